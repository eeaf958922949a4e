//! Memory read bandwidth with N threads, for the decode-speed ceiling that
//! `bench/generate.exs` prints (a token's decode reads every weight once, so bytes per token
//! ÷ read bandwidth bounds tokens per second).
//!
//!     llama_cpp_ex_membw [THREADS] [MIB]      prints GB/s (best of 5 passes)
//!
//! Each thread sums its part of a buffer several times larger than any cache with eight
//! independent accumulators (the loop vectorises), so the figure is DRAM streaming reads.

use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2).max(1);
    let mib: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1024);
    let words = mib * (1 << 20) / 8;
    // touched (not only reserved) so that page faults are not timed
    let buf: Vec<u64> = (0..words as u64).collect();
    let part = words / threads;
    let mut best = f64::MAX;
    let mut checksum = 0u64;
    for _ in 0..5 {
        let start = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(part)
                .take(threads)
                .map(|slice| {
                    s.spawn(move || {
                        let mut acc = [0u64; 8];
                        for c in slice.chunks_exact(8) {
                            for (a, x) in acc.iter_mut().zip(c) {
                                *a = a.wrapping_add(*x);
                            }
                        }
                        acc.iter().fold(0u64, |a, b| a.wrapping_add(*b))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        best = best.min(start.elapsed().as_secs_f64());
        checksum = sums.iter().fold(checksum, |a, b| a.wrapping_add(*b));
    }
    let bytes = (part * threads * 8) as f64;
    println!("{:.2}", bytes / best / 1e9);
    // keeps the sums observable so the loop is not optimised away
    if checksum == 42 {
        eprintln!("checksum {checksum}");
    }
}
