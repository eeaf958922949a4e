//! The decoder-only transformer families, as one forward pass with per-family switches.
//!
//! Every family here is the same block — RMSNorm, grouped-query attention with rotary
//! embeddings over the paged KV cache, a gated feed-forward — and differs only in details
//! that llama.cpp's per-architecture graphs spell out:
//!
//! | family   | rope pairs | Q/K norm | post-norms | embedding × √d | FFN act | soft-caps | sliding window |
//! |----------|------------|----------|------------|----------------|---------|-----------|----------------|
//! | `llama`  | adjacent   |          |            |                | SiLU    |           |                |
//! | `qwen2`  | half-split |          |            |                | SiLU    |           |                |
//! | `qwen3`  | half-split | yes      |            |                | SiLU    |           |                |
//! | `phi3`   | half-split |          |            |                | SiLU    |           |                |
//! | `gemma2` | half-split |          | yes        | yes            | GELU    | yes       | every 2nd layer global |
//! | `gemma3` | half-split | yes      | yes        | yes            | GELU    |           | every 6th layer global |
//!
//! Optional tensors are taken whenever a file has them, as llama.cpp does: Q/K/V and output
//! biases (`qwen2`, some `llama` fine-tunes), a fused `attn_qkv` (`phi3`), a fused gate+up
//! `ffn_up` without `ffn_gate` (`phi3`), `rope_freqs` (Llama 3.x), an output-head bias. A
//! tensor of the file that none of this reads is an error: a model that would silently run
//! without part of its weights would generate garbage.

use super::attention::{paged_attention, rotate_and_store, tiles_into, AttnParams};
use super::linear::{Embedding, Linear};
use super::ops::{
    add_assign, add_rms_norm_into, gelu_tanh_mul, inv_freq, output_logits_into, output_rows_into,
    rms_norm, rms_norm_into, silu_mul, sized,
};
use super::{ArchSpec, Architecture, Config, Projections, TensorLoader, Workspace};
use crate::batch::Batch;
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
use crate::kernels::weights::Pinnable;
use crate::kv::KvCache;
use crate::profile::{Clock, Section};
use std::sync::Arc;

/// The feed-forward gate's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU with the tanh approximation (ggml's `gelu`).
    GeluTanh,
}

/// Sliding-window attention on some layers: layer `i` is local unless
/// `i % pattern == pattern - 1` (llama.cpp's `set_swa_pattern`), unless the file lists the
/// local layers itself.
#[derive(Debug, Clone, Copy)]
pub struct SlidingWindow {
    pub pattern: u64,
    pub default_window: u64,
    /// Rope base of local layers when the file gives none (`None`: the global base).
    pub default_local_base: Option<f64>,
    /// Read `attention.logit_softcapping` / `final_logit_softcapping` (Gemma 2).
    pub softcaps: bool,
}

/// What distinguishes one family's block from another's.
#[derive(Debug)]
pub struct Family {
    /// Rotary pairs `(i, i + n_rot/2)` (llama.cpp's NEOX type) instead of adjacent elements.
    pub neox: bool,
    pub qk_norm: bool,
    /// Norms after attention and after the feed-forward, before each residual add.
    pub post_norms: bool,
    pub embed_scale: bool,
    pub act: Activation,
    pub swa: Option<SlidingWindow>,
    /// Causal attention over the cache (every generator). `false`: an embedding model
    /// (EmbeddingGemma) whose tokens attend to the whole of their sequence, within a symmetric
    /// window on sliding-window layers, and which has no generation output.
    pub causal: bool,
}

const fn spec(name: &'static str, family: &'static Family) -> ArchSpec {
    ArchSpec {
        name,
        family: Some(family),
        configure,
        load: |cfg, l| Ok(Box::new(Decoder::load(cfg, l)?)),
    }
}

const PLAIN: Family = Family {
    neox: false,
    qk_norm: false,
    post_norms: false,
    embed_scale: false,
    act: Activation::Silu,
    swa: None,
    causal: true,
};
const NEOX: Family = Family {
    neox: true,
    ..PLAIN
};

