//! The AVX2 + FMA products: `vpmaddubsw` dot products of a block with an activation block
//! (16-bit pair sums widened by `vpmaddwd`), and the one-group kernels built from them.

use super::x86::*;
use super::*;
use crate::kernels::q8::Q8Activations;

/// Per lane (row), the dot product of its 32 values with one activation block (`C`, the
/// number of independent accumulation chains, only matters to VNNI). `NARROW`: the values
/// are 4-bit (at most 15), so all 8 quads' `maddubs` pairs (each within ±2·15·127) sum in 16
/// bits without overflow and one `madd` widens them, instead of two for 5-bit values (at
/// most 31: four quads per 16-bit sum). The AVX2 products are bound by the vector pipes
/// that `maddubs`, `madd` and the float multiply-adds share (`examples/simd_ports.rs`), so
/// each one saved counts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn block_dot_avx2<const C: usize, const NARROW: bool>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    folded: i32,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let dot = quad_sums::<NARROW>(v, x, _mm256_set1_epi16(1));
    _mm256_add_epi32(dot, _mm256_set1_epi32(folded))
}

/// Per lane, the 8 quads' `vpmaddubsw` pairs summed in 16 bits (for `NARROW` all eight,
/// else two sums of four) and widened by a `vpmaddwd` with `by` (ones, or the lane's scale
/// integer in both halves): the dot product times `by`, in integers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn quad_sums<const NARROW: bool>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    by: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let p = |q: usize| _mm256_maddubs_epi16(v[q], _mm256_set1_epi32(*x.add(q)));
    let lo = _mm256_add_epi16(_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3)));
    let hi = _mm256_add_epi16(_mm256_add_epi16(p(4), p(5)), _mm256_add_epi16(p(6), p(7)));
    if NARROW {
        _mm256_madd_epi16(_mm256_add_epi16(lo, hi), by)
    } else {
        _mm256_add_epi32(_mm256_madd_epi16(lo, by), _mm256_madd_epi16(hi, by))
    }
}

/// Per lane, the dot product of quads `q..q + 4` (half a block; values at most 63, so a sum
/// of two `maddubs` pairs stays below 2¹⁵) times `by`, as [`quad_sums`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn half_sums(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    q: usize,
    by: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let p = |q: usize| _mm256_maddubs_epi16(v[q], _mm256_set1_epi32(*x.add(q)));
    let a = _mm256_madd_epi16(_mm256_add_epi16(p(q), p(q + 1)), by);
    let b = _mm256_madd_epi16(_mm256_add_epi16(p(q + 2), p(q + 3)), by);
    _mm256_add_epi32(a, b)
}

/// Block `b`'s [`BlockScales`] on AVX2 (`split`: a type with a scale per half, whose
/// implied offset folds `folded` per unit of an activation half's sum).
///
/// # Safety
/// As [`GroupRef::scale_pairs8`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn block_scales_avx2(
    p: &GroupRef,
    b: usize,
    split: bool,
    folded: i16,
) -> BlockScales {
    if split {
        BlockScales {
            s: [p.scale_pairs8(2 * b), p.scale_pairs8(2 * b + 1)],
            off: p.offset_pairs8(b, folded),
        }
    } else {
        let s = p.scale_pairs8(b);
        BlockScales {
            s: [s, s],
            off: std::arch::x86_64::_mm256_setzero_si256(),
        }
    }
}

/// [`block_dot_avx2`] (without a folded offset) times each lane's (row's) block scale
/// integer ([`BlockScales`]), in integers: the `vpmaddwd` that widens the 16-bit sums
/// multiplies by it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn block_dot_scaled_avx2<const C: usize, const NARROW: bool>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    scales: &BlockScales,
) -> std::arch::x86_64::__m256i {
    quad_sums::<NARROW>(v, x, scales.s[0])
}

/// Per lane (row), [`half_dots_avx2`]'s two dot products times their half scale integers
/// and summed, in integers, the folded offsets added as the activations' half sums
/// (`halves`, [`Q8Activations::half_sums`]) times [`BlockScales::off`] (the same integer as
/// `(dot + folded)·scale` per half; `folded` is for the VNNI form).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn half_dots_scaled_avx2<const C: usize>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    folded: [i32; 2],
    halves: *const i16,
    scales: &BlockScales,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let _ = folded;
    let sums = _mm256_set1_epi32((halves as *const i32).read_unaligned());
    let off = _mm256_madd_epi16(scales.off, sums);
    let dots = _mm256_add_epi32(
        half_sums(v, x, 0, scales.s[0]),
        half_sums(v, x, 4, scales.s[1]),
    );
    _mm256_add_epi32(dots, off)
}

/// Per lane (row), the dot product of a block of Q8_0 values flipped back from `q + 128` to
/// signed `q` (see [`GroupRef::signed`]) with one activation block: `maddubs(|q|, sign(q)·x)`
/// (the sign goes to the activation, whose range excludes -128), whose pairs stay within
/// ±2·128·127, widened to 32 bits per quad: exactly the integer the VNNI path gets from the
/// biased values and the folded offset.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn block_dot_avx2_signed(
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

/// Per lane (row), the dot products of values 0..16 and 16..32 with one activation block, plus
/// their folded offsets (types whose halves have their own scale; values at most 63, so a sum
/// of two `maddubs` pairs stays below 2¹⁵).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn half_dots_avx2<const C: usize>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    folded: [i32; 2],
) -> [std::arch::x86_64::__m256i; 2] {
    use std::arch::x86_64::*;
    let ones = _mm256_set1_epi16(1);
    let half = |q: usize, folded: i32| {
        _mm256_add_epi32(half_sums(v, x, q, ones), _mm256_set1_epi32(folded))
    };
    [half(0, folded[0]), half(4, folded[1])]
}

group_kernel!(
    group_kernel_avx2,
    group_pass_avx2,
    "avx2,fma,f16c",
    block_dot_avx2,
    half_dots_avx2,
    block_dot_scaled_avx2,
    half_dots_scaled_avx2,
    block_scales_avx2,
    false,
    true,
    true,
    4,
    [1, 2, 3, 4],
    all
);
group_kernel!(
    group_kernel_avx2_q8,
    group_pass_avx2_q8,
    "avx2,fma,f16c",
    block_dot_avx2,
    half_dots_avx2,
    block_dot_scaled_avx2,
    half_dots_scaled_avx2,
    block_scales_avx2,
    true,
    false,
    false,
    4,
    [1, 2, 3, 4],
    q8
);
