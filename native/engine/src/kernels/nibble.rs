//! 4- and 5-bit weights with a per-block scale and offset (`w = d·q + m`), times f32
//! activations, kept packed: Q4_0 (`m = -8d`), Q4_1, Q5_0 (`m = -16d`) and Q5_1. Blocks hold
//! 32 values; value i sits in the low nibble of byte i, value i+16 in the high nibble, and
//! 5-bit types add bit i of a 32-bit word as the value's fifth bit.
//!
//! With activations quantized to Q8_0 (`x ≈ d_x·a`), one block contributes
//! `d·d_x·Σ q·a + m·(d_x·Σ a)`; the second term uses the activation block sums computed once
//! per matmul. The values are unsigned, so `maddubs(q, a)` needs no sign trick.

use super::q8::{Q8Activations, QK8_0};
use super::SharedMut;
use half::f16;

/// Elements per block (same as Q8_0, so activation blocks line up).
pub const QK4_1: usize = QK8_0;
const PACKED: usize = QK4_1 / 2;

/// The ggml block layouts this kernel reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NibbleType {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    /// Signed 8-bit values, stored here as `q + 128` with offset `-128d` so every type runs
    /// through the same unsigned products on VNNI; the AVX2 path flips them back to signed
    /// (`maddubs` on `q + 128` would saturate) and uses `|x|·(sign(x)·q)`.
    Q8_0,
    /// Q6_K's 6-bit values (0..=63), one byte each; every 32-value block has two halves of 16
    /// with their own scale `d` and offset `-32d` (see [`super::kquant`]).
    Q6K,
}

impl NibbleType {
    fn has_min(self) -> bool {
        matches!(self, NibbleType::Q4_1 | NibbleType::Q5_1)
    }

    fn has_high_bits(self) -> bool {
        matches!(self, NibbleType::Q5_0 | NibbleType::Q5_1)
    }

    /// Values stored one per byte rather than packed in nibbles.
    fn byte_values(self) -> bool {
        matches!(self, NibbleType::Q8_0 | NibbleType::Q6K)
    }

    /// Scales (and offsets) per block: 2 when each half of 16 values has its own.
    pub(crate) fn halves(self) -> usize {
        if self == NibbleType::Q6K {
            2
        } else {
            1
        }
    }

    fn block_bytes(self) -> usize {
        if self.byte_values() {
            return 2 + QK8_0;
        }
        2 + if self.has_min() { 2 } else { 0 } + if self.has_high_bits() { 4 } else { 0 } + PACKED
    }

    /// Bytes of one block of a row group in the interleaved layout.
    fn group_block_bytes(self) -> usize {
        if self.byte_values() {
            GROUP * QK8_0
        } else {
            GROUP * PACKED
        }
    }

    /// The offset of a type without a stored minimum, in units of `d`.
    fn implied_offset(self) -> f32 {
        match self {
            NibbleType::Q4_0 => -8.0,
            NibbleType::Q5_0 => -16.0,
            NibbleType::Q8_0 => -128.0,
            NibbleType::Q6K => -32.0,
            _ => 0.0,
        }
    }
}
/// Output rows interleaved together: one 256-bit lane per row, so a block's products for all
/// of them come out of one vector and need no horizontal sums.
pub const GROUP: usize = 8;

/// A matrix `[n_out, n_in]` repacked in groups of [`GROUP`] output rows, interleaved per
/// block so that a 256-bit vector holds 4 consecutive values of each of the 8 rows.
///
/// Per row group and block: `d` is 8 floats (one per row), and so is `m` for types with a
/// stored minimum (the others' offset is implied by `d`, so it is not stored). `qs` is 4 chunks of 32
/// bytes; in chunk `c`, byte `4j + t` holds value `4c + t` of row `j` in its low nibble and
/// value `16 + 4c + t` in its high nibble, so the low nibbles of a chunk are "quad" `c` and
/// the high nibbles quad `c + 4` (a quad is 4 consecutive values). 5-bit types keep one `u32`
/// per row in which the fifth bit of value `4q + t` sits at bit `8t + 4 + q` (`q < 4`) or
/// `8t + q - 4` (`q ≥ 4`): one shift by `q` (right) or `8 - q` (left) and a mask with
/// `0x10101010` put quad `q`'s fifth bits where they belong. Rows past `n_out` are zero.
pub struct NibbleMatrix {
    pub n_out: usize,
    pub n_in: usize,
    pub kind: NibbleType,
    nb: usize,
    d: Vec<f32>,
    m: Vec<f32>,
    qs: Vec<u8>,
    qh: Vec<u32>,
}

/// One block of one row: scale and offset (per half of 16 values for split types; both
/// entries equal otherwise) and the 32 unsigned values.
#[derive(Clone, Copy)]
pub(crate) struct RowBlock {
    pub d: [f32; 2],
    pub m: [f32; 2],
    pub vals: [u8; QK4_1],
}

impl RowBlock {
    pub(crate) fn new(d: f32, m: f32, vals: [u8; QK4_1]) -> Self {
        RowBlock {
            d: [d; 2],
            m: [m; 2],
            vals,
        }
    }

    /// The weight value `i` stands for.
    #[cfg(test)]
    pub(crate) fn value(&self, i: usize) -> f32 {
        let h = i / (QK4_1 / 2);
        self.vals[i] as f32 * self.d[h] + self.m[h]
    }
}

