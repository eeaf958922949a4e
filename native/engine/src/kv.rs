//! Paged KV cache: fixed-size blocks, a block table per sequence, shared prefix blocks with
//! reference counts and copy-on-write.
//!
//! Layers are organised in groups that share one block allocator (all layers of a llama model
//! form one group; Gemma 3's sliding-window layers form a second group whose sequences only
//! keep the blocks inside the window). A sequence's positions are contiguous: `[0, len)` are
//! valid in every group that still holds them.

use crate::error::{EngineError, Result};
use half::f16;

mod snapshot;
pub use snapshot::{KvLayout, KvSnapshot};

/// Tokens per KV block.
pub const KV_BLOCK_SIZE: usize = 16;

const NO_BLOCK: u32 = u32::MAX;

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
const QK: usize = 32;

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
    fn bytes(self, elems: usize) -> usize {
        match self {
            KvType::F32 => elems * 4,
            KvType::F16 => elems * 2,
            KvType::Q8_0 => elems / QK * 34,
            KvType::Q4_0 => elems / QK * 18,
        }
    }

    fn quantized(self) -> bool {
        matches!(self, KvType::Q8_0 | KvType::Q4_0)
    }
}

/// Zero-filled words in their own anonymous mapping: untouched pages are never committed, so
/// memory grows with the blocks actually written, and [`PageBuf::release`] hands a freed
/// block's pages back to the kernel (a cache whose blocks come in several precisions needs
/// that to stay within its byte budget).
struct PageBuf {
    ptr: *mut u32,
    n_words: usize,
}

// SAFETY: a PageBuf owns its mapping exclusively (like a Vec); shared access is read-only.
unsafe impl Send for PageBuf {}
unsafe impl Sync for PageBuf {}

impl PageBuf {
    fn new(n_words: usize) -> Result<Self> {
        if n_words == 0 {
            return Ok(PageBuf {
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                n_words: 0,
            });
        }
        let bytes = n_words
            .checked_mul(4)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| EngineError::OutOfMemory(format!("KV buffer of {n_words} words")))?;
        let ptr = map_zeroed(bytes).ok_or_else(|| {
            EngineError::OutOfMemory(format!(
                "cannot reserve {} MiB for the KV cache",
                bytes >> 20
            ))
        })?;
        Ok(PageBuf {
            ptr: ptr as *mut u32,
            n_words,
        })
    }

    fn words(&self) -> &[u32] {
        // SAFETY: ptr is valid for n_words initialised words (zero pages or written values)
        // for the buffer's lifetime, and u32 has no invalid bit patterns.
        unsafe { std::slice::from_raw_parts(self.ptr, self.n_words) }
    }

    fn words_mut(&mut self) -> &mut [u32] {
        // SAFETY: as in `words`; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.n_words) }
    }

    /// Gives the pages of words `[at, at + n)` back to the kernel; they read as zeros after.
    /// The range must be page-aligned (the callers' blocks are whole pages).
    fn release(&mut self, at: usize, n: usize) {
        #[cfg(unix)]
        if n > 0 {
            // SAFETY: the range lies inside this buffer's own private anonymous mapping and is
            // page-aligned; MADV_DONTNEED on such memory only drops its contents (later reads
            // see zero pages), and no reference into the range exists (`&mut self`).
            unsafe {
                libc::madvise(
                    self.ptr.add(at) as *mut libc::c_void,
                    n * 4,
                    libc::MADV_DONTNEED,
                );
            }
        }
        #[cfg(not(unix))]
        self.words_mut()[at..at + n].fill(0);
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        if self.n_words > 0 {
            unmap(self.ptr as *mut u8, self.n_words * 4);
        }
    }
}

#[cfg(unix)]
fn map_zeroed(bytes: usize) -> Option<*mut u8> {
    // SAFETY: an anonymous private mapping with no address hint; the result is checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p as *mut u8)
}

#[cfg(unix)]
fn unmap(ptr: *mut u8, bytes: usize) {
    // SAFETY: exactly the mapping `map_zeroed` returned, unmapped once (on drop).
    unsafe { libc::munmap(ptr as *mut libc::c_void, bytes) };
}

