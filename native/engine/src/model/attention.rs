//! Attention over the paged KV cache.
//!
//! Work is split into tasks of (query tile, KV head): a tile is a run of up to
//! `QUERY_TILE` consecutive tokens of one sequence, so during prefill every K/V block is read
//! once per tile instead of once per token (in place: f16 is widened as the kernels load
//! it). Blocks are taken `CHUNK_BLOCKS` at a time: the tile's heads × the chunk's slots form
//! small matrix products (`kernels::attn`), and each query row keeps an online-softmax state
//! over the slots it can see: positions `[lo, pos]` of its sequence, where `lo` comes from
//! the layer's sliding window. Tasks run on the engine's worker pool.
//!
//! A row's visible slots are cut into segments of `SEGMENT` slots, each with its own
//! softmax state, merged in order. When there are fewer (tile, KV head) pairs than threads
//! (one sequence decoding at a long context, with one to three KV heads) each segment is a
//! task of its own, so both cores read the cache; the arithmetic is the same either way.

use super::ops::Rope;
use crate::batch::Batch;
use crate::kernels::attn;
use crate::kv::{KvCache, RowDest, KV_BLOCK_SIZE};
use crate::math::fast_exp;

/// Query tokens of one sequence that share each K/V chunk read.
const QUERY_TILE: usize = 32;
/// KV blocks scored together: one softmax rescale per chunk.
const CHUNK_BLOCKS: usize = 4;
const CHUNK: usize = CHUNK_BLOCKS * KV_BLOCK_SIZE;
/// K/V blocks past the one being read that are asked for ahead of their reads (see
/// `KvCache::prefetch_head`): a head's run in a block is 2–8 KB, too short for the hardware
/// prefetchers, and a decode step reads most of the cache once. Asking one block ahead
/// instead of the next whole chunk after the current one took an 8-stream SmolLM2 step's
/// share in the conversion from 25% to 15–19%
const PREFETCH_BLOCKS: usize = 1;

pub struct AttnParams {
    pub n_head: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Scores become `cap · tanh(score / cap)` before the softmax (Gemma 2).
    pub softcap: Option<f32>,
    /// A token sees positions up to its own (window: the last `w`). Otherwise it sees its
    /// whole sequence, which the batch must hold entirely (window: positions within `w / 2`
    /// either side, llama.cpp's symmetric sliding window).
    pub causal: bool,
}

/// Output rows written by disjoint tasks.
struct SharedOut(*mut f32);
// SAFETY: a task writes only the rows of its own tile and only the heads of its own KV head
// group; no two tasks share a (token, head) slice.
unsafe impl Sync for SharedOut {}
unsafe impl Send for SharedOut {}

/// Runs of consecutive positions of one sequence, at most `QUERY_TILE` long, into `out`
/// (computed once per forward pass; every layer attends over the same tiles).
pub fn tiles_into(batch: &Batch, out: &mut Vec<(usize, usize)>) {
    out.clear();
    for i in 0..batch.len() {
        match out.last_mut() {
            Some((start, len))
                if *len < QUERY_TILE
                    && batch.seq[i] == batch.seq[i - 1]
                    && batch.pos[i] == batch.pos[i - 1] + 1 =>
            {
                let _ = start;
                *len += 1;
            }
            _ => out.push((i, 1)),
        }
    }
}

/// The key positions a query at `pos` sees: causal, up to its own (within a window: the last
/// `w`); otherwise the whole sequence up to `seq_end` (within a window: `w / 2` either side,
/// llama.cpp's symmetric sliding window). Both backends' attention follows this rule.
#[inline]
pub(crate) fn visible_keys(
    causal: bool,
    window: Option<usize>,
    pos: usize,
    seq_end: usize,
) -> std::ops::Range<usize> {
    match (causal, window) {
        (true, None) => 0..pos + 1,
        (true, Some(w)) => (pos + 1).saturating_sub(w)..pos + 1,
        (false, None) => 0..seq_end,
        (false, Some(w)) => pos.saturating_sub(w / 2)..(pos + w / 2 + 1).min(seq_end),
    }
}

