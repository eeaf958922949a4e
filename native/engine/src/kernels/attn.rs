//! Register-blocked f32 micro-kernels for attention: scores `S = Q·Kᵀ` and the weighted sum
//! `O += P·V`. Rows are query heads in f32 scratch; keys are KV slots in row-major [`Rows`]:
//! the cache's own f16, f32 or `q8_0` rows, read in place (widened exactly as they are
//! loaded: `q8_0` as its dequantization), or f32 scratch for `q4_0` caches. The AVX2 path
//! keeps 4×2 score accumulators and 4×16 output columns in registers, so every loaded key or
//! value vector is used by four query rows (by the 1–3 left over in a last, narrower pass: a
//! decode tile of 3 query heads per KV head computes 3 rows, not 4). Each row's arithmetic is
//! its own, so the passes never change a result. On the AVX-512 level the same kernels run
//! 512 bits wide (two keys side by side in a score accumulator, eight keys a pass whose sums
//! are reduced together; 16 columns in an output accumulator; 16 exponentials a vector),
//! each lane adding the same products in the same order: bitwise the AVX2 results
//! (`docs/performance.md` has the alternated timings). [`exp_sum`] and
//! [`max_of`] do the softmax of a score row between the two.

use crate::math::fast_exp;
#[cfg(target_arch = "x86_64")]
use crate::math::FAST_EXP;
use half::f16;

/// Query rows per micro-kernel pass.
pub const ROW_BLOCK: usize = 4;
/// Keys per score micro-kernel call.
pub const KEY_BLOCK: usize = 2;
/// Output columns per weighted-sum micro-kernel call (two 8-lane vectors).
const COL_BLOCK: usize = 16;

#[cfg(target_arch = "x86_64")]
fn simd_ok(hd: usize) -> bool {
    hd.is_multiple_of(COL_BLOCK) && super::has_avx2()
}

/// Whether the 512-bit kernels run: on the AVX-512 level, with AVX-512 DQ (every CPU with
/// VNNI has it).
#[cfg(target_arch = "x86_64")]
fn wide() -> bool {
    use std::sync::OnceLock;
    static DQ: OnceLock<bool> = OnceLock::new();
    super::has_vnni() && *DQ.get_or_init(|| is_x86_feature_detected!("avx512dq"))
}

/// Whether [`scores_avx512`] and [`accumulate_avx512`] run for heads of `hd`: [`wide`], and
/// whole 32-column passes.
#[cfg(target_arch = "x86_64")]
fn wide_ok(hd: usize) -> bool {
    hd.is_multiple_of(WIDE_COL_BLOCK) && wide()
}

/// Output columns per pass of [`accumulate_avx512`] (two 16-lane vectors).
#[cfg(target_arch = "x86_64")]
const WIDE_COL_BLOCK: usize = 32;

/// Keys or values, `[keys, hd]` row-major: the KV cache's own rows or f32 scratch.
#[derive(Clone, Copy)]
pub enum Rows<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    /// llama.cpp's `q8_0` blocks (an f16 scale, then 32 signed bytes), read in place; `hd`
    /// is a multiple of 32, so a block never straddles two rows.
    Q8_0(&'a [u8]),
}

/// Bytes of a `q8_0` block and the values it holds.
const Q8_BLOCK: (usize, usize) = (34, 32);

/// Where the kernels read keys or values from: element `i` of the row-major `[keys, hd]`
/// matrix, widened to f32. Every source widens exactly as the cache's dequantization does
/// (f16 converted, `q8_0` as `d * q` in f32), so the kernels' arithmetic, and their results,
/// are the same whichever the cache stores or whether it was copied to scratch first.
trait Src: Copy {
    /// Elements readable.
    fn len(self) -> usize;
    fn get(self, i: usize) -> f32;
    /// Elements per block sharing one [`Src::factor`] (a block never straddles a row).
    #[cfg(target_arch = "x86_64")]
    const BLOCK: usize = usize::MAX;

    /// What [`Src::load8_in`] needs for the elements of `i`'s block (a quantized block's
    /// scale), taken once per block by the kernels.
    ///
    /// # Safety
    /// As [`Src::load8_in`].
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn factor(self, _i: usize) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_setzero_ps()
    }

    /// Elements `i..i + 8`, widened, given the [`Src::factor`] of `i`'s block.
    ///
    /// # Safety
    /// `i + 8 <= self.len()`, `i` a multiple of 8; the caller runs with AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8_in(
        self,
        i: usize,
        factor: std::arch::x86_64::__m256,
    ) -> std::arch::x86_64::__m256;

    /// Elements `a..a + 8` in the low 8 lanes and `b..b + 8` in the high ones, each widened
    /// as [`Src::load8_in`] does, given their blocks' factors.
    ///
    /// # Safety
    /// As [`Src::load8_in`] for `a` and for `b`; the caller runs with AVX-512 F.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8x2_in(
        self,
        a: usize,
        fa: std::arch::x86_64::__m256,
        b: usize,
        fb: std::arch::x86_64::__m256,
    ) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let (lo, hi) = (self.load8_in(a, fa), self.load8_in(b, fb));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
            _mm256_castps_pd(hi),
        ))
    }

    /// Elements `i..i + 16` of one block, widened as [`Src::load8_in`] does.
    ///
    /// # Safety
    /// As [`Src::load8_in`] for `i` and `i + 8`, both in the block of `factor`; the caller
    /// runs with AVX-512 F.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_in(
        self,
        i: usize,
        factor: std::arch::x86_64::__m256,
    ) -> std::arch::x86_64::__m512 {
        self.load8x2_in(i, factor, i + 8, factor)
    }
}