#[cfg(not(unix))]
fn map_zeroed(bytes: usize) -> Option<*mut u8> {
    let layout = Layout::from_size_align(bytes, 4096).ok()?;
    // SAFETY: non-zero size (checked by the caller); the result is checked for null.
    let p = unsafe { alloc_zeroed(layout) };
    (!p.is_null()).then_some(p)
}

#[cfg(not(unix))]
fn unmap(ptr: *mut u8, bytes: usize) {
    use std::alloc::{dealloc, Layout};
    // SAFETY: allocated by `map_zeroed` with this layout.
    unsafe { dealloc(ptr, Layout::from_size_align_unchecked(bytes, 4096)) };
}

pub(crate) fn page_words() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if page > 0 {
            return page as usize / 4;
        }
    }
    1024
}

/// Keys and values types of a cache's blocks.
pub type KvTypes = (KvType, KvType);

/// A block id carries its precision tier in the top bits (so block tables, and the attention
/// reading through them, stay one `u32` per block).
const TIER_SHIFT: u32 = 29;
const INDEX_MASK: u32 = (1 << TIER_SHIFT) - 1;
/// At most this many precisions in one cache (ids of tier 7 would collide with `NO_BLOCK`).
pub const MAX_KV_TIERS: usize = 3;

fn split_id(b: u32) -> (usize, usize) {
    ((b >> TIER_SHIFT) as usize, (b & INDEX_MASK) as usize)
}

/// The blocks of one precision in one layer group: `[block][layer of the group][keys, values]`,
/// so one block of every layer is one run of memory, released at once when freed.
struct Tier {
    types: KvTypes,
    /// Words of one layer's keys / values in one block.
    k_words: usize,
    v_words: usize,
    /// Words of one whole block (every layer of the group; whole pages when pages are released).
    block_words: usize,
    store: PageBuf,
    refcount: Vec<u32>,
    free: Vec<u32>,
}

impl Tier {
    fn block_bytes(&self) -> usize {
        self.block_words * 4
    }

    fn blocks_in_use(&self) -> usize {
        self.refcount.iter().filter(|&&c| c > 0).count()
    }

    /// The keys and values of layer slot `li` of block `idx`: `(word offset of the keys,
    /// word offset of the values)`.
    fn layer_at(&self, idx: usize, li: usize) -> (usize, usize) {
        let at = idx * self.block_words + li * (self.k_words + self.v_words);
        (at, at + self.k_words)
    }
}

#[derive(Debug, Clone, Default)]
struct SeqTable {
    /// Block ids by logical block index; `NO_BLOCK` for blocks dropped by a sliding window.
    blocks: Vec<u32>,
}

/// One allocator and one set of block tables shared by a group of layers. Blocks of every
/// precision tier draw from one byte budget.
struct Group {
    window: Option<usize>,
    tiers: Vec<Tier>,
    /// Bytes the blocks in use take, and the most they may take.
    used_bytes: usize,
    budget_bytes: usize,
    /// Whether freed blocks give their pages back (several tiers share the budget, so a
    /// tier's touched pages must not outlive its blocks).
    release_pages: bool,
    seqs: Vec<SeqTable>,
}

impl Group {
    /// Blocks of `tier` that can still be allocated.
    fn free_blocks(&self, tier: usize) -> usize {
        let t = &self.tiers[tier];
        t.free
            .len()
            .min((self.budget_bytes - self.used_bytes) / t.block_bytes())
    }

    fn blocks_in_use(&self) -> usize {
        self.tiers.iter().map(Tier::blocks_in_use).sum()
    }

