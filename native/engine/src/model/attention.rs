//! Attention over the paged KV cache.
//!
//! Work is split into tasks of (query tile, KV head): a tile is a run of up to
//! `QUERY_TILE` consecutive tokens of one sequence, so during prefill every K/V block is read
//! (and converted from f16) once per tile instead of once per token. Each query keeps an
//! online-softmax state over the blocks it can see: positions `[lo, pos]` of its sequence,
//! where `lo` comes from the layer's sliding window. Tasks run on candle's worker pool.

use super::ops::Rope;
use crate::batch::Batch;
use crate::kv::{KvCache, KV_BLOCK_SIZE};

/// Query tokens of one sequence that share each K/V block read.
const QUERY_TILE: usize = 32;

pub struct AttnParams {
    pub n_head: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// Output rows written by disjoint tasks.
struct SharedOut(*mut f32);
// SAFETY: a task writes only the rows of its own tile and only the heads of its own KV head
// group; no two tasks share a (token, head) slice.
unsafe impl Sync for SharedOut {}
unsafe impl Send for SharedOut {}

/// Runs of consecutive positions of one sequence, at most `QUERY_TILE` long.
fn tiles(batch: &Batch) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
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
    out
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

/// `q`: `[n_tokens, n_head * head_dim]` (already rotated). `out`: same shape.
/// Keys and values of every token of the batch must already be written to `kv`.
pub fn paged_attention(
    kv: &KvCache,
    layer: usize,
    batch: &Batch,
    q: &[f32],
    p: &AttnParams,
    out: &mut [f32],
) {
    assert_eq!(q.len(), out.len());
    let tiles = tiles(batch);
    let n_tasks = tiles.len() * p.n_kv_heads;
    let shared = SharedOut(out.as_mut_ptr());
    let run = |range: std::ops::Range<usize>| {
        let shared = &shared;
        let mut scratch = Scratch::new(p.head_dim, p.n_head / p.n_kv_heads);
        for task in range {
            let (start, len) = tiles[task / p.n_kv_heads];
            let g = task % p.n_kv_heads;
            attend_tile(kv, layer, batch, start, len, g, q, p, shared, &mut scratch);
        }
    };
    if n_tasks <= 1 {
        run(0..n_tasks);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(n_tasks, run);
    }
}

struct Scratch {
    k: Vec<f32>,
    v: Vec<f32>,
    scores: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
}

impl Scratch {
    fn new(head_dim: usize, ratio: usize) -> Self {
        Scratch {
            k: vec![0.0; KV_BLOCK_SIZE * head_dim],
            v: vec![0.0; KV_BLOCK_SIZE * head_dim],
            scores: vec![0.0; KV_BLOCK_SIZE],
            m: vec![0.0; QUERY_TILE * ratio],
            l: vec![0.0; QUERY_TILE * ratio],
        }
    }
}

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
    let lo_of = |pos: usize| window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let seq = batch.seq[start];
    let first = batch.pos[start];
    let last = batch.pos[start + len - 1];
    let blocks = kv.seq_view(layer, seq).blocks;
    s.m[..len * ratio].fill(f32::NEG_INFINITY);
    s.l[..len * ratio].fill(0.0);
    for t in 0..len {
        let off = (start + t) * row + g * ratio * hd;
        // SAFETY: see `SharedOut`; `off + ratio * hd` is within the output (`q.len()`).
        let o = unsafe { std::slice::from_raw_parts_mut(shared.0.add(off), ratio * hd) };
        o.fill(0.0);
    }
    let lo_min = lo_of(first);
    for (bi, &b) in blocks
        .iter()
        .enumerate()
        .take(last / KV_BLOCK_SIZE + 1)
        .skip(lo_min / KV_BLOCK_SIZE)
    {
        let block_start = bi * KV_BLOCK_SIZE;
        let s0 = lo_min.max(block_start) - block_start;
        let s1 = (last + 1).min(block_start + KV_BLOCK_SIZE) - block_start;
        let n = s1 - s0;
        kv.read_head(layer, false, b, g, s0..s1, &mut s.k[..n * hd]);
        kv.read_head(layer, true, b, g, s0..s1, &mut s.v[..n * hd]);
        for t in 0..len {
            let pos = first + t;
            // slots of this block visible to query t, relative to s0
            let from = lo_of(pos).max(block_start + s0);
            let to = pos.min(block_start + s1 - 1);
            if from > to {
                continue;
            }
            let (a, z) = (from - block_start - s0, to - block_start - s0 + 1);
            let off = (start + t) * row + g * ratio * hd;
            // SAFETY: as above.
            let o = unsafe { std::slice::from_raw_parts_mut(shared.0.add(off), ratio * hd) };
            for h in 0..ratio {
                let qh = &q[off + h * hd..off + (h + 1) * hd];
                let mut mb = f32::NEG_INFINITY;
                for j in a..z {
                    let d = dot(qh, &s.k[j * hd..(j + 1) * hd]) * p.scale;
                    s.scores[j] = d;
                    mb = mb.max(d);
                }
                let st = t * ratio + h;
                let m_new = s.m[st].max(mb);
                let corr = (s.m[st] - m_new).exp();
                let oh = &mut o[h * hd..(h + 1) * hd];
                if corr != 1.0 {
                    for x in oh.iter_mut() {
                        *x *= corr;
                    }
                }
                let mut sum = 0.0;
                for j in a..z {
                    let w = (s.scores[j] - m_new).exp();
                    sum += w;
                    for (x, vv) in oh.iter_mut().zip(&s.v[j * hd..(j + 1) * hd]) {
                        *x += w * vv;
                    }
                }
                s.l[st] = s.l[st] * corr + sum;
                s.m[st] = m_new;
            }
        }
    }
    for t in 0..len {
        let off = (start + t) * row + g * ratio * hd;
        // SAFETY: as above.
        let o = unsafe { std::slice::from_raw_parts_mut(shared.0.add(off), ratio * hd) };
        for h in 0..ratio {
            let inv = 1.0 / s.l[t * ratio + h];
            for x in &mut o[h * hd..(h + 1) * hd] {
                *x *= inv;
            }
        }
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise without fast-math.
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s
}