/// Rotates every token's queries and keys at its own position, then writes its keys and
/// values into the sequence's KV blocks for `layer`. A batch of several tokens does both on
/// the worker pool, a run of tokens per thread: on the calling thread alone they were 4–5%
/// of an 8-stream SmolLM2 decode step on 2 threads (the writes ~3× the rotations, the page
/// faults of blocks written for the first time included), a serial share that grows with
/// the threads the products split over. A validated batch never holds one position twice,
/// so no two tokens write the same rows.
#[allow(clippy::too_many_arguments)]
pub fn rotate_and_store(
    kv: &mut KvCache,
    layer: usize,
    batch: &Batch,
    rope: &Rope,
    neox: bool,
    p: &AttnParams,
    q: &mut [f32],
    k: &mut [f32],
    v: &[f32],
) {
    let q_dim = p.n_head * p.head_dim;
    let kv_dim = p.n_kv_heads * p.head_dim;
    let n = batch.len();
    assert!(q.len() >= n * q_dim && k.len() >= n * kv_dim && v.len() >= n * kv_dim);
    ROW_DESTS.with_borrow_mut(|dests| {
        dests.clear();
        dests.extend((0..n).map(|t| kv.row_dest(layer, batch.seq[t], batch.pos[t])));
        let (qs, ks, dests) = (
            SharedOut(q.as_mut_ptr()),
            SharedOut(k.as_mut_ptr()),
            &*dests,
        );
        let (qs, ks) = (&qs, &ks);
        let store = |tokens: std::ops::Range<usize>| {
            for t in tokens {
                // SAFETY: token `t`'s rows of `q` and `k` (which hold `n` rows, asserted
                // above) are this run's alone, and so are its cache rows: positions are
                // distinct within a validated batch, and `kv` is borrowed for the whole call.
                unsafe {
                    let qt = std::slice::from_raw_parts_mut(qs.0.add(t * q_dim), q_dim);
                    let kt = std::slice::from_raw_parts_mut(ks.0.add(t * kv_dim), kv_dim);
                    rope.apply(t, qt, p.head_dim, neox);
                    rope.apply(t, kt, p.head_dim, neox);
                    dests[t].write(kt, &v[t * kv_dim..(t + 1) * kv_dim]);
                }
            }
        };
        if n < PARALLEL_STORE_ROWS {
            store(0..n)
        } else {
            crate::pool::for_each_chunk(n, store)
        }
    });
}

/// Fewest tokens whose rotations and cache writes go to the worker pool.
const PARALLEL_STORE_ROWS: usize = 4;

