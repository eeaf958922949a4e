//! One engine step: ordered KV cache edits, one batched forward pass, and the tokens sampled
//! for every sequence that asked for logits. Every generation runs on it: the Server sends one
//! step per tick (through [`EngineThread`](crate::EngineThread)), a generation on a model one
//! per prompt chunk or token, speculation included.
//!
//! Every decision that depends on the cache (which prefix to share or trim) is taken by the
//! caller between steps and shipped as [`KvOp`]s, so a step needs nothing but its own input.

use super::speculate::SpecRequest;
use super::{seq_ranges, Context, Picked};
use crate::batch::Batch;
use crate::embedding::{pool, EmbedRequest};
use crate::error::{lock, EngineError, Result};
use crate::kv::KvSnapshot;
use crate::model::Pick;
use crate::sampler::{Sampler, TokenLogprobs};
use crate::tokenizer::TokenId;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// A sampler shared between its owner (a request) and the steps that sample with it.
pub type SharedSampler = Arc<Mutex<Sampler>>;

/// A cache edit applied before a step's batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvOp {
    /// Keep the first `keep` positions of `seq` (when a sliding window already dropped what
    /// position `keep` needs, the sequence is cleared instead).
    Trim { seq: usize, keep: usize },
    /// Make `dst` hold the first `len` positions of `src` by sharing its blocks.
    Share { src: usize, dst: usize, len: usize },
    /// Drop everything `seq` holds.
    Clear { seq: usize },
    /// Copy the first `len` positions of `seq` into [`StepOutcome::saved`] under `tag`, unless
    /// the copy would take more than `max_bytes` (the level-2 prompt cache's budget).
    Save {
        seq: usize,
        len: usize,
        max_bytes: usize,
        tag: u64,
    },
    /// Make `seq` hold the first `len` positions of a snapshot (copied into new blocks, idle
    /// caches of [`Step::purgeable`] dropped first when the free blocks cannot hold it). When
    /// even that is not enough, `seq` is left empty, its rows are left out of the step and it
    /// is reported in [`StepOutcome::restore_failed`].
    Restore {
        seq: usize,
        snapshot: Arc<KvSnapshot>,
        len: usize,
    },
    /// Give blocks allocated from now on the cache's precision tier `tier` (0: the context's
    /// `kv_type`, then its `kv_pressure_types`); blocks already written keep theirs.
    SetWriteTier { tier: usize },
}

/// A step's input.
#[derive(Default)]
pub struct Step {
    pub ops: Vec<KvOp>,
    pub batch: Batch,
    /// The sampler of every sequence whose logits row this step samples.
    pub samplers: Vec<(usize, SharedSampler)>,
    /// Idle sequences whose cache may be dropped under KV pressure, first to go first.
    pub purgeable: Vec<usize>,
    /// When positive, a purged cache of at most this many bytes is copied into
    /// [`StepOutcome::saved`] (tag 0) before it is dropped.
    pub save_purged_max_bytes: usize,
    /// Embedding texts in the batch, one sequence each: their entries keep hidden states
    /// instead of logits, are pooled into [`StepOutcome::embeddings`], and the sequences are
    /// cleared once the step ran (whatever its outcome).
    pub embeds: Vec<EmbedRequest>,
    /// Generating sequences that decode speculatively this step: drafts are added after their
    /// next token and verified with their sampler.
    pub specs: Vec<SpecRequest>,
    /// Sequences whose one entry (a decode row; its token a placeholder) feeds the token the
    /// step before this one sampled for them, so a step can be queued before its
    /// predecessor's outcome is known (the Server's overlapped decode). An entry whose
    /// sequence got no token in that step, or an end-of-generation one, is left out.
    pub follow: Vec<usize>,
}

/// A token sampled for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub seq: usize,
    pub token: TokenId,
    /// The bytes the token renders as (may end inside a UTF-8 character).
    pub piece: Vec<u8>,
    pub is_eog: bool,
    pub logprobs: Option<TokenLogprobs>,
}

