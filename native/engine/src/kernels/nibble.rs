//! 4- and 5-bit weights with a per-block scale and offset (`w = d·q + m`), times f32
//! activations, kept packed: Q4_0 (`m = -8d`), Q4_1, Q5_0 (`m = -16d`) and Q5_1. Blocks hold
//! 32 values; value i sits in the low nibble of byte i, value i+16 in the high nibble, and
//! 5-bit types add bit i of a 32-bit word as the value's fifth bit.
//!
//! With activations quantized to Q8_0 (`x ≈ d_x·a`), one block contributes
//! `d·d_x·Σ q·a + m·(d_x·Σ a)` for types that store `m`, using the activation block sums
//! computed once per matmul. Types whose offset is implied (`w = d·(q - c)`) fold it into the
//! integer instead: `d·d_x·(Σ q·a - c·Σ a)`, as ggml's own dot products do, which spares a
//! multiply-add per row and block on the vector pipes the integer products also need (they
//! bound prompts on Zen 4: docs/performance.md, session 16). The values are unsigned, so
//! `maddubs(q, a)` needs no sign trick.

use super::q8::{Q8Activations, QK8_0};
use super::weights::{PinStore, Pinnable, Store};
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

    /// The `c` of `w = d·(q - c)` folded into the integer dot products (0 for types that
    /// store their offset).
    fn folded_offset(self) -> i32 {
        if self.has_min() {
            0
        } else {
            -self.implied_offset() as i32
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

/// Most parts [`NibbleMatrix::matmul_parts`] writes (Q/K/V).
pub const MAX_PARTS: usize = 4;

/// Where a product's output columns go: part `p` holds columns `start[p]..start[p + 1]` as
/// its own row-major `[m, start[p + 1] - start[p]]` matrix. One part is a plain `[m, n_out]`
/// output; several are a stacked matrix's parts, written in place (each part but the last
/// a whole number of row groups, so no group straddles two).
#[derive(Clone, Copy)]
pub(crate) struct Dest {
    base: [*mut f32; MAX_PARTS],
    start: [usize; MAX_PARTS + 1],
    parts: usize,
}

// SAFETY: every task writes a distinct set of output elements (its own weight rows' columns).
unsafe impl Sync for Dest {}
unsafe impl Send for Dest {}

impl Dest {
    pub(crate) fn one(out: &mut [f32], n_out: usize) -> Self {
        let mut start = [n_out; MAX_PARTS + 1];
        start[0] = 0;
        Dest {
            base: [out.as_mut_ptr(); MAX_PARTS],
            start,
            parts: 1,
        }
    }

    /// Column `col` of output row `r`, and the columns of its part from there on.
    #[inline(always)]
    fn at(&self, r: usize, col: usize) -> *mut f32 {
        let mut p = 0;
        while p + 1 < self.parts && col >= self.start[p + 1] {
            p += 1;
        }
        let width = self.start[p + 1] - self.start[p];
        self.base[p].wrapping_add(r * width + col - self.start[p])
    }
}

/// A matrix `[n_out, n_in]` repacked in groups of [`GROUP`] output rows, interleaved per
/// block so that a 256-bit vector holds 4 consecutive values of each of the 8 rows.
///
/// Per row group and block: `d` is 8 scales (one per row), and so is `m` for types with a
/// stored minimum (the others' offset is implied by `d`, so it is not stored), in the
/// precision they need ([`Scales`]). `qs` is 4 chunks of 32
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
    d: Scales,
    m: Scales,
    qs: Store<u8>,
    qh: Store<u32>,
}

impl Pinnable for NibbleMatrix {
    fn stores(&mut self, f: &mut dyn FnMut(&mut dyn PinStore)) {
        for s in [&mut self.d, &mut self.m] {
            match s {
                Scales::F16(v) => f(v),
                Scales::F32(v) => f(v),
            }
        }
        f(&mut self.qs);
        f(&mut self.qh);
    }
}

/// A matrix's block scales (or minimums): f16 when every one of them is an f16 value, which
/// the native types' always are (they come from the file's f16 fields), else f32 (K-quant
/// sub-block scales `d·sc_j`). Decode reads every weight byte once per token, and f32 copies
/// of f16 scales made it read 15.6% (SmolLM2 Q4_1) and 9.8% (Gemma 3 Q4_K_M) more than the
/// file holds (docs/performance.md, session 18).
#[derive(Debug, Clone)]
enum Scales {
    F16(Store<f16>),
    F32(Store<f32>),
}

impl Scales {
    /// `v` in f16 when that is exact for every value.
    fn new(v: Vec<f32>) -> Self {
        let exact = |x: &f32| f16::from_f32(*x).to_f32().to_bits() == x.to_bits();
        if v.iter().all(exact) {
            Scales::F16(
                v.iter()
                    .map(|&x| f16::from_f32(x))
                    .collect::<Vec<_>>()
                    .into(),
            )
        } else {
            Scales::F32(v.into())
        }
    }

    fn get(&self, i: usize) -> f32 {
        match self {
            Scales::F16(v) => v[i].to_f32(),
            Scales::F32(v) => v[i],
        }
    }

    fn reserve_exact(&mut self, n: usize) {
        match self {
            Scales::F16(v) => v.vec_mut().reserve_exact(n),
            Scales::F32(v) => v.vec_mut().reserve_exact(n),
        }
    }

    /// Appends `other`'s values (both in f32 unless both are f16).
    fn extend(&mut self, other: &Scales) {
        match (&mut *self, other) {
            (Scales::F16(a), Scales::F16(b)) => a.vec_mut().extend_from_slice(b),
            (Scales::F32(a), Scales::F32(b)) => a.vec_mut().extend_from_slice(b),
            (Scales::F32(a), Scales::F16(b)) => a.vec_mut().extend(b.iter().map(|h| h.to_f32())),
            (Scales::F16(a), Scales::F32(b)) => {
                let mut all: Vec<f32> = a.iter().map(|h| h.to_f32()).collect();
                all.extend_from_slice(b);
                *self = Scales::F32(all.into());
            }
        }
    }

    /// Where value `i` lies, for the kernels.
    #[cfg(target_arch = "x86_64")]
    fn at(&self, i: usize) -> ScalePtr {
        match self {
            Scales::F16(v) => ScalePtr {
                at: v.as_ptr().wrapping_add(i) as *const u8,
                half: true,
            },
            Scales::F32(v) => ScalePtr {
                at: v.as_ptr().wrapping_add(i) as *const u8,
                half: false,
            },
        }
    }
}

/// A position in a [`Scales`] for the kernels: 8 consecutive values are one row group's.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct ScalePtr {
    at: *const u8,
    half: bool,
}

