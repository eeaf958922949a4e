//! The `gemma3` architecture: embeddings scaled by sqrt(hidden), QK-norm, rotary embeddings
//! on half-split pairs with a separate base for sliding-window layers, extra norms after
//! attention and after the feed-forward, and a GELU(tanh)-gated feed-forward. Sliding-window
//! layers are a separate KV layer group (see `Config::layer_windows`), so they only keep the
//! blocks inside their window.

use super::attention::{paged_attention, rotate_and_store, tiles_into, AttnParams};
use super::ops::{
    add_assign, add_rms_norm_into, gelu_tanh_mul, inv_freq, output_logits_into, rms_norm,
    rms_norm_into, sized, Embedding, Linear,
};
use super::{ArchSpec, Architecture, Config, Projections, TensorLoader, Workspace};
use crate::batch::Batch;
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
use crate::kv::KvCache;

/// Every sixth layer attends globally, the others through a sliding window.
const SWA_PATTERN: usize = 6;
const DEFAULT_WINDOW: u64 = 512;
/// Rope base of the sliding-window layers when the file does not give one.
const LOCAL_ROPE_BASE: f64 = 10_000.0;

pub const SPEC: ArchSpec = ArchSpec {
    name: "gemma3",
    configure,
    load: |cfg, l| Ok(Box::new(Gemma3::load(cfg, l)?)),
};

/// Sliding windows per layer and the local layers' rope base.
fn configure(g: &GgufFile, cfg: &mut Config) -> Result<()> {
    let window = g
        .get_u64(&cfg.key("attention.sliding_window"))
        .unwrap_or(DEFAULT_WINDOW);
    if window == 0 || window > 1 << 24 {
        return Err(EngineError::InvalidGguf(format!(
            "bad sliding_window {window}"
        )));
    }
    for (i, w) in cfg.layer_windows.iter_mut().enumerate() {
        if (i + 1) % SWA_PATTERN != 0 {
            *w = Some(window as usize);
        }
    }
    cfg.rope_base_local = g
        .get_f64(&cfg.key("rope.freq_base_swa"))
        .unwrap_or(LOCAL_ROPE_BASE) as f32;
    Ok(())
}

struct Layer {
    attn_norm: Vec<f32>,
    proj: Projections,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    post_attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    post_ffn_norm: Vec<f32>,
    local: bool,
}

pub struct Gemma3 {
    cfg: Config,
    embd: Embedding,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    output: std::sync::Arc<Linear>,
    inv_freq_global: Vec<f32>,
    inv_freq_local: Vec<f32>,
}

impl Gemma3 {
    pub(crate) fn load(cfg: &Config, l: &TensorLoader) -> Result<Self> {
        let d = cfg.n_embd;
        let hd = cfg.head_dim;
        let (embd, output) = l.embedding_and_output(cfg.n_vocab, d)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: l.vector(&n("attn_norm"), d)?,
                proj: l.projections(cfg, i)?,
                q_norm: l.vector(&n("attn_q_norm"), hd)?,
                k_norm: l.vector(&n("attn_k_norm"), hd)?,
                post_attn_norm: l.vector(&n("post_attention_norm"), d)?,
                ffn_norm: l.vector(&n("ffn_norm"), d)?,
                post_ffn_norm: l.vector(&n("post_ffw_norm"), d)?,
                local: cfg.layer_windows[i].is_some(),
            });
        }
        Ok(Gemma3 {
            cfg: cfg.clone(),
            embd,
            layers,
            norm: l.vector("output_norm.weight", d)?,
            output,
            inv_freq_global: inv_freq(cfg.n_rot, cfg.rope_base, None),
            inv_freq_local: inv_freq(cfg.n_rot, cfg.rope_base_local, None),
        })
    }
}

impl Architecture for Gemma3 {
    fn forward(&self, batch: &Batch, kv: &mut KvCache, ws: &mut Workspace) -> Result<()> {
        let c = &self.cfg;
        let n = batch.len();
        let d = c.n_embd;
        let hd = c.head_dim;
        self.embd.lookup_into(&batch.tokens, &mut ws.x)?;
        let scale = (d as f32).sqrt();
        for v in &mut ws.x {
            *v *= scale;
        }
        ws.rope.fill(&batch.pos, &self.inv_freq_global);
        ws.rope_local.fill(&batch.pos, &self.inv_freq_local);
        tiles_into(batch, &mut ws.tiles);
        let attn = AttnParams {
            n_head: c.n_head,
            n_kv_heads: c.n_head_kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
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
        } = ws;
        for (li, layer) in self.layers.iter().enumerate() {
            let rope = if layer.local {
                &*rope_local
            } else {
                &*rope_global
            };
            rms_norm_into(x, &layer.attn_norm, c.eps, h);
            layer.proj.qkv.forward_into(h, n, &mut [q, k, v], stacked)?;
            rms_norm(q, &layer.q_norm, c.eps);
            rms_norm(k, &layer.k_norm, c.eps);
            rotate_and_store(kv, li, batch, rope, true, &attn, q, k, v);
            paged_attention(kv, li, batch, tiles, q, &attn, attn_out);
            layer.proj.wo.forward_into(attn_out, n, o)?;
            rms_norm(o, &layer.post_attn_norm, c.eps);
            add_rms_norm_into(x, o, &layer.ffn_norm, c.eps, h);
            layer
                .proj
                .gate_up
                .forward_into(h, n, &mut [g, u], stacked)?;
            gelu_tanh_mul(g, u);
            layer.proj.down.forward_into(g, n, o)?;
            rms_norm(o, &layer.post_ffn_norm, c.eps);
            add_assign(x, o);
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
        )
    }
}
