//! ggml's K-quants (256-value super-blocks with 6- or 8-bit sub-block scales) re-expressed,
//! exactly, as the 32-value blocks of [`PackedMatrix`]:
//!
//! * Q4_K and Q5_K: sub-block `j` is `d·sc_j·q − dmin·m_j`, i.e. a Q4_1 / Q5_1 block with
//!   scale `d·sc_j` and offset `−dmin·m_j` (an f16 times a 6-bit integer is exact in f32).
//! * Q6_K: 16-value sub-blocks `d·sc·(q − 32)` with signed 8-bit `sc`; each 32-value block is
//!   two halves with scales `d·sc` and offsets `−32·d·sc` ([`PackedType::Q6K`]).
//!
//! The products then run on the interleaved kernels, whose per-row arithmetic does not depend
//! on how many activation rows share the call (batch-invariant, unlike candle's separate
//! single-row and tiled paths).

use super::packed::{Factors, PackedMatrix, PackedType, RowBlock, QK4_1};
use half::f16;

/// Values per super-block.
pub const QK_K: usize = 256;
/// 32-value blocks per super-block.
const BLOCKS: usize = QK_K / QK4_1;
/// Bytes of the packed 6-bit scale/min table of Q4_K and Q5_K.
const K_SCALE_BYTES: usize = 12;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KQuant {
    Q4K,
    Q5K,
    Q6K,
}

impl KQuant {
    pub fn block_bytes(self) -> usize {
        match self {
            KQuant::Q4K => 4 + K_SCALE_BYTES + QK_K / 2,
            KQuant::Q5K => 4 + K_SCALE_BYTES + QK_K / 8 + QK_K / 2,
            KQuant::Q6K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
        }
    }

    fn target(self) -> PackedType {
        match self {
            KQuant::Q4K => PackedType::Q4_1,
            KQuant::Q5K => PackedType::Q5_1,
            KQuant::Q6K => PackedType::Q6K,
        }
    }
}

fn f16_raw(b: &[u8], at: usize) -> f16 {
    f16::from_le_bytes([b[at], b[at + 1]])
}

/// Scale and minimum of sub-block `j` from the packed table (ggml's `get_scale_min_k4`).
fn scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The eight 32-value blocks of one super-block.
fn decode(kind: KQuant, sb: &[u8]) -> [RowBlock; BLOCKS] {
    let mut out = [RowBlock::new(0.0, 0.0, [0; QK4_1]); BLOCKS];
    match kind {
        KQuant::Q4K | KQuant::Q5K => {
            let (d16, dmin16) = (f16_raw(sb, 0), f16_raw(sb, 2));
            let (d, dmin) = (d16.to_f32(), dmin16.to_f32());
            let scales = &sb[4..4 + K_SCALE_BYTES];
            let mut at = 4 + K_SCALE_BYTES;
            let qh = (kind == KQuant::Q5K).then(|| {
                at += QK_K / 8;
                &sb[at - QK_K / 8..at]
            });
            let qs = &sb[at..at + QK_K / 2];
            for (j, blk) in out.iter_mut().enumerate() {
                let (sc, mn) = scale_min(j, scales);
                // sub-blocks 2p and 2p + 1 share 32 bytes: low nibbles, then high nibbles
                let bytes = &qs[(j / 2) * QK4_1..(j / 2 + 1) * QK4_1];
                for (l, v) in blk.vals.iter_mut().enumerate() {
                    let nibble = if j % 2 == 0 {
                        bytes[l] & 0xF
                    } else {
                        bytes[l] >> 4
                    };
                    let fifth = qh.map_or(0, |h| (h[l] >> j) & 1);
                    *v = nibble | (fifth << 4);
                }
                blk.d = [d * sc as f32; 2];
                blk.m = [-(dmin * mn as f32); 2];
                // (6-bit integers: they fit an i8)
                blk.factors = Some(Factors {
                    d_base: d16,
                    d_mul: [sc as i8; 2],
                    m_base: -dmin16,
                    m_mul: mn as i8,
                });
            }
        }
        KQuant::Q6K => {
            let (ql, qh) = (&sb[..QK_K / 2], &sb[QK_K / 2..QK_K / 2 + QK_K / 4]);
            let sc = &sb[QK_K / 2 + QK_K / 4..QK_K / 2 + QK_K / 4 + QK_K / 16];
            let d16 = f16_raw(sb, QK_K / 2 + QK_K / 4 + QK_K / 16);
            let d = d16.to_f32();
            // each half of the super-block: 64 bytes of low nibbles, 32 of high bit pairs
            for n in 0..2 {
                let (ql, qh, sc) = (&ql[n * 64..], &qh[n * 32..], &sc[n * 8..]);
                for k in 0..4 {
                    let blk = &mut out[n * 4 + k];
                    for l in 0..QK4_1 {
                        let byte = ql[l + 32 * (k % 2)];
                        let low = if k < 2 { byte & 0xF } else { byte >> 4 };
                        // value 32k + l of this half: shifts 0, 2, 4, 6 for k = 0, 1, 2, 3
                        let high = (qh[l] >> (2 * k)) & 3;
                        blk.vals[l] = low | (high << 4);
                    }
                    for h in 0..2 {
                        blk.d[h] = d * sc[2 * k + h] as i8 as f32;
                        blk.m[h] = -32.0 * blk.d[h];
                    }
                    blk.factors = Some(Factors {
                        d_mul: [sc[2 * k] as i8, sc[2 * k + 1] as i8],
                        d_base: d16,
                        ..Factors::ZERO
                    });
                }
            }
        }
    }
    out
}