#[cfg(target_arch = "x86_64")]
impl ScalePtr {
    /// `n` values further on (may point past the end: only ever prefetched there).
    #[inline(always)]
    fn add(self, n: usize) -> Self {
        ScalePtr {
            at: self.at.wrapping_add(n * self.bytes_per()),
            half: self.half,
        }
    }

    #[inline(always)]
    fn bytes_per(self) -> usize {
        if self.half {
            2
        } else {
            4
        }
    }

    /// The 8 values from here, as f32.
    ///
    /// # Safety
    /// 8 values from here lie inside their buffer; F16C is available.
    #[target_feature(enable = "avx,f16c")]
    #[inline]
    unsafe fn load8(self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        if self.half {
            _mm256_cvtph_ps(_mm_loadu_si128(self.at as *const __m128i))
        } else {
            _mm256_loadu_ps(self.at as *const f32)
        }
    }
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
            d: Scales::new(d),
            m: Scales::new(m),
            qs: qs.into(),
            qh: qh.into(),
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
            d: [self.d.get(at(0)), self.d.get(at(last))],
            m: [self.offset(at(0)), self.offset(at(last))],
            vals,
        }
    }

    /// The offset of the scale at `at` in `d`: stored for types with a minimum, else implied
    /// (`implied_offset · d`, the same f32 product the loader used to compute).
    fn offset(&self, at: usize) -> f32 {
        if self.kind.has_min() {
            self.m.get(at)
        } else {
            self.kind.implied_offset() * self.d.get(at)
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
            .vec_mut()
            .reserve_exact(blocks * self.kind.group_block_bytes());
        if self.kind.has_high_bits() {
            self.qh.vec_mut().reserve_exact(blocks * GROUP);
        }
    }

    /// Appends `other`'s rows below this matrix's; `None` (and nothing changes) unless both
    /// have the same type and input width and this matrix fills its last row group.
    pub fn append(&mut self, other: NibbleMatrix) -> Option<()> {
        if other.kind != self.kind || other.n_in != self.n_in || !self.n_out.is_multiple_of(GROUP) {
            return None;
        }
        self.n_out += other.n_out;
        self.d.extend(&other.d);
        self.m.extend(&other.m);
        self.qs.vec_mut().extend_from_slice(&other.qs);
        self.qh.vec_mut().extend_from_slice(&other.qh);
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
        assert_eq!(out.len(), m * self.n_out);
        self.matmul_into(x, m, &Dest::one(out, self.n_out));
    }

    /// The product of a matrix stacked from parts of `n_out`s `widths` (Q/K/V, gate/up) into
    /// one `[m, width]` output per part, written in place instead of split afterwards (the
    /// copy was 3% of a prompt). `None`, with nothing written, unless every part but the
    /// last is a whole number of row groups and there are at most [`MAX_PARTS`].
    pub fn matmul_parts(
        &self,
        x: &[f32],
        m: usize,
        widths: &[usize],
        outs: &mut [&mut Vec<f32>],
    ) -> Option<()> {
        let n = widths.len();
        let fits = n <= MAX_PARTS
            && outs.len() == n
            && widths.iter().sum::<usize>() == self.n_out
            && widths[..n.saturating_sub(1)].iter().all(|w| w % GROUP == 0);
        if !fits {
            return None;
        }
        let mut dest = Dest {
            base: [std::ptr::null_mut(); MAX_PARTS],
            start: [self.n_out; MAX_PARTS + 1],
            parts: n,
        };
        let mut col = 0;
        for (p, (out, &width)) in outs.iter_mut().zip(widths).enumerate() {
            out.resize(m * width, 0.0);
            dest.base[p] = out.as_mut_ptr();
            dest.start[p] = col;
            col += width;
        }
        self.matmul_into(x, m, &dest);
        Some(())
    }

    fn matmul_into(&self, x: &[f32], m: usize, shared: &Dest) {
        assert_eq!(x.len(), m * self.n_in);
        let macs = m * self.n_out * self.n_in;
        Q8Activations::with_quantized(x, m, self.n_in, self.kind.folded_offset(), |a| {
            if self.pairs_groups(m) {
                return super::for_each_tile(self.n_out, 2 * GROUP, macs, |o0, rows| {
                    self.group_pair(a, o0 / GROUP, rows, shared)
                });
            }
            if self.wide_groups() {
                return super::for_each_tile(self.n_out, 2 * GROUP, macs, |o0, rows| {
                    self.group_wide(a, o0 / GROUP, rows, shared)
                });
            }
            super::for_each_tile(self.n_out, GROUP, macs, |o0, _| {
                self.group(a, o0 / GROUP, shared)
            })
        });
    }

    fn group(&self, a: &Q8Activations, g: usize, out: &Dest) {
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

    /// Whether a product of `m` activation rows runs on pairs of row groups
    /// ([`pair_kernel_vnni`]): long batches on the VNNI path.
    fn pairs_groups(&self, m: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        if super::has_vnni() {
            return m > UNPACK_MAX_ROWS;
        }
        let _ = m;
        false
    }

    /// Whether short batches (decode) run two row groups per pass in 512-bit vectors
    /// ([`wide_kernel_vnni`]): on the VNNI path.
    fn wide_groups(&self) -> bool {
        super::has_vnni()
    }

    /// Row groups `g` and `g + 1` in 512-bit vectors (a tile of `rows` output rows: one
    /// group, in 256-bit vectors, when it is the last and alone).
    fn group_wide(&self, a: &Q8Activations, g: usize, rows: usize, out: &Dest) {
        #[cfg(target_arch = "x86_64")]
        if rows > GROUP {
            // SAFETY: only called when VNNI was detected (`wide_groups`); both groups exist
            // (the tile has more than one group's rows) and write only their own output
            // columns; offsets as in `group`.
            return unsafe { wide_kernel_vnni(self, a, g, out) };
        }
        let _ = rows;
        self.group(a, g, out)
    }

    /// Row groups `g` and `g + 1` (a tile of `rows` output rows: one group when it is the
    /// last and alone).
    fn group_pair(&self, a: &Q8Activations, g: usize, rows: usize, out: &Dest) {
        #[cfg(target_arch = "x86_64")]
        if rows > GROUP {
            // SAFETY: only called when VNNI was detected (`pairs_groups`); both groups
            // exist (the tile has more than one group's rows) and write only their own
            // output columns; offsets as in `group`.
            return unsafe { pair_kernel_vnni(self, a, g, out) };
        }
        let _ = rows;
        self.group(a, g, out)
    }

    fn group_scalar(&self, a: &Q8Activations, g: usize, out: &Dest) {
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
    fn row_scalar(&self, a: &Q8Activations, o: usize, blocks: &[RowBlock], out: &Dest) {
        let (k, nb) = (self.n_in, self.nb);
        for r in 0..a.m {
            let mut acc = 0f32;
            for (b, blk) in blocks.iter().enumerate() {
                let x = &a.quants[r * k + b * QK4_1..][..QK4_1];
                let dot = |range: std::ops::Range<usize>, folded: i32| -> f32 {
                    let d = range.map(|i| blk.vals[i] as i32 * x[i] as i32).sum::<i32>();
                    (d + folded) as f32
                };
                let at = r * nb + b;
                let dx = a.scales[at];
                if self.kind.halves() == 2 {
                    let half = QK4_1 / 2;
                    let [lo, hi] = [a.folded_halves[2 * at], a.folded_halves[2 * at + 1]];
                    let lo = dot(0..half, lo) * blk.d[0];
                    acc = dot(half..QK4_1, hi).mul_add(blk.d[1], lo).mul_add(dx, acc);
                } else if self.kind.has_min() {
                    acc = dot(0..QK4_1, 0).mul_add(blk.d[0] * dx, acc);
                    acc = blk.m[0].mul_add(a.sums[at], acc);
                } else {
                    acc = dot(0..QK4_1, a.folded[at]).mul_add(blk.d[0] * dx, acc);
                }
            }
            // SAFETY: (r, o) is in bounds and written by this row group only.
            unsafe { *out.at(r, o) = acc };
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
/// number of independent accumulation chains, only matters to VNNI). `NARROW`: the values
/// are 4-bit (at most 15), so all 8 quads' `maddubs` pairs (each within ±2·15·127) sum in 16
/// bits without overflow and one `madd` widens them, instead of two for 5-bit values (at
/// most 31: four quads per 16-bit sum). The AVX2 products are bound by the vector pipes
/// that `maddubs`, `madd` and the float multiply-adds share (docs/performance.md, session
/// 21), so each one saved counts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn block_dot_avx2<const C: usize, const NARROW: bool>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    folded: i32,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let p = |q: usize| _mm256_maddubs_epi16(v[q], _mm256_set1_epi32(*x.add(q)));
    let lo = _mm256_add_epi16(_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3)));
    let hi = _mm256_add_epi16(_mm256_add_epi16(p(4), p(5)), _mm256_add_epi16(p(6), p(7)));
    let ones = _mm256_set1_epi16(1);
    let dot = if NARROW {
        _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones)
    } else {
        _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones))
    };
    _mm256_add_epi32(dot, _mm256_set1_epi32(folded))
}