pub const LLAMA: ArchSpec = spec("llama", &PLAIN);
pub const QWEN2: ArchSpec = spec("qwen2", &NEOX);
pub const QWEN3: ArchSpec = spec(
    "qwen3",
    &Family {
        qk_norm: true,
        ..NEOX
    },
);
pub const PHI3: ArchSpec = spec("phi3", &NEOX);
pub const GEMMA2: ArchSpec = spec(
    "gemma2",
    &Family {
        neox: true,
        qk_norm: false,
        post_norms: true,
        embed_scale: true,
        act: Activation::GeluTanh,
        swa: Some(SlidingWindow {
            pattern: 2,
            default_window: 4096,
            default_local_base: None,
            softcaps: true,
        }),
        causal: true,
    },
);
const GEMMA3_FAMILY: Family = Family {
    neox: true,
    qk_norm: true,
    post_norms: true,
    embed_scale: true,
    act: Activation::GeluTanh,
    swa: Some(SlidingWindow {
        pattern: 6,
        default_window: 512,
        default_local_base: Some(10_000.0),
        softcaps: false,
    }),
    causal: true,
};
pub const GEMMA3: ArchSpec = spec("gemma3", &GEMMA3_FAMILY);
/// EmbeddingGemma (llama.cpp's `gemma-embedding`): Gemma 3's block with bidirectional
/// attention (symmetric windows on local layers), pooled, then sentence-transformers' dense
/// projections `dense_2` / `dense_3` when the file has them.
pub const GEMMA_EMBEDDING: ArchSpec = spec(
    "gemma-embedding",
    &Family {
        causal: false,
        ..GEMMA3_FAMILY
    },
);

/// The family's own hyper-parameters, after the common ones.
fn configure(g: &GgufFile, cfg: &mut Config) -> Result<()> {
    let family = super::arch_spec(&cfg.arch)
        .and_then(|s| s.family)
        .ok_or_else(|| EngineError::UnsupportedArchitecture(cfg.arch.clone()))?;
    if g.get_u64(&cfg.key("expert_count")).unwrap_or(0) > 0 {
        return Err(EngineError::Unsupported(format!(
            "mixture of experts ({}.expert_count)",
            cfg.arch
        )));
    }
    let Some(swa) = family.swa else {
        // llama.cpp runs `llama` (Mistral included) and `phi3` with full attention even when
        // the metadata names a sliding window; so does the engine, to give the same results.
        return Ok(());
    };
    let window = g
        .get_u64(&cfg.key("attention.sliding_window"))
        .unwrap_or(swa.default_window);
    if window == 0 || window > 1 << 24 {
        return Err(EngineError::InvalidGguf(format!(
            "bad sliding_window {window}"
        )));
    }
    let pattern_key = cfg.key("attention.sliding_window_pattern");
    let local: Vec<bool> = match g.get(&pattern_key) {
        Some(v) if v.is_array() => {
            let flags = v
                .as_array()
                .and_then(|a| a.iter().map(|b| b.as_bool()).collect::<Option<Vec<bool>>>())
                .ok_or_else(|| {
                    EngineError::InvalidGguf(format!("{pattern_key} is not an array of booleans"))
                })?;
            if flags.len() != cfg.n_layer {
                return Err(EngineError::InvalidGguf(format!(
                    "{pattern_key} has {} entries for {} layers",
                    flags.len(),
                    cfg.n_layer
                )));
            }
            flags
        }
        _ => {
            let pattern = g.get_u64(&pattern_key).unwrap_or(swa.pattern);
            if pattern == 0 || pattern > 1 << 16 {
                return Err(EngineError::InvalidGguf(format!(
                    "bad {pattern_key} {pattern}"
                )));
            }
            (0..cfg.n_layer as u64)
                .map(|i| i % pattern < pattern - 1)
                .collect()
        }
    };
    for (w, local) in cfg.layer_windows.iter_mut().zip(local) {
        *w = local.then_some(window as usize);
    }
    cfg.rope_base_local = g
        .get_f64(&cfg.key("rope.freq_base_swa"))
        .or(swa.default_local_base)
        .unwrap_or(cfg.rope_base as f64) as f32;
    if swa.softcaps {
        let arch = cfg.arch.clone();
        let cap = |k: &str| -> Result<Option<f32>> {
            match g.get_f64(&format!("{arch}.{k}")) {
                None => Ok(None),
                Some(c) if c.is_finite() && c > 0.0 => Ok(Some(c as f32)),
                Some(c) => Err(EngineError::InvalidGguf(format!("bad {k} {c}"))),
            }
        };
        cfg.attn_softcap = cap("attn_logit_softcapping")?;
        cfg.final_softcap = cap("final_logit_softcapping")?;
    }
    if cfg.arch == "gemma2" && cfg.n_layer == 46 {
        // Gemma 2 27B scales queries by 1/√(n_embd / n_head) rather than 1/√head_dim
        // (gemma_pytorch's `query_pre_attn_scalar`; llama.cpp keys it on the layer count)
        cfg.attn_scale = 1.0 / ((cfg.n_embd / cfg.n_head) as f32).sqrt();
    }
    Ok(())
}

