//! What the x86 paths share: unpacking a row group's blocks into the 8 quads a product
//! reads, where a row group lives (`GroupRef`), prefetches, the per-thread buffer of
//! unpacked blocks, and `group_kernel!`, which writes a one-group product for an instruction
//! set (`avx2.rs`, `vnni.rs`).

use super::*;

/// The 8 quads of one block of a row group: vector `q` holds values `4q..4q + 4` of each row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn unpack_block(
    qs: *const u8,
    qh: Option<*const u32>,
) -> [std::arch::x86_64::__m256i; 8] {
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

/// Adds a 6-bit block's high bit pairs (its two planes at `planes`, see [`PackedMatrix`]) to
/// the nibbles of its 8 quads.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn add_six_bit_pairs(v: &mut [std::arch::x86_64::__m256i; 8], planes: *const u8) {
    use std::arch::x86_64::*;
    let pair = _mm256_set1_epi8(0x30);
    for p in 0..2 {
        let w = _mm256_loadu_si256(planes.add(p * 32) as *const __m256i);
        // (what a shift moves across a byte boundary is masked off)
        let bits = [
            _mm256_slli_epi16::<4>(w),
            _mm256_slli_epi16::<2>(w),
            w,
            _mm256_srli_epi16::<2>(w),
        ];
        for (k, b) in bits.into_iter().enumerate() {
            v[4 * p + k] = _mm256_or_si256(v[4 * p + k], _mm256_and_si256(b, pair));
        }
    }
}

/// The 8 quads of one Q8_0 block of a row group (stored unpacked).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn load_bytes_block(qs: *const u8) -> [std::arch::x86_64::__m256i; 8] {
    use std::arch::x86_64::*;
    let mut v = [_mm256_setzero_si256(); 8];
    for (q, vq) in v.iter_mut().enumerate() {
        *vq = _mm256_loadu_si256(qs.add(q * 32) as *const __m256i);
    }
    v
}

/// Batches of at most this many rows prefetch the next row group's weights (see
/// `group_kernel!`).
#[cfg(target_arch = "x86_64")]
pub(super) const PREFETCH_MAX_ROWS: usize = 16;

/// Batches of more rows than this (prompts) fill a buffer with each row group's unpacked
/// values once per matmul and read it in passes of [`BUFFERED_ROWS`]; smaller ones (decode
/// batches) unpack again in every register pass (see `group_kernel!`).
#[cfg(target_arch = "x86_64")]
pub(super) const UNPACK_MAX_ROWS: usize = 32;

/// Rows per pass over a buffered row group.
#[cfg(target_arch = "x86_64")]
pub(super) const BUFFERED_ROWS: usize = 4;

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The unpacked blocks of the row group a batch's product is computing (see
    /// `group_kernel!`).
    pub(super) static BUFFERED: std::cell::RefCell<Vec<[std::arch::x86_64::__m256i; 8]>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// A block's scale integers as a product multiplies its dot products by them (factored
/// scales: K-quants, whose activations carry super-block scales). Each block's dot product
/// is multiplied by its scale integer (Q6_K: each half's by its own) and summed in integers
/// over the super-block; the sum is converted and multiplied by the super-block's factor
/// once, as ggml's K-quant products do: exact sums, and on AVX2 the `vpmaddwd` that widens
/// the 16-bit sums multiplies by the scale at no cost. `s`: per half (one for types without
/// halves), the integers as the path multiplies by them (AVX2: in both 16-bit halves of each
/// lane, [`GroupRef::scale_pairs8`]; VNNI: one per lane for `vpmulld`,
/// [`GroupRef::scales8`]); `off`: for split types on AVX2, each lane's two half scales
/// times the implied offset ([`GroupRef::offset_pairs8`]), for the activations' half sums.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct BlockScales {
    pub(super) s: [std::arch::x86_64::__m256i; 2],
    pub(super) off: std::arch::x86_64::__m256i,
}

/// How a row group's scales are stored (see [`Scales`]).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Form {
    F16,
    F32,
    Factored,
}

/// What a kernel knows of a matrix's layout when it is compiled. [`Dyn`] reads it from the
/// [`GroupRef`] at run time; [`Fixed`] has it as constants, so that the kernels' loops carry
/// no branches on it and keep their pointers in registers: a decode product's single-row
/// pass, compute-bound on one core of Zen 4 at ~13 GB/s with the branches, is the step that
/// the memory rate of two cores has to be reached with.
#[cfg(target_arch = "x86_64")]
pub(super) trait Format {
    /// Values stored one per byte (Q8_0, Q6_K).
    fn bytes8(p: &GroupRef) -> bool;
    /// 5-bit values' fifth bits.
    fn high(p: &GroupRef) -> bool;
    /// 6-bit values' planes of high bit pairs (Q6_K).
    fn six(p: &GroupRef) -> bool;
    fn halves(p: &GroupRef) -> usize;
    fn has_min(p: &GroupRef) -> bool;
    fn scales(p: &GroupRef) -> Form;
    /// Bytes of a block of the row group's values.
    fn gbb(p: &GroupRef) -> usize;
}

