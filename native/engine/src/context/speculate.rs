//! Lossless speculative decoding inside a step: a speculating sequence's next token and a
//! draft after it — looked up in the sequence's own tokens (prompt lookup) or the attached
//! draft model's greedy continuation — are evaluated in the same forward pass, with logits
//! at every position.
//!
//! Verification samples the positions in order with the request's own sampler and stops at
//! the first sampled token that differs from the draft. This is lossless for every sampler,
//! not only greedy: a draft is a single token per position (a one-hot draft distribution q),
//! for which the rejection-sampling rule "accept with min(1, p/q), else resample from the
//! normalised residual" is exactly "sample x ~ p; keep the draft if x equals it, else emit
//! x". The sampler sees the same logits, the same accepted tokens and draws the same random
//! numbers (one per emitted token) as without speculation, so a seeded request gives the same
//! text, and penalties, grammars and logit biases the same states. Rejected positions are
//! rolled back from the KV cache before the step returns.

use super::draft::{DraftModel, DraftRequest};
use super::step::SampledToken;
use super::Context;
use crate::batch::Batch;
use crate::error::{EngineError, Result};
use crate::sampler::Sampler;
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

/// A sequence decoding speculatively this step. The engine keeps the tokens each speculating
/// sequence has fed; a request sends what it fed since its last step, so a step costs the
/// same whatever the context's length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecRequest {
    pub seq: usize,
    /// The tokens fed since the sequence's last speculating step (every token of it with
    /// `reset`), the one evaluated in this step last.
    pub tokens: Vec<TokenId>,
    /// The tokens start the sequence's history over (a new request on the sequence).
    pub reset: bool,
    pub source: DraftSource,
}

/// Where a speculating sequence's drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftSource {
    /// Copied from the sequence's own earlier tokens.
    PromptLookup(PromptLookup),
    /// Greedy tokens of the context's attached draft model ([`Context::attach_draft`]).
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

impl Context {
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

    /// Appends each spec's tokens to its sequence's history (started over with `reset`); a
    /// history cannot outgrow the context, as the cache it mirrors cannot.
    fn record_histories(&mut self, specs: &[SpecRequest]) -> Result<()> {
        for spec in specs {
            let seq = self.kv.check_seq(spec.seq as i64)?;
            if matches!(spec.source, DraftSource::DraftModel { .. }) && self.drafter.is_none() {
                return Err(EngineError::InvalidArgument(
                    "speculation: no draft model is attached to this context".into(),
                ));
            }
            if self.spec_history.len() <= seq {
                self.spec_history.resize_with(seq + 1, Vec::new);
            }
            let history = &mut self.spec_history[seq];
            if spec.reset {
                history.clear();
            }
            if history.len() + spec.tokens.len() > self.params.n_ctx {
                return Err(EngineError::InvalidArgument(format!(
                    "speculation: sequence {seq} would have sent {} tokens, more than n_ctx {}",
                    history.len() + spec.tokens.len(),
                    self.params.n_ctx
                )));
            }
            history.extend_from_slice(&spec.tokens);
        }
        Ok(())
    }

    /// The tokens speculating requests sent for `seq` so far.
    fn history(&self, seq: usize) -> &[TokenId] {
        self.spec_history.get(seq).map_or(&[], Vec::as_slice)
    }

    /// Records the specs' tokens, then appends drafts for their sequences to `batch` (each
    /// after the sequence's one logits entry, its next token, which must be the last token of
    /// its history), within the batch size, the context and the free KV blocks; the attached
    /// draft model drafts for all its sequences in one batched pass per draft position.
    /// Returns the number of draft tokens per sequence.
    pub(super) fn add_drafts(
        &mut self,
        batch: &mut Batch,
        specs: &[SpecRequest],
    ) -> Result<Vec<(usize, usize)>> {
        self.record_histories(specs)?;
        // each speculating sequence's next-token row
        let rows: Vec<Option<usize>> = specs
            .iter()
            .map(|spec| {
                (0..batch.len())
                    .find(|&i| batch.seq[i] == spec.seq && batch.logits[i])
                    .filter(|&i| self.history(spec.seq).last() == Some(&batch.tokens[i]))
            })
            .collect();
        let mut drafts: Vec<Vec<TokenId>> = specs
            .iter()
            .zip(&rows)
            .map(|(spec, row)| match (&spec.source, row) {
                (DraftSource::PromptLookup(lookup), Some(_)) => {
                    lookup.draft(self.history(spec.seq))
                }
                _ => Vec::new(),
            })
            .collect();
        let n_ctx = self.params.n_ctx;
        let wanted: Vec<(usize, DraftRequest)> = specs
            .iter()
            .zip(&rows)
            .enumerate()
            .filter_map(|(k, (spec, row))| match (&spec.source, row) {
                (DraftSource::DraftModel { n_draft }, Some(row)) => Some((
                    k,
                    DraftRequest {
                        seq: spec.seq,
                        history: self.spec_history[spec.seq].as_slice(),
                        max: (*n_draft).min(n_ctx.saturating_sub(batch.pos[*row] + 1)),
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
        Ok(drafted)
    }

    /// Appends `draft` after entry `row` of `batch` (the token it follows), at most `budget`
    /// tokens and within the context and the batch size; returns how many went in.
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

    /// Verifies a draft evaluated in the last batch: `rows` are the entries of `seq` with
    /// logits, in position order (its next token, then the draft tokens). Samples them in
    /// order with `sampler`, stopping at the first token that differs from the next draft
    /// token (or ends generation), pushes the tokens emitted onto `out`, then rolls the cache
    /// back past the last accepted position.
    pub(super) fn verify_draft(
        &mut self,
        seq: usize,
        rows: &[usize],
        batch: &Batch,
        sampler: &mut Sampler,
        out: &mut Vec<SampledToken>,
    ) -> Result<()> {
        let mut emitted = 0;
        for (k, &row) in rows.iter().enumerate() {
            let (t, logprobs) = sampler.sample_with_logprobs(self.logits_ith(row as i64)?);
            let sampled = self.sampled_token(seq, t, logprobs);
            let is_eog = sampled.is_eog;
            out.push(sampled);
            emitted += 1;
            let draft_next = rows.get(k + 1).map(|&r| batch.tokens[r]);
            if draft_next != Some(t) || is_eog {
                break;
            }
        }
        // keep the evaluated token and the accepted drafts; drop the rest
        let pos = batch.pos[rows[0]];
        let keep = pos + emitted;
        if keep < pos + rows.len() && !self.kv.seq_rm(seq, keep, None)? {
            return Err(EngineError::Internal(
                "speculation: the rejected draft could not be rolled back".into(),
            ));
        }
        Ok(())
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
