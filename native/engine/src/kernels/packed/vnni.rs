//! The AVX-512 VNNI products: `vpdpbusd` dot products, the one-group kernel built from them,
//! and the two-group kernels: decode batches in 512-bit vectors (`wide_kernel_vnni`),
//! prompts two row groups per activation broadcast (`pair_kernel_vnni`).

use super::avx2::block_dot_avx2_signed;
use super::x86::*;
use super::*;
use crate::kernels::q8::Q8Activations;

/// `C` independent chains: one row alone needs several to hide `vpdpbusd`'s latency, while
/// many rows in flight hide it themselves and need the registers for their accumulators
/// (`NARROW` only matters to AVX2: `vpdpbusd` widens to 32 bits itself).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
#[inline]
pub(super) unsafe fn block_dot_vnni<const C: usize, const NARROW: bool>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    folded: i32,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let mut s = [_mm256_setzero_si256(); C];
    s[0] = _mm256_set1_epi32(folded);
    for (q, vq) in v.iter().enumerate() {
        s[q % C] = _mm256_dpbusd_epi32(s[q % C], *vq, _mm256_set1_epi32(*x.add(q)));
    }
    let mut sum = s[0];
    for &c in &s[1..] {
        sum = _mm256_add_epi32(sum, c);
    }
    sum
}

/// `C` chains per half.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
#[inline]
pub(super) unsafe fn half_dots_vnni<const C: usize>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    folded: [i32; 2],
) -> [std::arch::x86_64::__m256i; 2] {
    use std::arch::x86_64::*;
    let mut out = [_mm256_setzero_si256(); 2];
    for (h, half) in out.iter_mut().enumerate() {
        let mut s = [_mm256_setzero_si256(); C];
        s[0] = _mm256_set1_epi32(folded[h]);
        for q in 0..4 {
            let at = 4 * h + q;
            s[q % C] = _mm256_dpbusd_epi32(s[q % C], v[at], _mm256_set1_epi32(*x.add(at)));
        }
        *half = s[0];
        for &c in &s[1..] {
            *half = _mm256_add_epi32(*half, c);
        }
    }
    out
}

group_kernel!(
    group_kernel_vnni,
    group_pass_vnni,
    "avx2,fma,f16c,avx512vnni,avx512vl",
    block_dot_vnni,
    half_dots_vnni,
    false,
    false,
    false,
    8,
    [1, 2, 3, 4, 5, 6, 7, 8]
);

/// Rows per pass of [`wide_kernel_vnni`].
#[cfg(target_arch = "x86_64")]
pub(super) const WIDE_ROWS: usize = 8;

/// Row groups `g` and `g + 1` times every activation row of a short batch (decode), on the
/// VNNI path, in 512-bit vectors: lanes 0..8 are group `g`'s rows, 8..16 group `g + 1`'s. An
/// activation quad is broadcast once for 16 weight rows instead of 8, halving the loads of a
/// pass, which bound the 256-bit one-group passes;
/// `vpdpbusd` on 512 bits does the work of two on 256 (Zen 4 splits it in two halves, Intel's
/// server cores run it on two ports). Each lane's arithmetic is the one of
/// `group_kernel_vnni`, so results are bitwise the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni,avx512vl")]
pub(super) unsafe fn wide_kernel_vnni(w: &PackedMatrix, a: &Q8Activations, g: usize, out: &Dest) {
    let (p, valid) = GroupRef::pair(w, g);
    let mut r0 = 0;
    while r0 < a.m {
        let rows = (a.m - r0).min(WIDE_ROWS);
        // the first pass asks for the next tile's blocks while computing this one's: unlike
        // one group's blocks, read as one sequential stream, two groups' blocks are read as
        // two streams that jump ahead by a group at every tile, which the hardware
        // prefetchers do not follow (without these prefetches a 512-bit pass over Gemma 3's
        // head read 12-13 GB/s on one core, 256-bit ones 18-21)
        let prefetch = r0 == 0;
        macro_rules! pass {
            ($($r:literal),*) => {
                match (rows, prefetch) {
                    $(($r, true) => wide_pass_vnni::<$r, true>(w, &p, a, r0, valid, g, out),
                      ($r, false) => wide_pass_vnni::<$r, false>(w, &p, a, r0, valid, g, out),)*
                    _ => unreachable!(),
                }
            };
        }
        pass!(1, 2, 3, 4, 5, 6, 7, 8);
        r0 += rows;
    }
}