/// The layout as each [`GroupRef`] says.
#[cfg(target_arch = "x86_64")]
pub(super) struct Dyn;

#[cfg(target_arch = "x86_64")]
impl Format for Dyn {
    #[inline(always)]
    fn bytes8(p: &GroupRef) -> bool {
        p.kind.byte_values()
    }
    #[inline(always)]
    fn high(p: &GroupRef) -> bool {
        p.h.is_some()
    }
    #[inline(always)]
    fn six(p: &GroupRef) -> bool {
        p.kind.six_bits()
    }
    #[inline(always)]
    fn halves(p: &GroupRef) -> usize {
        p.kind.halves()
    }
    #[inline(always)]
    fn has_min(p: &GroupRef) -> bool {
        p.kind.has_min()
    }
    #[inline(always)]
    fn scales(p: &GroupRef) -> Form {
        match (p.factored, p.d.half) {
            (true, _) => Form::Factored,
            (false, true) => Form::F16,
            (false, false) => Form::F32,
        }
    }
    #[inline(always)]
    fn gbb(p: &GroupRef) -> usize {
        p.kind.group_block_bytes()
    }
}

/// Type `K` ([`kind_of`]) with scales of form `S` ([`form_of`]), known when compiled.
#[cfg(target_arch = "x86_64")]
pub(super) struct Fixed<const K: u8, const S: u8>;

#[cfg(target_arch = "x86_64")]
pub(super) const fn kind_of(k: u8) -> PackedType {
    match k {
        0 => PackedType::Q4_0,
        1 => PackedType::Q4_1,
        2 => PackedType::Q5_0,
        3 => PackedType::Q5_1,
        4 => PackedType::Q8_0,
        _ => PackedType::Q6K,
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) const fn form_of(s: u8) -> Form {
    match s {
        0 => Form::F16,
        1 => Form::F32,
        _ => Form::Factored,
    }
}

#[cfg(target_arch = "x86_64")]
impl<const K: u8, const S: u8> Format for Fixed<K, S> {
    #[inline(always)]
    fn bytes8(_: &GroupRef) -> bool {
        kind_of(K).byte_values()
    }
    #[inline(always)]
    fn high(_: &GroupRef) -> bool {
        kind_of(K).has_high_bits()
    }
    #[inline(always)]
    fn six(_: &GroupRef) -> bool {
        kind_of(K).six_bits()
    }
    #[inline(always)]
    fn halves(_: &GroupRef) -> usize {
        kind_of(K).halves()
    }
    #[inline(always)]
    fn has_min(_: &GroupRef) -> bool {
        kind_of(K).has_min()
    }
    #[inline(always)]
    fn scales(_: &GroupRef) -> Form {
        form_of(S)
    }
    #[inline(always)]
    fn gbb(_: &GroupRef) -> usize {
        kind_of(K).group_block_bytes()
    }
}

/// Runs `$call` with `$t` the [`Format`] of row group `$p` and `$s` a `const bool`, whether
/// the activations carry one scale per super-block (`$super`, true only for K-quants): with
/// `all`, a [`Fixed`] format for the layouts models have (the native types' scales, f16 or
/// f32 where a folded minimum is not an f16, without super-block scales; K-quants' factored
/// scales and their f32 copies with them),
/// [`Dyn`] for any other; with `q8`, [`Fixed`] only for Q8_0 (a kernel only Q8_0 reaches);
/// with `dyn`, always [`Dyn`] (a kernel off the hot paths, not worth its copies). Pairing
/// each layout with the one activation form it meets keeps the kernels' copies (and the
/// build's time) to those that run.
macro_rules! by_format {
    ($formats:ident $p:expr, $super:expr, |$t:ident, $s:ident| $call:expr) => {{
        if $super {
            const $s: bool = true;
            by_format!(@ $formats true $p, |$t| $call)
        } else {
            const $s: bool = false;
            by_format!(@ $formats false $p, |$t| $call)
        }
    }};
    (@ dyn $super:literal $p:expr, |$t:ident| $call:expr) => {{
        type $t = Dyn;
        $call
    }};
    (@ q8 true $p:expr, |$t:ident| $call:expr) => {
        by_format!(@ dyn true $p, |$t| $call)
    };
    (@ q8 false $p:expr, |$t:ident| $call:expr) => {
        by_format!(@ fixed $p, |$t| $call, [(Q8_0, F16) 4 0])
    };
    (@ all false $p:expr, |$t:ident| $call:expr) => {
        by_format!(@ fixed $p, |$t| $call, [
            (Q4_0, F16) 0 0, (Q4_1, F16) 1 0, (Q4_1, F32) 1 1, (Q5_0, F16) 2 0,
            (Q5_1, F16) 3 0, (Q5_1, F32) 3 1, (Q8_0, F16) 4 0
        ])
    };
    (@ all true $p:expr, |$t:ident| $call:expr) => {
        by_format!(@ fixed $p, |$t| $call, [
            (Q4_1, Factored) 1 2, (Q5_1, Factored) 3 2, (Q6K, Factored) 5 2
        ])
    };
    (@ fixed $p:expr, |$t:ident| $call:expr,
     [$(($kind:ident, $form:ident) $k:literal $f:literal),*]) => {{
        let p: &GroupRef = $p;
        match (p.kind, Dyn::scales(p)) {
            $((PackedType::$kind, Form::$form) => {
                type $t = Fixed<$k, $f>;
                $call
            })*
            _ => {
                type $t = Dyn;
                $call
            }
        }
    }};
}

pub(super) use by_format;

// SAFETY: a `GroupRef` only points into a matrix's arrays, which are only read while
// products run (see `Dest` for the outputs).
#[cfg(target_arch = "x86_64")]
unsafe impl Sync for GroupRef {}

/// Where one row group's blocks live.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct GroupRef {
    pub(super) q: *const u8,
    pub(super) h: Option<*const u32>,
    /// The scales and minimums (unused when `factored`, or the minimums without
    /// `has_min`).
    pub(super) d: ScalePtr,
    pub(super) m: ScalePtr,
    /// The factored scales and minimums ([`Scales::Factored`]; the scales unused unless
    /// `factored`, the minimums read by [`Self::min_pairs8`] either way).
    fd: FactorPtr,
    fm: FactorPtr,
    /// Whether the scales are read from `fd`/`fm` instead of `d`/`m`.
    pub(super) factored: bool,
    pub(super) kind: PackedType,
    /// Byte values are flipped from `q + 128` back to signed `q` when loaded (the AVX2 Q8_0
    /// path, whose dot product then adds `128·Σx` back).
    pub(super) signed: bool,
}