impl Src for &[f32] {
    fn len(self) -> usize {
        <[f32]>::len(self)
    }

    #[inline(always)]
    fn get(self, i: usize) -> f32 {
        self[i]
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8_in(self, i: usize, _: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(self.as_ptr().add(i))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_in(self, i: usize, _: std::arch::x86_64::__m256) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(self.as_ptr().add(i))
    }
}

impl Src for &[f16] {
    fn len(self) -> usize {
        <[f16]>::len(self)
    }

    #[inline(always)]
    fn get(self, i: usize) -> f32 {
        self[i].to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8_in(self, i: usize, _: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(self.as_ptr().add(i) as *const __m128i))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8x2_in(
        self,
        a: usize,
        _: std::arch::x86_64::__m256,
        b: usize,
        _: std::arch::x86_64::__m256,
    ) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let at = |i: usize| _mm_loadu_si128(self.as_ptr().add(i) as *const __m128i);
        _mm512_cvtph_ps(_mm256_set_m128i(at(b), at(a)))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_in(self, i: usize, _: std::arch::x86_64::__m256) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(self.as_ptr().add(i) as *const __m256i))
    }
}

/// `q8_0` blocks as a [`Src`].
#[derive(Clone, Copy)]
struct Q8Blocks<'a>(&'a [u8]);

impl Q8Blocks<'_> {
    /// The byte offset of element `i`'s block and element `i`'s place in it.
    #[inline(always)]
    fn at(i: usize) -> (usize, usize) {
        (i / Q8_BLOCK.1 * Q8_BLOCK.0, i % Q8_BLOCK.1)
    }

    #[inline(always)]
    fn scale(self, block: usize) -> f32 {
        f16::from_bits(u16::from_le_bytes([self.0[block], self.0[block + 1]])).to_f32()
    }
}

impl Src for Q8Blocks<'_> {
    fn len(self) -> usize {
        self.0.len() / Q8_BLOCK.0 * Q8_BLOCK.1
    }

    #[inline(always)]
    fn get(self, i: usize) -> f32 {
        let (block, j) = Self::at(i);
        self.scale(block) * (self.0[block + 2 + j] as i8) as f32
    }

    #[cfg(target_arch = "x86_64")]
    const BLOCK: usize = Q8_BLOCK.1;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn factor(self, i: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let p = self.0.as_ptr().add(Self::at(i).0);
        let d = i32::from(p.cast::<u16>().read_unaligned());
        _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(d)))
    }

    /// `d * q` per element, in f32: the cache's dequantization (`kv::codec`), bitwise.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8_in(self, i: usize, d: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let (block, j) = Self::at(i);
        let q = _mm_loadl_epi64(self.0.as_ptr().add(block + 2 + j) as *const __m128i);
        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)))
    }
}

/// `s[i * s_stride + j] = q_i · k_j` for `i < rows`, `j < keys`; `q` is `[rows, hd]`, `k` is
/// `[keys, hd]`. `keys` must be a multiple of [`KEY_BLOCK`]; `s` may start anywhere in a
/// score matrix (its last row needs only `keys` entries).
pub fn scores(
    q: &[f32],
    rows: usize,
    k: Rows<'_>,
    keys: usize,
    hd: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    match k {
        Rows::F32(k) => scores_of(q, rows, k, keys, hd, s, s_stride),
        Rows::F16(k) => scores_of(q, rows, k, keys, hd, s, s_stride),
        Rows::Q8_0(k) => scores_of(q, rows, Q8Blocks(k), keys, hd, s, s_stride),
    }
}

fn scores_of<T: Src>(
    q: &[f32],
    rows: usize,
    k: T,
    keys: usize,
    hd: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    assert!(keys.is_multiple_of(KEY_BLOCK) && keys <= s_stride);
    assert!(q.len() >= rows * hd && k.len() >= keys * hd);
    assert!(rows == 0 || s.len() >= (rows - 1) * s_stride + keys);
    #[cfg(target_arch = "x86_64")]
    if simd_ok(hd) {
        // SAFETY: AVX2, FMA and F16C (and AVX-512 F and DQ for the wide kernel) were
        // detected; the asserts above bound every access.
        unsafe {
            if wide_ok(hd) {
                scores_avx512(q, rows, k, keys, hd, s, s_stride)
            } else {
                scores_avx2(q, rows, k, keys, hd, s, s_stride)
            }
        };
        return;
    }
    for i in 0..rows {
        let qi = &q[i * hd..(i + 1) * hd];
        for j in 0..keys {
            s[i * s_stride + j] = if hd.is_multiple_of(COL_BLOCK) {
                lane_dot(qi, k, j * hd)
            } else {
                qi.iter()
                    .enumerate()
                    .map(|(d, a)| a * k.get(j * hd + d))
                    .sum()
            };
        }
    }
}