impl NibbleMatrix {
    /// From GGUF/ggml block bytes of `kind`.
    pub fn from_bytes(kind: NibbleType, bytes: &[u8], n_out: usize, n_in: usize) -> Option<Self> {
        let bb = kind.block_bytes();
        if kind == NibbleType::Q6K
            || n_out == 0
            || !n_in.is_multiple_of(QK4_1)
            || bytes.len() != n_out * n_in / QK4_1 * bb
        {
            return None;
        }
        let nb = n_in / QK4_1;
        Some(Self::build(kind, n_out, n_in, |o, b| {
            let block = &bytes[(o * nb + b) * bb..][..bb];
            let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
            let mut at = 2;
            let m = if kind.has_min() {
                at += 2;
                f16::from_le_bytes([block[2], block[3]]).to_f32()
            } else {
                kind.implied_offset() * d
            };
            let mut high = 0u32;
            if kind.has_high_bits() {
                high = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
                at += 4;
            }
            let mut vals = [0u8; QK4_1];
            if kind == NibbleType::Q8_0 {
                for (v, &q) in vals.iter_mut().zip(&block[2..2 + QK8_0]) {
                    *v = (q as i8 as i16 + 128) as u8;
                }
                return RowBlock::new(d, m, vals);
            }
            for (i, &byte) in block[at..at + PACKED].iter().enumerate() {
                vals[i] = (byte & 0x0F) | (((high >> i) & 1) << 4) as u8;
                vals[i + PACKED] = (byte >> 4) | (((high >> (i + PACKED)) & 1) << 4) as u8;
            }
            RowBlock::new(d, m, vals)
        }))
    }

    pub(crate) fn build(
        kind: NibbleType,
        n_out: usize,
        n_in: usize,
        mut row_block: impl FnMut(usize, usize) -> RowBlock,
    ) -> Self {
        let nb = n_in / QK4_1;
        let blocks = n_out.div_ceil(GROUP) * nb;
        let halves = kind.halves();
        let mut d = Vec::with_capacity(blocks * GROUP * halves);
        let mut m = Vec::with_capacity(if kind.has_min() {
            blocks * GROUP * halves
        } else {
            0
        });
        let mut qs = Vec::with_capacity(blocks * kind.group_block_bytes());
        let mut qh = Vec::with_capacity(if kind.has_high_bits() {
            blocks * GROUP
        } else {
            0
        });
        let mut rows = [RowBlock::new(0.0, 0.0, [0; QK4_1]); GROUP];
        for g in 0..n_out.div_ceil(GROUP) {
            for b in 0..nb {
                for (j, row) in rows.iter_mut().enumerate() {
                    let o = g * GROUP + j;
                    if o < n_out {
                        *row = row_block(o, b);
                    } else {
                        *row = RowBlock::new(0.0, 0.0, [0; QK4_1]);
                    }
                }
                for h in 0..halves {
                    d.extend(rows.iter().map(|r| r.d[h]));
                    if kind.has_min() {
                        m.extend(rows.iter().map(|r| r.m[h]));
                    }
                }
                if kind.byte_values() {
                    for q in 0..QK8_0 / 4 {
                        for RowBlock { vals, .. } in &rows {
                            qs.extend_from_slice(&vals[4 * q..4 * q + 4]);
                        }
                    }
                    continue;
                }
                for c in 0..4 {
                    for RowBlock { vals, .. } in &rows {
                        for t in 0..4 {
                            qs.push(
                                (vals[4 * c + t] & 0x0F) | (vals[PACKED + 4 * c + t] & 0x0F) << 4,
                            );
                        }
                    }
                }
                if kind.has_high_bits() {
                    for RowBlock { vals, .. } in &rows {
                        let mut w = 0u32;
                        for (i, &v) in vals.iter().enumerate() {
                            let (q, t) = (i / 4, i % 4);
                            let pos = if q < 4 { 8 * t + 4 + q } else { 8 * t + q - 4 };
                            w |= ((v as u32 >> 4) & 1) << pos;
                        }
                        qh.push(w);
                    }
                }
            }
        }
        NibbleMatrix {
            n_out,
            n_in,
            kind,
            nb,
            d,
            m,
            qs,
            qh,
        }
    }

    /// Block `b` of row `o` read back from the interleaved layout.
    pub(crate) fn row_block(&self, o: usize, b: usize) -> RowBlock {
        let (g, j) = (o / GROUP, o % GROUP);
        let gb = g * self.nb + b;
        let gbb = self.kind.group_block_bytes();
        let chunk = &self.qs[gb * gbb..][..gbb];
        let high = self.qh.get(gb * GROUP + j).copied();
        let mut vals = [0u8; QK4_1];
        for (i, v) in vals.iter_mut().enumerate() {
            let (q, t) = (i / 4, i % 4);
            if self.kind.byte_values() {
                *v = chunk[q * 32 + j * 4 + t];
                continue;
            }
            let byte = chunk[(q % 4) * 32 + j * 4 + t];
            *v = if q < 4 { byte & 0x0F } else { byte >> 4 };
            if let Some(w) = high {
                let pos = if q < 4 { 8 * t + 4 + q } else { 8 * t + q - 4 };
                *v |= (((w >> pos) & 1) << 4) as u8;
            }
        }
        let halves = self.kind.halves();
        let at = |h: usize| (gb * halves + h) * GROUP + j;
        let last = halves - 1;
        RowBlock {
            d: [self.d[at(0)], self.d[at(last)]],
            m: [self.offset(at(0)), self.offset(at(last))],
            vals,
        }
    }

