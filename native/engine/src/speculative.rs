//! Prompt-lookup speculative decoding (no draft model): when the last tokens of a sequence
//! occurred earlier in its prompt or output, the tokens that followed them then are proposed
//! as a draft, and the sequence's next token and the whole draft are evaluated in ONE forward
//! pass with logits at every position.
//!
//! Verification samples the positions in order with the request's own sampler and stops at
//! the first sampled token that differs from the draft. This is lossless for every sampler,
//! not only greedy: a prompt-lookup draft is a single token per position (a one-hot draft
//! distribution q), for which the rejection-sampling rule "accept with min(1, p/q), else
//! resample from the normalised residual" is exactly "sample x ~ p; keep the draft if x
//! equals it, else emit x". The sampler sees the same logits, the same accepted tokens and
//! draws the same random numbers (one per emitted token) as without speculation, so a seeded
//! request gives the same text, and penalties, grammars and logit biases the same states.
//! Rejected positions are rolled back from the KV cache before the step returns.

mod draft;
pub use draft::{DraftModel, DraftRequest};

use crate::batch::Batch;
use crate::context::Context;
use crate::error::{EngineError, Result};
use crate::sampler::{Sampler, TokenLogprobs};
use crate::tokenizer::TokenId;

/// How drafts are looked up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLookup {
    /// Most draft tokens per step.
    pub n_draft: usize,
    /// Longest and shortest suffix searched for (longest first).
    pub ngram_max: usize,
    pub ngram_min: usize,
}

impl Default for PromptLookup {
    fn default() -> Self {
        PromptLookup {
            n_draft: 8,
            ngram_max: 4,
            ngram_min: 2,
        }
    }
}

impl PromptLookup {
    /// The draft after `history` (which ends with the token about to be evaluated): the
    /// tokens that followed the latest earlier occurrence of its longest matching suffix.
    pub fn draft(&self, history: &[TokenId]) -> Vec<TokenId> {
        let n = history.len();
        for len in (self.ngram_min.max(1)..=self.ngram_max).rev() {
            if len >= n {
                continue;
            }
            let pattern = &history[n - len..];
            // latest earlier occurrence (not the suffix itself), with at least one follower
            for start in (0..n - len).rev() {
                if &history[start..start + len] == pattern {
                    let from = start + len;
                    let to = (from + self.n_draft).min(n);
                    return history[from..to].to_vec();
                }
            }
        }
        Vec::new()
    }
}

/// One verified token.
#[derive(Debug, Clone, PartialEq)]
pub struct Verified {
    pub token: TokenId,
    pub is_eog: bool,
    pub logprobs: Option<TokenLogprobs>,
}

/// What one speculative step did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecOutcome {
    /// The tokens emitted, in order: accepted draft tokens, then the token sampled where the
    /// draft stopped (or after the whole draft). At least one.
    pub tokens: Vec<Verified>,
    /// Draft tokens proposed (accepted: `tokens.len() - 1`).
    pub n_drafted: usize,
}

impl Context {
    /// Evaluates `token` at `pos` of `seq` together with a draft from `source` — looked up in
    /// `history` (the sequence's tokens so far, `token` last) or the attached draft model's
    /// greedy continuation of it — verifies the draft with `sampler` and rolls back the
    /// rejected positions: the cache then holds `seq` up to `pos + tokens.len()` and the last
    /// emitted token is the next one to evaluate.
    pub fn speculate(
        &mut self,
        seq: usize,
        token: TokenId,
        pos: usize,
        history: &[TokenId],
        sampler: &mut Sampler,
        source: DraftSource,
    ) -> Result<SpecOutcome> {
        if history.last() != Some(&token) {
            return Err(EngineError::InvalidArgument(
                "speculate: the history must end with the token being evaluated".into(),
            ));
        }
        if matches!(source, DraftSource::DraftModel { .. }) && self.drafter.is_none() {
            return Err(EngineError::InvalidArgument(
                "speculate: no draft model is attached to this context".into(),
            ));
        }
        let mut batch = Batch::with_capacity(1);
        batch.push(token, pos, seq, true);
        // the Server's path with one sequence: the same draft sources, the same limits
        let spec = SpecRequest {
            seq,
            history: history.to_vec(),
            source,
        };
        let n_drafted = self
            .add_drafts(&mut batch, std::slice::from_ref(&spec))
            .first()
            .map_or(0, |&(_, n)| n);
        self.decode(&batch)?;
        let rows: Vec<usize> = (0..=n_drafted).collect();
        let tokens = self.verify_draft(seq, &rows, &batch, sampler)?;
        Ok(SpecOutcome { tokens, n_drafted })
    }

