//! Row-wise operations on flat `f32` activations: norms, rotary embeddings, activations,
//! residual adds, the output head's rows, and the buffers they write.

use super::linear::Linear;
use crate::error::Result;
use crate::math::{fast_exp, ggml_expf};

/// `v` resized to `n` values (zeroed), without reallocating once its capacity is enough.
pub fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.clear();
    v.resize(n, 0.0);
    v
}

/// `v` resized to `n` for a kernel that writes every element. Unlike [`sized`], what the
/// last use left is not zeroed first: a memset of every product's output (a 262144-wide
/// logits row per token, 3 MB activations per layer of a 512-token prompt) was serial time
/// with the workers idle.
pub fn sized_for_overwrite(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    v
}

/// `1 / sqrt(mean(x²) + eps)` for one row, summed as ggml's `rms_norm` does (each square in
/// f32, accumulated in f64) but in 8 independent lanes, so the loop vectorises: a sequential
/// f32 sum was a chain of dependent adds, 8% of a prompt's time on the calling thread.
fn rms_scale(row: &[f32], eps: f32) -> f32 {
    let mut lanes = [0f64; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += (v * v) as f64;
        }
    }
    let sum = tail.iter().fold(
        ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
            + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])),
        |s, v| s + (v * v) as f64,
    );
    let mean = (sum / row.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// `x = rms_norm(x) · w` per row of `w.len()` values.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for_row_runs(d, x, &mut [], |_, x, _| {
        for row in x.chunks_exact_mut(d) {
            let scale = rms_scale(row, eps);
            for (v, g) in row.iter_mut().zip(w) {
                *v = *v * scale * g;
            }
        }
    });
}

/// `out = rms_norm(x)` (`x` unchanged): the copy and the norm in one pass.
pub fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut Vec<f32>) {
    let d = w.len();
    out.resize(x.len() / d * d, 0.0);
    for_row_runs(d, out, &mut [], |rows, out, _| {
        let x = &x[rows.start * d..rows.end * d];
        for (row, dst) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            let scale = rms_scale(row, eps);
            for ((o, v), g) in dst.iter_mut().zip(row).zip(w) {
                *o = v * scale * g;
            }
        }
    });
}

/// `x += y`, then `out = rms_norm(x)`: a residual add and the next norm in one pass per row
/// (the same arithmetic as [`add_assign`] then [`rms_norm_into`]).
pub fn add_rms_norm_into(x: &mut [f32], y: &[f32], w: &[f32], eps: f32, out: &mut Vec<f32>) {
    let d = w.len();
    out.resize(x.len() / d * d, 0.0);
    for_row_runs(d, x, out, |rows, x, out| {
        let add = &y[rows.start * d..rows.end * d];
        for ((row, add), dst) in x
            .chunks_exact_mut(d)
            .zip(add.chunks_exact(d))
            .zip(out.chunks_exact_mut(d))
        {
            for (v, a) in row.iter_mut().zip(add) {
                *v += a;
            }
            let scale = rms_scale(row, eps);
            for ((o, v), g) in dst.iter_mut().zip(row.iter()).zip(w) {
                *o = v * scale * g;
            }
        }
    });
}

/// Rotary tables per token: `cos[t * half + i]`, `sin[...]`.
#[derive(Default)]
pub struct Rope {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl Rope {
    /// Recomputes the tables for `positions`, reusing their allocations; `mscale` multiplies
    /// cos and sin (1 unless the rope was extended).
    pub fn fill(&mut self, positions: &[usize], inv_freq: &[f32], mscale: f32) {
        self.half = inv_freq.len();
        self.cos.clear();
        self.sin.clear();
        for &p in positions {
            for &f in inv_freq {
                let a = p as f32 * f;
                self.cos.push(a.cos() * mscale);
                self.sin.push(a.sin() * mscale);
            }
        }
    }

