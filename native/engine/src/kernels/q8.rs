//! Q8_0 weights (blocks of 32 int8 values with one f16 scale) times f32 activations.

use super::SharedMut;
use half::f16;

/// Elements per Q8_0 block.
pub const QK8_0: usize = 32;
const Q8_0_BLOCK_BYTES: usize = 2 + QK8_0;
/// Weight rows computed together for every activation row.
pub(crate) const ROW_TILE: usize = 4;
/// Below this many multiply-adds a product runs on the calling thread.
pub(crate) const PARALLEL_MIN_MACS: usize = 1 << 16;

/// A Q8_0 matrix `[n_out, n_in]` repacked as separate scale and quant arrays.
pub struct Q8Matrix {
    pub n_out: usize,
    pub n_in: usize,
    nb: usize,
    scales: Vec<f32>,
    quants: Vec<i8>,
}

/// Activations quantized to Q8_0 per row and block.
pub struct Q8Activations {
    pub(crate) m: usize,
    pub(crate) quants: Vec<i8>,
    pub(crate) scales: Vec<f32>,
    /// Per block: scale × Σ quants (ggml's Q8_1 `s`), for weight types with an offset.
    pub(crate) sums: Vec<f32>,
    /// The same per half block (values 0..16, 16..32), for types with a scale per half.
    pub(crate) half_sums: Vec<f32>,
}

impl Q8Matrix {
    /// From GGUF/ggml Q8_0 bytes (34-byte blocks: f16 scale then 32 int8).
    pub fn from_q8_0_bytes(bytes: &[u8], n_out: usize, n_in: usize) -> Option<Self> {
        if !n_in.is_multiple_of(QK8_0) || bytes.len() != n_out * n_in / QK8_0 * Q8_0_BLOCK_BYTES {
            return None;
        }
        let nb = n_in / QK8_0;
        let mut scales = Vec::with_capacity(n_out * nb);
        let mut quants = Vec::with_capacity(n_out * n_in);
        for block in bytes.chunks_exact(Q8_0_BLOCK_BYTES) {
            scales.push(f16::from_le_bytes([block[0], block[1]]).to_f32());
            quants.extend(block[2..].iter().map(|&b| b as i8));
        }
        Some(Q8Matrix {
            n_out,
            n_in,
            nb,
            scales,
            quants,
        })
    }

    /// Stacks matrices with the same input width (e.g. Q, K and V) so one product computes
    /// all of them.
    pub fn concat(parts: &[&Q8Matrix]) -> Option<Q8Matrix> {
        let n_in = parts.first()?.n_in;
        if parts.iter().any(|p| p.n_in != n_in) {
            return None;
        }
        Some(Q8Matrix {
            n_out: parts.iter().map(|p| p.n_out).sum(),
            n_in,
            nb: n_in / QK8_0,
            scales: parts
                .iter()
                .flat_map(|p| p.scales.iter().copied())
                .collect(),
            quants: parts
                .iter()
                .flat_map(|p| p.quants.iter().copied())
                .collect(),
        })
    }

