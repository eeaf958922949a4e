//! Reading and writing the cached rows of a block: attention's side of the cache.

use super::codec::{bytemuck_f32, bytemuck_u16, bytemuck_u8, read_rows, write_row};
use super::{split_id, KvCache, KvType, KvTypes, SeqView, Tier, KV_BLOCK_SIZE, QK};

impl KvCache {
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
    #[inline]
    pub(super) fn locate(&self, layer: usize, b: u32) -> (&Tier, usize, usize) {
        let (tier, idx) = split_id(b);
        let t = &self.groups[self.layer_group[layer]].tiers[tier];
        let (k, v) = t.layer_at(idx, self.layer_slot[layer]);
        (t, k, v)
    }

    /// Writes one position's keys and values (`n_kv_heads * head_dim` each) for a layer.
    /// The block must have been reserved.
    pub fn write(&mut self, layer: usize, seq: usize, pos: usize, k: &[f32], v: &[f32]) {
        let dest = self.row_dest(layer, seq, pos);
        // SAFETY: `&mut self` keeps every other access to the cache out until this returns.
        unsafe { dest.write(k, v) }
    }

    /// Where [`Self::write`] puts one position's keys and values for a layer, found ahead
    /// so that several threads can each write their own positions at once (the rows of
    /// distinct positions never overlap). The block must have been reserved.
    pub fn row_dest(&mut self, layer: usize, seq: usize, pos: usize) -> RowDest {
        let (hd, n_kv_heads) = (self.head_dim, self.n_kv_heads);
        let (g, li) = (self.layer_group[layer], self.layer_slot[layer]);
        let b = self.groups[g].seqs[seq].blocks[pos / KV_BLOCK_SIZE];
        let (tier, idx) = split_id(b);
        let t = &mut self.groups[g].tiers[tier];
        let (k_at, v_at) = t.layer_at(idx, li);
        let (words, types) = (t.store.words_mut(), t.types);
        // (the values follow the keys of the same layer, `Tier::layer_at`; checked once per
        // position and layer, as the slices it replaces were)
        assert!(k_at + t.k_words == v_at && v_at + t.v_words <= words.len());
        let base = words.as_mut_ptr().cast::<u8>();
        // SAFETY: both offsets are within the block's words (asserted above).
        let (k, v) = unsafe { (base.add(4 * k_at), base.add(4 * v_at)) };
        RowDest {
            k,
            v,
            types,
            first: pos % KV_BLOCK_SIZE * hd,
            n_kv_heads,
            head_dim: hd,
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
    /// (This and the block accessors below are inlined: attention calls them ~5 times a
    /// block, and as calls returning slices through memory they cost decode attention 4–9%.)
    #[inline]
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
    /// for attention to read in place; `None` for `q4_0` blocks, which [`Self::read_head`]
    /// dequantizes. Slots past the sequence's end are readable (the block holds them) but
    /// hold stale or zero values.
    #[inline]
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
            KvType::Q8_0 if hd.is_multiple_of(QK) => Some(Rows::Q8_0(
                &bytemuck_u8(words)[ty.bytes(range.start)..ty.bytes(range.end)],
            )),
            KvType::Q8_0 | KvType::Q4_0 => None,
        }
    }

    /// Asks the CPU to start loading one KV head's keys and values of block `b`, so that
    /// attention computing on the current blocks overlaps the memory reads of the next ones.
    /// The hint is `T2` (to the outer caches): a head's 2–8 KB runs in scattered blocks are
    /// too short for the hardware prefetchers, and a single core reading them in turn waits
    /// on each miss (5.6 GB/s on Zen 4); `T0` prefetches compete for the few L1 miss
    /// buffers the reads need themselves (6.8 GB/s), `T2` a block or two ahead reached
    /// 11.5 GB/s.
    #[inline]
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
    /// depth 300; the same for keys was slower (their
    /// scores read them row by row).
    #[inline]
    pub fn prefetch_values_l1(&self, layer: usize, b: u32, head: usize) {
        #[cfg(target_arch = "x86_64")]
        self.prefetch_rows::<{ std::arch::x86_64::_MM_HINT_T0 }>(layer, b, head, true);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (layer, b, head);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
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

/// One position's key and value rows in one layer of the cache ([`KvCache::row_dest`]).
#[derive(Clone, Copy)]
pub struct RowDest {
    /// The layer's keys and values in the position's block.
    k: *mut u8,
    v: *mut u8,
    types: KvTypes,
    /// The position's element offset in the first head's run.
    first: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

// SAFETY: a `RowDest` only points into a cache's storage; [`RowDest::write`]'s contract
// keeps threads to rows of their own.
unsafe impl Send for RowDest {}
unsafe impl Sync for RowDest {}

impl RowDest {
    /// Writes the position's keys and values (`n_kv_heads * head_dim` each).
    ///
    /// # Safety
    /// The cache it came from is alive and not moved or resized, and nothing else reads or
    /// writes this position's rows of the layer meanwhile.
    pub unsafe fn write(&self, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        for h in 0..self.n_kv_heads {
            let at = self.first + h * KV_BLOCK_SIZE * hd;
            for (ty, base, src) in [(self.types.0, self.k, k), (self.types.1, self.v, v)] {
                // SAFETY: a head's row of the position: within the layer's words of the
                // block, and no other position's (the caller's contract).
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(base.add(ty.bytes(at)), ty.bytes(hd)) };
                write_row(ty, dst, &src[h * hd..(h + 1) * hd]);
            }
        }
    }
}