thread_local! {
    /// The batch's cache rows, found by the calling thread before the pool writes them
    /// (grown once).
    static ROW_DESTS: std::cell::RefCell<Vec<RowDest>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `q`: `[n_tokens, n_head * head_dim]` (already rotated). `out`: same shape. `tiles`: from
/// [`tiles_into`]. Keys and values of every token of the batch must already be written to `kv`.
///
/// A task is one (tile, KV head) pair walking its segments, or, when there are too few pairs
/// to keep every thread busy (one sequence decoding, a KV head or three), one segment of a
/// pair, followed by a pass that merges each pair's segments in order. Both give bitwise the
/// same result (see [`SEGMENT`]).
pub fn paged_attention(
    kv: &KvCache,
    layer: usize,
    batch: &Batch,
    tiles: &[(usize, usize)],
    q: &[f32],
    p: &AttnParams,
    out: &mut [f32],
) {
    assert_eq!(q.len(), out.len());
    let ratio = p.n_head / p.n_kv_heads;
    let threads = crate::pool::threads();
    // Fewer (tile, KV head) pairs than threads (a decode step of one sequence over 1–3 KV
    // heads): each pair's query heads are split among tasks too. Every row's arithmetic is
    // its own, so the results do not change; each task reads the pair's keys and values.
    let units = tiles.len() * p.n_kv_heads;
    let parts = if units < threads {
        ratio.min(threads.div_ceil(units))
    } else {
        1
    };
    let n_pairs = units * parts;
    let shared = SharedOut(out.as_mut_ptr());
    let shared = &shared;
    let with_scratch = |f: &mut dyn FnMut(&mut Scratch)| {
        SCRATCH.with(|cell| {
            let mut scratch = cell.borrow_mut();
            scratch.fit(p.head_dim, ratio);
            f(&mut scratch)
        })
    };
    let tile = |pair: usize| {
        let (unit, part) = (pair / parts, pair % parts);
        let (start, len) = tiles[unit / p.n_kv_heads];
        let head0 = unit % p.n_kv_heads * ratio;
        let heads = head0 + part * ratio / parts..head0 + (part + 1) * ratio / parts;
        Tile::new(kv, layer, batch, start, len, heads, p)
    };
    let walk = |range: std::ops::Range<usize>| {
        with_scratch(&mut |s| {
            let mut tiles = range.clone().map(tile).peekable();
            while let Some(t) = tiles.next() {
                if let Some(next) = tiles.peek() {
                    next.prefetch_start(kv);
                }
                t.scale_queries(q, p, s);
                s.total.reset(t.rows, p.head_dim);
                for seg in t.segments() {
                    t.attend_segment(kv, seg, p, s);
                    merge(s.total.view_mut(), s.state.view(), t.rows, p.head_dim);
                }
                t.write_out(s.total.view(), p, shared);
            }
        })
    };

    // Few pairs: a task per segment, when that makes more tasks and the partial states fit.
    if n_pairs < 2 * threads && threads > 1 {
        let plan = SPLIT.with(|cell| {
            let mut split = cell.borrow_mut();
            split.tasks.clear();
            let mut width = 0;
            for pair in 0..n_pairs {
                let t = tile(pair);
                width = width.max(State::floats(t.rows, p.head_dim));
                split
                    .tasks
                    .extend(t.segments().map(|seg| (pair as u32, seg as u32)));
            }
            let floats = split.tasks.len() * width;
            if split.tasks.len() <= n_pairs || floats > SPLIT_FLOATS_MAX {
                return None;
            }
            if split.partials.len() < floats {
                split.partials.resize(floats, 0.0);
            }
            Some((
                std::mem::take(&mut split.tasks),
                std::mem::take(&mut split.partials),
                width,
            ))
        });
        if let Some((tasks, mut partials, width)) = plan {
            let parts = SharedOut(partials.as_mut_ptr());
            let parts = &parts;
            crate::pool::for_each_chunk(tasks.len(), |range| {
                with_scratch(&mut |s| {
                    for i in range.clone() {
                        let (pair, seg) = tasks[i];
                        let t = tile(pair as usize);
                        t.scale_queries(q, p, s);
                        t.attend_segment(kv, seg as usize, p, s);
                        // SAFETY: task `i` alone writes floats `[i * width, (i + 1) * width)`
                        // of `partials`, which holds `tasks.len() * width` of them.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(parts.0.add(i * width), width)
                        };
                        s.state.view().store(dst, t.rows, p.head_dim);
                    }
                })
            });
            // tasks are in pair order, then segment order: merge each pair's run in order
            let runs = &tasks;
            crate::pool::for_each_chunk(n_pairs, |range| {
                with_scratch(&mut |s| {
                    for pair in range.clone() {
                        let t = tile(pair);
                        s.total.reset(t.rows, p.head_dim);
                        let first = runs.partition_point(|&(pp, _)| (pp as usize) < pair);
                        let last = runs.partition_point(|&(pp, _)| (pp as usize) <= pair);
                        for i in first..last {
                            let part = StateView::load(
                                &partials[i * width..(i + 1) * width],
                                t.rows,
                                p.head_dim,
                            );
                            merge(s.total.view_mut(), part, t.rows, p.head_dim);
                        }
                        t.write_out(s.total.view(), p, shared);
                    }
                })
            });
            SPLIT.with(|cell| {
                let mut split = cell.borrow_mut();
                split.tasks = tasks;
                split.partials = partials;
            });
            return;
        }
    }
    if n_pairs <= 1 {
        walk(0..n_pairs);
    } else {
        crate::pool::for_each_chunk(n_pairs, walk);
    }
}

/// KV slots per attention segment. A row's visible slots are cut at multiples of `SEGMENT`;
/// each segment's softmax state starts from scratch and the states are merged in segment
/// order ([`merge`]), whether one task walks a pair's segments or each segment is its own
/// task. So a token's result depends only on its own position and cache, never on the
/// batch around it or the number of threads, while a single decoding sequence with few KV
/// heads still gives every thread work. (Contexts up to `SEGMENT` are one segment: the same
/// arithmetic as a single online softmax.)
const SEGMENT: usize = 4 * CHUNK;
/// Most floats of partial states the segment-parallel path may keep; past it the pairs walk
/// their segments themselves (same result, fewer tasks).
const SPLIT_FLOATS_MAX: usize = 1 << 20;

/// Work list and partial states of the segment-parallel path, on the calling thread, grown
/// once.
struct Split {
    /// (pair, segment), in pair order then segment order.
    tasks: Vec<(u32, u32)>,
    partials: Vec<f32>,
}

thread_local! {
    static SPLIT: std::cell::RefCell<Split> = const {
        std::cell::RefCell::new(Split { tasks: Vec::new(), partials: Vec::new() })
    };
}

/// Online-softmax state of a tile's query rows: running maximum, sum of exponentials and
/// unnormalised output.
struct State {
    m: Vec<f32>,
    l: Vec<f32>,
    o: Vec<f32>,
}

impl State {
    const fn new() -> Self {
        State {
            m: Vec::new(),
            l: Vec::new(),
            o: Vec::new(),
        }
    }

    /// Floats of a stored state of `rows` rows of `hd` values.
    fn floats(rows: usize, hd: usize) -> usize {
        rows * (hd + 2)
    }

    fn fit(&mut self, rows: usize, hd: usize) {
        grow(&mut self.m, rows);
        grow(&mut self.l, rows);
        grow(&mut self.o, rows * hd);
    }

