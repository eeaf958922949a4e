//! Packing: ggml's blocks of a matrix re-laid out in interleaved row groups (one 256-bit lane
//! per row), the scales in the precision they need.

use super::*;

/// What [`PackedMatrix::build`] hands each packed run of rows' file bytes (so that a caller
/// reading a mapping can drop their pages).
pub type Release<'a> = &'a (dyn Fn(&[u8]) + Sync);

/// The file bytes [`PackedMatrix::build`] packs rows from, and what it hands each packed run
/// of them.
pub(crate) type Source<'a> = (&'a [u8], Release<'a>);

/// Most rows [`PackedMatrix::build`] packs before it reports them packed (with one such run in
/// flight per thread, the bound on a matrix resident in both layouts while it loads).
const RELEASE_ROWS: usize = 4096;

impl PackedMatrix {
    /// From GGUF/ggml block bytes of `kind`.
    pub fn from_bytes(kind: PackedType, bytes: &[u8], n_out: usize, n_in: usize) -> Option<Self> {
        Self::from_bytes_releasing(kind, bytes, n_out, n_in, &|_| {})
    }

    /// [`PackedMatrix::from_bytes`], handing each packed run of rows' bytes to `release`
    /// (see [`PackedMatrix::build`]).
    pub fn from_bytes_releasing(
        kind: PackedType,
        bytes: &[u8],
        n_out: usize,
        n_in: usize,
        release: Release,
    ) -> Option<Self> {
        let bb = kind.block_bytes();
        if kind == PackedType::Q6K
            || n_out == 0
            || !n_in.is_multiple_of(QK4_1)
            || bytes.len() != n_out * n_in / QK4_1 * bb
        {
            return None;
        }
        let nb = n_in / QK4_1;
        let block = |o: usize, b: usize| {
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
        };
        Some(Self::build(
            kind,
            n_out,
            n_in,
            false,
            |o, blocks| {
                for (b, blk) in blocks.iter_mut().enumerate() {
                    *blk = block(o, b);
                }
            },
            (bytes, release),
        ))
    }