/// Per lane (row), the dot product of a block of Q8_0 values flipped back from `q + 128` to
/// signed `q` (see [`GroupRef::signed`]) with one activation block: `maddubs(|q|, sign(q)·x)`
/// (the sign goes to the activation, whose range excludes -128), whose pairs stay within
/// ±2·128·127, widened to 32 bits per quad: exactly the integer the VNNI path gets from the
/// biased values and the folded offset.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn block_dot_avx2_signed(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let ones = _mm256_set1_epi16(1);
    let mut sum = _mm256_setzero_si256();
    for (q, vq) in v.iter().enumerate() {
        let xq = _mm256_set1_epi32(*x.add(q));
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(*vq, *vq), _mm256_sign_epi8(xq, *vq));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));
    }
    sum
}

/// `C` independent chains: one row alone needs several to hide `vpdpbusd`'s latency, while
/// many rows in flight hide it themselves and need the registers for their accumulators
/// (`NARROW` only matters to AVX2: `vpdpbusd` widens to 32 bits itself).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
#[inline]
unsafe fn block_dot_vnni<const C: usize, const NARROW: bool>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    folded: i32,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let mut s = [_mm256_setzero_si256(); C];
    s[0] = _mm256_set1_epi32(folded);
    for (q, vq) in v.iter().enumerate() {
        s[q % C] = _mm256_dpbusd_epi32(s[q % C], *vq, _mm256_set1_epi32(*x.add(q)));
    }
    let mut sum = s[0];
    for &c in &s[1..] {
        sum = _mm256_add_epi32(sum, c);
    }
    sum
}

/// Per lane (row), the dot products of values 0..16 and 16..32 with one activation block, plus
/// their folded offsets (types whose halves have their own scale; values at most 63, so a sum
/// of two `maddubs` pairs stays below 2¹⁵).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn half_dots_avx2<const C: usize>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    folded: [i32; 2],
) -> [std::arch::x86_64::__m256i; 2] {
    use std::arch::x86_64::*;
    let p = |q: usize| _mm256_maddubs_epi16(v[q], _mm256_set1_epi32(*x.add(q)));
    let ones = _mm256_set1_epi16(1);
    let half = |q: usize, folded: i32| {
        let a = _mm256_madd_epi16(_mm256_add_epi16(p(q), p(q + 1)), ones);
        let b = _mm256_madd_epi16(_mm256_add_epi16(p(q + 2), p(q + 3)), ones);
        _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_set1_epi32(folded))
    };
    [half(0, folded[0]), half(4, folded[1])]
}

