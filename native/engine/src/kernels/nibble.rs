//! 4- and 5-bit weights with a per-block scale and offset (`w = d·q + m`), times f32
//! activations, kept packed: Q4_0 (`m = -8d`), Q4_1, Q5_0 (`m = -16d`) and Q5_1. Blocks hold
//! 32 values; value i sits in the low nibble of byte i, value i+16 in the high nibble, and
//! 5-bit types add bit i of a 32-bit word as the value's fifth bit.
//!
//! With activations quantized to Q8_0 (`x ≈ d_x·a`), one block contributes
//! `d·d_x·Σ q·a + m·(d_x·Σ a)`; the second term uses the activation block sums computed once
//! per matmul. The values are unsigned, so `maddubs(q, a)` needs no sign trick.

use super::q8::{Q8Activations, QK8_0, ROW_TILE};
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
}

impl NibbleType {
    fn has_min(self) -> bool {
        matches!(self, NibbleType::Q4_1 | NibbleType::Q5_1)
    }

    fn has_high_bits(self) -> bool {
        matches!(self, NibbleType::Q5_0 | NibbleType::Q5_1)
    }

    fn block_bytes(self) -> usize {
        2 + if self.has_min() { 2 } else { 0 } + if self.has_high_bits() { 4 } else { 0 } + PACKED
    }

    /// The offset of a type without a stored minimum, in units of `d`.
    fn implied_offset(self) -> f32 {
        match self {
            NibbleType::Q4_0 => -8.0,
            NibbleType::Q5_0 => -16.0,
            _ => 0.0,
        }
    }
}
/// From this many activation rows on, a tile's nibbles are unpacked once and reused.
const UNPACK_MIN_ROWS: usize = 4;

/// A matrix `[n_out, n_in]` repacked as scale, offset, nibble and high-bit arrays.
pub struct NibbleMatrix {
    pub n_out: usize,
    pub n_in: usize,
    pub kind: NibbleType,
    nb: usize,
    d: Vec<f32>,
    m: Vec<f32>,
    /// 16 bytes per block: value i in the low nibble of byte i, value i+16 in the high one.
    qs: Vec<u8>,
    /// 5-bit types: bit i is the fifth bit of value i (empty for 4-bit types).
    qh: Vec<u32>,
}

impl NibbleMatrix {
    /// From GGUF/ggml block bytes of `kind`.
    pub fn from_bytes(kind: NibbleType, bytes: &[u8], n_out: usize, n_in: usize) -> Option<Self> {
        let bb = kind.block_bytes();
        if !n_in.is_multiple_of(QK4_1) || bytes.len() != n_out * n_in / QK4_1 * bb {
            return None;
        }
        let nb = n_in / QK4_1;
        let blocks = n_out * nb;
        let (mut d, mut m) = (Vec::with_capacity(blocks), Vec::with_capacity(blocks));
        let mut qs = Vec::with_capacity(blocks * PACKED);
        let mut qh = Vec::new();
        for block in bytes.chunks_exact(bb) {
            let scale = f16::from_le_bytes([block[0], block[1]]).to_f32();
            let mut at = 2;
            d.push(scale);
            if kind.has_min() {
                m.push(f16::from_le_bytes([block[2], block[3]]).to_f32());
                at += 2;
            } else {
                m.push(kind.implied_offset() * scale);
            }
            if kind.has_high_bits() {
                qh.push(u32::from_le_bytes([
                    block[at],
                    block[at + 1],
                    block[at + 2],
                    block[at + 3],
                ]));
                at += 4;
            }
            qs.extend_from_slice(&block[at..at + PACKED]);
        }
        Some(NibbleMatrix {
            n_out,
            n_in,
            kind,
            nb,
            d,
            m,
            qs,
            qh,
        })
    }

    /// From GGUF/ggml Q4_1 bytes (20-byte blocks: f16 d, f16 m, 16 packed bytes).
    pub fn from_q4_1_bytes(bytes: &[u8], n_out: usize, n_in: usize) -> Option<Self> {
        Self::from_bytes(NibbleType::Q4_1, bytes, n_out, n_in)
    }