    /// Packs the rows `row_blocks(o, blocks)` writes (all `n_in / 32` blocks of row `o`),
    /// row groups in parallel on the calling thread's share of the pool: repacking is most
    /// of a model's load, and the threads that write the packed pages first also fault them
    /// in. `(source, release)`: the rows' bytes in the file, equal runs per row (empty when
    /// there is no file), and what is handed each run of at most [`RELEASE_ROWS`] rows of
    /// them once packed, so a caller reading a mapping can drop the run's pages: a large
    /// matrix (a 262k-row output head) is then never resident in both layouts at once, and
    /// it is packed in one piece (packed in parts and appended, the copies were a fifth of
    /// a 1B model's load). `factored`: every block carries [`Factors`] (K-quants, whose rows
    /// are whole super-blocks), kept as [`Scales::Factored`].
    pub(crate) fn build(
        kind: PackedType,
        n_out: usize,
        n_in: usize,
        factored: bool,
        row_blocks: impl Fn(usize, &mut [RowBlock]) + Sync,
        (source, release): Source,
    ) -> Self {
        let row_bytes = source.len() / n_out;
        let nb = n_in / QK4_1;
        let groups = n_out.div_ceil(GROUP);
        let halves = kind.halves();
        let scales = nb * GROUP * halves;
        let gbb = kind.group_block_bytes();
        let (has_min, high) = (kind.has_min(), kind.has_high_bits());
        assert!(!factored || nb.is_multiple_of(SUPER_BLOCKS));
        // a factor per row and run of `per` scales (a super-block's blocks, or halves)
        let per = SUPER_BLOCKS * halves;
        let (n_plain, n_factored) = if factored {
            (0, groups * scales)
        } else {
            (groups * scales, 0)
        };
        let with_min = |n: usize| if has_min { n } else { 0 };
        let mut d = Vec::<f32>::with_capacity(n_plain);
        let mut m = Vec::<f32>::with_capacity(with_min(n_plain));
        let mut d_mul = Vec::<i8>::with_capacity(n_factored);
        let mut d_base = Vec::<f16>::with_capacity(n_factored / per);
        let mut m_mul = Vec::<i8>::with_capacity(with_min(n_factored));
        let mut m_base = Vec::<f16>::with_capacity(with_min(n_factored / per));
        let mut qs = Vec::<u8>::with_capacity(groups * nb * gbb);
        let mut qh = Vec::<u32>::with_capacity(if high { groups * nb * GROUP } else { 0 });
        let out = Spare {
            d: d.as_mut_ptr(),
            m: m.as_mut_ptr(),
            d_mul: d_mul.as_mut_ptr(),
            d_base: d_base.as_mut_ptr(),
            m_mul: m_mul.as_mut_ptr(),
            m_base: m_base.as_mut_ptr(),
            qs: qs.as_mut_ptr(),
            qh: qh.as_mut_ptr(),
        };
        let zero = RowBlock {
            factors: factored.then_some(Factors::ZERO),
            ..RowBlock::new(0.0, 0.0, [0; QK4_1])
        };
        let pack_groups = |range: std::ops::Range<usize>, rows: &mut [RowBlock]| {
            for g in range {
                for (j, blocks) in rows.chunks_exact_mut(nb).enumerate() {
                    if g * GROUP + j < n_out {
                        row_blocks(g * GROUP + j, blocks);
                    } else {
                        blocks.fill(zero);
                    }
                }
                // SAFETY: group `g` writes only its own ranges of the four arrays, each
                // within the capacity reserved above; no other task has the same `g`.
                unsafe {
                    let (mut di, mut qi, mut hi) = (g * scales, g * nb * gbb, g * nb * GROUP);
                    for b in 0..nb {
                        let row = |j: usize| &rows[j * nb + b];
                        for h in 0..halves {
                            for j in 0..GROUP {
                                let r = row(j);
                                if let (true, Some(f)) = (factored, r.factors) {
                                    // the factor once per run (the first of its scales)
                                    let at = (di / GROUP)
                                        .is_multiple_of(per)
                                        .then(|| (di / GROUP / per) * GROUP + j);
                                    debug_assert_eq!(
                                        (f.d_base.to_f32() * f.d_mul[h] as f32).to_bits(),
                                        r.d[h].to_bits()
                                    );
                                    out.d_mul().add(di).write(f.d_mul[h]);
                                    if let Some(at) = at {
                                        out.d_base().add(at).write(f.d_base);
                                    }
                                    if has_min {
                                        out.m_mul().add(di).write(f.m_mul);
                                        if let Some(at) = at {
                                            out.m_base().add(at).write(f.m_base);
                                        }
                                    }
                                } else {
                                    assert!(!factored, "a factored matrix's block without factors");
                                    out.d().add(di).write(r.d[h]);
                                    if has_min {
                                        out.m().add(di).write(r.m[h]);
                                    }
                                }
                                di += 1;
                            }
                        }
                        if kind.byte_values() {
                            for q in 0..QK8_0 / 4 {
                                for j in 0..GROUP {
                                    for t in 0..4 {
                                        out.qs().add(qi).write(row(j).vals[4 * q + t]);
                                        qi += 1;
                                    }
                                }
                            }
                            continue;
                        }
                        for c in 0..4 {
                            for j in 0..GROUP {
                                let vals = &row(j).vals;
                                for t in 0..4 {
                                    let (lo, hi) = (vals[4 * c + t], vals[PACKED + 4 * c + t]);
                                    out.qs().add(qi).write((lo & 0x0F) | (hi & 0x0F) << 4);
                                    qi += 1;
                                }
                            }
                        }
                        if kind.six_bits() {
                            for plane in 0..2 {
                                for j in 0..GROUP {
                                    let vals = &row(j).vals;
                                    for t in 0..4 {
                                        let bits = (0..4).fold(0u8, |bits, k| {
                                            let v = vals[4 * (4 * plane + k) + t];
                                            bits | ((v >> 4) & 3) << (2 * k)
                                        });
                                        out.qs().add(qi).write(bits);
                                        qi += 1;
                                    }
                                }
                            }
                        }
                        if high {
                            for j in 0..GROUP {
                                let mut w = 0u32;
                                for (i, &v) in row(j).vals.iter().enumerate() {
                                    let (q, t) = (i / 4, i % 4);
                                    let pos = if q < 4 { 8 * t + 4 + q } else { 8 * t + q - 4 };
                                    w |= ((v as u32 >> 4) & 1) << pos;
                                }
                                out.qh().add(hi).write(w);
                                hi += 1;
                            }
                        }
                    }
                }
            }
        };
        // steps of a few groups per thread, for balance, and of at most `RELEASE_ROWS`
        let threads = crate::pool::threads();
        let step = (RELEASE_ROWS / GROUP)
            .min(groups.div_ceil(4 * threads))
            .max(1);
        crate::pool::for_each_chunk(groups.div_ceil(step), |steps| {
            let mut rows = vec![zero; GROUP * nb];
            for s in steps {
                let range = s * step..groups.min((s + 1) * step);
                pack_groups(range.clone(), &mut rows);
                let done = range.start * GROUP..n_out.min(range.end * GROUP);
                release(&source[done.start * row_bytes..done.end * row_bytes]);
            }
        });
        // SAFETY: the groups together wrote every element up to these lengths.
        unsafe {
            d.set_len(n_plain);
            m.set_len(with_min(n_plain));
            d_mul.set_len(n_factored);
            d_base.set_len(n_factored / per);
            m_mul.set_len(with_min(n_factored));
            m_base.set_len(with_min(n_factored / per));
            qs.set_len(groups * nb * gbb);
            if high {
                qh.set_len(groups * nb * GROUP);
            }
        }
        let shift = per.trailing_zeros();
        let (d, m) = if factored {
            (
                Scales::factored(d_base, d_mul, shift),
                Scales::factored(m_base, m_mul, shift),
            )
        } else {
            (Scales::new(d), Scales::new(m))
        };
        PackedMatrix {
            n_out,
            n_in,
            kind,
            nb,
            d,
            m,
            qs: qs.into(),
            qh: qh.into(),
        }
    }
}

/// Where [`PackedMatrix::build`]'s tasks write: the arrays' reserved, not yet initialised
/// memory.
#[derive(Clone, Copy)]
struct Spare {
    d: *mut f32,
    m: *mut f32,
    d_mul: *mut i8,
    d_base: *mut f16,
    m_mul: *mut i8,
    m_base: *mut f16,
    qs: *mut u8,
    qh: *mut u32,
}

impl Spare {
    // (methods, so that closures capture the whole `Spare`, not its raw pointers)
    fn d(&self) -> *mut f32 {
        self.d
    }
    fn m(&self) -> *mut f32 {
        self.m
    }
    fn d_mul(&self) -> *mut i8 {
        self.d_mul
    }
    fn d_base(&self) -> *mut f16 {
        self.d_base
    }
    fn m_mul(&self) -> *mut i8 {
        self.m_mul
    }
    fn m_base(&self) -> *mut f16 {
        self.m_base
    }
    fn qs(&self) -> *mut u8 {
        self.qs
    }
    fn qh(&self) -> *mut u32 {
        self.qh
    }
}

// SAFETY: each task writes a disjoint range (its row groups'), see `build`.
unsafe impl Send for Spare {}
unsafe impl Sync for Spare {}
