//! The `gemma3` architecture: embeddings scaled by sqrt(hidden), QK-norm, rotary embeddings
//! on half-split pairs with a separate base for sliding-window layers, extra norms after
//! attention and after the feed-forward, and a GELU(tanh)-gated feed-forward. Sliding-window
//! layers are a separate KV layer group (see `Config::layer_windows`), so they only keep the
//! blocks inside their window.

use super::attention::{paged_attention, rotate_and_store, AttnParams};
use super::ops::{
    add_assign, gelu_tanh_mul, inv_freq, output_logits, rms_norm, Embedding, Linear, Rope,
};
use super::{Architecture, Config, Projections, TensorLoader};
use crate::batch::Batch;
use crate::error::Result;
use crate::kv::KvCache;

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
    fn forward(&self, batch: &Batch, kv: &mut KvCache) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let n = batch.len();
        let d = c.n_embd;
        let hd = c.head_dim;
        let mut x = self.embd.lookup(&batch.tokens)?;
        let scale = (d as f32).sqrt();
        for v in &mut x {
            *v *= scale;
        }
        let rope_global = Rope::new(&batch.pos, &self.inv_freq_global);
        let rope_local = Rope::new(&batch.pos, &self.inv_freq_local);
        let attn = AttnParams {
            n_head: c.n_head,
            n_kv_heads: c.n_head_kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let q_dim = c.n_head * hd;
        let mut attn_out = vec![0f32; n * q_dim];
        for (li, layer) in self.layers.iter().enumerate() {
            let rope = if layer.local {
                &rope_local
            } else {
                &rope_global
            };
            let mut h = x.clone();
            rms_norm(&mut h, &layer.attn_norm, c.eps);
            let mut qkv = layer.proj.qkv.forward(&h, n)?.into_iter();
            let (mut q, mut k, v) = match (qkv.next(), qkv.next(), qkv.next()) {
                (Some(q), Some(k), Some(v)) => (q, k, v),
                _ => unreachable!("three projections"),
            };
            rms_norm(&mut q, &layer.q_norm, c.eps);
            rms_norm(&mut k, &layer.k_norm, c.eps);
            rotate_and_store(kv, li, batch, rope, true, &attn, &mut q, &mut k, &v);
            paged_attention(kv, li, batch, &q, &attn, &mut attn_out);
            let mut o = layer.proj.wo.forward(&attn_out, n)?;
            rms_norm(&mut o, &layer.post_attn_norm, c.eps);
            add_assign(&mut x, &o);

            let mut h = x.clone();
            rms_norm(&mut h, &layer.ffn_norm, c.eps);
            let mut gu = layer.proj.gate_up.forward(&h, n)?.into_iter();
            let (mut g, u) = match (gu.next(), gu.next()) {
                (Some(g), Some(u)) => (g, u),
                _ => unreachable!("two projections"),
            };
            gelu_tanh_mul(&mut g, &u);
            let mut down = layer.proj.down.forward(&g, n)?;
            rms_norm(&mut down, &layer.post_ffn_norm, c.eps);
            add_assign(&mut x, &down);
        }
        output_logits(&x, d, &batch.logits, &self.norm, c.eps, &self.output)
    }
}
