//! The AVX-512 VNNI products: `vpdpbusd` dot products, the one-group kernel built from them,
//! and the two-group kernels in 512-bit vectors: decode batches unpacking in registers
//! (`wide_kernel_vnni`), prompts reading a buffer unpacked once (`pair_kernel_vnni`).

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

/// Block `b`'s [`BlockScales`] on VNNI: one integer per lane and half, no offsets (the
/// folded offsets start the dot products' chains).
///
/// # Safety
/// As [`GroupRef::scale_pairs8`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn block_scales_vnni(
    p: &GroupRef,
    b: usize,
    split: bool,
    folded: i16,
) -> BlockScales {
    let _ = folded;
    let s = if split {
        [p.scales8(2 * b), p.scales8(2 * b + 1)]
    } else {
        [p.scales8(b); 2]
    };
    BlockScales {
        s,
        off: std::arch::x86_64::_mm256_setzero_si256(),
    }
}

/// [`block_dot_vnni`] (without a folded offset) times each lane's (row's) block scale
/// integer ([`BlockScales`]), in integers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
#[inline]
pub(super) unsafe fn block_dot_scaled_vnni<const C: usize, const NARROW: bool>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    scales: &BlockScales,
) -> std::arch::x86_64::__m256i {
    std::arch::x86_64::_mm256_mullo_epi32(block_dot_vnni::<C, NARROW>(v, x, 0), scales.s[0])
}

/// [`half_dots_vnni`] (with their folded offsets) times their half scale integers and
/// summed, in integers (`halves` is for the AVX2 form).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
#[inline]
pub(super) unsafe fn half_dots_scaled_vnni<const C: usize>(
    v: &[std::arch::x86_64::__m256i; 8],
    x: *const i32,
    folded: [i32; 2],
    halves: *const i16,
    scales: &BlockScales,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let _ = halves;
    let [lo, hi] = half_dots_vnni::<C>(v, x, folded);
    _mm256_add_epi32(
        _mm256_mullo_epi32(lo, scales.s[0]),
        _mm256_mullo_epi32(hi, scales.s[1]),
    )
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
    block_dot_scaled_vnni,
    half_dots_scaled_vnni,
    block_scales_vnni,
    false,
    false,
    false,
    8,
    [1, 2, 3, 4, 5, 6, 7, 8],
    dyn
);

/// Rows per pass of [`wide_kernel_vnni`] (its blocks are unpacked again in every pass).
#[cfg(target_arch = "x86_64")]
pub(super) const WIDE_ROWS: usize = 8;

/// Rows per pass of [`wide_kernel_vnni`] for split types (Q6_K) with super-block activation
/// scales: each row's two dot products and three accumulators for 8 rows spill (an 8-row
/// Q6_K product 27% slower).
#[cfg(target_arch = "x86_64")]
pub(super) const WIDE_ROWS_SPLIT_SUPER: usize = 4;

/// Rows per pass of [`pair_kernel_vnni`]: 4 rows of 2 chains kept the `vpdpbusd` ports
/// busier than 8 rows of one (1.1× on a Xeon; LLVM emits each row's chain in sequence,
/// however the source interleaves them, so a row's chain length is what the out-of-order
/// window has to hide), and 8 of 2 spill.
#[cfg(target_arch = "x86_64")]
pub(super) const PAIR_ROWS: usize = 4;

/// Runs `$call` with the constants `$r`, the `$rows` of a pass, and `$c`, the independent
/// `vpdpbusd` chains per row: `vpdpbusd`'s ~5-cycle latency needs ~10 chains in flight to
/// keep its two ports busy; a row alone brings `C`, 8 rows one each (and need the registers
/// for their accumulators).
macro_rules! by_rows {
    ($rows:expr, |$r:ident, $c:ident| $call:expr) => {
        by_rows!(@ $rows, $r, $c, $call, [1 4, 2 2, 3 2, 4 2, 5 2, 6 2, 7 1, 8 1])
    };
    (@ $rows:expr, $r:ident, $c:ident, $call:expr, [$($n:literal $chains:literal),*]) => {
        match $rows {
            $($n => {
                const $r: usize = $n;
                const $c: usize = $chains;
                $call
            })*
            _ => unreachable!(),
        }
    };
}

