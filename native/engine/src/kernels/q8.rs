//! Activations quantized to Q8_0 (blocks of 32 int8 values with one scale), or with one scale
//! per 256 values for K-quant weights (ggml's Q8_K): the input side of every quantized
//! product (`super::packed`).

#[cfg(target_arch = "x86_64")]
use super::has_avx2;
use super::kquant::QK_K;
use crate::pool::Prologue;
use half::f16;

/// Elements per Q8_0 block.
pub const QK8_0: usize = 32;

/// Blocks per super-block of [`ActFormat::super_scales`] (a K-quant's super-block).
const SUPER: usize = QK_K / QK8_0;

/// How a product's weights want their activations quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActFormat {
    /// The weights' implied offset `c` for [`Q8Activations::folded`] (0 when they store
    /// their own).
    pub offset: i32,
    /// One scale per [`QK_K`] values instead of per block, as ggml quantizes the
    /// activations of its K-quant products (Q8_K): the kernels then apply the activation
    /// scale once per super-block, where the weights' sub-block scales are integers times a
    /// super-block factor anyway, instead of once per block and row (a multiply on the vector
    /// pipes the integer products are bound by, ~7% of a K-quant prompt on Zen 4).
    pub super_scales: bool,
}

impl ActFormat {
    /// Per-block scales and no offset.
    pub const PLAIN: ActFormat = ActFormat {
        offset: 0,
        super_scales: false,
    };
}

/// [`Q8Activations`]' buffers while tasks fill disjoint blocks of them.
struct Outputs {
    quants: *mut i8,
    scales: *mut f32,
    sums: *mut f32,
    block_sums: *mut i16,
    half_sums: *mut i16,
    folded: *mut i32,
    folded_halves: *mut i32,
}
// SAFETY: tasks write disjoint blocks (see `Job::run`).
unsafe impl Sync for Outputs {}

/// Activations quantized to Q8_0 per row and block (per row and super-block with
/// [`ActFormat::super_scales`]).
pub struct Q8Activations {
    pub(crate) m: usize,
    /// Whether [`ActFormat::super_scales`]: every block's entry of `scales` is then its
    /// super-block's scale, and `block_sums` (not `sums`) are written.
    pub(crate) super_scales: bool,
    pub(crate) quants: Vec<i8>,
    pub(crate) scales: Vec<f32>,
    /// Per block: scale × Σ quants (ggml's Q8_1 `s`), for weight types with a stored offset
    /// (without super-block scales).
    pub(crate) sums: Vec<f32>,
    /// With super-block scales, per block `Σ quants` (at most 32 · 127 in magnitude), so
    /// that two blocks' sums read as one `i32` are the 16-bit pair a `vpmaddwd` lane
    /// multiplies with two blocks' minimums (ggml's Q8_K `bsums`, per 32 values).
    pub(crate) block_sums: Vec<i16>,
    /// With super-block scales, per block `Σ quants` of values 0..16 and of 16..32, one
    /// after the other: read as one `i32`, the 16-bit pair a `vpmaddwd` lane multiplies
    /// with a split type's two half scales (times its implied offset).
    pub(crate) half_sums: Vec<i16>,
    /// Per block: `-c·Σ quants`, where the weights' values carry an implied offset of `c`
    /// units of their scale (`w = d·(q - c)`, see `packed`): the integer that turns the dot
    /// product of the stored values into the one of `q - c`, exactly.
    pub(crate) folded: Vec<i32>,
    /// The same per half block (values 0..16, 16..32), for types with a scale per half.
    pub(crate) folded_halves: Vec<i32>,
}

impl Q8Activations {
    /// ggml's `quantize_row_q8_0`: per block scale `amax / 127`, values rounded to nearest
    /// (ties to even, as ggml's AVX2 path does); with [`ActFormat::super_scales`], the same
    /// with `amax` taken over each 256-value super-block and the scale kept in f32 (ggml's
    /// `quantize_row_q8_K`). `format.offset` is the weights' implied offset `c` for
    /// [`Q8Activations::folded`].
    pub fn quantize(x: &[f32], m: usize, k: usize, format: ActFormat) -> Self {
        let mut a = empty();
        a.quantize_into(x, m, k, format);
        a
    }

