//! The worker pool's own cost per call and how decode-sized products split over its threads,
//! for the many-core targets (no model, no BEAM):
//!
//!     cargo run --release --example pool_probe -- [THREADS...]
//!
//! Per thread count (default 2): an empty call's round trip; a call in which every thread
//! spins 5 µs (the call's cost on top of its work); and products on synthetic Q4_1 weights
//! of decode size (SmolLM2's `down`, 576 × 1536, and a 1B file's, 2048 × 8192, at 1 and 8
//! activation rows): µs a call, the split's efficiency against the same product on one
//! thread (one-thread time ÷ (threads × time)), and per call the time the caller and the
//! workers spent in it (their work and the activations' quantization) and the caller's wait
//! for the last worker.

use half::f16;
use llama_cpp_ex_engine::kernels::packed::{PackedMatrix, PackedType};
use llama_cpp_ex_engine::{pool, profile};
use std::time::{Duration, Instant};

fn spin(us: f64) {
    let t = Instant::now();
    while t.elapsed().as_secs_f64() * 1e6 < us {
        std::hint::spin_loop();
    }
}

/// Q4_1 blocks with small random scales, a fixed offset and random values.
fn q4_1(n_out: usize, n_in: usize) -> PackedMatrix {
    let mut seed = 7u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as u8
    };
    let mut bytes = Vec::with_capacity(n_out * n_in / 32 * 20);
    for _ in 0..n_out * n_in / 32 {
        let d = f16::from_f32(0.01 + f32::from(next() % 100) * 1e-4);
        bytes.extend_from_slice(&d.to_le_bytes());
        bytes.extend_from_slice(&f16::from_f32(-0.05).to_le_bytes());
        bytes.extend((0..16).map(|_| next()));
    }
    PackedMatrix::from_bytes(PackedType::Q4_1, &bytes, n_out, n_in).expect("whole blocks")
}

/// Mean µs of `f` over about 0.2 s of calls, after a warm-up.
fn per_call(mut f: impl FnMut()) -> f64 {
    for _ in 0..50 {
        f();
    }
    let t = Instant::now();
    let mut n = 0u32;
    while t.elapsed() < Duration::from_millis(200) {
        f();
        n += 1;
    }
    t.elapsed().as_secs_f64() * 1e6 / f64::from(n)
}

fn main() {
    let threads: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let threads = if threads.is_empty() { vec![2] } else { threads };
    let shapes = [("smollm2 down", 576, 1536), ("llama1b down", 2048, 8192)];
    let ws: Vec<PackedMatrix> = shapes.iter().map(|&(_, o, i)| q4_1(o, i)).collect();
    // one thread's time per product, the split's reference
    let mut alone = Vec::new();
    pool::with_threads(1, || {
        for (w, &(_, n_out, n_in)) in ws.iter().zip(&shapes) {
            for m in [1, 8] {
                let x = vec![0.5f32; m * n_in];
                let mut out = vec![0f32; m * n_out];
                alone.push(per_call(|| w.matmul(&x, m, &mut out)));
            }
        }
    });
    for &t in &threads {
        pool::with_threads(t, || {
            let empty = per_call(|| pool::for_each_chunk_in(t, 1, |_| {}));
            let busy = per_call(|| pool::for_each_chunk_in(t, 1, |_| spin(5.0)));
            println!("threads {t}: empty call {empty:.2} us, call of 5 us a thread {busy:.2} us");
            let mut k = 0;
            for (w, &(label, n_out, n_in)) in ws.iter().zip(&shapes) {
                for m in [1, 8] {
                    let x = vec![0.5f32; m * n_in];
                    let mut out = vec![0f32; m * n_out];
                    profile::enable(true);
                    let s0 = pool::stats();
                    let mut calls = 0u32;
                    let us = per_call(|| {
                        w.matmul(&x, m, &mut out);
                        calls += 1;
                    });
                    let s1 = pool::stats();
                    profile::enable(false);
                    let each = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(calls);
                    println!(
                        "threads {t}: {label} m={m}: {us:8.2} us a call, split {:4.0}% \
                         (caller {:.2} us, workers {:.2} us a call, caller waiting {:.2} us)",
                        100.0 * alone[k] / (t as f64 * us),
                        each(s1.caller_work - s0.caller_work),
                        each(s1.helper_work - s0.helper_work),
                        each(s1.join_wait - s0.join_wait),
                    );
                    k += 1;
                }
            }
        });
    }
}