/// Biases of the Q, K and V products.
struct QkvBias {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

struct Layer {
    attn_norm: Vec<f32>,
    proj: Projections,
    qkv_bias: Option<QkvBias>,
    wo_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    post_attn_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    post_ffn_norm: Option<Vec<f32>>,
    local: bool,
}

pub struct Decoder {
    cfg: Config,
    family: &'static Family,
    embd: Embedding,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    output: Arc<Linear>,
    output_bias: Option<Vec<f32>>,
    heads: PooledHeads,
    inv_freq_global: Vec<f32>,
    inv_freq_local: Vec<f32>,
    /// Phi-3 LongRoPE: the frequencies for contexts beyond `n_ctx_orig` (the short factor set
    /// is in `inv_freq_global`).
    inv_freq_long: Option<Vec<f32>>,
}

impl Decoder {
    pub(crate) fn load(cfg: &Config, l: &TensorLoader) -> Result<Self> {
        let family = super::arch_spec(&cfg.arch)
            .and_then(|s| s.family)
            .ok_or_else(|| EngineError::UnsupportedArchitecture(cfg.arch.clone()))?;
        let d = cfg.n_embd;
        let hd = cfg.head_dim;
        let (q_dim, kv_dim) = (cfg.n_head * hd, cfg.n_head_kv * hd);
        let (embd, output) = l.embedding_and_output(cfg.n_vocab, d)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let norm = |s: &str, len| l.vector(&n(s), len);
            let optional = |s: &str, len| l.optional_vector(&n(s), len);
            let qkv_bias = if let Some(b) = optional("attn_qkv.bias", q_dim + 2 * kv_dim)? {
                Some(QkvBias {
                    q: b[..q_dim].to_vec(),
                    k: b[q_dim..q_dim + kv_dim].to_vec(),
                    v: b[q_dim + kv_dim..].to_vec(),
                })
            } else {
                match (
                    optional("attn_q.bias", q_dim)?,
                    optional("attn_k.bias", kv_dim)?,
                    optional("attn_v.bias", kv_dim)?,
                ) {
                    (Some(q), Some(k), Some(v)) => Some(QkvBias { q, k, v }),
                    (None, None, None) => None,
                    _ => {
                        return Err(EngineError::Unsupported(format!(
                            "bias layout in block {i}: some but not all of attn_q/k/v.bias"
                        )))
                    }
                }
            };
            let qk = family.qk_norm;
            let post = family.post_norms;
            layers.push(Layer {
                attn_norm: norm("attn_norm.weight", d)?,
                proj: l.projections(cfg, i)?,
                qkv_bias,
                wo_bias: optional("attn_output.bias", d)?,
                q_norm: qk.then(|| norm("attn_q_norm.weight", hd)).transpose()?,
                k_norm: qk.then(|| norm("attn_k_norm.weight", hd)).transpose()?,
                post_attn_norm: post
                    .then(|| norm("post_attention_norm.weight", d))
                    .transpose()?,
                ffn_norm: norm("ffn_norm.weight", d)?,
                post_ffn_norm: post.then(|| norm("post_ffw_norm.weight", d)).transpose()?,
                local: cfg.layer_windows[i].is_some(),
            });
        }
        let freqs = rope_freqs(cfg, l)?;
        let mut model = Decoder {
            cfg: cfg.clone(),
            family,
            embd,
            layers,
            norm: l.vector("output_norm.weight", d)?,
            output,
            output_bias: l.optional_vector("output.bias", cfg.n_vocab)?,
            heads: PooledHeads::load(l, d)?,
            inv_freq_global: freqs.global,
            inv_freq_local: freqs.local,
            inv_freq_long: freqs.long,
        };
        l.check_all_used()?;
        model.pin_weights();
        Ok(model)
    }