impl PackedMatrix {
    /// From GGUF/ggml K-quant bytes; `None` when the sizes do not match.
    pub fn from_k_quant(kind: KQuant, bytes: &[u8], n_out: usize, n_in: usize) -> Option<Self> {
        Self::from_k_quant_releasing(kind, bytes, n_out, n_in, &|_| {})
    }

    /// [`PackedMatrix::from_k_quant`], handing each packed run of rows' bytes to `release`
    /// (see [`PackedMatrix::build`]).
    pub fn from_k_quant_releasing(
        kind: KQuant,
        bytes: &[u8],
        n_out: usize,
        n_in: usize,
        release: super::packed::Release,
    ) -> Option<Self> {
        let bb = kind.block_bytes();
        if n_out == 0 || !n_in.is_multiple_of(QK_K) || bytes.len() != n_out * n_in / QK_K * bb {
            return None;
        }
        let per_row = n_in / QK_K;
        Some(Self::build(
            kind.target(),
            n_out,
            n_in,
            true,
            |o, blocks| {
                for (s, out) in blocks.chunks_exact_mut(BLOCKS).enumerate() {
                    let sb = o * per_row + s;
                    out.copy_from_slice(&decode(kind, &bytes[sb * bb..(sb + 1) * bb]));
                }
            },
            (bytes, release),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::lcg;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    fn quantized(kind: KQuant, n_out: usize, n_in: usize, seed: &mut u64) -> (Vec<u8>, Vec<f32>) {
        let dtype = match kind {
            KQuant::Q4K => GgmlDType::Q4K,
            KQuant::Q5K => GgmlDType::Q5K,
            KQuant::Q6K => GgmlDType::Q6K,
        };
        let x: Vec<f32> = (0..n_out * n_in).map(|_| lcg(seed) * 0.1).collect();
        let t = Tensor::from_vec(x, (n_out, n_in), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, dtype).unwrap();
        let dense = q.dequantize(&Device::Cpu).unwrap();
        let dense = dense.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (q.data().unwrap().to_vec(), dense)
    }

    const KINDS: [KQuant; 3] = [KQuant::Q4K, KQuant::Q5K, KQuant::Q6K];

    #[test]
    fn blocks_hold_ggml_values_exactly() {
        let mut seed = 21;
        for kind in KINDS {
            let (bytes, dense) = quantized(kind, 9, 512, &mut seed);
            let w = PackedMatrix::from_k_quant(kind, &bytes, 9, 512).unwrap();
            for o in 0..9 {
                for b in 0..512 / QK4_1 {
                    let blk = w.row_block(o, b);
                    for i in 0..QK4_1 {
                        let want = dense[o * 512 + b * QK4_1 + i];
                        assert_eq!(blk.value(i), want, "{kind:?} row {o} block {b} value {i}");
                    }
                }
            }
            assert!(PackedMatrix::from_k_quant(kind, &bytes[1..], 9, 512).is_none());
            assert!(PackedMatrix::from_k_quant(kind, &bytes, 9, 500).is_none());
        }
    }

    #[test]
    fn scales_stay_factored_and_take_about_the_files_bytes() {
        let mut seed = 24;
        for kind in KINDS {
            let (bytes, _) = quantized(kind, 16, 512, &mut seed);
            let w = PackedMatrix::from_k_quant(kind, &bytes, 16, 512).unwrap();
            assert!(w.factored(), "{kind:?}");
            // a byte per block (or half) and 2 bytes per super-block for each of d and m,
            // against 4 bytes per block each as f32 values (1.33 and 1.52 of the file), and
            // Q6_K's values in 6 bits (as bytes, 1.30)
            let held = w.resident_bytes() as f64 / bytes.len() as f64;
            assert!(held <= 1.03, "{kind:?}: {held:.3} of the file's bytes");
            // stacked with a part of the same kind (whole row groups or not) it stays
            // factored and keeps every value
            let (more, _) = quantized(kind, 5, 512, &mut seed);
            let tail = PackedMatrix::from_k_quant(kind, &more, 5, 512).unwrap();
            for parts in [[&w, &tail], [&tail, &w]] {
                let both = PackedMatrix::concat(&parts).unwrap();
                assert!(both.factored(), "{kind:?}");
                let mut row = 0;
                for p in parts {
                    for o in 0..p.n_out {
                        for b in 0..512 / QK4_1 {
                            let (x, y) = (p.row_block(o, b), both.row_block(row, b));
                            assert_eq!((x.d, x.m, x.vals), (y.d, y.m, y.vals), "{kind:?}");
                        }
                        row += 1;
                    }
                }
            }
        }
    }

    #[test]
    fn products_match_a_dequantized_reference() {
        let mut seed = 22;
        for kind in KINDS {
            for &(n_out, n_in) in &[(7usize, 256usize), (13, 1024)] {
                let (bytes, dense) = quantized(kind, n_out, n_in, &mut seed);
                let w = PackedMatrix::from_k_quant(kind, &bytes, n_out, n_in).unwrap();
                crate::kernels::check_against_reference(
                    &format!("{kind:?}"),
                    &dense,
                    n_out,
                    n_in,
                    &mut seed,
                    |x, m, out| w.matmul(x, m, out),
                    |row| row.iter().map(|v| v.abs()).sum::<f32>() * 0.5 / 127.0 + 1e-4,
                );
            }
        }
    }

    #[test]
    fn simd_paths_agree_and_rows_do_not_depend_on_the_batch() {
        let mut seed = 23;
        for kind in KINDS {
            let (bytes, _) = quantized(kind, 12, 512, &mut seed);
            let w = PackedMatrix::from_k_quant(kind, &bytes, 12, 512).unwrap();
            crate::kernels::packed::tests::assert_paths_agree(&w, &mut seed);
            // several pairs of groups, the last of them partial
            let (many, _) = quantized(kind, 44, 512, &mut seed);
            let many = PackedMatrix::from_k_quant(kind, &many, 44, 512).unwrap();
            crate::kernels::packed::tests::assert_paths_agree(&many, &mut seed);
            let x: Vec<f32> = (0..9 * 512).map(|_| lcg(&mut seed)).collect();
            let mut all = vec![0f32; 9 * 12];
            w.matmul(&x, 9, &mut all);
            for r in [0usize, 4, 8] {
                let mut one = vec![0f32; 12];
                w.matmul(&x[r * 512..(r + 1) * 512], 1, &mut one);
                assert_eq!(one, all[r * 12..(r + 1) * 12], "{kind:?} row {r}");
            }
        }
    }
}