/// A step's result.
#[derive(Debug, Clone, Default)]
pub struct StepOutcome {
    /// In batch order; a speculating sequence's accepted draft tokens and the token sampled
    /// after them follow each other.
    pub sampled: Vec<SampledToken>,
    /// Idle sequences whose cache was dropped to make room.
    pub purged: Vec<usize>,
    /// How many times the batch had to be re-planned under KV pressure.
    pub n_splits: usize,
    /// Sequences that could not get KV blocks even after purging; their entries were dropped.
    pub failed: Vec<usize>,
    /// The vector (or why there is none) of every embedding sequence of the step that was
    /// evaluated.
    pub embeddings: Vec<(usize, std::result::Result<Vec<f32>, String>)>,
    /// Wall time of the step, in microseconds.
    pub eval_us: u64,
    /// Of `eval_us`, the time spent drafting (speculating sequences).
    pub draft_us: u64,
    /// Tokens the cache's free blocks hold after the step.
    pub kv_free_tokens: usize,
    /// Per sequence holding blocks: the tokens its blocks that no other sequence shares
    /// hold, what dropping its cache would free. With `kv_free_tokens`, what the Server
    /// admits requests by (the engine is the one that counts KV capacity).
    pub kv_exclusive_tokens: Vec<(usize, usize)>,
    /// Fraction of the KV byte budget in use after the step (the Server's `kv_policy` input).
    pub kv_occupancy: f64,
    /// Draft tokens proposed per speculating sequence (accepted: its sampled tokens - 1).
    pub drafted: Vec<(usize, usize)>,
    /// `(seq, tag, copy)` of every [`KvOp::Save`] (its tag) and every purged cache that was
    /// copied (tag 0), in the order taken.
    pub saved: Vec<(usize, u64, Arc<KvSnapshot>)>,
    /// Sequences whose [`KvOp::Restore`] did not fit: left empty, their rows not evaluated.
    pub restore_failed: Vec<usize>,
}

/// The idle caches a step may drop to make room ([`Step::purgeable`], first to go first),
/// whether to copy them first, and the ones dropped so far.
struct Evictor<'a> {
    order: &'a [usize],
    save_max_bytes: usize,
    dropped: Vec<usize>,
}

