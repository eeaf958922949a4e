//! Quantized weights kept packed, times f32 activations: 4- and 5-bit blocks with a per-block
//! scale and offset (`w = d·q + m`: Q4_0 with `m = -8d`, Q4_1, Q5_0 with `m = -16d`, Q5_1),
//! Q8_0, and K-quants re-expressed as such blocks (`kquant`). Blocks hold 32 values; value i
//! sits in the low nibble of byte i, value i+16 in the high nibble, and 5-bit types add bit i
//! of a 32-bit word as the value's fifth bit.
//!
//! `pack.rs` lays a matrix out in interleaved row groups; the products run on one of three
//! paths chosen at run time: `scalar.rs` (portable), `avx2.rs` (AVX2 + FMA) and `vnni.rs`
//! (AVX-512 VNNI), the x86 ones on what `x86.rs` shares. Every path computes bitwise the same
//! results.
//!
//! With activations quantized to Q8_0 (`x ≈ d_x·a`), one block contributes
//! `d·d_x·Σ q·a + m·(d_x·Σ a)` for types that store `m`, using the activation block sums
//! computed once per matmul. Types whose offset is implied (`w = d·(q - c)`) fold it into the
//! integer instead: `d·d_x·(Σ q·a - c·Σ a)`, as ggml's own dot products do, which spares a
//! multiply-add per row and block on the vector pipes the integer products also need (they
//! bound prompts on Zen 4). The values are unsigned, so
//! `maddubs(q, a)` needs no sign trick.
//!
//! K-quants' activations carry one scale per 256-value super-block ([`ActFormat`], ggml's
//! Q8_K): a row sums its super-block's `d·Σ q·a` and `m·Σ a` in two chains without `d_x`
//! and scales their sum by `d_x` once after the super-block's last block, which spares a
//! multiply per block and row (K-quant prompt products 7–9% faster on Zen 4 at VNNI).

#[cfg(target_arch = "x86_64")]
mod avx2;
mod pack;
pub use pack::Release;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod vnni;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(target_arch = "x86_64")]
use avx2::{group_kernel_avx2, group_kernel_avx2_q8};
#[cfg(target_arch = "x86_64")]
use vnni::{group_kernel_vnni, pair_kernel_vnni, wide_kernel_vnni};

use super::q8::{ActFormat, Q8Activations, QK8_0};
use super::weights::{PinStore, Pinnable, Store};
use half::f16;
use std::ops::Range;

/// Elements per block (same as Q8_0, so activation blocks line up).
pub const QK4_1: usize = QK8_0;
const PACKED: usize = QK4_1 / 2;

/// The ggml block layouts this kernel reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackedType {
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

impl PackedType {
    const fn has_min(self) -> bool {
        matches!(self, PackedType::Q4_1 | PackedType::Q5_1)
    }

    const fn has_high_bits(self) -> bool {
        matches!(self, PackedType::Q5_0 | PackedType::Q5_1)
    }

    /// Values stored one per byte rather than packed in nibbles.
    const fn byte_values(self) -> bool {
        matches!(self, PackedType::Q8_0)
    }

    /// 6-bit values: nibbles as the 4-bit types', then their high bit pairs (Q6_K).
    const fn six_bits(self) -> bool {
        matches!(self, PackedType::Q6K)
    }

    /// Scales (and offsets) per block: 2 when each half of 16 values has its own.
    pub(crate) const fn halves(self) -> usize {
        if matches!(self, PackedType::Q6K) {
            2
        } else {
            1
        }
    }

    /// Bytes of a block in ggml's layout (of the types [`PackedMatrix::from_bytes`] reads).
    fn block_bytes(self) -> usize {
        if self.byte_values() || self.six_bits() {
            return 2 + QK8_0;
        }
        2 + if self.has_min() { 2 } else { 0 } + if self.has_high_bits() { 4 } else { 0 } + PACKED
    }

    /// Bytes of one block of a row group in the interleaved layout.
    const fn group_block_bytes(self) -> usize {
        if self.byte_values() {
            GROUP * QK8_0
        } else if self.six_bits() {
            GROUP * PACKED + 2 * SIX_BIT_PLANE
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
            PackedType::Q4_0 => -8.0,
            PackedType::Q5_0 => -16.0,
            PackedType::Q8_0 => -128.0,
            PackedType::Q6K => -32.0,
            _ => 0.0,
        }
    }
}
/// Output rows interleaved together: one 256-bit lane per row, so a block's products for all
/// of them come out of one vector and need no horizontal sums.
pub const GROUP: usize = 8;

/// Bytes of one of a 6-bit block's two planes of high bit pairs (see [`PackedMatrix`]).
const SIX_BIT_PLANE: usize = 32;

/// Most parts [`PackedMatrix::matmul_parts`] writes (Q/K/V).
pub const MAX_PARTS: usize = 4;

/// Most activation rows [`PackedMatrix::matmul_gated`] takes: beyond, a batch's gating runs
/// on the pool by itself and a tile's halves would no longer fit in L1.
pub const GATED_MAX_ROWS: usize = 32;
/// Most row groups a tile of a short batch's product runs through one call of the
/// one-group kernel ([`PackedMatrix::tile_rows`]).
const RUN_GROUPS: usize = 4;
/// Batches of at most this many rows (decode) take tiles of several row groups on the
/// one-group kernels.
const RUN_MAX_ROWS: usize = 16;

/// Row groups [`PackedMatrix::prefetch_tile`] asks for at a tile's start: a pair, the
/// two-group kernels' first step.
#[cfg(target_arch = "x86_64")]
const COLD_GROUPS: usize = 2;

thread_local! {
    /// The matrix and first output row of the tile this thread would run next if it went on
    /// from its last one (see [`PackedMatrix::prefetch_tile`]).
    static NEXT_TILE: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((0, 0)) };
    /// One tile's gate and up outputs in [`PackedMatrix::matmul_gated`], per thread.
    static GATED_TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Where the kernels find a matrix's arrays, looked up once per product rather than per tile
/// (on x86, row group 0's [`x86::GroupRef`], from which each group's is a few additions; a
/// small model's decode products are tiles of well under a microsecond, and the lookup per
/// tile was 3% of a SmolLM2 step).
#[cfg(target_arch = "x86_64")]
type Base = x86::GroupRef;
#[cfg(not(target_arch = "x86_64"))]
type Base = NoBase;

/// Elsewhere the portable kernels index the matrix themselves: nothing to carry.
#[cfg(not(target_arch = "x86_64"))]
#[derive(Clone, Copy)]
struct NoBase;