/// Two 256-bit halves as one 512-bit vector (`lo` in lanes 0..8).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn join_si(
    lo: std::arch::x86_64::__m256i,
    hi: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// Group `g`'s 8 scales at `lo` and group `g + 1`'s at `hi` as one vector.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c,avx512f")]
#[inline]
pub(super) unsafe fn join_ps(lo: ScalePtr, hi: ScalePtr) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let lo = _mm256_castps_si256(lo.load8());
    let hi = _mm256_castps_si256(hi.load8());
    _mm512_castsi512_ps(join_si(lo, hi))
}

/// The 8 quads of block `b` of both row groups: vector `q` holds values `4q..4q + 4` of
/// each of the 16 rows (the unpacking of [`unpack_block`] on both halves at once).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f")]
#[inline]
pub(super) unsafe fn wide_block(p: &[GroupRef; 2], b: usize) -> [std::arch::x86_64::__m512i; 8] {
    use std::arch::x86_64::*;
    let load =
        |j: usize, at: usize| _mm256_loadu_si256(p[j].q.add(b * p[j].gbb + at) as *const __m256i);
    let mut v = [_mm512_setzero_si512(); 8];
    if p[0].bytes8 {
        for (q, vq) in v.iter_mut().enumerate() {
            *vq = join_si(load(0, q * 32), load(1, q * 32));
        }
        return v;
    }
    let low = _mm512_set1_epi8(0x0F);
    for c in 0..4 {
        let packed = join_si(load(0, c * 32), load(1, c * 32));
        v[c] = _mm512_and_si512(packed, low);
        // per byte, the high nibble (what a shift crosses into a byte is masked off)
        v[c + 4] = _mm512_and_si512(_mm512_srli_epi32::<4>(packed), low);
    }
    if let (Some(h0), Some(h1)) = (p[0].h, p[1].h) {
        let w = join_si(
            _mm256_loadu_si256(h0.add(b * GROUP) as *const __m256i),
            _mm256_loadu_si256(h1.add(b * GROUP) as *const __m256i),
        );
        let fifth = _mm512_set1_epi8(0x10);
        let or = |v: __m512i, bits: __m512i| _mm512_or_si512(v, _mm512_and_si512(bits, fifth));
        v[0] = or(v[0], w);
        v[1] = or(v[1], _mm512_srli_epi32::<1>(w));
        v[2] = or(v[2], _mm512_srli_epi32::<2>(w));
        v[3] = or(v[3], _mm512_srli_epi32::<3>(w));
        v[4] = or(v[4], _mm512_slli_epi32::<4>(w));
        v[5] = or(v[5], _mm512_slli_epi32::<3>(w));
        v[6] = or(v[6], _mm512_slli_epi32::<2>(w));
        v[7] = or(v[7], _mm512_slli_epi32::<1>(w));
    }
    v
}

/// Per lane (row of either group), the dot product of the quads `quads` with one activation
/// block, plus `folded`, in `C` independent chains (as [`block_dot_vnni`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
pub(super) unsafe fn wide_dot<const C: usize>(
    v: &[std::arch::x86_64::__m512i; 8],
    quads: std::ops::Range<usize>,
    x: *const i32,
    folded: i32,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let mut s = [_mm512_setzero_si512(); C];
    s[0] = _mm512_set1_epi32(folded);
    for (n, q) in quads.enumerate() {
        s[n % C] = _mm512_dpbusd_epi32(s[n % C], v[q], _mm512_set1_epi32(*x.add(q)));
    }
    let mut sum = s[0];
    for &c in &s[1..] {
        sum = _mm512_add_epi32(sum, c);
    }
    sum
}