#[cfg(target_arch = "x86_64")]
impl GroupRef {
    /// Row group 0 of `w`, from which [`Self::at`] derives the others (the one place a
    /// group's arrays are found from the matrix).
    pub(super) fn base(w: &PackedMatrix) -> Self {
        let none = ScalePtr::f32(std::ptr::null());
        let no_factors = FactorPtr {
            mult: std::ptr::null(),
            base: std::ptr::null(),
        };
        let has_min = w.kind.has_min();
        GroupRef {
            q: w.qs.as_ptr(),
            h: (!w.qh.is_empty()).then(|| w.qh.as_ptr()),
            d: w.d.at(0).unwrap_or(none),
            m: has_min.then(|| w.m.at(0)).flatten().unwrap_or(none),
            fd: w.d.factors_at(0).unwrap_or(no_factors),
            fm: has_min
                .then(|| w.m.factors_at(0))
                .flatten()
                .unwrap_or(no_factors),
            factored: w.factored(),
            kind: w.kind,
            signed: false,
        }
    }

    /// Row group `g` of `w`, from `w`'s [`Self::base`] (the groups' blocks, scales and
    /// factors each lie one after another, so this is only additions).
    #[inline(always)]
    pub(super) fn at(&self, w: &PackedMatrix, g: usize, signed: bool) -> Self {
        let (nb, kind) = (w.nb, self.kind);
        // this group's first block, scale (run of GROUP) and super-block
        let (block, unit) = (g * nb, g * nb * kind.halves());
        GroupRef {
            q: self.q.wrapping_add(block * kind.group_block_bytes()),
            h: self.h.map(|h| h.wrapping_add(block * GROUP)),
            d: self.d.add(unit * GROUP),
            m: self.m.add(unit * GROUP),
            fd: self.fd.offset(unit, block / SUPER_BLOCKS),
            fm: self.fm.offset(unit, block / SUPER_BLOCKS),
            signed,
            ..*self
        }
    }

    /// Row groups `g` and `g + 1` (which must exist) of the matrix whose [`Self::base`] is
    /// `base`, and how many of their 8 rows are real (the second may be a matrix's last,
    /// partial group), for the two-group kernels.
    #[inline(always)]
    pub(super) fn pair(base: &Self, w: &PackedMatrix, g: usize) -> ([Self; 2], [usize; 2]) {
        let refs = [base.at(w, g, false), base.at(w, g + 1, false)];
        (refs, [GROUP, GROUP.min(w.n_out - (g + 1) * GROUP)])
    }