#[cfg(not(target_arch = "x86_64"))]
impl NoBase {
    fn base(_: &PackedMatrix) -> Self {
        NoBase
    }
}

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
    /// Columns `col0..col0 + width` of every output row into `buf`, row-major
    /// `[m, width]` (one tile's outputs, kept apart from the rest of the product).
    fn window(buf: &mut [f32], col0: usize, width: usize) -> Self {
        let mut start = [col0 + width; MAX_PARTS + 1];
        start[0] = 0;
        start[1] = col0;
        let mut base = [std::ptr::null_mut(); MAX_PARTS];
        base[1] = buf.as_mut_ptr();
        Dest {
            base,
            start,
            parts: 2,
        }
    }

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
/// `0x10101010` put quad `q`'s fifth bits where they belong. 6-bit values (Q6_K) follow their
/// 4 chunks of nibbles with two planes of 32 bytes, quads 0..4 and 4..8: byte `4j + t` of
/// plane `p` holds bits 4 and 5 of value `4(4p + k) + t` of row `j` at bits `2k` and
/// `2k + 1`, so that one shift (left by `4 - 2k`, or right by 2 for `k = 3`) and a mask with
/// `0x30` put quad `4p + k`'s high bits where they belong — the file's 6.6 bits a weight
/// rather than 8.6 as bytes. Rows past `n_out` are zero.
pub struct PackedMatrix {
    pub n_out: usize,
    pub n_in: usize,
    pub kind: PackedType,
    nb: usize,
    d: Scales,
    m: Scales,
    qs: Store<u8>,
    qh: Store<u32>,
}

impl Pinnable for PackedMatrix {
    fn stores(&mut self, f: &mut dyn FnMut(&mut dyn PinStore)) {
        for s in [&mut self.d, &mut self.m] {
            match s {
                Scales::F16(v) => f(v),
                Scales::F32(v) => f(v),
                Scales::Factored(s) => {
                    f(&mut s.base);
                    f(&mut s.mult);
                }
            }
        }
        f(&mut self.qs);
        f(&mut self.qh);
    }
}

/// Blocks per ggml K-quant super-block: the run of blocks whose scales share one factor in
/// [`Scales::Factored`].
pub(crate) const SUPER_BLOCKS: usize = 8;

/// A matrix's block scales (or minimums): f16 when every one of them is an f16 value, which
/// the native types' always are (they come from the file's f16 fields); K-quants' sub-block
/// scales `d·sc_j` as their two factors; else f32. Decode reads every weight byte once per
/// token, and f32 copies of f16 scales made it read 15.6% (SmolLM2 Q4_1) and 9.8% (Gemma 3
/// Q4_K_M) more than the file holds.
#[derive(Debug, Clone)]
enum Scales {
    F16(Store<f16>),
    F32(Store<f32>),
    /// K-quants' scales as their factors (see [`Factored`]).
    Factored(Box<Factored>),
}

/// Scales whose value `i` is `base[(i / GROUP >> shift) · GROUP + i % GROUP] · mult[i]`: per
/// row, a super-block's f16 factor (`d`, or `-dmin` for minimums) times each of its
/// `1 << shift` blocks' (or halves') 8-bit integer, a product exact in f32. As f32 values a
/// Q4_K matrix was 6 bits a weight in memory, a third more than its file's 4.5, and a 1B
/// Q4_K_M decode read 927 MB a token for the file's 667; factored it is 4.6 bits.
#[derive(Debug, Clone)]
struct Factored {
    base: Store<f16>,
    mult: Store<i8>,
    shift: u32,
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

    /// Factored scales from their factors and integers (see [`Factored`]).
    fn factored(base: Vec<f16>, mult: Vec<i8>, shift: u32) -> Self {
        Scales::Factored(Box::new(Factored {
            base: base.into(),
            mult: mult.into(),
            shift,
        }))
    }

    /// No values, in the same form.
    fn empty_like(&self) -> Self {
        match self {
            Scales::F16(_) => Scales::F16(Vec::new().into()),
            Scales::F32(_) => Scales::F32(Vec::new().into()),
            Scales::Factored(f) => Scales::factored(Vec::new(), Vec::new(), f.shift),
        }
    }

    fn len(&self) -> usize {
        match self {
            Scales::F16(v) => v.len(),
            Scales::F32(v) => v.len(),
            Scales::Factored(f) => f.mult.len(),
        }
    }

    /// Where value `i`'s factor sits in `base` (factored scales).
    fn base_index(i: usize, shift: u32) -> usize {
        ((i / GROUP) >> shift) * GROUP + i % GROUP
    }

    fn get(&self, i: usize) -> f32 {
        match self {
            Scales::F16(v) => v[i].to_f32(),
            Scales::F32(v) => v[i],
            Scales::Factored(f) => f.base[Self::base_index(i, f.shift)].to_f32() * f.mult[i] as f32,
        }
    }

    /// Value `i`'s two factors, when the scales are kept factored.
    fn factors(&self, i: usize) -> Option<(f16, i8)> {
        match self {
            Scales::Factored(f) => Some((f.base[Self::base_index(i, f.shift)], f.mult[i])),
            _ => None,
        }
    }

    fn reserve_exact(&mut self, n: usize) {
        match self {
            Scales::F16(v) => v.vec_mut().reserve_exact(n),
            Scales::F32(v) => v.vec_mut().reserve_exact(n),
            Scales::Factored(f) => {
                f.mult.vec_mut().reserve_exact(n);
                f.base.vec_mut().reserve_exact(n >> f.shift);
            }
        }
    }

    /// Appends `other`'s values (in f32 unless both are f16, or both factored alike).
    fn extend(&mut self, other: &Scales) {
        match (&mut *self, other) {
            (Scales::F16(a), Scales::F16(b)) => a.vec_mut().extend_from_slice(b),
            (Scales::F32(a), Scales::F32(b)) => a.vec_mut().extend_from_slice(b),
            (Scales::Factored(a), Scales::Factored(b)) if a.shift == b.shift => {
                a.base.vec_mut().extend_from_slice(&b.base);
                a.mult.vec_mut().extend_from_slice(&b.mult);
            }
            (Scales::F32(a), b) => a.vec_mut().extend((0..b.len()).map(|i| b.get(i))),
            (a, b) => {
                let mut all: Vec<f32> = (0..a.len()).map(|i| a.get(i)).collect();
                all.extend((0..b.len()).map(|i| b.get(i)));
                *self = Scales::F32(all.into());
            }
        }
    }

    /// Where value `i` lies, for the kernels (`None` for factored scales: see
    /// [`Self::factors_at`]).
    #[cfg(target_arch = "x86_64")]
    fn at(&self, i: usize) -> Option<ScalePtr> {
        match self {
            Scales::F16(v) => Some(ScalePtr {
                at: v.as_ptr().wrapping_add(i) as *const u8,
                half: true,
            }),
            Scales::F32(v) => Some(ScalePtr::f32(v.as_ptr().wrapping_add(i))),
            Scales::Factored(_) => None,
        }
    }

