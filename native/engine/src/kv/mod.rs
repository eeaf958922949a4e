//! Paged KV cache: fixed-size blocks, a block table per sequence, shared prefix blocks with
//! reference counts and copy-on-write.
//!
//! Layers are organised in groups that share one block allocator (all layers of a llama model
//! form one group; Gemma 3's sliding-window layers form a second group whose sequences only
//! keep the blocks inside the window). A sequence's positions are contiguous: `[0, len)` are
//! valid in every group that still holds them.

use crate::error::{EngineError, Result};
use crate::pages::{page_words, PageBuf};

mod access;
mod alloc;
mod codec;
mod snapshot;
pub use access::RowDest;
pub use alloc::MAX_KV_TIERS;
use alloc::{split_id, Group, SeqTable, Tier, INDEX_MASK, NO_BLOCK};
pub use snapshot::{KvLayout, KvSnapshot};

/// Tokens per KV block.
pub const KV_BLOCK_SIZE: usize = 16;

/// Whether a sequence that held `len` positions under a sliding window `window` (which drops
/// whole blocks that fell out of it) still holds what position `n` attends to, so its first
/// `n` positions can be continued. The Server's prefix matching asks the same question
/// through the NIF.
pub fn window_keeps_prefix(len: usize, n: usize, window: Option<usize>) -> bool {
    match window {
        None => true,
        Some(w) => {
            let dropped_blocks = len.saturating_sub(w) / KV_BLOCK_SIZE;
            // the token at position n attends from n + 1 - w
            dropped_blocks <= (n + 1).saturating_sub(w) / KV_BLOCK_SIZE
        }
    }
}

/// Storage precision of cached keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvType {
    F16,
    F32,
    /// llama.cpp's `q8_0` blocks: 32 values as an f16 scale and 32 signed bytes (34 bytes).
    Q8_0,
    /// llama.cpp's `q4_0` blocks: 32 values as an f16 scale and 32 nibbles (18 bytes).
    Q4_0,
}

/// Values per quantization block of `q8_0` / `q4_0`.
pub(crate) const QK: usize = 32;

/// Bytes one cached token takes: keys and values of every layer.
pub fn bytes_per_token(
    n_layers: usize,
    n_kv_heads: usize,
    head_dim: usize,
    k: KvType,
    v: KvType,
) -> usize {
    let row = n_kv_heads * head_dim;
    n_layers * (k.bytes(row) + v.bytes(row))
}

impl KvType {
    /// Bytes that hold `elems` values (`elems` a multiple of 32 for the quantized types).
    pub(crate) fn bytes(self, elems: usize) -> usize {
        match self {
            KvType::F32 => elems * 4,
            KvType::F16 => elems * 2,
            KvType::Q8_0 => elems / QK * 34,
            KvType::Q4_0 => elems / QK * 18,
        }
    }

    pub(crate) fn quantized(self) -> bool {
        matches!(self, KvType::Q8_0 | KvType::Q4_0)
    }
}

/// Keys and values types of a cache's blocks.
pub type KvTypes = (KvType, KvType);

/// The index of block id `b` inside its precision's blocks (where a device keeps it); `None`
/// for a block a sliding window dropped.
pub fn block_index(b: u32) -> Option<usize> {
    (b != NO_BLOCK).then(|| split_id(b).1)
}

/// Block-level description of where a sequence's positions live, for the attention kernel.
pub struct SeqView<'a> {
    pub blocks: &'a [u32],
}

pub struct KvCache {
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Blocks the budget holds at the first (highest) precision.
    pub n_blocks: usize,
    n_seq_max: usize,
    /// The group of every layer, and the layer's slot inside its group's blocks.
    layer_group: Vec<usize>,
    layer_slot: Vec<usize>,
    groups: Vec<Group>,
    /// The precision tier newly allocated blocks get (see [`KvCache::set_write_tier`]).
    write_tier: usize,
    /// Valid positions per sequence.
    lens: Vec<usize>,
    /// Whether the contents live in a device's memory (see [`KvCache::keep_on_device`]):
    /// then this cache keeps only the block tables, and its copy-on-write copies are left in
    /// `copies` for the device to replay.
    on_device: bool,
    copies: Vec<BlockCopy>,
}

/// A block copied on write: the whole block, every layer of its group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub group: usize,
    pub src: u32,
    pub dst: u32,
}