    /// [`Q8Activations::quantize`] into this value's buffers (no allocation once they are
    /// large enough), on the calling thread (the products quantize inside their own pool
    /// call: [`Q8Activations::with_quantized_in`]).
    pub fn quantize_into(&mut self, x: &[f32], m: usize, k: usize, format: ActFormat) {
        let (job, _) = self.prepare(x, m, k, format);
        job.run(0..job.n);
    }

    /// Sizes the buffers for `m` rows of `k` values in `format` and returns the quantization
    /// that fills them, block by block ([`Job::run`]), and the activations it fills (to be
    /// read once it has run): both borrow the buffers, which nothing can resize meanwhile.
    fn prepare<'a>(
        &'a mut self,
        x: &'a [f32],
        m: usize,
        k: usize,
        format: ActFormat,
    ) -> (Job<'a>, &'a Self) {
        let nb = k / QK8_0;
        let sup = format.super_scales;
        assert!(
            !sup || k.is_multiple_of(QK_K),
            "super-block scales need k % 256 == 0"
        );
        assert!(x.len() >= m * k, "activations shorter than m * k");
        self.m = m;
        self.super_scales = sup;
        // every element is written by the job: resizing without clearing skips zero-filling
        // buffers that were already long enough
        self.quants.resize(m * k, 0);
        self.scales.resize(m * nb, 0.0);
        if sup {
            self.block_sums.resize(m * nb, 0);
            self.half_sums.resize(2 * m * nb, 0);
        } else {
            self.sums.resize(m * nb, 0.0);
        }
        self.folded.resize(m * nb, 0);
        self.folded_halves.resize(2 * m * nb, 0);
        let job = Job {
            x,
            out: Outputs {
                quants: self.quants.as_mut_ptr(),
                scales: self.scales.as_mut_ptr(),
                sums: self.sums.as_mut_ptr(),
                block_sums: self.block_sums.as_mut_ptr(),
                half_sums: self.half_sums.as_mut_ptr(),
                folded: self.folded.as_mut_ptr(),
                folded_halves: self.folded_halves.as_mut_ptr(),
            },
            offset: format.offset,
            sup,
            n: m * nb,
            buffers: std::marker::PhantomData,
        };
        (job, self)
    }

    /// The activations of a product in `formats` (quantized once when they are equal), for
    /// `f` to quantize inside the product's own pool call: `f` gets the quantization as a
    /// [`Prologue`] and the activations it fills, which a task may read only after the
    /// prologue's [`Prologue::ensure`] returned on its thread. A decode batch's quantization
    /// (a few microseconds per product, ~4% of an 8-stream SmolLM2 step) then runs on every
    /// thread of the call (a piece each at most) instead of on the caller while the workers
    /// wait.
    pub(crate) fn with_quantized_in<R>(
        x: &[f32],
        m: usize,
        k: usize,
        formats: [ActFormat; 2],
        f: impl FnOnce(&Prologue<'_>, [&Self; 2]) -> R,
    ) -> R {
        with_buffer(&BUFFERS, |first| {
            let (one, first) = first.prepare(x, m, k, formats[0]);
            let pieces = (one.n / PIECE_BLOCKS).clamp(1, crate::pool::threads().max(1));
            if formats[1] == formats[0] {
                let run = |i: usize| {
                    if let Some(blocks) = one.piece(i, pieces) {
                        one.run(blocks)
                    }
                };
                return f(&Prologue::new(pieces, &run), [first, first]);
            }
            with_buffer(&SECOND, |second| {
                let (two, second) = second.prepare(x, m, k, formats[1]);
                let run = |i: usize| {
                    for job in [&one, &two] {
                        if let Some(blocks) = job.piece(i, pieces) {
                            job.run(blocks)
                        }
                    }
                };
                f(&Prologue::new(pieces, &run), [first, second])
            })
        })
    }
}

/// A quantization of `n` blocks into buffers sized by [`Q8Activations::prepare`], which
/// tasks may run on disjoint ranges of blocks at once.
struct Job<'a> {
    x: &'a [f32],
    /// Pointers into the buffers borrowed for `'a`.
    out: Outputs,
    offset: i32,
    sup: bool,
    n: usize,
    buffers: std::marker::PhantomData<&'a Q8Activations>,
}