    fn reset(&mut self, rows: usize, hd: usize) {
        self.m[..rows].fill(f32::NEG_INFINITY);
        self.l[..rows].fill(0.0);
        self.o[..rows * hd].fill(0.0);
    }

    fn view(&self) -> StateView<'_> {
        StateView {
            m: &self.m,
            l: &self.l,
            o: &self.o,
        }
    }

    fn view_mut(&mut self) -> StateMut<'_> {
        StateMut {
            m: &mut self.m,
            l: &mut self.l,
            o: &mut self.o,
        }
    }
}

#[derive(Clone, Copy)]
struct StateView<'a> {
    m: &'a [f32],
    l: &'a [f32],
    o: &'a [f32],
}

impl<'a> StateView<'a> {
    /// `[m; l; o]` of `rows` rows, as [`StateView::store`] wrote them.
    fn load(src: &'a [f32], rows: usize, hd: usize) -> Self {
        let (m, rest) = src.split_at(rows);
        let (l, o) = rest.split_at(rows);
        StateView {
            m,
            l,
            o: &o[..rows * hd],
        }
    }

    fn store(&self, dst: &mut [f32], rows: usize, hd: usize) {
        dst[..rows].copy_from_slice(&self.m[..rows]);
        dst[rows..2 * rows].copy_from_slice(&self.l[..rows]);
        dst[2 * rows..2 * rows + rows * hd].copy_from_slice(&self.o[..rows * hd]);
    }
}

struct StateMut<'a> {
    m: &'a mut [f32],
    l: &'a mut [f32],
    o: &'a mut [f32],
}

/// Folds the state of one segment into the running total of the segments before it:
/// `m = max(m₁, m₂)`, `l = l₁·e^(m₁-m) + l₂·e^(m₂-m)`, the same for `o`. A row that saw
/// nothing in the segment (`m₂ = -inf`) is left alone; the first segment a row sees is
/// copied.
fn merge(total: StateMut<'_>, part: StateView<'_>, rows: usize, hd: usize) {
    for r in 0..rows {
        let (pm, tm) = (part.m[r], total.m[r]);
        if pm == f32::NEG_INFINITY {
            continue;
        }
        let o = &mut total.o[r * hd..(r + 1) * hd];
        let po = &part.o[r * hd..(r + 1) * hd];
        if tm == f32::NEG_INFINITY {
            total.m[r] = pm;
            total.l[r] = part.l[r];
            o.copy_from_slice(po);
            continue;
        }
        let m = tm.max(pm);
        let (ct, cp) = (fast_exp(tm - m), fast_exp(pm - m));
        total.m[r] = m;
        total.l[r] = total.l[r] * ct + part.l[r] * cp;
        for (x, y) in o.iter_mut().zip(po) {
            *x = *x * ct + *y * cp;
        }
    }
}

/// The runs of slots `[from, to)` inside each KV block: `(block index, first slot, end)`,
/// slots counted from the sequence's start.
fn block_runs(from: usize, to: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (from / KV_BLOCK_SIZE..to.div_ceil(KV_BLOCK_SIZE))
        .map(move |bi| {
            let start = bi * KV_BLOCK_SIZE;
            (bi, start.max(from), (start + KV_BLOCK_SIZE).min(to))
        })
        .filter(|&(_, at, end)| at < end)
}

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

struct Scratch {
    /// Scaled queries of the tile, `[rows, hd]`.
    q: Vec<f32>,
    /// One block's keys or values dequantized to f32, `[KV_BLOCK_SIZE, hd]`, for `q4_0`
    /// caches (f16, f32 and `q8_0` ones are read in place).
    kv: Vec<f32>,
    /// Scores, then probabilities, `[rows, CHUNK]`.
    s: Vec<f32>,
    /// The current segment's state.
    state: State,
    /// The merged state of the segments done so far.
    total: State,
}

thread_local! {
    /// Per worker thread, reused by every layer and pass: a task initialises what it reads,
    /// so only growing it allocates.
    static SCRATCH: std::cell::RefCell<Scratch> = const {
        std::cell::RefCell::new(Scratch {
            q: Vec::new(),
            kv: Vec::new(),
            s: Vec::new(),
            state: State::new(),
            total: State::new(),
        })
    };
}

impl Scratch {
    /// Sizes the buffers for heads of `head_dim` and `ratio` query heads per KV head.
    fn fit(&mut self, head_dim: usize, ratio: usize) {
        let rows = QUERY_TILE * ratio;
        grow(&mut self.q, rows * head_dim);
        grow(&mut self.kv, KV_BLOCK_SIZE * head_dim);
        grow(&mut self.s, rows * CHUNK);
        self.state.fit(rows, head_dim);
        self.total.fit(rows, head_dim);
    }
}

