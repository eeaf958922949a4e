//! One engine step: ordered KV cache edits, one batched forward pass, and one sampled token
//! for every sequence that asked for logits. `LlamaCppEx.Server` sends one step per tick
//! (through [`EngineThread`]), and a local generation sends one per prompt chunk or token.
//!
//! Every decision that depends on the cache (which prefix to share or trim) is taken by the
//! caller between steps and shipped as [`KvOp`]s, so a step needs nothing but its own input.

use crate::batch::Batch;
use crate::context::{Context, EvalOutcome, Purge};
use crate::embedding::EmbedRequest;
use crate::error::{EngineError, Result};
use crate::kv::KvSnapshot;
use crate::sampler::{Sampler, TokenLogprobs};
use crate::speculative::SpecRequest;
use crate::tokenizer::TokenId;
use crossbeam_channel::{unbounded, Sender};
use std::panic::{catch_unwind, AssertUnwindSafe};
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
    /// Generating sequences that decode speculatively this step (prompt lookup): drafts are
    /// added after their next token and verified with their sampler.
    pub specs: Vec<SpecRequest>,
}

/// The token sampled for one sequence.
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
    /// Tokens the cache's free blocks hold after the step (the Server's admission estimate).
    pub kv_free_tokens: usize,
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // a panic inside a step is reported as that step's error; the state it guards stays
    // usable (a failed batch rolls its KV reservation back)
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What [`Context::apply_kv_ops`] produced besides the edits.
#[derive(Debug, Default)]
pub struct OpsOutcome {
    pub saved: Vec<(usize, u64, Arc<KvSnapshot>)>,
    pub purged: Vec<usize>,
    pub restore_failed: Vec<usize>,
}

impl Context {
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

    /// Applies cache edits in order. A restore may drop idle caches of `purge` (copied first
    /// when `purge.save_max_bytes` allows).
    pub fn apply_kv_ops(&mut self, ops: &[KvOp], purge: Purge<'_>) -> Result<OpsOutcome> {
        let mut out = OpsOutcome::default();
        // a cache a later op shares from is not dropped to make room for a restore
        let sources: Vec<usize> = ops
            .iter()
            .filter_map(|op| match *op {
                KvOp::Share { src, .. } => Some(src),
                _ => None,
            })
            .collect();
        let mut victims = purge.order.iter().copied().filter(|p| !sources.contains(p));
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
                                // an idle cache goes (the target itself was cleared)
                                let Some(p) = victims.by_ref().find(|&p| {
                                    p != seq && !out.purged.contains(&p) && self.kv.seq_len(p) > 0
                                }) else {
                                    out.restore_failed.push(seq);
                                    break;
                                };
                                if let Some(snap) =
                                    self.snapshot_within(p, usize::MAX, purge.save_max_bytes)
                                {
                                    out.saved.push((p, 0, snap));
                                }
                                self.kv.seq_clear(p);
                                out.purged.push(p);
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
        Ok(out)
    }