/// A snapshot of block usage for audits and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvUsage {
    pub n_blocks: usize,
    /// Blocks in use per group.
    pub used: Vec<usize>,
    /// `(seq, blocks held)` per group.
    pub owners: Vec<Vec<(usize, usize)>>,
    /// `(seq, positions held)` of every sequence holding any.
    pub tokens: Vec<(usize, usize)>,
}

impl KvCache {
    /// A cache of one precision: `layer_windows[i]` is the sliding window of layer `i` (None for
    /// full attention). Of the `n_seq_max` sequences, the last `n_seq_transient` only borrow
    /// blocks for one step (embedding texts): the pool holds `n_ctx` tokens for the others.
    pub fn new(
        layer_windows: &[Option<usize>],
        n_kv_heads: usize,
        head_dim: usize,
        n_ctx: usize,
        seqs: (usize, usize),
        types: KvTypes,
    ) -> Result<Self> {
        Self::with_tiers(layer_windows, n_kv_heads, head_dim, n_ctx, seqs, &[types])
    }

    /// A cache whose blocks may be kept in any of `tiers` (highest precision first): `n_ctx`
    /// tokens at the first tier's size make the byte budget every tier draws from, and
    /// [`KvCache::set_write_tier`] picks the precision of blocks allocated from then on (the
    /// Server's `kv_policy`). Blocks already written keep theirs.
    pub fn with_tiers(
        layer_windows: &[Option<usize>],
        n_kv_heads: usize,
        head_dim: usize,
        n_ctx: usize,
        (n_seq_max, n_seq_transient): (usize, usize),
        tiers: &[KvTypes],
    ) -> Result<Self> {
        if tiers.is_empty() || tiers.len() > MAX_KV_TIERS {
            return Err(EngineError::InvalidArgument(format!(
                "a KV cache has 1 to {MAX_KV_TIERS} precisions, not {}",
                tiers.len()
            )));
        }
        let quantized = tiers.iter().any(|(k, v)| k.quantized() || v.quantized());
        if quantized && !head_dim.is_multiple_of(QK) {
            return Err(EngineError::Unsupported(format!(
                "a quantized KV cache needs a head size that is a multiple of {QK}, not {head_dim}"
            )));
        }
        if n_ctx == 0 {
            return Err(EngineError::InvalidArgument(
                "n_ctx must be positive".into(),
            ));
        }
        if n_seq_max == 0 {
            return Err(EngineError::InvalidArgument(
                "n_seq_max must be positive".into(),
            ));
        }
        let too_large = || EngineError::InvalidArgument(format!("n_ctx {n_ctx} is too large"));
        // Each sequence may leave its last block partly empty; reserve one extra block per
        // sequence so n_ctx tokens always fit (transient ones borrow from that budget).
        let n_blocks = n_ctx.div_ceil(KV_BLOCK_SIZE) + n_seq_max - n_seq_transient.min(n_seq_max);
        if n_blocks > INDEX_MASK as usize {
            return Err(too_large());
        }
        let elems = KV_BLOCK_SIZE
            .checked_mul(n_kv_heads)
            .and_then(|x| x.checked_mul(head_dim))
            .ok_or_else(too_large)?;
        let mut windows: Vec<Option<usize>> = Vec::new();
        let mut layer_group = Vec::with_capacity(layer_windows.len());
        let mut layer_slot = Vec::with_capacity(layer_windows.len());
        let mut group_layers: Vec<usize> = Vec::new();
        for w in layer_windows {
            let g = match windows.iter().position(|x| x == w) {
                Some(g) => g,
                None => {
                    windows.push(*w);
                    group_layers.push(0);
                    windows.len() - 1
                }
            };
            layer_group.push(g);
            layer_slot.push(group_layers[g]);
            group_layers[g] += 1;
        }
        let release_pages = tiers.len() > 1;
        let page = page_words();
        let mut total_bytes: u128 = 0;
        let mut groups = Vec::with_capacity(windows.len());
        for (g, window) in windows.into_iter().enumerate() {
            let shapes: Vec<(usize, usize, usize)> = tiers
                .iter()
                .map(|&(k, v)| {
                    let (kw, vw) = (k.bytes(elems) / 4, v.bytes(elems) / 4);
                    let words = (kw + vw) * group_layers[g];
                    (
                        kw,
                        vw,
                        if release_pages {
                            words.next_multiple_of(page)
                        } else {
                            words
                        },
                    )
                })
                .collect();
            let budget_bytes = (n_blocks as u128) * (shapes[0].2 as u128) * 4;
            total_bytes += budget_bytes;
            if total_bytes > isize::MAX as u128 / 4 {
                return Err(EngineError::OutOfMemory(format!(
                    "a KV cache of n_ctx {n_ctx} needs {total_bytes} bytes"
                )));
            }
            let budget_bytes = budget_bytes as usize;
            let mut group_tiers = Vec::with_capacity(tiers.len());
            for (&types, &(k_words, v_words, block_words)) in tiers.iter().zip(&shapes) {
                // as many blocks as the whole budget holds at this precision
                let capacity = (budget_bytes / (block_words * 4).max(1)).min(INDEX_MASK as usize);
                group_tiers.push(Tier {
                    types,
                    k_words,
                    v_words,
                    block_words,
                    store: PageBuf::new(capacity * block_words)?,
                    refcount: vec![0; capacity],
                    free: (0..capacity as u32).rev().collect(),
                });
            }
            groups.push(Group {
                window,
                tiers: group_tiers,
                used_bytes: 0,
                budget_bytes,
                release_pages,
                // room for a full context, so decoding never grows a table
                seqs: (0..n_seq_max)
                    .map(|_| SeqTable {
                        blocks: Vec::with_capacity(n_blocks),
                    })
                    .collect(),
            });
        }
        Ok(KvCache {
            n_kv_heads,
            head_dim,
            n_blocks,
            n_seq_max,
            layer_group,
            layer_slot,
            groups,
            write_tier: 0,
            lens: vec![0; n_seq_max],
            on_device: false,
            copies: Vec::new(),
        })
    }