/// `C` chains per half.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
#[inline]
unsafe fn half_dots_vnni<const C: usize>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    folded: [i32; 2],
) -> [std::arch::x86_64::__m256i; 2] {
    use std::arch::x86_64::*;
    let mut out = [_mm256_setzero_si256(); 2];
    for (h, half) in out.iter_mut().enumerate() {
        let mut s = [_mm256_setzero_si256(); C];
        s[0] = _mm256_set1_epi32(folded[h]);
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
    d: ScalePtr,
    /// `None` for types whose offset is implied by the scale.
    m: Option<ScalePtr>,
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
                d: w.d.at(g * nb * GROUP * halves),
                m: w.kind.has_min().then(|| w.m.at(g * nb * GROUP * halves)),
                gbb,
                bytes8: w.kind.byte_values(),
                signed,
                halves,
            }
        }
    }

    /// Row groups `g` and `g + 1` (which must exist) and how many of their 8 rows are real
    /// (the second may be a matrix's last, partial group), for the two-group kernels.
    fn pair(w: &NibbleMatrix, g: usize) -> ([Self; 2], [usize; 2]) {
        let refs = [GroupRef::new(w, g, false), GroupRef::new(w, g + 1, false)];
        (refs, [GROUP, GROUP.min(w.n_out - (g + 1) * GROUP)])
    }

    /// Starts loading block `b` of the next row group (laid out right after this one's `nb`
    /// blocks) into L1.
    #[inline(always)]
    fn prefetch_next(&self, nb: usize, b: usize) {
        self.prefetch_block::<{ std::arch::x86_64::_MM_HINT_T0 }>(nb + b)
    }

    /// Starts loading the block `at` blocks after this group's first (the row groups are
    /// laid out one after the other) into the caches `HINT` names.
    #[inline(always)]
    fn prefetch_block<const HINT: i32>(&self, at: usize) {
        let per_block = GROUP * self.halves;
        prefetch_span::<HINT>(self.q.wrapping_add(at * self.gbb), self.gbb);
        // a block's scales (and minimums) are 16–64 bytes: the lines of their first and last
        // byte cover them (a loop over a span whose length is known only at run time cost
        // more than the prefetches saved)
        for s in [Some(self.d), self.m].into_iter().flatten() {
            let from = s.add(at * per_block).at;
            let last = from.wrapping_add(s.bytes_per() * per_block - 1);
            // SAFETY: a prefetch is a hint that never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<HINT>(from as *const i8);
                std::arch::x86_64::_mm_prefetch::<HINT>(last as *const i8);
            }
        }
        if let Some(h) = self.h {
            prefetch_span::<HINT>(h.wrapping_add(at * GROUP) as *const u8, 4 * GROUP);
        }
    }
}

/// Asks for every cache line of `bytes` bytes from `from` to be loaded into the caches
/// `HINT` names. The pointer may be past the end of its buffer (the last row group's
/// "next"): it is never read.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_span<const HINT: i32>(from: *const u8, bytes: usize) {
    use std::arch::x86_64::_mm_prefetch;
    const LINE: usize = 64;
    let first = from as usize & !(LINE - 1);
    let last = (from as usize).wrapping_add(bytes - 1);
    let mut line = first;
    while line <= last {
        // SAFETY: a prefetch is a hint that never faults, whatever the address.
        unsafe { _mm_prefetch::<HINT>(line as *const i8) };
        line += LINE;
    }
}

/// One activation row's results for a row group: the first `valid` of its 8 lanes (fewer
/// than 8 only in a matrix's last group) into `dst`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[inline]
unsafe fn store_group(acc: std::arch::x86_64::__m256, dst: *mut f32, valid: usize) {
    use std::arch::x86_64::_mm256_storeu_ps;
    if valid == GROUP {
        _mm256_storeu_ps(dst, acc);
    } else {
        let mut tmp = [0f32; GROUP];
        _mm256_storeu_ps(tmp.as_mut_ptr(), acc);
        std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, valid);
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
     $signed:literal, $buffer_5bit:literal, $narrow:literal, $rows:literal, [$($r:literal),*]) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name(w: &NibbleMatrix, a: &Q8Activations, g: usize, out: &Dest) {
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
                    // 4-bit values (no fifth bits, not stored as bytes), on a path whose
                    // dot products gain from knowing it
                    let narrow = $narrow && !p.bytes8 && p.h.is_none();
                    match (rows, prefetch, narrow) {
                        $(($r, true, true) =>
                            $pass::<$r, true, true>(w, &p, buffered, a, r0, valid, g, out),
                          ($r, true, false) =>
                            $pass::<$r, true, false>(w, &p, buffered, a, r0, valid, g, out),
                          ($r, false, true) =>
                            $pass::<$r, false, true>(w, &p, buffered, a, r0, valid, g, out),
                          ($r, false, false) =>
                            $pass::<$r, false, false>(w, &p, buffered, a, r0, valid, g, out),)*
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
        unsafe fn $pass<const R: usize, const PREFETCH: bool, const NARROW: bool>(
            w: &NibbleMatrix,
            p: &GroupRef,
            buffered: &[[std::arch::x86_64::__m256i; 8]],
            a: &Q8Activations,
            r0: usize,
            valid: usize,
            g: usize,
            out: &Dest,
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
                    // (split types have implied offsets, folded into the integers)
                    let dv = p.d.add(b * GROUP * 2).load8();
                    let dv1 = p.d.add(b * GROUP * 2 + GROUP).load8();
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let f = a.folded_halves.as_ptr().add(2 * at(i));
                        let f = [*f, *f.add(1)];
                        let [lo, hi] = if R >= 4 {
                            $half_dots::<1>(&v, x(i), f)
                        } else {
                            $half_dots::<2>(&v, x(i), f)
                        };
                        let dx = _mm256_set1_ps(*a.scales.get_unchecked(at(i)));
                        let dot_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(lo), dv);
                        let dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), dv1, dot_lo);
                        *acc = _mm256_fmadd_ps(dot, dx, *acc);
                    }
                    continue;
                }
                let dv = p.d.add(b * GROUP).load8();
                let dot = |i: usize, folded: i32| {
                    if $signed {
                        block_dot_avx2_signed(&v, x(i))
                    } else if R >= 4 {
                        $dot::<1, NARROW>(&v, x(i), folded)
                    } else if R >= 2 {
                        $dot::<2, NARROW>(&v, x(i), folded)
                    } else {
                        $dot::<4, NARROW>(&v, x(i), folded)
                    }
                };
                match p.m {
                    Some(m) => {
                        let mv = m.add(b * GROUP).load8();
                        for (i, acc) in acc.iter_mut().enumerate() {
                            let dot = _mm256_cvtepi32_ps(dot(i, 0));
                            let dx = _mm256_set1_ps(*a.scales.get_unchecked(at(i)));
                            let sx = _mm256_set1_ps(*a.sums.get_unchecked(at(i)));
                            *acc = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, dx), *acc);
                            *acc = _mm256_fmadd_ps(mv, sx, *acc);
                        }
                    }
                    None => {
                        for (i, acc) in acc.iter_mut().enumerate() {
                            let folded = *a.folded.get_unchecked(at(i));
                            let dot = _mm256_cvtepi32_ps(dot(i, folded));
                            let dx = _mm256_set1_ps(*a.scales.get_unchecked(at(i)));
                            *acc = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, dx), *acc);
                        }
                    }
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                store_group(*acc, out.at(r0 + i, g * GROUP), valid);
            }
        }
    };
}

