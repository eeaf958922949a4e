//! A context: a model, a paged KV cache sized by `n_ctx`, and the logits of the last forward
//! pass. Its one driver is [`Context::step`] (`step.rs`): cache edits, one batched forward
//! pass and a sampled token per sequence that asks for one, speculation included
//! (`speculate.rs`, drafts from a draft model in `draft.rs`). [`Context::decode`] is the bare
//! forward pass under it, for callers that only fill the cache.

mod draft;
mod speculate;
mod step;

pub use draft::{DraftModel, DraftRequest};
pub use speculate::{DraftSource, PromptLookup, SpecRequest};
pub use step::{KvOp, SampledToken, SharedSampler, Step, StepOutcome};

use crate::batch::Batch;
use crate::error::{EngineError, Result};
use crate::kv::{KvCache, KvType, KvUsage};
use crate::model::{Model, Pick, Workspace};
use crate::tokenizer::TokenId;
use std::sync::Arc;

/// Hard ceiling on `n_ctx`, far above any model's training context, so that a typo cannot
/// size a cache of terabytes.
pub const MAX_CONTEXT_TOKENS: usize = 1 << 22;
/// Most sequences one context holds.
pub const MAX_SEQUENCES: usize = 4096;
/// `n_ctx` when none is given.
pub const DEFAULT_CONTEXT_TOKENS: usize = 2048;
/// Largest batch a single forward pass evaluates; bigger batches are split.
pub const DEFAULT_UBATCH: usize = 512;

#[derive(Debug, Clone)]
pub struct ContextParams {
    pub n_ctx: usize,
    pub n_batch: usize,
    pub n_ubatch: usize,
    pub n_seq_max: usize,
    /// Of `n_seq_max`, the last sequences that hold embedding texts for one step only
    /// ([`Step::embeds`]): they borrow KV blocks from the `n_ctx` budget.
    pub n_seq_embd: usize,
    /// Precision of cached keys, and of cached values (`None`: as the keys).
    pub kv_type: KvType,
    pub kv_type_v: Option<KvType>,
    /// Lower precisions (keys and values alike) the cache may switch newly written blocks to,
    /// highest first, all within the byte budget `n_ctx` tokens take at `kv_type`/`kv_type_v`
    /// (the Server's `kv_policy`, through [`KvOp::SetWriteTier`]); empty: one precision.
    pub kv_pressure_types: Vec<KvType>,
    /// Threads a one-token forward pass of this context uses (the calling thread included).
    pub n_threads: usize,
    /// Threads a forward pass over several tokens uses.
    pub n_threads_batch: usize,
}

impl Default for ContextParams {
    fn default() -> Self {
        ContextParams {
            n_ctx: DEFAULT_CONTEXT_TOKENS,
            n_batch: DEFAULT_CONTEXT_TOKENS,
            n_ubatch: DEFAULT_UBATCH,
            n_seq_max: 1,
            n_seq_embd: 0,
            kv_type: KvType::F16,
            kv_type_v: None,
            kv_pressure_types: Vec::new(),
            n_threads: crate::pool::default_threads(),
            n_threads_batch: crate::pool::default_threads(),
        }
    }
}

/// What a step's entry got in place of its logits row (see [`Pick`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Picked {
    /// Its row (or nothing: no logits were asked for).
    None,
    /// Its greedy token.
    Token(TokenId),
    /// Its best candidates, at this range of the context's.
    Best(std::ops::Range<usize>),
}

pub struct Context {
    pub model: Arc<Model>,
    pub params: ContextParams,
    pub kv: KvCache,
    /// Logits rows of the last forward pass, `[n_outputs, n_vocab]` (or, in embeddings mode,
    /// hidden-state rows `[n_outputs, n_embd]`).
    logits: Vec<f32>,
    /// For each entry of the last batch, its logits row (or -1).
    output_rows: Vec<i32>,
    /// For each entry of the batch a step evaluates, how its row comes back: whole, or as
    /// what its sampler reads of it, taken where the logits are (empty outside a step, or
    /// when the architecture does not pick: [`Architecture::picks`]).
    ///
    /// [`Architecture::picks`]: crate::model::Architecture::picks
    pick: Vec<Pick>,
    /// For each entry of the last batch, what came back in place of its row.
    picked: Vec<Picked>,
    /// The best candidates of the last batch's [`Picked::Best`] entries.
    candidates: Vec<(TokenId, f32)>,
    /// Final-normed hidden states of the last batch's embedding rows (`[n, n_embd]`, see
    /// [`Batch::embd`]), and for each entry its row there (or -1).
    embd: Vec<f32>,
    embd_rows: Vec<i32>,
    /// Buffers reused by every forward pass and batch check (no allocation per token).
    ws: Workspace,
    next_pos: Vec<Option<usize>>,
    ranges: Vec<(usize, usize, usize)>,
    /// Per sequence, the tokens a speculating request has sent so far (its cache's tokens):
    /// drafts are looked up in them and a draft model catches up on them. A request sends
    /// only what it fed since its last step ([`SpecRequest`]).
    spec_history: Vec<Vec<TokenId>>,
    /// A draft model attached for speculative decoding (its own context and KV), used by
    /// sequences that ask for draft-model drafts.
    drafter: Option<Box<DraftModel>>,
    /// `(seq, token, end of generation?)` of the last token the last step sampled for each
    /// sequence: what a [`Step::follow`] entry of the next step feeds.
    last_sampled: Vec<(usize, TokenId, bool)>,
}

