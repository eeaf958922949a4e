//! Block allocation: per layer group, a pool of blocks for each precision tier under one
//! byte budget, reference counts, and the sequences' block tables.

use super::KvTypes;
use crate::pages::PageBuf;

/// Marks a block a sliding window dropped.
pub(super) const NO_BLOCK: u32 = u32::MAX;

/// A block id carries its precision tier in the top bits (so block tables, and the attention
/// reading through them, stay one `u32` per block).
pub(super) const TIER_SHIFT: u32 = 29;
pub(super) const INDEX_MASK: u32 = (1 << TIER_SHIFT) - 1;
/// At most this many precisions in one cache (ids of tier 7 would collide with `NO_BLOCK`).
pub const MAX_KV_TIERS: usize = 3;

pub(super) fn split_id(b: u32) -> (usize, usize) {
    ((b >> TIER_SHIFT) as usize, (b & INDEX_MASK) as usize)
}

/// The blocks of one precision in one layer group: `[block][layer of the group][keys, values]`,
/// so one block of every layer is one run of memory, released at once when freed.
pub(super) struct Tier {
    pub(super) types: KvTypes,
    /// Words of one layer's keys / values in one block.
    pub(super) k_words: usize,
    pub(super) v_words: usize,
    /// Words of one whole block (every layer of the group; whole pages when pages are released).
    pub(super) block_words: usize,
    pub(super) store: PageBuf,
    pub(super) refcount: Vec<u32>,
    pub(super) free: Vec<u32>,
}

impl Tier {
    pub(super) fn block_bytes(&self) -> usize {
        self.block_words * 4
    }

    pub(super) fn blocks_in_use(&self) -> usize {
        self.refcount.iter().filter(|&&c| c > 0).count()
    }

    /// The keys and values of layer slot `li` of block `idx`: `(word offset of the keys,
    /// word offset of the values)`.
    pub(super) fn layer_at(&self, idx: usize, li: usize) -> (usize, usize) {
        let at = idx * self.block_words + li * (self.k_words + self.v_words);
        (at, at + self.k_words)
    }
}

#[derive(Debug, Clone, Default)]
pub(super) struct SeqTable {
    /// Block ids by logical block index; `NO_BLOCK` for blocks dropped by a sliding window.
    pub(super) blocks: Vec<u32>,
}

/// One allocator and one set of block tables shared by a group of layers. Blocks of every
/// precision tier draw from one byte budget.
pub(super) struct Group {
    pub(super) window: Option<usize>,
    pub(super) tiers: Vec<Tier>,
    /// Bytes the blocks in use take, and the most they may take.
    pub(super) used_bytes: usize,
    pub(super) budget_bytes: usize,
    /// Whether freed blocks give their pages back (several tiers share the budget, so a
    /// tier's touched pages must not outlive its blocks).
    pub(super) release_pages: bool,
    pub(super) seqs: Vec<SeqTable>,
}

impl Group {
    /// Blocks of `tier` that can still be allocated.
    pub(super) fn free_blocks(&self, tier: usize) -> usize {
        let t = &self.tiers[tier];
        t.free
            .len()
            .min((self.budget_bytes - self.used_bytes) / t.block_bytes())
    }

    pub(super) fn blocks_in_use(&self) -> usize {
        self.tiers.iter().map(Tier::blocks_in_use).sum()
    }

    pub(super) fn alloc(&mut self, tier: usize) -> Option<u32> {
        if self.free_blocks(tier) == 0 {
            return None;
        }
        let t = &mut self.tiers[tier];
        let idx = t.free.pop()?;
        t.refcount[idx as usize] = 1;
        self.used_bytes += t.block_bytes();
        Some(((tier as u32) << TIER_SHIFT) | idx)
    }

    /// A block of `tier`, or of the first lower precision that still fits: a request is not
    /// failed for want of room at the write precision while a smaller block would do (the
    /// policy's level lags a burst of allocations).
    pub(super) fn alloc_from(&mut self, tier: usize) -> Option<u32> {
        (tier..self.tiers.len()).find_map(|t| self.alloc(t))
    }

    pub(super) fn refcount(&self, b: u32) -> u32 {
        let (tier, idx) = split_id(b);
        self.tiers[tier].refcount[idx]
    }

    pub(super) fn refcount_mut(&mut self, b: u32) -> &mut u32 {
        let (tier, idx) = split_id(b);
        &mut self.tiers[tier].refcount[idx]
    }

    pub(super) fn release(&mut self, b: u32) {
        if b == NO_BLOCK {
            return;
        }
        let (tier, idx) = split_id(b);
        let t = &mut self.tiers[tier];
        let rc = &mut t.refcount[idx];
        debug_assert!(*rc > 0, "double free of KV block {b}");
        *rc -= 1;
        if *rc == 0 {
            t.free.push(idx as u32);
            self.used_bytes -= t.block_bytes();
            if self.release_pages {
                t.store.release(idx * t.block_words, t.block_words);
            }
        }
    }
}
