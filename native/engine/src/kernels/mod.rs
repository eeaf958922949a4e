//! CPU matmul kernels owned by the engine.
//!
//! candle's quantized matmul costs the same per activation row whatever the batch size for
//! our shapes, so a batch of B rows costs B single-row products. These kernels quantize the
//! activations once per matmul and keep a tile of weight rows in L1 while every activation
//! row streams past it, so the weights are read from memory once per matmul instead of once
//! per row. Paths are chosen at run time (AVX512-VNNI, AVX2+FMA, else portable scalar).
//! K-quants are re-expressed exactly in the interleaved layout (`kquant`), and `attn` holds
//! the f32 micro-kernels of paged attention.

pub mod attn;
pub mod kquant;
pub mod packed;
pub mod q8;
pub(crate) mod weights;

/// The instruction sets the kernels may use, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    /// Portable Rust (also every target other than x86_64).
    Scalar,
    /// AVX2 + FMA + F16C, 16 ymm registers, `vpmaddubsw` products.
    Avx2,
    /// AVX512-VNNI: `vpdpbusd` on 256-bit vectors (AVX512VL encodings, 32 ymm registers),
    /// and on 512-bit ones for decode batches (two row groups per vector).
    Avx512Vnni,
}

impl SimdLevel {
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512Vnni => "avx512",
        }
    }
}

/// The best level this CPU supports.
pub fn detected_simd_level() -> SimdLevel {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        let vnni = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl");
        match (avx2, vnni) {
            (true, true) => SimdLevel::Avx512Vnni,
            (true, false) => SimdLevel::Avx2,
            _ => SimdLevel::Scalar,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        SimdLevel::Scalar
    }
}

/// The level the kernels use: the detected one, lowered by `LLAMA_CPP_EX_SIMD=scalar|avx2|avx512`
/// (or the older `LLAMA_CPP_EX_NO_VNNI=1`, the same as `avx2`) so every path can be exercised
/// and compared on one machine. A level above what the CPU has is ignored. Read once per
/// process.
pub fn simd_level() -> SimdLevel {
    use std::sync::OnceLock;
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cpu = detected_simd_level();
        let asked = match std::env::var("LLAMA_CPP_EX_SIMD").as_deref() {
            Ok("scalar") => SimdLevel::Scalar,
            Ok("avx2") => SimdLevel::Avx2,
            _ if std::env::var_os("LLAMA_CPP_EX_NO_VNNI").is_some() => SimdLevel::Avx2,
            _ => SimdLevel::Avx512Vnni,
        };
        cpu.min(asked)
    })
}

/// Whether the one-group kernels' prefetches of the next row group go to L2 (`T2`) rather
/// than L1 (`T0`): on AMD cores, whose L1 miss buffers the `T0` prefetches of a row group
/// take from the loads the products need (AVX2 decode on a Zen 4 EPYC, alternated: a 1B
/// Q4_K_M file 29.6 -> 39.2 tok/s, SmolLM2 189 -> 213, Gemma 3 93 -> 101); Intel cores
/// decode faster with `T0` (3-10 points on a Xeon). `LLAMA_CPP_EX_PREFETCH=l1|l2` overrides
/// the choice by vendor, to compare them on one machine. Read once per process.
pub fn prefetch_to_l2() -> bool {
    use std::sync::OnceLock;
    static L2: OnceLock<bool> = OnceLock::new();
    *L2.get_or_init(|| match std::env::var("LLAMA_CPP_EX_PREFETCH").as_deref() {
        Ok("l1") => false,
        Ok("l2") => true,
        _ => cpu_vendor_is_amd(),
    })
}

/// Whether a single row's products (one sequence decoding) run on the one-group AVX2 kernels
/// where the VNNI path is available, instead of its 512-bit kernel over pairs of row groups.
/// The products are bitwise the same; the kernels differ in how they stream the weights. On
/// a Zen 5 EPYC, decode steps alternated in one process: SmolLM2 3-5%, Gemma 3 14-15% and a
/// 1B Q4_K_M file 20-22% faster on the one-group kernels; at 2 rows -7% to +14%, at 3 and
/// more 4-30% slower, so batches keep the 512-bit kernel. Taken on AMD cores from Zen 5 on
/// (family 26), where it was measured; `LLAMA_CPP_EX_DECODE_KERNEL=wide|group` overrides the
/// choice, to compare them on one machine. Read once per process.
pub fn single_row_on_one_group() -> bool {
    use std::sync::OnceLock;
    static ONE_GROUP: OnceLock<bool> = OnceLock::new();
    *ONE_GROUP.get_or_init(
        || match std::env::var("LLAMA_CPP_EX_DECODE_KERNEL").as_deref() {
            Ok("wide") => false,
            Ok("group") => true,
            _ => cpu_vendor_is_amd() && cpu_family() >= 0x1A,
        },
    )
}