impl Context {
    pub fn new(model: Arc<Model>, params: ContextParams) -> Result<Self> {
        if params.n_ctx == 0 || params.n_ctx > MAX_CONTEXT_TOKENS {
            return Err(EngineError::InvalidArgument(format!(
                "n_ctx must be in 1..={MAX_CONTEXT_TOKENS}, got {}",
                params.n_ctx
            )));
        }
        if params.n_batch == 0 || params.n_ubatch == 0 {
            return Err(EngineError::InvalidArgument(
                "n_batch and n_ubatch must be positive".into(),
            ));
        }
        if params.n_seq_max == 0 || params.n_seq_max > MAX_SEQUENCES {
            return Err(EngineError::InvalidArgument(format!(
                "n_seq_max must be in 1..={MAX_SEQUENCES}, got {}",
                params.n_seq_max
            )));
        }
        let max_threads = crate::pool::max_threads();
        for (name, n) in [
            ("n_threads", params.n_threads),
            ("n_threads_batch", params.n_threads_batch),
        ] {
            if n == 0 || n > max_threads {
                return Err(EngineError::InvalidArgument(format!(
                    "{name} must be in 1..={max_threads} (twice this machine's cores), got {n}"
                )));
            }
        }
        model.architecture()?;
        let c = &model.config;
        let mut tiers = vec![(params.kv_type, params.kv_type_v.unwrap_or(params.kv_type))];
        tiers.extend(params.kv_pressure_types.iter().map(|&t| (t, t)));
        let row = c.n_head_kv * c.head_dim;
        let sizes: Vec<usize> = tiers
            .iter()
            .map(|&(k, v)| crate::kv::bytes_per_token(1, c.n_head_kv, c.head_dim, k, v))
            .collect();
        if row > 0 && sizes.windows(2).any(|w| w[1] >= w[0]) {
            return Err(EngineError::InvalidArgument(
                "each KV pressure precision must take fewer bytes than the one before it".into(),
            ));
        }
        let mut kv = KvCache::with_tiers(
            &c.layer_windows,
            c.n_head_kv,
            c.head_dim,
            params.n_ctx,
            (params.n_seq_max, params.n_seq_embd),
            &tiers,
        )?;
        if model.architecture()?.kv_on_device() {
            if tiers != [(KvType::F16, KvType::F16)] {
                return Err(EngineError::Unsupported(
                    "KV cache types other than f16 with a model on a GPU".into(),
                ));
            }
            kv.keep_on_device()?;
        }
        let n_ctx_seq = params.n_ctx;
        Ok(Context {
            model,
            params,
            kv,
            logits: Vec::new(),
            output_rows: Vec::new(),
            pick: Vec::new(),
            picked: Vec::new(),
            candidates: Vec::new(),
            embd: Vec::new(),
            embd_rows: Vec::new(),
            ws: Workspace {
                n_ctx_seq,
                ..Workspace::default()
            },
            next_pos: Vec::new(),
            ranges: Vec::new(),
            spec_history: Vec::new(),
            drafter: None,
            last_sampled: Vec::new(),
        })
    }

    pub fn n_vocab(&self) -> usize {
        self.model.config.n_vocab
    }

    /// Checks a batch: within `n_batch`, known tokens, sequence ids in range, and per
    /// sequence positions that continue its cache without gaps and stay below `n_ctx`. The
    /// one check a batch gets on its way to the forward pass.
    fn validate(&mut self, batch: &Batch) -> Result<()> {
        if batch.is_empty() {
            return Err(EngineError::InvalidArgument("empty batch".into()));
        }
        if batch.len() > self.params.n_batch {
            return Err(EngineError::InvalidArgument(format!(
                "batch of {} tokens exceeds n_batch {}",
                batch.len(),
                self.params.n_batch
            )));
        }
        let mut next = std::mem::take(&mut self.next_pos);
        next.clear();
        next.resize(self.kv.n_seq_max(), None);
        let checked = self.validate_with(batch, &mut next);
        self.next_pos = next;
        checked
    }