    /// The offset of the scale at `at` in `d`: stored for types with a minimum, else implied
    /// (`implied_offset · d`, the same f32 product the loader used to compute).
    fn offset(&self, at: usize) -> f32 {
        if self.kind.has_min() {
            self.m[at]
        } else {
            self.kind.implied_offset() * self.d[at]
        }
    }

    /// Row `o` dequantized into `out` (`n_in` values), with ggml's own formulas so a tied
    /// embedding read from here equals one read from the file: `(q + offset)·d` for types
    /// with an implied offset, `d·q + m` otherwise.
    pub fn dequantize_row(&self, o: usize, out: &mut [f32]) {
        let offset = self.kind.implied_offset();
        for (b, chunk) in out[..self.n_in].chunks_exact_mut(QK4_1).enumerate() {
            let blk = self.row_block(o, b);
            for (i, v) in chunk.iter_mut().enumerate() {
                let h = i / (QK4_1 / 2);
                let q = blk.vals[i] as f32;
                *v = if self.kind.has_min() {
                    blk.d[h] * q + blk.m[h]
                } else {
                    (q + offset) * blk.d[h]
                };
            }
        }
    }

    /// Reserves room for `n_out` rows in all, so appending parts never reallocates.
    pub fn reserve_rows(&mut self, n_out: usize) {
        let groups = n_out
            .div_ceil(GROUP)
            .saturating_sub(self.n_out.div_ceil(GROUP));
        let blocks = groups * self.nb;
        let halves = self.kind.halves();
        self.d.reserve_exact(blocks * GROUP * halves);
        if self.kind.has_min() {
            self.m.reserve_exact(blocks * GROUP * halves);
        }
        self.qs
            .reserve_exact(blocks * self.kind.group_block_bytes());
        if self.kind.has_high_bits() {
            self.qh.reserve_exact(blocks * GROUP);
        }
    }

    /// Appends `other`'s rows below this matrix's; `None` (and nothing changes) unless both
    /// have the same type and input width and this matrix fills its last row group.
    pub fn append(&mut self, other: NibbleMatrix) -> Option<()> {
        if other.kind != self.kind || other.n_in != self.n_in || !self.n_out.is_multiple_of(GROUP) {
            return None;
        }
        self.n_out += other.n_out;
        self.d.extend_from_slice(&other.d);
        self.m.extend_from_slice(&other.m);
        self.qs.extend_from_slice(&other.qs);
        self.qh.extend_from_slice(&other.qh);
        Some(())
    }

    /// Stacks matrices with the same input width so one product computes all of them.
    pub fn concat(parts: &[&NibbleMatrix]) -> Option<NibbleMatrix> {
        let first = parts.first()?;
        let (n_in, kind) = (first.n_in, first.kind);
        if parts.iter().any(|p| p.n_in != n_in || p.kind != kind) {
            return None;
        }
        let mut owner = Vec::new();
        for (pi, p) in parts.iter().enumerate() {
            owner.extend((0..p.n_out).map(|o| (pi, o)));
        }
        Some(Self::build(kind, owner.len(), n_in, |o, b| {
            let (pi, row) = owner[o];
            parts[pi].row_block(row, b)
        }))
    }