    /// Moves every product's weights into one huge-page region ([`crate::kernels::weights`];
    /// a tied head was pinned on its own when it was built).
    fn pin_weights(&mut self) {
        let mut matrices: Vec<&mut dyn Pinnable> = Vec::new();
        for layer in &mut self.layers {
            let p = &mut layer.proj;
            let fused = p.qkv.packed_mut().into_iter().chain(p.gate_up.packed_mut());
            let single = [p.wo.packed_mut(), p.down.packed_mut()]
                .into_iter()
                .flatten();
            matrices.extend(fused.chain(single).map(|m| m as &mut dyn Pinnable));
        }
        let heads = Arc::get_mut(&mut self.output)
            .into_iter()
            .chain(self.heads.cls_out.as_mut())
            .chain(self.heads.dense.iter_mut())
            .filter_map(|w| w.packed_mut());
        matrices.extend(heads.map(|m| m as &mut dyn Pinnable));
        crate::kernels::weights::pin(&mut matrices);
    }
}

/// Rotary frequencies of global and local layers, and Phi-3 LongRoPE's long set (its short
/// set is the global one).
pub(super) fn rope_freqs(cfg: &Config, l: &TensorLoader) -> Result<RopeFreqs> {
    // Llama 3.x: per-dimension frequency factors (one tensor shared by every layer);
    // Phi-3 LongRoPE: a short and a long set, chosen by the context size
    let long = l.optional_vector("rope_factors_long.weight", cfg.n_rot / 2)?;
    let factors = match &long {
        Some(_) => Some(l.vector("rope_factors_short.weight", cfg.n_rot / 2)?),
        None => l.optional_vector("rope_freqs.weight", cfg.n_rot / 2)?,
    };
    let freqs_with = |base, factors: Option<&[f32]>| {
        let mut f = inv_freq(cfg.n_rot, base, factors);
        for x in &mut f {
            *x *= cfg.rope_freq_scale;
        }
        f
    };
    let freqs = |base| freqs_with(base, factors.as_deref());
    Ok(RopeFreqs {
        global: freqs(cfg.rope_base),
        local: freqs(cfg.rope_base_local),
        long: long.as_deref().map(|f| freqs_with(cfg.rope_base, Some(f))),
    })
}

/// Rotary frequencies of global and local layers, and LongRoPE's long set.
pub(super) struct RopeFreqs {
    pub global: Vec<f32>,
    pub local: Vec<f32>,
    pub long: Option<Vec<f32>>,
}

/// What runs on pooled vectors, on the host whichever backend ran the pass: a reranker's
/// head and sentence-transformers' projections.
pub(super) struct PooledHeads {
    /// A reranker's head (`cls.output`: one row per `classifier.output_labels` entry; Qwen3
    /// rerankers have yes/no rows of the vocabulary head, turned into a softmax).
    cls_out: Option<Linear>,
    /// sentence-transformers' projections after pooling (EmbeddingGemma's `dense_2`, then
    /// `dense_3`), as llama.cpp's `build_dense_out`.
    dense: Vec<Linear>,
}