    fn validate_with(&self, batch: &Batch, next: &mut [Option<usize>]) -> Result<()> {
        let n = batch.len();
        if batch.pos.len() != n
            || batch.seq.len() != n
            || batch.logits.len() != n
            || !(batch.embd.is_empty() || batch.embd.len() == n)
        {
            return Err(EngineError::InvalidArgument(
                "batch fields differ in length".into(),
            ));
        }
        for i in 0..n {
            self.model.tokenizer.check_id(batch.tokens[i] as i64)?;
            let s = self.kv.check_seq(batch.seq[i] as i64)?;
            if batch.pos[i] >= self.params.n_ctx {
                return Err(EngineError::ContextFull { seq: s });
            }
            let expected = next[s].unwrap_or_else(|| self.kv.seq_len(s));
            if batch.pos[i] != expected {
                return Err(EngineError::InvalidArgument(format!(
                    "position {} of sequence {s} does not continue its cache (next position is {expected})",
                    batch.pos[i]
                )));
            }
            next[s] = Some(expected + 1);
        }
        Ok(())
    }

    /// Evaluates a batch. Logits of flagged entries are then available through
    /// [`Context::logits_ith`]. On error the cache is left as it was before the call for
    /// every sequence of the failing micro-batch.
    pub fn decode(&mut self, batch: &Batch) -> Result<()> {
        self.validate(batch)?;
        self.forward(batch, false)
    }

    /// The forward pass of a validated batch, in micro-batches of `n_ubatch`; `reserved`:
    /// the batch's KV blocks are reserved already (a step reserved them while it made room).
    fn forward(&mut self, batch: &Batch, reserved: bool) -> Result<()> {
        // The last step's logits go back to the workspace, whose output head overwrites
        // them in place (no zeroing); this step's are handed over in `forward_ranges`. Two
        // buffers trade places every step, so neither is copied, cleared or reallocated.
        std::mem::swap(&mut self.logits, &mut self.ws.logits);
        self.logits.clear();
        self.output_rows.clear();
        self.picked.clear();
        self.candidates.clear();
        self.embd.clear();
        self.embd_rows.clear();
        let ub = self.params.n_ubatch;
        if batch.len() <= ub {
            self.set_pick_rows(0..batch.len());
            return self.forward_ubatch(batch, reserved);
        }
        // an encoder attends within its micro-batch only (no cache to read earlier tokens
        // from), so its sequences are never cut: a micro-batch ends between two sequences
        let whole_seqs = !self.model.architecture()?.causal();
        let mut start = 0;
        while start < batch.len() {
            let mut end = (start + ub).min(batch.len());
            if whole_seqs {
                end = micro_batch_end(&batch.seq, start, end);
            }
            self.set_pick_rows(start..end);
            if let Err(e) = self.forward_ubatch(&batch.slice(start..end), reserved) {
                if reserved {
                    // what the later micro-batches had reserved goes too
                    self.release_reserved(&seq_ranges(batch));
                }
                return Err(e);
            }
            start = end;
        }
        debug_assert_eq!(self.logits.len() % self.row_width().max(1), 0);
        Ok(())
    }

    /// Hands the architecture the pick flags of batch entries `range` (a micro-batch).
    fn set_pick_rows(&mut self, range: std::ops::Range<usize>) {
        self.ws.pick_rows.clear();
        if !self.pick.is_empty() {
            self.ws.pick_rows.extend_from_slice(&self.pick[range]);
        }
    }

    fn forward_ubatch(&mut self, batch: &Batch, reserved: bool) -> Result<()> {
        let mut ranges = std::mem::take(&mut self.ranges);
        seq_ranges_into(batch, &mut ranges);
        let done = self.forward_ranges(batch, &ranges, reserved);
        self.ranges = ranges;
        done
    }