/// `a · b[at..at + a.len()]` with the AVX2 path's arithmetic: 8 lanes of fused
/// multiply-adds, then its horizontal reduction `((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
/// (l6 + l7))`, so scores are bitwise the same on every path.
fn lane_dot<T: Src>(a: &[f32], b: T, at: usize) -> f32 {
    let mut l = [0f32; 8];
    for (c, ca) in a.chunks_exact(8).enumerate() {
        for i in 0..8 {
            l[i] = ca[i].mul_add(b.get(at + 8 * c + i), l[i]);
        }
    }
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// `o_i += Σ_j p[i * p_stride + j] · v_j` for `i < rows`; `v` is `[keys, hd]`, `o` is
/// `[rows, hd]`. Any `keys` up to `p_stride`; `p` may start anywhere in a probability matrix
/// (its last row needs only `keys` entries).
pub fn accumulate(
    p: &[f32],
    p_stride: usize,
    rows: usize,
    v: Rows<'_>,
    keys: usize,
    hd: usize,
    o: &mut [f32],
) {
    match v {
        Rows::F32(v) => accumulate_of(p, p_stride, rows, v, keys, hd, o),
        Rows::F16(v) => accumulate_of(p, p_stride, rows, v, keys, hd, o),
        Rows::Q8_0(v) => accumulate_of(p, p_stride, rows, Q8Blocks(v), keys, hd, o),
    }
}

fn accumulate_of<T: Src>(
    p: &[f32],
    p_stride: usize,
    rows: usize,
    v: T,
    keys: usize,
    hd: usize,
    o: &mut [f32],
) {
    assert!(keys <= p_stride);
    assert!(v.len() >= keys * hd && o.len() >= rows * hd);
    assert!(rows == 0 || p.len() >= (rows - 1) * p_stride + keys);
    #[cfg(target_arch = "x86_64")]
    if simd_ok(hd) {
        // SAFETY: AVX2, FMA and F16C (and AVX-512 F for the wide kernel) were detected; the
        // asserts above bound every access.
        unsafe {
            if wide_ok(hd) {
                accumulate_avx512(p, p_stride, rows, v, keys, hd, o)
            } else {
                accumulate_avx2(p, p_stride, rows, v, keys, hd, o)
            }
        };
        return;
    }
    for i in 0..rows {
        let oi = &mut o[i * hd..(i + 1) * hd];
        for j in 0..keys {
            let w = p[i * p_stride + j];
            for (d, x) in oi.iter_mut().enumerate() {
                // fused, like the AVX2 path
                *x = w.mul_add(v.get(j * hd + d), *x);
            }
        }
    }
}

/// The largest of `xs` (`-inf` when empty; NaNs are skipped, as `f32::max` does). The order
/// of comparisons does not change a maximum, so every path gives the same value.
pub fn max_of(xs: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2() {
        // SAFETY: AVX2 was detected; the function reads only within `xs`.
        return unsafe { max_of_avx2(xs) };
    }
    xs.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// Replaces every `x` of `xs` with `fast_exp(x - m)` and returns their sum: the softmax
/// numerators of one score row. The sum is taken in 8 lanes (lane `j` adds elements `j`,
/// `j + 8`, ... in order) reduced as in [`lane_dot`], so the SIMD and scalar paths give
/// bitwise the same probabilities and sum. (A plain running sum was a serial chain of
/// dependent adds: 80% of the time of attention outside its matrix products.)
pub fn exp_sum(xs: &mut [f32], m: f32) -> f32 {
    let mut lanes = [0f32; 8];
    #[cfg(target_arch = "x86_64")]
    let simd = if wide() {
        // SAFETY: AVX-512 F was detected; the function touches only `xs`.
        unsafe { exp_sum_avx512(xs, m, &mut lanes) };
        true
    } else if super::has_avx2() {
        // SAFETY: AVX2 and FMA were detected; the function touches only `xs`.
        unsafe { exp_sum_avx2(xs, m, &mut lanes) };
        true
    } else {
        false
    };
    #[cfg(not(target_arch = "x86_64"))]
    let simd = false;
    if !simd {
        for (i, x) in xs.iter_mut().enumerate() {
            *x = fast_exp(*x - m);
            lanes[i % 8] += *x;
        }
    }
    ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn max_of_avx2(xs: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut acc = neg_inf;
    let chunks = xs.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        // `max_ps` returns its second operand when the first is NaN: NaNs are skipped
        acc = _mm256_max_ps(_mm256_loadu_ps(c.as_ptr()), acc);
    }
    if !tail.is_empty() {
        // the last 1-7 in one masked load, the lanes past the end -inf
        let mask = tail_mask(tail.len());
        let x = _mm256_maskload_ps(tail.as_ptr(), mask);
        acc = _mm256_max_ps(_mm256_blendv_ps(neg_inf, x, _mm256_castsi256_ps(mask)), acc);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    lanes.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// Lanes `0..n` set (all bits) and the rest clear, for the masked loads and stores of a
/// last chunk of `n` < 8 elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn tail_mask(n: usize) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lane)
}

/// [`exp_sum`] on AVX2: exponentials written back, sums into `lanes`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sum_avx2(xs: &mut [f32], m: f32, lanes: &mut [f32; 8]) {
    use std::arch::x86_64::*;
    let n = xs.len() / 8 * 8;
    let mv = _mm256_set1_ps(m);
    let mut acc = _mm256_setzero_ps();
    for i in (0..n).step_by(8) {
        let at = xs.as_mut_ptr().add(i);
        let e = fast_exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(at), mv));
        _mm256_storeu_ps(at, e);
        acc = _mm256_add_ps(acc, e);
    }
    acc = exp_tail_avx2(xs, n, mv, acc);
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
}