/// One tile of queries (query heads `head0..head0 + heads`, some or all of those of KV head
/// `g`) and the slots its rows see.
struct Tile<'a> {
    blocks: &'a [u32],
    layer: usize,
    start: usize,
    len: usize,
    g: usize,
    first: usize,
    last: usize,
    head0: usize,
    heads: usize,
    rows: usize,
    causal: bool,
    window: Option<usize>,
    seq_end: usize,
}

impl<'a> Tile<'a> {
    fn new(
        kv: &'a KvCache,
        layer: usize,
        batch: &Batch,
        start: usize,
        len: usize,
        heads: std::ops::Range<usize>,
        p: &AttnParams,
    ) -> Self {
        let ratio = p.n_head / p.n_kv_heads;
        let seq = batch.seq[start];
        let last = batch.pos[start + len - 1];
        let seq_end = if p.causal {
            last + 1
        } else {
            (start..batch.len())
                .take_while(|&i| batch.seq[i] == seq)
                .map(|i| batch.pos[i] + 1)
                .max()
                .unwrap_or(last + 1)
        };
        let rows = len * heads.len();
        Tile {
            blocks: kv.seq_view(layer, seq).blocks,
            layer,
            start,
            len,
            g: heads.start / ratio,
            first: batch.pos[start],
            last,
            head0: heads.start,
            heads: heads.len(),
            rows,
            causal: p.causal,
            window: kv.layer_window(layer),
            seq_end,
        }
    }

    /// The first slot a query at `pos` sees; grows with `pos`.
    fn lo_of(&self, pos: usize) -> usize {
        visible_keys(self.causal, self.window, pos, self.seq_end).start
    }

    /// One past the last slot a query at `pos` sees; grows with `pos`.
    fn hi_of(&self, pos: usize) -> usize {
        visible_keys(self.causal, self.window, pos, self.seq_end).end
    }

    /// The segments holding slots some row of the tile sees.
    fn segments(&self) -> std::ops::Range<usize> {
        let (lo, hi) = (self.lo_of(self.first), self.hi_of(self.last));
        if hi <= lo {
            return 0..0;
        }
        lo / SEGMENT..hi.div_ceil(SEGMENT)
    }

    /// Asks for the tile's first [`PREFETCH_BLOCKS`] K/V blocks, so that the task finds them
    /// on their way when it starts this tile (called as it starts the tile before).
    fn prefetch_start(&self, kv: &KvCache) {
        let (lo, hi) = (self.lo_of(self.first), self.hi_of(self.last));
        self.prefetch_blocks(
            kv,
            lo,
            hi.min((lo / KV_BLOCK_SIZE + PREFETCH_BLOCKS) * KV_BLOCK_SIZE),
        );
    }

    /// Asks for the K/V blocks holding slots `[from, to)`; returns the slot after the last
    /// block asked for (`from` when none), where the next call can continue.
    fn prefetch_blocks(&self, kv: &KvCache, from: usize, to: usize) -> usize {
        let mut at = from;
        while at < to {
            kv.prefetch_head(self.layer, self.blocks[at / KV_BLOCK_SIZE], self.g);
            at = (at / KV_BLOCK_SIZE + 1) * KV_BLOCK_SIZE;
        }
        at
    }

    /// The tile's queries times the softmax scale into `s.q`.
    fn scale_queries(&self, q: &[f32], p: &AttnParams, s: &mut Scratch) {
        let hd = p.head_dim;
        let row = p.n_head * hd;
        for t in 0..self.len {
            let src = &q[(self.start + t) * row + self.head0 * hd..][..self.heads * hd];
            let dst = &mut s.q[t * self.heads * hd..(t + 1) * self.heads * hd];
            for (d, x) in dst.iter_mut().zip(src) {
                *d = x * p.scale;
            }
        }
    }

