//! The `llama` architecture (Llama 2/3, Mistral, SmolLM2): RMSNorm, rotary embeddings on
//! adjacent pairs, grouped-query attention, SwiGLU feed-forward.

use super::attention::{paged_attention, rotate_and_store, AttnParams};
use super::ops::{
    add_assign, inv_freq, output_logits, rms_norm, silu_mul, Embedding, Linear, Rope,
};
use super::{Architecture, Config, Projections, TensorLoader};
use crate::batch::Batch;
use crate::error::Result;
use crate::kv::KvCache;

struct Layer {
    attn_norm: Vec<f32>,
    proj: Projections,
    ffn_norm: Vec<f32>,
}

pub struct Llama {
    cfg: Config,
    embd: Embedding,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    output: std::sync::Arc<Linear>,
    inv_freq: Vec<f32>,
}

impl Llama {
    pub(crate) fn load(cfg: &Config, l: &TensorLoader) -> Result<Self> {
        let d = cfg.n_embd;
        let (embd, output) = l.embedding_and_output(cfg.n_vocab, d)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: l.vector(&n("attn_norm"), d)?,
                proj: l.projections(cfg, i)?,
                ffn_norm: l.vector(&n("ffn_norm"), d)?,
            });
        }
        let factors = if l.gguf.has_tensor("rope_freqs.weight") {
            Some(l.vector("rope_freqs.weight", cfg.n_rot / 2)?)
        } else {
            None
        };
        Ok(Llama {
            cfg: cfg.clone(),
            embd,
            layers,
            norm: l.vector("output_norm.weight", d)?,
            output,
            inv_freq: inv_freq(cfg.n_rot, cfg.rope_base, factors.as_deref()),
        })
    }
}

impl Architecture for Llama {
    fn forward(&self, batch: &Batch, kv: &mut KvCache) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let n = batch.len();
        let d = c.n_embd;
        let hd = c.head_dim;
        let mut x = self.embd.lookup(&batch.tokens)?;
        let rope = Rope::new(&batch.pos, &self.inv_freq);
        let attn = AttnParams {
            n_head: c.n_head,
            n_kv_heads: c.n_head_kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let q_dim = c.n_head * hd;
        let mut attn_out = vec![0f32; n * q_dim];
        for (li, layer) in self.layers.iter().enumerate() {
            let mut h = x.clone();
            rms_norm(&mut h, &layer.attn_norm, c.eps);
            let mut qkv = layer.proj.qkv.forward(&h, n)?.into_iter();
            let (mut q, mut k, v) = match (qkv.next(), qkv.next(), qkv.next()) {
                (Some(q), Some(k), Some(v)) => (q, k, v),
                _ => unreachable!("three projections"),
            };
            rotate_and_store(kv, li, batch, &rope, false, &attn, &mut q, &mut k, &v);
            paged_attention(kv, li, batch, &q, &attn, &mut attn_out);
            let o = layer.proj.wo.forward(&attn_out, n)?;
            add_assign(&mut x, &o);

            let mut h = x.clone();
            rms_norm(&mut h, &layer.ffn_norm, c.eps);
            let mut gu = layer.proj.gate_up.forward(&h, n)?.into_iter();
            let (mut g, u) = match (gu.next(), gu.next()) {
                (Some(g), Some(u)) => (g, u),
                _ => unreachable!("two projections"),
            };
            silu_mul(&mut g, &u);
            let down = layer.proj.down.forward(&g, n)?;
            add_assign(&mut x, &down);
        }
        output_logits(&x, d, &batch.logits, &self.norm, c.eps, &self.output)
    }
}