/// Row groups `groups` (an even number, taken in pairs one after the other) times every
/// activation row of a short batch (decode), on the VNNI path, in 512-bit vectors: for a
/// pair `g`, `g + 1`, lanes 0..8 are group `g`'s rows, 8..16 group `g + 1`'s. An activation
/// quad is broadcast once for 16 weight rows instead of 8, halving the loads of a pass, which
/// bound the 256-bit one-group passes;
/// `vpdpbusd` on 512 bits does the work of two on 256 (Zen 4 splits it in two halves, Intel's
/// server cores run it on two ports). The blocks are unpacked in registers once per pass of
/// up to [`WIDE_ROWS`] rows. Each lane's arithmetic is the one of `group_kernel_vnni`, so
/// results are bitwise the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni,avx512vl")]
pub(super) unsafe fn wide_kernel_vnni(
    w: &PackedMatrix,
    base: &GroupRef,
    a: &Q8Activations,
    act: std::ops::Range<usize>,
    groups: std::ops::Range<usize>,
    out: &Dest,
) {
    debug_assert!(groups.len().is_multiple_of(2));
    for g in groups.step_by(2) {
        let (p, valid) = GroupRef::pair(base, w, g);
        wide_passes(w, a, act.clone(), g, &p, valid, out)
    }
}

/// [`wide_kernel_vnni`]'s passes over groups `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni,avx512vl")]
unsafe fn wide_passes(
    w: &PackedMatrix,
    a: &Q8Activations,
    act: std::ops::Range<usize>,
    g: usize,
    p: &[GroupRef; 2],
    valid: [usize; 2],
    out: &Dest,
) {
    let mut r0 = act.start;
    while r0 < act.end {
        let rows = (act.end - r0).min(if a.super_scales && Dyn::halves(&p[0]) == 2 {
            WIDE_ROWS_SPLIT_SUPER
        } else {
            WIDE_ROWS
        });
        // the first pass asks for the next tile's blocks while computing this one's: unlike
        // one group's blocks, read as one sequential stream, two groups' blocks are read as
        // two streams that jump ahead by a group at every tile, which the hardware
        // prefetchers do not follow (without these prefetches a 512-bit pass over Gemma 3's
        // head read 12-13 GB/s on one core, 256-bit ones 18-21)
        let prefetch = r0 == act.start;
        by_format!(all & p[0], a.super_scales, |T, S| by_rows!(
            rows,
            |R, C| if prefetch {
                wide_pass_vnni::<R, C, true, false, S, T>(w, p, &[], a, r0, valid, g, out)
            } else {
                wide_pass_vnni::<R, C, false, false, S, T>(w, p, &[], a, r0, valid, g, out)
            }
        ));
        r0 += rows;
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The unpacked blocks of the two row groups a prompt's product is computing (see
    /// [`pair_kernel_vnni`]).
    static WIDE_BUFFERED: std::cell::RefCell<Vec<[std::arch::x86_64::__m512i; 8]>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Row groups `g` and `g + 1` times every activation row of a long batch (a prompt), on the
/// VNNI path: the 512-bit passes of [`wide_kernel_vnni`], but both groups' blocks are
/// unpacked once into the thread's buffer and every pass of up to [`PAIR_ROWS`] activation
/// rows reads them from there. Results are bitwise those of `group_kernel_vnni`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni,avx512vl")]
pub(super) unsafe fn pair_kernel_vnni(
    w: &PackedMatrix,
    base: &GroupRef,
    a: &Q8Activations,
    act: std::ops::Range<usize>,
    g: usize,
    out: &Dest,
) {
    let (p, valid) = GroupRef::pair(base, w, g);
    use std::arch::x86_64::*;
    let run = |buffered: &mut Vec<[__m512i; 8]>| {
        buffered.clear();
        buffered.extend((0..w.nb).map(|b| wide_block::<Dyn>(&p, b)));
        if a.super_scales && Dyn::has_min(&p[0]) {
            // after the blocks, each super-block's minimums
            buffered.extend((0..w.nb / SUPER_BLOCKS).map(|sb| {
                let (pairs, factor) = wide_min_pairs(&p, sb);
                min_entry(pairs, _mm512_castps_si512(factor), _mm512_setzero_si512())
            }));
        }
        by_format!(all & p[0], a.super_scales, |T, S| {
            let mut r0 = act.start;
            while r0 < act.end {
                let rows = (act.end - r0).min(PAIR_ROWS);
                by_rows!(rows, |R, C| wide_pass_vnni::<R, C, false, true, S, T>(
                    w, &p, buffered, a, r0, valid, g, out,
                ));
                r0 += rows;
            }
        })
    };
    WIDE_BUFFERED.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buffered) => run(&mut buffered),
        Err(_) => run(&mut Vec::new()),
    })
}