group_kernel!(
    group_kernel_avx2,
    group_pass_avx2,
    "avx2,fma,f16c",
    block_dot_avx2,
    half_dots_avx2,
    false,
    true,
    true,
    4,
    [1, 2, 3, 4]
);
group_kernel!(
    group_kernel_avx2_q8,
    group_pass_avx2_q8,
    "avx2,fma,f16c",
    block_dot_avx2,
    half_dots_avx2,
    true,
    false,
    false,
    4,
    [1, 2, 3, 4]
);
group_kernel!(
    group_kernel_vnni,
    group_pass_vnni,
    "avx2,fma,f16c,avx512vnni,avx512vl",
    block_dot_vnni,
    half_dots_vnni,
    false,
    false,
    false,
    8,
    [1, 2, 3, 4, 5, 6, 7, 8]
);

/// Rows per pass of [`wide_kernel_vnni`].
#[cfg(target_arch = "x86_64")]
const WIDE_ROWS: usize = 8;

/// Row groups `g` and `g + 1` times every activation row of a short batch (decode), on the
/// VNNI path, in 512-bit vectors: lanes 0..8 are group `g`'s rows, 8..16 group `g + 1`'s. An
/// activation quad is broadcast once for 16 weight rows instead of 8, halving the loads of a
/// pass, which bound the 256-bit one-group passes (docs/performance.md, sessions 16 and 18);
/// `vpdpbusd` on 512 bits does the work of two on 256 (Zen 4 splits it in two halves, Intel's
/// server cores run it on two ports). Each lane's arithmetic is the one of
/// `group_kernel_vnni`, so results are bitwise the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni,avx512vl")]
unsafe fn wide_kernel_vnni(w: &NibbleMatrix, a: &Q8Activations, g: usize, out: &Dest) {
    let (p, valid) = GroupRef::pair(w, g);
    let mut r0 = 0;
    while r0 < a.m {
        let rows = (a.m - r0).min(WIDE_ROWS);
        // the first pass asks for the next tile's blocks while computing this one's: unlike
        // one group's blocks, read as one sequential stream, two groups' blocks are read as
        // two streams that jump ahead by a group at every tile, which the hardware
        // prefetchers do not follow (without these prefetches a 512-bit pass over Gemma 3's
        // head read 12-13 GB/s on one core, 256-bit ones 18-21)
        let prefetch = r0 == 0;
        macro_rules! pass {
            ($($r:literal),*) => {
                match (rows, prefetch) {
                    $(($r, true) => wide_pass_vnni::<$r, true>(w, &p, a, r0, valid, g, out),
                      ($r, false) => wide_pass_vnni::<$r, false>(w, &p, a, r0, valid, g, out),)*
                    _ => unreachable!(),
                }
            };
        }
        pass!(1, 2, 3, 4, 5, 6, 7, 8);
        r0 += rows;
    }
}

/// Two 256-bit halves as one 512-bit vector (`lo` in lanes 0..8).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn join_si(
    lo: std::arch::x86_64::__m256i,
    hi: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// Group `g`'s 8 scales at `lo` and group `g + 1`'s at `hi` as one vector.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c,avx512f")]
#[inline]
unsafe fn join_ps(lo: ScalePtr, hi: ScalePtr) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let lo = _mm256_castps_si256(lo.load8());
    let hi = _mm256_castps_si256(hi.load8());
    _mm512_castsi512_ps(join_si(lo, hi))
}

/// The 8 quads of block `b` of both row groups: vector `q` holds values `4q..4q + 4` of
/// each of the 16 rows (the unpacking of [`unpack_block`] on both halves at once).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f")]
#[inline]
unsafe fn wide_block(p: &[GroupRef; 2], b: usize) -> [std::arch::x86_64::__m512i; 8] {
    use std::arch::x86_64::*;
    let load =
        |j: usize, at: usize| _mm256_loadu_si256(p[j].q.add(b * p[j].gbb + at) as *const __m256i);
    let mut v = [_mm512_setzero_si512(); 8];
    if p[0].bytes8 {
        for (q, vq) in v.iter_mut().enumerate() {
            *vq = join_si(load(0, q * 32), load(1, q * 32));
        }
        return v;
    }
    let low = _mm512_set1_epi8(0x0F);
    for c in 0..4 {
        let packed = join_si(load(0, c * 32), load(1, c * 32));
        v[c] = _mm512_and_si512(packed, low);
        // per byte, the high nibble (what a shift crosses into a byte is masked off)
        v[c + 4] = _mm512_and_si512(_mm512_srli_epi32::<4>(packed), low);
    }
    if let (Some(h0), Some(h1)) = (p[0].h, p[1].h) {
        let w = join_si(
            _mm256_loadu_si256(h0.add(b * GROUP) as *const __m256i),
            _mm256_loadu_si256(h1.add(b * GROUP) as *const __m256i),
        );
        let fifth = _mm512_set1_epi8(0x10);
        let or = |v: __m512i, bits: __m512i| _mm512_or_si512(v, _mm512_and_si512(bits, fifth));
        v[0] = or(v[0], w);
        v[1] = or(v[1], _mm512_srli_epi32::<1>(w));
        v[2] = or(v[2], _mm512_srli_epi32::<2>(w));
        v[3] = or(v[3], _mm512_srli_epi32::<3>(w));
        v[4] = or(v[4], _mm512_slli_epi32::<4>(w));
        v[5] = or(v[5], _mm512_slli_epi32::<3>(w));
        v[6] = or(v[6], _mm512_slli_epi32::<2>(w));
        v[7] = or(v[7], _mm512_slli_epi32::<1>(w));
    }
    v
}

