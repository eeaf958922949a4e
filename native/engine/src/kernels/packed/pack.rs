//! Packing: ggml's blocks of a matrix re-laid out in interleaved row groups (one 256-bit lane
//! per row), the scales in the precision they need.

use super::*;

impl PackedMatrix {
    /// From GGUF/ggml block bytes of `kind`.
    pub fn from_bytes(kind: PackedType, bytes: &[u8], n_out: usize, n_in: usize) -> Option<Self> {
        let bb = kind.block_bytes();
        if kind == PackedType::Q6K
            || n_out == 0
            || !n_in.is_multiple_of(QK4_1)
            || bytes.len() != n_out * n_in / QK4_1 * bb
        {
            return None;
        }
        let nb = n_in / QK4_1;
        Some(Self::build(kind, n_out, n_in, |o, b| {
            let block = &bytes[(o * nb + b) * bb..][..bb];
            let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
            let mut at = 2;
            let m = if kind.has_min() {
                at += 2;
                f16::from_le_bytes([block[2], block[3]]).to_f32()
            } else {
                kind.implied_offset() * d
            };
            let mut high = 0u32;
            if kind.has_high_bits() {
                high = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
                at += 4;
            }
            let mut vals = [0u8; QK4_1];
            if kind == PackedType::Q8_0 {
                for (v, &q) in vals.iter_mut().zip(&block[2..2 + QK8_0]) {
                    *v = (q as i8 as i16 + 128) as u8;
                }
                return RowBlock::new(d, m, vals);
            }
            for (i, &byte) in block[at..at + PACKED].iter().enumerate() {
                vals[i] = (byte & 0x0F) | (((high >> i) & 1) << 4) as u8;
                vals[i + PACKED] = (byte >> 4) | (((high >> (i + PACKED)) & 1) << 4) as u8;
            }
            RowBlock::new(d, m, vals)
        }))
    }
    pub(crate) fn build(
        kind: PackedType,
        n_out: usize,
        n_in: usize,
        mut row_block: impl FnMut(usize, usize) -> RowBlock,
    ) -> Self {
        let nb = n_in / QK4_1;
        let blocks = n_out.div_ceil(GROUP) * nb;
        let halves = kind.halves();
        let mut d = Vec::with_capacity(blocks * GROUP * halves);
        let mut m = Vec::with_capacity(if kind.has_min() {
            blocks * GROUP * halves
        } else {
            0
        });
        let mut qs = Vec::with_capacity(blocks * kind.group_block_bytes());
        let mut qh = Vec::with_capacity(if kind.has_high_bits() {
            blocks * GROUP
        } else {
            0
        });
        let mut rows = [RowBlock::new(0.0, 0.0, [0; QK4_1]); GROUP];
        for g in 0..n_out.div_ceil(GROUP) {
            for b in 0..nb {
                for (j, row) in rows.iter_mut().enumerate() {
                    let o = g * GROUP + j;
                    if o < n_out {
                        *row = row_block(o, b);
                    } else {
                        *row = RowBlock::new(0.0, 0.0, [0; QK4_1]);
                    }
                }
                for h in 0..halves {
                    d.extend(rows.iter().map(|r| r.d[h]));
                    if kind.has_min() {
                        m.extend(rows.iter().map(|r| r.m[h]));
                    }
                }
                if kind.byte_values() {
                    for q in 0..QK8_0 / 4 {
                        for RowBlock { vals, .. } in &rows {
                            qs.extend_from_slice(&vals[4 * q..4 * q + 4]);
                        }
                    }
                    continue;
                }
                for c in 0..4 {
                    for RowBlock { vals, .. } in &rows {
                        for t in 0..4 {
                            qs.push(
                                (vals[4 * c + t] & 0x0F) | (vals[PACKED + 4 * c + t] & 0x0F) << 4,
                            );
                        }
                    }
                }
                if kind.has_high_bits() {
                    for RowBlock { vals, .. } in &rows {
                        let mut w = 0u32;
                        for (i, &v) in vals.iter().enumerate() {
                            let (q, t) = (i / 4, i % 4);
                            let pos = if q < 4 { 8 * t + 4 + q } else { 8 * t + q - 4 };
                            w |= ((v as u32 >> 4) & 1) << pos;
                        }
                        qh.push(w);
                    }
                }
            }
        }
        PackedMatrix {
            n_out,
            n_in,
            kind,
            nb,
            d: Scales::new(d),
            m: Scales::new(m),
            qs: qs.into(),
            qh: qh.into(),
        }
    }
}