/// `R` activation rows times both row groups of [`wide_kernel_vnni`]; the blocks are
/// unpacked in registers once per pass, as `group_kernel!`'s short batches do.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni,avx512vl")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn wide_pass_vnni<const R: usize, const PREFETCH: bool>(
    w: &PackedMatrix,
    p: &[GroupRef; 2],
    a: &Q8Activations,
    r0: usize,
    valid: [usize; 2],
    g: usize,
    out: &Dest,
) {
    use std::arch::x86_64::*;
    let (k, nb) = (w.n_in, w.nb);
    // one row alone needs several chains to hide `vpdpbusd`'s latency; many rows hide it
    // themselves and need the registers
    macro_rules! dot {
        ($v:expr, $quads:expr, $x:expr, $folded:expr) => {
            if R >= 4 {
                wide_dot::<1>($v, $quads, $x, $folded)
            } else if R >= 2 {
                wide_dot::<2>($v, $quads, $x, $folded)
            } else {
                wide_dot::<4>($v, $quads, $x, $folded)
            }
        };
    }
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        if PREFETCH {
            // the next tile: groups g + 2 and g + 3
            // the next tile (groups g + 2 and g + 3) to the outer caches: `T0` prefetches
            // of 16 rows' blocks take the L1 miss buffers the loads need (an 8-row head
            // product at 77-82 GMAC/s with them, 111-131 with `T2`)
            p[0].prefetch_block::<_MM_HINT_T2>(2 * nb + b);
            p[1].prefetch_block::<_MM_HINT_T2>(2 * nb + b);
        }
        let v = wide_block(p, b);
        let x = |i: usize| a.quants.as_ptr().add((r0 + i) * k + b * QK4_1) as *const i32;
        let at = |i: usize| (r0 + i) * nb + b;
        if p[0].halves == 2 {
            // (split types have implied offsets, folded into the integers)
            let dv = join_ps(p[0].d.add(b * GROUP * 2), p[1].d.add(b * GROUP * 2));
            let dv1 = join_ps(
                p[0].d.add(b * GROUP * 2 + GROUP),
                p[1].d.add(b * GROUP * 2 + GROUP),
            );
            for (i, acc) in acc.iter_mut().enumerate() {
                let f = a.folded_halves.as_ptr().add(2 * at(i));
                let lo = dot!(&v, 0..4, x(i), *f);
                let hi = dot!(&v, 4..8, x(i), *f.add(1));
                let dx = _mm512_set1_ps(*a.scales.get_unchecked(at(i)));
                let dot_lo = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), dv);
                let dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), dv1, dot_lo);
                *acc = _mm512_fmadd_ps(dot, dx, *acc);
            }
            continue;
        }
        let dv = join_ps(p[0].d.add(b * GROUP), p[1].d.add(b * GROUP));
        match (p[0].m, p[1].m) {
            (Some(m0), Some(m1)) => {
                let mv = join_ps(m0.add(b * GROUP), m1.add(b * GROUP));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let dot = _mm512_cvtepi32_ps(dot!(&v, 0..8, x(i), 0));
                    let dx = _mm512_set1_ps(*a.scales.get_unchecked(at(i)));
                    let sx = _mm512_set1_ps(*a.sums.get_unchecked(at(i)));
                    *acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, dx), *acc);
                    *acc = _mm512_fmadd_ps(mv, sx, *acc);
                }
            }
            _ => {
                for (i, acc) in acc.iter_mut().enumerate() {
                    let folded = *a.folded.get_unchecked(at(i));
                    let dot = _mm512_cvtepi32_ps(dot!(&v, 0..8, x(i), folded));
                    let dx = _mm512_set1_ps(*a.scales.get_unchecked(at(i)));
                    *acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, dx), *acc);
                }
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        let bits = _mm512_castps_si512(*acc);
        let lo = _mm256_castsi256_ps(_mm512_castsi512_si256(bits));
        let hi = _mm256_castsi256_ps(_mm512_extracti64x4_epi64::<1>(bits));
        store_group(lo, out.at(r0 + i, g * GROUP), valid[0]);
        store_group(hi, out.at(r0 + i, (g + 1) * GROUP), valid[1]);
    }
}

/// Activation rows per pass of [`pair_kernel_vnni`].
#[cfg(target_arch = "x86_64")]
pub(super) const PAIR_ROWS: usize = 4;

/// Row groups `g` and `g + 1` times every activation row of a long batch (a prompt), on the
/// VNNI path. Both groups' blocks are unpacked once into the thread's buffer; each pass of
/// up to [`PAIR_ROWS`] activation rows loads an activation quad once for the two groups'
/// `vpdpbusd`s, so a pass issues 6 loads per 8 of them where a one-group pass issues 5 per 4
/// — one group's passes were bound by loads. Each row's
/// arithmetic is the one of `group_kernel_vnni`, so results are bitwise the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(super) unsafe fn pair_kernel_vnni(w: &PackedMatrix, a: &Q8Activations, g: usize, out: &Dest) {
    let (p, valid) = GroupRef::pair(w, g);
    let run = |buffered: &mut Vec<[std::arch::x86_64::__m256i; 8]>| {
        buffered.clear();
        for b in 0..w.nb {
            buffered.push(group_block(&p[0], b));
            buffered.push(group_block(&p[1], b));
        }
        let mut r0 = 0;
        while r0 < a.m {
            let rows = (a.m - r0).min(PAIR_ROWS);
            let pass = match rows {
                1 => pair_pass_vnni::<1>,
                2 => pair_pass_vnni::<2>,
                3 => pair_pass_vnni::<3>,
                4 => pair_pass_vnni::<4>,
                _ => unreachable!(),
            };
            pass(w, &p, buffered, a, r0, valid, g, out);
            r0 += rows;
        }
    };
    BUFFERED.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buffered) => run(&mut buffered),
        Err(_) => run(&mut Vec::new()),
    })
}