/// The last `xs.len() - n` (< 8) elements of [`exp_sum`] in one masked pass, from `n`: their
/// exponentials written back and added to their lanes of `acc`, +0 to the other lanes (lane
/// sums are never -0, so adding +0 changes none): the sums of the scalar definition. (A
/// decode row's last chunk holds a few slots: their scalar exponentials were ~6% of an
/// 8-stream decode's attention with its K/V in cache, `LAYERS=1 attention_profile`.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp_tail_avx2(
    xs: &mut [f32],
    n: usize,
    mv: std::arch::x86_64::__m256,
    acc: std::arch::x86_64::__m256,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    if n == xs.len() {
        return acc;
    }
    let mask = tail_mask(xs.len() - n);
    let at = xs.as_mut_ptr().add(n);
    let e = fast_exp_avx2(_mm256_sub_ps(_mm256_maskload_ps(at, mask), mv));
    _mm256_maskstore_ps(at, mask, e);
    _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_castsi256_ps(mask)))
}

/// [`exp_sum_avx2`] 16 elements a pass: the exponentials in 512-bit vectors (the same
/// operations on every lane), each pass's two halves added to the 8 lane sums one after the
/// other, the order [`exp_sum`] defines. Then the last whole 8, if any, and the rest as the
/// AVX2 path.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512dq")]
unsafe fn exp_sum_avx512(xs: &mut [f32], m: f32, lanes: &mut [f32; 8]) {
    use std::arch::x86_64::*;
    let n16 = xs.len() / 16 * 16;
    let mv = _mm512_set1_ps(m);
    let mut acc = _mm256_setzero_ps();
    for i in (0..n16).step_by(16) {
        let at = xs.as_mut_ptr().add(i);
        let e = fast_exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(at), mv));
        _mm512_storeu_ps(at, e);
        acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
        acc = _mm256_add_ps(acc, _mm512_extractf32x8_ps::<1>(e));
    }
    let mv = _mm256_set1_ps(m);
    if xs.len() - n16 >= 8 {
        let at = xs.as_mut_ptr().add(n16);
        let e = fast_exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(at), mv));
        _mm256_storeu_ps(at, e);
        acc = _mm256_add_ps(acc, e);
    }
    acc = exp_tail_avx2(xs, xs.len() / 8 * 8, mv, acc);
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
}

/// [`fast_exp_avx2`] on 16 lanes: the same operations in the same order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn fast_exp_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    use FAST_EXP as C;
    let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(C.lo)), _mm512_set1_ps(C.hi));
    let round = _mm512_set1_ps(C.round);
    let k = _mm512_sub_ps(
        _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(C.log2e)), round),
        round,
    );
    let r = _mm512_sub_ps(
        _mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(C.ln2_hi))),
        _mm512_mul_ps(k, _mm512_set1_ps(C.ln2_lo)),
    );
    let mut p = _mm512_set1_ps(C.poly[0]);
    for &c in &C.poly[1..] {
        p = _mm512_add_ps(_mm512_set1_ps(c), _mm512_mul_ps(r, p));
    }
    let k = _mm512_slli_epi32::<23>(_mm512_cvttps_epi32(k));
    _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), k))
}

/// [`fast_exp`] on 8 lanes with the same operations in the same order (separate multiplies
/// and adds, no fused ones), so every lane is bitwise the scalar result.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn fast_exp_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    use FAST_EXP as C;
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(C.lo)), _mm256_set1_ps(C.hi));
    let round = _mm256_set1_ps(C.round);
    let k = _mm256_sub_ps(
        _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(C.log2e)), round),
        round,
    );
    let r = _mm256_sub_ps(
        _mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(C.ln2_hi))),
        _mm256_mul_ps(k, _mm256_set1_ps(C.ln2_lo)),
    );
    let mut p = _mm256_set1_ps(C.poly[0]);
    for &c in &C.poly[1..] {
        p = _mm256_add_ps(_mm256_set1_ps(c), _mm256_mul_ps(r, p));
    }
    let k = _mm256_slli_epi32(_mm256_cvttps_epi32(k), 23);
    _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), k))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_avx2<T: Src>(
    q: &[f32],
    rows: usize,
    k: T,
    keys: usize,
    hd: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    with_head_dim!(hd, H, {
        row_passes!(rows, |r0, R| scores_rows_avx2::<T, R, H>(
            q, r0, k, keys, hd, s, s_stride
        ))
    });
}

/// Runs `$call` for every pass over `$rows` rows: `$r0` its first row, `$r` (a constant) its
/// rows, `ROW_BLOCK` or the fewer left in the last pass (so a tile of 3 query heads per KV
/// head computes 3 rows, not 4).
#[cfg(target_arch = "x86_64")]
macro_rules! row_passes {
    ($rows:expr, |$r0:ident, $r:ident| $call:expr) => {{
        let mut $r0 = 0;
        while $r0 < $rows {
            let done = row_passes!(@ $rows - $r0, $r, $call, [1, 2, 3]);
            $r0 += done;
        }
    }};
    (@ $left:expr, $r:ident, $call:expr, [$($n:literal),*]) => {
        match $left {
            $($n => {
                const $r: usize = $n;
                $call;
                $n
            })*
            _ => {
                const $r: usize = ROW_BLOCK;
                $call;
                ROW_BLOCK
            }
        }
    };
}
#[cfg(target_arch = "x86_64")]
use row_passes;

