//! The terms of a step (`LlamaCppEx.Server` and local generation build them) and of its
//! outcome.

use crate::error::binary;
use crate::sampler::SamplerRes;
use crate::snapshot::{encode_snapshot, SnapshotRes};
use llama_cpp_ex_engine::embedding::{EmbedRequest, Pooling};
use llama_cpp_ex_engine::sampler::TokenLogprobs;
use llama_cpp_ex_engine::speculative::{DraftSource, SpecRequest};
use llama_cpp_ex_engine::{Batch, KvOp, Model, Step, StepOutcome};
use rustler::{Encoder, Env, NifTaggedEnum, NifTuple, ResourceArc, Term};

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

/// `{ops, [{token, pos, seq, logits?}], [{seq, sampler}], {purgeable_seqs, save_max_bytes},
/// [{embed_seq, pooling, normalize}], [{seq, history, n_draft, draft_model?}]}` (pooling in
/// llama.cpp's numbering, -1 the model's own; history: the sequence's tokens, its next one
/// last; draft_model?: drafts from the context's attached draft model, else prompt lookup;
/// save_max_bytes 0: purged caches are not copied).
#[derive(NifTuple)]
pub struct StepTerm {
    ops: Vec<KvOpTerm>,
    entries: Vec<(u32, usize, usize, bool)>,
    samplers: Vec<(usize, ResourceArc<SamplerRes>)>,
    purgeable: (Vec<usize>, usize),
    embeds: Vec<(usize, i64, i32)>,
    specs: Vec<(usize, Vec<u32>, usize, bool)>,
}

impl StepTerm {
    pub fn into_step(self, model: &Model) -> llama_cpp_ex_engine::error::Result<Step> {
        let embeds = self
            .embeds
            .into_iter()
            .map(|(seq, pooling, normalize)| {
                Ok(EmbedRequest {
                    seq,
                    pooling: Pooling::resolve(pooling, model)?,
                    normalize,
                })
            })
            .collect::<llama_cpp_ex_engine::error::Result<Vec<_>>>()?;
        let mut batch = Batch::with_capacity(self.entries.len());
        for (token, pos, seq, logits) in self.entries {
            batch.push(token, pos, seq, logits);
        }
        Ok(Step {
            ops: self
                .ops
                .into_iter()
                .map(|op| match op {
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
                })
                .collect(),
            batch,
            samplers: self
                .samplers
                .into_iter()
                .map(|(seq, s)| (seq, s.sampler.clone()))
                .collect(),
            purgeable: self.purgeable.0,
            save_purged_max_bytes: self.purgeable.1,
            embeds,
            specs: self
                .specs
                .into_iter()
                .map(|(seq, history, n_draft, draft_model)| SpecRequest {
                    seq,
                    history,
                    source: DraftSource::new(n_draft, draft_model),
                })
                .collect(),
        })
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

/// `{[{seq, token, piece, eog?, logprobs | nil}], purged, n_splits, failed, eval_us,
/// [{embed_seq, {:ok, f32_binary} | {:error, message}}], {kv_free_tokens, kv_occupancy,
/// [{seq, n_drafted}], [{seq, tag, {snapshot, bytes, len}}], restore_failed_seqs}}`.
pub fn encode_outcome<'a>(env: Env<'a>, model: &Model, o: &StepOutcome) -> Term<'a> {
    let sampled: Vec<Term> = o
        .sampled
        .iter()
        .map(|s| {
            let lp = match &s.logprobs {
                Some(lp) => encode_logprobs(env, model, lp),
                None => rustler::types::atom::nil().encode(env),
            };
            (s.seq, s.token, binary(env, &s.piece), s.is_eog, lp).encode(env)
        })
        .collect();
    let embeddings: Vec<Term> = o
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
            (*seq, r).encode(env)
        })
        .collect();
    let saved: Vec<Term> = o
        .saved
        .iter()
        .map(|(seq, tag, s)| (*seq, *tag, encode_snapshot(env, s)).encode(env))
        .collect();
    (
        sampled,
        &o.purged,
        o.n_splits,
        &o.failed,
        o.eval_us,
        embeddings,
        (
            o.kv_free_tokens,
            o.kv_occupancy,
            &o.drafted,
            saved,
            &o.restore_failed,
        ),
    )
        .encode(env)
}