/// `R` activation rows (from `r0`) times both row groups, their blocks unpacked in
/// registers or (`BUFFERED`) read from `buffered`, their layout `T`: `R · C` independent
/// `vpdpbusd` chains, the whole pass in one function so that the accumulators stay in
/// registers. Integer sums are exact in any order, and the
/// float steps are those of `group_kernel_vnni`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni,avx512vl")]
#[allow(clippy::too_many_arguments)]
unsafe fn wide_pass_vnni<
    const R: usize,
    const C: usize,
    const PREFETCH: bool,
    const BUFFERED: bool,
    const SUPER: bool,
    T: Format,
>(
    w: &PackedMatrix,
    p: &[GroupRef; 2],
    buffered: &[[std::arch::x86_64::__m512i; 8]],
    a: &Q8Activations,
    r0: usize,
    valid: [usize; 2],
    g: usize,
    out: &Dest,
) {
    use std::arch::x86_64::*;
    let (k, nb) = (w.n_in, w.nb);
    let mut acc = [_mm512_setzero_ps(); R];
    // with super-block scales, each row's dots times their scale integers over the
    // super-block ([`BlockScales`])
    let mut isup = [_mm512_setzero_si512(); R];
    let min_super = SUPER && T::has_min(&p[0]);
    // with super-block scales (K-quants), a super-block's blocks at a time: each row's
    // integer sums over them (its dots times their scale integers, and for types with a
    // minimum its minimums) are scaled by their factors and its activation scale once, after
    // its last block
    let span = if SUPER { SUPER_BLOCKS } else { nb.max(1) };
    for b0 in (0..nb).step_by(span) {
        let mins = match (min_super, BUFFERED) {
            (false, _) => ([_mm512_setzero_si512(); 4], _mm512_setzero_ps()),
            (true, true) => {
                let (pairs, factor) =
                    from_min_entry(buffered.get_unchecked(nb + b0 / SUPER_BLOCKS));
                (pairs, _mm512_castsi512_ps(factor))
            }
            (true, false) => wide_min_pairs(p, b0 / SUPER_BLOCKS),
        };
        for b in b0..(b0 + span).min(nb) {
            if PREFETCH {
                // the next tile (groups g + 2 and g + 3) to the outer caches: `T0` prefetches
                // of 16 rows' blocks take the L1 miss buffers the loads need (an 8-row head
                // product at 77-82 GMAC/s with them, 111-131 with `T2`)
                p[0].prefetch_block::<T, _MM_HINT_T2>(2 * nb + b);
                p[1].prefetch_block::<T, _MM_HINT_T2>(2 * nb + b);
            }
            let v = if BUFFERED {
                *buffered.get_unchecked(b)
            } else {
                wide_block::<T>(p, b)
            };
            let x = |i: usize| a.quants.as_ptr().add((r0 + i) * k + b * QK4_1) as *const i32;
            let at = |i: usize| (r0 + i) * nb + b;
            // per row, the dot of quads `quads` plus `folded[i]`, in `chains` (≤ C) chains,
            // the first starting from `folded[i]` (integers: exact in any order)
            let dots =
                |quads: std::ops::Range<usize>, folded: [i32; R], chains: usize| -> [__m512i; R] {
                    let mut s: [[__m512i; C]; R] = std::array::from_fn(|i| {
                        let mut c = [_mm512_setzero_si512(); C];
                        c[0] = _mm512_set1_epi32(folded[i]);
                        c
                    });
                    for (n, q) in quads.enumerate() {
                        for (i, s) in s.iter_mut().enumerate() {
                            s[n % chains] = _mm512_dpbusd_epi32(
                                s[n % chains],
                                v[q],
                                _mm512_set1_epi32(*x(i).add(q)),
                            );
                        }
                    }
                    std::array::from_fn(|i| {
                        let mut sum = s[i][0];
                        for &c in &s[i][1..chains] {
                            sum = _mm512_add_epi32(sum, c);
                        }
                        sum
                    })
                };
            if T::halves(&p[0]) == 2 {
                // (split types have implied offsets, folded into the integers; the two halves
                // are independent chains already)
                let chains = (C / 2).max(1);
                let lo = dots(
                    0..4,
                    std::array::from_fn(|i| *a.folded_halves.get_unchecked(2 * at(i))),
                    chains,
                );
                let hi = dots(
                    4..8,
                    std::array::from_fn(|i| *a.folded_halves.get_unchecked(2 * at(i) + 1)),
                    chains,
                );
                if SUPER {
                    let (s0, s1) = (wide_scales(p, 2 * b), wide_scales(p, 2 * b + 1));
                    for (i, isup) in isup.iter_mut().enumerate() {
                        let d = _mm512_add_epi32(
                            _mm512_mullo_epi32(lo[i], s0),
                            _mm512_mullo_epi32(hi[i], s1),
                        );
                        *isup = _mm512_add_epi32(*isup, d);
                    }
                    continue;
                }
                let dv = join_ps(p[0].d8::<T>(b, 0), p[1].d8::<T>(b, 0));
                let dv1 = join_ps(p[0].d8::<T>(b, 1), p[1].d8::<T>(b, 1));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let dx = _mm512_set1_ps(*a.scales.get_unchecked(at(i)));
                    let dot_lo = _mm512_mul_ps(_mm512_cvtepi32_ps(lo[i]), dv);
                    let dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[i]), dv1, dot_lo);
                    *acc = _mm512_fmadd_ps(dot, dx, *acc);
                }
                continue;
            }
            let dv = || join_ps(p[0].d8::<T>(b, 0), p[1].d8::<T>(b, 0));
            match T::has_min(&p[0]) {
                true if SUPER => {
                    // (the factor and the minimums once per super-block, below)
                    let sc = wide_scales(p, b);
                    let s = dots(0..8, [0; R], C);
                    for (i, isup) in isup.iter_mut().enumerate() {
                        *isup = _mm512_add_epi32(*isup, _mm512_mullo_epi32(s[i], sc));
                    }
                }
                true => {
                    let dv = dv();
                    let mv = join_ps(p[0].m8::<T>(b), p[1].m8::<T>(b));
                    let s = dots(0..8, [0; R], C);
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let dot = _mm512_cvtepi32_ps(s[i]);
                        let dx = _mm512_set1_ps(*a.scales.get_unchecked(at(i)));
                        let sx = _mm512_set1_ps(*a.sums.get_unchecked(at(i)));
                        *acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, dx), *acc);
                        *acc = _mm512_fmadd_ps(mv, sx, *acc);
                    }
                }
                false => {
                    let dv = dv();
                    let s = dots(
                        0..8,
                        std::array::from_fn(|i| *a.folded.get_unchecked(at(i))),
                        C,
                    );
                    debug_assert!(!SUPER, "super-block scales: a minimum or halves");
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let dot = _mm512_cvtepi32_ps(s[i]);
                        let dx = _mm512_set1_ps(*a.scales.get_unchecked(at(i)));
                        *acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, dx), *acc);
                    }
                }
            }
        }
        if SUPER {
            let d_base = join_ps(p[0].d_base8::<T>(b0), p[1].d_base8::<T>(b0));
            for (i, acc) in acc.iter_mut().enumerate() {
                let at = (r0 + i) * nb + b0;
                let dx = _mm512_set1_ps(*a.scales.get_unchecked(at));
                let scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(isup[i]), d_base);
                isup[i] = _mm512_setzero_si512();
                // (the sum of minimums is below 2^24: exact as an f32)
                let sums = if min_super {
                    let m = wide_min_dot(&mins.0, a.block_sums.as_ptr().add(at));
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), mins.1, scaled)
                } else {
                    scaled
                };
                *acc = _mm512_fmadd_ps(sums, dx, *acc);
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