impl Job<'_> {
    /// Quantizes blocks `blocks` (whole super-blocks with super-block scales).
    fn run(&self, blocks: std::ops::Range<usize>) {
        let (x, out, offset, sup) = (self.x, &self.out, self.offset, self.sup);
        assert!(blocks.end <= self.n, "blocks past the prepared buffers");
        // SAFETY (both closures): `bi < n = m·nb`, so every slot written is inside its buffer
        // (sized by `prepare`, and borrowed, so not resized, while the job lives); concurrent
        // runs are given disjoint ranges of blocks, and the activations `prepare` returned
        // are read only after the runs (`Prologue::ensure`).
        let store = |bi: usize, scale: f32, [lo, hi]: [i32; 2]| unsafe {
            *out.scales.add(bi) = scale;
            if sup {
                *out.block_sums.add(bi) = (lo + hi) as i16;
                *out.half_sums.add(2 * bi) = lo as i16;
                *out.half_sums.add(2 * bi + 1) = hi as i16;
            } else {
                *out.sums.add(bi) = scale * (lo + hi) as f32;
            }
            *out.folded.add(bi) = -offset * (lo + hi);
            *out.folded_halves.add(2 * bi) = -offset * lo;
            *out.folded_halves.add(2 * bi + 1) = -offset * hi;
        };
        let quants = |bi: usize| unsafe {
            std::slice::from_raw_parts_mut(out.quants.add(bi * QK8_0), QK8_0)
        };
        if !sup {
            for bi in blocks {
                let (d, halves) = quantize_block(&x[bi * QK8_0..(bi + 1) * QK8_0], quants(bi));
                // the scale as ggml stores it (f16) so results match Q8_0 x Q8_0 products
                store(bi, f16::from_f32(d).to_f32(), halves);
            }
            return;
        }
        for b0 in blocks.step_by(SUPER) {
            let xs = &x[b0 * QK8_0..(b0 + SUPER) * QK8_0];
            let d = abs_max(xs) / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            for bi in b0..b0 + SUPER {
                let halves = quantize_block_by(&x[bi * QK8_0..(bi + 1) * QK8_0], quants(bi), id);
                store(bi, d, halves);
            }
        }
    }

    /// The job cut in about `pieces` ranges of blocks (whole super-blocks), `None` past the
    /// last: piece `i` of a [`crate::pool::Prologue`].
    fn piece(&self, i: usize, pieces: usize) -> Option<std::ops::Range<usize>> {
        let unit = if self.sup { SUPER } else { 1 };
        let len = (self.n / unit).div_ceil(pieces.max(1)).max(1) * unit;
        let start = i * len;
        (start < self.n).then(|| start..(start + len).min(self.n))
    }
}

/// Blocks a piece of an activation quantization done inside its product's pool call holds at
/// least ([`Q8Activations::with_quantized_in`]), ~0.15 µs of work; there is at most a piece
/// per thread (a decode batch's few microseconds of quantization in 4 pieces a thread ran
/// no faster on 2 threads: each piece is an atomic add on a line the threads share).
const PIECE_BLOCKS: usize = 32;

const fn empty() -> Q8Activations {
    Q8Activations {
        m: 0,
        super_scales: false,
        quants: Vec::new(),
        scales: Vec::new(),
        sums: Vec::new(),
        block_sums: Vec::new(),
        half_sums: Vec::new(),
        folded: Vec::new(),
        folded_halves: Vec::new(),
    }
}

thread_local! {
    /// The calling thread's activations of the product in progress, grown once.
    static BUFFERS: std::cell::RefCell<Q8Activations> = const { std::cell::RefCell::new(empty()) };
    /// The same quantized for a second weight type ([`Q8Activations::with_quantized_in`]).
    static SECOND: std::cell::RefCell<Q8Activations> = const { std::cell::RefCell::new(empty()) };
}

/// Runs `f` on the thread's buffer `key`, or on a fresh value when it is already in use on
/// this thread (a product nested in another).
fn with_buffer<R>(
    key: &'static std::thread::LocalKey<std::cell::RefCell<Q8Activations>>,
    f: impl FnOnce(&mut Q8Activations) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut a) => f(&mut a),
        Err(_) => f(&mut empty()),
    })
}

/// Quantizes one block of [`QK8_0`] values as llama.cpp's `quantize_row_q8_0` does on x86
/// (`d = max|x| / 127`, `q = round(x / d)`, ties to even); returns `d`. The one Q8_0 quantizer
/// of the engine: activations and q8_0 KV blocks.
pub fn quantize_block_q8_0(xb: &[f32], qb: &mut [i8]) -> f32 {
    quantize_block(xb, qb).0
}

