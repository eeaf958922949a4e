//! Scalar math the kernels and the model share: exponentials written so that loops over them
//! vectorise. A leaf: it imports nothing from the crate.

/// The constants of [`fast_exp`], shared with its SIMD copy in `kernels::attn`.
pub struct FastExp {
    /// Inputs are clamped to `[lo, hi]`, the finite range of the result.
    pub lo: f32,
    pub hi: f32,
    pub log2e: f32,
    /// `ln 2` split in two, so `x - k·ln 2` loses no precision.
    pub ln2_hi: f32,
    pub ln2_lo: f32,
    /// Adding and subtracting 1.5·2^23 rounds to the nearest integer without a libm call.
    pub round: f32,
    /// Taylor coefficients from the highest degree down, for Horner's scheme.
    pub poly: [f32; 7],
}

pub const FAST_EXP: FastExp = FastExp {
    lo: -87.3,
    hi: 88.7,
    log2e: std::f32::consts::LOG2_E,
    ln2_hi: 0.693_359_4,
    ln2_lo: -2.121_944_4e-4,
    round: 12_582_912.0,
    poly: [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ],
};

/// `exp(x)` without a libm call, so loops over it vectorise: `2^k · p(r)` with
/// `r = x - k·ln 2`, `|r| ≤ ln 2 / 2`, and a degree-6 Taylor polynomial (relative error
/// below 2e-7). Inputs are clamped to the finite range of f32.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    let c = &FAST_EXP;
    let x = x.clamp(c.lo, c.hi);
    let t = x * c.log2e + c.round;
    let k = t - c.round;
    let r = x - k * c.ln2_hi - k * c.ln2_lo;
    let mut p = c.poly[0];
    for &a in &c.poly[1..] {
        p = a + r * p;
    }
    // `k as i32` read off `t`'s bits, where `k` sits in the low mantissa bits (`t` is
    // `k + 1.5·2²³`, in a binade whose unit is 1): `as` saturates, which no vector
    // instruction does, so a loop over it converted each value on its own (half of GELU's
    // time). A NaN keeps `k` at 0, as `as` does, so the NaN of `p` comes out unchanged.
    let ki = if k.is_nan() {
        0
    } else {
        (t.to_bits() as i32).wrapping_sub(c.round.to_bits() as i32)
    };
    f32::from_bits((p.to_bits() as i32).wrapping_add(ki << 23) as u32)
}

/// The constants of [`ggml_expf`], shared with [`ggml_expf_avx2`]: ggml's hexadecimal
/// literals as bit patterns.
struct GgmlExp {
    /// 0x1.8p23: adding and subtracting it rounds to the nearest integer.
    round: u32,
    log2e: u32,
    /// `ln 2` split in a short high part and the rest.
    ln2_hi: u32,
    ln2_lo: u32,
    /// The polynomial's coefficients, in the order the evaluation takes them.
    poly: [u32; 5],
}

const GGML_EXP: GgmlExp = GgmlExp {
    round: 0x4b40_0000,
    log2e: 0x3fb8_aa3b,
    ln2_hi: 0x3f31_7200,
    ln2_lo: 0x35bf_be8e,
    poly: [
        0x3c07_2010,
        0x3d2b_9f17,
        0x3e2a_af33,
        0x3eff_fedb,
        0x3f7f_fff6,
    ],
};

/// `e^x` computed as ggml's 256-bit `ggml_v_expf` computes each lane (an Arm
/// optimized-routines design: `n = round(x·log2 e)`, `b = x - n·ln 2` in two parts, a
/// degree-5 polynomial, scaled by `2^n`; at most 1.5 ulp from `expf`), the same operations
/// and fused multiply-adds in the same order, so a vectorised loop over it gives, bit for
/// bit, what llama.cpp's AVX2 build gives (its AVX-512 build rounds the polynomial's last
/// step differently). Branch-free: each lane computes both the common result and the one for
/// `|n| > 126` and selects, which in a vectorised loop costs subnormal assists on Intel
/// cores (hot loops use [`ggml_expf_avx2`]). Without FMA hardware `mul_add` is libm's exact
/// `fmaf`: slower, the same bits.
#[inline(always)]
pub fn ggml_expf(x: f32) -> f32 {
    let (cs, p) = (&GGML_EXP, f32::from_bits);
    let r = p(cs.round);
    let z = x.mul_add(p(cs.log2e), r);
    let n = z - r;
    // x - n·ln 2, with ln 2 split in a short high part and the rest
    let b = (-n).mul_add(p(cs.ln2_lo), (-n).mul_add(p(cs.ln2_hi), x));
    let e = z.to_bits() << 23;
    let k = p(e.wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = p(cs.poly[0])
        .mul_add(b, p(cs.poly[1]))
        .mul_add(u, p(cs.poly[2]).mul_add(b, p(cs.poly[3])));
    let j = j.mul_add(u, p(cs.poly[4]) * b);
    let common = k.mul_add(j, k);
    // |n| > 126: 2^n is not a normal float; scale in two steps (and past 192, to 0 or ∞)
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = p(g.wrapping_add(0x7f00_0000));
    let s2 = p(e.wrapping_sub(g));
    let far = if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    };
    if n.abs() > 126.0 {
        far
    } else {
        common
    }
}