    /// Runs one step: the cache edits, then the batch (an empty batch only edits), sampling
    /// one token per sequence in `step.samplers` from its logits row.
    pub fn step(&mut self, step: &Step) -> Result<StepOutcome> {
        let started = Instant::now();
        // lock order everywhere: the context (held by the caller), then samplers
        let mut guards: Vec<(usize, MutexGuard<'_, Sampler>)> = step
            .samplers
            .iter()
            .map(|(seq, s)| (*seq, lock(s)))
            .collect();
        let purge = Purge {
            order: &step.purgeable,
            save_max_bytes: step.save_purged_max_bytes,
        };
        let ops = self.apply_kv_ops(&step.ops, purge)?;
        let mut outcome = StepOutcome {
            saved: ops.saved,
            purged: ops.purged,
            restore_failed: ops.restore_failed,
            ..StepOutcome::default()
        };
        // what the ops dropped is not dropped again; what failed to restore is not evaluated
        let purgeable: Vec<usize> = step
            .purgeable
            .iter()
            .copied()
            .filter(|p| !outcome.purged.contains(p))
            .collect();
        let restricted;
        let step_batch = if outcome.restore_failed.is_empty() {
            &step.batch
        } else {
            restricted = step.batch.without(&outcome.restore_failed);
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
                outcome.drafted = self.add_drafts(&mut b, &step.specs);
                extended = b;
                &extended
            };
            let speculating: Vec<usize> = outcome.drafted.iter().map(|&(s, _)| s).collect();
            let evaluated = self.eval_sample(
                batch,
                &mut samplers,
                Purge {
                    order: &purgeable,
                    ..purge
                },
                &step.embeds,
                &speculating,
            );
            // embedding sequences never keep a cache, evaluated or not
            for e in &step.embeds {
                if self.kv.check_seq(e.seq as i64).is_ok() {
                    self.kv.seq_clear(e.seq);
                }
            }
            let EvalOutcome {
                sampled,
                purged,
                n_splits,
                failed,
                embedded,
                saved,
            } = evaluated?;
            outcome.embeddings = embedded;
            outcome
                .saved
                .extend(saved.into_iter().map(|(seq, snap)| (seq, 0, snap)));
            let tokenizer = &self.model.tokenizer;
            outcome.sampled = sampled
                .into_iter()
                .map(|s| SampledToken {
                    seq: s.seq,
                    token: s.token,
                    piece: tokenizer
                        .token_to_piece(s.token)
                        .map(<[u8]>::to_vec)
                        .unwrap_or_default(),
                    is_eog: s.is_eog,
                    logprobs: s.logprobs,
                })
                .collect();
            outcome.purged.extend(purged);
            outcome.n_splits = n_splits;
            outcome.failed = failed;
        }
        outcome.eval_us = started.elapsed().as_micros() as u64;
        outcome.kv_free_tokens = self.kv.free_tokens();
        outcome.kv_occupancy = self.kv.occupancy();
        Ok(outcome)
    }
}

/// How a finished step is delivered.
pub type Reply = Box<dyn FnOnce(Result<StepOutcome>) + Send>;

struct Job {
    step: Step,
    reply: Reply,
}

/// A thread that runs steps on one context, one after another, so whoever submits them (the
/// Server's GenServer) never waits for a forward pass.
pub struct EngineThread {
    tx: Mutex<Option<Sender<Job>>>,
}

impl EngineThread {
    /// Starts the thread; it ends when [`EngineThread::stop`] is called or this value is
    /// dropped, after the step it is running.
    pub fn start(ctx: Arc<Mutex<Context>>) -> Result<Self> {
        let (tx, rx) = unbounded::<Job>();
        std::thread::Builder::new()
            .name("llama_cpp_ex-engine".into())
            .spawn(move || {
                for job in rx {
                    let result = catch_unwind(AssertUnwindSafe(|| lock(&ctx).step(&job.step)))
                        .unwrap_or_else(|payload| Err(EngineError::internal(payload)));
                    (job.reply)(result);
                }
            })
            .map_err(|e| EngineError::Internal(format!("cannot start the engine thread: {e}")))?;
        Ok(EngineThread {
            tx: Mutex::new(Some(tx)),
        })
    }

    /// Queues a step; `reply` is called with its outcome on the engine thread.
    pub fn submit(&self, step: Step, reply: Reply) -> Result<()> {
        let tx = lock(&self.tx);
        let tx = tx
            .as_ref()
            .ok_or_else(|| EngineError::Internal("the engine thread was stopped".into()))?;
        tx.send(Job { step, reply })
            .map_err(|_| EngineError::Internal("the engine thread is gone".into()))
    }

    /// Stops accepting steps; queued steps still run.
    pub fn stop(&self) {
        lock(&self.tx).take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stopped_engine_refuses_steps() {
        let (tx, _rx) = unbounded::<Job>();
        let engine = EngineThread {
            tx: Mutex::new(Some(tx)),
        };
        engine.stop();
        let err = engine
            .submit(Step::default(), Box::new(|_| {}))
            .unwrap_err();
        assert!(err.to_string().contains("stopped"), "{err}");
    }
}
