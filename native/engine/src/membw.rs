//! The machine's memory read rate: the denominator of the decode ceiling that the benchmarks
//! print (a token's decode reads every weight once, so bytes per token ÷ read rate bounds
//! tokens per second).

use std::time::Instant;

/// A buffer of `mib` MiB, written once so that page faults are not timed, for
/// [`Probe::read_rate`]; keep it several times larger than the last-level cache.
pub struct Probe {
    buf: Vec<u64>,
}

impl Probe {
    pub fn new(mib: usize) -> Probe {
        let words = (mib.max(1) << 20) / 8;
        Probe {
            buf: (0..words as u64).collect(),
        }
    }

    /// GB/s of the fastest of `passes` reads of the whole buffer by `threads` threads. Each
    /// thread sums its part with eight independent accumulators (the loop vectorises), so the
    /// figure is DRAM streaming reads.
    pub fn read_rate(&self, threads: usize, passes: usize) -> f64 {
        let threads = threads.max(1);
        let part = self.buf.len() / threads;
        let mut best = f64::MAX;
        for _ in 0..passes.max(1) {
            let start = Instant::now();
            let sum = std::thread::scope(|s| {
                let handles: Vec<_> = self
                    .buf
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
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or(0))
                    .fold(0u64, u64::wrapping_add)
            });
            best = best.min(start.elapsed().as_secs_f64());
            // keeps the sums observable so that the loop is not optimised away
            std::hint::black_box(sum);
        }
        (part * threads * 8) as f64 / best / 1e9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_rate_is_a_positive_finite_figure() {
        let rate = Probe::new(8).read_rate(2, 2);
        assert!(rate.is_finite() && rate > 0.0, "{rate}");
    }
}