    /// The 8 rows' scales of half `h` of block `b` (`h` = 0 for types with one scale a
    /// block; scales not factored: factored ones are multiplied in integers,
    /// [`BlockScales`]).
    ///
    /// # Safety
    /// Block `b` is inside the matrix; AVX2 and F16C are available; `T` is this group's
    /// format.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(super) unsafe fn d8<T: Format>(&self, b: usize, h: usize) -> std::arch::x86_64::__m256 {
        let form = T::scales(self);
        debug_assert!(form != Form::Factored, "factored scales are integers");
        let unit = b * T::halves(self) + h;
        let half = form == Form::F16;
        self.d.add_as(unit * GROUP, half).load8_as(half)
    }

    /// The 8 rows' minimums of block `b` (types with a stored one, scales not factored), as
    /// [`Self::d8`]. Factored scales come with super-block activation scales, whose kernels
    /// read the minimums as integers ([`Self::min_pairs8`]).
    ///
    /// # Safety
    /// As [`Self::d8`].
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(super) unsafe fn m8<T: Format>(&self, b: usize) -> std::arch::x86_64::__m256 {
        let form = T::scales(self);
        debug_assert!(
            form != Form::Factored,
            "factored minimums are read as integers"
        );
        let half = form == Form::F16;
        self.m.add_as(b * GROUP, half).load8_as(half)
    }

    /// The converted super-block factor of block `b`'s scales (zero unless they are
    /// factored), by which a super-block's integer sum is multiplied ([`BlockScales`]).
    ///
    /// # Safety
    /// As [`Self::d8`].
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(super) unsafe fn d_base8<T: Format>(&self, b: usize) -> std::arch::x86_64::__m256 {
        match T::scales(self) {
            Form::Factored => self.fd.base8(b / SUPER_BLOCKS),
            _ => std::arch::x86_64::_mm256_setzero_ps(),
        }
    }

    /// The 8 rows' scale integers of run `unit` (a block, or a half of one for split types;
    /// factored scales), each in both 16-bit halves of its lane, for the `vpmaddwd` of
    /// [`BlockScales`] on AVX2.
    ///
    /// # Safety
    /// The scales are factored and the run is inside the matrix; AVX2 is available.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) unsafe fn scale_pairs8(&self, unit: usize) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let n = _mm_loadl_epi64(self.fd.mult.add(unit * GROUP) as *const __m128i);
        _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(n, n))
    }

    /// [`Self::scale_pairs8`]'s integers, one per 32-bit lane (for `vpmulld`).
    ///
    /// # Safety
    /// As [`Self::scale_pairs8`].
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) unsafe fn scales8(&self, unit: usize) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let n = _mm_loadl_epi64(self.fd.mult.add(unit * GROUP) as *const __m128i);
        _mm256_cvtepi8_epi32(n)
    }

    /// Per row of a split type's block `b`, its two half scale integers times `c` (the
    /// type's implied offset) as the low and high 16 bits of its lane: against the
    /// activations' half sums ([`Q8Activations::half_sums`]), the integer the folded offsets
    /// add to the scaled dot products.
    ///
    /// # Safety
    /// As [`Self::scale_pairs8`], the type split.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) unsafe fn offset_pairs8(&self, b: usize, c: i16) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // halves 2b and 2b + 1: 8 rows' integers each, one after the other
        let two = _mm_loadu_si128(self.fd.mult.add(2 * b * GROUP) as *const __m128i);
        let pairs = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(two, _mm_srli_si128::<8>(two)));
        _mm256_mullo_epi16(pairs, _mm256_set1_epi16(c))
    }

    /// Super-block `sb`'s minimums ([`Scales::Factored`], which super-block activation
    /// scales imply) for [`min_dot8`]: vector `p` holds, per row, the integers of blocks
    /// `2p` and `2p + 1` as the low and high 16 bits of its lane; and their factor per row.
    ///
    /// # Safety
    /// The matrix's minimums are factored and the super-block is inside it; AVX2 and F16C
    /// are available.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(super) unsafe fn min_pairs8(
        &self,
        sb: usize,
    ) -> ([std::arch::x86_64::__m256i; 4], std::arch::x86_64::__m256) {
        use std::arch::x86_64::*;
        let pairs = std::array::from_fn(|p| {
            // blocks 2p and 2p + 1: 8 rows' integers each, one after the other
            let two = _mm_loadu_si128(
                self.fm.mult.add((SUPER_BLOCKS * sb + 2 * p) * GROUP) as *const __m128i
            );
            _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(two, _mm_srli_si128::<8>(two)))
        });
        (pairs, self.fm.base8(sb))
    }

    /// Starts loading the `nb` blocks of this group (values, scales, fifth bits; the first
    /// [`COLD_SPAN`] bytes of each) into L2, as many lines in flight at once as they take:
    /// the first group of a tile that no kernel's prefetch of a next group reached (see
    /// [`PackedMatrix::prefetch_tile`]).
    #[inline(always)]
    pub(super) fn prefetch_group(&self, nb: usize) {
        use std::arch::x86_64::_MM_HINT_T2;
        let span = |from: *const u8, bytes: usize| {
            if bytes > 0 {
                prefetch_span::<_MM_HINT_T2>(from, bytes.min(COLD_SPAN))
            }
        };
        let (halves, has_min) = (self.kind.halves(), self.kind.has_min());
        span(self.q, nb * self.kind.group_block_bytes());
        if self.factored {
            let supers = 2 * nb.div_ceil(SUPER_BLOCKS) * GROUP;
            span(self.fd.mult as *const u8, nb * halves * GROUP);
            span(self.fd.base as *const u8, supers);
            if has_min {
                span(self.fm.mult as *const u8, nb * GROUP);
                span(self.fm.base as *const u8, supers);
            }
        } else {
            span(self.d.at, nb * halves * GROUP * self.d.bytes_per());
            if has_min {
                span(self.m.at, nb * GROUP * self.m.bytes_per());
            }
        }
        if let Some(h) = self.h {
            span(h as *const u8, nb * GROUP * 4);
        }
    }

    /// Starts loading block `b` of the next row group (laid out right after this one's `nb`
    /// blocks) into L1, or into L2 when `l2` ([`crate::kernels::prefetch_to_l2`]).
    #[inline(always)]
    pub(super) fn prefetch_next<T: Format>(&self, nb: usize, b: usize, l2: bool) {
        use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T2};
        if l2 {
            self.prefetch_block::<T, _MM_HINT_T2>(nb + b)
        } else {
            self.prefetch_block::<T, _MM_HINT_T0>(nb + b)
        }
    }

    /// Starts loading the block `at` blocks after this group's first (the row groups are
    /// laid out one after the other, their scales and factors too) into the caches `HINT`
    /// names.
    #[inline(always)]
    pub(super) fn prefetch_block<T: Format, const HINT: i32>(&self, at: usize) {
        let gbb = T::gbb(self);
        prefetch_span::<HINT>(self.q.wrapping_add(at * gbb), gbb);
        let halves = T::halves(self);
        let has_min = T::has_min(self);
        if T::scales(self) == Form::Factored {
            // 8 or 16 bytes of integers and the super-block's factors
            self.fd.prefetch::<HINT>(at * halves, at / SUPER_BLOCKS);
            if has_min {
                self.fm.prefetch::<HINT>(at, at / SUPER_BLOCKS);
            }
        } else {
            let per_block = GROUP * halves;
            let mins = has_min.then_some(self.m);
            // (the stride known when compiled, as `T` has it)
            let half = T::scales(self) == Form::F16;
            for s in [Some(self.d), mins].into_iter().flatten() {
                // a block's scales (and minimums) are 16–64 bytes: the lines of their first
                // and last byte cover them (a loop over a span whose length is known only
                // at run time cost more than the prefetches saved)
                let from = s.add_as(at * per_block, half).at;
                let last = from.wrapping_add(ScalePtr::bytes_per_as(half) * per_block - 1);
                // SAFETY: a prefetch is a hint that never faults, whatever the address.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<HINT>(from as *const i8);
                    std::arch::x86_64::_mm_prefetch::<HINT>(last as *const i8);
                }
            }
        }
        if T::high(self) {
            if let Some(h) = self.h {
                prefetch_span::<HINT>(h.wrapping_add(at * GROUP) as *const u8, 4 * GROUP);
            }
        }
    }
}