    /// Rotates every head of token `t`. `neox`: pairs are (i, i + n_rot/2) instead of
    /// adjacent elements.
    pub fn apply(&self, t: usize, x: &mut [f32], head_dim: usize, neox: bool) {
        let c = &self.cos[t * self.half..(t + 1) * self.half];
        let s = &self.sin[t * self.half..(t + 1) * self.half];
        for head in x.chunks_exact_mut(head_dim) {
            for i in 0..self.half {
                let (a, b) = if neox {
                    (i, i + self.half)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c[i] - x1 * s[i];
                head[b] = x0 * s[i] + x1 * c[i];
            }
        }
    }
}

pub fn inv_freq(n_rot: usize, base: f32, factors: Option<&[f32]>) -> Vec<f32> {
    (0..n_rot / 2)
        .map(|i| {
            let f = 1.0 / base.powf(2.0 * i as f32 / n_rot as f32);
            match factors {
                Some(fs) if i < fs.len() && fs[i] != 0.0 => f / fs[i],
                _ => f,
            }
        })
        .collect()
}

/// The final norm of the rows whose output flag is set, in batch order, into `h`.
pub fn output_rows_into(
    x: &[f32],
    d: usize,
    wanted: &[bool],
    norm: &[f32],
    eps: f32,
    h: &mut Vec<f32>,
) {
    h.clear();
    for (t, _) in wanted.iter().enumerate().filter(|(_, &w)| w) {
        h.extend_from_slice(&x[t * d..(t + 1) * d]);
    }
    rms_norm(h, norm, eps);
}

/// Final norm and output head for the rows whose logits flag is set, in batch order, into
/// `logits` (`h` holds the selected rows).
#[allow(clippy::too_many_arguments)]
pub fn output_logits_into(
    x: &[f32],
    d: usize,
    wanted: &[bool],
    norm: &[f32],
    eps: f32,
    output: &Linear,
    h: &mut Vec<f32>,
    logits: &mut Vec<f32>,
) -> Result<()> {
    output_rows_into(x, d, wanted, norm, eps, h);
    if h.is_empty() {
        logits.clear();
        return Ok(());
    }
    output.forward_into(h, h.len() / d, logits)
}

/// SiLU times the up projection, `g / (1 + e^-g) · u`, with the exponential llama.cpp's
/// fused SwiGLU uses on an AVX2 CPU ([`ggml_expf`]) rather than libm's `expf`, which no loop
/// vectorises (libm's scalar `expf` and its loop were ~6% of an 8-stream SmolLM2 decode step).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    for_row_runs(1, &mut gate[..n], &mut [], |at, g, _| {
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::has_avx2() {
            // SAFETY: AVX2 and FMA were detected at run time.
            return unsafe { silu_mul_avx2(g, &up[at]) };
        }
        apply(g, &up[at], &silu_one)
    });
}

#[inline(always)]
fn silu_one(g: f32, u: f32) -> f32 {
    g / (1.0 + ggml_expf(0.0 - g)) * u
}

/// [`silu_mul`] 8 values at a time on [`crate::math::ggml_expf_avx2`], the same operations
/// in the same order as [`silu_one`], so every value is bitwise the scalar result.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(g: &mut [f32], u: &[f32]) {
    use std::arch::x86_64::*;
    let n = g.len().min(u.len()) / 8 * 8;
    for i in (0..n).step_by(8) {
        let x = _mm256_loadu_ps(g.as_ptr().add(i));
        let e = crate::math::ggml_expf_avx2(_mm256_sub_ps(_mm256_setzero_ps(), x));
        let s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e));
        let v = _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i)));
        _mm256_storeu_ps(g.as_mut_ptr().add(i), v);
    }
    apply(&mut g[n..], &u[n..], &silu_one)
}

/// GELU with the tanh approximation, written as `x · σ(2u)` (the same function:
/// `0.5·(1 + tanh(u)) = σ(2u)`) so it needs one exponential and no `tanhf`.
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    elementwise(gate, up, |x, u| {
        let two_u = 2.0 * SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
        x / (1.0 + fast_exp(-two_u)) * u
    });
}

