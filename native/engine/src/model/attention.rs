//! Attention over the paged KV cache.
//!
//! Work is split into tasks of (query tile, KV head): a tile is a run of up to
//! `QUERY_TILE` consecutive tokens of one sequence, so during prefill every K/V block is read
//! (and converted from f16) once per tile instead of once per token. Blocks are taken
//! `CHUNK_BLOCKS` at a time: the tile's heads × the chunk's slots form small matrix products
//! (`kernels::attn`), and each query row keeps an online-softmax state over the slots it can
//! see: positions `[lo, pos]` of its sequence, where `lo` comes from the layer's sliding
//! window. Tasks run on the engine's worker pool.

use super::ops::{fast_exp, Rope};
use crate::batch::Batch;
use crate::kernels::attn;
use crate::kv::{KvCache, KV_BLOCK_SIZE};

/// Query tokens of one sequence that share each K/V chunk read.
const QUERY_TILE: usize = 32;
/// KV blocks converted to f32 and scored together: one softmax rescale per chunk.
const CHUNK_BLOCKS: usize = 4;
const CHUNK: usize = CHUNK_BLOCKS * KV_BLOCK_SIZE;

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

/// Rotates every token's queries and keys at its own position, then writes its keys and
/// values into the sequence's KV blocks for `layer`.
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
    for t in 0..batch.len() {
        rope.apply(t, &mut q[t * q_dim..(t + 1) * q_dim], p.head_dim, neox);
        rope.apply(t, &mut k[t * kv_dim..(t + 1) * kv_dim], p.head_dim, neox);
        kv.write(
            layer,
            batch.seq[t],
            batch.pos[t],
            &k[t * kv_dim..(t + 1) * kv_dim],
            &v[t * kv_dim..(t + 1) * kv_dim],
        );
    }
}

/// `q`: `[n_tokens, n_head * head_dim]` (already rotated). `out`: same shape. `tiles`: from
/// [`tiles_into`]. Keys and values of every token of the batch must already be written to `kv`.
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
    let n_tasks = tiles.len() * p.n_kv_heads;
    let shared = SharedOut(out.as_mut_ptr());
    let run = |range: std::ops::Range<usize>| {
        let shared = &shared;
        SCRATCH.with(|cell| {
            let mut scratch = cell.borrow_mut();
            scratch.fit(p.head_dim, p.n_head / p.n_kv_heads);
            for task in range.clone() {
                let (start, len) = tiles[task / p.n_kv_heads];
                let g = task % p.n_kv_heads;
                attend_tile(kv, layer, batch, start, len, g, q, p, shared, &mut scratch);
            }
        });
    };
    if n_tasks <= 1 {
        run(0..n_tasks);
    } else {
        crate::pool::for_each_chunk(n_tasks, run);
    }
}

struct Scratch {
    /// Scaled queries of the tile, `[rows, hd]`.
    q: Vec<f32>,
    /// One chunk of keys and values in f32, `[CHUNK, hd]`.
    k: Vec<f32>,
    v: Vec<f32>,
    /// Scores, then probabilities, `[rows, CHUNK]`.
    s: Vec<f32>,
    /// Unnormalised outputs, `[rows, hd]`.
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
}

thread_local! {
    /// Per worker thread, reused by every layer and pass: `attend_tile` initialises what it
    /// reads, so only growing it allocates.
    static SCRATCH: std::cell::RefCell<Scratch> = const {
        std::cell::RefCell::new(Scratch {
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            s: Vec::new(),
            o: Vec::new(),
            m: Vec::new(),
            l: Vec::new(),
        })
    };
}

impl Scratch {
    /// Sizes the buffers for heads of `head_dim` and `ratio` query heads per KV head.
    fn fit(&mut self, head_dim: usize, ratio: usize) {
        let rows = (QUERY_TILE * ratio).next_multiple_of(attn::ROW_BLOCK);
        let grow = |v: &mut Vec<f32>, n: usize| {
            if v.len() < n {
                v.resize(n, 0.0);
            }
        };
        grow(&mut self.q, rows * head_dim);
        grow(&mut self.k, CHUNK * head_dim);
        grow(&mut self.v, CHUNK * head_dim);
        grow(&mut self.s, rows * CHUNK);
        grow(&mut self.o, rows * head_dim);
        grow(&mut self.m, rows);
        grow(&mut self.l, rows);
    }
}