/// Per lane (row of either group), the dot product of the quads `quads` with one activation
/// block, plus `folded`, in `C` independent chains (as [`block_dot_vnni`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
unsafe fn wide_dot<const C: usize>(
    v: &[std::arch::x86_64::__m512i; 8],
    quads: std::ops::Range<usize>,
    x: *const i32,
    folded: i32,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let mut s = [_mm512_setzero_si512(); C];
    s[0] = _mm512_set1_epi32(folded);
    for (n, q) in quads.enumerate() {
        s[n % C] = _mm512_dpbusd_epi32(s[n % C], v[q], _mm512_set1_epi32(*x.add(q)));
    }
    let mut sum = s[0];
    for &c in &s[1..] {
        sum = _mm512_add_epi32(sum, c);
    }
    sum
}

/// `R` activation rows times both row groups of [`wide_kernel_vnni`]; the blocks are
/// unpacked in registers once per pass, as `group_kernel!`'s short batches do.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni,avx512vl")]
#[allow(clippy::too_many_arguments)]
unsafe fn wide_pass_vnni<const R: usize, const PREFETCH: bool>(
    w: &NibbleMatrix,
    p: &[GroupRef; 2],
    a: &Q8Activations,
    r0: usize,
    valid: [usize; 2],
    g: usize,
    out: &Dest,
) {
    use std::arch::x86_64::*;
    let (k, nb) = (w.n_in, w.nb);
    // one row alone needs several chains to hide `vpdpbusd`'s latency; many rows hide it
    // themselves and need the registers
    macro_rules! dot {
        ($v:expr, $quads:expr, $x:expr, $folded:expr) => {
            if R >= 4 {
                wide_dot::<1>($v, $quads, $x, $folded)
            } else if R >= 2 {
                wide_dot::<2>($v, $quads, $x, $folded)
            } else {
                wide_dot::<4>($v, $quads, $x, $folded)
            }
        };
    }
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        if PREFETCH {
            // the next tile: groups g + 2 and g + 3
            // the next tile (groups g + 2 and g + 3) to the outer caches: `T0` prefetches
            // of 16 rows' blocks take the L1 miss buffers the loads need (an 8-row head
            // product at 77-82 GMAC/s with them, 111-131 with `T2`)
            p[0].prefetch_block::<_MM_HINT_T2>(2 * nb + b);
            p[1].prefetch_block::<_MM_HINT_T2>(2 * nb + b);
        }
        let v = wide_block(p, b);
        let x = |i: usize| a.quants.as_ptr().add((r0 + i) * k + b * QK4_1) as *const i32;
        let at = |i: usize| (r0 + i) * nb + b;
        if p[0].halves == 2 {
            // (split types have implied offsets, folded into the integers)
            let dv = join_ps(p[0].d.add(b * GROUP * 2), p[1].d.add(b * GROUP * 2));
            let dv1 = join_ps(
                p[0].d.add(b * GROUP * 2 + GROUP),
                p[1].d.add(b * GROUP * 2 + GROUP),
            );
            for (i, acc) in acc.iter_mut().enumerate() {
                let f = a.folded_halves.as_ptr().add(2 * at(i));
                let lo = dot!(&v, 0..4, x(i), *f);
                let hi = dot!(&v, 4..8, x(i), *f.add(1));
                let dx = _mm512_set1_ps(*a.scales.get_unchecked(at(i)));
                let dot_lo = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), dv);
                let dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), dv1, dot_lo);
                *acc = _mm512_fmadd_ps(dot, dx, *acc);
            }
            continue;
        }
        let dv = join_ps(p[0].d.add(b * GROUP), p[1].d.add(b * GROUP));
        match (p[0].m, p[1].m) {
            (Some(m0), Some(m1)) => {
                let mv = join_ps(m0.add(b * GROUP), m1.add(b * GROUP));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let dot = _mm512_cvtepi32_ps(dot!(&v, 0..8, x(i), 0));
                    let dx = _mm512_set1_ps(*a.scales.get_unchecked(at(i)));
                    let sx = _mm512_set1_ps(*a.sums.get_unchecked(at(i)));
                    *acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, dx), *acc);
                    *acc = _mm512_fmadd_ps(mv, sx, *acc);
                }
            }
            _ => {
                for (i, acc) in acc.iter_mut().enumerate() {
                    let folded = *a.folded.get_unchecked(at(i));
                    let dot = _mm512_cvtepi32_ps(dot!(&v, 0..8, x(i), folded));
                    let dx = _mm512_set1_ps(*a.scales.get_unchecked(at(i)));
                    *acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, dx), *acc);
                }
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        let bits = _mm512_castps_si512(*acc);
        let lo = _mm256_castsi256_ps(_mm512_castsi512_si256(bits));
        let hi = _mm256_castsi256_ps(_mm512_extracti64x4_epi64::<1>(bits));
        store_group(lo, out.at(r0 + i, g * GROUP), valid[0]);
        store_group(hi, out.at(r0 + i, (g + 1) * GROUP), valid[1]);
    }
}

/// Activation rows per pass of [`pair_kernel_vnni`].
#[cfg(target_arch = "x86_64")]
const PAIR_ROWS: usize = 4;