/// `R` activation rows times the two buffered row groups of [`pair_kernel_vnni`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pair_pass_vnni<const R: usize>(
    w: &PackedMatrix,
    p: &[GroupRef; 2],
    buffered: &[[std::arch::x86_64::__m256i; 8]],
    a: &Q8Activations,
    r0: usize,
    valid: [usize; 2],
    g: usize,
    out: &Dest,
) {
    use std::arch::x86_64::*;
    let (k, nb) = (w.n_in, w.nb);
    let zero = _mm256_setzero_si256();
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for b in 0..nb {
        let v = [&buffered[2 * b], &buffered[2 * b + 1]];
        let x = |i: usize| a.quants.as_ptr().add((r0 + i) * k + b * QK4_1) as *const i32;
        let at = |i: usize| (r0 + i) * nb + b;
        // integer dots of quads `quads` for every row and both groups, plus the rows' folded
        // offsets `folded(i)`; quad-major so each activation broadcast and each weight vector
        // is loaded once per pass (the offsets are added last: starting the chains from them
        // made the compiler spill)
        let dots = |quads: std::ops::Range<usize>, folded: &dyn Fn(usize) -> i32| {
            let mut s = [[zero; 2]; R];
            for q in quads {
                let (v0, v1) = (v[0][q], v[1][q]);
                for (i, s) in s.iter_mut().enumerate() {
                    let xq = _mm256_set1_epi32(*x(i).add(q));
                    s[0] = _mm256_dpbusd_epi32(s[0], v0, xq);
                    s[1] = _mm256_dpbusd_epi32(s[1], v1, xq);
                }
            }
            for (i, s) in s.iter_mut().enumerate() {
                let f = _mm256_set1_epi32(folded(i));
                s[0] = _mm256_add_epi32(s[0], f);
                s[1] = _mm256_add_epi32(s[1], f);
            }
            s
        };
        if p[0].halves == 2 {
            // (split types have implied offsets, folded into the integers)
            let lo = dots(0..4, &|i| *a.folded_halves.get_unchecked(2 * at(i)));
            let hi = dots(4..8, &|i| *a.folded_halves.get_unchecked(2 * at(i) + 1));
            for j in 0..2 {
                let dv = p[j].d.add(b * GROUP * 2).load8();
                let dv1 = p[j].d.add(b * GROUP * 2 + GROUP).load8();
                for (i, acc) in acc.iter_mut().enumerate() {
                    let dx = _mm256_set1_ps(*a.scales.get_unchecked(at(i)));
                    let dot_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(lo[i][j]), dv);
                    let dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[i][j]), dv1, dot_lo);
                    acc[j] = _mm256_fmadd_ps(dot, dx, acc[j]);
                }
            }
            continue;
        }
        let s = match p[0].m {
            Some(_) => dots(0..8, &|_| 0),
            None => dots(0..8, &|i| *a.folded.get_unchecked(at(i))),
        };
        for j in 0..2 {
            let dv = p[j].d.add(b * GROUP).load8();
            for (i, acc) in acc.iter_mut().enumerate() {
                let dx = _mm256_set1_ps(*a.scales.get_unchecked(at(i)));
                let dot = _mm256_cvtepi32_ps(s[i][j]);
                acc[j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, dx), acc[j]);
                if let Some(m) = p[j].m {
                    let sx = _mm256_set1_ps(*a.sums.get_unchecked(at(i)));
                    acc[j] = _mm256_fmadd_ps(m.add(b * GROUP).load8(), sx, acc[j]);
                }
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for j in 0..2 {
            store_group(acc[j], out.at(r0 + i, (g + j) * GROUP), valid[j]);
        }
    }
}