/// [`GroupRef::scales8`] of both groups (`p[0]` in lanes 0..8): run `unit`'s scale integers
/// ([`BlockScales`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f")]
#[inline]
unsafe fn wide_scales(p: &[GroupRef; 2], unit: usize) -> std::arch::x86_64::__m512i {
    join_si(p[0].scales8(unit), p[1].scales8(unit))
}

/// [`GroupRef::min_pairs8`] of both groups (`p[0]` in lanes 0..8).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c,avx512f")]
#[inline]
unsafe fn wide_min_pairs(
    p: &[GroupRef; 2],
    sb: usize,
) -> ([std::arch::x86_64::__m512i; 4], std::arch::x86_64::__m512) {
    let (lo, d_lo) = p[0].min_pairs8(sb);
    let (hi, d_hi) = p[1].min_pairs8(sb);
    (
        std::array::from_fn(|q| join_si(lo[q], hi[q])),
        join_ps(d_lo, d_hi),
    )
}

/// [`min_dot8`] for both groups of [`wide_min_pairs`], in two `vpdpwssd` chains (the same
/// integers).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
unsafe fn wide_min_dot(
    pairs: &[std::arch::x86_64::__m512i; 4],
    sums: *const i16,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let s = |q: usize| _mm512_set1_epi32((sums as *const i32).add(q).read_unaligned());
    let z = _mm512_setzero_si512();
    let lo = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(z, pairs[0], s(0)), pairs[1], s(1));
    let hi = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(z, pairs[2], s(2)), pairs[3], s(3));
    _mm512_add_epi32(lo, hi)
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