/// Runs `$body` with `$h` a constant: the head dimension when it is one of the common ones
/// (64, 128, 256), so the kernels' loops over it unroll and keep no counters, or 0 (the
/// kernels then read the run-time `hd`).
#[cfg(target_arch = "x86_64")]
macro_rules! with_head_dim {
    ($hd:expr, $h:ident, $body:block) => {
        match $hd {
            64 => {
                const $h: usize = 64;
                $body
            }
            128 => {
                const $h: usize = 128;
                $body
            }
            256 => {
                const $h: usize = 256;
                $body
            }
            _ => {
                const $h: usize = 0;
                $body
            }
        }
    };
}
#[cfg(target_arch = "x86_64")]
use with_head_dim;

/// Scores of rows `r0..r0 + R` (`R ≤ ROW_BLOCK`) against every key.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_rows_avx2<T: Src, const R: usize, const H: usize>(
    q: &[f32],
    r0: usize,
    k: T,
    keys: usize,
    hd: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    use std::arch::x86_64::*;
    let hd = if H > 0 { H } else { hd };
    let (qp, sp) = (q.as_ptr(), s.as_mut_ptr());
    for j0 in (0..keys).step_by(KEY_BLOCK) {
        // (the queries' loads stay in this loop: hoisted out of it, the rows' vectors for
        // every `d` spilled to the stack at each call and were read back from there)
        let qp = std::hint::black_box(qp);
        let mut acc = [[_mm256_setzero_ps(); KEY_BLOCK]; R];
        let mut f = [_mm256_setzero_ps(); KEY_BLOCK];
        let mut d = 0;
        while d < hd {
            let at = [j0 * hd + d, (j0 + 1) * hd + d];
            if d % T::BLOCK == 0 {
                f = [k.factor(at[0]), k.factor(at[1])];
            }
            let kv = [k.load8_in(at[0], f[0]), k.load8_in(at[1], f[1])];
            for (i, row) in acc.iter_mut().enumerate() {
                let qv = _mm256_loadu_ps(qp.add((r0 + i) * hd + d));
                row[0] = _mm256_fmadd_ps(qv, kv[0], row[0]);
                row[1] = _mm256_fmadd_ps(qv, kv[1], row[1]);
            }
            d += 8;
        }
        for pair in 0..R.div_ceil(2) {
            let a = acc[2 * pair];
            let b = acc.get(2 * pair + 1).copied().unwrap_or(a);
            // [a0 a1 b0 b1]: four horizontal sums at once
            let h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(b[0], b[1]));
            let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            let mut out = [0f32; 4];
            _mm_storeu_ps(out.as_mut_ptr(), sums);
            for (half, row) in (2 * pair..(2 * pair + 2).min(R)).enumerate() {
                let at = sp.add((r0 + row) * s_stride + j0);
                *at = out[2 * half];
                *at.add(1) = out[2 * half + 1];
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate_avx2<T: Src>(
    p: &[f32],
    p_stride: usize,
    rows: usize,
    v: T,
    keys: usize,
    hd: usize,
    o: &mut [f32],
) {
    with_head_dim!(hd, H, {
        row_passes!(rows, |r0, R| accumulate_rows_avx2::<T, R, H>(
            p, p_stride, r0, v, keys, hd, o
        ))
    });
}

/// The weighted sums of rows `r0..r0 + R` (`R ≤ ROW_BLOCK`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate_rows_avx2<T: Src, const R: usize, const H: usize>(
    p: &[f32],
    p_stride: usize,
    r0: usize,
    v: T,
    keys: usize,
    hd: usize,
    o: &mut [f32],
) {
    use std::arch::x86_64::*;
    let hd = if H > 0 { H } else { hd };
    let (pp, op) = (p.as_ptr(), o.as_mut_ptr());
    for c in (0..hd).step_by(COL_BLOCK) {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for (i, row) in acc.iter_mut().enumerate() {
            let at = op.add((r0 + i) * hd + c);
            *row = [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))];
        }
        for j in 0..keys {
            // (both halves in one block: `COL_BLOCK` divides a quantized block)
            let f = v.factor(j * hd + c);
            let v0 = v.load8_in(j * hd + c, f);
            let v1 = v.load8_in(j * hd + c + 8, f);
            for (i, row) in acc.iter_mut().enumerate() {
                let w = _mm256_broadcast_ss(&*pp.add((r0 + i) * p_stride + j));
                row[0] = _mm256_fmadd_ps(w, v0, row[0]);
                row[1] = _mm256_fmadd_ps(w, v1, row[1]);
            }
        }
        for (i, row) in acc.iter().enumerate() {
            let at = op.add((r0 + i) * hd + c);
            _mm256_storeu_ps(at, row[0]);
            _mm256_storeu_ps(at.add(8), row[1]);
        }
    }
}

/// [`scores_avx2`] in 512-bit vectors: each of a row's accumulators holds two keys side by
/// side (lanes 0–7 the first key's, 8–15 the second's), so every lane adds the same
/// products in the same order as the AVX2 kernel's, and the horizontal sums are the same
/// operations: bitwise its scores, with half the multiply-add instructions.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
unsafe fn scores_avx512<T: Src>(
    q: &[f32],
    rows: usize,
    k: T,
    keys: usize,
    hd: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    with_head_dim!(hd, H, {
        row_passes!(rows, |r0, R| scores_rows_avx512::<T, R, H>(
            q, r0, k, keys, hd, s, s_stride
        ))
    });
}