    /// Where factored value `i` and its factor lie, for the kernels (`i` a multiple of
    /// [`GROUP`]).
    #[cfg(target_arch = "x86_64")]
    fn factors_at(&self, i: usize) -> Option<FactorPtr> {
        match self {
            Scales::Factored(f) => Some(FactorPtr {
                mult: f.mult.as_ptr().wrapping_add(i),
                base: f.base.as_ptr().wrapping_add(Self::base_index(i, f.shift)),
            }),
            _ => None,
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
    fn f32(at: *const f32) -> Self {
        ScalePtr {
            at: at as *const u8,
            half: false,
        }
    }

    /// `n` values further on (may point past the end: only ever prefetched there).
    #[inline(always)]
    fn add(self, n: usize) -> Self {
        self.add_as(n, self.half)
    }

    /// [`Self::add`] for a caller that knows the storage when compiled (`half`, as
    /// `self.half` says): a constant stride instead of a shift by a count read per block.
    #[inline(always)]
    fn add_as(self, n: usize, half: bool) -> Self {
        debug_assert_eq!(half, self.half);
        ScalePtr {
            at: self.at.wrapping_add(n * Self::bytes_per_as(half)),
            half,
        }
    }

    #[inline(always)]
    const fn bytes_per_as(half: bool) -> usize {
        if half {
            2
        } else {
            4
        }
    }

    #[inline(always)]
    fn bytes_per(self) -> usize {
        Self::bytes_per_as(self.half)
    }

    /// The 8 values from here, as f32, stored as f16 when `half` (which the caller knows
    /// when compiled, or reads from `self.half`).
    ///
    /// # Safety
    /// 8 values from here lie inside their buffer, stored as `half` says; F16C is available.
    #[target_feature(enable = "avx,f16c")]
    #[inline]
    unsafe fn load8_as(self, half: bool) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        if half {
            _mm256_cvtph_ps(_mm_loadu_si128(self.at as *const __m128i))
        } else {
            _mm256_loadu_ps(self.at as *const f32)
        }
    }
}

/// A row group's first factored scales ([`Scales::Factored`]) for the kernels: its 8-bit
/// integers, and the factor of its first super-block (the next ones follow, [`GROUP`] a
/// super-block).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct FactorPtr {
    mult: *const i8,
    base: *const f16,
}

#[cfg(target_arch = "x86_64")]
impl FactorPtr {
    /// `units` runs of GROUP integers and `supers` super-blocks' factors further on.
    #[inline(always)]
    fn offset(self, units: usize, supers: usize) -> Self {
        FactorPtr {
            mult: self.mult.wrapping_add(units * GROUP),
            base: self.base.wrapping_add(supers * GROUP),
        }
    }

    /// Super-block `sb`'s 8 factors as f32.
    ///
    /// # Safety
    /// The super-block lies inside the matrix; AVX2 and F16C are available.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn base8(self, sb: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(self.base.add(sb * GROUP) as *const __m128i))
    }

    /// Asks for the lines of run `unit` of super-block `sb` to be loaded into the caches
    /// `HINT` names.
    #[inline(always)]
    fn prefetch<const HINT: i32>(self, unit: usize, sb: usize) {
        // SAFETY: a prefetch is a hint that never faults, whatever the address.
        unsafe {
            use std::arch::x86_64::_mm_prefetch;
            _mm_prefetch::<HINT>(self.mult.wrapping_add(unit * GROUP));
            _mm_prefetch::<HINT>(self.base.wrapping_add(sb * GROUP) as *const i8);
        }
    }
}

/// A K-quant block's scale and offset as their super-block's f16 factors times the block's
/// 8-bit integers (`d = d_base · d_mul[h]`, `m = m_base · m_mul`), which
/// [`PackedMatrix::build`] keeps factored ([`Scales::Factored`]).
#[derive(Clone, Copy)]
pub(crate) struct Factors {
    pub d_base: f16,
    pub d_mul: [i8; 2],
    pub m_base: f16,
    pub m_mul: i8,
}

impl Factors {
    /// A zero scale and offset (the padding rows of a matrix's last row group).
    pub(crate) const ZERO: Factors = Factors {
        d_base: f16::ZERO,
        d_mul: [0; 2],
        m_base: f16::ZERO,
        m_mul: 0,
    };
}

/// One block of one row: scale and offset (per half of 16 values for split types; both
/// entries equal otherwise) and the 32 unsigned values.
#[derive(Clone, Copy)]
pub(crate) struct RowBlock {
    pub d: [f32; 2],
    pub m: [f32; 2],
    pub vals: [u8; QK4_1],
    /// `d` and `m` as factors (K-quants), when the matrix keeps them so.
    pub factors: Option<Factors>,
}

impl RowBlock {
    pub(crate) fn new(d: f32, m: f32, vals: [u8; QK4_1]) -> Self {
        RowBlock {
            d: [d; 2],
            m: [m; 2],
            vals,
            factors: None,
        }
    }

    /// The weight value `i` stands for.
    #[cfg(test)]
    pub(crate) fn value(&self, i: usize) -> f32 {
        let h = i / (QK4_1 / 2);
        self.vals[i] as f32 * self.d[h] + self.m[h]
    }
}