/// Group `g`'s 8 scales `lo` and group `g + 1`'s `hi` as one vector.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,avx512f")]
#[inline]
pub(super) unsafe fn join_ps(
    lo: std::arch::x86_64::__m256,
    hi: std::arch::x86_64::__m256,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    _mm512_castsi512_ps(join_si(_mm256_castps_si256(lo), _mm256_castps_si256(hi)))
}

/// The 8 quads of block `b` of both row groups: vector `q` holds values `4q..4q + 4` of
/// each of the 16 rows (the unpacking of [`unpack_block`] on both halves at once).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f")]
#[inline]
pub(super) unsafe fn wide_block<T: Format>(
    p: &[GroupRef; 2],
    b: usize,
) -> [std::arch::x86_64::__m512i; 8] {
    use std::arch::x86_64::*;
    let gbb = T::gbb(&p[0]);
    let load = |j: usize, at: usize| _mm256_loadu_si256(p[j].q.add(b * gbb + at) as *const __m256i);
    let mut v = [_mm512_setzero_si512(); 8];
    if T::bytes8(&p[0]) {
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
    if T::six(&p[0]) {
        let pair = _mm512_set1_epi8(0x30);
        for plane in 0..2 {
            let at = GROUP * PACKED + plane * 32;
            let w = join_si(load(0, at), load(1, at));
            // (what a shift moves across a byte boundary is masked off)
            let bits = [
                _mm512_slli_epi32::<4>(w),
                _mm512_slli_epi32::<2>(w),
                w,
                _mm512_srli_epi32::<2>(w),
            ];
            for (k, b) in bits.into_iter().enumerate() {
                let q = 4 * plane + k;
                v[q] = _mm512_or_si512(v[q], _mm512_and_si512(b, pair));
            }
        }
    }
    if let (true, Some(h0), Some(h1)) = (T::high(&p[0]), p[0].h, p[1].h) {
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
