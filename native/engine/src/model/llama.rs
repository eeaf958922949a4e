//! The `llama` architecture (Llama 2/3, Mistral, SmolLM2): RMSNorm, rotary embeddings on
//! adjacent pairs, grouped-query attention, SwiGLU feed-forward.

use super::attention::{paged_attention, rotate_and_store, tiles_into, AttnParams};
use super::ops::{
    add_assign, add_rms_norm_into, inv_freq, output_logits_into, rms_norm_into, silu_mul, sized,
    Embedding, Linear,
};
use super::{ArchSpec, Architecture, Config, Projections, TensorLoader, Workspace};
use crate::batch::Batch;
use crate::error::Result;
use crate::kv::KvCache;

pub const SPEC: ArchSpec = ArchSpec {
    name: "llama",
    configure: |_, _| Ok(()),
    load: |cfg, l| Ok(Box::new(Llama::load(cfg, l)?)),
};

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
    fn forward(&self, batch: &Batch, kv: &mut KvCache, ws: &mut Workspace) -> Result<()> {
        let c = &self.cfg;
        let n = batch.len();
        let d = c.n_embd;
        let hd = c.head_dim;
        self.embd.lookup_into(&batch.tokens, &mut ws.x)?;
        ws.rope.fill(&batch.pos, &self.inv_freq);
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
            rope,
            tiles,
            logits,
            ..
        } = ws;
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm_into(x, &layer.attn_norm, c.eps, h);
            layer.proj.qkv.forward_into(h, n, &mut [q, k, v], stacked)?;
            rotate_and_store(kv, li, batch, rope, false, &attn, q, k, v);
            paged_attention(kv, li, batch, tiles, q, &attn, attn_out);
            layer.proj.wo.forward_into(attn_out, n, o)?;
            add_rms_norm_into(x, o, &layer.ffn_norm, c.eps, h);
            layer
                .proj
                .gate_up
                .forward_into(h, n, &mut [g, u], stacked)?;
            silu_mul(g, u);
            layer.proj.down.forward_into(g, n, o)?;
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