/// Values per task of a parallel element-wise op; smaller ops run on the calling thread.
const ELEMENTWISE_CHUNK: usize = 4096;

/// `a[i] = f(a[i], b[i])`, on the worker pool when there are several chunks of work (a
/// batch's gated activations are the largest serial step between two products).
fn elementwise(a: &mut [f32], b: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) {
    let n = a.len().min(b.len());
    for_row_runs(1, &mut a[..n], &mut [], |at, a, _| {
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::has_avx2() {
            // SAFETY: AVX2 and FMA were detected at run time.
            return unsafe { apply_avx2(a, &b[at], &f) };
        }
        apply(a, &b[at], &f)
    });
}

/// `a[i] = f(a[i], b[i])`, inlined into its caller so that the loop vectorises for the
/// caller's target features.
#[inline(always)]
fn apply(a: &mut [f32], b: &[f32], f: &impl Fn(f32, f32) -> f32) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = f(*x, *y);
    }
}

/// [`apply`] compiled for AVX2: the portable build vectorises it 4 lanes wide (SSE2), and
/// GELU's polynomial took 3.5 cycles per value of a Gemma 3 prompt there (4% of it). The
/// arithmetic is the same operations in the same order (Rust fuses no multiply-adds by
/// itself), so results are bitwise unchanged.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn apply_avx2(a: &mut [f32], b: &[f32], f: &impl Fn(f32, f32) -> f32) {
    apply(a, b, f)
}

/// Hands disjoint runs of whole rows of `d` values of `a` (and the same rows of `b`, when it
/// is not empty) to `f(rows, a_rows, b_rows)`: on the worker pool when `a` holds several
/// [`ELEMENTWISE_CHUNK`]s of values (a prompt's norms and gated activations would otherwise
/// run on the calling thread while the other workers wait), else at once on this thread.
fn for_row_runs(
    d: usize,
    a: &mut [f32],
    b: &mut [f32],
    f: impl Fn(std::ops::Range<usize>, &mut [f32], &mut [f32]) + Sync,
) {
    let rows = a.len() / d.max(1);
    let has_b = !b.is_empty();
    assert!(!has_b || b.len() >= rows * d);
    if rows * d < 2 * ELEMENTWISE_CHUNK {
        let b_rows = if has_b { &mut b[..rows * d] } else { b };
        return f(0..rows, &mut a[..rows * d], b_rows);
    }
    let per_task = ELEMENTWISE_CHUNK.div_ceil(d);
    let (pa, pb) = (
        crate::kernels::SharedMut(a.as_mut_ptr()),
        crate::kernels::SharedMut(b.as_mut_ptr()),
    );
    let (pa, pb) = (&pa, &pb);
    crate::pool::for_each_chunk(rows.div_ceil(per_task), |tasks| {
        let run = tasks.start * per_task..(tasks.end * per_task).min(rows);
        let (at, n) = (run.start * d, run.len() * d);
        // SAFETY: the runs of rows are disjoint and within `a` (and `b`, checked above),
        // which outlive the call.
        let (a_rows, b_rows) = unsafe {
            (
                std::slice::from_raw_parts_mut(pa.0.add(at), n),
                if has_b {
                    std::slice::from_raw_parts_mut(pb.0.add(at), n)
                } else {
                    &mut []
                },
            )
        };
        f(run, a_rows, b_rows)
    });
}

pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norms_of_many_rows_run_in_parallel_and_match_row_by_row() {
        let d = 256;
        let rows = 64;
        let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 * 0.01).collect();
        let x: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let y: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 11 % 13) as f32 - 6.0) * 0.07)
            .collect();
        let (mut many, mut into, mut fused_x, mut fused) = (x.clone(), vec![], x.clone(), vec![]);
        crate::pool::with_threads(2, || {
            rms_norm(&mut many, &w, 1e-6);
            rms_norm_into(&x, &w, 1e-6, &mut into);
            add_rms_norm_into(&mut fused_x, &y, &w, 1e-6, &mut fused);
        });
        for r in 0..rows {
            let row = &x[r * d..(r + 1) * d];
            let mut one = row.to_vec();
            rms_norm(&mut one, &w, 1e-6);
            assert_eq!(&many[r * d..(r + 1) * d], &one[..], "row {r}");
            assert_eq!(&into[r * d..(r + 1) * d], &one[..], "row {r}");
            // ggml's definition: squares in f32, summed in f64
            let ss: f64 = row.iter().map(|v| (v * v) as f64).sum();
            let scale = 1.0 / ((ss / d as f64) as f32 + 1e-6).sqrt();
            for (i, (&got, v)) in one.iter().zip(row).enumerate() {
                let want = v * scale * w[i];
                assert!((got - want).abs() <= 1e-6 * want.abs().max(1e-3), "{r} {i}");
            }
            let sum: Vec<f32> = row.iter().zip(&y[r * d..]).map(|(a, b)| a + b).collect();
            let mut one = Vec::new();
            rms_norm_into(&sum, &w, 1e-6, &mut one);
            assert_eq!(&fused[r * d..(r + 1) * d], &one[..], "row {r}");
        }
    }

    #[test]
    fn fused_norms_equal_the_separate_steps_bitwise() {
        let d = 24;
        let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 * 0.03).collect();
        let x: Vec<f32> = (0..3 * d)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.11)
            .collect();
        let y: Vec<f32> = (0..3 * d)
            .map(|i| ((i * 11 % 13) as f32 - 6.0) * 0.07)
            .collect();

        let mut want = x.clone();
        rms_norm(&mut want, &w, 1e-6);
        let mut got = Vec::new();
        rms_norm_into(&x, &w, 1e-6, &mut got);
        assert_eq!(got, want);

        let mut summed = x.clone();
        add_assign(&mut summed, &y);
        let mut want = summed.clone();
        rms_norm(&mut want, &w, 1e-6);
        let mut fused_x = x.clone();
        add_rms_norm_into(&mut fused_x, &y, &w, 1e-6, &mut got);
        assert_eq!(fused_x, summed);
        assert_eq!(got, want);
    }

    /// Inputs and outputs of ggml's 256-bit `ggml_v_expf` (bit patterns), from a C program
    /// that calls it: ordinary values, the ends of the normal range (|n| > 126), past 192
    /// (0 and ∞), signed zeros and infinities. A sweep of 32M random bit patterns and values
    /// in ±120 matched it bit for bit, vectorised and scalar.
    #[test]
    fn ggml_expf_is_ggml_v_expf_bit_for_bit() {
        const CASES: [(u32, u32); 24] = [
            (0x0000_0000, 0x3f80_0000),
            (0x3f80_0000, 0x402d_f855),
            (0xbf80_0000, 0x3ebc_5ab2),
            (0x3f00_0000, 0x3fd3_094c),
            (0x4124_cccd, 0x46e8_4940),
            (0xc124_cccd, 0x380d_1140),
            (0x42b0_0000, 0x7ef8_82b7),
            (0x42b1_6666, 0x7f7a_37fc),
            (0x42b2_0000, 0x7f80_0000),
            (0xc2af_0000, 0x006c_b2bb),
            (0xc2c8_0000, 0x0000_001b),
            (0xc2ce_0000, 0x0000_0001),
            (0xc2d1_0000, 0x0000_0000),
            (0xc316_0000, 0x0000_0000),
            (0x4348_0000, 0x7f80_0000),
            (0xc348_0000, 0x0000_0000),
            (0x7f80_0000, 0x7f80_0000),
            (0xff80_0000, 0x0000_0000),
            (0x8000_0000, 0x3f80_0000),
            (0x3300_d959, 0x3f80_0000),
            (0xbf31_7215, 0x3f00_0001),
            (0x41a0_0000, 0x4de7_5844),
            (0xc1a0_0000, 0x310d_a432),
            (0x4229_b261, 0x5e13_8ff1),
        ];
        let xs: Vec<f32> = CASES.iter().map(|c| f32::from_bits(c.0)).collect();
        // through the vectorised element-wise path too (silu_mul's loop), not only scalar
        let mut v = xs.clone();
        elementwise(&mut v, &vec![0.0; xs.len()], |x, _| ggml_expf(x));
        for (i, &(x, want)) in CASES.iter().enumerate() {
            let x = f32::from_bits(x);
            assert_eq!(ggml_expf(x).to_bits(), want, "ggml_expf({x:e})");
            assert_eq!(v[i].to_bits(), want, "vectorised ggml_expf({x:e})");
        }
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::has_avx2() {
            let mut lanes = xs.clone();
            lanes.resize(xs.len().div_ceil(8) * 8, 0.0);
            for c in lanes.chunks_exact_mut(8) {
                // SAFETY: AVX2 and FMA were detected; the chunk holds 8 values.
                unsafe {
                    use std::arch::x86_64::*;
                    let e = crate::math::ggml_expf_avx2(_mm256_loadu_ps(c.as_ptr()));
                    _mm256_storeu_ps(c.as_mut_ptr(), e);
                }
            }
            for (i, &(x, want)) in CASES.iter().enumerate() {
                let x = f32::from_bits(x);
                assert_eq!(lanes[i].to_bits(), want, "ggml_expf_avx2({x:e})");
            }
        }
        assert!(ggml_expf(f32::NAN).is_nan());
        // within 2 ulp of the exact exponential over the range SiLU sees
        for i in -8700..8800 {
            let x = i as f32 * 0.01;
            let (got, want) = (ggml_expf(x) as f64, (x as f64).exp());
            let ulp = (want as f32).abs() * f32::EPSILON;
            assert!(
                (got - want).abs() <= 2.0 * ulp as f64,
                "{x}: {got} vs {want}"
            );
        }
    }

    /// SiLU's 8-lane path against the scalar one, bitwise: values from every branch of the
    /// exponential (ordinary, |n| > 126, past 192), lanes mixing them, and random bit
    /// patterns.
    #[test]
    fn silu_lanes_equal_the_scalar_silu_bitwise() {
        let mut seed = 7u64;
        let mut xs: Vec<f32> = (-2000..2000).map(|i| i as f32 * 0.07).collect();
        xs.extend((0..4000).map(|_| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            f32::from_bits((seed >> 32) as u32)
        }));
        let up: Vec<f32> = (0..xs.len()).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
        let mut got = xs.clone();
        silu_mul(&mut got, &up);
        for (i, (&x, &u)) in xs.iter().zip(&up).enumerate() {
            let want = silu_one(x, u);
            assert!(
                got[i].to_bits() == want.to_bits() || (got[i].is_nan() && want.is_nan()),
                "silu({x:e}) · {u}: {} vs {want}",
                got[i]
            );
        }
    }

    #[test]
    fn activations_match_their_definitions() {
        let xs: Vec<f32> = (-400..400).map(|i| i as f32 * 0.025).collect();
        let ones = vec![1.0f32; xs.len()];
        let (mut s, mut g) = (xs.clone(), xs.clone());
        silu_mul(&mut s, &ones);
        gelu_tanh_mul(&mut g, &ones);
        for (i, &x) in xs.iter().enumerate() {
            let silu = x / (1.0 + (-x).exp());
            let gelu = 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044715 * x * x * x)).tanh());
            assert!(
                (s[i] - silu).abs() <= 1e-5 * silu.abs().max(1.0),
                "silu {x}"
            );
            assert!(
                (g[i] - gelu).abs() <= 1e-5 * gelu.abs().max(1.0),
                "gelu {x}"
            );
        }
    }
}