/// The most bytes of one array of a row group [`GroupRef::prefetch_group`] asks for: a
/// small model's groups whole or nearly (SmolLM2's 2.9 KB of values, Gemma 3's 2.5-12 KB);
/// of a 1B model's 8192-wide down product (32 KB of Q4_K values a group) the part the
/// hardware prefetchers need to find the stream, without a thousand prefetches queued at
/// once. On a 1B Q4_K_M file, alternating decode steps in one process, 32 KB was within
/// noise of 8 KB.
#[cfg(target_arch = "x86_64")]
const COLD_SPAN: usize = 8 << 10;

/// Asks for every cache line of `bytes` bytes from `from` to be loaded into the caches
/// `HINT` names: a line per 64 bytes from `from`, and the line of the last byte (which a span
/// not on a line boundary ends in), so that with `bytes` known when compiled the loop
/// unrolls. The pointer may be past the end of its buffer (the last row group's "next"): it
/// is never read.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_span<const HINT: i32>(from: *const u8, bytes: usize) {
    use std::arch::x86_64::_mm_prefetch;
    const LINE: usize = 64;
    // SAFETY: a prefetch is a hint that never faults, whatever the address.
    unsafe {
        for i in 0..bytes / LINE {
            _mm_prefetch::<HINT>(from.wrapping_add(i * LINE) as *const i8);
        }
        _mm_prefetch::<HINT>(from.wrapping_add(bytes - 1) as *const i8);
    }
}