/// Row groups `g` and `g + 1` times every activation row of a long batch (a prompt), on the
/// VNNI path. Both groups' blocks are unpacked once into the thread's buffer; each pass of
/// up to [`PAIR_ROWS`] activation rows loads an activation quad once for the two groups'
/// `vpdpbusd`s, so a pass issues 6 loads per 8 of them where a one-group pass issues 5 per 4
/// — one group's passes were bound by loads (docs/performance.md, session 16). Each row's
/// arithmetic is the one of `group_kernel_vnni`, so results are bitwise the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn pair_kernel_vnni(w: &NibbleMatrix, a: &Q8Activations, g: usize, out: &Dest) {
    let (p, valid) = GroupRef::pair(w, g);
    let run = |buffered: &mut Vec<[std::arch::x86_64::__m256i; 8]>| {
        buffered.clear();
        for b in 0..w.nb {
            buffered.push(group_block(&p[0], b));
            buffered.push(group_block(&p[1], b));
        }
        let mut r0 = 0;
        while r0 < a.m {
            let rows = (a.m - r0).min(PAIR_ROWS);
            let pass = match rows {
                1 => pair_pass_vnni::<1>,
                2 => pair_pass_vnni::<2>,
                3 => pair_pass_vnni::<3>,
                4 => pair_pass_vnni::<4>,
                _ => unreachable!(),
            };
            pass(w, &p, buffered, a, r0, valid, g, out);
            r0 += rows;
        }
    };
    BUFFERED.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buffered) => run(&mut buffered),
        Err(_) => run(&mut Vec::new()),
    })
}

