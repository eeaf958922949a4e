//! BERT-family encoders (all-MiniLM, bge, e5, ...), llama.cpp's `bert` architecture:
//! absolute position and token-type embeddings, post-layer-norm blocks with biases, GELU, and
//! bidirectional attention inside each sequence of the batch. An encoder has no KV cache to
//! fill and no logits: it runs in the context's embeddings mode, leaving each flagged token's
//! hidden state for pooling, so `embed`/`embed_batch` and their many-texts-per-pass batching
//! are the same code for encoders and decoders.

use super::linear::Linear;
use super::ops::{add_assign, sized};
use super::{ArchSpec, Architecture, Config, TensorLoader, Workspace};
use crate::batch::Batch;
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
use crate::kv::KvCache;

pub const BERT: ArchSpec = ArchSpec {
    name: "bert",
    family: None,
    configure,
    load: |cfg, l| Ok(Box::new(Bert::load(cfg, l)?)),
};

fn configure(g: &GgufFile, cfg: &mut Config) -> Result<()> {
    // layer norms, not RMS norms: their own epsilon key
    cfg.eps = g
        .get_f64(&cfg.key("attention.layer_norm_epsilon"))
        .unwrap_or(1e-12) as f32;
    if g.get_bool(&cfg.key("attention.causal")) == Some(true) {
        return Err(EngineError::Unsupported(
            "bert with causal attention (bert.attention.causal)".into(),
        ));
    }
    Ok(())
}

/// A weight matrix with its bias.
struct Dense {
    w: Linear,
    b: Vec<f32>,
}

impl Dense {
    fn load(l: &TensorLoader, name: &str, rows: usize, cols: usize) -> Result<Self> {
        Ok(Dense {
            w: Linear::new(l.matrix(&format!("{name}.weight"), rows, cols)?)?,
            b: l.vector(&format!("{name}.bias"), rows)?,
        })
    }

    fn forward(&self, x: &[f32], n: usize, out: &mut Vec<f32>) -> Result<()> {
        self.w.forward_into(x, n, out)?;
        for row in out.chunks_exact_mut(self.b.len()) {
            add_assign(row, &self.b);
        }
        Ok(())
    }
}

struct Norm {
    w: Vec<f32>,
    b: Vec<f32>,
}

impl Norm {
    fn load(l: &TensorLoader, name: &str, d: usize) -> Result<Self> {
        Ok(Norm {
            w: l.vector(&format!("{name}.weight"), d)?,
            b: l.vector(&format!("{name}.bias"), d)?,
        })
    }

    fn apply(&self, x: &mut [f32], eps: f32) {
        let d = self.w.len();
        for row in x.chunks_exact_mut(d) {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
            let var = row
                .iter()
                .map(|&v| (v as f64 - mean) * (v as f64 - mean))
                .sum::<f64>()
                / d as f64;
            let inv = 1.0 / (var + eps as f64).sqrt();
            for ((v, w), b) in row.iter_mut().zip(&self.w).zip(&self.b) {
                *v = ((*v as f64 - mean) * inv) as f32 * w + b;
            }
        }
    }
}

struct Layer {
    q: Dense,
    k: Dense,
    v: Dense,
    o: Dense,
    attn_norm: Norm,
    up: Dense,
    down: Dense,
    out_norm: Norm,
}

pub struct Bert {
    cfg: Config,
    tokens: Vec<f32>,
    positions: Vec<f32>,
    /// Token type 0's embedding (every input is one segment).
    token_type: Vec<f32>,
    embd_norm: Norm,
    layers: Vec<Layer>,
    /// A cross-encoder's head: `cls` (dense + tanh, BERT's pooler) then `cls.output`.
    cls: Option<Dense>,
    cls_out: Option<Dense>,
}

impl Bert {
    fn load(cfg: &Config, l: &TensorLoader) -> Result<Self> {
        let d = cfg.n_embd;
        let table = |name: &str, rows: usize| -> Result<Vec<f32>> {
            let t = l.matrix(name, rows, d)?;
            let v = t
                .dequantize(&candle_core::Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            Ok(v)
        };
        let n_pos = l
            .gguf
            .tensor_info("position_embd.weight")?
            .shape
            .first()
            .copied()
            .unwrap_or(0);
        let types = l
            .gguf
            .tensor_info("token_types.weight")?
            .shape
            .first()
            .copied()
            .unwrap_or(0);
        let mut token_type = table("token_types.weight", types)?;
        token_type.truncate(d);
        let mut layers = Vec::with_capacity(cfg.n_layer);
        let (ff, qd) = (cfg.n_ff, cfg.n_head * cfg.head_dim);
        for i in 0..cfg.n_layer {
            let b = |n: &str| format!("blk.{i}.{n}");
            layers.push(Layer {
                q: Dense::load(l, &b("attn_q"), qd, d)?,
                k: Dense::load(l, &b("attn_k"), qd, d)?,
                v: Dense::load(l, &b("attn_v"), qd, d)?,
                o: Dense::load(l, &b("attn_output"), d, qd)?,
                attn_norm: Norm::load(l, &b("attn_output_norm"), d)?,
                up: Dense::load(l, &b("ffn_up"), ff, d)?,
                down: Dense::load(l, &b("ffn_down"), d, ff)?,
                out_norm: Norm::load(l, &b("layer_output_norm"), d)?,
            });
        }
        let model = Bert {
            cfg: cfg.clone(),
            tokens: table("token_embd.weight", cfg.n_vocab)?,
            positions: table("position_embd.weight", n_pos)?,
            token_type,
            embd_norm: Norm::load(l, "token_embd_norm", d)?,
            layers,
            cls: if l.gguf.has_tensor("cls.weight") {
                Some(Dense::load(l, "cls", d, d)?)
            } else {
                None
            },
            cls_out: match l.gguf.tensor_info("cls.output.weight") {
                Ok(info) => Some(Dense::load(l, "cls.output", info.shape[0], d)?),
                Err(_) => None,
            },
        };
        l.check_all_used()?;
        Ok(model)
    }
}

/// `erf` (Numerical Recipes' `erfc` Chebyshev fit, relative error below 1.2e-7).
fn erf(x: f32) -> f32 {
    let z = (x as f64).abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let e = 1.0 - t * poly.exp();
    (if x >= 0.0 { e } else { -e }) as f32
}

/// BERT's GELU (exact, erf-based, as transformers' `gelu`).
fn gelu(x: &mut [f32]) {
    for v in x {
        *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2));
    }
}