/// Quantizes one block of [`QK8_0`] values; returns the scale and the sums of the quantized
/// halves.
fn quantize_block(xb: &[f32], qb: &mut [i8]) -> (f32, [i32; 2]) {
    let d = abs_max(xb) / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    (d, quantize_block_by(xb, qb, id))
}

/// The largest `|x|` (0 for none); the same on every path (a maximum does not depend on the
/// order of comparisons).
fn abs_max(xs: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && xs.len().is_multiple_of(QK8_0) {
        // SAFETY: AVX2 was detected; whole blocks of `xs` are read.
        return xs
            .chunks_exact(QK8_0)
            .map(|b| unsafe { abs_max_avx2(b.as_ptr()) })
            .fold(0f32, f32::max);
    }
    xs.iter().fold(0f32, |a, v| a.max(v.abs()))
}

/// One block of [`QK8_0`] values times `id` (the inverse scale), rounded to nearest, ties to
/// even; returns the sums of the quantized halves.
fn quantize_block_by(xb: &[f32], qb: &mut [i8], id: f32) -> [i32; 2] {
    assert!(xb.len() == QK8_0 && qb.len() == QK8_0);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 was detected; both blocks hold QK8_0 elements (asserted above).
        return unsafe { quantize_block_avx2(xb.as_ptr(), qb.as_mut_ptr(), id) };
    }
    quantize_block_scalar(xb, qb, id)
}

fn quantize_block_scalar(xb: &[f32], qb: &mut [i8], id: f32) -> [i32; 2] {
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
    [half(0), half(1)]
}

/// `max |x|` of one block of [`QK8_0`] values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn abs_max_avx2(xb: *const f32) -> f32 {
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
    _mm_cvtss_f32(m4)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(xb: *const f32, qb: *mut i8, id: f32) -> [i32; 2] {
    use std::arch::x86_64::*;
    let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xb.add(8 * i)));
    let id = _mm256_set1_ps(id);
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
    halves
}

// the scalar path against the AVX2 one
#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::kernels::lcg;

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
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let scalar = quantize_block_scalar(&x, &mut a, id);
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                // SAFETY: AVX2 detected; both blocks hold QK8_0 elements.
                let simd = unsafe { quantize_block_avx2(x.as_ptr(), b.as_mut_ptr(), id) };
                assert_eq!(scalar, simd, "case {case}");
                assert_eq!(a, b, "case {case}");
                // SAFETY: as above.
                assert_eq!(unsafe { abs_max_avx2(x.as_ptr()) }, amax, "case {case}");
            }
        }
    }

    /// With super-block scales every block of a 256-value super-block shares the scale of
    /// the super-block's largest value, kept in f32, and the sums are plain integers; per-block
    /// scales are f16-rounded.
    #[test]
    fn super_block_scales_are_shared_and_sums_plain() {
        let mut seed = 5u64;
        let (m, k) = (3, 2 * QK_K);
        let x: Vec<f32> = (0..m * k)
            .map(|i| lcg(&mut seed) * if i % 97 == 0 { 9.0 } else { 1.0 })
            .collect();
        let format = |super_scales| ActFormat {
            offset: 8,
            super_scales,
        };
        let a = Q8Activations::quantize(&x, m, k, format(true));
        let plain = Q8Activations::quantize(&x, m, k, format(false));
        let nb = k / QK8_0;
        for (s, xs) in x.chunks(QK_K).enumerate() {
            let d = xs.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
            for bi in s * SUPER..(s + 1) * SUPER {
                assert_eq!(a.scales[bi], d, "block {bi}");
                let mut q = [0i8; QK8_0];
                let [lo, hi] = quantize_block_scalar(&x[bi * QK8_0..][..QK8_0], &mut q, 1.0 / d);
                assert_eq!(&a.quants[bi * QK8_0..][..QK8_0], &q[..], "block {bi}");
                assert_eq!(a.block_sums[bi] as i32, lo + hi, "block {bi}");
                let halves = [a.half_sums[2 * bi], a.half_sums[2 * bi + 1]];
                assert_eq!(halves.map(i32::from), [lo, hi], "block {bi}");
                assert_eq!(a.folded[bi], -8 * (lo + hi), "block {bi}");
                let pd = plain.scales[bi];
                assert_eq!(pd, f16::from_f32(pd).to_f32(), "block {bi}");
            }
        }
        assert_eq!(a.scales.len(), m * nb);
        assert!(a.super_scales && !plain.super_scales);
    }
}