/// `R` activation rows times the two buffered row groups of [`pair_kernel_vnni`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
#[allow(clippy::too_many_arguments)]
unsafe fn pair_pass_vnni<const R: usize>(
    w: &NibbleMatrix,
    p: &[GroupRef; 2],
    buffered: &[[std::arch::x86_64::__m256i; 8]],
    a: &Q8Activations,
    r0: usize,
    valid: [usize; 2],
    g: usize,
    out: &Dest,
) {
    use std::arch::x86_64::*;
    let (k, nb) = (w.n_in, w.nb);
    let zero = _mm256_setzero_si256();
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for b in 0..nb {
        let v = [&buffered[2 * b], &buffered[2 * b + 1]];
        let x = |i: usize| a.quants.as_ptr().add((r0 + i) * k + b * QK4_1) as *const i32;
        let at = |i: usize| (r0 + i) * nb + b;
        // integer dots of quads `quads` for every row and both groups, plus the rows' folded
        // offsets `folded(i)`; quad-major so each activation broadcast and each weight vector
        // is loaded once per pass (the offsets are added last: starting the chains from them
        // made the compiler spill)
        let dots = |quads: std::ops::Range<usize>, folded: &dyn Fn(usize) -> i32| {
            let mut s = [[zero; 2]; R];
            for q in quads {
                let (v0, v1) = (v[0][q], v[1][q]);
                for (i, s) in s.iter_mut().enumerate() {
                    let xq = _mm256_set1_epi32(*x(i).add(q));
                    s[0] = _mm256_dpbusd_epi32(s[0], v0, xq);
                    s[1] = _mm256_dpbusd_epi32(s[1], v1, xq);
                }
            }
            for (i, s) in s.iter_mut().enumerate() {
                let f = _mm256_set1_epi32(folded(i));
                s[0] = _mm256_add_epi32(s[0], f);
                s[1] = _mm256_add_epi32(s[1], f);
            }
            s
        };
        if p[0].halves == 2 {
            // (split types have implied offsets, folded into the integers)
            let lo = dots(0..4, &|i| *a.folded_halves.get_unchecked(2 * at(i)));
            let hi = dots(4..8, &|i| *a.folded_halves.get_unchecked(2 * at(i) + 1));
            for j in 0..2 {
                let dv = p[j].d.add(b * GROUP * 2).load8();
                let dv1 = p[j].d.add(b * GROUP * 2 + GROUP).load8();
                for (i, acc) in acc.iter_mut().enumerate() {
                    let dx = _mm256_set1_ps(*a.scales.get_unchecked(at(i)));
                    let dot_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(lo[i][j]), dv);
                    let dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[i][j]), dv1, dot_lo);
                    acc[j] = _mm256_fmadd_ps(dot, dx, acc[j]);
                }
            }
            continue;
        }
        let s = match p[0].m {
            Some(_) => dots(0..8, &|_| 0),
            None => dots(0..8, &|i| *a.folded.get_unchecked(at(i))),
        };
        for j in 0..2 {
            let dv = p[j].d.add(b * GROUP).load8();
            for (i, acc) in acc.iter_mut().enumerate() {
                let dx = _mm256_set1_ps(*a.scales.get_unchecked(at(i)));
                let dot = _mm256_cvtepi32_ps(s[i][j]);
                acc[j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, dx), acc[j]);
                if let Some(m) = p[j].m {
                    let sx = _mm256_set1_ps(*a.sums.get_unchecked(at(i)));
                    acc[j] = _mm256_fmadd_ps(m.add(b * GROUP).load8(), sx, acc[j]);
                }
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for j in 0..2 {
            store_group(acc[j], out.at(r0 + i, (g + j) * GROUP), valid[j]);
        }
    }
}

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
    fn scales_are_kept_in_f16_exactly_when_every_one_is_an_f16() {
        assert!(matches!(
            Scales::new(vec![0.5, -3.0, 65504.0, 0.0]),
            Scales::F16(_)
        ));
        // 0.1 and an f16 times a 6-bit integer (a K-quant scale) are not f16 values
        assert!(matches!(Scales::new(vec![0.5, 0.1]), Scales::F32(_)));
        let k = f16::from_f32(0.0123).to_f32() * 37.0;
        assert!(matches!(Scales::new(vec![k]), Scales::F32(_)));
        // appending keeps every value, in f32 when the precisions differ
        let mut a = Scales::new(vec![0.5, 2.0]);
        a.extend(&Scales::new(vec![k]));
        assert!(matches!(a, Scales::F32(_)));
        assert_eq!([a.get(0), a.get(1), a.get(2)], [0.5, 2.0, k]);
        let mut b = Scales::new(vec![k]);
        b.extend(&Scales::new(vec![0.25]));
        assert_eq!([b.get(0), b.get(1)], [k, 0.25]);
        // the native types' scales come from f16 fields: always stored as f16
        let mut seed = 5;
        for kind in TYPES {
            let (bytes, _) = random_blocks(kind, 16, 64, &mut seed);
            let w = NibbleMatrix::from_bytes(kind, &bytes, 16, 64).unwrap();
            assert!(matches!(w.d, Scales::F16(_)), "{kind:?}");
            assert!(matches!(w.m, Scales::F16(_)), "{kind:?}");
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
        for m in [1usize, 3, 5, 6, 8, 9, 17] {
            let x: Vec<f32> = (0..m * k).map(|_| lcg(seed)).collect();
            let a = Q8Activations::quantize(&x, m, k, w12.kind.folded_offset());
            let mut scalar = vec![0f32; m * n_out];
            let s = Dest::one(&mut scalar, n_out);
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
                let p = Dest::one(&mut simd, n_out);
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
            // prompts' pairs of row groups (any batch size computes the same per row)
            #[cfg(target_arch = "x86_64")]
            if crate::kernels::has_vnni() {
                let mut pairs = vec![0f32; m * n_out];
                let p = Dest::one(&mut pairs, n_out);
                for g in (0..groups).step_by(2) {
                    // SAFETY: VNNI was detected above; group g + 1 exists when called.
                    unsafe {
                        if g + 1 < groups {
                            pair_kernel_vnni(w12, &a, g, &p)
                        } else {
                            group_kernel_vnni(w12, &a, g, &p)
                        }
                    }
                }
                assert_eq!(pairs, scalar, "{kind:?} vnni pairs m={m}");
                // decode batches' 512-bit pairs of row groups
                let mut wide = vec![0f32; m * n_out];
                let p = Dest::one(&mut wide, n_out);
                for g in (0..groups).step_by(2) {
                    // SAFETY: VNNI was detected above; group g + 1 exists when called.
                    unsafe {
                        if g + 1 < groups {
                            wide_kernel_vnni(w12, &a, g, &p)
                        } else {
                            group_kernel_vnni(w12, &a, g, &p)
                        }
                    }
                }
                assert_eq!(wide, scalar, "{kind:?} vnni wide m={m}");
            }
        }
    }

    #[test]
    fn stacked_parts_are_written_in_place() {
        let mut seed = 12;
        for kind in TYPES {
            let widths = [16usize, 8, 13];
            let parts: Vec<NibbleMatrix> = widths
                .iter()
                .map(|&n| {
                    let (bytes, _) = random_blocks(kind, n, 96, &mut seed);
                    NibbleMatrix::from_bytes(kind, &bytes, n, 96).unwrap()
                })
                .collect();
            let stacked = NibbleMatrix::concat(&parts.iter().collect::<Vec<_>>()).unwrap();
            for m in [1usize, 5, 40] {
                let x: Vec<f32> = (0..m * 96).map(|_| lcg(&mut seed)).collect();
                // stale contents of the wrong length are replaced
                let (mut a, mut b, mut c) = (vec![9.0; 3], Vec::new(), vec![1.0; 999]);
                stacked
                    .matmul_parts(&x, m, &widths, &mut [&mut a, &mut b, &mut c])
                    .unwrap();
                for (part, got) in parts.iter().zip([&a, &b, &c]) {
                    let mut want = vec![0f32; m * part.n_out];
                    part.matmul(&x, m, &mut want);
                    assert_eq!(got, &want, "{kind:?} m={m}");
                }
            }
            let x = vec![0.5f32; 96];
            let (mut a, mut b) = (Vec::new(), Vec::new());
            let odd = NibbleMatrix::concat(&[&parts[2], &parts[0]]).unwrap();
            assert!(odd
                .matmul_parts(&x, 1, &[13, 16], &mut [&mut a, &mut b])
                .is_none());
        }
    }

    #[test]
    fn four_bit_extremes_sum_a_whole_block_in_sixteen_bits() {
        // every value 15 against activations at ±127: each `maddubs` pair is ±2·15·127 and a
        // block's eight quads ±30480, the most a 16-bit sum of the AVX2 path holds
        let (n_out, k) = (16, 256);
        for kind in [NibbleType::Q4_0, NibbleType::Q4_1] {
            let mut bytes = Vec::new();
            for _ in 0..n_out * k / QK4_1 {
                bytes.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
                if kind.has_min() {
                    bytes.extend_from_slice(&f16::from_f32(-1.0).to_le_bytes());
                }
                bytes.extend_from_slice(&[0xFF; PACKED]);
            }
            let w = NibbleMatrix::from_bytes(kind, &bytes, n_out, k).unwrap();
            for m in [3usize, 40] {
                for sign in [1.0f32, -1.0] {
                    let x = vec![sign; m * k];
                    let a = Q8Activations::quantize(&x, m, k, kind.folded_offset());
                    let mut scalar = vec![0f32; m * n_out];
                    let s = Dest::one(&mut scalar, n_out);
                    for g in 0..n_out / GROUP {
                        w.group_scalar(&a, g, &s);
                    }
                    // d·(15 - 8)·Σx (Q4_0) or (d·15 - 1)·Σx (Q4_1), up to the activations'
                    // f16 scale
                    let want = sign * k as f32 * if kind.has_min() { 6.5 } else { 3.5 };
                    assert!((scalar[0] - want).abs() < 1e-2 * want.abs(), "{kind:?}");
                    #[cfg(target_arch = "x86_64")]
                    if crate::kernels::has_avx2() {
                        let mut simd = vec![0f32; m * n_out];
                        let p = Dest::one(&mut simd, n_out);
                        for g in 0..n_out / GROUP {
                            // SAFETY: AVX2 was detected above.
                            unsafe { group_kernel_avx2(&w, &a, g, &p) };
                        }
                        assert_eq!(simd, scalar, "{kind:?} m={m} sign={sign}");
                    }
                }
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