    /// `out[r * n_out + o] = Σ_i w[o, i] · x[r, i]` for `m` rows of `x`.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        assert_eq!(x.len(), m * self.n_in);
        assert_eq!(out.len(), m * self.n_out);
        let shared = SharedMut(out.as_mut_ptr());
        Q8Activations::with_quantized(x, m, self.n_in, |a| {
            super::for_each_tile(self.n_out, GROUP, m * self.n_out * self.n_in, |o0, _| {
                self.group(a, o0 / GROUP, &shared)
            })
        });
    }

    fn group(&self, a: &Q8Activations, g: usize, out: &SharedMut) {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: the features were detected at run time; every offset stays inside the
            // matrices and the activations (checked by the asserts in `matmul`), and row
            // group `g` writes only its own output columns.
            if super::has_vnni() {
                return unsafe { group_kernel_vnni(self, a, g, out) };
            }
            if super::has_avx2() {
                return unsafe {
                    if self.kind == NibbleType::Q8_0 {
                        group_kernel_avx2_q8(self, a, g, out)
                    } else {
                        group_kernel_avx2(self, a, g, out)
                    }
                };
            }
        }
        self.group_scalar(a, g, out);
    }

    fn group_scalar(&self, a: &Q8Activations, g: usize, out: &SharedMut) {
        thread_local! {
            /// One row's blocks, decoded once for every activation row (reused: no allocation
            /// per product once grown).
            static BLOCKS: std::cell::RefCell<Vec<RowBlock>> = const {
                std::cell::RefCell::new(Vec::new())
            };
        }
        BLOCKS.with(|cell| {
            let mut blocks = cell.borrow_mut();
            for o in g * GROUP..self.n_out.min((g + 1) * GROUP) {
                blocks.clear();
                blocks.extend((0..self.nb).map(|b| self.row_block(o, b)));
                self.row_scalar(a, o, &blocks, out);
            }
        });
    }

    /// Output row `o` (its blocks decoded in `blocks`) for every activation row, with the
    /// SIMD paths' arithmetic in the same order (integer dots are exact, then the same fused
    /// multiply-adds), so every path gives bitwise the same results.
    fn row_scalar(&self, a: &Q8Activations, o: usize, blocks: &[RowBlock], out: &SharedMut) {
        let (k, nb) = (self.n_in, self.nb);
        for r in 0..a.m {
            let mut acc = 0f32;
            for (b, blk) in blocks.iter().enumerate() {
                let x = &a.quants[r * k + b * QK4_1..][..QK4_1];
                let dot = |range: std::ops::Range<usize>| -> f32 {
                    range.map(|i| blk.vals[i] as i32 * x[i] as i32).sum::<i32>() as f32
                };
                let at = r * nb + b;
                let dx = a.scales[at];
                if self.kind.halves() == 2 {
                    let half = QK4_1 / 2;
                    let dot = dot(half..QK4_1).mul_add(blk.d[1], dot(0..half) * blk.d[0]);
                    acc = dot.mul_add(dx, acc);
                    acc = blk.m[0].mul_add(a.half_sums[2 * at], acc);
                    acc = blk.m[1].mul_add(a.half_sums[2 * at + 1], acc);
                } else {
                    acc = dot(0..QK4_1).mul_add(blk.d[0] * dx, acc);
                    acc = blk.m[0].mul_add(a.sums[at], acc);
                }
            }
            // SAFETY: (r, o) is in bounds and written by this row group only.
            unsafe { *out.0.add(r * self.n_out + o) = acc };
        }
    }
}

/// The 8 quads of one block of a row group: vector `q` holds values `4q..4q + 4` of each row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn unpack_block(qs: *const u8, qh: Option<*const u32>) -> [std::arch::x86_64::__m256i; 8] {
    use std::arch::x86_64::*;
    let low = _mm256_set1_epi8(0x0F);
    let mut v = [_mm256_setzero_si256(); 8];
    for c in 0..4 {
        let packed = _mm256_loadu_si256(qs.add(c * 32) as *const __m256i);
        v[c] = _mm256_and_si256(packed, low);
        v[c + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    }
    if let Some(qh) = qh {
        let w = _mm256_loadu_si256(qh as *const __m256i);
        let fifth = _mm256_set1_epi8(0x10);
        v[0] = _mm256_or_si256(v[0], _mm256_and_si256(w, fifth));
        v[1] = _mm256_or_si256(v[1], _mm256_and_si256(_mm256_srli_epi32(w, 1), fifth));
        v[2] = _mm256_or_si256(v[2], _mm256_and_si256(_mm256_srli_epi32(w, 2), fifth));
        v[3] = _mm256_or_si256(v[3], _mm256_and_si256(_mm256_srli_epi32(w, 3), fifth));
        v[4] = _mm256_or_si256(v[4], _mm256_and_si256(_mm256_slli_epi32(w, 4), fifth));
        v[5] = _mm256_or_si256(v[5], _mm256_and_si256(_mm256_slli_epi32(w, 3), fifth));
        v[6] = _mm256_or_si256(v[6], _mm256_and_si256(_mm256_slli_epi32(w, 2), fifth));
        v[7] = _mm256_or_si256(v[7], _mm256_and_si256(_mm256_slli_epi32(w, 1), fifth));
    }
    v
}

/// The 8 quads of one Q8_0 block of a row group (stored unpacked).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn load_bytes_block(qs: *const u8) -> [std::arch::x86_64::__m256i; 8] {
    use std::arch::x86_64::*;
    let mut v = [_mm256_setzero_si256(); 8];
    for (q, vq) in v.iter_mut().enumerate() {
        *vq = _mm256_loadu_si256(qs.add(q * 32) as *const __m256i);
    }
    v
}

/// Per lane (row), the dot product of its 32 values with one activation block (`C`, the
/// number of independent accumulation chains, only matters to VNNI).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn block_dot_avx2<const C: usize>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // maddubs pairs stay below 2·31·127, so four quads summed in 16 bits cannot overflow
    let p = |q: usize| _mm256_maddubs_epi16(v[q], _mm256_set1_epi32(*x.add(q)));
    let lo = _mm256_add_epi16(_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3)));
    let hi = _mm256_add_epi16(_mm256_add_epi16(p(4), p(5)), _mm256_add_epi16(p(6), p(7)));
    let ones = _mm256_set1_epi16(1);
    _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones))
}

/// Per lane (row), the dot product of a block of Q8_0 values flipped back from `q + 128` to
/// signed `q` (see [`GroupRef::signed`]) with one activation block: `maddubs(|q|, sign(q)·x)`
/// (the sign goes to the activation, whose range excludes -128), whose pairs stay within
/// ±2·128·127, widened to 32 bits per quad. `bias` (`128·Σx`) is added back, so the result
/// is exactly the integer the biased layout gives on the VNNI path.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn block_dot_avx2_signed(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    bias: i32,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let ones = _mm256_set1_epi16(1);
    let mut sum = _mm256_set1_epi32(bias);
    for (q, vq) in v.iter().enumerate() {
        let xq = _mm256_set1_epi32(*x.add(q));
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(*vq, *vq), _mm256_sign_epi8(xq, *vq));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));
    }
    sum
}