    /// Keeps only the block tables here: the keys and values are written and read by a
    /// device backend, in its own memory, at the same block ids. The host pages are never
    /// touched (a mapping that costs nothing), and what needs them — a single precision, no
    /// snapshots — is refused.
    pub fn keep_on_device(&mut self) -> Result<()> {
        if self.groups.iter().any(|g| g.tiers.len() > 1) {
            return Err(EngineError::Unsupported(
                "KV pressure precisions with a model on a GPU".into(),
            ));
        }
        self.on_device = true;
        Ok(())
    }

    pub fn on_device(&self) -> bool {
        self.on_device
    }

    /// The copy-on-write copies made since the last call, for the device to replay before
    /// it writes.
    pub fn take_copies(&mut self) -> Vec<BlockCopy> {
        std::mem::take(&mut self.copies)
    }

    /// The group of layer `layer` (its block ids are the group's).
    pub fn layer_group(&self, layer: usize) -> usize {
        self.layer_group[layer]
    }

    /// Blocks the first precision of `group` can hold: a block id's index is below it.
    pub fn group_capacity(&self, group: usize) -> usize {
        self.groups[group].tiers[0].refcount.len()
    }

    pub fn n_seq_max(&self) -> usize {
        self.n_seq_max
    }

    pub fn n_layers(&self) -> usize {
        self.layer_group.len()
    }

    /// The precisions blocks may have, highest first.
    pub fn tiers(&self) -> Vec<KvTypes> {
        self.groups[0].tiers.iter().map(|t| t.types).collect()
    }

    /// The precision tier blocks allocated from now on get.
    pub fn write_tier(&self) -> usize {
        self.write_tier
    }

    /// Makes blocks allocated from now on (new positions, copies of shared blocks) use `tier`
    /// (an index into [`KvCache::tiers`]); blocks already written keep their precision.
    pub fn set_write_tier(&mut self, tier: usize) -> Result<()> {
        if tier >= self.groups[0].tiers.len() {
            return Err(EngineError::InvalidArgument(format!(
                "KV precision tier {tier} does not exist (the cache has {})",
                self.groups[0].tiers.len()
            )));
        }
        self.write_tier = tier;
        Ok(())
    }

    /// Fraction of the byte budget the blocks in use take (the fullest layer group).
    pub fn occupancy(&self) -> f64 {
        self.groups
            .iter()
            .map(|g| g.used_bytes as f64 / g.budget_bytes.max(1) as f64)
            .fold(0.0, f64::max)
    }

    /// Blocks in use per precision tier, summed over the layer groups.
    pub fn blocks_by_tier(&self) -> Vec<usize> {
        (0..self.groups[0].tiers.len())
            .map(|i| self.groups.iter().map(|g| g.tiers[i].blocks_in_use()).sum())
            .collect()
    }

    pub fn check_seq(&self, seq: i64) -> Result<usize> {
        if seq >= 0 && (seq as usize) < self.n_seq_max {
            Ok(seq as usize)
        } else {
            Err(EngineError::InvalidSeqId {
                seq,
                n_seq_max: self.n_seq_max,
            })
        }
    }