    /// Attaches a draft model's context for [`DraftSource::DraftModel`] drafts: its
    /// vocabulary must be this model's and it must hold as many sequences as this context.
    pub fn attach_draft(&mut self, draft: Context) -> Result<()> {
        if draft.params.n_seq_max < self.params.n_seq_max {
            return Err(EngineError::InvalidArgument(format!(
                "the draft context holds {} sequences, this context {}",
                draft.params.n_seq_max, self.params.n_seq_max
            )));
        }
        self.drafter = Some(Box::new(DraftModel::new(draft, &self.model)?));
        Ok(())
    }

    /// Verifies a draft evaluated in the last batch: `rows` are the entries of `seq` with
    /// logits, in position order (its next token, then the draft tokens). Samples them in
    /// order with `sampler`, stopping at the first token that differs from the next draft
    /// token (or ends generation), then rolls the cache back past the last accepted position.
    /// The one verification rule of the local and the Server's speculation.
    pub(crate) fn verify_draft(
        &mut self,
        seq: usize,
        rows: &[usize],
        batch: &Batch,
        sampler: &mut Sampler,
    ) -> Result<Vec<Verified>> {
        let mut out = Vec::with_capacity(rows.len());
        for (k, &row) in rows.iter().enumerate() {
            let (t, logprobs) = sampler.sample_with_logprobs(self.logits_ith(row as i64)?);
            let is_eog = self.model.tokenizer.is_eog(t);
            out.push(Verified {
                token: t,
                is_eog,
                logprobs,
            });
            let draft_next = rows.get(k + 1).map(|&r| batch.tokens[r]);
            if draft_next != Some(t) || is_eog {
                break;
            }
        }
        // keep the evaluated token and the accepted drafts; drop the rest
        let pos = batch.pos[rows[0]];
        let keep = pos + out.len();
        if keep < pos + rows.len() && !self.kv.seq_rm(seq, keep, None)? {
            return Err(EngineError::Internal(
                "speculation: the rejected draft could not be rolled back".into(),
            ));
        }
        Ok(out)
    }

    /// Appends drafts for the sequences of `specs` to `batch` (each after the sequence's one
    /// logits entry, its next token), within the batch size, the context and the free KV
    /// blocks; the attached draft model drafts for all its sequences in one batched pass per
    /// draft position. Returns the number of draft tokens per sequence.
    pub(crate) fn add_drafts(
        &mut self,
        batch: &mut Batch,
        specs: &[SpecRequest],
    ) -> Vec<(usize, usize)> {
        // each speculating sequence's next-token row
        let rows: Vec<Option<usize>> = specs
            .iter()
            .map(|spec| {
                (0..batch.len())
                    .find(|&i| batch.seq[i] == spec.seq && batch.logits[i])
                    .filter(|&i| spec.history.last() == Some(&batch.tokens[i]))
            })
            .collect();
        let mut drafts: Vec<Vec<TokenId>> = specs
            .iter()
            .zip(&rows)
            .map(|(spec, row)| match (&spec.source, row) {
                (DraftSource::PromptLookup(lookup), Some(_)) => lookup.draft(&spec.history),
                _ => Vec::new(),
            })
            .collect();
        let wanted: Vec<(usize, DraftRequest)> = specs
            .iter()
            .zip(&rows)
            .enumerate()
            .filter_map(|(k, (spec, row))| match (&spec.source, row) {
                (DraftSource::DraftModel { n_draft }, Some(row)) => Some((
                    k,
                    DraftRequest {
                        seq: spec.seq,
                        history: &spec.history,
                        max: (*n_draft).min(self.params.n_ctx.saturating_sub(batch.pos[*row] + 1)),
                    },
                )),
                _ => None,
            })
            .collect();
        if let (false, Some(drafter)) = (wanted.is_empty(), self.drafter.as_mut()) {
            let reqs: Vec<DraftRequest> = wanted.iter().map(|(_, r)| *r).collect();
            for ((k, _), d) in wanted.iter().zip(drafter.draft(&reqs)) {
                drafts[*k] = d;
            }
        }
        // draft rows only where blocks are surely free: the batch's own needs first
        let mut budget = self
            .kv
            .free_tokens()
            .saturating_sub(batch.len() + crate::kv::KV_BLOCK_SIZE * specs.len());
        let mut drafted = Vec::with_capacity(specs.len());
        for ((spec, row), draft) in specs.iter().zip(rows).zip(drafts) {
            let Some(row) = row else { continue };
            let n = self.push_draft(batch, row, draft, budget);
            budget -= n;
            drafted.push((spec.seq, n));
        }
        drafted
    }