/// Scores of rows `r0..r0 + R` (`R ≤ ROW_BLOCK`) against every key, 512 bits wide: eight
/// keys a pass where they are (four times the independent chains of multiply-adds of a
/// two-key pass; each lane's chain is the head dim over 8 long, its order fixed by the AVX2
/// kernel's), then a pass of four and one of two for the rest.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
unsafe fn scores_rows_avx512<T: Src, const R: usize, const H: usize>(
    q: &[f32],
    r0: usize,
    k: T,
    keys: usize,
    hd: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    let mut j0 = 0;
    while j0 + 8 <= keys {
        scores_pass_avx512::<T, R, H, 4>(q, r0, k, j0, hd, s, s_stride);
        j0 += 8;
    }
    if j0 + 4 <= keys {
        scores_pass_avx512::<T, R, H, 2>(q, r0, k, j0, hd, s, s_stride);
        j0 += 4;
    }
    if j0 < keys {
        scores_pass_avx512::<T, R, H, 1>(q, r0, k, j0, hd, s, s_stride);
    }
}

/// Scores of rows `r0..r0 + R` against keys `j0..j0 + 2P` (`P` ≤ 4 accumulators a row, two
/// keys each), their sums reduced together ([`reduce8`]). Not inlined: in the loop over keys
/// the queries' broadcasts, the same for every pass, were hoisted out of it and spilled to
/// the stack at every call (a prompt's attention 7–8% slower).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
#[inline(never)]
unsafe fn scores_pass_avx512<T: Src, const R: usize, const H: usize, const P: usize>(
    q: &[f32],
    r0: usize,
    k: T,
    j0: usize,
    hd: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    use std::arch::x86_64::*;
    let hd = if H > 0 { H } else { hd };
    let (qp, sp) = (q.as_ptr(), s.as_mut_ptr());
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    let mut f = [[_mm256_setzero_ps(); 2]; P];
    let mut d = 0;
    while d < hd {
        let at = |p: usize, h: usize| (j0 + 2 * p + h) * hd + d;
        if d % T::BLOCK == 0 {
            f = std::array::from_fn(|p| [k.factor(at(p, 0)), k.factor(at(p, 1))]);
        }
        let kv: [__m512; P] =
            std::array::from_fn(|p| k.load8x2_in(at(p, 0), f[p][0], at(p, 1), f[p][1]));
        for (i, row) in acc.iter_mut().enumerate() {
            let qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(qp.add((r0 + i) * hd + d)));
            for (a, kv) in row.iter_mut().zip(kv) {
                *a = _mm512_fmadd_ps(qv, kv, *a);
            }
        }
        d += 8;
    }
    for (i, row) in acc.iter().enumerate() {
        // (missing accumulators as zeros: their sums are never stored)
        let sums = reduce8(std::array::from_fn(|p| {
            row.get(p).copied().unwrap_or(_mm512_setzero_ps())
        }));
        let at = sp.add((r0 + i) * s_stride + j0);
        if P == 4 {
            _mm256_storeu_ps(at, sums);
        } else {
            let mut out = [0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), sums);
            std::ptr::copy_nonoverlapping(out.as_ptr(), at, 2 * P);
        }
    }
}

/// The scores of eight keys from a row's accumulators (`z[p]`: keys `2p` and `2p + 1`,
/// 8 lanes each), each `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))` of its lanes as
/// the AVX2 kernel's horizontal sums add them, in key order: in-lane shuffles pair the
/// lanes for all eight keys at once (each `hadd` of the AVX2 kernel adds the same pairs).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f")]
#[inline]
unsafe fn reduce8(z: [std::arch::x86_64::__m512; 4]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    const EVEN: i32 = 0b10_00_10_00;
    const ODD: i32 = 0b11_01_11_01;
    // per 128-bit quarter [a0 a1 a2 a3] of two inputs x, y: [x0+x1, x2+x3, y0+y1, y2+y3]
    let pairs = |x: __m512, y: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_ps::<EVEN>(x, y),
            _mm512_shuffle_ps::<ODD>(x, y),
        )
    };
    // quarters (k0 lo, k0 hi, k1 lo, k1 hi) of z[0] with those of z[1] beside them, ...
    let (p01, p23) = (pairs(z[0], z[1]), pairs(z[2], z[3]));
    // quarter q: [key 0, 2, 4, 6] (q = 0, 1: their lanes 0-3, 4-7) or [1, 3, 5, 7] (q = 2, 3),
    // each the sum of those four lanes
    let quads = pairs(p01, p23);
    // lanes 0-3 plus lanes 4-7: keys 0, 2, 4, 6, 1, 3, 5, 7
    let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(quads, quads);
    let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(quads, quads);
    let sums = _mm512_castps512_ps256(_mm512_add_ps(lo, hi));
    _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// [`accumulate_avx2`] in 512-bit vectors, [`WIDE_COL_BLOCK`] columns a pass: each output
/// element adds the same products in the same order, so the results are bitwise the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn accumulate_avx512<T: Src>(
    p: &[f32],
    p_stride: usize,
    rows: usize,
    v: T,
    keys: usize,
    hd: usize,
    o: &mut [f32],
) {
    with_head_dim!(hd, H, {
        row_passes!(rows, |r0, R| accumulate_rows_avx512::<T, R, H>(
            p, p_stride, r0, v, keys, hd, o
        ))
    });
}