    /// Number of valid positions of `seq` (its next position).
    pub fn seq_len(&self, seq: usize) -> usize {
        self.lens[seq]
    }

    /// Makes sure positions `[from, to)` of `seq` have blocks this sequence owns exclusively,
    /// copying shared blocks first (copy-on-write). On failure nothing stays allocated beyond
    /// what the sequence held before.
    pub fn reserve(&mut self, seq: usize, from: usize, to: usize) -> Result<()> {
        if to <= from {
            return Ok(());
        }
        let first = from / KV_BLOCK_SIZE;
        let last = (to - 1) / KV_BLOCK_SIZE;
        for g in 0..self.groups.len() {
            let before = self.groups[g].seqs[seq].blocks.len();
            for bi in first..=last {
                if let Err(e) = self.ensure_exclusive(g, seq, bi) {
                    let group = &mut self.groups[g];
                    let table = &mut group.seqs[seq].blocks;
                    let keep = before.min(table.len());
                    let extra: Vec<u32> = table.drain(keep..).collect();
                    for b in extra {
                        group.release(b);
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    fn ensure_exclusive(&mut self, g: usize, seq: usize, bi: usize) -> Result<()> {
        let tier = self.write_tier;
        let group = &mut self.groups[g];
        while group.seqs[seq].blocks.len() <= bi {
            let b = group
                .alloc_from(tier)
                .ok_or(EngineError::ContextFull { seq })?;
            group.seqs[seq].blocks.push(b);
        }
        let b = group.seqs[seq].blocks[bi];
        if b == NO_BLOCK {
            let nb = group
                .alloc_from(tier)
                .ok_or(EngineError::ContextFull { seq })?;
            group.seqs[seq].blocks[bi] = nb;
            return Ok(());
        }
        if *group.refcount_mut(b) > 1 {
            // the copy keeps the block's precision: its contents are copied, not re-quantized
            let (src_tier, src) = split_id(b);
            let nb = group
                .alloc(src_tier)
                .ok_or(EngineError::ContextFull { seq })?;
            *group.refcount_mut(b) -= 1;
            group.seqs[seq].blocks[bi] = nb;
            if self.on_device {
                self.copies.push(BlockCopy {
                    group: g,
                    src: b,
                    dst: nb,
                });
                return Ok(());
            }
            let t = &mut group.tiers[src_tier];
            let (w, dst) = (t.block_words, split_id(nb).1);
            t.store
                .words_mut()
                .copy_within(src * w..(src + 1) * w, dst * w);
        }
        Ok(())
    }

    /// Marks `[len, new_len)` valid after a successful write.
    pub fn commit(&mut self, seq: usize, new_len: usize) {
        if new_len > self.lens[seq] {
            self.lens[seq] = new_len;
        }
        self.apply_windows(seq);
    }

    /// Frees blocks that fell out of every sliding window of the sequence.
    fn apply_windows(&mut self, seq: usize) {
        let len = self.lens[seq];
        for group in &mut self.groups {
            let Some(window) = group.window else { continue };
            // Positions < len - window are never attended again by later tokens.
            let keep_from = len.saturating_sub(window);
            let dead_blocks = keep_from / KV_BLOCK_SIZE;
            for bi in 0..dead_blocks.min(group.seqs[seq].blocks.len()) {
                let b = group.seqs[seq].blocks[bi];
                if b != NO_BLOCK {
                    group.seqs[seq].blocks[bi] = NO_BLOCK;
                    group.release(b);
                }
            }
        }
    }

    /// Removes positions `[p0, p1)` of `seq` (`p1 = None` means to the end). Only the tail can
    /// be removed: returns `Ok(false)` for a range that would leave a hole, as llama.cpp does
    /// for caches that cannot remove partially.
    pub fn seq_rm(&mut self, seq: usize, p0: usize, p1: Option<usize>) -> Result<bool> {
        let len = self.lens[seq];
        let p1 = p1.unwrap_or(usize::MAX);
        if p0 >= len || p1 <= p0 {
            return Ok(true);
        }
        if p1 < len {
            return Ok(false);
        }
        // A sliding-window group that already dropped blocks needed after p0 cannot serve a
        // truncated sequence.
        let truncate_to = if self.prefix_usable(seq, p0) { p0 } else { 0 };
        let keep_blocks = truncate_to.div_ceil(KV_BLOCK_SIZE);
        for group in &mut self.groups {
            let table = &mut group.seqs[seq].blocks;
            let tail: Vec<u32> = table.drain(keep_blocks.min(table.len())..).collect();
            for b in tail {
                group.release(b);
            }
        }
        self.lens[seq] = truncate_to;
        Ok(truncate_to == p0)
    }

    /// Tokens the free budget holds at the write precision (in the fullest layer group). New
    /// blocks may still fall back to a lower precision when that is used up, but callers that
    /// plan (admission, drafts) count on the write precision only.
    pub fn free_tokens(&self) -> usize {
        self.groups
            .iter()
            .map(|g| g.free_blocks(self.write_tier) * KV_BLOCK_SIZE)
            .min()
            .unwrap_or(0)
    }

    /// Per sequence holding blocks: the positions its blocks that no other sequence shares
    /// hold (in the layer group where it holds the most), what clearing it would free.
    pub fn exclusive_tokens(&self) -> Vec<(usize, usize)> {
        (0..self.n_seq_max)
            .filter(|&s| self.lens[s] > 0)
            .map(|s| {
                let blocks = self
                    .groups
                    .iter()
                    .map(|g| {
                        g.seqs[s]
                            .blocks
                            .iter()
                            .filter(|&&b| b != NO_BLOCK && g.refcount(b) == 1)
                            .count()
                    })
                    .max()
                    .unwrap_or(0);
                (s, (blocks * KV_BLOCK_SIZE).min(self.lens[s]))
            })
            .collect()
    }

    /// Frees blocks reserved beyond the valid positions of `seq` (after a failed batch).
    pub fn release_unused(&mut self, seq: usize) {
        let keep = self.lens[seq].div_ceil(KV_BLOCK_SIZE);
        for group in &mut self.groups {
            let table = &mut group.seqs[seq].blocks;
            let tail: Vec<u32> = table.drain(keep.min(table.len())..).collect();
            for b in tail {
                group.release(b);
            }
        }
    }

    /// Whether the first `n` positions of `seq` can be continued: every sliding-window group
    /// still holds the blocks the next token attends to.
    pub fn prefix_usable(&self, seq: usize, n: usize) -> bool {
        self.groups
            .iter()
            .all(|g| window_keeps_prefix(self.lens[seq], n, g.window))
    }

    pub fn seq_clear(&mut self, seq: usize) {
        for group in &mut self.groups {
            let mut blocks = std::mem::take(&mut group.seqs[seq].blocks);
            for &b in &blocks {
                group.release(b);
            }
            blocks.clear();
            group.seqs[seq].blocks = blocks;
        }
        self.lens[seq] = 0;
    }

    pub fn clear(&mut self) {
        for seq in 0..self.n_seq_max {
            self.seq_clear(seq);
        }
    }

    /// Makes `dst` hold the first `n` positions of `src` by sharing its blocks (no data is
    /// copied; the first write into a shared block copies that block).
    pub fn seq_share_prefix(&mut self, src: usize, dst: usize, n: usize) -> Result<()> {
        if src == dst {
            return Ok(());
        }
        let n = n.min(self.lens[src]);
        if !self.prefix_usable(src, n) {
            return Err(EngineError::InvalidArgument(format!(
                "sequence {src} no longer holds the window needed to continue after {n} positions"
            )));
        }
        self.seq_clear(dst);
        let n_blocks = n.div_ceil(KV_BLOCK_SIZE);
        for group in &mut self.groups {
            let mut shared = std::mem::take(&mut group.seqs[dst].blocks);
            shared.extend_from_slice(&group.seqs[src].blocks[..n_blocks]);
            for &b in &shared {
                if b != NO_BLOCK {
                    *group.refcount_mut(b) += 1;
                }
            }
            group.seqs[dst].blocks = shared;
        }
        self.lens[dst] = n;
        Ok(())
    }

    pub fn usage(&self) -> KvUsage {
        KvUsage {
            n_blocks: self.n_blocks,
            used: self.groups.iter().map(Group::blocks_in_use).collect(),
            owners: self
                .groups
                .iter()
                .map(|g| {
                    g.seqs
                        .iter()
                        .enumerate()
                        .map(|(s, t)| (s, t.blocks.iter().filter(|&&b| b != NO_BLOCK).count()))
                        .filter(|&(_, n)| n > 0)
                        .collect()
                })
                .collect(),
            tokens: self
                .lens
                .iter()
                .copied()
                .enumerate()
                .filter(|&(_, n)| n > 0)
                .collect(),
        }
    }

    /// Checks the allocator invariants: every block's reference count equals the number of
    /// table entries pointing at it, free blocks have none, and the bytes in use are the sum
    /// of the blocks in use.
    pub fn audit(&self) -> std::result::Result<(), String> {
        for (gi, g) in self.groups.iter().enumerate() {
            let mut counts: Vec<Vec<u32>> = g
                .tiers
                .iter()
                .map(|t| vec![0u32; t.refcount.len()])
                .collect();
            for t in &g.seqs {
                for &b in &t.blocks {
                    if b != NO_BLOCK {
                        let (tier, idx) = split_id(b);
                        match counts.get_mut(tier).and_then(|c| c.get_mut(idx)) {
                            Some(c) => *c += 1,
                            None => return Err(format!("group {gi}: block id {b} out of range")),
                        }
                    }
                }
            }
            let mut bytes = 0;
            for (ti, (t, counts)) in g.tiers.iter().zip(&counts).enumerate() {
                if counts != &t.refcount {
                    return Err(format!(
                        "group {gi} tier {ti}: reference counts differ from block tables"
                    ));
                }
                let mut free = t.free.clone();
                free.sort_unstable();
                free.dedup();
                if free.len() != t.free.len() {
                    return Err(format!("group {gi} tier {ti}: a block is free twice"));
                }
                for &b in &t.free {
                    if counts[b as usize] != 0 {
                        return Err(format!(
                            "group {gi} tier {ti}: block {b} is free but referenced"
                        ));
                    }
                }
                let used = counts.iter().filter(|&&c| c > 0).count();
                if used + t.free.len() != t.refcount.len() {
                    return Err(format!("group {gi} tier {ti}: leaked blocks"));
                }
                bytes += used * t.block_bytes();
            }
            if bytes != g.used_bytes || bytes > g.budget_bytes {
                return Err(format!(
                    "group {gi}: {bytes} bytes in blocks, {} counted, budget {}",
                    g.used_bytes, g.budget_bytes
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(n_ctx: usize, n_seq: usize) -> KvCache {
        KvCache::new(
            &[None, None],
            2,
            4,
            n_ctx,
            (n_seq, 0),
            (KvType::F16, KvType::F16),
        )
        .unwrap()
    }

    fn fill(kv: &mut KvCache, seq: usize, from: usize, to: usize, tag: f32) {
        kv.reserve(seq, from, to).unwrap();
        for p in from..to {
            let row: Vec<f32> = (0..8).map(|i| tag + p as f32 + i as f32 * 0.25).collect();
            for l in 0..2 {
                kv.write(l, seq, p, &row, &row);
            }
        }
        kv.commit(seq, to);
    }

    fn read_pos(kv: &KvCache, layer: usize, seq: usize, pos: usize) -> Vec<f32> {
        let b = kv.seq_view(layer, seq).blocks[pos / KV_BLOCK_SIZE];
        let mut buf = vec![0f32; KV_BLOCK_SIZE * 8];
        kv.read_block(layer, false, b, KV_BLOCK_SIZE, &mut buf);
        let off = (pos % KV_BLOCK_SIZE) * 8;
        buf[off..off + 8].to_vec()
    }

    #[test]
    fn no_block_leaks_after_remove_and_clear() {
        let mut kv = cache(256, 4);
        fill(&mut kv, 0, 0, 40, 0.0);
        fill(&mut kv, 1, 0, 17, 100.0);
        assert_eq!(kv.usage().used, vec![3 + 2]);
        assert!(kv.seq_rm(0, 20, None).unwrap());
        assert_eq!(kv.seq_len(0), 20);
        assert_eq!(kv.usage().used, vec![2 + 2]);
        assert!(!kv.seq_rm(1, 2, Some(5)).unwrap(), "holes are refused");
        kv.seq_clear(1);
        kv.clear();
        assert_eq!(kv.usage().used, vec![0]);
        kv.audit().unwrap();
    }

    #[test]
    fn shared_prefix_is_reference_counted_and_copied_on_write() {
        let mut kv = cache(256, 3);
        fill(&mut kv, 0, 0, 40, 0.0);
        kv.seq_share_prefix(0, 1, 36).unwrap();
        // 3 blocks shared (positions 0..36 span blocks 0,1,2), no new allocation.
        assert_eq!(kv.usage().used, vec![3]);
        kv.audit().unwrap();
        assert_eq!(kv.seq_len(1), 36);
        // seq 1 writes position 36: block 2 is shared, so it is copied first.
        fill(&mut kv, 1, 36, 37, 500.0);
        assert_eq!(kv.usage().used, vec![4]);
        kv.audit().unwrap();
        // the copy kept the shared data and seq 0's block is untouched
        assert_eq!(read_pos(&kv, 0, 1, 33), read_pos(&kv, 0, 0, 33));
        assert_eq!(read_pos(&kv, 1, 0, 36)[0], 36.0);
        assert_eq!(read_pos(&kv, 1, 1, 36)[0], 536.0);
        kv.seq_clear(0);
        kv.audit().unwrap();
        assert_eq!(kv.usage().used, vec![3]);
        kv.seq_clear(1);
        assert_eq!(kv.usage().used, vec![0]);
        kv.audit().unwrap();
    }

    #[test]
    fn exhaustion_is_an_error_and_rolls_back() {
        let mut kv = cache(32, 1); // 2 + 1 blocks
        fill(&mut kv, 0, 0, 40, 0.0);
        let err = kv.reserve(0, 40, 80).unwrap_err();
        assert!(matches!(err, EngineError::ContextFull { seq: 0 }));
        assert_eq!(kv.usage().used, vec![3]);
        kv.audit().unwrap();
    }

    #[test]
    fn sliding_window_group_drops_old_blocks() {
        let mut kv = KvCache::new(
            &[Some(32), None],
            2,
            4,
            512,
            (1, 0),
            (KvType::F32, KvType::F32),
        )
        .unwrap();
        fill(&mut kv, 0, 0, 100, 0.0);
        let usage = kv.usage();
        // window group keeps positions >= 68 → blocks 4,5,6; full group keeps all 7.
        assert_eq!(usage.used, vec![3, 7]);
        kv.audit().unwrap();
        // truncating into the dropped region forces a full reset
        assert!(!kv.seq_rm(0, 50, None).unwrap());
        assert_eq!(kv.seq_len(0), 0);
        kv.audit().unwrap();
    }

    fn tiered(n_ctx: usize, n_seq: usize) -> KvCache {
        KvCache::with_tiers(
            &[None, None],
            2,
            32,
            n_ctx,
            (n_seq, 0),
            &[
                (KvType::F16, KvType::F16),
                (KvType::Q8_0, KvType::Q8_0),
                (KvType::Q4_0, KvType::Q4_0),
            ],
        )
        .unwrap()
    }

    fn fill64(kv: &mut KvCache, seq: usize, from: usize, to: usize) -> Result<()> {
        kv.reserve(seq, from, to)?;
        let width = kv.n_kv_heads * kv.head_dim;
        for p in from..to {
            let row: Vec<f32> = (0..width)
                .map(|i| ((p * 7 + i) % 13) as f32 - 6.0)
                .collect();
            for l in 0..kv.n_layers() {
                kv.write(l, seq, p, &row, &row);
            }
        }
        kv.commit(seq, to);
        Ok(())
    }

    fn max_error(kv: &KvCache, seq: usize, bi: usize) -> f32 {
        let b = kv.seq_view(1, seq).blocks[bi];
        let mut buf = vec![0f32; KV_BLOCK_SIZE * 64];
        kv.read_block(1, true, b, KV_BLOCK_SIZE, &mut buf);
        let mut worst = 0f32;
        for (s, row) in buf.chunks_exact(64).enumerate() {
            let p = bi * KV_BLOCK_SIZE + s;
            for (i, x) in row.iter().enumerate() {
                worst = worst.max((x - (((p * 7 + i) % 13) as f32 - 6.0)).abs());
            }
        }
        worst
    }

    #[test]
    fn new_blocks_take_the_write_precision_and_old_ones_keep_theirs() {
        let mut kv = tiered(256, 2);
        fill64(&mut kv, 0, 0, 32).unwrap();
        kv.set_write_tier(1).unwrap();
        fill64(&mut kv, 0, 32, 64).unwrap();
        kv.set_write_tier(2).unwrap();
        fill64(&mut kv, 0, 64, 80).unwrap();
        // both layers share one group: a block holds the keys and values of both
        assert_eq!(kv.blocks_by_tier(), vec![2, 2, 1]);
        assert_eq!(
            max_error(&kv, 0, 0),
            0.0,
            "f16 holds small integers exactly"
        );
        assert!(max_error(&kv, 0, 2) <= 6.0 / 127.0, "q8_0 within a step");
        assert!(
            max_error(&kv, 0, 4) <= 6.0 / 8.0 + 1e-3,
            "q4_0 within a step"
        );
        // a shared block is copied in its own precision, whatever the write precision
        kv.seq_share_prefix(0, 1, 40).unwrap();
        fill64(&mut kv, 1, 40, 41).unwrap();
        assert_eq!(kv.blocks_by_tier(), vec![2, 3, 1]);
        assert_eq!(max_error(&kv, 1, 2), max_error(&kv, 0, 2));
        kv.audit().unwrap();
        assert!(kv.set_write_tier(3).is_err());
        kv.clear();
        assert_eq!(kv.occupancy(), 0.0);
        kv.audit().unwrap();
    }

    #[test]
    fn one_byte_budget_holds_more_tokens_at_lower_precision() {
        let n_ctx = 64 * KV_BLOCK_SIZE;
        let mut held = Vec::new();
        for tier in 0..3 {
            // blocks are whole pages in a tiered cache: a model-sized block keeps the rounding small
            let mut kv = KvCache::with_tiers(
                &[None; 4],
                4,
                64,
                n_ctx,
                (1, 0),
                &[
                    (KvType::F16, KvType::F16),
                    (KvType::Q8_0, KvType::Q8_0),
                    (KvType::Q4_0, KvType::Q4_0),
                ],
            )
            .unwrap();
            kv.set_write_tier(tier).unwrap();
            let mut len = 0;
            while fill64(&mut kv, 0, len, len + KV_BLOCK_SIZE).is_ok() {
                len += KV_BLOCK_SIZE;
            }
            assert_eq!(kv.free_tokens(), 0);
            assert!(kv.occupancy() <= 1.0 && kv.occupancy() > 0.99);
            kv.audit().unwrap();
            // once the write precision is full, the rest went to the lower ones
            let by_tier = kv.blocks_by_tier();
            assert!(by_tier[..tier].iter().all(|&n| n == 0));
            assert_eq!(by_tier.iter().sum::<usize>() * KV_BLOCK_SIZE, len);
            held.push(by_tier[tier] * KV_BLOCK_SIZE);
        }
        // 16 pages per f16 block, 9 per q8_0 block, 5 per q4_0 block
        assert_eq!(held[0], n_ctx + KV_BLOCK_SIZE);
        assert!(held[1] as f64 >= 1.7 * held[0] as f64, "{held:?}");
        assert!(held[2] as f64 >= 2.9 * held[0] as f64, "{held:?}");
    }

    #[test]
    fn a_block_that_does_not_fit_at_the_write_precision_takes_a_lower_one() {
        // 16 pages per f16 block, 9 per q8_0 block, 5 per q4_0 block; 64 + 2 f16 blocks of budget
        let mut kv = KvCache::with_tiers(
            &[None; 4],
            4,
            64,
            64 * KV_BLOCK_SIZE,
            (2, 0),
            &[
                (KvType::F16, KvType::F16),
                (KvType::Q8_0, KvType::Q8_0),
                (KvType::Q4_0, KvType::Q4_0),
            ],
        )
        .unwrap();
        kv.set_write_tier(2).unwrap();
        fill64(&mut kv, 0, 0, KV_BLOCK_SIZE).unwrap();
        kv.set_write_tier(0).unwrap();
        let mut len = 0;
        while fill64(&mut kv, 1, len, len + KV_BLOCK_SIZE).is_ok() {
            len += KV_BLOCK_SIZE;
        }
        // 1051 pages left: 65 f16 blocks, then the last 11 pages take one q8_0 block
        assert_eq!(kv.blocks_by_tier(), vec![65, 1, 1]);
        assert_eq!(len, 66 * KV_BLOCK_SIZE);
        kv.audit().unwrap();
    }

    #[test]
    fn freed_blocks_of_a_tiered_cache_give_their_pages_back() {
        let mut kv = tiered(256, 1);
        kv.set_write_tier(1).unwrap();
        fill64(&mut kv, 0, 0, 16).unwrap();
        let (tier, idx) = split_id(kv.seq_view(0, 0).blocks[0]);
        let t = &kv.groups[0].tiers[tier];
        let span = idx * t.block_words..(idx + 1) * t.block_words;
        assert!(t.store.words()[span.clone()].iter().any(|&w| w != 0));
        kv.seq_clear(0);
        // MADV_DONTNEED dropped the pages: they read as fresh zero pages
        let t = &kv.groups[0].tiers[tier];
        assert!(t.store.words()[span].iter().all(|&w| w == 0));
    }

    #[test]
    fn absurd_sizes_are_errors() {
        assert!(KvCache::new(
            &[None],
            8,
            128,
            usize::MAX / 4,
            (1, 0),
            (KvType::F32, KvType::F32)
        )
        .is_err());
        assert!(KvCache::new(&[None], 8, 128, 0, (1, 0), (KvType::F32, KvType::F32)).is_err());
    }
}