    fn forward_ranges(
        &mut self,
        batch: &Batch,
        ranges: &[(usize, usize, usize)],
        reserved: bool,
    ) -> Result<()> {
        if !reserved {
            self.reserve_batch(ranges)
                .map_err(|seq| EngineError::ContextFull { seq })?;
        }
        let arch = self.model.architecture()?;
        let threads = if batch.len() == 1 {
            self.params.n_threads
        } else {
            self.params.n_threads_batch
        };
        let (kv, ws) = (&mut self.kv, &mut self.ws);
        if let Err(e) = crate::pool::with_threads(threads, || arch.forward(batch, kv, ws)) {
            self.release_reserved(ranges);
            return Err(e);
        }
        for &(s, _, to) in ranges {
            self.kv.commit(s, to);
        }
        let width = self.row_width();
        let base = (self.logits.len() / width.max(1)) as i32;
        let mut row = base;
        let mut picked = self.ws.picked.iter();
        let window = arch.picks().unwrap_or(0);
        let mut best = self.candidates.len();
        self.candidates.extend_from_slice(&self.ws.candidates);
        for (i, &want) in batch.logits.iter().enumerate() {
            let pick = self.ws.pick_rows.get(i).copied().unwrap_or_default();
            let (out_row, got) = match (want, pick) {
                (false, _) => (-1, Picked::None),
                (true, Pick::Whole) => {
                    row += 1;
                    (row - 1, Picked::None)
                }
                (true, Pick::Greedy) => (
                    -1,
                    picked.next().map_or(Picked::None, |&t| Picked::Token(t)),
                ),
                (true, Pick::Best) => {
                    best += window;
                    (-1, Picked::Best(best - window..best))
                }
            };
            self.output_rows.push(out_row);
            self.picked.push(got);
        }
        debug_assert!(picked.next().is_none());
        debug_assert_eq!(best, self.candidates.len());
        if self.ws.hidden_only {
            self.logits.extend_from_slice(&self.ws.hidden);
        } else {
            if self.logits.is_empty() {
                // the first micro-batch's rows: taken, not copied (a 1 MB row per token for
                // a 262k vocabulary)
                std::mem::swap(&mut self.logits, &mut self.ws.logits);
            } else {
                self.logits.extend_from_slice(&self.ws.logits);
            }
            // embedding rows are rare: a batch without any costs nothing here (an entry past
            // `embd_rows` has none)
            if batch.has_embd() {
                let d = self.model.config.n_embd;
                let mut row = (self.embd.len() / d) as i32;
                self.embd_rows
                    .resize(self.output_rows.len() - batch.len(), -1);
                for i in 0..batch.len() {
                    if batch.is_embd(i) {
                        self.embd_rows.push(row);
                        row += 1;
                    } else {
                        self.embd_rows.push(-1);
                    }
                }
                self.embd.extend_from_slice(&self.ws.hidden);
            }
        }
        Ok(())
    }

    /// Embeddings mode: decodes leave each flagged token's final hidden state (width
    /// `n_embd`) where logits would be; read them with [`Context::embeddings_ith`].
    pub fn set_embeddings(&mut self, on: bool) {
        self.ws.hidden_only = on;
    }

    fn row_width(&self) -> usize {
        if self.ws.hidden_only {
            self.model.config.n_embd
        } else {
            self.n_vocab()
        }
    }

    /// The final-normed hidden state of entry `i` of the last batch: a flagged entry in
    /// embeddings mode, an embedding row ([`Batch::embd`]) otherwise.
    pub fn embeddings_ith(&self, i: usize) -> Option<&[f32]> {
        let d = self.model.config.n_embd;
        let (rows, data) = if self.ws.hidden_only {
            (&self.output_rows, &self.logits)
        } else {
            (&self.embd_rows, &self.embd)
        };
        let row = *rows.get(i)?;
        (row >= 0).then(|| &data[row as usize * d..(row as usize + 1) * d])
    }

    /// Reserves blocks for every sequence's new positions; on failure releases what was
    /// reserved and names the sequence that did not fit.
    fn reserve_batch(
        &mut self,
        ranges: &[(usize, usize, usize)],
    ) -> std::result::Result<(), usize> {
        for &(s, from, to) in ranges {
            if self.kv.reserve(s, from, to).is_err() {
                self.release_reserved(ranges);
                return Err(s);
            }
        }
        Ok(())
    }

    /// Frees blocks reserved beyond each sequence's committed positions.
    fn release_reserved(&mut self, ranges: &[(usize, usize, usize)]) {
        for &(s, _, _) in ranges {
            self.kv.release_unused(s);
        }
    }

    /// Host↔device copies this context's forward passes have made (all zero on the CPU
    /// backend).
    pub fn device_copies(&self) -> crate::DeviceCopies {
        self.ws.device_copies
    }

    /// What came back for entry `i` of the last step's batch in place of its logits row.
    pub(crate) fn picked_ith(&self, i: usize) -> Picked {
        self.picked.get(i).cloned().unwrap_or(Picked::None)
    }