/// One activation row's results for a row group: the first `valid` of its 8 lanes (fewer
/// than 8 only in a matrix's last group) into `dst`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[inline]
pub(super) unsafe fn store_group(acc: std::arch::x86_64::__m256, dst: *mut f32, valid: usize) {
    use std::arch::x86_64::_mm256_storeu_ps;
    if valid == GROUP {
        _mm256_storeu_ps(dst, acc);
    } else {
        let mut tmp = [0f32; GROUP];
        _mm256_storeu_ps(tmp.as_mut_ptr(), acc);
        std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, valid);
    }
}

/// The 8 quads of block `b` of a row group, whatever its storage: [`group_block_inline`]
/// compiled for AVX2, for callers without it (filling a buffer of unpacked blocks).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn group_block<T: Format>(
    p: &GroupRef,
    b: usize,
) -> [std::arch::x86_64::__m256i; 8] {
    group_block_inline::<T>(p, b)
}

/// [`group_block`] always inlined into its caller, which must have AVX2 (so without a
/// `target_feature` of its own), for the passes over 5-bit types: LLVM left [`group_block`]
/// a call there, its 8 vectors went through the stack, and a single row's product ran at
/// half speed. Other types keep LLVM's choice (forced, the AVX2 Q8_0 pass over 512 rows ran
/// 5-9% slower).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn group_block_inline<T: Format>(
    p: &GroupRef,
    b: usize,
) -> [std::arch::x86_64::__m256i; 8] {
    let gbb = T::gbb(p);
    if T::bytes8(p) {
        let mut v = load_bytes_block(p.q.add(b * gbb));
        if p.signed {
            use std::arch::x86_64::{_mm256_set1_epi8, _mm256_xor_si256};
            let flip = _mm256_set1_epi8(-128);
            for vq in &mut v {
                *vq = _mm256_xor_si256(*vq, flip);
            }
        }
        v
    } else {
        let h = if T::high(p) {
            p.h.map(|h| h.add(b * GROUP))
        } else {
            None
        };
        let mut v = unpack_block(p.q.add(b * gbb), h);
        if T::six(p) {
            add_six_bit_pairs(&mut v, p.q.add(b * gbb + GROUP * PACKED));
        }
        v
    }
}

/// A super-block's minimums (its pair vectors and its factor's bits, as
/// [`GroupRef::min_pairs8`] gives them, at any vector width) as an entry of a buffer of
/// unpacked blocks, after the blocks: the pairs, the factor, then `zero`s.
#[inline(always)]
pub(super) fn min_entry<V: Copy>(pairs: [V; 4], factor: V, zero: V) -> [V; 8] {
    let [p0, p1, p2, p3] = pairs;
    [p0, p1, p2, p3, factor, zero, zero, zero]
}

/// The pairs and factor bits [`min_entry`] stored.
#[inline(always)]
pub(super) fn from_min_entry<V: Copy>(e: &[V; 8]) -> ([V; 4], V) {
    ([e[0], e[1], e[2], e[3]], e[4])
}

/// Per row of a group, the sum over a super-block's blocks of each block's minimum integer
/// ([`GroupRef::min_pairs8`]) times its activation block's sum, from `sums`, the activation
/// row's [`Q8Activations::block_sums`] of the super-block: exact in any order, so every
/// path's integers are equal.
///
/// # Safety
/// `sums` holds 8 values; AVX2 is available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn min_dot8(
    pairs: &[std::arch::x86_64::__m256i; 4],
    sums: *const i16,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let s = |p: usize| _mm256_set1_epi32((sums as *const i32).add(p).read_unaligned());
    let madd = |p: usize| _mm256_madd_epi16(pairs[p], s(p));
    _mm256_add_epi32(
        _mm256_add_epi32(madd(0), madd(1)),
        _mm256_add_epi32(madd(2), madd(3)),
    )
}