/// [`ggml_expf`] on 8 lanes, every lane bitwise the scalar result. Written with intrinsics
/// because a vectorised loop over the scalar function computes every lane's `|n| > 126`
/// result too, and LLVM moves the arithmetic ahead of any select that would keep it on safe
/// inputs: for `0 < n ≤ 126` that result's products are subnormal, and on Intel cores each
/// is a microcode assist (SiLU ran at 11.5 ns a value). Here the far results are computed
/// only when a lane needs them, as ggml's `ggml_v_expf` does.
///
/// # Safety
/// The CPU must have AVX2 and FMA (see [`crate::kernels::has_avx2`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub unsafe fn ggml_expf_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let (cs, c) = (&GGML_EXP, |bits: u32| _mm256_set1_ps(f32::from_bits(bits)));
    let (r, poly) = (c(cs.round), cs.poly.map(c));
    let z = _mm256_fmadd_ps(x, c(cs.log2e), r);
    let n = _mm256_sub_ps(z, r);
    let b = _mm256_fnmadd_ps(n, c(cs.ln2_lo), _mm256_fnmadd_ps(n, c(cs.ln2_hi), x));
    let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
    let k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_set1_epi32(0x3f80_0000)));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(poly[0], b, poly[1]), u, {
            _mm256_fmadd_ps(poly[2], b, poly[3])
        }),
        u,
        _mm256_mul_ps(poly[4], b),
    );
    let common = _mm256_fmadd_ps(k, j, k);
    let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
    let far = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(126.0));
    if _mm256_movemask_ps(far) == 0 {
        return common;
    }
    let g = _mm256_and_si256(
        _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())),
        _mm256_set1_epi32(0x8200_0000u32 as i32),
    );
    let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
    let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    let past_192 = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
    let scaled = _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1);
    let far_value = _mm256_blendv_ps(scaled, _mm256_mul_ps(s1, s1), past_192);
    _mm256_blendv_ps(common, far_value, far)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_libm() {
        let mut x = -87.0f32;
        while x < 88.5 {
            let (got, want) = (fast_exp(x), x.exp());
            assert!(((got - want) / want).abs() < 1e-6, "{x}: {got} vs {want}");
            x += 0.0137;
        }
        // clamped, never infinite; a NaN stays NaN
        assert!(fast_exp(1000.0).is_finite() && fast_exp(-1000.0) >= 0.0);
        assert!(fast_exp(f32::NAN).is_nan());
    }

    #[test]
    fn fast_exp_reads_k_off_the_bits_as_the_cast_would() {
        // the exponent `k` converted with `as` (saturating), as before the bit trick
        let with_cast = |x: f32| {
            let c = &FAST_EXP;
            let x = x.clamp(c.lo, c.hi);
            let k = (x * c.log2e + c.round) - c.round;
            let r = x - k * c.ln2_hi - k * c.ln2_lo;
            let mut p = c.poly[0];
            for &a in &c.poly[1..] {
                p = a + r * p;
            }
            f32::from_bits((p.to_bits() as i32).wrapping_add((k as i32) << 23) as u32)
        };
        let mut x = -200.0f32;
        while x < 200.0 {
            assert_eq!(fast_exp(x).to_bits(), with_cast(x).to_bits(), "{x}");
            x += 0.0071;
        }
        for x in [
            f32::MIN,
            f32::MAX,
            -87.3,
            88.7,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ] {
            assert_eq!(fast_exp(x).to_bits(), with_cast(x).to_bits(), "{x}");
        }
    }
}
