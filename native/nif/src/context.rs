//! Contexts: creation, the KV cache, decode, logits, and one step run in the caller (a
//! generation on a model; the Server's steps go through `engine.rs`).

use crate::atoms;
use crate::error::{guard, lock, message, Out, Status};
use crate::model::ModelRes;
use crate::step::{encode_outcome, StepTerm};
use llama_cpp_ex_engine::kv::{KvLayout, KvType};
use llama_cpp_ex_engine::{Context, ContextParams};
use rustler::{Atom, Encoder, Env, NifMap, ResourceArc, Term};
use std::sync::{Arc, Mutex};

pub struct ContextRes {
    pub ctx: Arc<Mutex<Context>>,
    pub model: Arc<llama_cpp_ex_engine::Model>,
    // kept outside the mutex so these reads never wait for a running forward pass
    n_ctx: usize,
    n_seq_max: usize,
    pub kv_layout: KvLayout,
}

#[rustler::resource_impl]
impl rustler::Resource for ContextRes {}

/// `LlamaCppEx.Context.create/2`'s validated options.
#[derive(NifMap)]
struct ContextOpts {
    n_ctx: usize,
    n_batch: usize,
    n_ubatch: usize,
    n_threads: usize,
    n_threads_batch: usize,
    n_seq_max: usize,
    n_seq_embd: usize,
    type_k: Atom,
    type_v: Atom,
    kv_pressure_types: Vec<Atom>,
}

fn kv_type(a: Atom) -> Result<KvType, crate::error::NifError> {
    Ok(match a {
        a if a == atoms::f32() => KvType::F32,
        a if a == atoms::f16() => KvType::F16,
        a if a == atoms::q8_0() => KvType::Q8_0,
        a if a == atoms::q4_0() => KvType::Q4_0,
        _ => return Err(message("unsupported KV cache type")),
    })
}

/// Bytes one cached token of `m` takes with keys and values in these types (a Server's
/// `:kv_budget_mb` becomes its `n_ctx` by it).
#[rustler::nif]
fn kv_bytes_per_token(m: ResourceArc<ModelRes>, type_k: Atom, type_v: Atom) -> Out<usize> {
    guard(|| {
        let c = &m.model.config;
        Ok(llama_cpp_ex_engine::kv::bytes_per_token(
            c.n_layer,
            c.n_head_kv,
            c.head_dim,
            kv_type(type_k)?,
            kv_type(type_v)?,
        ))
    })
}

#[rustler::nif(schedule = "DirtyCpu")]
fn context_create<'a>(env: Env<'a>, m: ResourceArc<ModelRes>, opts: ContextOpts) -> Term<'a> {
    let r: Out<ResourceArc<ContextRes>> = guard(|| {
        let ctx = Context::new(m.model.clone(), opts.params()?)?;
        let kv_layout = ctx.kv.layout();
        Ok(ResourceArc::new(ContextRes {
            kv_layout,
            ctx: Arc::new(Mutex::new(ctx)),
            model: m.model.clone(),
            n_ctx: opts.n_ctx,
            n_seq_max: opts.n_seq_max,
        }))
    });
    r.encode(env)
}

impl ContextOpts {
    fn params(&self) -> Result<ContextParams, crate::error::NifError> {
        Ok(ContextParams {
            n_ctx: self.n_ctx,
            n_batch: self.n_batch,
            n_ubatch: self.n_ubatch,
            n_seq_max: self.n_seq_max,
            n_seq_embd: self.n_seq_embd,
            kv_type: kv_type(self.type_k)?,
            kv_type_v: Some(kv_type(self.type_v)?),
            kv_pressure_types: self
                .kv_pressure_types
                .iter()
                .map(|&t| kv_type(t))
                .collect::<Result<_, _>>()?,
            n_threads: self.n_threads,
            n_threads_batch: self.n_threads_batch,
        })
    }
}

/// Gives the context a draft model for speculative decoding, on a context of its own made
/// with `opts` (its vocabulary must be the context's model's).
#[rustler::nif(schedule = "DirtyCpu")]
fn context_attach_draft(
    c: ResourceArc<ContextRes>,
    draft: ResourceArc<ModelRes>,
    opts: ContextOpts,
) -> Status {
    Status(guard(|| {
        let draft_ctx = Context::new(draft.model.clone(), opts.params()?)?;
        lock(&c.ctx).attach_draft(draft_ctx)?;
        Ok(())
    }))
}

#[rustler::nif]
fn context_n_ctx(c: ResourceArc<ContextRes>) -> usize {
    c.n_ctx
}

#[rustler::nif]
fn context_n_seq_max(c: ResourceArc<ContextRes>) -> usize {
    c.n_seq_max
}

#[rustler::nif(schedule = "DirtyCpu")]
fn memory_clear(c: ResourceArc<ContextRes>) -> Atom {
    lock(&c.ctx).kv.clear();
    atoms::ok()
}

/// `{n_blocks, used blocks per layer group, [[{seq, blocks}]] per layer group,
/// [{seq, positions}]}`.
type KvUsageTerm = (
    usize,
    Vec<usize>,
    Vec<Vec<(usize, usize)>>,
    Vec<(usize, usize)>,
);

/// The KV cache's block usage after an integrity audit.
#[rustler::nif(schedule = "DirtyCpu")]
fn context_kv_usage(c: ResourceArc<ContextRes>) -> Out<KvUsageTerm> {
    guard(|| {
        let ctx = lock(&c.ctx);
        ctx.kv.audit().map_err(message)?;
        let u = ctx.kv.usage();
        Ok((u.n_blocks, u.used, u.owners, u.tokens))
    })
}

/// Appends `tokens` to sequence 0 in forward passes of at most `n_batch` tokens.
#[rustler::nif(schedule = "DirtyCpu")]
fn decode(c: ResourceArc<ContextRes>, tokens: Vec<u32>) -> Status {
    Status(guard(|| {
        lock(&c.ctx).decode_tokens(&tokens, 0)?;
        Ok(())
    }))
}

#[rustler::nif(schedule = "DirtyCpu")]
fn get_logits(c: ResourceArc<ContextRes>, idx: i64) -> Out<Vec<f32>> {
    guard(|| Ok(lock(&c.ctx).logits_ith(idx)?.to_vec()))
}

/// The `n` most likely tokens of entry `idx` of the last batch with their log-probabilities.
#[rustler::nif(schedule = "DirtyCpu")]
fn get_top_logprobs(c: ResourceArc<ContextRes>, idx: i64, n: usize) -> Out<Vec<(u32, f64)>> {
    guard(|| {
        let ctx = lock(&c.ctx);
        let lp = llama_cpp_ex_engine::sampler::token_logprobs(ctx.logits_ith(idx)?, 0, n);
        Ok(lp.top.into_iter().map(|(id, l)| (id, l as f64)).collect())
    })
}

/// Runs one step on this context now (a generation on a model: the caller drives, one prompt
/// chunk or one token per call, so it can stop between any two).
#[rustler::nif(schedule = "DirtyCpu")]
fn context_step<'a>(env: Env<'a>, c: ResourceArc<ContextRes>, step: StepTerm) -> Out<Term<'a>> {
    guard(|| {
        let step = step.into_step(&c.model)?;
        let mut ctx = lock(&c.ctx);
        let outcome = ctx.step(&step)?;
        Ok(encode_outcome(env, &ctx.model, &outcome))
    })
}
