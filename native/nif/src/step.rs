//! The step and its outcome as Elixir structs (`LlamaCppEx.Engine.Step`,
//! `LlamaCppEx.Engine.Outcome` and their parts, defined in `lib/llama_cpp_ex/engine.ex`):
//! every generation's way in and out of the engine, on both routes.

use crate::error::binary;
use crate::sampler::SamplerRes;
use crate::snapshot::{encode_snapshot, SnapshotRes};
use llama_cpp_ex_engine::context::{DraftSource, SpecRequest};
use llama_cpp_ex_engine::embedding::{EmbedRequest, Pooling};
use llama_cpp_ex_engine::sampler::TokenLogprobs;
use llama_cpp_ex_engine::{Batch, KvOp, Model, Step, StepOutcome};
use rustler::{Encoder, Env, NifStruct, NifTaggedEnum, ResourceArc, Term};

/// `{:trim, seq, keep}`, `{:share, src, dst, len}`, `{:clear, seq}`,
/// `{:save, seq, len, max_bytes, tag}`, `{:restore, seq, snapshot, len}` or
/// `{:set_write_tier, tier}`.
#[derive(NifTaggedEnum)]
pub enum KvOpTerm {
    Trim(usize, usize),
    Share(usize, usize, usize),
    Clear(usize),
    Save(usize, usize, usize, u64),
    Restore(usize, ResourceArc<SnapshotRes>, usize),
    SetWriteTier(usize),
}

/// `%LlamaCppEx.Engine.Embed{}`: an embedding text's sequence, its pooling (llama.cpp's
/// numbering, -1 the model's own) and normalisation.
#[derive(NifStruct)]
#[module = "LlamaCppEx.Engine.Embed"]
pub struct EmbedTerm {
    seq: usize,
    pooling: i64,
    normalize: i32,
}

/// `%LlamaCppEx.Engine.Spec{}`: a speculating sequence, the tokens it fed since its last
/// step (all of them with `reset`), and its drafts' source.
#[derive(NifStruct)]
#[module = "LlamaCppEx.Engine.Spec"]
pub struct SpecTerm {
    seq: usize,
    tokens: Vec<u32>,
    reset: bool,
    n_draft: usize,
    draft_model: bool,
}

/// `%LlamaCppEx.Engine.Step{}`; entries are `{token, pos, seq, logits?}`.
#[derive(NifStruct)]
#[module = "LlamaCppEx.Engine.Step"]
pub struct StepTerm {
    ops: Vec<KvOpTerm>,
    entries: Vec<(u32, usize, usize, bool)>,
    samplers: Vec<(usize, ResourceArc<SamplerRes>)>,
    purgeable: Vec<usize>,
    save_purged_max_bytes: usize,
    embeds: Vec<EmbedTerm>,
    specs: Vec<SpecTerm>,
    follow: Vec<usize>,
}

impl StepTerm {
    pub fn into_step(self, model: &Model) -> llama_cpp_ex_engine::Result<Step> {
        let embeds = self
            .embeds
            .into_iter()
            .map(|e| {
                Ok(EmbedRequest {
                    seq: e.seq,
                    pooling: Pooling::resolve(e.pooling, model)?,
                    normalize: e.normalize,
                })
            })
            .collect::<llama_cpp_ex_engine::Result<Vec<_>>>()?;
        let mut batch = Batch::with_capacity(self.entries.len());
        for (token, pos, seq, logits) in self.entries {
            batch.push(token, pos, seq, logits);
        }
        Ok(Step {
            ops: self.ops.into_iter().map(KvOpTerm::into_op).collect(),
            batch,
            samplers: self
                .samplers
                .into_iter()
                .map(|(seq, s)| (seq, s.sampler.clone()))
                .collect(),
            purgeable: self.purgeable,
            save_purged_max_bytes: self.save_purged_max_bytes,
            embeds,
            specs: self
                .specs
                .into_iter()
                .map(|s| SpecRequest {
                    seq: s.seq,
                    tokens: s.tokens,
                    reset: s.reset,
                    source: DraftSource::new(s.n_draft, s.draft_model),
                })
                .collect(),
            follow: self.follow,
        })
    }
}