    /// The softmax state of the tile's rows over the slots of segment `seg` they see, from
    /// scratch, into `s.state`, a chunk of `CHUNK` slots at a time: scores for the whole
    /// chunk, one online-softmax update per query row, then the chunk's weighted values.
    /// Keys and values are read block by block where the cache keeps them (f16 and `q8_0`
    /// widened as the kernels load them: a step no longer writes and re-reads the chunk as
    /// f32 scratch, which was 12–15% of an 8-stream f16 decode step). `s.q` must hold the
    /// scaled queries.
    fn attend_segment(&self, kv: &KvCache, seg: usize, p: &AttnParams, s: &mut Scratch) {
        let hd = p.head_dim;
        let rows = self.rows;
        s.state.reset(rows, hd);
        let end = self.hi_of(self.last).min((seg + 1) * SEGMENT);
        let start = self.lo_of(self.first).max(seg * SEGMENT);
        // Scores start at an even slot: the kernel takes keys in pairs and a block holds an
        // even number of slots, so no pair leaves its block. A slot before `start` is masked
        // like any slot a row does not see (values are summed from `start` only).
        let mut c0 = start & !(attn::KEY_BLOCK - 1);
        let mut prefetched = c0;
        while c0 < end {
            let c1 = ((c0 / KV_BLOCK_SIZE + CHUNK_BLOCKS) * KV_BLOCK_SIZE).min(end);
            let keys = (c1 - c0).next_multiple_of(attn::KEY_BLOCK);
            for (bi, at, block_end) in block_runs(c0, c1) {
                let ahead = ((bi + 1 + PREFETCH_BLOCKS) * KV_BLOCK_SIZE).min(end);
                prefetched = self.prefetch_blocks(kv, prefetched, ahead);
                let n = (block_end - at).next_multiple_of(attn::KEY_BLOCK);
                let first = at % KV_BLOCK_SIZE;
                let k = self.head_rows(kv, false, bi, first..first + n, hd, &mut s.kv);
                attn::scores(&s.q, rows, k, n, hd, &mut s.s[at - c0..], CHUNK);
            }
            let st = &mut s.state;
            for r in 0..rows {
                let probs = &mut s.s[r * CHUNK..r * CHUNK + keys];
                let pos = self.first + r / self.heads;
                // slots of this chunk visible to the row's query, relative to c0
                let (a, z) = (self.lo_of(pos).max(start).max(c0), self.hi_of(pos).min(c1));
                if a >= z {
                    probs.fill(0.0);
                    continue;
                }
                let (a, z) = (a - c0, z - c0);
                if let Some(cap) = p.softcap {
                    for x in &mut probs[a..z] {
                        *x = cap * (*x / cap).tanh();
                    }
                }
                let m_new = st.m[r].max(attn::max_of(&probs[a..z]));
                let sum = attn::exp_sum(&mut probs[a..z], m_new);
                probs[..a].fill(0.0);
                probs[z..].fill(0.0);
                if st.m[r] != m_new && st.m[r] != f32::NEG_INFINITY {
                    let corr = fast_exp(st.m[r] - m_new);
                    st.l[r] *= corr;
                    for x in &mut st.o[r * hd..(r + 1) * hd] {
                        *x *= corr;
                    }
                }
                st.l[r] += sum;
                st.m[r] = m_new;
            }
            for (bi, _, _) in block_runs(c0.max(start), c1) {
                kv.prefetch_values_l1(self.layer, self.blocks[bi], self.g);
            }
            for (bi, at, block_end) in block_runs(c0.max(start), c1) {
                let (first, n) = (at % KV_BLOCK_SIZE, block_end - at);
                let v = self.head_rows(kv, true, bi, first..first + n, hd, &mut s.kv);
                attn::accumulate(&s.s[at - c0..], CHUNK, rows, v, n, hd, &mut st.o);
            }
            c0 = c1;
        }
    }