/// `C` independent chains: one row alone needs several to hide `vpdpbusd`'s latency, while
/// many rows in flight hide it themselves and need the registers for their accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
#[inline]
unsafe fn block_dot_vnni<const C: usize>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let mut s = [_mm256_setzero_si256(); C];
    for (q, vq) in v.iter().enumerate() {
        s[q % C] = _mm256_dpbusd_epi32(s[q % C], *vq, _mm256_set1_epi32(*x.add(q)));
    }
    let mut sum = s[0];
    for &c in &s[1..] {
        sum = _mm256_add_epi32(sum, c);
    }
    sum
}

/// Per lane (row), the dot products of values 0..16 and 16..32 with one activation block
/// (types whose halves have their own scale; values at most 63, so a sum of two `maddubs`
/// pairs stays below 2¹⁵).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn half_dots_avx2<const C: usize>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
) -> [std::arch::x86_64::__m256i; 2] {
    use std::arch::x86_64::*;
    let p = |q: usize| _mm256_maddubs_epi16(v[q], _mm256_set1_epi32(*x.add(q)));
    let ones = _mm256_set1_epi16(1);
    let half = |q: usize| {
        let a = _mm256_madd_epi16(_mm256_add_epi16(p(q), p(q + 1)), ones);
        let b = _mm256_madd_epi16(_mm256_add_epi16(p(q + 2), p(q + 3)), ones);
        _mm256_add_epi32(a, b)
    };
    [half(0), half(4)]
}

/// `C` chains per half.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
#[inline]
unsafe fn half_dots_vnni<const C: usize>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
) -> [std::arch::x86_64::__m256i; 2] {
    use std::arch::x86_64::*;
    let mut out = [_mm256_setzero_si256(); 2];
    for (h, half) in out.iter_mut().enumerate() {
        let mut s = [_mm256_setzero_si256(); C];
        for q in 0..4 {
            let at = 4 * h + q;
            s[q % C] = _mm256_dpbusd_epi32(s[q % C], v[at], _mm256_set1_epi32(*x.add(at)));
        }
        *half = s[0];
        for &c in &s[1..] {
            *half = _mm256_add_epi32(*half, c);
        }
    }
    out
}

/// Batches of at most this many rows prefetch the next row group's weights (see
/// `group_kernel!`).
#[cfg(target_arch = "x86_64")]
const PREFETCH_MAX_ROWS: usize = 16;

/// Batches of more rows than this (prompts) fill a buffer with each row group's unpacked
/// values once per matmul and read it in passes of [`BUFFERED_ROWS`]; smaller ones (decode
/// batches) unpack again in every register pass (see `group_kernel!`).
#[cfg(target_arch = "x86_64")]
const UNPACK_MAX_ROWS: usize = 32;

/// Rows per pass over a buffered row group.
#[cfg(target_arch = "x86_64")]
const BUFFERED_ROWS: usize = 4;

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The unpacked blocks of the row group a batch's product is computing (see
    /// `group_kernel!`).
    static BUFFERED: std::cell::RefCell<Vec<[std::arch::x86_64::__m256i; 8]>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Where one row group's blocks live.
#[cfg(target_arch = "x86_64")]
struct GroupRef {
    q: *const u8,
    h: Option<*const u32>,
    d: *const f32,
    /// `None` for types whose offset is implied by the scale.
    m: Option<*const f32>,
    implied: f32,
    gbb: usize,
    bytes8: bool,
    /// Byte values are flipped from `q + 128` back to signed `q` when loaded (the AVX2 Q8_0
    /// path, whose dot product then adds `128·Σx` back).
    signed: bool,
    halves: usize,
}

#[cfg(target_arch = "x86_64")]
impl GroupRef {
    fn new(w: &NibbleMatrix, g: usize, signed: bool) -> Self {
        let (nb, gbb, halves) = (w.nb, w.kind.group_block_bytes(), w.kind.halves());
        // SAFETY: group `g` exists, so these offsets are inside the matrix's buffers.
        unsafe {
            GroupRef {
                q: w.qs.as_ptr().add(g * nb * gbb),
                h: (!w.qh.is_empty()).then(|| w.qh.as_ptr().add(g * nb * GROUP)),
                d: w.d.as_ptr().add(g * nb * GROUP * halves),
                m: w.kind
                    .has_min()
                    .then(|| w.m.as_ptr().add(g * nb * GROUP * halves)),
                implied: w.kind.implied_offset(),
                gbb,
                bytes8: w.kind.byte_values(),
                signed,
                halves,
            }
        }
    }

    /// Starts loading block `b` of the next row group (laid out right after this one's `nb`
    /// blocks) into L1.
    #[inline(always)]
    fn prefetch_next(&self, nb: usize, b: usize) {
        let per_block = GROUP * self.halves;
        let at = nb + b;
        prefetch_span(self.q.wrapping_add(at * self.gbb), self.gbb);
        prefetch_span(
            self.d.wrapping_add(at * per_block) as *const u8,
            4 * per_block,
        );
        if let Some(m) = self.m {
            prefetch_span(m.wrapping_add(at * per_block) as *const u8, 4 * per_block);
        }
        if let Some(h) = self.h {
            prefetch_span(h.wrapping_add(at * GROUP) as *const u8, 4 * GROUP);
        }
    }
}