impl KvOpTerm {
    fn into_op(self) -> KvOp {
        match self {
            KvOpTerm::Trim(seq, keep) => KvOp::Trim { seq, keep },
            KvOpTerm::Share(src, dst, len) => KvOp::Share { src, dst, len },
            KvOpTerm::Clear(seq) => KvOp::Clear { seq },
            KvOpTerm::Save(seq, len, max_bytes, tag) => KvOp::Save {
                seq,
                len,
                max_bytes,
                tag,
            },
            KvOpTerm::Restore(seq, s, len) => KvOp::Restore {
                seq,
                snapshot: s.snapshot.clone(),
                len,
            },
            KvOpTerm::SetWriteTier(tier) => KvOp::SetWriteTier { tier },
        }
    }
}

/// `{logprob, [{id, piece, logprob}]}`.
pub fn encode_logprobs<'a>(env: Env<'a>, model: &Model, lp: &TokenLogprobs) -> Term<'a> {
    let top: Vec<Term> = lp
        .top
        .iter()
        .map(|&(id, l)| {
            let piece = model.tokenizer.token_to_piece(id).unwrap_or(&[]);
            (id, binary(env, piece), l as f64).encode(env)
        })
        .collect();
    (lp.logprob as f64, top).encode(env)
}

/// `%LlamaCppEx.Engine.Sampled{}`.
#[derive(NifStruct)]
#[module = "LlamaCppEx.Engine.Sampled"]
struct SampledTerm<'a> {
    seq: usize,
    token: u32,
    piece: Term<'a>,
    eog: bool,
    logprobs: Term<'a>,
}

/// `%LlamaCppEx.Engine.Outcome{}`.
#[derive(NifStruct)]
#[module = "LlamaCppEx.Engine.Outcome"]
struct OutcomeTerm<'a> {
    sampled: Vec<SampledTerm<'a>>,
    purged: Vec<usize>,
    n_splits: usize,
    failed: Vec<usize>,
    embeddings: Vec<(usize, Term<'a>)>,
    eval_us: u64,
    draft_us: u64,
    kv_free_tokens: usize,
    kv_exclusive_tokens: Vec<(usize, usize)>,
    kv_occupancy: f64,
    drafted: Vec<(usize, usize)>,
    saved: Vec<(usize, u64, Term<'a>)>,
    restore_failed: Vec<usize>,
}

pub fn encode_outcome<'a>(env: Env<'a>, model: &Model, o: &StepOutcome) -> Term<'a> {
    let nil = || rustler::types::atom::nil().encode(env);
    OutcomeTerm {
        sampled: o
            .sampled
            .iter()
            .map(|s| SampledTerm {
                seq: s.seq,
                token: s.token,
                piece: binary(env, &s.piece),
                eog: s.is_eog,
                logprobs: s
                    .logprobs
                    .as_ref()
                    .map_or_else(nil, |lp| encode_logprobs(env, model, lp)),
            })
            .collect(),
        purged: o.purged.clone(),
        n_splits: o.n_splits,
        failed: o.failed.clone(),
        embeddings: o
            .embeddings
            .iter()
            .map(|(seq, r)| {
                let r = match r {
                    Ok(v) => {
                        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_ne_bytes()).collect();
                        (crate::atoms::ok(), binary(env, &bytes)).encode(env)
                    }
                    Err(m) => (crate::atoms::error(), m.as_str()).encode(env),
                };
                (*seq, r)
            })
            .collect(),
        eval_us: o.eval_us,
        draft_us: o.draft_us,
        kv_free_tokens: o.kv_free_tokens,
        kv_exclusive_tokens: o.kv_exclusive_tokens.clone(),
        kv_occupancy: o.kv_occupancy,
        drafted: o.drafted.clone(),
        saved: o
            .saved
            .iter()
            .map(|(seq, tag, s)| (*seq, *tag, encode_snapshot(env, s)))
            .collect(),
        restore_failed: o.restore_failed.clone(),
    }
    .encode(env)
}
