//! Attention over the paged KV cache: one task per (token, KV head), online softmax over the
//! sequence's blocks, tasks spread over candle's worker pool.

use crate::batch::Batch;
use crate::kv::{KvCache, KV_BLOCK_SIZE};

pub struct AttnParams {
    pub n_head: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// Output rows written by disjoint tasks.
struct SharedOut(*mut f32);
// SAFETY: each task writes only the `head_dim`-sized slices of the heads it owns
// (token t, query heads of KV head g), which no other task touches.
unsafe impl Sync for SharedOut {}
unsafe impl Send for SharedOut {}

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
    let n_tasks = batch.len() * p.n_kv_heads;
    let shared = SharedOut(out.as_mut_ptr());
    let out_len = out.len();
    let run = |range: std::ops::Range<usize>| {
        let shared = &shared;
        let mut kbuf = vec![0f32; KV_BLOCK_SIZE * p.head_dim];
        let mut vbuf = vec![0f32; KV_BLOCK_SIZE * p.head_dim];
        let mut scores = vec![0f32; KV_BLOCK_SIZE];
        for task in range {
            let t = task / p.n_kv_heads;
            let g = task % p.n_kv_heads;
            let ratio = p.n_head / p.n_kv_heads;
            let row = p.n_head * p.head_dim;
            let off = t * row + g * ratio * p.head_dim;
            let len = ratio * p.head_dim;
            debug_assert!(off + len <= out_len);
            // SAFETY: see `SharedOut`; the range is in bounds of `out`.
            let o = unsafe { std::slice::from_raw_parts_mut(shared.0.add(off), len) };
            attend_one(
                kv,
                layer,
                batch.seq[t],
                batch.pos[t],
                g,
                &q[off..off + len],
                p,
                o,
                &mut kbuf,
                &mut vbuf,
                &mut scores,
            );
        }
    };
    if n_tasks <= 1 {
        run(0..n_tasks);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(n_tasks, run);
    }
}

#[allow(clippy::too_many_arguments)]
fn attend_one(
    kv: &KvCache,
    layer: usize,
    seq: usize,
    pos: usize,
    g: usize,
    q: &[f32],
    p: &AttnParams,
    out: &mut [f32],
    kbuf: &mut [f32],
    vbuf: &mut [f32],
    scores: &mut [f32],
) {
    let hd = p.head_dim;
    let ratio = p.n_head / p.n_kv_heads;
    let lo = match kv.layer_window(layer) {
        Some(w) => (pos + 1).saturating_sub(w),
        None => 0,
    };
    let blocks = kv.seq_view(layer, seq).blocks;
    let mut m = vec![f32::NEG_INFINITY; ratio];
    let mut l = vec![0f32; ratio];
    out.fill(0.0);
    for bi in lo / KV_BLOCK_SIZE..=pos / KV_BLOCK_SIZE {
        let start = bi * KV_BLOCK_SIZE;
        let s0 = lo.max(start) - start;
        let s1 = (pos + 1).min(start + KV_BLOCK_SIZE) - start;
        let n = s1 - s0;
        let b = blocks[bi];
        kv.read_head(layer, false, b, g, s0, s1, &mut kbuf[..n * hd]);
        kv.read_head(layer, true, b, g, s0, s1, &mut vbuf[..n * hd]);
        for h in 0..ratio {
            let qh = &q[h * hd..(h + 1) * hd];
            let mut mb = f32::NEG_INFINITY;
            for s in 0..n {
                let k = &kbuf[s * hd..(s + 1) * hd];
                let d = dot(qh, k) * p.scale;
                scores[s] = d;
                mb = mb.max(d);
            }
            let m_new = m[h].max(mb);
            let corr = (m[h] - m_new).exp();
            let oh = &mut out[h * hd..(h + 1) * hd];
            if corr != 1.0 {
                for x in oh.iter_mut() {
                    *x *= corr;
                }
            }
            let mut sum = 0.0;
            for s in 0..n {
                let w = (scores[s] - m_new).exp();
                sum += w;
                let v = &vbuf[s * hd..(s + 1) * hd];
                for (x, vv) in oh.iter_mut().zip(v) {
                    *x += w * vv;
                }
            }
            l[h] = l[h] * corr + sum;
            m[h] = m_new;
        }
    }
    for h in 0..ratio {
        let inv = 1.0 / l[h];
        for x in &mut out[h * hd..(h + 1) * hd] {
            *x *= inv;
        }
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise without fast-math.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for j in 0..8 {
            acc[j] += a[c * 8 + j] * b[c * 8 + j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}