    /// Appends `draft` after entry `row` of `batch` (the token it follows), at most `budget`
    /// tokens and within the context and the batch size; returns how many went in. The one
    /// draft rule of the local and the Server's speculation.
    fn push_draft(
        &self,
        batch: &mut Batch,
        row: usize,
        mut draft: Vec<TokenId>,
        budget: usize,
    ) -> usize {
        let (seq, pos) = (batch.seq[row], batch.pos[row]);
        let room = self.params.n_ctx.saturating_sub(pos + 1);
        let batch_room = self.params.n_batch.saturating_sub(batch.len());
        draft.truncate(room.min(batch_room).min(budget));
        for (k, &d) in draft.iter().enumerate() {
            batch.push(d, pos + 1 + k, seq, true);
        }
        draft.len()
    }
}

/// A Server request decoding speculatively this step: its sequence's tokens so far (the one
/// being evaluated last) and where its drafts come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecRequest {
    pub seq: usize,
    pub history: Vec<TokenId>,
    pub source: DraftSource,
}

/// Where a speculating sequence's drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftSource {
    /// Copied from the sequence's own earlier tokens.
    PromptLookup(PromptLookup),
    /// Greedy tokens of the context's attached draft model ([`Context::attach_draft`]); none
    /// when no draft model is attached.
    DraftModel { n_draft: usize },
}

impl DraftSource {
    /// At most `n_draft` tokens from the attached draft model, or else looked up (with the
    /// default n-gram lengths).
    pub fn new(n_draft: usize, draft_model: bool) -> Self {
        if draft_model {
            DraftSource::DraftModel { n_draft }
        } else {
            DraftSource::PromptLookup(PromptLookup {
                n_draft,
                ..PromptLookup::default()
            })
        }
    }
}

/// The decoder interface speculative decoding is built on (ferrum's `forward_verify`,
/// `truncate_kv`, `prepare`, `kv_capacity`).
impl Context {
    /// Evaluates `tokens` of `seq` from position `pos` in one pass and returns the logits of
    /// every position (`[tokens.len(), n_vocab]`), borrowed from the context (no copy).
    pub fn forward_verify(&mut self, seq: usize, pos: usize, tokens: &[TokenId]) -> Result<&[f32]> {
        if tokens.is_empty() {
            return Err(EngineError::InvalidArgument(
                "forward_verify: no tokens".into(),
            ));
        }
        let mut batch = Batch::with_capacity(tokens.len());
        for (i, &t) in tokens.iter().enumerate() {
            batch.push(t, pos + i, seq, true);
        }
        self.decode(&batch)?;
        Ok(self.last_logits())
    }

    /// Rolls `seq` back to its first `new_len` positions, freeing the blocks past them
    /// (O(blocks)); blocks shared with other sequences are only released by this one, so a
    /// shared prefix stays intact for its other holders.
    pub fn truncate_kv(&mut self, seq: usize, new_len: usize) -> Result<()> {
        let seq = self.kv.check_seq(seq as i64)?;
        if self.kv.seq_rm(seq, new_len, None)? {
            Ok(())
        } else {
            Err(EngineError::Unsupported(format!(
                "truncate_kv: sequence {seq} cannot be rolled back to {new_len} positions \
                 (its sliding-window layers already dropped what that needs); it was cleared"
            )))
        }
    }

    /// Reserves the blocks `seq` needs to grow by `max_tokens` positions, so that those
    /// steps cannot fail for lack of KV blocks; `{:context_full}` now if they do not fit.
    pub fn prepare(&mut self, seq: usize, max_tokens: usize) -> Result<()> {
        let seq = self.kv.check_seq(seq as i64)?;
        let len = self.kv.seq_len(seq);
        if len + max_tokens > self.params.n_ctx {
            return Err(EngineError::PastContext {
                seq,
                held: len,
                more: max_tokens,
                n_ctx: self.params.n_ctx,
            });
        }
        self.kv.reserve(seq, len, len + max_tokens)
    }

    /// How many more positions `seq` can grow by: the context's `n_ctx` minus what it holds,
    /// bounded by its reserved room plus the free blocks.
    pub fn kv_capacity(&self, seq: usize) -> Result<usize> {
        let seq = self.kv.check_seq(seq as i64)?;
        let len = self.kv.seq_len(seq);
        let by_ctx = self.params.n_ctx.saturating_sub(len);
        Ok(by_ctx.min(self.kv.room(seq)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_is_what_followed_the_latest_match() {
        let l = PromptLookup {
            n_draft: 3,
            ngram_max: 3,
            ngram_min: 1,
        };
        // "... 1 2 3 9 9 ... 1 2 3 7 8 ... 1 2 3" → after the latest "1 2 3": 7 8 5
        let h = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3];
        assert_eq!(l.draft(&h), vec![7, 8, 5]);
        // no earlier occurrence of any suffix
        assert_eq!(l.draft(&[4, 5, 6]), Vec::<TokenId>::new());
        // a shorter suffix when the longer ones never occurred
        assert_eq!(l.draft(&[5, 6, 1, 7, 6]), vec![1, 7, 6]);
    }
}
