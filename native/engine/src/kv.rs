//! Paged KV cache: fixed-size blocks, a block table per sequence, shared prefix blocks with
//! reference counts and copy-on-write.
//!
//! Layers are organised in groups that share one block allocator (all layers of a llama model
//! form one group; Gemma 3's sliding-window layers form a second group whose sequences only
//! keep the blocks inside the window). A sequence's positions are contiguous: `[0, len)` are
//! valid in every group that still holds them.

use crate::error::{EngineError, Result};
use half::f16;
use std::alloc::{alloc_zeroed, Layout};

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

/// A zero-filled `u32`-word buffer obtained from `alloc_zeroed`, so untouched pages are never
/// committed: memory grows with the positions actually written, bounded by `n_ctx`.
struct ZeroedBuf {
    words: Vec<u32>,
}

impl ZeroedBuf {
    fn new(n_words: usize) -> Result<Self> {
        if n_words == 0 {
            return Ok(ZeroedBuf { words: Vec::new() });
        }
        let layout = Layout::array::<u32>(n_words)
            .map_err(|_| EngineError::OutOfMemory(format!("KV buffer of {n_words} words")))?;
        // SAFETY: layout has non-zero size; the pointer is checked for null and handed to a
        // Vec with exactly the capacity and alignment it was allocated with, and every element
        // (a u32 of zero bits) is initialised by alloc_zeroed.
        let words = unsafe {
            let ptr = alloc_zeroed(layout) as *mut u32;
            if ptr.is_null() {
                return Err(EngineError::OutOfMemory(format!(
                    "cannot allocate {} MiB for the KV cache",
                    layout.size() >> 20
                )));
            }
            Vec::from_raw_parts(ptr, n_words, n_words)
        };
        Ok(ZeroedBuf { words })
    }
}

/// Keys and values of one layer: `[block][kv_head][slot][head_dim]`.
struct LayerStore {
    k: ZeroedBuf,
    v: ZeroedBuf,
}

#[derive(Debug, Clone, Default)]
struct SeqTable {
    /// Block ids by logical block index; `NO_BLOCK` for blocks dropped by a sliding window.
    blocks: Vec<u32>,
}

/// One allocator and one set of block tables shared by a group of layers.
struct Group {
    window: Option<usize>,
    refcount: Vec<u32>,
    free: Vec<u32>,
    seqs: Vec<SeqTable>,
}

impl Group {
    fn free_blocks(&self) -> usize {
        self.free.len()
    }

    fn alloc(&mut self) -> Option<u32> {
        let b = self.free.pop()?;
        self.refcount[b as usize] = 1;
        Some(b)
    }