    /// `out[r * n_out + o] = Σ_i w[o, i] · x[r, i]` for `m` rows of `x`.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        assert_eq!(x.len(), m * self.n_in);
        assert_eq!(out.len(), m * self.n_out);
        let shared = SharedMut(out.as_mut_ptr());
        Q8Activations::with_quantized(x, m, self.n_in, |a| {
            super::for_each_tile(
                self.n_out,
                ROW_TILE,
                m * self.n_out * self.n_in,
                |o0, rows| self.tile(a, o0, rows, &shared),
            )
        });
    }

    fn tile(&self, a: &Q8Activations, o0: usize, rows: usize, out: &SharedMut) {
        #[cfg(target_arch = "x86_64")]
        {
            if rows == ROW_TILE && has_avx2() {
                // SAFETY: AVX2 and FMA were detected at run time; all slices are in bounds
                // (checked by the asserts in `matmul` and the tile arithmetic).
                unsafe { self.tile4_avx2(a, o0, out) };
                return;
            }
        }
        self.tile_scalar(a, o0, rows, out);
    }

    fn tile_scalar(&self, a: &Q8Activations, o0: usize, rows: usize, out: &SharedMut) {
        let (k, nb) = (self.n_in, self.nb);
        for r in 0..a.m {
            for j in 0..rows {
                let o = o0 + j;
                let mut sum = 0f32;
                for b in 0..nb {
                    let w = &self.quants[o * k + b * QK8_0..o * k + (b + 1) * QK8_0];
                    let x = &a.quants[r * k + b * QK8_0..r * k + (b + 1) * QK8_0];
                    let dot: i32 = w.iter().zip(x).map(|(&p, &q)| p as i32 * q as i32).sum();
                    sum += dot as f32 * self.scales[o * nb + b] * a.scales[r * nb + b];
                }
                // SAFETY: (r, o) is in bounds and written by this tile only.
                unsafe { *out.0.add(r * self.n_out + o) = sum };
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile4_avx2(&self, a: &Q8Activations, o0: usize, out: &SharedMut) {
        use std::arch::x86_64::*;
        let (k, nb) = (self.n_in, self.nb);
        let ones = _mm256_set1_epi16(1);
        let w_ptr = self.quants.as_ptr().add(o0 * k);
        let ws = self.scales.as_ptr().add(o0 * nb);
        for r in 0..a.m {
            let x_ptr = a.quants.as_ptr().add(r * k);
            let xs = a.scales.as_ptr().add(r * nb);
            let mut acc = [_mm256_setzero_ps(); ROW_TILE];
            for b in 0..nb {
                let vx = _mm256_loadu_si256(x_ptr.add(b * QK8_0) as *const __m256i);
                let dx = *xs.add(b);
                for (j, acc_j) in acc.iter_mut().enumerate() {
                    let vw = _mm256_loadu_si256(w_ptr.add(j * k + b * QK8_0) as *const __m256i);
                    // |w| · (x · sign(w)) as unsigned × signed byte products summed in pairs
                    let aw = _mm256_sign_epi8(vw, vw);
                    let sx = _mm256_sign_epi8(vx, vw);
                    let d16 = _mm256_maddubs_epi16(aw, sx);
                    let d32 = _mm256_madd_epi16(d16, ones);
                    let scale = _mm256_set1_ps(*ws.add(j * nb + b) * dx);
                    *acc_j = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d32), scale, *acc_j);
                }
            }
            for (j, acc_j) in acc.iter().enumerate() {
                *out.0.add(r * self.n_out + o0 + j) = hsum(*acc_j);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// AVX512-VNNI with 256-bit vectors (`vpdpbusd` on ymm registers), and AVX2/FMA.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_vnni() -> bool {
    use std::sync::OnceLock;
    static VNNI: OnceLock<bool> = OnceLock::new();
    *VNNI.get_or_init(|| {
        has_avx2()
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl")
            && std::env::var("LLAMA_CPP_EX_NO_VNNI").is_err()
    })
}

impl Q8Activations {
    /// ggml's `quantize_row_q8_0`: per block scale `amax / 127`, values rounded to nearest
    /// (ties to even, as ggml's AVX2 path does).
    pub fn quantize(x: &[f32], m: usize, k: usize) -> Self {
        let mut a = Q8Activations {
            m: 0,
            quants: Vec::new(),
            scales: Vec::new(),
            sums: Vec::new(),
            half_sums: Vec::new(),
        };
        a.quantize_into(x, m, k);
        a
    }

    /// [`Q8Activations::quantize`] into this value's buffers (no allocation once they are
    /// large enough).
    pub fn quantize_into(&mut self, x: &[f32], m: usize, k: usize) {
        let nb = k / QK8_0;
        self.m = m;
        let fit = |v: &mut Vec<f32>, n: usize| {
            v.clear();
            v.resize(n, 0.0);
        };
        self.quants.clear();
        self.quants.resize(m * k, 0);
        fit(&mut self.scales, m * nb);
        fit(&mut self.sums, m * nb);
        fit(&mut self.half_sums, 2 * m * nb);
        for (bi, (xb, qb)) in x
            .chunks_exact(QK8_0)
            .zip(self.quants.chunks_exact_mut(QK8_0))
            .enumerate()
        {
            let (d, [lo, hi]) = quantize_block(xb, qb);
            // the scale as ggml stores it (f16) so results match Q8_0 x Q8_0 products
            let scale = f16::from_f32(d).to_f32();
            self.scales[bi] = scale;
            self.sums[bi] = scale * (lo + hi) as f32;
            self.half_sums[2 * bi] = scale * lo as f32;
            self.half_sums[2 * bi + 1] = scale * hi as f32;
        }
    }

    /// Quantizes `x` into the calling thread's reusable activation buffers and runs `f` on
    /// them (a fresh value if they are already in use on this thread).
    pub(crate) fn with_quantized<R>(
        x: &[f32],
        m: usize,
        k: usize,
        f: impl FnOnce(&Self) -> R,
    ) -> R {
        thread_local! {
            static BUFFERS: std::cell::RefCell<Q8Activations> =
                const { std::cell::RefCell::new(Q8Activations {
                    m: 0,
                    quants: Vec::new(),
                    scales: Vec::new(),
                    sums: Vec::new(),
                    half_sums: Vec::new(),
                }) };
        }
        BUFFERS.with(|cell| match cell.try_borrow_mut() {
            Ok(mut a) => {
                a.quantize_into(x, m, k);
                f(&a)
            }
            Err(_) => f(&Self::quantize(x, m, k)),
        })
    }
}

/// Quantizes one block of [`QK8_0`] values; returns the scale and the sums of the quantized
/// halves.
fn quantize_block(xb: &[f32], qb: &mut [i8]) -> (f32, [i32; 2]) {
    assert!(xb.len() == QK8_0 && qb.len() == QK8_0);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 was detected; both blocks hold QK8_0 elements (asserted above).
        return unsafe { quantize_block_avx2(xb.as_ptr(), qb.as_mut_ptr()) };
    }
    quantize_block_scalar(xb, qb)
}

fn quantize_block_scalar(xb: &[f32], qb: &mut [i8]) -> (f32, [i32; 2]) {
    let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, v) in qb.iter_mut().zip(xb) {
        *q = (v * id).round_ties_even() as i8;
    }
    let half = |h: usize| {
        let n = QK8_0 / 2;
        qb[h * n..(h + 1) * n]
            .iter()
            .map(|&q| q as i32)
            .sum::<i32>()
    };
    (d, [half(0), half(1)])
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(xb: *const f32, qb: *mut i8) -> (f32, [i32; 2]) {
    use std::arch::x86_64::*;
    let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xb.add(8 * i)));
    let sign = _mm256_set1_ps(-0.0);
    let abs = |x: __m256| _mm256_andnot_ps(sign, x);
    let mx = _mm256_max_ps(
        _mm256_max_ps(abs(v[0]), abs(v[1])),
        _mm256_max_ps(abs(v[2]), abs(v[3])),
    );
    let mut m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    let d = _mm_cvtss_f32(m4) / 127.0;
    let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
    let q: [__m256i; 4] = std::array::from_fn(|i| {
        let r = _mm256_round_ps(
            _mm256_mul_ps(v[i], id),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        _mm256_cvtps_epi32(r)
    });
    let hsum = |x: __m256i| {
        let s = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    };
    let halves = [
        hsum(_mm256_add_epi32(q[0], q[1])),
        hsum(_mm256_add_epi32(q[2], q[3])),
    ];
    // packs work within 128-bit lanes; the permutation restores element order
    let w = _mm256_packs_epi16(
        _mm256_packs_epi32(q[0], q[1]),
        _mm256_packs_epi32(q[2], q[3]),
    );
    let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(qb as *mut __m256i, w);
    (d, halves)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_quantization_matches_scalar() {
        let mut seed = 3u64;
        for case in 0..200 {
            let mut x: Vec<f32> = (0..QK8_0).map(|_| lcg(&mut seed) * 4.0).collect();
            if case % 3 == 0 {
                // exact halves: ties round to even on both paths
                let amax = 127.0 / 4.0;
                x[0] = amax;
                for (i, v) in x.iter_mut().enumerate().skip(1) {
                    *v = (i as f32 - 16.0) + 0.5;
                }
            }
            if case == 1 {
                x.fill(0.0);
            }
            let (mut a, mut b) = ([0i8; QK8_0], [0i8; QK8_0]);
            let scalar = quantize_block_scalar(&x, &mut a);
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                // SAFETY: AVX2 detected; both blocks hold QK8_0 elements.
                let simd = unsafe { quantize_block_avx2(x.as_ptr(), b.as_mut_ptr()) };
                assert_eq!(scalar, simd, "case {case}");
                assert_eq!(a, b, "case {case}");
            }
        }
    }

    use crate::kernels::lcg;

    fn random_q8(n_out: usize, n_in: usize, seed: &mut u64) -> (Vec<u8>, Vec<f32>) {
        let mut bytes = Vec::new();
        let mut dense = Vec::new();
        for _ in 0..n_out * n_in / QK8_0 {
            let d = f16::from_f32(0.01 + lcg(seed).abs() * 0.02);
            bytes.extend_from_slice(&d.to_le_bytes());
            for _ in 0..QK8_0 {
                let q = (lcg(seed) * 127.0).round() as i8;
                bytes.push(q as u8);
                dense.push(q as f32 * d.to_f32());
            }
        }
        (bytes, dense)
    }

    #[test]
    fn matches_a_dequantized_reference() {
        let mut seed = 42;
        for &(n_out, n_in) in &[(7usize, 64usize), (33, 576), (130, 640), (1, 32)] {
            let (bytes, dense) = random_q8(n_out, n_in, &mut seed);
            let w = Q8Matrix::from_q8_0_bytes(&bytes, n_out, n_in).unwrap();
            // activation quantization error: |x| ≤ 1 → step 1/127 per element
            let bound = 0.02 * (n_in as f32).sqrt() + 1e-3;
            crate::kernels::check_against_reference(
                "Q8_0",
                &dense,
                n_out,
                n_in,
                &mut seed,
                |x, m, out| w.matmul(x, m, out),
                |_| bound,
            );
        }
    }

    #[test]
    fn scalar_and_simd_paths_agree() {
        let mut seed = 7;
        let (bytes, _) = random_q8(8, 128, &mut seed);
        let w = Q8Matrix::from_q8_0_bytes(&bytes, 8, 128).unwrap();
        let x: Vec<f32> = (0..3 * 128).map(|_| lcg(&mut seed)).collect();
        let a = Q8Activations::quantize(&x, 3, 128);
        let mut simd = vec![0f32; 3 * 8];
        let mut scalar = vec![0f32; 3 * 8];
        let s1 = SharedMut(simd.as_mut_ptr());
        let s2 = SharedMut(scalar.as_mut_ptr());
        for tile in 0..2 {
            w.tile(&a, tile * 4, 4, &s1);
            w.tile_scalar(&a, tile * 4, 4, &s2);
        }
        for (p, q) in simd.iter().zip(&scalar) {
            assert!((p - q).abs() <= 1e-4 * q.abs().max(1.0), "{p} vs {q}");
        }
    }

    #[test]
    fn stacked_matrices_compute_every_part() {
        let mut seed = 9;
        let (b1, _) = random_q8(5, 64, &mut seed);
        let (b2, _) = random_q8(3, 64, &mut seed);
        let w1 = Q8Matrix::from_q8_0_bytes(&b1, 5, 64).unwrap();
        let w2 = Q8Matrix::from_q8_0_bytes(&b2, 3, 64).unwrap();
        let both = Q8Matrix::concat(&[&w1, &w2]).unwrap();
        let x: Vec<f32> = (0..2 * 64).map(|_| lcg(&mut seed)).collect();
        let (mut o1, mut o2, mut o) = (vec![0f32; 10], vec![0f32; 6], vec![0f32; 16]);
        w1.matmul(&x, 2, &mut o1);
        w2.matmul(&x, 2, &mut o2);
        both.matmul(&x, 2, &mut o);
        // (tail rows of a part use the scalar path: equal up to summation order)
        let close = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .all(|(x, y)| (x - y).abs() <= 1e-4 * y.abs().max(1.0))
        };
        for r in 0..2 {
            assert!(close(&o[r * 8..r * 8 + 5], &o1[r * 5..r * 5 + 5]));
            assert!(close(&o[r * 8 + 5..r * 8 + 8], &o2[r * 3..r * 3 + 3]));
        }
        let narrow = Q8Matrix::from_q8_0_bytes(&b2[..34], 1, 32).unwrap();
        assert!(Q8Matrix::concat(&[&w1, &narrow]).is_none());
    }

    #[test]
    fn rejects_bad_shapes() {
        assert!(Q8Matrix::from_q8_0_bytes(&[0u8; 34], 1, 31).is_none());
        assert!(Q8Matrix::from_q8_0_bytes(&[0u8; 33], 1, 32).is_none());
    }
}
