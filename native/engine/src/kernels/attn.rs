//! Register-blocked f32 micro-kernels for attention: scores `S = Q·Kᵀ` and the weighted sum
//! `O += P·V`. Rows are query heads and keys are KV slots, both already converted to f32 in
//! row-major scratch; callers pad `rows` to [`ROW_BLOCK`] and `keys` to [`KEY_BLOCK`] with
//! zeros. The AVX2 path keeps 4×2 score accumulators and 4×16 output columns in registers, so
//! every loaded key or value vector is used by four query rows.

/// Query rows per micro-kernel call.
pub const ROW_BLOCK: usize = 4;
/// Keys per score micro-kernel call.
pub const KEY_BLOCK: usize = 2;
/// Output columns per weighted-sum micro-kernel call (two 8-lane vectors).
const COL_BLOCK: usize = 16;

#[cfg(target_arch = "x86_64")]
fn simd_ok(hd: usize) -> bool {
    hd.is_multiple_of(COL_BLOCK) && super::has_avx2()
}

/// `s[i * s_stride + j] = q_i · k_j` for `i < rows`, `j < keys`; `q` is `[rows, hd]`, `k` is
/// `[keys, hd]`. `rows` must be a multiple of [`ROW_BLOCK`], `keys` of [`KEY_BLOCK`].
pub fn scores(
    q: &[f32],
    rows: usize,
    k: &[f32],
    keys: usize,
    hd: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    assert!(rows.is_multiple_of(ROW_BLOCK) && keys.is_multiple_of(KEY_BLOCK) && keys <= s_stride);
    assert!(q.len() >= rows * hd && k.len() >= keys * hd && s.len() >= rows * s_stride);
    #[cfg(target_arch = "x86_64")]
    if simd_ok(hd) {
        // SAFETY: AVX2 and FMA were detected; the asserts above bound every access.
        unsafe { scores_avx2(q, rows, k, keys, hd, s, s_stride) };
        return;
    }
    for i in 0..rows {
        let qi = &q[i * hd..(i + 1) * hd];
        for j in 0..keys {
            let kj = &k[j * hd..(j + 1) * hd];
            s[i * s_stride + j] = if hd.is_multiple_of(COL_BLOCK) {
                lane_dot(qi, kj)
            } else {
                qi.iter().zip(kj).map(|(a, b)| a * b).sum()
            };
        }
    }
}