/// Asks for every cache line of `bytes` bytes from `from` to be loaded into L1. The pointer
/// may be past the end of its buffer (the last row group's "next"): it is never read.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_span(from: *const u8, bytes: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    const LINE: usize = 64;
    let first = from as usize & !(LINE - 1);
    let last = (from as usize).wrapping_add(bytes - 1);
    let mut line = first;
    while line <= last {
        // SAFETY: a prefetch is a hint that never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
        line += LINE;
    }
}

/// The 8 quads of block `b` of a row group, whatever its storage.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn group_block(p: &GroupRef, b: usize) -> [std::arch::x86_64::__m256i; 8] {
    if p.bytes8 {
        let mut v = load_bytes_block(p.q.add(b * p.gbb));
        if p.signed {
            use std::arch::x86_64::{_mm256_set1_epi8, _mm256_xor_si256};
            let flip = _mm256_set1_epi8(-128);
            for vq in &mut v {
                *vq = _mm256_xor_si256(*vq, flip);
            }
        }
        v
    } else {
        unpack_block(p.q.add(b * p.gbb), p.h.map(|h| h.add(b * GROUP)))
    }
}

/// One row group times every activation row. `$rows` activation rows share one pass over
/// the group's values, with everything they need in registers (AVX2 has 16 of them, the
/// AVX512VL encodings used by the VNNI path 32). A batch of up to [`UNPACK_MAX_ROWS`] rows
/// unpacks the values again in each pass, except 5-bit values on the path that sets
/// `$buffer_5bit` (AVX2), whose fifth bits make the unpack dear enough that reading a buffer
/// filled once is cheaper; longer batches buffer every type (measurements:
/// docs/performance.md, session 15). Each row's arithmetic is the same whatever `R`, so a
/// row's result does not depend on the batch around it.
macro_rules! group_kernel {
    ($name:ident, $pass:ident, $features:literal, $dot:ident, $half_dots:ident,
     $signed:literal, $buffer_5bit:literal, $rows:literal, [$($r:literal),*]) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name(w: &NibbleMatrix, a: &Q8Activations, g: usize, out: &SharedMut) {
            let p = GroupRef::new(w, g, $signed);
            let run = |buffered: &mut Vec<[std::arch::x86_64::__m256i; 8]>| {
                buffered.clear();
                let mut chunk = $rows;
                let dear_unpack = $buffer_5bit && p.h.is_some();
                if a.m > $rows && (a.m > UNPACK_MAX_ROWS || dear_unpack) {
                    buffered.extend((0..w.nb).map(|b| group_block(&p, b)));
                    chunk = BUFFERED_ROWS;
                }
                let valid = GROUP.min(w.n_out - g * GROUP);
                let mut r0 = 0;
                while r0 < a.m {
                    let rows = (a.m - r0).min(chunk);
                    // the first pass over a group of a small batch asks for the next
                    // group's blocks while computing this one's, so the next unpack (or
                    // buffer fill) reads from cache instead of stalling on memory with no
                    // products in flight; a long batch computes long enough per group for
                    // the hardware prefetcher, and the extra loads only cost it
                    let prefetch = r0 == 0 && a.m <= PREFETCH_MAX_ROWS;
                    match (rows, prefetch) {
                        $(($r, true) => $pass::<$r, true>(w, &p, buffered, a, r0, valid, g, out),
                          ($r, false) => $pass::<$r, false>(w, &p, buffered, a, r0, valid, g, out),)*
                        _ => unreachable!(),
                    }
                    r0 += rows;
                }
            };
            // one buffer per thread, grown once: a batch's products used to allocate and
            // free one per row group (malloc was ~4% of an 8-stream decode)
            BUFFERED.with(|cell| match cell.try_borrow_mut() {
                Ok(mut buffered) => run(&mut buffered),
                Err(_) => run(&mut Vec::new()),
            })
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $pass<const R: usize, const PREFETCH: bool>(
            w: &NibbleMatrix,
            p: &GroupRef,
            buffered: &[[std::arch::x86_64::__m256i; 8]],
            a: &Q8Activations,
            r0: usize,
            valid: usize,
            g: usize,
            out: &SharedMut,
        ) {
            use std::arch::x86_64::*;
            let (k, nb) = (w.n_in, w.nb);
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                if PREFETCH {
                    p.prefetch_next(nb, b);
                }
                let v = match buffered.get(b) {
                    Some(v) => *v,
                    None => group_block(p, b),
                };
                let x = |i: usize| a.quants.as_ptr().add((r0 + i) * k + b * QK4_1) as *const i32;
                let at = |i: usize| (r0 + i) * nb + b;
                if p.halves == 2 {
                    let dv = _mm256_loadu_ps(p.d.add(b * GROUP * 2));
                    let dv1 = _mm256_loadu_ps(p.d.add(b * GROUP * 2 + GROUP));
                    let (mv, mv1) = match p.m {
                        Some(m) => (
                            _mm256_loadu_ps(m.add(b * GROUP * 2)),
                            _mm256_loadu_ps(m.add(b * GROUP * 2 + GROUP)),
                        ),
                        None => (
                            _mm256_mul_ps(_mm256_set1_ps(p.implied), dv),
                            _mm256_mul_ps(_mm256_set1_ps(p.implied), dv1),
                        ),
                    };
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let [lo, hi] = if R >= 4 {
                            $half_dots::<1>(&v, x(i))
                        } else {
                            $half_dots::<2>(&v, x(i))
                        };
                        let dx = _mm256_set1_ps(*a.scales.get_unchecked(at(i)));
                        let sums = a.half_sums.as_ptr().add(2 * at(i));
                        let dot_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(lo), dv);
                        let dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), dv1, dot_lo);
                        *acc = _mm256_fmadd_ps(dot, dx, *acc);
                        *acc = _mm256_fmadd_ps(mv, _mm256_set1_ps(*sums), *acc);
                        *acc = _mm256_fmadd_ps(mv1, _mm256_set1_ps(*sums.add(1)), *acc);
                    }
                    continue;
                }
                let dv = _mm256_loadu_ps(p.d.add(b * GROUP));
                let mv = match p.m {
                    Some(m) => _mm256_loadu_ps(m.add(b * GROUP)),
                    None => _mm256_mul_ps(_mm256_set1_ps(p.implied), dv),
                };
                for (i, acc) in acc.iter_mut().enumerate() {
                    let dot = if $signed {
                        block_dot_avx2_signed(&v, x(i), 128 * *a.int_sums.get_unchecked(at(i)))
                    } else if R >= 4 {
                        $dot::<1>(&v, x(i))
                    } else if R >= 2 {
                        $dot::<2>(&v, x(i))
                    } else {
                        $dot::<4>(&v, x(i))
                    };
                    let dot = _mm256_cvtepi32_ps(dot);
                    let dx = _mm256_set1_ps(*a.scales.get_unchecked(at(i)));
                    let sx = _mm256_set1_ps(*a.sums.get_unchecked(at(i)));
                    *acc = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, dx), *acc);
                    *acc = _mm256_fmadd_ps(mv, sx, *acc);
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                let dst = out.0.add((r0 + i) * w.n_out + g * GROUP);
                if valid == GROUP {
                    _mm256_storeu_ps(dst, *acc);
                } else {
                    let mut tmp = [0f32; GROUP];
                    _mm256_storeu_ps(tmp.as_mut_ptr(), *acc);
                    std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, valid);
                }
            }
        }
    };
}