/// The CPU's family as `/proc/cpuinfo` gives it (the base family plus, for family 15, the
/// extended one); 0 off x86.
fn cpu_family() -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: leaf 1 exists on every x86-64 CPU (see `cpu_vendor_is_amd`)
        #[allow(unused_unsafe)]
        let eax = unsafe { std::arch::x86_64::__cpuid(1) }.eax;
        let base = (eax >> 8) & 0xF;
        if base == 0xF {
            base + ((eax >> 20) & 0xFF)
        } else {
            base
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

fn cpu_vendor_is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: leaf 0 (the vendor) exists on every x86-64 CPU; `__cpuid` is a safe
        // function on recent toolchains, unsafe on older ones
        #[allow(unused_unsafe)]
        let id = unsafe { std::arch::x86_64::__cpuid(0) };
        let vendor: Vec<u8> = [id.ebx, id.edx, id.ecx]
            .iter()
            .flat_map(|r| r.to_le_bytes())
            .collect();
        vendor == b"AuthenticAMD" || vendor == b"HygonGenuine"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the AVX512-VNNI paths run (see [`simd_level`]).
pub fn has_vnni() -> bool {
    simd_level() >= SimdLevel::Avx512Vnni
}

/// Whether the AVX2 (or better) paths run (see [`simd_level`]).
pub fn has_avx2() -> bool {
    simd_level() >= SimdLevel::Avx2
}

/// Below this many multiply-adds a product runs on the calling thread.
pub(crate) const PARALLEL_MIN_MACS: usize = 1 << 16;

/// Multiply-adds a range of a product's tiles handed to a thread should hold at least
/// ([`crate::pool::for_each_chunk_in`]): a range is a run of weights streamed in order and
/// each one starts cold, so a product's per-thread share is cut in at most as many ranges as
/// it holds this many (one a thread below twice as many, as llama.cpp splits short
/// products; at most [`crate::pool::GRABS_PER_THREAD`]). More ranges balance a call better
/// where a thread is slowed; fewer stream better (SmolLM2's single-row decode ran 3–10%
/// faster with its mid-sized products in 1–3 ranges a thread instead of 8,
/// `docs/performance.md`). Batches use this rule; a single row's product goes further
/// ([`crate::pool::for_each_split`]: one range a thread, halves of another's rest taken at
/// the end).
const RANGE_MACS: usize = 1 << 18;

/// Fewest activation rows a prompt's product gives one task (see [`for_each_tile`]): each
/// task unpacks its tile's weights again, which a shorter run of rows would not repay.
const MIN_SPLIT_ROWS: usize = 64;

/// Runs `tile(o0, rows, act)` over every tile of `tile_rows` output rows and every run
/// `act` of activation rows it is split into ([`for_each_task`]).
pub(crate) fn for_each_tile(
    n_out: usize,
    tile_rows: usize,
    m: usize,
    macs: usize,
    first: &crate::pool::Prologue<'_>,
    tile: impl Fn(usize, usize, std::ops::Range<usize>) + Sync,
) {
    for_each_task(n_out.div_ceil(tile_rows), m, macs, first, |t, act| {
        let o0 = t * tile_rows;
        tile(o0, tile_rows.min(n_out - o0), act)
    })
}

/// Runs `task(t, act)` over tiles `t` of `0..n_tiles` and every run `act` of activation
/// rows each is split into, on the worker pool when the product (`macs` multiply-adds) is
/// large enough to pay for waking it. A batch of `m` rows is split only when that finishes
/// sooner on the pool's threads: with tasks of equal cost, the time is the rounds of tasks
/// the busiest thread runs, so a 576-row product's 36 tiles of 16 rows take 3 rounds on 16
/// threads (2.25 of work), 4 runs of each tile's rows 9 rounds of a quarter (2.25).
/// Results do not depend on the split: every output is one row's dot products, whichever
/// task computes it. The threads that run tasks do `first` (the activations' quantization)
/// before their first one.
pub(crate) fn for_each_task(
    n_tiles: usize,
    m: usize,
    macs: usize,
    first: &crate::pool::Prologue<'_>,
    task: impl Fn(usize, std::ops::Range<usize>) + Sync,
) {
    // below this many multiply-adds, waking the worker pool costs more than it saves
    let threads = if macs < PARALLEL_MIN_MACS {
        1
    } else {
        crate::pool::threads()
    };
    let runs = row_runs(n_tiles, m, threads);
    let per_run = m.div_ceil(runs);
    let run = |tasks: std::ops::Range<usize>| {
        first.ensure();
        for t in tasks {
            let r0 = t % runs * per_run;
            if r0 < m {
                task(t / runs, r0..m.min(r0 + per_run));
            }
        }
    };
    if threads == 1 {
        run(0..n_tiles * runs);
    } else if m == 1 {
        // a single row's product is one stream of weights: each thread's stays in order
        crate::pool::for_each_split(n_tiles * runs, |t| run(t..t + 1));
    } else {
        let grabs = (macs / threads / RANGE_MACS).clamp(1, crate::pool::GRABS_PER_THREAD);
        crate::pool::for_each_chunk_in(n_tiles * runs, grabs, run);
    }
}

/// Into how many runs [`for_each_tile`] splits `m` activation rows of `n_tiles` tiles on
/// `threads` threads: the fewest that give the least time in rounds, runs of at least
/// [`MIN_SPLIT_ROWS`] rows.
fn row_runs(n_tiles: usize, m: usize, threads: usize) -> usize {
    let rounds = |runs: usize| (n_tiles * runs).div_ceil(threads) as f64 / runs as f64;
    let mut best = 1;
    let mut runs = 2;
    while m.div_ceil(runs) >= MIN_SPLIT_ROWS && runs <= threads {
        if rounds(runs) < rounds(best) {
            best = runs;
        }
        runs *= 2;
    }
    best
}

/// Output pointer shared by tasks that write disjoint elements.
pub(crate) struct SharedMut(pub *mut f32);
// SAFETY: every task writes a distinct set of output elements (its own weight rows' columns).
unsafe impl Sync for SharedMut {}
unsafe impl Send for SharedMut {}

/// Checks `matmul` against the f32 product with `dense` (`[n_out, n_in]` dequantized
/// weights) for every batch size kernels are required to handle; `bound(row)` is the allowed
/// error for one output of weight row `row`.
#[cfg(test)]
pub(crate) fn check_against_reference(
    label: &str,
    dense: &[f32],
    n_out: usize,
    n_in: usize,
    seed: &mut u64,
    matmul: impl Fn(&[f32], usize, &mut [f32]),
    bound: impl Fn(&[f32]) -> f32,
) {
    for &m in &[1usize, 2, 3, 7, 8, 16, 33, 512] {
        let x: Vec<f32> = (0..m * n_in).map(|_| lcg(seed)).collect();
        let mut out = vec![0f32; m * n_out];
        matmul(&x, m, &mut out);
        for r in 0..m {
            for o in 0..n_out {
                let row = &dense[o * n_in..(o + 1) * n_in];
                let exact: f32 = (0..n_in).map(|i| row[i] * x[r * n_in + i]).sum();
                let got = out[r * n_out + o];
                assert!(
                    (got - exact).abs() <= bound(row),
                    "{label} m={m} ({n_out}x{n_in}) r={r} o={o}: {got} vs {exact}"
                );
            }
        }
    }
}

/// Deterministic pseudo-random values in [-1, 1) for kernel tests.
#[cfg(test)]
pub(crate) fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_split_their_rows_only_where_that_finishes_sooner() {
        // two threads, an even number of tiles: nothing to gain
        assert_eq!(row_runs(36, 512, 2), 1);
        // 36 tiles on 16 threads: 3 rounds whole, 72 tasks 5 rounds of half (2.5), 144
        // tasks 9 rounds of a quarter (2.25, every thread busy); eighths gain nothing more
        assert_eq!(row_runs(36, 512, 16), 4);
        // 18 tiles: 2 rounds whole; eighths 9 rounds of an eighth (1.125)
        assert_eq!(row_runs(18, 512, 16), 8);
        assert_eq!(row_runs(18, 256, 16), 4, "runs of at least 64 rows");
        // a decode batch is never split
        assert_eq!(row_runs(3, 8, 16), 1);
        assert_eq!(row_runs(96, 512, 16), 1, "tiles already divide evenly");
    }
}