/// The weighted sums of rows `r0..r0 + R` (`R ≤ ROW_BLOCK`), 512 bits wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn accumulate_rows_avx512<T: Src, const R: usize, const H: usize>(
    p: &[f32],
    p_stride: usize,
    r0: usize,
    v: T,
    keys: usize,
    hd: usize,
    o: &mut [f32],
) {
    use std::arch::x86_64::*;
    let hd = if H > 0 { H } else { hd };
    let (pp, op) = (p.as_ptr(), o.as_mut_ptr());
    for c in (0..hd).step_by(WIDE_COL_BLOCK) {
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        for (i, row) in acc.iter_mut().enumerate() {
            let at = op.add((r0 + i) * hd + c);
            *row = [_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(16))];
        }
        for j in 0..keys {
            // (one block: `WIDE_COL_BLOCK` divides a quantized block and the head dim)
            let f = v.factor(j * hd + c);
            let v0 = v.load16_in(j * hd + c, f);
            let v1 = v.load16_in(j * hd + c + 16, f);
            for (i, row) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*pp.add((r0 + i) * p_stride + j));
                row[0] = _mm512_fmadd_ps(w, v0, row[0]);
                row[1] = _mm512_fmadd_ps(w, v1, row[1]);
            }
        }
        for (i, row) in acc.iter().enumerate() {
            let at = op.add((r0 + i) * hd + c);
            _mm512_storeu_ps(at, row[0]);
            _mm512_storeu_ps(at.add(16), row[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::lcg;

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn scalar_and_avx2_paths_are_bitwise_equal() {
        if !crate::kernels::has_avx2() {
            return;
        }
        let mut seed = 9u64;
        // full passes of 4 rows and the narrower last ones; head dims the kernels unroll
        // (64, 128, 256) and one they loop over
        for (rows, hd) in [
            (8, 64),
            (7, 64),
            (6, 128),
            (5, 96),
            (3, 64),
            (3, 128),
            (3, 96),
            (4, 256),
        ] {
            // (the 512-bit scores take 8 keys a pass, then 4, then 2)
            let (keys, stride) = (14, 16);
            let q: Vec<f32> = (0..rows * hd).map(|_| lcg(&mut seed)).collect();
            let k: Vec<f32> = (0..keys * hd).map(|_| lcg(&mut seed)).collect();
            let (mut s1, mut s2) = (vec![0f32; rows * stride], vec![0f32; rows * stride]);
            // SAFETY: AVX2 and FMA were detected; the buffers hold every index touched.
            unsafe { scores_avx2(&q, rows, &k[..], keys, hd, &mut s1, stride) };
            for i in 0..rows {
                for j in 0..keys {
                    s2[i * stride + j] = lane_dot(&q[i * hd..(i + 1) * hd], &k[..], j * hd);
                }
            }
            assert_eq!(s1, s2, "scores, {rows} rows of {hd}");
            let (mut o1, mut o2) = (vec![0.25f32; rows * hd], vec![0.25f32; rows * hd]);
            // SAFETY: as above.
            unsafe { accumulate_avx2(&s1, stride, rows, &k[..], keys, hd, &mut o1) };
            for i in 0..rows {
                for j in 0..keys {
                    let w = s1[i * stride + j];
                    for d in 0..hd {
                        o2[i * hd + d] = w.mul_add(k[j * hd + d], o2[i * hd + d]);
                    }
                }
            }
            assert_eq!(o1, o2, "weighted sums, {rows} rows of {hd}");
            if wide_ok(hd) {
                let mut s3 = vec![0f32; rows * stride];
                let mut o3 = vec![0.25f32; rows * hd];
                // SAFETY: AVX-512 F and DQ were detected; the buffers hold every index touched.
                unsafe {
                    scores_avx512(&q, rows, &k[..], keys, hd, &mut s3, stride);
                    accumulate_avx512(&s1, stride, rows, &k[..], keys, hd, &mut o3);
                }
                assert_eq!(s3, s1, "512-bit scores, {rows} rows of {hd}");
                assert_eq!(o3, o1, "512-bit weighted sums, {rows} rows of {hd}");
            }
        }
    }

    /// `exp_sum` and `max_of` on the machine's path against the scalar definitions, bitwise,
    /// for lengths around the 8-lane chunks; and `fast_exp_avx2` against `fast_exp` over the
    /// whole clamped range and beyond.
    #[test]
    fn softmax_helpers_are_bitwise_the_scalar_definitions() {
        let mut seed = 3u64;
        for n in [0usize, 1, 7, 8, 9, 16, 24, 31, 64, 100] {
            let xs: Vec<f32> = (0..n).map(|_| 20.0 * lcg(&mut seed)).collect();
            let max = xs.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            assert_eq!(max_of(&xs).to_bits(), max.to_bits(), "max n={n}");
            let mut want = xs.clone();
            let mut lanes = [0f32; 8];
            for (i, x) in want.iter_mut().enumerate() {
                *x = fast_exp(*x - max);
                lanes[i % 8] += *x;
            }
            let sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
                + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
            let mut got = xs.clone();
            assert_eq!(exp_sum(&mut got, max).to_bits(), sum.to_bits(), "sum n={n}");
            assert_eq!(got, want, "exps n={n}");
        }
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::has_avx2() {
            use std::arch::x86_64::*;
            let xs: Vec<f32> = (0..8 * 4000)
                .map(|i| -120.0 + i as f32 * (230.0 / 32000.0))
                .chain([0.0, -0.0, 1e-30, -1e-30, f32::MIN, f32::MAX])
                .collect();
            for c in xs.chunks(8) {
                let mut x = [0f32; 8];
                x[..c.len()].copy_from_slice(c);
                let mut e = [0f32; 8];
                // SAFETY: AVX2 was detected; both arrays hold 8 floats.
                unsafe {
                    _mm256_storeu_ps(e.as_mut_ptr(), fast_exp_avx2(_mm256_loadu_ps(x.as_ptr())))
                };
                for (a, b) in x.iter().zip(e) {
                    assert_eq!(fast_exp(*a).to_bits(), b.to_bits(), "exp({a})");
                }
            }
            if wide() {
                for c in xs.chunks(16) {
                    let mut x = [0f32; 16];
                    x[..c.len()].copy_from_slice(c);
                    let mut e = [0f32; 16];
                    // SAFETY: AVX-512 F was detected; both arrays hold 16 floats.
                    unsafe {
                        _mm512_storeu_ps(
                            e.as_mut_ptr(),
                            fast_exp_avx512(_mm512_loadu_ps(x.as_ptr())),
                        )
                    };
                    for (a, b) in x.iter().zip(e) {
                        assert_eq!(fast_exp(*a).to_bits(), b.to_bits(), "512-bit exp({a})");
                    }
                }
            }
        }
    }

    #[test]
    fn micro_kernels_match_plain_loops() {
        let mut seed = 7u64;
        for &hd in &[16usize, 64, 256, 24] {
            let (rows, keys, stride) = (8, 6, 10);
            let q: Vec<f32> = (0..rows * hd).map(|_| lcg(&mut seed)).collect();
            let k: Vec<f32> = (0..keys * hd).map(|_| lcg(&mut seed)).collect();
            let mut s = vec![0f32; rows * stride];
            scores(&q, rows, Rows::F32(&k), keys, hd, &mut s, stride);
            let mut o = vec![0.5f32; rows * hd];
            accumulate(&s, stride, rows, Rows::F32(&k), keys, hd, &mut o);
            for i in 0..rows {
                for j in 0..keys {
                    let want: f32 = (0..hd).map(|d| q[i * hd + d] * k[j * hd + d]).sum();
                    assert!(
                        (s[i * stride + j] - want).abs() < 1e-4,
                        "hd {hd} s[{i},{j}]"
                    );
                }
                for d in 0..hd {
                    let want: f32 = 0.5
                        + (0..keys)
                            .map(|j| s[i * stride + j] * k[j * hd + d])
                            .sum::<f32>();
                    assert!((o[i * hd + d] - want).abs() < 1e-3, "hd {hd} o[{i},{d}]");
                }
            }
        }
    }

    /// The cache's f16 rows read in place give bitwise the results of their f32 widening,
    /// on the machine's path and the scalar one, also for a score or probability matrix
    /// entered at a column offset (as attention does block by block).
    #[test]
    fn f16_rows_in_place_equal_their_f32_widening() {
        let mut seed = 11u64;
        for &hd in &[64usize, 256, 24] {
            let (rows, keys, stride, col) = (8, 14, 20, 5);
            let q: Vec<f32> = (0..rows * hd).map(|_| lcg(&mut seed)).collect();
            let kh: Vec<f16> = (0..keys * hd)
                .map(|_| f16::from_f32(4.0 * lcg(&mut seed)))
                .collect();
            let kf: Vec<f32> = kh.iter().map(|x| x.to_f32()).collect();
            let (mut s1, mut s2) = (vec![0f32; rows * stride], vec![0f32; rows * stride]);
            scores(&q, rows, Rows::F16(&kh), keys, hd, &mut s1[col..], stride);
            scores(&q, rows, Rows::F32(&kf), keys, hd, &mut s2[col..], stride);
            assert_eq!(s1, s2, "scores hd {hd}");
            let mut s3 = vec![0f32; rows * stride];
            for i in 0..rows {
                for j in 0..keys {
                    s3[col + i * stride + j] = lane_dot(&q[i * hd..(i + 1) * hd], &kh[..], j * hd);
                }
            }
            if hd % 16 == 0 {
                assert_eq!(s1, s3, "scalar scores hd {hd}");
            }
            let (mut o1, mut o2) = (vec![0.5f32; rows * hd], vec![0.5f32; rows * hd]);
            accumulate(
                &s1[col..],
                stride,
                rows,
                Rows::F16(&kh),
                keys - 1,
                hd,
                &mut o1,
            );
            accumulate(
                &s1[col..],
                stride,
                rows,
                Rows::F32(&kf),
                keys - 1,
                hd,
                &mut o2,
            );
            assert_eq!(o1, o2, "accumulate hd {hd}");
            let mut o3 = vec![0.5f32; rows * hd];
            for i in 0..rows {
                for j in 0..keys - 1 {
                    let w = s1[col + i * stride + j];
                    for d in 0..hd {
                        o3[i * hd + d] = w.mul_add(kf[j * hd + d], o3[i * hd + d]);
                    }
                }
            }
            assert_eq!(o1, o3, "scalar accumulate hd {hd}");
        }
    }
}