group_kernel!(
    group_kernel_avx2,
    group_pass_avx2,
    "avx2,fma",
    block_dot_avx2,
    half_dots_avx2,
    false,
    true,
    4,
    [1, 2, 3, 4]
);
group_kernel!(
    group_kernel_avx2_q8,
    group_pass_avx2_q8,
    "avx2,fma",
    block_dot_avx2,
    half_dots_avx2,
    true,
    false,
    4,
    [1, 2, 3, 4]
);
group_kernel!(
    group_kernel_vnni,
    group_pass_vnni,
    "avx2,fma,avx512vnni,avx512vl",
    block_dot_vnni,
    half_dots_vnni,
    false,
    false,
    8,
    [1, 2, 3, 4, 5, 6, 7, 8]
);

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    const TYPES: [NibbleType; 5] = [
        NibbleType::Q4_0,
        NibbleType::Q4_1,
        NibbleType::Q5_0,
        NibbleType::Q5_1,
        NibbleType::Q8_0,
    ];

    use crate::kernels::lcg;

    /// Random blocks of `kind` in ggml's layout and their dequantized values.
    fn random_blocks(
        kind: NibbleType,
        n_out: usize,
        n_in: usize,
        seed: &mut u64,
    ) -> (Vec<u8>, Vec<f32>) {
        let levels = match kind {
            NibbleType::Q8_0 => 256.0,
            k if k.has_high_bits() => 32.0,
            _ => 16.0,
        };
        let mut bytes = Vec::new();
        let mut dense = Vec::new();
        for _ in 0..n_out * n_in / QK4_1 {
            let d = f16::from_f32(0.005 + lcg(seed).abs() * 0.01);
            bytes.extend_from_slice(&d.to_le_bytes());
            let min = if kind.has_min() {
                let m = f16::from_f32(-0.08 + lcg(seed) * 0.02);
                bytes.extend_from_slice(&m.to_le_bytes());
                m.to_f32()
            } else {
                kind.implied_offset() * d.to_f32()
            };
            let q: Vec<u32> = (0..QK4_1)
                .map(|_| ((lcg(seed) + 1.0) * (levels / 2.0 - 0.01)) as u32)
                .collect();
            if kind == NibbleType::Q8_0 {
                bytes.extend(q.iter().map(|&v| (v as i32 - 128) as i8 as u8));
            } else if kind.has_high_bits() {
                let qh: u32 = (0..QK4_1).map(|i| ((q[i] >> 4) & 1) << i).sum();
                bytes.extend_from_slice(&qh.to_le_bytes());
            }
            if kind != NibbleType::Q8_0 {
                for i in 0..PACKED {
                    bytes.push(((q[i] & 0xF) | ((q[i + PACKED] & 0xF) << 4)) as u8);
                }
            }
            dense.extend(q.iter().map(|&v| v as f32 * d.to_f32() + min));
        }
        (bytes, dense)
    }

    #[test]
    fn matches_a_dequantized_reference() {
        let mut seed = 4;
        for kind in TYPES {
            for &(n_out, n_in) in &[(7usize, 64usize), (33, 576), (130, 640), (1, 32)] {
                let (bytes, dense) = random_blocks(kind, n_out, n_in, &mut seed);
                let w = NibbleMatrix::from_bytes(kind, &bytes, n_out, n_in).unwrap();
                // activation quantization: half a step (1/127) per |w| term
                crate::kernels::check_against_reference(
                    &format!("{kind:?}"),
                    &dense,
                    n_out,
                    n_in,
                    &mut seed,
                    |x, m, out| w.matmul(x, m, out),
                    |row| row.iter().map(|v| v.abs()).sum::<f32>() * 0.5 / 127.0 + 1e-3,
                );
            }
        }
    }

    #[test]
    fn the_interleaved_layout_keeps_every_value() {
        let mut seed = 5;
        for kind in TYPES {
            let (bytes, dense) = random_blocks(kind, 13, 96, &mut seed);
            let w = NibbleMatrix::from_bytes(kind, &bytes, 13, 96).unwrap();
            for o in 0..13 {
                for b in 0..3 {
                    let blk = w.row_block(o, b);
                    for i in 0..QK4_1 {
                        let want = dense[o * 96 + b * 32 + i];
                        assert!((blk.value(i) - want).abs() < 1e-6, "{kind:?} {o} {b} {i}");
                    }
                }
            }
        }
    }

    /// The scalar, AVX2 and VNNI paths give bitwise the same products.
    pub(crate) fn assert_paths_agree(w12: &NibbleMatrix, seed: &mut u64) {
        #[cfg(target_arch = "x86_64")]
        let kind = w12.kind;
        let (n_out, k) = (w12.n_out, w12.n_in);
        let groups = n_out.div_ceil(GROUP);
        for m in [1usize, 3, 5, 9] {
            let x: Vec<f32> = (0..m * k).map(|_| lcg(seed)).collect();
            let a = Q8Activations::quantize(&x, m, k);
            let mut scalar = vec![0f32; m * n_out];
            let s = SharedMut(scalar.as_mut_ptr());
            for g in 0..groups {
                w12.group_scalar(&a, g, &s);
            }
            #[cfg(target_arch = "x86_64")]
            for (path, available) in [
                ("avx2", crate::kernels::has_avx2()),
                ("vnni", crate::kernels::has_vnni()),
            ] {
                if !available {
                    continue;
                }
                let mut simd = vec![0f32; m * n_out];
                let p = SharedMut(simd.as_mut_ptr());
                for g in 0..groups {
                    // SAFETY: the feature was detected above.
                    unsafe {
                        if path == "avx2" && kind == NibbleType::Q8_0 {
                            group_kernel_avx2_q8(w12, &a, g, &p)
                        } else if path == "avx2" {
                            group_kernel_avx2(w12, &a, g, &p)
                        } else {
                            group_kernel_vnni(w12, &a, g, &p)
                        }
                    }
                }
                assert_eq!(simd, scalar, "{kind:?} {path} m={m}");
            }
        }
    }

    #[test]
    fn scalar_and_simd_paths_agree_and_stack() {
        let mut seed = 11;
        for kind in TYPES {
            let (b1, _) = random_blocks(kind, 8, 128, &mut seed);
            let (b2, _) = random_blocks(kind, 4, 128, &mut seed);
            let (b12, _) = random_blocks(kind, 12, 128, &mut seed);
            let w = NibbleMatrix::from_bytes(kind, &b1, 8, 128).unwrap();
            let w12 = NibbleMatrix::from_bytes(kind, &b12, 12, 128).unwrap();
            assert_paths_agree(&w12, &mut seed);
            let x: Vec<f32> = (0..3 * 128).map(|_| lcg(&mut seed)).collect();
            let w2 = NibbleMatrix::from_bytes(kind, &b2, 4, 128).unwrap();
            let both = NibbleMatrix::concat(&[&w, &w2]).unwrap();
            let (mut o1, mut o) = (vec![0f32; 24], vec![0f32; 36]);
            w.matmul(&x, 3, &mut o1);
            both.matmul(&x, 3, &mut o);
            for r in 0..3 {
                for c in 0..8 {
                    let (p, q) = (o[r * 12 + c], o1[r * 8 + c]);
                    assert!((p - q).abs() <= 1e-4 * q.abs().max(1.0));
                }
            }
            assert!(NibbleMatrix::from_bytes(kind, &b1[..kind.block_bytes() - 1], 1, 32).is_none());
        }
        let (q4, _) = random_blocks(NibbleType::Q4_1, 4, 64, &mut seed);
        let (q5, _) = random_blocks(NibbleType::Q5_0, 4, 64, &mut seed);
        let a = NibbleMatrix::from_bytes(NibbleType::Q4_1, &q4, 4, 64).unwrap();
        let b = NibbleMatrix::from_bytes(NibbleType::Q5_0, &q5, 4, 64).unwrap();
        assert!(
            NibbleMatrix::concat(&[&a, &b]).is_none(),
            "types do not mix"
        );
    }
}