impl Context {
    /// Runs one step: the cache edits, then the batch (an empty batch only edits), sampling
    /// with the sampler of every sequence in `step.samplers` from its logits rows.
    pub fn step(&mut self, step: &Step) -> Result<StepOutcome> {
        let started = Instant::now();
        // lock order everywhere: the context (held by the caller), then samplers
        let mut guards: Vec<(usize, MutexGuard<'_, Sampler>)> = step
            .samplers
            .iter()
            .map(|(seq, s)| (*seq, lock(s)))
            .collect();
        let mut out = StepOutcome::default();
        let mut evictor = Evictor {
            order: &step.purgeable,
            save_max_bytes: step.save_purged_max_bytes,
            dropped: Vec::new(),
        };
        let previous = std::mem::take(&mut self.last_sampled);
        self.apply_kv_ops(&step.ops, &mut evictor, &mut out)?;
        // what failed to restore is not evaluated; a follow entry takes its token or goes
        let restricted;
        let step_batch = if out.restore_failed.is_empty() && step.follow.is_empty() {
            &step.batch
        } else {
            let mut b = step.batch.without(&out.restore_failed);
            let mut gone = Vec::new();
            for &seq in &step.follow {
                let fed = previous.iter().find(|&&(s, _, _)| s == seq);
                match (fed, b.seq.iter().position(|&s| s == seq)) {
                    (Some(&(_, token, false)), Some(i)) => b.tokens[i] = token,
                    _ => gone.push(seq),
                }
            }
            restricted = if gone.is_empty() { b } else { b.without(&gone) };
            &restricted
        };
        if !step_batch.is_empty() {
            let mut samplers: Vec<(usize, &mut Sampler)> =
                guards.iter_mut().map(|(seq, g)| (*seq, &mut **g)).collect();
            let extended;
            let batch = if step.embeds.is_empty() && step.specs.is_empty() {
                step_batch
            } else {
                let seqs: Vec<usize> = step.embeds.iter().map(|e| e.seq).collect();
                let mut b = step_batch.clone();
                b.mark_embedding_rows(&seqs);
                let drafting = Instant::now();
                out.drafted = self.add_drafts(&mut b, &step.specs)?;
                out.draft_us = drafting.elapsed().as_micros() as u64;
                extended = b;
                &extended
            };
            let speculating: Vec<usize> = out.drafted.iter().map(|&(s, _)| s).collect();
            let evaluated = self.evaluate(
                batch,
                &mut samplers,
                &mut evictor,
                &step.embeds,
                &speculating,
                &mut out,
            );
            // embedding sequences never keep a cache, evaluated or not
            for e in &step.embeds {
                if self.kv.check_seq(e.seq as i64).is_ok() {
                    self.kv.seq_clear(e.seq);
                }
            }
            evaluated?;
        }
        out.purged = evictor.dropped;
        let mut last = previous;
        last.clear();
        for t in &out.sampled {
            match last.iter_mut().find(|(s, _, _)| *s == t.seq) {
                Some(l) => *l = (t.seq, t.token, t.is_eog),
                None => last.push((t.seq, t.token, t.is_eog)),
            }
        }
        self.last_sampled = last;
        out.eval_us = started.elapsed().as_micros() as u64;
        out.kv_free_tokens = self.kv.free_tokens();
        out.kv_exclusive_tokens = self.kv.exclusive_tokens();
        out.kv_occupancy = self.kv.occupancy();
        Ok(out)
    }

    /// A copy of the first `len` positions of `seq`, when it takes at most `max_bytes` and a
    /// sliding window has not dropped what it needs.
    pub fn snapshot_within(
        &self,
        seq: usize,
        len: usize,
        max_bytes: usize,
    ) -> Option<Arc<KvSnapshot>> {
        let len = len.min(self.kv.seq_len(seq));
        if len == 0 || self.kv.snapshot_bytes(seq, len) > max_bytes {
            return None;
        }
        self.kv.snapshot(seq, len).ok().map(Arc::new)
    }

    /// Drops the first idle cache of the evictor's order that holds something and that
    /// `spare` does not protect, copying it first (tag 0) when the copy fits its budget; the
    /// sequence dropped, or `None` when no cache is left to drop. The one eviction rule of a
    /// step, for restores and for the batch alike.
    fn evict_idle(
        &mut self,
        ev: &mut Evictor<'_>,
        spare: impl Fn(usize) -> bool,
        out: &mut StepOutcome,
    ) -> Option<usize> {
        let victim = ev.order.iter().copied().find(|&p| {
            !ev.dropped.contains(&p)
                && !spare(p)
                && self.kv.check_seq(p as i64).is_ok()
                && self.kv.seq_len(p) > 0
        })?;
        if let Some(snap) = self.snapshot_within(victim, usize::MAX, ev.save_max_bytes) {
            out.saved.push((victim, 0, snap));
        }
        self.kv.seq_clear(victim);
        ev.dropped.push(victim);
        Some(victim)
    }

    /// Applies cache edits in order. A restore may drop idle caches (never one a later op
    /// shares from, nor its own target).
    fn apply_kv_ops(
        &mut self,
        ops: &[KvOp],
        ev: &mut Evictor<'_>,
        out: &mut StepOutcome,
    ) -> Result<()> {
        let sources: Vec<usize> = ops
            .iter()
            .filter_map(|op| match *op {
                KvOp::Share { src, .. } => Some(src),
                _ => None,
            })
            .collect();
        for op in ops {
            match *op {
                KvOp::Save {
                    seq,
                    len,
                    max_bytes,
                    tag,
                } => {
                    let seq = self.kv.check_seq(seq as i64)?;
                    if let Some(snap) = self.snapshot_within(seq, len, max_bytes) {
                        out.saved.push((seq, tag, snap));
                    }
                }
                KvOp::Restore {
                    seq,
                    ref snapshot,
                    len,
                } => {
                    let seq = self.kv.check_seq(seq as i64)?;
                    loop {
                        match self.kv.restore(seq, snapshot) {
                            Ok(()) => {
                                if !self.kv.seq_rm(seq, len, None)? {
                                    self.kv.seq_clear(seq);
                                }
                                break;
                            }
                            Err(EngineError::ContextFull { .. }) => {
                                let spare = |p: usize| p == seq || sources.contains(&p);
                                if self.evict_idle(ev, spare, out).is_none() {
                                    out.restore_failed.push(seq);
                                    break;
                                }
                            }
                            // a snapshot of another layout: the request evaluates its
                            // prompt instead (the caller checked when it loaded the file)
                            Err(_) => {
                                out.restore_failed.push(seq);
                                break;
                            }
                        }
                    }
                }
                KvOp::Trim { seq, keep } => {
                    let seq = self.kv.check_seq(seq as i64)?;
                    if !self.kv.seq_rm(seq, keep, None)? {
                        self.kv.seq_clear(seq);
                    }
                }
                KvOp::Share { src, dst, len } => {
                    let src = self.kv.check_seq(src as i64)?;
                    let dst = self.kv.check_seq(dst as i64)?;
                    self.kv.seq_share_prefix(src, dst, len)?;
                }
                KvOp::Clear { seq } => {
                    let seq = self.kv.check_seq(seq as i64)?;
                    self.kv.seq_clear(seq);
                }
                KvOp::SetWriteTier { tier } => self.kv.set_write_tier(tier)?,
            }
        }
        Ok(())
    }

    /// Evaluates a batch and samples every entry with its logits flag set with that entry's
    /// sequence's sampler. Under KV pressure, drops idle caches first, then fails the
    /// sequences that still do not fit and evaluates the rest, so one request outgrowing the
    /// cache does not fail the others.
    ///
    /// The sequences of `embeds` are embedding texts riding in the pass: their entries keep
    /// hidden states ([`Batch::embd`] marks them), pooled per sequence. The sequences of
    /// `speculating` carry a draft after their next token: their logits rows are verified in
    /// order (several tokens may come out) and the rejected positions rolled back.
    fn evaluate(
        &mut self,
        batch: &Batch,
        samplers: &mut [(usize, &mut Sampler)],
        ev: &mut Evictor<'_>,
        embeds: &[EmbedRequest],
        speculating: &[usize],
        out: &mut StepOutcome,
    ) -> Result<()> {
        // a sequence that would grow past n_ctx fails alone, whatever else is free
        let n_ctx = self.params.n_ctx;
        out.failed = seq_ranges(batch)
            .into_iter()
            .filter(|&(_, _, end)| end > n_ctx)
            .map(|(s, _, _)| s)
            .collect();
        let mut batch = batch.without(&out.failed);
        if batch.is_empty() {
            return Ok(());
        }
        self.validate(&batch)?;
        loop {
            match self.reserve_batch(&seq_ranges(&batch)) {
                Ok(()) => break,
                Err(seq) => {
                    out.n_splits += 1;
                    let in_batch = |p: usize| batch.seq.contains(&p);
                    if self.evict_idle(ev, in_batch, out).is_some() {
                        continue;
                    }
                    out.failed.push(seq);
                    batch = batch.without(&[seq]);
                    if batch.is_empty() {
                        return Ok(());
                    }
                }
            }
        }
        // rows whose sampler reads only their largest logit, or only their best few: an
        // architecture that picks where the logits are (a GPU) brings back the token's id or
        // those candidates instead of vocabulary-wide rows
        self.pick.clear();
        if let Some(window) = self.model.architecture()?.picks() {
            if !self.ws.hidden_only {
                let pick = |(&seq, &want): (&usize, &bool)| {
                    let sampler = samplers.iter().find(|(s, _)| *s == seq);
                    match sampler {
                        Some((_, s)) if want && !speculating.contains(&seq) => {
                            if s.argmax_decides() {
                                Pick::Greedy
                            } else if s.candidates_decide().is_some_and(|k| k <= window) {
                                Pick::Best
                            } else {
                                Pick::Whole
                            }
                        }
                        _ => Pick::Whole,
                    }
                };
                self.pick
                    .extend(batch.seq.iter().zip(&batch.logits).map(pick));
            }
        }
        let done = self.forward(&batch, true);
        self.pick.clear();
        done?;
        for (i, (&seq, &want)) in batch.seq.iter().zip(&batch.logits).enumerate() {
            if !want {
                continue;
            }
            let Some((_, sampler)) = samplers.iter_mut().find(|(s, _)| *s == seq) else {
                continue;
            };
            let token = match self.picked_ith(i) {
                Picked::Token(token) => {
                    sampler.accept(token);
                    Some(token)
                }
                Picked::Best(at) => Some(sampler.sample_candidates(self.candidates(at))),
                Picked::None => None,
            };
            if let Some(token) = token {
                out.sampled.push(self.sampled_token(seq, token, None));
                continue;
            }
            if speculating.contains(&seq) {
                // every logits row of the sequence at once, at its first one
                if batch.seq[..i].contains(&seq) {
                    continue;
                }
                let rows: Vec<usize> = (i..batch.len())
                    .filter(|&r| batch.seq[r] == seq && batch.logits[r])
                    .collect();
                self.verify_draft(seq, &rows, &batch, sampler, &mut out.sampled)?;
                continue;
            }
            let (token, logprobs) = sampler.sample_with_logprobs(self.logits_ith(i as i64)?);
            out.sampled.push(self.sampled_token(seq, token, logprobs));
        }
        for e in embeds.iter().filter(|e| batch.seq.contains(&e.seq)) {
            let rows: Vec<&[f32]> = (0..batch.len())
                .filter(|&i| batch.seq[i] == e.seq)
                .filter_map(|i| self.embeddings_ith(i))
                .collect();
            let pooled =
                pool(&self.model, &rows, e.pooling, e.normalize).map_err(|e| e.to_string());
            out.embeddings.push((e.seq, pooled));
        }
        Ok(())
    }

    /// A sampled token with its piece and end-of-generation flag.
    pub(super) fn sampled_token(
        &self,
        seq: usize,
        token: TokenId,
        logprobs: Option<TokenLogprobs>,
    ) -> SampledToken {
        let tokenizer = &self.model.tokenizer;
        SampledToken {
            seq,
            token,
            piece: tokenizer
                .token_to_piece(token)
                .map(<[u8]>::to_vec)
                .unwrap_or_default(),
            is_eog: tokenizer.is_eog(token),
            logprobs,
        }
    }
}