/// A run of row groups, one after the other, times every activation row (a decode tile's
/// several groups in one call: per group, the call and its thread-local buffer's borrow
/// were a few percent of a small model's step). `$rows` activation rows share one pass over
/// the group's values, with everything they need in registers (AVX2 has 16 of them, the
/// AVX512VL encodings used by the VNNI path 32). A batch of up to [`UNPACK_MAX_ROWS`] rows
/// unpacks the values again in each pass, except 5-bit values on the path that sets
/// `$buffer_5bit` (AVX2), whose fifth bits make the unpack dear enough that reading a buffer
/// filled once is cheaper; longer batches buffer every type (measurements:
/// measured on the reference machines). Each row's arithmetic is the same whatever `R`, so a
/// row's result does not depend on the batch around it.
macro_rules! group_kernel {
    ($name:ident, $pass:ident, $features:literal, $dot:ident, $half_dots:ident,
     $scaled_dot:ident, $scaled_half_dots:ident, $block_scales:ident, $signed:literal,
     $buffer_5bit:literal, $narrow:literal, $rows:literal, [$($r:literal),*],
     $formats:ident) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name(
            w: &PackedMatrix,
            base: &GroupRef,
            a: &Q8Activations,
            act: std::ops::Range<usize>,
            groups: std::ops::Range<usize>,
            out: &Dest,
        ) {
            let passes = |p: &GroupRef,
                          g: usize,
                          buffered: &[[std::arch::x86_64::__m256i; 8]],
                          chunk: usize| {
                by_format!($formats p, a.super_scales, |T, S| {
                    let valid = GROUP.min(w.n_out - g * GROUP);
                    let mut r0 = act.start;
                    while r0 < act.end {
                        let rows = (act.end - r0).min(chunk);
                        // the first pass over a group of a small batch asks for the next
                        // group's blocks while computing this one's, so the next unpack (or
                        // buffer fill) reads from cache instead of stalling on memory with
                        // no products in flight; a long batch computes long enough per group
                        // for the hardware prefetcher, and the extra loads only cost it
                        let prefetch = r0 == act.start && a.m <= PREFETCH_MAX_ROWS;
                        match (rows, prefetch) {
                            $(($r, true) =>
                                $pass::<$r, true, S, T>(w, p, buffered, a, r0, valid, g, out),
                              ($r, false) =>
                                $pass::<$r, false, S, T>(w, p, buffered, a, r0, valid, g, out),)*
                            _ => unreachable!(),
                        }
                        r0 += rows;
                    }
                })
            };
            let run = |buffered: &mut Vec<[std::arch::x86_64::__m256i; 8]>| {
                // (the same for every group of the matrix)
                let dear_unpack = $buffer_5bit && base.h.is_some();
                let buffer = a.m > $rows && (a.m > UNPACK_MAX_ROWS || dear_unpack);
                let chunk = if buffer { BUFFERED_ROWS } else { $rows };
                for g in groups.clone() {
                    let p = base.at(w, g, $signed);
                    buffered.clear();
                    if buffer {
                        buffered.extend((0..w.nb).map(|b| group_block::<Dyn>(&p, b)));
                        if a.super_scales && Dyn::has_min(&p) {
                            // after the blocks, each super-block's minimums
                            buffered.extend((0..w.nb / SUPER_BLOCKS).map(|sb| {
                                use std::arch::x86_64::*;
                                let (pairs, factor) = p.min_pairs8(sb);
                                let z = _mm256_setzero_si256();
                                min_entry(pairs, _mm256_castps_si256(factor), z)
                            }));
                        }
                    }
                    passes(&p, g, buffered, chunk)
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
        unsafe fn $pass<const R: usize, const PREFETCH: bool, const SUPER: bool, T: Format>(
            w: &PackedMatrix,
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
            // 4-bit values (no fifth bits, not stored as bytes), on a path whose dot
            // products gain from knowing it
            let narrow = $narrow && !T::bytes8(p) && !T::high(p) && !T::six(p);
            let l2 = crate::kernels::prefetch_to_l2();
            let mut acc = [_mm256_setzero_ps(); R];
            // with super-block scales, each row's dots times their scale integers over the
            // super-block ([`BlockScales`])
            let mut isup = [_mm256_setzero_si256(); R];
            // (split types' implied offset, per unit of an activation half's sum)
            let folded_unit = -(w.kind.folded_offset() as i16);
            let min_super = SUPER && T::has_min(p);
            // with super-block scales (K-quants), a super-block's blocks at a time: each row's
            // integer sums over them (its dots times their scale integers, and for types with
            // a minimum its minimums) are scaled by their factors and its activation scale
            // once, after its last block
            let span = if SUPER { SUPER_BLOCKS } else { nb.max(1) };
            for b0 in (0..nb).step_by(span) {
                for b in b0..(b0 + span).min(nb) {
                    if PREFETCH {
                        p.prefetch_next::<T>(nb, b, l2);
                    }
                    let v = match buffered.get(b) {
                        Some(v) => *v,
                        // (5-bit blocks inlined by force, see `group_block_inline`)
                        None if T::high(p) => group_block_inline::<T>(p, b),
                        None => group_block::<T>(p, b),
                    };
                    let x = |i: usize| a.quants.as_ptr().add((r0 + i) * k + b * QK4_1) as *const i32;
                    let at = |i: usize| (r0 + i) * nb + b;
                    if T::halves(p) == 2 {
                        // (split types have implied offsets, folded into the integers)
                        let folded = |i: usize| {
                            let f = a.folded_halves.as_ptr().add(2 * at(i));
                            [*f, *f.add(1)]
                        };
                        if SUPER {
                            let sc = $block_scales(p, b, true, folded_unit);
                            for (i, isup) in isup.iter_mut().enumerate() {
                                let halves = a.half_sums.as_ptr().add(2 * at(i));
                                let d = if R >= 4 {
                                    $scaled_half_dots::<1>(&v, x(i), folded(i), halves, &sc)
                                } else {
                                    $scaled_half_dots::<2>(&v, x(i), folded(i), halves, &sc)
                                };
                                *isup = _mm256_add_epi32(*isup, d);
                            }
                            continue;
                        }
                        let dv = p.d8::<T>(b, 0);
                        let dv1 = p.d8::<T>(b, 1);
                        for (i, acc) in acc.iter_mut().enumerate() {
                            let [lo, hi] = if R >= 4 {
                                $half_dots::<1>(&v, x(i), folded(i))
                            } else {
                                $half_dots::<2>(&v, x(i), folded(i))
                            };
                            let dx = _mm256_set1_ps(*a.scales.get_unchecked(at(i)));
                            let dot_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(lo), dv);
                            let dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), dv1, dot_lo);
                            *acc = _mm256_fmadd_ps(dot, dx, *acc);
                        }
                        continue;
                    }
                    let dv = || p.d8::<T>(b, 0);
                    let dot = |i: usize, folded: i32| {
                        if $signed {
                            block_dot_avx2_signed(&v, x(i))
                        } else if R >= 4 {
                            if narrow {
                                $dot::<1, true>(&v, x(i), folded)
                            } else {
                                $dot::<1, false>(&v, x(i), folded)
                            }
                        } else if R >= 2 {
                            if narrow {
                                $dot::<2, true>(&v, x(i), folded)
                            } else {
                                $dot::<2, false>(&v, x(i), folded)
                            }
                        } else if narrow {
                            $dot::<4, true>(&v, x(i), folded)
                        } else {
                            $dot::<4, false>(&v, x(i), folded)
                        }
                    };
                    match T::has_min(p) {
                        true if SUPER => {
                            // (the factor and the minimums once per super-block, below)
                            let sc = &$block_scales(p, b, false, 0);
                            for (i, isup) in isup.iter_mut().enumerate() {
                                let d = match (R, narrow) {
                                    (4.., true) => $scaled_dot::<1, true>(&v, x(i), sc),
                                    (4.., false) => $scaled_dot::<1, false>(&v, x(i), sc),
                                    (2.., true) => $scaled_dot::<2, true>(&v, x(i), sc),
                                    (2.., false) => $scaled_dot::<2, false>(&v, x(i), sc),
                                    (_, true) => $scaled_dot::<4, true>(&v, x(i), sc),
                                    (_, false) => $scaled_dot::<4, false>(&v, x(i), sc),
                                };
                                *isup = _mm256_add_epi32(*isup, d);
                            }
                        }
                        true => {
                            let (dv, mv) = (dv(), p.m8::<T>(b));
                            for (i, acc) in acc.iter_mut().enumerate() {
                                let dot = _mm256_cvtepi32_ps(dot(i, 0));
                                let dx = _mm256_set1_ps(*a.scales.get_unchecked(at(i)));
                                let sx = _mm256_set1_ps(*a.sums.get_unchecked(at(i)));
                                *acc = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, dx), *acc);
                                *acc = _mm256_fmadd_ps(mv, sx, *acc);
                            }
                        }
                        false => {
                            debug_assert!(!SUPER, "super-block scales: a minimum or halves");
                            let dv = dv();
                            for (i, acc) in acc.iter_mut().enumerate() {
                                let folded = *a.folded.get_unchecked(at(i));
                                let dot = _mm256_cvtepi32_ps(dot(i, folded));
                                let dx = _mm256_set1_ps(*a.scales.get_unchecked(at(i)));
                                *acc = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, dx), *acc);
                            }
                        }
                    }
                }
                if SUPER {
                    // (read here, not copied at the super-block's start: a buffer's entry is
                    // read in place rather than spilled beside the loop's registers)
                    let mins = match (min_super, buffered.get(nb + b0 / SUPER_BLOCKS)) {
                        (false, _) => ([_mm256_setzero_si256(); 4], _mm256_setzero_ps()),
                        (true, Some(e)) => {
                            let (pairs, factor) = from_min_entry(e);
                            (pairs, _mm256_castsi256_ps(factor))
                        }
                        (true, None) => p.min_pairs8(b0 / SUPER_BLOCKS),
                    };
                    let d_base = p.d_base8::<T>(b0);
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let at = (r0 + i) * nb + b0;
                        let dx = _mm256_set1_ps(*a.scales.get_unchecked(at));
                        let scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(isup[i]), d_base);
                        isup[i] = _mm256_setzero_si256();
                        // (the sum of minimums is below 2^24: exact as an f32)
                        let sums = if min_super {
                            let m = min_dot8(&mins.0, a.block_sums.as_ptr().add(at));
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), mins.1, scaled)
                        } else {
                            scaled
                        };
                        *acc = _mm256_fmadd_ps(sums, dx, *acc);
                    }
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                store_group(*acc, out.at(r0 + i, g * GROUP), valid);
            }
        }
    };
}

pub(super) use group_kernel;