    /// Stacks matrices with the same input width so one product computes all of them.
    pub fn concat(parts: &[&NibbleMatrix]) -> Option<NibbleMatrix> {
        let first = parts.first()?;
        let (n_in, kind) = (first.n_in, first.kind);
        if parts.iter().any(|p| p.n_in != n_in || p.kind != kind) {
            return None;
        }
        Some(NibbleMatrix {
            n_out: parts.iter().map(|p| p.n_out).sum(),
            n_in,
            kind,
            nb: n_in / QK4_1,
            d: parts.iter().flat_map(|p| p.d.iter().copied()).collect(),
            m: parts.iter().flat_map(|p| p.m.iter().copied()).collect(),
            qs: parts.iter().flat_map(|p| p.qs.iter().copied()).collect(),
            qh: parts.iter().flat_map(|p| p.qh.iter().copied()).collect(),
        })
    }

    /// `out[r * n_out + o] = Σ_i w[o, i] · x[r, i]` for `m` rows of `x`.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        assert_eq!(x.len(), m * self.n_in);
        assert_eq!(out.len(), m * self.n_out);
        let a = Q8Activations::quantize(x, m, self.n_in);
        let shared = SharedMut(out.as_mut_ptr());
        super::for_each_tile(self.n_out, m * self.n_out * self.n_in, |o0, rows| {
            self.tile(&a, o0, rows, &shared)
        });
    }

    fn tile(&self, a: &Q8Activations, o0: usize, rows: usize, out: &SharedMut) {
        #[cfg(target_arch = "x86_64")]
        {
            if rows == ROW_TILE && super::q8::has_avx2() {
                // SAFETY: AVX2 and FMA were detected at run time; every pointer offset stays
                // inside the matrices (checked by the asserts in `matmul`).
                unsafe { self.tile4_avx2(a, o0, out) };
                return;
            }
        }
        self.tile_scalar(a, o0, rows, out);
    }

    fn value(&self, o: usize, b: usize, i: usize) -> i32 {
        let bi = o * self.nb + b;
        let byte = self.qs[bi * PACKED + i % PACKED];
        let low = (if i < PACKED { byte & 0x0F } else { byte >> 4 }) as i32;
        match self.qh.get(bi) {
            Some(h) => low | (((h >> i) & 1) as i32) << 4,
            None => low,
        }
    }

    fn tile_scalar(&self, a: &Q8Activations, o0: usize, rows: usize, out: &SharedMut) {
        let (k, nb) = (self.n_in, self.nb);
        for r in 0..a.m {
            for j in 0..rows {
                let o = o0 + j;
                let mut sum = 0f32;
                for b in 0..nb {
                    let x = &a.quants[r * k + b * QK4_1..r * k + (b + 1) * QK4_1];
                    let dot: i32 = (0..QK4_1).map(|i| self.value(o, b, i) * x[i] as i32).sum();
                    let bi = o * nb + b;
                    sum += dot as f32 * self.d[bi] * a.scales[r * nb + b]
                        + self.m[bi] * a.sums[r * nb + b];
                }
                // SAFETY: (r, o) is in bounds and written by this tile only.
                unsafe { *out.0.add(r * self.n_out + o) = sum };
            }
        }
    }

    /// The 32 values of block `bi` (global index `gbi`) as unsigned bytes.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn load_values(
        &self,
        q_ptr: *const u8,
        gbi: usize,
        bi: usize,
        low: std::arch::x86_64::__m128i,
    ) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let packed = _mm_loadu_si128(q_ptr.add(bi * PACKED) as *const __m128i);
        let lo = _mm_and_si128(packed, low);
        let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
        let q = _mm256_set_m128i(hi, lo);
        if self.qh.is_empty() {
            return q;
        }
        // Spread the 32 high bits over 32 bytes (ggml's bytes_from_bits_32), keep 0x10.
        let bits = _mm256_set1_epi32(*self.qh.get_unchecked(gbi) as i32);
        let shuf = _mm256_set_epi64x(
            0x0303030303030303,
            0x0202020202020202,
            0x0101010101010101,
            0,
        );
        let bytes = _mm256_or_si256(
            _mm256_shuffle_epi8(bits, shuf),
            _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe),
        );
        let set = _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
        _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile4_avx2(&self, a: &Q8Activations, o0: usize, out: &SharedMut) {
        use std::arch::x86_64::*;
        let (k, nb) = (self.n_in, self.nb);
        let ones = _mm256_set1_epi16(1);
        let low = _mm_set1_epi8(0x0F);
        let q_ptr = self.qs.as_ptr().add(o0 * nb * PACKED);
        let d_ptr = self.d.as_ptr().add(o0 * nb);
        let m_ptr = self.m.as_ptr().add(o0 * nb);
        // Many activation rows: unpack the tile's values once (they stay in L1) instead of
        // once per row.
        let unpacked: Option<Vec<u8>> = (a.m >= UNPACK_MIN_ROWS).then(|| {
            let mut u = vec![0u8; ROW_TILE * k];
            for bi in 0..ROW_TILE * nb {
                let q = self.load_values(q_ptr, o0 * nb + bi, bi, low);
                _mm256_storeu_si256(u.as_mut_ptr().add(bi * QK4_1) as *mut __m256i, q);
            }
            u
        });
        for r in 0..a.m {
            let x_ptr = a.quants.as_ptr().add(r * k);
            let xs = a.scales.as_ptr().add(r * nb);
            let xsum = a.sums.as_ptr().add(r * nb);
            let mut acc = [_mm256_setzero_ps(); ROW_TILE];
            let mut offs = [0f32; ROW_TILE];
            for b in 0..nb {
                let vx = _mm256_loadu_si256(x_ptr.add(b * QK4_1) as *const __m256i);
                let (dx, sx) = (*xs.add(b), *xsum.add(b));
                for j in 0..ROW_TILE {
                    let bi = j * nb + b;
                    let q = match &unpacked {
                        Some(u) => _mm256_loadu_si256(u.as_ptr().add(bi * QK4_1) as *const __m256i),
                        None => self.load_values(q_ptr, o0 * nb + bi, bi, low),
                    };
                    let d32 = _mm256_madd_epi16(_mm256_maddubs_epi16(q, vx), ones);
                    let scale = _mm256_set1_ps(*d_ptr.add(bi) * dx);
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d32), scale, acc[j]);
                    offs[j] += *m_ptr.add(bi) * sx;
                }
            }
            for j in 0..ROW_TILE {
                *out.0.add(r * self.n_out + o0 + j) = super::q8::hsum(acc[j]) + offs[j];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TYPES: [NibbleType; 4] = [
        NibbleType::Q4_0,
        NibbleType::Q4_1,
        NibbleType::Q5_0,
        NibbleType::Q5_1,
    ];

    use crate::kernels::lcg;

    /// Random blocks of `kind` in ggml's layout and their dequantized values.
    fn random_blocks(
        kind: NibbleType,
        n_out: usize,
        n_in: usize,
        seed: &mut u64,
    ) -> (Vec<u8>, Vec<f32>) {
        let levels = if kind.has_high_bits() { 32.0 } else { 16.0 };
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
            if kind.has_high_bits() {
                let qh: u32 = (0..QK4_1).map(|i| ((q[i] >> 4) & 1) << i).sum();
                bytes.extend_from_slice(&qh.to_le_bytes());
            }
            for i in 0..PACKED {
                bytes.push(((q[i] & 0xF) | ((q[i + PACKED] & 0xF) << 4)) as u8);
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
                for &m in &[1usize, 2, 3, 7, 8, 16, 33, 512] {
                    let x: Vec<f32> = (0..m * n_in).map(|_| lcg(&mut seed)).collect();
                    let mut out = vec![0f32; m * n_out];
                    w.matmul(&x, m, &mut out);
                    for r in 0..m {
                        for o in 0..n_out {
                            let row = &dense[o * n_in..(o + 1) * n_in];
                            let exact: f32 = (0..n_in).map(|i| row[i] * x[r * n_in + i]).sum();
                            // activation quantization: half a step (1/127) per |w| term
                            let norm: f32 = row.iter().map(|v| v.abs()).sum();
                            let bound = norm * 0.5 / 127.0 + 1e-3;
                            let got = out[r * n_out + o];
                            assert!(
                                (got - exact).abs() <= bound,
                                "{kind:?} m={m} ({n_out}x{n_in}) r={r} o={o}: {got} vs {exact}"
                            );
                        }
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
            let w = NibbleMatrix::from_bytes(kind, &b1, 8, 128).unwrap();
            for m in [1usize, 3, 5] {
                let x: Vec<f32> = (0..m * 128).map(|_| lcg(&mut seed)).collect();
                let a = Q8Activations::quantize(&x, m, 128);
                let (mut simd, mut scalar) = (vec![0f32; m * 8], vec![0f32; m * 8]);
                let (s1, s2) = (SharedMut(simd.as_mut_ptr()), SharedMut(scalar.as_mut_ptr()));
                for tile in 0..2 {
                    w.tile(&a, tile * 4, 4, &s1);
                    w.tile_scalar(&a, tile * 4, 4, &s2);
                }
                for (p, q) in simd.iter().zip(&scalar) {
                    assert!(
                        (p - q).abs() <= 1e-4 * q.abs().max(1.0),
                        "{kind:?} {p} vs {q}"
                    );
                }
            }
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