impl PackedMatrix {
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
            if self.kind.six_bits() {
                let plane = chunk[GROUP * PACKED + (q / 4) * SIX_BIT_PLANE + j * 4 + t];
                *v |= ((plane >> (2 * (q % 4))) & 3) << 4;
            }
            if let Some(w) = high {
                let pos = if q < 4 { 8 * t + 4 + q } else { 8 * t + q - 4 };
                *v |= (((w >> pos) & 1) << 4) as u8;
            }
        }
        let halves = self.kind.halves();
        let at = |h: usize| (gb * halves + h) * GROUP + j;
        let last = halves - 1;
        let factors = self.d.factors(at(0)).map(|(d_base, d0)| {
            let (m_base, m_mul) = match self.kind.has_min() {
                true => self.m.factors(at(0)).unwrap_or((f16::ZERO, 0)),
                false => (f16::ZERO, 0),
            };
            let d1 = self.d.factors(at(last)).map_or(d0, |(_, d1)| d1);
            Factors {
                d_base,
                d_mul: [d0, d1],
                m_base,
                m_mul,
            }
        });
        RowBlock {
            d: [self.d.get(at(0)), self.d.get(at(last))],
            m: [self.offset(at(0)), self.offset(at(last))],
            vals,
            factors,
        }
    }

    /// Bytes the matrix's arrays hold (what a decode step reads of it).
    pub fn resident_bytes(&self) -> usize {
        let scales = |s: &Scales| match s {
            Scales::F16(v) => 2 * v.len(),
            Scales::F32(v) => 4 * v.len(),
            Scales::Factored(f) => 2 * f.base.len() + f.mult.len(),
        };
        scales(&self.d) + scales(&self.m) + self.qs.len() + 4 * self.qh.len()
    }

    /// Whether the scales are kept factored ([`Scales::Factored`]).
    pub(crate) fn factored(&self) -> bool {
        matches!(self.d, Scales::Factored(_))
    }

    /// How this matrix's activations are quantized: with its implied offset folded in, and
    /// with one scale per super-block for K-quants (whose scales are factored), as ggml does.
    pub(crate) fn act_format(&self) -> ActFormat {
        ActFormat {
            offset: self.kind.folded_offset(),
            super_scales: self.factored(),
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
    pub fn append(&mut self, other: &PackedMatrix) -> Option<()> {
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
    pub fn concat(parts: &[&PackedMatrix]) -> Option<PackedMatrix> {
        let first = parts.first()?;
        let (n_in, kind) = (first.n_in, first.kind);
        if parts.iter().any(|p| p.n_in != n_in || p.kind != kind) {
            return None;
        }
        let n_out = parts.iter().map(|p| p.n_out).sum();
        if parts[..parts.len() - 1]
            .iter()
            .all(|p| p.n_out.is_multiple_of(GROUP))
        {
            // row groups are laid out one after another, so whole ones are copied as they
            // are (repacking every row again was a quarter of a 1B model's load)
            let mut out = PackedMatrix {
                n_out: 0,
                n_in,
                kind,
                nb: first.nb,
                d: first.d.empty_like(),
                m: first.m.empty_like(),
                qs: Vec::new().into(),
                qh: Vec::new().into(),
            };
            out.reserve_rows(n_out);
            for p in parts {
                out.append(p)?;
            }
            return Some(out);
        }
        let mut owner = Vec::new();
        for (pi, p) in parts.iter().enumerate() {
            owner.extend((0..p.n_out).map(|o| (pi, o)));
        }
        Some(Self::build(
            kind,
            n_out,
            n_in,
            parts.iter().all(|p| p.factored()),
            |o, blocks| {
                let (pi, row) = owner[o];
                for (b, blk) in blocks.iter_mut().enumerate() {
                    *blk = parts[pi].row_block(row, b);
                }
            },
            (&[], &|_| {}),
        ))
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

    /// The products of matrices with one input width but of types that cannot be stacked
    /// (a layer's Q and K in one type and V in another), `[m, n_out]` each into `outs`, as
    /// one product: the activations are quantized once per type's offset and every
    /// matrix's tiles are handed out in one call of the worker pool. As three products, a
    /// Gemma 3 layer's Q, K and V (two of them a few microseconds each) took ~44 µs of a
    /// decode step where their tiles alone take ~30. Results are bitwise those of each
    /// matrix's own product. `None`, with nothing written, for more than [`MAX_PARTS`]
    /// matrices, input widths that differ, or matrices needing more than two activation
    /// formats ([`ActFormat`]).
    pub fn matmul_each(
        mats: &[&PackedMatrix],
        x: &[f32],
        m: usize,
        outs: &mut [&mut Vec<f32>],
    ) -> Option<()> {
        let n = mats.len();
        let first = mats.first()?;
        // the activation formats the matrices need: types with a stored minimum fold no
        // offset, so any format with their kind of scales serves them
        let serves = |f: &ActFormat, w: &PackedMatrix| {
            let want = w.act_format();
            f.super_scales == want.super_scales && (w.kind.has_min() || f.offset == want.offset)
        };
        let mut formats: [Option<ActFormat>; 2] = [None; 2];
        // (those without a minimum first; no allocation: a decode step calls this per layer)
        let without_min = mats.iter().filter(|w| !w.kind.has_min());
        for w in without_min.chain(mats.iter().filter(|w| w.kind.has_min())) {
            if formats.iter().flatten().any(|f| serves(f, w)) {
                continue;
            }
            match formats.iter_mut().find(|f| f.is_none()) {
                Some(slot) => *slot = Some(w.act_format()),
                None => return None,
            }
        }
        let formats = [
            formats[0].unwrap_or(ActFormat::PLAIN),
            formats[1].or(formats[0]).unwrap_or(ActFormat::PLAIN),
        ];
        let fits = n <= MAX_PARTS && outs.len() == n && mats.iter().all(|w| w.n_in == first.n_in);
        if !fits {
            return None;
        }
        assert_eq!(x.len(), m * first.n_in);
        let mut dests = [Dest::one(&mut [], 0); MAX_PARTS];
        for (i, (w, out)) in mats.iter().zip(outs.iter_mut()).enumerate() {
            out.resize(m * w.n_out, 0.0);
            dests[i] = Dest::one(out, w.n_out);
        }
        let bases: [Option<Base>; MAX_PARTS] =
            std::array::from_fn(|i| mats.get(i).map(|w| Base::base(w)));
        // each matrix's tile height and its first tile in the call's numbering
        let tile_rows: [usize; MAX_PARTS] =
            std::array::from_fn(|i| mats.get(i).map_or(GROUP, |w| w.tile_rows(w.n_out, m)));
        let mut firsts = [0; MAX_PARTS + 1];
        for i in 0..n {
            firsts[i + 1] = firsts[i] + mats[i].n_out.div_ceil(tile_rows[i]);
        }
        let macs = mats.iter().map(|w| m * w.n_out * w.n_in).sum();
        Q8Activations::with_quantized_in(x, m, first.n_in, formats, |quantize, acts| {
            super::for_each_task(firsts[n], m, macs, quantize, |t, act| {
                let i = (0..n).rfind(|&i| firsts[i] <= t).unwrap_or(0);
                let (w, rows) = (mats[i], tile_rows[i]);
                let o0 = (t - firsts[i]) * rows;
                let a = acts[!serves(&formats[0], w) as usize];
                let base = bases[i].as_ref().expect("a base per matrix");
                let rows = rows.min(w.n_out - o0);
                w.prefetch_tile(base, m, o0, rows);
                w.tile(base, a, act, o0, rows, &dests[i])
            })
        });
        Some(())
    }

    /// For a matrix stacked from a gate and an up half of equal height (`ffn_gate` over
    /// `ffn_up`): `out[r, o] = gate[r, o] · up[r, o]` after `act(gate_row, up_row)`, which
    /// overwrites the gate values of a run of one row's columns with the gated result. Each
    /// tile computes the same columns of both halves and gates them while they are in this
    /// core's cache, so no serial step between this product and the next reads both halves
    /// back (on a decode step the gated activation was a tenth of the calling thread's time,
    /// mostly waiting for the lines other cores wrote). The same kernels as [`Self::matmul`]:
    /// results are bitwise those of the product followed by `act`. `None`, with nothing
    /// written, for more than [`GATED_MAX_ROWS`] rows (a prompt: its gating runs on the pool
    /// anyway) or halves that are not whole row groups.
    pub fn matmul_gated(
        &self,
        x: &[f32],
        m: usize,
        out: &mut Vec<f32>,
        act: impl Fn(&mut [f32], &[f32]) + Sync,
    ) -> Option<()> {
        let half = self.n_out / 2;
        if m > GATED_MAX_ROWS || !self.n_out.is_multiple_of(2) || !half.is_multiple_of(GROUP) {
            return None;
        }
        assert_eq!(x.len(), m * self.n_in);
        out.resize(m * half, 0.0);
        let shared = super::SharedMut(out.as_mut_ptr());
        let shared = &shared;
        let macs = m * self.n_out * self.n_in;
        let base = &Base::base(self);
        self.with_quantized(x, m, |quantize, a| {
            let tile_rows = self.tile_rows(half, m);
            super::for_each_tile(half, tile_rows, m, macs, quantize, |o0, rows, run| {
                GATED_TILE.with_borrow_mut(|buf| {
                    // sized once per thread: zeroing it per tile cost more than the fusion saved
                    if buf.len() < 2 * m * rows {
                        buf.resize(2 * m * rows, 0.0);
                    }
                    let (gate, up) = buf[..2 * m * rows].split_at_mut(m * rows);
                    self.prefetch_tile(base, m, o0, rows);
                    // the up half's first groups, read once the gate half's are done: the
                    // kernels' prefetches of each next group run on within the gate half
                    self.prefetch_groups(base, m, (half + o0) / GROUP);
                    // (a decode batch: one run of every row, see `for_each_tile`)
                    self.tile(
                        base,
                        a,
                        run.clone(),
                        o0,
                        rows,
                        &Dest::window(gate, o0, rows),
                    );
                    self.tile(
                        base,
                        a,
                        run.clone(),
                        half + o0,
                        rows,
                        &Dest::window(up, half + o0, rows),
                    );
                    for r in run {
                        let (g, u) = (&mut gate[r * rows..][..rows], &up[r * rows..][..rows]);
                        act(g, u);
                        // SAFETY: tiles write disjoint columns `o0..o0 + rows` of each row
                        // of `out`, which holds `m * half` values and outlives the call.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                g.as_ptr(),
                                shared.0.add(r * half + o0),
                                rows,
                            )
                        };
                    }
                })
            });
        });
        Some(())
    }

    fn matmul_into(&self, x: &[f32], m: usize, shared: &Dest) {
        assert_eq!(x.len(), m * self.n_in);
        let macs = m * self.n_out * self.n_in;
        let base = &Base::base(self);
        self.with_quantized(x, m, |quantize, a| {
            let tile_rows = self.tile_rows(self.n_out, m);
            super::for_each_tile(self.n_out, tile_rows, m, macs, quantize, |o0, rows, act| {
                self.prefetch_tile(base, m, o0, rows);
                self.tile(base, a, act, o0, rows, shared)
            })
        });
    }

    /// `x`'s `m` rows quantized for this matrix inside the product's pool call
    /// ([`Q8Activations::with_quantized_in`]): `f` gets the quantization and the activations.
    fn with_quantized<R>(
        &self,
        x: &[f32],
        m: usize,
        f: impl FnOnce(&crate::pool::Prologue<'_>, &Q8Activations) -> R,
    ) -> R {
        let format = self.act_format();
        Q8Activations::with_quantized_in(x, m, self.n_in, [format; 2], |quantize, [a, _]| {
            f(quantize, a)
        })
    }

    /// Before a short batch's tile `o0..o0 + rows`: asks for its first [`COLD_GROUPS`] row
    /// groups at once unless the tile this thread ran last was the one before it in this
    /// matrix, whose kernels' prefetches of each next group already reached them. A
    /// thread's first tile of a product (or of a range it took) otherwise starts on memory
    /// with one block's lines in flight at a time. With the up half's groups in
    /// [`Self::matmul_gated`], alternate decode steps in one process: a SmolLM2 step's
    /// products 3.4-4.7% faster on AVX2, 6.1-7.7% on VNNI (5.8% at 8 streams), Gemma 3's
    /// 0.2-2% (its head, two thirds of the step, is thousands of tiles in a row). On many
    /// threads each thread's ranges are a few tiles, so more of them start cold.
    fn prefetch_tile(&self, base: &Base, m: usize, o0: usize, rows: usize) {
        let me = self as *const Self as usize;
        if NEXT_TILE.with(|next| next.replace((me, o0 + rows))) != (me, o0) {
            self.prefetch_groups(base, m, o0 / GROUP);
        }
    }

    /// Starts loading [`COLD_GROUPS`] row groups from `g` (those that exist) into L2, for a
    /// short batch of `m` rows (a prompt's tiles compute long enough for the hardware
    /// prefetchers).
    fn prefetch_groups(&self, base: &Base, m: usize, g: usize) {
        if m > RUN_MAX_ROWS {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        for g in g..(g + COLD_GROUPS).min(self.n_out.div_ceil(GROUP)) {
            base.at(self, g, false).prefetch_group(self.nb);
        }
        let _ = (base, g);
    }

    /// Output rows per tile of `n` output rows times `m` activation rows: one row group, or
    /// two on the VNNI path, and up to [`RUN_GROUPS`] for a short batch (a run of pairs on
    /// the VNNI path, of one-group kernels on the others) — unless fewer a tile finish the
    /// product sooner on the pool's threads (a 576-row product: 36 tiles of two groups take
    /// 3 rounds on 16 threads, 72 of one group 5 rounds of half the work). A prompt's tiles
    /// stay two groups wide (VNNI) or one, its activation rows split instead
    /// ([`super::for_each_tile`]).
    fn tile_rows(&self, n: usize, m: usize) -> usize {
        if self.pairs_groups(m) {
            return 2 * GROUP;
        }
        let threads = crate::pool::threads();
        let time = |rows: usize| n.div_ceil(rows).div_ceil(threads) * rows;
        let widest = |rows: &[usize]| {
            rows.iter()
                .copied()
                .filter(|&r| time(r) <= time(GROUP))
                .max()
                .unwrap_or(GROUP)
        };
        if m <= RUN_MAX_ROWS {
            widest(&[GROUP, 2 * GROUP, RUN_GROUPS * GROUP])
        } else if self.wide_groups() {
            widest(&[GROUP, 2 * GROUP])
        } else {
            GROUP
        }
    }

    /// The tile of output rows `o0..o0 + rows` (`rows` ≤ [`Self::tile_rows`], `o0` a whole
    /// row group) times activation rows `act`, on the kernel the batch size and the CPU
    /// select (`base`: [`Base::base`] of this matrix).
    fn tile(
        &self,
        base: &Base,
        a: &Q8Activations,
        act: Range<usize>,
        o0: usize,
        rows: usize,
        out: &Dest,
    ) {
        // (the kernels' offsets stay inside the activations for runs within the batch)
        assert!(act.end <= a.m);
        let g = o0 / GROUP;
        let groups = g..g + rows.div_ceil(GROUP);
        if self.pairs_groups(a.m) {
            self.two_groups(TwoGroups::Buffered, base, a, act, groups, out)
        } else if self.wide_groups() && !Self::single_row_on_avx2(a.m) {
            self.two_groups(TwoGroups::Wide, base, a, act, groups, out)
        } else {
            self.group(base, a, act, groups, out)
        }
    }

    /// Row groups `groups` (one after the other) on the one-group kernel of the CPU (the
    /// AVX2 one for a single row where [`Self::single_row_on_avx2`]).
    fn group(
        &self,
        base: &Base,
        a: &Q8Activations,
        act: Range<usize>,
        groups: Range<usize>,
        out: &Dest,
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: the features were detected at run time; every offset stays inside the
            // matrices and the activations (checked by the asserts in `matmul`), and each
            // row group writes only its own output columns.
            if super::has_vnni() && !Self::single_row_on_avx2(a.m) {
                return unsafe { group_kernel_vnni(self, base, a, act, groups, out) };
            }
            if super::has_avx2() {
                return unsafe {
                    if self.kind == PackedType::Q8_0 {
                        group_kernel_avx2_q8(self, base, a, act, groups, out)
                    } else {
                        group_kernel_avx2(self, base, a, act, groups, out)
                    }
                };
            }
        }
        let _ = base;
        self.group_scalar(a, act, groups, out);
    }

    /// Whether a product of `m` activation rows runs on pairs of row groups
    /// ([`pair_kernel_vnni`]): long batches on the VNNI path.
    fn pairs_groups(&self, m: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        if super::has_vnni() {
            return m > x86::UNPACK_MAX_ROWS;
        }
        let _ = m;
        false
    }

    /// Whether a product of `m` activation rows runs on the one-group AVX2 kernels although
    /// the VNNI path is available ([`super::single_row_on_one_group`]).
    fn single_row_on_avx2(m: usize) -> bool {
        m == 1 && super::has_vnni() && super::single_row_on_one_group()
    }

    /// Whether short batches (decode) run two row groups per pass in 512-bit vectors
    /// ([`wide_kernel_vnni`]): on the VNNI path.
    fn wide_groups(&self) -> bool {
        super::has_vnni()
    }

    /// Row groups `groups` in pairs on the two-group kernel `how` picks (a [`TwoGroups::Wide`]
    /// tile holds up to [`RUN_GROUPS`], a [`TwoGroups::Buffered`] one at most 2); a last,
    /// odd group on [`Self::group`].
    fn two_groups(
        &self,
        how: TwoGroups,
        base: &Base,
        a: &Q8Activations,
        act: Range<usize>,
        groups: Range<usize>,
        out: &Dest,
    ) {
        let paired = groups.start..groups.start + groups.len() / 2 * 2;
        #[cfg(target_arch = "x86_64")]
        if !paired.is_empty() {
            // SAFETY: only called when VNNI was detected (`pairs_groups`, `wide_groups`);
            // every paired group exists (`paired` lies inside the tile's groups) and writes
            // only its own output columns; offsets as in `group`.
            unsafe {
                match how {
                    TwoGroups::Wide => {
                        wide_kernel_vnni(self, base, a, act.clone(), paired.clone(), out)
                    }
                    TwoGroups::Buffered => {
                        debug_assert_eq!(paired.len(), 2);
                        pair_kernel_vnni(self, base, a, act.clone(), paired.start, out)
                    }
                }
            }
            if paired.end < groups.end {
                self.group(base, a, act, paired.end..groups.end, out)
            }
            return;
        }
        let _ = (how, paired);
        self.group(base, a, act, groups, out)
    }
}

/// The two-group kernels of the VNNI path (see [`PackedMatrix::two_groups`]).
#[derive(Clone, Copy)]
enum TwoGroups {
    /// Short batches (decode): both groups' blocks in 512-bit vectors ([`wide_kernel_vnni`]).
    Wide,
    /// Long batches (prompts): both groups' blocks unpacked once into the thread's buffer,
    /// which every pass of activation rows rereads ([`pair_kernel_vnni`]).
    Buffered,
}
#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    const TYPES: [PackedType; 5] = [
        PackedType::Q4_0,
        PackedType::Q4_1,
        PackedType::Q5_0,
        PackedType::Q5_1,
        PackedType::Q8_0,
    ];

    use crate::kernels::lcg;

    /// Random blocks of `kind` in ggml's layout and their dequantized values.
    fn random_blocks(
        kind: PackedType,
        n_out: usize,
        n_in: usize,
        seed: &mut u64,
    ) -> (Vec<u8>, Vec<f32>) {
        let levels = match kind {
            PackedType::Q8_0 => 256.0,
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
            if kind == PackedType::Q8_0 {
                bytes.extend(q.iter().map(|&v| (v as i32 - 128) as i8 as u8));
            } else if kind.has_high_bits() {
                let qh: u32 = (0..QK4_1).map(|i| ((q[i] >> 4) & 1) << i).sum();
                bytes.extend_from_slice(&qh.to_le_bytes());
            }
            if kind != PackedType::Q8_0 {
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
                let w = PackedMatrix::from_bytes(kind, &bytes, n_out, n_in).unwrap();
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
            let w = PackedMatrix::from_bytes(kind, &bytes, 16, 64).unwrap();
            assert!(matches!(w.d, Scales::F16(_)), "{kind:?}");
            assert!(matches!(w.m, Scales::F16(_)), "{kind:?}");
        }
    }

    #[test]
    fn the_interleaved_layout_keeps_every_value() {
        let mut seed = 5;
        for kind in TYPES {
            let (bytes, dense) = random_blocks(kind, 13, 96, &mut seed);
            let w = PackedMatrix::from_bytes(kind, &bytes, 13, 96).unwrap();
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

    /// The scalar, AVX2 and VNNI paths give bitwise the same products, whether a tile
    /// computes every activation row or runs of them (the SIMD paths take two runs here).
    pub(crate) fn assert_paths_agree(w12: &PackedMatrix, seed: &mut u64) {
        #[cfg(target_arch = "x86_64")]
        let kind = w12.kind;
        let (n_out, k) = (w12.n_out, w12.n_in);
        let groups = n_out.div_ceil(GROUP);
        // (33 rows: more than `UNPACK_MAX_ROWS`, the one-group kernels' buffered passes)
        for m in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 15, 17, 33] {
            let x: Vec<f32> = (0..m * k).map(|_| lcg(seed)).collect();
            let a = Q8Activations::quantize(&x, m, k, w12.act_format());
            let mut scalar = vec![0f32; m * n_out];
            let s = Dest::one(&mut scalar, n_out);
            for g in 0..groups {
                w12.group_scalar(&a, 0..m, g..g + 1, &s);
            }
            let mut scalar_run = vec![0f32; m * n_out];
            w12.group_scalar(&a, 0..m, 0..groups, &Dest::one(&mut scalar_run, n_out));
            assert_eq!(scalar_run, scalar, "scalar run of groups m={m}");
            #[cfg(target_arch = "x86_64")]
            let runs = [0..m / 2, m / 2..m];
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
                for (g, act) in (0..groups).flat_map(|g| runs.clone().map(|r| (g, r))) {
                    // SAFETY: the feature was detected above.
                    unsafe {
                        if path == "avx2" && kind == PackedType::Q8_0 {
                            group_kernel_avx2_q8(w12, &Base::base(w12), &a, act, g..g + 1, &p)
                        } else if path == "avx2" {
                            group_kernel_avx2(w12, &Base::base(w12), &a, act, g..g + 1, &p)
                        } else {
                            group_kernel_vnni(w12, &Base::base(w12), &a, act, g..g + 1, &p)
                        }
                    }
                }
                assert_eq!(simd, scalar, "{kind:?} {path} m={m}");
                // a decode tile's run of several groups in one call
                let mut run = vec![0f32; m * n_out];
                let p = Dest::one(&mut run, n_out);
                // SAFETY: the feature was detected above.
                unsafe {
                    let base = &Base::base(w12);
                    if path == "avx2" && kind == PackedType::Q8_0 {
                        group_kernel_avx2_q8(w12, base, &a, 0..m, 0..groups, &p)
                    } else if path == "avx2" {
                        group_kernel_avx2(w12, base, &a, 0..m, 0..groups, &p)
                    } else {
                        group_kernel_vnni(w12, base, &a, 0..m, 0..groups, &p)
                    }
                }
                assert_eq!(run, scalar, "{kind:?} {path} run of groups m={m}");
            }
            // prompts' pairs of row groups (any batch size computes the same per row)
            #[cfg(target_arch = "x86_64")]
            if crate::kernels::has_vnni() {
                let mut pairs = vec![0f32; m * n_out];
                let p = Dest::one(&mut pairs, n_out);
                for (g, act) in (0..groups)
                    .step_by(2)
                    .flat_map(|g| runs.clone().map(|r| (g, r)))
                {
                    // SAFETY: VNNI was detected above; group g + 1 exists when called.
                    unsafe {
                        if g + 1 < groups {
                            pair_kernel_vnni(w12, &Base::base(w12), &a, act, g, &p)
                        } else {
                            group_kernel_vnni(w12, &Base::base(w12), &a, act, g..g + 1, &p)
                        }
                    }
                }
                assert_eq!(pairs, scalar, "{kind:?} vnni pairs m={m}");
                // decode batches' 512-bit pairs of row groups
                let mut wide = vec![0f32; m * n_out];
                let p = Dest::one(&mut wide, n_out);
                for (g, act) in (0..groups)
                    .step_by(2)
                    .flat_map(|g| runs.clone().map(|r| (g, r)))
                {
                    // SAFETY: VNNI was detected above; group g + 1 exists when called.
                    unsafe {
                        if g + 1 < groups {
                            wide_kernel_vnni(w12, &Base::base(w12), &a, act, g..g + 2, &p)
                        } else {
                            group_kernel_vnni(w12, &Base::base(w12), &a, act, g..g + 1, &p)
                        }
                    }
                }
                assert_eq!(wide, scalar, "{kind:?} vnni wide m={m}");
                // a decode tile's run of pairs in one call
                let mut run = vec![0f32; m * n_out];
                let p = Dest::one(&mut run, n_out);
                let paired = groups / 2 * 2;
                // SAFETY: VNNI was detected above; every paired group exists.
                unsafe {
                    let base = &Base::base(w12);
                    wide_kernel_vnni(w12, base, &a, 0..m, 0..paired, &p);
                    if paired < groups {
                        group_kernel_vnni(w12, base, &a, 0..m, paired..groups, &p)
                    }
                }
                assert_eq!(run, scalar, "{kind:?} vnni wide run of pairs m={m}");
            }
        }
    }

    #[test]
    fn stacked_parts_are_written_in_place() {
        let mut seed = 12;
        for kind in TYPES {
            let widths = [16usize, 8, 13];
            let parts: Vec<PackedMatrix> = widths
                .iter()
                .map(|&n| {
                    let (bytes, _) = random_blocks(kind, n, 96, &mut seed);
                    PackedMatrix::from_bytes(kind, &bytes, n, 96).unwrap()
                })
                .collect();
            let stacked = PackedMatrix::concat(&parts.iter().collect::<Vec<_>>()).unwrap();
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
            let odd = PackedMatrix::concat(&[&parts[2], &parts[0]]).unwrap();
            assert!(odd
                .matmul_parts(&x, 1, &[13, 16], &mut [&mut a, &mut b])
                .is_none());
        }
    }

    #[test]
    fn products_of_several_types_in_one_call_equal_each_product() {
        let mut seed = 21;
        // Gemma 3's Q, K (Q5_0) and V (Q8_0); a type with a stored minimum beside them; a
        // run of row groups and a partial last one
        let kinds = [
            PackedType::Q5_0,
            PackedType::Q5_0,
            PackedType::Q8_0,
            PackedType::Q4_1,
        ];
        let heights = [40usize, 16, 13, 24];
        let parts: Vec<PackedMatrix> = kinds
            .iter()
            .zip(heights)
            .map(|(&kind, n)| {
                let (bytes, _) = random_blocks(kind, n, 128, &mut seed);
                PackedMatrix::from_bytes(kind, &bytes, n, 128).unwrap()
            })
            .collect();
        let mats: Vec<&PackedMatrix> = parts.iter().collect();
        for threads in [1, 2, 3] {
            for m in [1usize, 3, 16, 40, 300] {
                let x: Vec<f32> = (0..m * 128).map(|_| lcg(&mut seed)).collect();
                // stale contents of the wrong length are replaced
                let mut outs = [vec![7.0; 5], Vec::new(), vec![1.0; 999], Vec::new()];
                let [a, b, c, d] = &mut outs;
                crate::pool::with_threads(threads, || {
                    PackedMatrix::matmul_each(&mats, &x, m, &mut [a, b, c, d]).unwrap()
                });
                for (part, got) in parts.iter().zip(&outs) {
                    let mut want = vec![0f32; m * part.n_out];
                    part.matmul(&x, m, &mut want);
                    assert_eq!(got, &want, "{:?} m={m} threads={threads}", part.kind);
                }
            }
        }
        // three types' offsets (Q4_0's too), or another input width: not one call
        let (bytes, _) = random_blocks(PackedType::Q4_0, 8, 128, &mut seed);
        let q4_0 = PackedMatrix::from_bytes(PackedType::Q4_0, &bytes, 8, 128).unwrap();
        let (bytes, _) = random_blocks(PackedType::Q5_0, 8, 64, &mut seed);
        let narrow = PackedMatrix::from_bytes(PackedType::Q5_0, &bytes, 8, 64).unwrap();
        let x = vec![0.5f32; 128];
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        let three = [&parts[0], &parts[2], &q4_0];
        assert!(PackedMatrix::matmul_each(&three, &x, 1, &mut [&mut a, &mut b, &mut c]).is_none());
        let widths = [&parts[0], &narrow];
        assert!(PackedMatrix::matmul_each(&widths, &x, 1, &mut [&mut a, &mut b]).is_none());
        assert!(a.is_empty() && b.is_empty(), "nothing written");
    }

    #[test]
    fn products_are_bitwise_the_same_however_the_threads_split_them() {
        // 48 rows: three two-group tiles, which 8 threads run as six one-group tiles on
        // the VNNI path (decode) or as two runs of each tile's activation rows (a prompt)
        let mut seed = 29;
        for kind in [PackedType::Q4_1, PackedType::Q5_0, PackedType::Q8_0] {
            let (bytes, _) = random_blocks(kind, 48, 256, &mut seed);
            let w = PackedMatrix::from_bytes(kind, &bytes, 48, 256).unwrap();
            if w.wide_groups() {
                let rows = crate::pool::with_threads(8, || w.tile_rows(48, 8));
                assert_eq!(rows, GROUP, "decode on 8 threads: one-group tiles");
            }
            for m in [8usize, 256] {
                let x: Vec<f32> = (0..m * 256).map(|_| lcg(&mut seed)).collect();
                let mut one = vec![0f32; m * 48];
                crate::pool::with_threads(1, || w.matmul(&x, m, &mut one));
                for threads in [2, 3, 8] {
                    let mut many = vec![0f32; m * 48];
                    crate::pool::with_threads(threads, || w.matmul(&x, m, &mut many));
                    assert_eq!(many, one, "{kind:?} m={m} threads={threads}");
                }
            }
        }
    }

    #[test]
    fn gated_tiles_equal_the_product_then_the_activation() {
        let act = |g: &mut [f32], u: &[f32]| {
            for (g, u) in g.iter_mut().zip(u) {
                *g = *g * 0.5 - u * u;
            }
        };
        let mut seed = 13;
        for kind in TYPES {
            // 24 rows: a half ending in a tile of one row group on the two-group paths
            for half in [8usize, 24, 40] {
                let (bytes, _) = random_blocks(kind, 2 * half, 96, &mut seed);
                let w = PackedMatrix::from_bytes(kind, &bytes, 2 * half, 96).unwrap();
                for m in [1usize, 5, GATED_MAX_ROWS] {
                    let x: Vec<f32> = (0..m * 96).map(|_| lcg(&mut seed)).collect();
                    let mut want = vec![0f32; m * 2 * half];
                    w.matmul(&x, m, &mut want);
                    let (mut g, mut u) = (Vec::new(), Vec::new());
                    for row in want.chunks_exact(2 * half) {
                        g.extend_from_slice(&row[..half]);
                        u.extend_from_slice(&row[half..]);
                    }
                    act(&mut g, &u);
                    // stale contents of the wrong length are replaced
                    let mut got = vec![7.0; 3];
                    crate::pool::with_threads(2, || w.matmul_gated(&x, m, &mut got, act)).unwrap();
                    assert_eq!(got, g, "{kind:?} half={half} m={m}");
                }
            }
            let (bytes, _) = random_blocks(kind, 24, 96, &mut seed);
            let odd = PackedMatrix::from_bytes(kind, &bytes, 24, 96).unwrap();
            let mut out = Vec::new();
            let x = vec![0.5f32; 96 * (GATED_MAX_ROWS + 1)];
            assert!(odd.matmul_gated(&x[..96], 1, &mut out, act).is_none());
            let (bytes, _) = random_blocks(kind, 32, 96, &mut seed);
            let w = PackedMatrix::from_bytes(kind, &bytes, 32, 96).unwrap();
            assert!(w
                .matmul_gated(&x, GATED_MAX_ROWS + 1, &mut out, act)
                .is_none());
            assert!(out.is_empty());
        }
    }

    #[test]
    fn four_bit_extremes_sum_a_whole_block_in_sixteen_bits() {
        // every value 15 against activations at ±127: each `maddubs` pair is ±2·15·127 and a
        // block's eight quads ±30480, the most a 16-bit sum of the AVX2 path holds
        let (n_out, k) = (16, 256);
        for kind in [PackedType::Q4_0, PackedType::Q4_1] {
            let mut bytes = Vec::new();
            for _ in 0..n_out * k / QK4_1 {
                bytes.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
                if kind.has_min() {
                    bytes.extend_from_slice(&f16::from_f32(-1.0).to_le_bytes());
                }
                bytes.extend_from_slice(&[0xFF; PACKED]);
            }
            let w = PackedMatrix::from_bytes(kind, &bytes, n_out, k).unwrap();
            for m in [3usize, 40] {
                for sign in [1.0f32, -1.0] {
                    let x = vec![sign; m * k];
                    let a = Q8Activations::quantize(&x, m, k, w.act_format());
                    let mut scalar = vec![0f32; m * n_out];
                    let s = Dest::one(&mut scalar, n_out);
                    for g in 0..n_out / GROUP {
                        w.group_scalar(&a, 0..m, g..g + 1, &s);
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
                            unsafe {
                                group_kernel_avx2(&w, &Base::base(&w), &a, 0..m, g..g + 1, &p)
                            };
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
            let w = PackedMatrix::from_bytes(kind, &b1, 8, 128).unwrap();
            let w12 = PackedMatrix::from_bytes(kind, &b12, 12, 128).unwrap();
            assert_paths_agree(&w12, &mut seed);
            // several pairs of groups, the last of them partial
            let (b44, _) = random_blocks(kind, 44, 128, &mut seed);
            assert_paths_agree(
                &PackedMatrix::from_bytes(kind, &b44, 44, 128).unwrap(),
                &mut seed,
            );
            let x: Vec<f32> = (0..3 * 128).map(|_| lcg(&mut seed)).collect();
            let w2 = PackedMatrix::from_bytes(kind, &b2, 4, 128).unwrap();
            let both = PackedMatrix::concat(&[&w, &w2]).unwrap();
            let (mut o1, mut o) = (vec![0f32; 24], vec![0f32; 36]);
            w.matmul(&x, 3, &mut o1);
            both.matmul(&x, 3, &mut o);
            for r in 0..3 {
                for c in 0..8 {
                    let (p, q) = (o[r * 12 + c], o1[r * 8 + c]);
                    assert!((p - q).abs() <= 1e-4 * q.abs().max(1.0));
                }
            }
            assert!(PackedMatrix::from_bytes(kind, &b1[..kind.block_bytes() - 1], 1, 32).is_none());
        }
        let (q4, _) = random_blocks(PackedType::Q4_1, 4, 64, &mut seed);
        let (q5, _) = random_blocks(PackedType::Q5_0, 4, 64, &mut seed);
        let a = PackedMatrix::from_bytes(PackedType::Q4_1, &q4, 4, 64).unwrap();
        let b = PackedMatrix::from_bytes(PackedType::Q5_0, &q5, 4, 64).unwrap();
        assert!(
            PackedMatrix::concat(&[&a, &b]).is_none(),
            "types do not mix"
        );
    }
}