    /// Keys (or values) of the tile's KV head in slots `slots` of its `bi`-th block: the
    /// cache's rows in place, or dequantized into `scratch` for quantized blocks.
    fn head_rows<'s>(
        &self,
        kv: &'s KvCache,
        values: bool,
        bi: usize,
        slots: std::ops::Range<usize>,
        hd: usize,
        scratch: &'s mut [f32],
    ) -> attn::Rows<'s> {
        let b = self.blocks[bi];
        match kv.head_rows(self.layer, values, b, self.g, slots.clone()) {
            Some(rows) => rows,
            None => {
                let out = &mut scratch[..slots.len() * hd];
                kv.read_head(self.layer, values, b, self.g, slots, out);
                attn::Rows::F32(out)
            }
        }
    }

    /// The normalised outputs of a merged state into the tile's rows of the output.
    fn write_out(&self, total: StateView<'_>, p: &AttnParams, shared: &SharedOut) {
        let hd = p.head_dim;
        let row = p.n_head * hd;
        for t in 0..self.len {
            let off = (self.start + t) * row + self.head0 * hd;
            // SAFETY: see `SharedOut`; `off + heads * hd` is within the output (`q.len()`).
            let o = unsafe { std::slice::from_raw_parts_mut(shared.0.add(off), self.heads * hd) };
            for h in 0..self.heads {
                let r = t * self.heads + h;
                let inv = 1.0 / total.l[r];
                for (x, acc) in o[h * hd..(h + 1) * hd].iter_mut().zip(&total.o[r * hd..]) {
                    *x = acc * inv;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvType;

    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }

        fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.next()).collect()
        }
    }

    const HD: usize = 64;
    const HEADS: usize = 3;

    fn params() -> AttnParams {
        AttnParams {
            n_head: HEADS,
            n_kv_heads: 1,
            head_dim: HD,
            scale: 1.0 / (HD as f32).sqrt(),
            softcap: None,
            causal: true,
        }
    }

    /// One layer, one KV head; sequence 0 holds `long` positions, sequence 1 holds 64. Also
    /// returns sequence 0's keys and values as the cache stores them.
    fn cache(
        long: usize,
        window: Option<usize>,
        ty: KvType,
        rng: &mut Rng,
    ) -> (KvCache, Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let mut kv = KvCache::new(&[window], 1, HD, 2 * long, (2, 0), (ty, ty)).unwrap();
        let stored = |x: Vec<f32>| match ty {
            KvType::F16 => x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
            _ => x,
        };
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for (seq, len) in [(0, long), (1, 64)] {
            kv.reserve(seq, 0, len).unwrap();
            for pos in 0..len {
                // keys scaled up so the softmax is peaked and rescaling matters
                let k: Vec<f32> = rng.vec(HD).iter().map(|x| 4.0 * x).collect();
                let v = rng.vec(HD);
                kv.write(0, seq, pos, &k, &v);
                if seq == 0 && matches!(ty, KvType::Q8_0 | KvType::Q4_0) {
                    // what the cache holds: its own dequantization
                    let b = kv.seq_view(0, 0).blocks[pos / KV_BLOCK_SIZE];
                    let slot = pos % KV_BLOCK_SIZE..pos % KV_BLOCK_SIZE + 1;
                    let (mut k, mut v) = (vec![0f32; HD], vec![0f32; HD]);
                    kv.read_head(0, false, b, 0, slot.clone(), &mut k);
                    kv.read_head(0, true, b, 0, slot, &mut v);
                    ks.push(k);
                    vs.push(v);
                } else if seq == 0 {
                    ks.push(stored(k));
                    vs.push(stored(v));
                }
            }
            kv.commit(seq, len);
        }
        (kv, ks, vs)
    }

    #[test]
    fn a_batchs_rotations_and_cache_writes_on_the_pool_match_token_by_token() {
        use super::super::ops::inv_freq;
        let tokens = 40;
        let batch = Batch::for_sequence(&vec![1; tokens], 0, 0);
        let mut rope = Rope::default();
        let positions: Vec<usize> = (0..tokens).map(|t| 3 * t + 1).collect();
        rope.fill(&positions, &inv_freq(HD, 10000.0, None), 1.0);
        let mut rng = Rng(7);
        let (q, k, v) = (
            rng.vec(tokens * HEADS * HD),
            rng.vec(tokens * HD),
            rng.vec(tokens * HD),
        );
        let fresh = || {
            let types = (KvType::F16, KvType::F16);
            let mut kv = KvCache::new(&[None], 1, HD, 64, (1, 0), types).unwrap();
            kv.reserve(0, 0, tokens).unwrap();
            kv
        };
        let row = |kv: &KvCache, values: bool, pos: usize| {
            let b = kv.seq_view(0, 0).blocks[pos / KV_BLOCK_SIZE];
            let mut out = vec![0f32; HD];
            kv.read_head(
                0,
                values,
                b,
                0,
                pos % KV_BLOCK_SIZE..pos % KV_BLOCK_SIZE + 1,
                &mut out,
            );
            out
        };
        for neox in [false, true] {
            let (mut kv, mut qm, mut km) = (fresh(), q.clone(), k.clone());
            crate::pool::with_threads(2, || {
                rotate_and_store(
                    &mut kv,
                    0,
                    &batch,
                    &rope,
                    neox,
                    &params(),
                    &mut qm,
                    &mut km,
                    &v,
                )
            });
            let mut alone = fresh();
            for t in 0..tokens {
                let mut one = q[t * HEADS * HD..(t + 1) * HEADS * HD].to_vec();
                rope.apply(t, &mut one, HD, neox);
                assert_eq!(
                    &qm[t * HEADS * HD..(t + 1) * HEADS * HD],
                    &one[..],
                    "token {t}"
                );
                let mut one = k[t * HD..(t + 1) * HD].to_vec();
                rope.apply(t, &mut one, HD, neox);
                assert_eq!(&km[t * HD..(t + 1) * HD], &one[..], "token {t}");
                alone.write(0, 0, t, &one, &v[t * HD..(t + 1) * HD]);
                for values in [false, true] {
                    assert_eq!(row(&kv, values, t), row(&alone, values, t), "token {t}");
                }
            }
        }
    }

    fn attend(kv: &KvCache, batch: &Batch, q: &[f32], threads: usize) -> Vec<f32> {
        let mut tiles = Vec::new();
        tiles_into(batch, &mut tiles);
        let mut out = vec![0f32; q.len()];
        crate::pool::with_threads(threads, || {
            paged_attention(kv, 0, batch, &tiles, q, &params(), &mut out)
        });
        out
    }

    /// The softmax in f64 over the slots `[lo, ks.len())`.
    fn reference(q: &[f32], ks: &[Vec<f32>], vs: &[Vec<f32>], lo: usize) -> Vec<f64> {
        let scale = params().scale as f64;
        let mut out = Vec::new();
        for h in 0..HEADS {
            let qh = &q[h * HD..(h + 1) * HD];
            let scores: Vec<f64> = ks[lo..]
                .iter()
                .map(|k| {
                    scale
                        * qh.iter()
                            .zip(k)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let l: f64 = w.iter().sum();
            for d in 0..HD {
                out.push(
                    w.iter()
                        .zip(&vs[lo..])
                        .map(|(w, v)| w * v[d] as f64)
                        .sum::<f64>()
                        / l,
                );
            }
        }
        out
    }

    fn assert_close(got: &[f32], want: &[f64]) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let g = *g as f64;
            assert!(
                (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "value {i}: {g} vs {w}"
            );
        }
    }

    /// A `q8_0` cache's blocks, which the kernels read in place, give bitwise the attention
    /// of an f32 cache holding their dequantized values (a `q4_0` cache's are dequantized to
    /// scratch first: the same values again), at a long and a short context.
    #[test]
    fn quantized_blocks_give_the_attention_of_their_dequantized_values() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        for ty in [KvType::Q8_0, KvType::Q4_0] {
            for long in [300, 70] {
                let (kv, ks, vs) = cache(long, None, ty, &mut rng);
                let mut plain =
                    KvCache::new(&[None], 1, HD, 2 * long, (2, 0), (KvType::F32, KvType::F32))
                        .unwrap();
                plain.reserve(0, 0, long).unwrap();
                for pos in 0..long {
                    plain.write(0, 0, pos, &ks[pos], &vs[pos]);
                }
                plain.commit(0, long);
                let q = rng.vec(HEADS * HD);
                let b = Batch::for_sequence(&[0], long - 1, 0);
                assert_eq!(
                    attend(&kv, &b, &q, 2),
                    attend(&plain, &b, &q, 2),
                    "{ty:?} {long}"
                );
            }
        }
    }

    /// A decoding token at a short context and at a long one, with an even and an odd number
    /// of slots in its last block, with and without a sliding window (whose first block is
    /// partial), in f32 and f16 caches: its query heads split among tasks, and one task per
    /// segment, on two and three threads equal the pairs walking their segments on one
    /// thread, in a batch with more pairs than threads, and the same token as
    /// the second of a two-token tile, all bitwise, and within f32 rounding of the softmax in
    /// f64.
    #[test]
    fn decode_attention_is_exact_and_independent_of_threads_batch_and_tile() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for ty in [KvType::F32, KvType::F16] {
            for (long, window) in [
                (100, None),
                (1000, None),
                (1001, None),
                (1000, Some(301)),
                (1001, Some(300)),
            ] {
                let case = format!("{ty:?} {long} {window:?}");
                let (kv, ks, vs) = cache(long, window, ty, &mut rng);
                let q = rng.vec(HEADS * HD);

                let alone = Batch::for_sequence(&[0], long - 1, 0);
                let split = attend(&kv, &alone, &q, 2);
                let one = attend(&kv, &alone, &q, 1);
                assert_eq!(split, one, "{case}: threads");
                // (the query heads split in two tasks above, in three here)
                assert_eq!(attend(&kv, &alone, &q, 3), one, "{case}: 3 threads");

                // four more tiles (non-consecutive positions of sequence 1): five pairs
                let mut mixed = Batch::for_sequence(&[0], long - 1, 0);
                for pos in [10, 20, 30, 40] {
                    mixed.push(0, pos, 1, true);
                }
                let mut q_mixed = q.clone();
                q_mixed.extend(rng.vec(4 * HEADS * HD));
                let in_batch = attend(&kv, &mixed, &q_mixed, 2);
                assert_eq!(&in_batch[..HEADS * HD], &split[..], "{case}: batch");

                let pair = Batch::for_sequence(&[0, 0], long - 2, 0);
                let mut q_pair = rng.vec(HEADS * HD);
                q_pair.extend(&q);
                let tiled = attend(&kv, &pair, &q_pair, 2);
                assert_eq!(&tiled[HEADS * HD..], &split[..], "{case}: tile");

                let lo = window.map_or(0, |w| long.saturating_sub(w));
                assert_close(&split, &reference(&q, &ks, &vs, lo));
            }
        }
    }
}