    fn alloc(&mut self, tier: usize) -> Option<u32> {
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
    fn alloc_from(&mut self, tier: usize) -> Option<u32> {
        (tier..self.tiers.len()).find_map(|t| self.alloc(t))
    }

    fn refcount_mut(&mut self, b: u32) -> &mut u32 {
        let (tier, idx) = split_id(b);
        &mut self.tiers[tier].refcount[idx]
    }

    fn release(&mut self, b: u32) {
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
}

/// A snapshot of block usage for audits and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvUsage {
    pub n_blocks: usize,
    /// Blocks in use per group.
    pub used: Vec<usize>,
    /// `(seq, blocks held)` per group.
    pub owners: Vec<Vec<(usize, usize)>>,
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
        })
    }

    pub fn n_seq_max(&self) -> usize {
        self.n_seq_max
    }

    pub fn n_layers(&self) -> usize {
        self.layer_group.len()
    }

    /// Total number of token positions the cache can hold at its first precision.
    pub fn capacity_tokens(&self) -> usize {
        self.n_blocks * KV_BLOCK_SIZE
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

    /// Highest valid position of `seq`, -1 when empty (llama.cpp's `seq_pos_max`).
    pub fn seq_pos_max(&self, seq: usize) -> i64 {
        self.lens[seq] as i64 - 1
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

    /// Positions `seq` can still add: the unused part of the blocks it holds, plus what the
    /// free budget holds at the write precision (the smallest figure over the layer groups).
    pub fn room(&self, seq: usize) -> usize {
        let len = self.lens[seq];
        self.groups
            .iter()
            .map(|g| {
                let held = g.seqs[seq].blocks.len() * KV_BLOCK_SIZE;
                held.saturating_sub(len) + g.free_blocks(self.write_tier) * KV_BLOCK_SIZE
            })
            .min()
            .unwrap_or(0)
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

    pub fn seq_view(&self, layer: usize, seq: usize) -> SeqView<'_> {
        SeqView {
            blocks: &self.groups[self.layer_group[layer]].seqs[seq].blocks,
        }
    }

    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        self.groups[self.layer_group[layer]].window
    }

    /// The tier of block `b` in `layer`'s group and the word offsets of that layer's keys and
    /// values in it.
    fn locate(&self, layer: usize, b: u32) -> (&Tier, usize, usize) {
        let (tier, idx) = split_id(b);
        let t = &self.groups[self.layer_group[layer]].tiers[tier];
        let (k, v) = t.layer_at(idx, self.layer_slot[layer]);
        (t, k, v)
    }

    /// Writes one position's keys and values (`n_kv_heads * head_dim` each) for a layer.
    /// The block must have been reserved.
    pub fn write(&mut self, layer: usize, seq: usize, pos: usize, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        let (g, li) = (self.layer_group[layer], self.layer_slot[layer]);
        let b = self.groups[g].seqs[seq].blocks[pos / KV_BLOCK_SIZE];
        let (tier, idx) = split_id(b);
        let t = &mut self.groups[g].tiers[tier];
        let ((kt, vt), (kw, vw)) = (t.types, (t.k_words, t.v_words));
        let (k_at, v_at) = t.layer_at(idx, li);
        let words = t.store.words_mut();
        // the values follow the keys of the same layer (`Tier::layer_at`)
        debug_assert_eq!(v_at, k_at + kw);
        let (kd, rest) = words[k_at..].split_at_mut(kw);
        let vd = &mut rest[..vw];
        let first = pos % KV_BLOCK_SIZE * hd;
        for h in 0..self.n_kv_heads {
            let at = first + h * KV_BLOCK_SIZE * hd;
            write_row(kt, kd, at, &k[h * hd..(h + 1) * hd]);
            write_row(vt, vd, at, &v[h * hd..(h + 1) * hd]);
        }
    }

    /// Reads the keys (or values) of `n` consecutive slots of block `b` into `out` as f32,
    /// one row of every KV head per slot.
    pub fn read_block(&self, layer: usize, values: bool, b: u32, n: usize, out: &mut [f32]) {
        let (hd, row) = (self.head_dim, self.n_kv_heads * self.head_dim);
        let mut head = vec![0f32; n * hd];
        for h in 0..self.n_kv_heads {
            self.read_head(layer, values, b, h, 0..n, &mut head);
            for (s, src) in head.chunks_exact(hd).enumerate() {
                out[s * row + h * hd..][..hd].copy_from_slice(src);
            }
        }
    }

    /// Reads one KV head of the slots `slots` of block `b` into `out`
    /// (`slots.len() * head_dim` values). Slots of KV head `h` are contiguous in a block
    /// (`[kv_head][slot][head_dim]`), for the per-head attention tasks.
    pub fn read_head(
        &self,
        layer: usize,
        values: bool,
        b: u32,
        head: usize,
        slots: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        let hd = self.head_dim;
        let (words, ty) = self.layer_words(layer, b, values);
        let first = (head * KV_BLOCK_SIZE + slots.start) * hd;
        read_rows(ty, words, first, &mut out[..slots.len() * hd]);
    }

    /// The words of block `b` that hold one layer's keys (or values), and their type.
    fn layer_words(&self, layer: usize, b: u32, values: bool) -> (&[u32], KvType) {
        let (t, k_at, v_at) = self.locate(layer, b);
        let (at, n, ty) = if values {
            (v_at, t.v_words, t.types.1)
        } else {
            (k_at, t.k_words, t.types.0)
        };
        (&t.store.words()[at..at + n], ty)
    }

    /// One KV head's keys (or values) of slots `slots` of block `b` as the cache stores them,
    /// for attention to read in place; `None` for quantized blocks, which [`Self::read_head`]
    /// dequantizes. Slots past the sequence's end are readable (the block holds them) but
    /// hold stale or zero values.
    pub fn head_rows(
        &self,
        layer: usize,
        values: bool,
        b: u32,
        head: usize,
        slots: std::ops::Range<usize>,
    ) -> Option<crate::kernels::attn::Rows<'_>> {
        use crate::kernels::attn::Rows;
        let hd = self.head_dim;
        let (words, ty) = self.layer_words(layer, b, values);
        let range =
            (head * KV_BLOCK_SIZE + slots.start) * hd..(head * KV_BLOCK_SIZE + slots.end) * hd;
        match ty {
            KvType::F32 => Some(Rows::F32(bytemuck_f32(&words[range]))),
            KvType::F16 => {
                let halves = &bytemuck_u16(words)[range];
                Some(Rows::F16(half::slice::HalfBitsSliceExt::reinterpret_cast(
                    halves,
                )))
            }
            KvType::Q8_0 | KvType::Q4_0 => None,
        }
    }

    /// Asks the CPU to start loading one KV head's keys and values of block `b`, so that
    /// attention computing on the current blocks overlaps the memory reads of the next ones.
    /// The hint is `T2` (to the outer caches): a head's 2–8 KB runs in scattered blocks are
    /// too short for the hardware prefetchers, and a single core reading them in turn waits
    /// on each miss (5.6 GB/s on Zen 4); `T0` prefetches compete for the few L1 miss
    /// buffers the reads need themselves (6.8 GB/s), `T2` a block or two ahead reached
    /// 11.5 GB/s (docs/performance.md, session 17).
    pub fn prefetch_head(&self, layer: usize, b: u32, head: usize) {
        #[cfg(target_arch = "x86_64")]
        for values in [false, true] {
            self.prefetch_rows::<{ std::arch::x86_64::_MM_HINT_T2 }>(layer, b, head, values);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (layer, b, head);
    }

    /// Asks for one KV head's values of block `b` into L1, just before they are summed. They
    /// were asked for with `T2` a chunk earlier; the weighted sum then walks them a column
    /// block at a time across every slot, and waited on them for 67% of its time. Asking
    /// for all of a chunk's value lines first made an 8-stream SmolLM2 step 4% faster at
    /// depth 300 (docs/performance.md, session 19); the same for keys was slower (their
    /// scores read them row by row).
    pub fn prefetch_values_l1(&self, layer: usize, b: u32, head: usize) {
        #[cfg(target_arch = "x86_64")]
        self.prefetch_rows::<{ std::arch::x86_64::_MM_HINT_T0 }>(layer, b, head, true);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (layer, b, head);
    }

    #[cfg(target_arch = "x86_64")]
    fn prefetch_rows<const HINT: i32>(&self, layer: usize, b: u32, head: usize, values: bool) {
        use std::arch::x86_64::_mm_prefetch;
        const LINE_BYTES: usize = 64;
        let (words, ty) = self.layer_words(layer, b, values);
        let n = KV_BLOCK_SIZE * self.head_dim;
        let base = words.as_ptr() as *const i8;
        let (at, len) = (ty.bytes(head * n), ty.bytes(n));
        for off in (0..len).step_by(LINE_BYTES) {
            // SAFETY: a prefetch never faults, and `at + off` stays inside the layer's
            // words of block `b` (head `head`'s run), so the pointer arithmetic is in bounds.
            unsafe { _mm_prefetch::<HINT>(base.add(at + off)) };
        }
    }
}