/// Attention of one tile of queries (every head of KV head `g`) over the visible KV slots,
/// a chunk of `CHUNK` slots at a time: scores for the whole chunk, one online-softmax update
/// per query row, then the chunk's weighted values.
#[allow(clippy::too_many_arguments)]
fn attend_tile(
    kv: &KvCache,
    layer: usize,
    batch: &Batch,
    start: usize,
    len: usize,
    g: usize,
    q: &[f32],
    p: &AttnParams,
    shared: &SharedOut,
    s: &mut Scratch,
) {
    let hd = p.head_dim;
    let ratio = p.n_head / p.n_kv_heads;
    let row = p.n_head * hd;
    let window = kv.layer_window(layer);
    let seq = batch.seq[start];
    let first = batch.pos[start];
    let last = batch.pos[start + len - 1];
    // the positions `[lo_of(pos), hi_of(pos))` a query at `pos` sees; both grow with `pos`
    let causal = p.causal;
    let seq_end = if causal {
        last + 1
    } else {
        (start..batch.len())
            .take_while(|&i| batch.seq[i] == seq)
            .map(|i| batch.pos[i] + 1)
            .max()
            .unwrap_or(last + 1)
    };
    let lo_of = |pos: usize| match (causal, window) {
        (_, None) => 0,
        (true, Some(w)) => (pos + 1).saturating_sub(w),
        (false, Some(w)) => pos.saturating_sub(w / 2),
    };
    let hi_of = |pos: usize| match (causal, window) {
        (true, _) => pos + 1,
        (false, None) => seq_end,
        (false, Some(w)) => (pos + w / 2 + 1).min(seq_end),
    };
    let hi_last = hi_of(last);
    let blocks = kv.seq_view(layer, seq).blocks;
    let rows = len * ratio;
    let rows_pad = rows.next_multiple_of(attn::ROW_BLOCK);
    for t in 0..len {
        let src = &q[(start + t) * row + g * ratio * hd..][..ratio * hd];
        let dst = &mut s.q[t * ratio * hd..(t + 1) * ratio * hd];
        for (d, x) in dst.iter_mut().zip(src) {
            *d = x * p.scale;
        }
    }
    s.q[rows * hd..rows_pad * hd].fill(0.0);
    s.o[..rows_pad * hd].fill(0.0);
    s.m[..rows_pad].fill(f32::NEG_INFINITY);
    s.l[..rows_pad].fill(0.0);

    let mut c0 = lo_of(first);
    while c0 < hi_last {
        let c1 = ((c0 / KV_BLOCK_SIZE + CHUNK_BLOCKS) * KV_BLOCK_SIZE).min(hi_last);
        let n = c1 - c0;
        let mut at = c0;
        while at < c1 {
            let bi = at / KV_BLOCK_SIZE;
            let block_start = bi * KV_BLOCK_SIZE;
            let end = (block_start + KV_BLOCK_SIZE).min(c1);
            let (from, to) = ((at - c0) * hd, (end - c0) * hd);
            let slots = at - block_start..end - block_start;
            kv.read_head(
                layer,
                false,
                blocks[bi],
                g,
                slots.clone(),
                &mut s.k[from..to],
            );
            kv.read_head(layer, true, blocks[bi], g, slots, &mut s.v[from..to]);
            at = end;
        }
        let next_end = (c1 + CHUNK).min(hi_last);
        for bi in (c1.div_ceil(KV_BLOCK_SIZE) * KV_BLOCK_SIZE..next_end).step_by(KV_BLOCK_SIZE) {
            kv.prefetch_head(layer, blocks[bi / KV_BLOCK_SIZE], g);
        }
        let keys = n.next_multiple_of(attn::KEY_BLOCK);
        s.k[n * hd..keys * hd].fill(0.0);
        s.v[n * hd..keys * hd].fill(0.0);
        attn::scores(&s.q, rows_pad, &s.k, keys, hd, &mut s.s, CHUNK);
        for r in 0..rows_pad {
            let probs = &mut s.s[r * CHUNK..r * CHUNK + keys];
            let pos = first + r / ratio;
            // slots of this chunk visible to the row's query, relative to c0
            let (a, z) = (lo_of(pos).max(c0), hi_of(pos).min(c1));
            if r >= rows || a >= z {
                probs.fill(0.0);
                continue;
            }
            let (a, z) = (a - c0, z - c0);
            if let Some(cap) = p.softcap {
                for x in &mut probs[a..z] {
                    *x = cap * (*x / cap).tanh();
                }
            }
            let m_chunk = probs[a..z].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let m_new = s.m[r].max(m_chunk);
            let mut sum = 0.0;
            for x in &mut probs[a..z] {
                *x = fast_exp(*x - m_new);
                sum += *x;
            }
            probs[..a].fill(0.0);
            probs[z..].fill(0.0);
            if s.m[r] != m_new && s.m[r] != f32::NEG_INFINITY {
                let corr = fast_exp(s.m[r] - m_new);
                s.l[r] *= corr;
                for x in &mut s.o[r * hd..(r + 1) * hd] {
                    *x *= corr;
                }
            }
            s.l[r] += sum;
            s.m[r] = m_new;
        }
        attn::accumulate(&s.s, CHUNK, rows_pad, &s.v, keys, hd, &mut s.o);
        c0 = c1;
    }
    for t in 0..len {
        let off = (start + t) * row + g * ratio * hd;
        // SAFETY: see `SharedOut`; `off + ratio * hd` is within the output (`q.len()`).
        let o = unsafe { std::slice::from_raw_parts_mut(shared.0.add(off), ratio * hd) };
        for h in 0..ratio {
            let r = t * ratio + h;
            let inv = 1.0 / s.l[r];
            for (x, acc) in o[h * hd..(h + 1) * hd].iter_mut().zip(&s.o[r * hd..]) {
                *x = acc * inv;
            }
        }
    }
}