    fn release(&mut self, b: u32) {
        if b == NO_BLOCK {
            return;
        }
        let rc = &mut self.refcount[b as usize];
        debug_assert!(*rc > 0, "double free of KV block {b}");
        *rc -= 1;
        if *rc == 0 {
            self.free.push(b);
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
    pub n_blocks: usize,
    /// Precision of the keys and of the values.
    pub k_type: KvType,
    pub v_type: KvType,
    n_seq_max: usize,
    layer_group: Vec<usize>,
    layers: Vec<LayerStore>,
    groups: Vec<Group>,
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
    /// `layer_windows[i]` is the sliding window of layer `i` (None for full attention). Of the
    /// `n_seq_max` sequences, the last `n_seq_transient` only borrow blocks for one step
    /// (embedding texts): the pool holds `n_ctx` tokens for the others.
    pub fn new(
        layer_windows: &[Option<usize>],
        n_kv_heads: usize,
        head_dim: usize,
        n_ctx: usize,
        (n_seq_max, n_seq_transient): (usize, usize),
        (k_type, v_type): (KvType, KvType),
    ) -> Result<Self> {
        if (k_type.quantized() || v_type.quantized()) && !head_dim.is_multiple_of(QK) {
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
        // Each sequence may leave its last block partly empty; reserve one extra block per
        // sequence so n_ctx tokens always fit (transient ones borrow from that budget).
        let n_blocks = n_ctx.div_ceil(KV_BLOCK_SIZE) + n_seq_max - n_seq_transient.min(n_seq_max);
        if n_blocks >= NO_BLOCK as usize {
            return Err(EngineError::InvalidArgument(format!(
                "n_ctx {n_ctx} is too large"
            )));
        }
        let row = n_kv_heads * head_dim;
        let elems_per_layer = n_blocks
            .checked_mul(KV_BLOCK_SIZE * row)
            .ok_or_else(|| EngineError::InvalidArgument(format!("n_ctx {n_ctx} is too large")))?;
        let (k_words, v_words) = (
            k_type.bytes(elems_per_layer).div_ceil(4),
            v_type.bytes(elems_per_layer).div_ceil(4),
        );
        let total_bytes = ((k_words + v_words) as u128) * 4 * layer_windows.len() as u128;
        if total_bytes > isize::MAX as u128 {
            return Err(EngineError::OutOfMemory(format!(
                "a KV cache of n_ctx {n_ctx} needs {total_bytes} bytes"
            )));
        }
        let mut windows: Vec<Option<usize>> = Vec::new();
        let mut layer_group = Vec::with_capacity(layer_windows.len());
        for w in layer_windows {
            let g = match windows.iter().position(|x| x == w) {
                Some(g) => g,
                None => {
                    windows.push(*w);
                    windows.len() - 1
                }
            };
            layer_group.push(g);
        }
        let mut layers = Vec::with_capacity(layer_windows.len());
        for _ in layer_windows {
            layers.push(LayerStore {
                k: ZeroedBuf::new(k_words)?,
                v: ZeroedBuf::new(v_words)?,
            });
        }
        let groups = windows
            .into_iter()
            .map(|window| Group {
                window,
                refcount: vec![0; n_blocks],
                free: (0..n_blocks as u32).rev().collect(),
                // room for a full context, so decoding never grows a table
                seqs: (0..n_seq_max)
                    .map(|_| SeqTable {
                        blocks: Vec::with_capacity(n_blocks),
                    })
                    .collect(),
            })
            .collect();
        Ok(KvCache {
            n_kv_heads,
            head_dim,
            n_blocks,
            k_type,
            v_type,
            n_seq_max,
            layer_group,
            layers,
            groups,
            lens: vec![0; n_seq_max],
        })
    }

    pub fn n_seq_max(&self) -> usize {
        self.n_seq_max
    }

    /// Total number of token positions the cache can hold.
    pub fn capacity_tokens(&self) -> usize {
        self.n_blocks * KV_BLOCK_SIZE
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
        let group = &mut self.groups[g];
        while group.seqs[seq].blocks.len() <= bi {
            let b = group.alloc().ok_or(EngineError::ContextFull { seq })?;
            group.seqs[seq].blocks.push(b);
        }
        let b = group.seqs[seq].blocks[bi];
        if b == NO_BLOCK {
            let nb = group.alloc().ok_or(EngineError::ContextFull { seq })?;
            group.seqs[seq].blocks[bi] = nb;
            return Ok(());
        }
        if group.refcount[b as usize] > 1 {
            let nb = group.alloc().ok_or(EngineError::ContextFull { seq })?;
            group.refcount[b as usize] -= 1;
            group.seqs[seq].blocks[bi] = nb;
            let layers: Vec<usize> = (0..self.layers.len())
                .filter(|&l| self.layer_group[l] == g)
                .collect();
            for l in layers {
                self.copy_block(l, b as usize, nb as usize);
            }
        }
        Ok(())
    }

    /// Words of one block of one layer (a whole number for every type: a block holds
    /// `16 · n_kv_heads · head_dim` values, a multiple of 64 whenever the type is quantized).
    fn block_words(&self, t: KvType) -> usize {
        t.bytes(KV_BLOCK_SIZE * self.n_kv_heads * self.head_dim) / 4
    }

    fn copy_block(&mut self, layer: usize, src: usize, dst: usize) {
        let (wk, wv) = (self.block_words(self.k_type), self.block_words(self.v_type));
        let store = &mut self.layers[layer];
        store
            .k
            .words
            .copy_within(src * wk..(src + 1) * wk, dst * wk);
        store
            .v
            .words
            .copy_within(src * wv..(src + 1) * wv, dst * wv);
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

    /// Tokens the free blocks hold (in the fullest layer group).
    pub fn free_tokens(&self) -> usize {
        self.groups
            .iter()
            .map(|g| g.free_blocks() * KV_BLOCK_SIZE)
            .min()
            .unwrap_or(0)
    }

    /// Positions `seq` can still add: the unused part of the blocks it holds, plus the free
    /// blocks (the smallest figure over the layer groups).
    pub fn room(&self, seq: usize) -> usize {
        let len = self.lens[seq];
        self.groups
            .iter()
            .map(|g| {
                let held = g.seqs[seq].blocks.len() * KV_BLOCK_SIZE;
                held.saturating_sub(len) + g.free_blocks() * KV_BLOCK_SIZE
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
                    group.refcount[b as usize] += 1;
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
            used: self
                .groups
                .iter()
                .map(|g| self.n_blocks - g.free.len())
                .collect(),
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
    /// table entries pointing at it, and free blocks have none.
    pub fn audit(&self) -> std::result::Result<(), String> {
        for (gi, g) in self.groups.iter().enumerate() {
            let mut counts = vec![0u32; self.n_blocks];
            for t in &g.seqs {
                for &b in &t.blocks {
                    if b != NO_BLOCK {
                        counts[b as usize] += 1;
                    }
                }
            }
            if counts != g.refcount {
                return Err(format!(
                    "group {gi}: reference counts differ from block tables"
                ));
            }
            let mut free = g.free.clone();
            free.sort_unstable();
            free.dedup();
            if free.len() != g.free.len() {
                return Err(format!("group {gi}: a block is free twice"));
            }
            for &b in &g.free {
                if counts[b as usize] != 0 {
                    return Err(format!("group {gi}: block {b} is free but referenced"));
                }
            }
            let used = counts.iter().filter(|&&c| c > 0).count();
            if used + g.free.len() != self.n_blocks {
                return Err(format!("group {gi}: leaked blocks"));
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

    /// Writes one position's keys and values (`n_kv_heads * head_dim` each) for a layer.
    /// The block must have been reserved.
    pub fn write(&mut self, layer: usize, seq: usize, pos: usize, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        let b = self.groups[self.layer_group[layer]].seqs[seq].blocks[pos / KV_BLOCK_SIZE] as usize;
        let (kt, vt) = (self.k_type, self.v_type);
        let first = self.head_offset(b, 0) + pos % KV_BLOCK_SIZE * hd;
        let store = &mut self.layers[layer];
        for h in 0..self.n_kv_heads {
            let at = first + h * KV_BLOCK_SIZE * hd;
            write_row(kt, &mut store.k.words, at, &k[h * hd..(h + 1) * hd]);
            write_row(vt, &mut store.v.words, at, &v[h * hd..(h + 1) * hd]);
        }
    }

    /// Element offset of KV head `h`'s slots in block `b` (`[block][kv_head][slot][head_dim]`,
    /// so one head's slots of a block are contiguous for the per-head attention tasks).
    fn head_offset(&self, b: usize, h: usize) -> usize {
        (b * self.n_kv_heads + h) * KV_BLOCK_SIZE * self.head_dim
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
    /// (`slots.len() * head_dim` values).
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
        let store = &self.layers[layer];
        let (words, t) = if values {
            (&store.v.words, self.v_type)
        } else {
            (&store.k.words, self.k_type)
        };
        let at = self.head_offset(b as usize, head) + slots.start * hd;
        read_rows(t, words, at, &mut out[..slots.len() * hd]);
    }

    /// Asks the CPU to start loading one KV head's keys and values of block `b`, so that
    /// attention computing on the current blocks overlaps the memory reads of the next ones.
    pub fn prefetch_head(&self, layer: usize, b: u32, head: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            const LINE_BYTES: usize = 64;
            let store = &self.layers[layer];
            let at = self.head_offset(b as usize, head);
            let n = KV_BLOCK_SIZE * self.head_dim;
            for (words, t) in [(&store.k.words, self.k_type), (&store.v.words, self.v_type)] {
                let (at, len) = (t.bytes(at), t.bytes(n));
                let base = words.as_ptr() as *const i8;
                for off in (0..len).step_by(LINE_BYTES) {
                    // SAFETY: a prefetch never faults, and `at + off` stays inside the layer's
                    // buffer (block `b` exists), so the pointer arithmetic is in bounds.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(base.add(at + off)) };
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (layer, b, head);
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