fn write_row(kv_type: KvType, words: &mut [u32], at: usize, src: &[f32]) {
    match kv_type {
        KvType::F32 => {
            for (w, x) in words[at..at + src.len()].iter_mut().zip(src) {
                *w = x.to_bits();
            }
        }
        KvType::F16 => {
            let halves: &mut [u16] = bytemuck_u16_mut(words);
            let dst = &mut halves[at..at + src.len()];
            let dst: &mut [f16] = half::slice::HalfBitsSliceExt::reinterpret_cast_mut(dst);
            half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
        }
        KvType::Q8_0 | KvType::Q4_0 => {
            let bytes = bytemuck_u8_mut(words);
            let (bb, mut off) = (kv_type.bytes(QK), kv_type.bytes(at));
            for x in src.chunks_exact(QK) {
                let dst = &mut bytes[off..off + bb];
                if kv_type == KvType::Q8_0 {
                    quantize_q8_0(x, dst);
                } else {
                    quantize_q4_0(x, dst);
                }
                off += bb;
            }
        }
    }
}

/// ggml's `quantize_row_q8_0_ref`: `d = max|x| / 127`, `q = round(x / d)`.
fn quantize_q8_0(x: &[f32], dst: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    dst[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
    for (q, v) in dst[2..].iter_mut().zip(x) {
        *q = ((v * id).round() as i8) as u8;
    }
}

/// ggml's `quantize_row_q4_0_ref`: `d = max / -8` (the value of largest magnitude, signed),
/// `q = min(15, x / d + 8.5)`; byte `j` holds values `j` (low nibble) and `j + 16`.
fn quantize_q4_0(x: &[f32], dst: &mut [u8]) {
    let max = x
        .iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    dst[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
    let q = |v: f32| ((v * id + 8.5) as u8).min(15);
    for j in 0..QK / 2 {
        dst[2 + j] = q(x[j]) | (q(x[j + QK / 2]) << 4);
    }
}

fn read_rows(kv_type: KvType, words: &[u32], at: usize, out: &mut [f32]) {
    match kv_type {
        KvType::F32 => {
            let n = out.len();
            for (o, w) in out.iter_mut().zip(&words[at..at + n]) {
                *o = f32::from_bits(*w);
            }
        }
        KvType::F16 => {
            let halves: &[u16] = bytemuck_u16(words);
            f16_to_f32(&halves[at..at + out.len()], out);
        }
        // dequantized a head row at a time, into the attention's chunk buffer: the cache
        // itself stays quantized
        KvType::Q8_0 | KvType::Q4_0 => {
            let bytes = bytemuck_u8(words);
            let (bb, mut off) = (kv_type.bytes(QK), kv_type.bytes(at));
            let simd = avx2();
            for o in out.chunks_exact_mut(QK) {
                let blk = &bytes[off..off + bb];
                let d = f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32();
                let q = &blk[2..];
                #[cfg(target_arch = "x86_64")]
                if simd {
                    // SAFETY: AVX2 was detected; `q` holds 32 (q8_0) or 16 (q4_0) bytes and
                    // `o` 32 values.
                    unsafe {
                        if kv_type == KvType::Q8_0 {
                            dequant_q8_0_avx2(d, q, o)
                        } else {
                            dequant_q4_0_avx2(d, q, o)
                        }
                    }
                    off += bb;
                    continue;
                }
                let _ = simd;
                if kv_type == KvType::Q8_0 {
                    for (y, &q) in o.iter_mut().zip(q) {
                        *y = d * (q as i8) as f32;
                    }
                } else {
                    for j in 0..QK / 2 {
                        o[j] = d * ((q[j] & 0x0f) as i32 - 8) as f32;
                        o[j + QK / 2] = d * ((q[j] >> 4) as i32 - 8) as f32;
                    }
                }
                off += bb;
            }
        }
    }
}

/// Whether the quantized KV reads may use AVX2: any SIMD level the engine runs at (cached by
/// `simd_level`, which `LLAMA_CPP_EX_SIMD=scalar` forces off) includes it.
fn avx2() -> bool {
    crate::kernels::simd_level() != crate::kernels::SimdLevel::Scalar
}

/// 32 q8_0 values `d · q` into `out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dequant_q8_0_avx2(d: f32, q: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let scale = _mm256_set1_ps(d);
    for k in 0..4 {
        let bytes = _mm_loadl_epi64(q.as_ptr().add(8 * k) as *const __m128i);
        let ints = _mm256_cvtepi8_epi32(bytes);
        let v = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(ints));
        _mm256_storeu_ps(out.as_mut_ptr().add(8 * k), v);
    }
}