impl PooledHeads {
    pub(super) fn load(l: &TensorLoader, d: usize) -> Result<Self> {
        let cls_out = match l.gguf.tensor_info("cls.output.weight") {
            Ok(info) => Some(Linear::new(l.matrix(
                "cls.output.weight",
                info.shape[0],
                d,
            )?)?),
            Err(_) => None,
        };
        let mut dense = Vec::new();
        // `dense_2` (`n_embd` → its width) and `dense_3` (back to `n_embd`), when present
        for (name, into) in [("dense_2.weight", false), ("dense_3.weight", true)] {
            let Ok(info) = l.gguf.tensor_info(name) else {
                continue;
            };
            let [rows, cols] = info.shape[..] else {
                return Err(EngineError::InvalidGguf(format!("{name} is not a matrix")));
            };
            // dense_2 reads n_embd values, dense_3 writes n_embd (llama.cpp asserts the same)
            if (into && rows != d) || (!into && cols != d) {
                return Err(EngineError::InvalidGguf(format!(
                    "{name} has shape [{rows}, {cols}], which does not fit n_embd {d}"
                )));
            }
            dense.push(Linear::new(l.matrix(name, rows, cols)?)?);
        }
        Ok(PooledHeads { cls_out, dense })
    }

    pub(super) fn project(&self, v: &mut Vec<f32>) -> Result<()> {
        let mut next = Vec::new();
        for p in &self.dense {
            p.forward_into(v, 1, &mut next)?;
            std::mem::swap(v, &mut next);
        }
        Ok(())
    }

    /// A reranker's scores: the classification head over the pooled state (a softmax over
    /// the labels for Qwen3, as llama.cpp's reranker).
    pub(super) fn classify(&self, arch: &str, pooled: &[f32]) -> Result<Vec<f32>> {
        let head = self.cls_out.as_ref().ok_or_else(|| {
            EngineError::Unsupported(
                "pooling rank: the model has no classification head (cls.output)".into(),
            )
        })?;
        let mut out = Vec::new();
        head.forward_into(pooled, 1, &mut out)?;
        if arch == "qwen3" {
            let max = out.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = out.iter().map(|v| (v - max).exp()).sum();
            out.iter_mut().for_each(|v| *v = (*v - max).exp() / sum);
        }
        Ok(out)
    }
}

/// An embedding model's pass may not ask for logits: it has no generation output.
pub(super) fn refuse_generation(
    family: &Family,
    arch: &str,
    hidden_only: bool,
    batch: &Batch,
) -> Result<()> {
    if !family.causal && !hidden_only && batch.logits.iter().any(|&l| l) {
        return Err(EngineError::Unsupported(format!(
            "generation with {arch} (an embedding model): use embed"
        )));
    }
    Ok(())
}

fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// `cap · tanh(x / cap)`.
fn soft_cap(x: &mut [f32], cap: f32) {
    for v in x {
        *v = cap * (*v / cap).tanh();
    }
}

impl Architecture for Decoder {
    fn causal(&self) -> bool {
        self.family.causal
    }

    fn project_pooled(&self, v: &mut Vec<f32>) -> Result<()> {
        self.heads.project(v)
    }

    fn classify(&self, pooled: &[f32]) -> Result<Vec<f32>> {
        self.heads.classify(&self.cfg.arch, pooled)
    }