    /// The best candidates of a [`Picked::Best`] entry.
    pub(crate) fn candidates(&self, at: std::ops::Range<usize>) -> &[(TokenId, f32)] {
        &self.candidates[at]
    }

    /// Logits of entry `i` of the last batch; `-1` is the last entry with logits, and any
    /// other negative index is invalid (as `llama_cpp_ex`'s `sampler_sample_at` has it).
    pub fn logits_ith(&self, i: i64) -> Result<&[f32]> {
        if self.ws.hidden_only {
            return Err(EngineError::InvalidArgument(
                "the context is in embeddings mode (no logits)".into(),
            ));
        }
        let n_vocab = self.n_vocab();
        let row = match i {
            -1 => self.output_rows.iter().rev().find(|&&r| r >= 0).copied(),
            i if i < 0 => None,
            i => self
                .output_rows
                .get(i as usize)
                .copied()
                .filter(|&r| r >= 0),
        }
        .ok_or_else(|| EngineError::InvalidArgument(format!("no logits for batch entry {i}")))?;
        let r = row as usize;
        Ok(&self.logits[r * n_vocab..(r + 1) * n_vocab])
    }

    /// Appends `tokens` to sequence `seq` in `n_batch` chunks. All or nothing: an append
    /// that would grow the sequence past `n_ctx` fails before any evaluation, and a chunk that
    /// fails later (no free block) leaves the sequence as it was before the call.
    pub fn decode_tokens(&mut self, tokens: &[u32], seq: usize) -> Result<()> {
        if tokens.is_empty() {
            return Err(EngineError::InvalidArgument("empty token list".into()));
        }
        let seq = self.kv.check_seq(seq as i64)?;
        let start = self.kv.seq_len(seq);
        if start + tokens.len() > self.params.n_ctx {
            return Err(EngineError::PastContext {
                seq,
                held: start,
                more: tokens.len(),
                n_ctx: self.params.n_ctx,
            });
        }
        let mut pos = start;
        for chunk in tokens.chunks(self.params.n_batch) {
            if let Err(e) = self.decode(&Batch::for_sequence(chunk, pos, seq)) {
                self.kv.seq_rm(seq, start, None)?;
                return Err(e);
            }
            pos += chunk.len();
        }
        Ok(())
    }

    pub fn kv_usage(&self) -> KvUsage {
        self.kv.usage()
    }
}

/// Where a micro-batch `start..end` of `seqs` ends when sequences must stay whole: at the
/// start of the sequence `end` would cut, or, when that sequence began at `start` (longer than
/// a micro-batch), at its end.
fn micro_batch_end(seqs: &[usize], start: usize, end: usize) -> usize {
    if end >= seqs.len() || seqs[end - 1] != seqs[end] {
        return end;
    }
    let s = seqs[end - 1];
    let run_start = (start..end)
        .rev()
        .take_while(|&i| seqs[i] == s)
        .last()
        .unwrap_or(end);
    if run_start > start {
        return run_start;
    }
    (end..seqs.len())
        .find(|&i| seqs[i] != s)
        .unwrap_or(seqs.len())
}

/// `(seq, first position, end position)` of every sequence in a (validated) batch.
fn seq_ranges(batch: &Batch) -> Vec<(usize, usize, usize)> {
    let mut ranges = Vec::new();
    seq_ranges_into(batch, &mut ranges);
    ranges
}

/// Per sequence of the batch: `(seq, first position, last position + 1)`.
fn seq_ranges_into(batch: &Batch, ranges: &mut Vec<(usize, usize, usize)>) {
    ranges.clear();
    for i in 0..batch.len() {
        let s = batch.seq[i];
        match ranges.iter_mut().find(|r| r.0 == s) {
            Some(r) => r.2 = batch.pos[i] + 1,
            None => ranges.push((s, batch.pos[i], batch.pos[i] + 1)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::micro_batch_end;

    #[test]
    fn micro_batches_keep_sequences_whole() {
        let seqs = [0, 0, 0, 1, 1, 1, 1, 2];
        // a cut inside sequence 1 moves back to its start
        assert_eq!(micro_batch_end(&seqs, 0, 5), 3);
        // a cut between sequences stays
        assert_eq!(micro_batch_end(&seqs, 0, 3), 3);
        // a sequence longer than the micro-batch goes whole
        assert_eq!(micro_batch_end(&seqs, 3, 5), 7);
        // the end of the batch
        assert_eq!(micro_batch_end(&seqs, 7, 8), 8);
    }
}