/// `a · b` with the AVX2 path's arithmetic: 8 lanes of fused multiply-adds, then its
/// horizontal reduction `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`, so scores are
/// bitwise the same on every path.
fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut l = [0f32; 8];
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for i in 0..8 {
            l[i] = ca[i].mul_add(cb[i], l[i]);
        }
    }
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// `o_i += Σ_j p[i * p_stride + j] · v_j` for `i < rows`; `v` is `[keys, hd]`, `o` is
/// `[rows, hd]`. Same padding rules as [`scores`].
pub fn accumulate(
    p: &[f32],
    p_stride: usize,
    rows: usize,
    v: &[f32],
    keys: usize,
    hd: usize,
    o: &mut [f32],
) {
    assert!(rows.is_multiple_of(ROW_BLOCK) && keys <= p_stride);
    assert!(p.len() >= rows * p_stride && v.len() >= keys * hd && o.len() >= rows * hd);
    #[cfg(target_arch = "x86_64")]
    if simd_ok(hd) {
        // SAFETY: AVX2 and FMA were detected; the asserts above bound every access.
        unsafe { accumulate_avx2(p, p_stride, rows, v, keys, hd, o) };
        return;
    }
    for i in 0..rows {
        let oi = &mut o[i * hd..(i + 1) * hd];
        for j in 0..keys {
            let w = p[i * p_stride + j];
            for (x, vv) in oi.iter_mut().zip(&v[j * hd..(j + 1) * hd]) {
                // fused, like the AVX2 path
                *x = w.mul_add(*vv, *x);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2(
    q: &[f32],
    rows: usize,
    k: &[f32],
    keys: usize,
    hd: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    use std::arch::x86_64::*;
    let (qp, kp, sp) = (q.as_ptr(), k.as_ptr(), s.as_mut_ptr());
    for r0 in (0..rows).step_by(ROW_BLOCK) {
        for j0 in (0..keys).step_by(KEY_BLOCK) {
            let mut acc = [[_mm256_setzero_ps(); KEY_BLOCK]; ROW_BLOCK];
            for d in (0..hd).step_by(8) {
                let kv = [
                    _mm256_loadu_ps(kp.add(j0 * hd + d)),
                    _mm256_loadu_ps(kp.add((j0 + 1) * hd + d)),
                ];
                for (i, row) in acc.iter_mut().enumerate() {
                    let qv = _mm256_loadu_ps(qp.add((r0 + i) * hd + d));
                    row[0] = _mm256_fmadd_ps(qv, kv[0], row[0]);
                    row[1] = _mm256_fmadd_ps(qv, kv[1], row[1]);
                }
            }
            for pair in 0..ROW_BLOCK / 2 {
                let (a, b) = (acc[2 * pair], acc[2 * pair + 1]);
                // [a0 a1 b0 b1]: four horizontal sums at once
                let h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(b[0], b[1]));
                let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                let mut out = [0f32; 4];
                _mm_storeu_ps(out.as_mut_ptr(), sums);
                let ra = sp.add((r0 + 2 * pair) * s_stride + j0);
                let rb = sp.add((r0 + 2 * pair + 1) * s_stride + j0);
                *ra = out[0];
                *ra.add(1) = out[1];
                *rb = out[2];
                *rb.add(1) = out[3];
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn accumulate_avx2(
    p: &[f32],
    p_stride: usize,
    rows: usize,
    v: &[f32],
    keys: usize,
    hd: usize,
    o: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (pp, vp, op) = (p.as_ptr(), v.as_ptr(), o.as_mut_ptr());
    for r0 in (0..rows).step_by(ROW_BLOCK) {
        for c in (0..hd).step_by(COL_BLOCK) {
            let mut acc = [[_mm256_setzero_ps(); 2]; ROW_BLOCK];
            for (i, row) in acc.iter_mut().enumerate() {
                let at = op.add((r0 + i) * hd + c);
                *row = [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))];
            }
            for j in 0..keys {
                let v0 = _mm256_loadu_ps(vp.add(j * hd + c));
                let v1 = _mm256_loadu_ps(vp.add(j * hd + c + 8));
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
        let (rows, keys, stride, hd) = (8, 6, 8, 64);
        let q: Vec<f32> = (0..rows * hd).map(|_| lcg(&mut seed)).collect();
        let k: Vec<f32> = (0..keys * hd).map(|_| lcg(&mut seed)).collect();
        let (mut s1, mut s2) = (vec![0f32; rows * stride], vec![0f32; rows * stride]);
        // SAFETY: AVX2 and FMA were detected; the buffers hold every index touched.
        unsafe { scores_avx2(&q, rows, &k, keys, hd, &mut s1, stride) };
        for i in 0..rows {
            for j in 0..keys {
                s2[i * stride + j] = lane_dot(&q[i * hd..(i + 1) * hd], &k[j * hd..(j + 1) * hd]);
            }
        }
        assert_eq!(s1, s2);
        let (mut o1, mut o2) = (vec![0.25f32; rows * hd], vec![0.25f32; rows * hd]);
        // SAFETY: as above.
        unsafe { accumulate_avx2(&s1, stride, rows, &k, keys, hd, &mut o1) };
        for i in 0..rows {
            for j in 0..keys {
                let w = s1[i * stride + j];
                for d in 0..hd {
                    o2[i * hd + d] = w.mul_add(k[j * hd + d], o2[i * hd + d]);
                }
            }
        }
        assert_eq!(o1, o2);
    }

    #[test]
    fn micro_kernels_match_plain_loops() {
        let mut seed = 7u64;
        for &hd in &[16usize, 64, 256, 24] {
            let (rows, keys, stride) = (8, 6, 10);
            let q: Vec<f32> = (0..rows * hd).map(|_| lcg(&mut seed)).collect();
            let k: Vec<f32> = (0..keys * hd).map(|_| lcg(&mut seed)).collect();
            let mut s = vec![0f32; rows * stride];
            scores(&q, rows, &k, keys, hd, &mut s, stride);
            let mut o = vec![0.5f32; rows * hd];
            accumulate(&s, stride, rows, &k, keys, hd, &mut o);
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
}
