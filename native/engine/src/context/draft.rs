//! Draft-model speculation: a smaller model sharing the target's vocabulary proposes the next
//! tokens of a sequence from its own KV cache, and the target verifies them in one forward
//! pass by the same rule as prompt-lookup drafts (`speculate.rs`).
//!
//! Drafts are greedy (the draft model's most likely token at each position), so the draft
//! distribution q is one-hot and the rejection-sampling rule "accept with min(1, p/q), else
//! resample from the normalised residual" is exactly the verification rule: sample x ~ p with
//! the request's own sampler, keep the draft token if x equals it, else emit x. The output
//! distribution is the target's, for every sampler, and a seeded request gives the same text
//! as without speculation. A sampled draft would accept more often at high temperature but
//! would make the request's random stream depend on the draft model.

use super::Context;
use crate::batch::Batch;
use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::tokenizer::TokenId;

/// At most this many tokens a draft cache lacks go into the first draft pass (the tokens
/// accepted since the last draft, typically) instead of a pass of their own.
const TAIL: usize = 16;

/// A draft model's context and what its cache holds per sequence.
pub struct DraftModel {
    ctx: Context,
    /// Per sequence: the tokens its draft cache holds, in order.
    held: Vec<Vec<TokenId>>,
}

/// One sequence to draft for: its tokens so far (the one the target evaluates next last) and
/// the most draft tokens wanted.
#[derive(Debug, Clone, Copy)]
pub struct DraftRequest<'a> {
    pub seq: usize,
    pub history: &'a [TokenId],
    pub max: usize,
}

impl DraftModel {
    /// Wraps a context of the draft model; its vocabulary must be the target's.
    pub fn new(ctx: Context, target: &Model) -> Result<Self> {
        let (d, t) = (&ctx.model.tokenizer, &target.tokenizer);
        if d.n_vocab() != t.n_vocab() || d.bos != t.bos || d.eos != t.eos {
            return Err(EngineError::InvalidArgument(format!(
                "the draft model's vocabulary ({} tokens) is not the target's ({} tokens)",
                d.n_vocab(),
                t.n_vocab()
            )));
        }
        let n_seq = ctx.params.n_seq_max;
        Ok(DraftModel {
            ctx,
            held: vec![Vec::new(); n_seq],
        })
    }

    /// Greedy drafts for several sequences, batched: first each draft cache catches up with
    /// its history (what it already holds is kept; the last few tokens it lacks join the
    /// first draft pass), then up to `max` passes of one token per sequence. A sequence whose
    /// draft cannot be computed (its draft cache full) gets an empty or shorter draft;
    /// speculation is an optimisation, never a failure.
    pub fn draft(&mut self, reqs: &[DraftRequest<'_>]) -> Vec<Vec<TokenId>> {
        let mut drafts: Vec<Vec<TokenId>> = vec![Vec::new(); reqs.len()];
        // (index into reqs, where the tokens fed next start in its history)
        let mut first: Vec<(usize, usize)> = Vec::with_capacity(reqs.len());
        for (i, r) in reqs.iter().enumerate() {
            if r.max == 0 || r.seq >= self.held.len() || r.history.is_empty() {
                continue;
            }
            let mut caught_up = self.catch_up(r.seq, r.history);
            if caught_up.is_err() {
                // caches of sequences that ended since are dropped lazily: free them and retry
                self.forget(r.seq);
                let active: Vec<usize> = reqs.iter().map(|r| r.seq).collect();
                for seq in 0..self.held.len() {
                    if !active.contains(&seq) {
                        self.forget(seq);
                    }
                }
                caught_up = self.catch_up(r.seq, r.history);
            }
            match caught_up {
                Ok(from) => first.push((i, from)),
                Err(_) => self.forget(r.seq),
            }
        }
        let n_ctx = self.ctx.params.n_ctx;
        // the first pass feeds each sequence's unevaluated tail and its last token (logits
        // only for that one); every later pass one token per sequence
        let mut live: Vec<(usize, usize, usize)> = first
            .iter()
            .map(|&(i, from)| (i, from, reqs[i].history.len()))
            .collect();
        let mut pass = 0;
        while !live.is_empty() {
            live.retain(|&(_, _, end)| end <= n_ctx);
            let mut batch = Batch::with_capacity(live.len());
            // each live sequence's entry with logits
            let mut rows = Vec::with_capacity(live.len());
            for &(i, from, end) in &live {
                let tokens = if pass == 0 {
                    &reqs[i].history[from..end]
                } else {
                    &drafts[i][drafts[i].len() - 1..]
                };
                let start = end - tokens.len();
                for (k, &t) in tokens.iter().enumerate() {
                    batch.push(t, start + k, reqs[i].seq, start + k + 1 == end);
                }
                rows.push(batch.len() - 1);
            }
            if batch.is_empty() || self.ctx.decode(&batch).is_err() {
                for &(i, _, _) in &live {
                    self.forget(reqs[i].seq);
                    drafts[i].clear();
                }
                break;
            }
            let mut next = Vec::with_capacity(live.len());
            for (&row, &(i, from, end)) in rows.iter().zip(&live) {
                let seq = reqs[i].seq;
                if pass == 0 {
                    self.held[seq].extend_from_slice(&reqs[i].history[from..end]);
                } else {
                    let last = drafts[i][drafts[i].len() - 1];
                    self.held[seq].push(last);
                }
                let Ok(logits) = self.ctx.logits_ith(row as i64) else {
                    continue;
                };
                drafts[i].push(crate::sampler::argmax(logits) as TokenId);
                if drafts[i].len() < reqs[i].max {
                    next.push((i, from, end + 1));
                }
            }
            live = next;
            pass += 1;
        }
        drafts
    }

    /// Makes the draft cache of `seq` hold a prefix of `history` (what it already holds in
    /// common is kept) and returns where the rest starts: a long rest is evaluated in chunks
    /// without logits, the last few tokens are left to the first draft pass.
    fn catch_up(&mut self, seq: usize, history: &[TokenId]) -> Result<usize> {
        let held = &self.held[seq];
        let keep = held
            .iter()
            .zip(history)
            .take_while(|(a, b)| a == b)
            .count()
            .min(history.len() - 1);
        if keep < held.len() {
            if !self.ctx.kv.seq_rm(seq, keep, None)? {
                self.forget(seq);
                return self.catch_up(seq, history);
            }
            self.held[seq].truncate(keep);
        }
        let target = history.len().saturating_sub(TAIL).max(keep);
        let chunk = self.ctx.params.n_batch.max(1);
        let mut pos = keep;
        while pos < target {
            let end = (pos + chunk).min(target);
            let mut batch = Batch::with_capacity(end - pos);
            for (p, &t) in history.iter().enumerate().take(end).skip(pos) {
                batch.push(t, p, seq, false);
            }
            self.ctx.decode(&batch)?;
            self.held[seq].extend_from_slice(&history[pos..end]);
            pos = end;
        }
        Ok(target)
    }

    /// Drops what the draft cache of `seq` holds.
    pub fn forget(&mut self, seq: usize) {
        if seq < self.held.len() {
            self.ctx.kv.seq_clear(seq);
            self.held[seq].clear();
        }
    }
}