impl Architecture for Bert {
    fn causal(&self) -> bool {
        false
    }

    fn classify(&self, pooled: &[f32]) -> Result<Vec<f32>> {
        if self.cls.is_none() && self.cls_out.is_none() {
            return Err(EngineError::Unsupported(
                "pooling rank: this bert has no classification head (cls, cls.output)".into(),
            ));
        }
        let mut x = pooled.to_vec();
        let mut y = Vec::new();
        if let Some(cls) = &self.cls {
            cls.forward(&x, 1, &mut y)?;
            y.iter_mut().for_each(|v| *v = v.tanh());
            std::mem::swap(&mut x, &mut y);
        }
        if let Some(out) = &self.cls_out {
            out.forward(&x, 1, &mut y)?;
            std::mem::swap(&mut x, &mut y);
        }
        Ok(x)
    }

    fn forward(&self, batch: &Batch, _kv: &mut KvCache, ws: &mut Workspace) -> Result<()> {
        // an encoder has hidden states only: embeddings mode, or embedding rows
        if !ws.hidden_only && batch.logits.iter().any(|&l| l) {
            return Err(EngineError::Unsupported(
                "generation with an encoder (bert has no output head): use embed".into(),
            ));
        }
        let c = &self.cfg;
        let (n, d, hd, nh) = (batch.len(), c.n_embd, c.head_dim, c.n_head);
        let n_pos = self.positions.len() / d;
        let x = sized(&mut ws.x, n * d);
        for (t, (&tok, &pos)) in batch.tokens.iter().zip(&batch.pos).enumerate() {
            if pos >= n_pos {
                return Err(EngineError::InvalidArgument(format!(
                    "position {pos} is past bert's {n_pos} position embeddings"
                )));
            }
            let row = &mut x[t * d..(t + 1) * d];
            row.copy_from_slice(&self.tokens[tok as usize * d..(tok as usize + 1) * d]);
            add_assign(row, &self.positions[pos * d..(pos + 1) * d]);
            add_assign(row, &self.token_type);
        }
        self.embd_norm.apply(x, c.eps);

        // tokens of each sequence, in batch order
        let mut seqs: Vec<(usize, Vec<usize>)> = Vec::new();
        for (t, &s) in batch.seq.iter().enumerate() {
            match seqs.iter_mut().find(|(id, _)| *id == s) {
                Some((_, ts)) => ts.push(t),
                None => seqs.push((s, vec![t])),
            }
        }
        let scale = c.attn_scale;
        let ws_hidden_only = ws.hidden_only;
        let Workspace {
            x,
            q,
            k,
            v,
            attn,
            o,
            u,
            hidden,
            ..
        } = ws;
        let mut scores: Vec<f32> = Vec::new();
        for layer in &self.layers {
            layer.q.forward(x, n, q)?;
            layer.k.forward(x, n, k)?;
            layer.v.forward(x, n, v)?;
            let a = sized(attn, n * nh * hd);
            a.fill(0.0);
            for (_, ts) in &seqs {
                for h in 0..nh {
                    for &i in ts {
                        let qi = &q[i * nh * hd + h * hd..][..hd];
                        scores.clear();
                        let mut max = f32::NEG_INFINITY;
                        for &j in ts {
                            let kj = &k[j * nh * hd + h * hd..][..hd];
                            let s = qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale;
                            max = max.max(s);
                            scores.push(s);
                        }
                        let mut sum = 0f32;
                        for s in &mut scores {
                            *s = (*s - max).exp();
                            sum += *s;
                        }
                        let out = &mut a[i * nh * hd + h * hd..][..hd];
                        for (&j, &p) in ts.iter().zip(&scores) {
                            let vj = &v[j * nh * hd + h * hd..][..hd];
                            for (o, vv) in out.iter_mut().zip(vj) {
                                *o += p / sum * vv;
                            }
                        }
                    }
                }
            }
            layer.o.forward(a, n, o)?;
            add_assign(o, x);
            layer.attn_norm.apply(o, c.eps);
            std::mem::swap(x, o);
            layer.up.forward(x, n, u)?;
            gelu(u);
            layer.down.forward(u, n, o)?;
            add_assign(o, x);
            layer.out_norm.apply(o, c.eps);
            std::mem::swap(x, o);
        }
        hidden.clear();
        let wanted = if ws_hidden_only {
            &batch.logits
        } else {
            &batch.embd
        };
        for (t, _) in wanted.iter().enumerate().filter(|(_, &w)| w) {
            hidden.extend_from_slice(&x[t * d..(t + 1) * d]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn erf_is_accurate() {
        // erf(0.5), erf(1), erf(2), erf(-1)
        for (x, want) in [
            (0.5f32, 0.520_499_9f32),
            (1.0, 0.842_700_8),
            (2.0, 0.995_322_3),
            (-1.0, -0.842_700_8),
        ] {
            assert!((super::erf(x) - want).abs() < 1e-6, "erf({x})");
        }
    }
}
