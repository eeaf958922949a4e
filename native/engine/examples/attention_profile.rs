//! Times decode attention alone over a paged KV cache of random values, for A/B checks of
//! attention changes (no model, no BEAM):
//!
//!     cargo run --release --example attention_profile -- [THREADS] [DEPTH] [STREAMS]
//!
//! Each of STREAMS sequences (default 8) holds DEPTH positions (default 228) in every layer
//! and decodes one token: SmolLM2's shapes (30 layers, 9 query heads over 3 KV heads of 64;
//! `N_HEAD`, `N_KV_HEADS` and `HEAD_DIM` set others).
//! `LAYERS=1` keeps one layer, whose K/V stay in cache between calls (the arithmetic alone);
//! `KV_TYPE=f16|f32|q8_0|q4_0` sets the cache's precision (default f16); `FLUSH=MB` reads
//! that many MB between layers, untimed, so each layer's keys and values come from memory as
//! in a decode step (whose weights evict them). Prints the best of five rounds, per step and
//! per (KV head, key) pair. `PREFILL=N` attends N prompt tokens of one sequence instead (its
//! last N positions, as a prompt's forward pass does: query tiles of many rows).

use llama_cpp_ex_engine::batch::Batch;
use llama_cpp_ex_engine::kv::{KvCache, KvType};
use llama_cpp_ex_engine::model::attention::{paged_attention, tiles_into, AttnParams};
use std::time::Instant;

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .map(|s| s.parse().expect("arguments are numbers"))
        .unwrap_or(default)
}

fn main() {
    let (threads, depth, streams) = (arg(1, 2), arg(2, 228), arg(3, 8));
    let env = |k: &str, d: usize| std::env::var(k).map_or(d, |s| s.parse().expect(k));
    let layers = env("LAYERS", 30);
    let ty = match std::env::var("KV_TYPE").as_deref() {
        Ok("f32") => KvType::F32,
        Ok("q8_0") => KvType::Q8_0,
        Ok("q4_0") => KvType::Q4_0,
        _ => KvType::F16,
    };
    let (n_head, n_kv_heads, head_dim) =
        (env("N_HEAD", 9), env("N_KV_HEADS", 3), env("HEAD_DIM", 64));
    let kv_dim = n_kv_heads * head_dim;
    let mut kv = KvCache::new(
        &vec![None; layers],
        n_kv_heads,
        head_dim,
        streams * (depth + 64),
        (streams, 0),
        (ty, ty),
    )
    .expect("KV cache");
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut random = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    // positions written in the order decoding writes them: every stream's, a token at a time
    for s in 0..streams {
        kv.reserve(s, 0, depth + 1).expect("blocks");
    }
    let (mut k, mut v) = (vec![0f32; kv_dim], vec![0f32; kv_dim]);
    for pos in 0..=depth {
        for s in 0..streams {
            for l in 0..layers {
                k.iter_mut().for_each(|x| *x = random());
                v.iter_mut().for_each(|x| *x = random());
                kv.write(l, s, pos, &k, &v);
            }
        }
    }
    for s in 0..streams {
        kv.commit(s, depth + 1);
    }
    let prefill: usize = std::env::var("PREFILL").map_or(0, |s| s.parse().expect("PREFILL"));
    let mut batch = Batch::with_capacity(streams.max(prefill));
    if prefill > 0 {
        for pos in depth + 1 - prefill.min(depth + 1)..=depth {
            batch.push(0, pos, 0, true);
        }
    } else {
        for s in 0..streams {
            batch.push(0, depth, s, true);
        }
    }
    let mut tiles = Vec::new();
    tiles_into(&batch, &mut tiles);
    let params = AttnParams {
        n_head,
        n_kv_heads,
        head_dim,
        scale: 1.0 / (head_dim as f32).sqrt(),
        softcap: None,
        causal: true,
    };
    let q: Vec<f32> = (0..batch.len() * n_head * head_dim)
        .map(|_| random())
        .collect();
    let mut out = vec![0f32; q.len()];
    let steps = (20_000_000 / (layers * batch.len() * (depth + 1))).max(3);
    // FLUSH=MB: read that many MB between layers (untimed), as a decode step's weights evict
    // the cache between one layer's attention and the next
    let flush_mb: usize = std::env::var("FLUSH").map_or(0, |s| s.parse().expect("FLUSH"));
    let flush: Vec<u64> = vec![1; flush_mb << 17];
    let mut sink = 0u64;
    let best = llama_cpp_ex_engine::pool::with_threads(threads, || {
        (0..5)
            .map(|_| {
                let mut spent = 0f64;
                for _ in 0..steps {
                    for l in 0..layers {
                        if flush_mb > 0 {
                            sink = sink.wrapping_add(flush.iter().step_by(8).sum::<u64>());
                        }
                        let t = Instant::now();
                        paged_attention(&kv, l, &batch, &tiles, &q, &params, &mut out);
                        spent += t.elapsed().as_secs_f64();
                    }
                }
                spent / steps as f64
            })
            .fold(f64::INFINITY, f64::min)
    });
    std::hint::black_box(sink);
    if prefill > 0 {
        // (query row, key) pairs a causal prompt computes
        let seen: usize = (0..batch.len()).map(|t| batch.pos[t] + 1).sum();
        let pairs = layers * n_head * seen;
        println!(
            "{} prompt tokens up to depth {depth}, {layers} layers, {ty:?} cache, {threads} \
             threads: {:.3} ms a pass, {:.2} ns a (query row, key) pair, {:.1} GMAC/s",
            batch.len(),
            best * 1e3,
            best * 1e9 / pairs as f64,
            (2 * pairs * head_dim) as f64 / best * 1e-9
        );
        return;
    }
    let pair_keys = layers * streams * n_kv_heads * (depth + 1);
    println!(
        "{streams} streams at depth {depth}, {layers} layers, {ty:?} cache, {threads} threads: \
         {:.3} ms a step, {:.1} ns a (KV head, key) pair",
        best * 1e3,
        best * 1e9 / pair_keys as f64
    );
}