/// 32 q4_0 values `d · (nibble - 8)` into `out` (low nibbles first, then high ones).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dequant_q4_0_avx2(d: f32, q: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let scale = _mm256_set1_ps(d);
    let packed = _mm_loadu_si128(q.as_ptr() as *const __m128i);
    let mask = _mm_set1_epi8(0x0f);
    let eight = _mm_set1_epi8(8);
    let lo = _mm_sub_epi8(_mm_and_si128(packed, mask), eight);
    let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), eight);
    for (half, v) in [lo, hi].into_iter().enumerate() {
        for k in 0..2 {
            let bytes = if k == 0 { v } else { _mm_srli_si128(v, 8) };
            let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
            _mm256_storeu_ps(
                out.as_mut_ptr().add(16 * half + 8 * k),
                _mm256_mul_ps(scale, f),
            );
        }
    }
}

/// f16 bits to f32. The `half` crate's slice conversion checks the CPU and calls out once
/// per 8 values, which costs more than the conversion on head-sized rows.
fn f16_to_f32(src: &[u16], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static F16C: OnceLock<bool> = OnceLock::new();
        if *F16C.get_or_init(|| is_x86_feature_detected!("f16c") && is_x86_feature_detected!("avx"))
        {
            // SAFETY: F16C and AVX were detected; both slices have the same length.
            return unsafe { f16_to_f32_f16c(src, out) };
        }
    }
    for (o, &h) in out.iter_mut().zip(src) {
        *o = f16::from_bits(h).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16_to_f32_f16c(src: &[u16], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len().min(out.len());
    let mut i = 0;
    while i + 8 <= n {
        let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        i += 8;
    }
    for j in i..n {
        out[j] = f16::from_bits(src[j]).to_f32();
    }
}

fn bytemuck_u16(words: &[u32]) -> &[u16] {
    // SAFETY: u32 storage reinterpreted as twice as many u16; alignment of u16 divides that
    // of u32 and every bit pattern is a valid u16.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u16, words.len() * 2) }
}

fn bytemuck_f32(words: &[u32]) -> &[f32] {
    // SAFETY: u32 and f32 have the same size and alignment and every bit pattern is a valid
    // f32.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const f32, words.len()) }
}

fn bytemuck_u8(words: &[u32]) -> &[u8] {
    // SAFETY: u32 storage reinterpreted as four times as many bytes; every bit pattern is a
    // valid u8 and u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, words.len() * 4) }
}

fn bytemuck_u8_mut(words: &mut [u32]) -> &mut [u8] {
    // SAFETY: as in `bytemuck_u8`; the borrow is unique.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, words.len() * 4) }
}

fn bytemuck_u16_mut(words: &mut [u32]) -> &mut [u16] {
    // SAFETY: as in `bytemuck_u16`; the borrow is unique.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u16, words.len() * 2) }
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
            assert_eq!(kv.room(0), len.next_multiple_of(KV_BLOCK_SIZE) - len);
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