    fn forward(&self, batch: &Batch, kv: &mut KvCache, ws: &mut Workspace) -> Result<()> {
        let c = &self.cfg;
        let f = self.family;
        refuse_generation(f, &c.arch, ws.hidden_only, batch)?;
        let mut clock = Clock::start();
        let n = batch.len();
        let d = c.n_embd;
        let hd = c.head_dim;
        self.embd.lookup_into(&batch.tokens, &mut ws.x)?;
        if f.embed_scale {
            let scale = (d as f32).sqrt();
            for v in &mut ws.x {
                *v *= scale;
            }
        }
        let global = match &self.inv_freq_long {
            Some(long) if ws.n_ctx_seq > c.n_ctx_orig => long,
            _ => &self.inv_freq_global,
        };
        ws.rope.fill(&batch.pos, global, c.rope_attn_factor);
        if f.swa.is_some() {
            ws.rope_local
                .fill(&batch.pos, &self.inv_freq_local, c.rope_attn_factor);
        }
        tiles_into(batch, &mut ws.tiles);
        let attn = AttnParams {
            n_head: c.n_head,
            n_kv_heads: c.n_head_kv,
            head_dim: hd,
            scale: c.attn_scale,
            softcap: c.attn_softcap,
            causal: f.causal,
        };
        sized(&mut ws.attn, n * c.n_head * hd);
        let Workspace {
            x,
            h,
            q,
            k,
            v,
            attn: attn_out,
            o,
            g,
            u,
            stacked,
            rope: rope_global,
            rope_local,
            tiles,
            logits,
            hidden_only,
            hidden,
            n_ctx_seq: _,
            device_kv: _,
            device_copies: _,
            pick_rows: _,
            picked: _,
            candidates: _,
        } = ws;
        clock.lap(Section::Inputs);
        for (li, layer) in self.layers.iter().enumerate() {
            let rope = if layer.local {
                &*rope_local
            } else {
                &*rope_global
            };
            rms_norm_into(x, &layer.attn_norm, c.eps, h);
            clock.lap(Section::Norms);
            layer.proj.qkv.forward_into(h, n, &mut [q, k, v], stacked)?;
            clock.lap(Section::Qkv);
            if let Some(b) = &layer.qkv_bias {
                add_bias(q, &b.q);
                add_bias(k, &b.k);
                add_bias(v, &b.v);
            }
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                rms_norm(q, qn, c.eps);
                rms_norm(k, kn, c.eps);
            }
            clock.lap(Section::Norms);
            rotate_and_store(kv, li, batch, rope, f.neox, &attn, q, k, v);
            clock.lap(Section::RopeKvWrite);
            paged_attention(kv, li, batch, tiles, q, &attn, attn_out);
            clock.lap(Section::Attention);
            layer.proj.wo.forward_into(attn_out, n, o)?;
            clock.lap(Section::Wo);
            if let Some(b) = &layer.wo_bias {
                add_bias(o, b);
            }
            if let Some(w) = &layer.post_attn_norm {
                rms_norm(o, w, c.eps);
            }
            add_rms_norm_into(x, o, &layer.ffn_norm, c.eps, h);
            clock.lap(Section::Norms);
            let act = match f.act {
                Activation::Silu => silu_mul,
                Activation::GeluTanh => gelu_tanh_mul,
            };
            layer.proj.gate_up.forward_gated(h, n, g, u, stacked, act)?;
            clock.lap(Section::GateUp);
            layer.proj.down.forward_into(g, n, o)?;
            clock.lap(Section::Down);
            if let Some(w) = &layer.post_ffn_norm {
                rms_norm(o, w, c.eps);
            }
            add_assign(x, o);
            clock.lap(Section::Norms);
        }
        if *hidden_only {
            // embeddings: the final-normed hidden states, as llama.cpp's `t_embd`
            output_rows_into(x, d, &batch.logits, &self.norm, c.eps, hidden);
            clock.lap(Section::Head);
            return Ok(());
        }
        // embedding rows riding in a generation pass keep their hidden state, no logits
        if batch.has_embd() {
            output_rows_into(x, d, &batch.embd, &self.norm, c.eps, hidden);
        } else {
            hidden.clear();
        }
        output_logits_into(
            x,
            d,
            &batch.logits,
            &self.norm,
            c.eps,
            &self.output,
            h,
            logits,
        )?;
        if let Some(b) = &self.output_bias {
            add_bias(logits, b);
        }
        if let Some(cap) = c.final_softcap {
            soft_cap(logits, cap);
        }
        clock.lap(Section::Head);
        Ok(())
    }
}
