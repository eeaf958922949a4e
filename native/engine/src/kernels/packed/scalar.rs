//! The portable path: one output row at a time, with the SIMD paths' arithmetic in the same
//! order, so every path gives bitwise the same results.

use super::*;
use crate::kernels::q8::Q8Activations;

impl PackedMatrix {
    pub(super) fn group_scalar(
        &self,
        a: &Q8Activations,
        act: std::ops::Range<usize>,
        groups: std::ops::Range<usize>,
        out: &Dest,
    ) {
        thread_local! {
            /// One row's blocks, decoded once for every activation row (reused: no allocation
            /// per product once grown).
            static BLOCKS: std::cell::RefCell<Vec<RowBlock>> = const {
                std::cell::RefCell::new(Vec::new())
            };
        }
        BLOCKS.with(|cell| {
            let mut blocks = cell.borrow_mut();
            for o in groups.start * GROUP..self.n_out.min(groups.end * GROUP) {
                blocks.clear();
                blocks.extend((0..self.nb).map(|b| self.row_block(o, b)));
                self.row_scalar(a, act.clone(), o, &blocks, out);
            }
        });
    }
    /// Output row `o` (its blocks decoded in `blocks`) for every activation row, with the
    /// SIMD paths' arithmetic in the same order (integer dots are exact, then the same fused
    /// multiply-adds), so every path gives bitwise the same results.
    pub(super) fn row_scalar(
        &self,
        a: &Q8Activations,
        act: std::ops::Range<usize>,
        o: usize,
        blocks: &[RowBlock],
        out: &Dest,
    ) {
        let (k, nb) = (self.n_in, self.nb);
        for r in act {
            let mut acc = 0f32;
            // with super-block scales, the super-block's integer sums before their factors and
            // its activation scale: the dots times their scale integers (with split types'
            // folded offsets), and for types with a minimum the minimums times block sums
            let (mut scaled, mut mins) = (0i32, 0i32);
            let mut min_base = 0f32;
            for (b, blk) in blocks.iter().enumerate() {
                let x = &a.quants[r * k + b * QK4_1..][..QK4_1];
                let int_dot = |range: std::ops::Range<usize>| -> i32 {
                    range.map(|i| blk.vals[i] as i32 * x[i] as i32).sum::<i32>()
                };
                let dot = |range: std::ops::Range<usize>, folded: i32| -> f32 {
                    (int_dot(range) + folded) as f32
                };
                let at = r * nb + b;
                let dx = a.scales[at];
                if a.super_scales {
                    // (K-quants: split or with a minimum)
                    // (K-quants: split, with an implied offset, or with a minimum)
                    let f = blk.factors.expect("super-block scales are factored");
                    if self.kind.halves() == 2 {
                        let half = QK4_1 / 2;
                        let [lo, hi] = [a.folded_halves[2 * at], a.folded_halves[2 * at + 1]];
                        scaled += f.d_mul[0] as i32 * (int_dot(0..half) + lo)
                            + f.d_mul[1] as i32 * (int_dot(half..QK4_1) + hi);
                    } else {
                        // (types with a minimum have no folded offset)
                        scaled += f.d_mul[0] as i32 * int_dot(0..QK4_1);
                        mins += f.m_mul as i32 * a.block_sums[at] as i32;
                        min_base = f.m_base.to_f32();
                    }
                    if b % SUPER_BLOCKS == SUPER_BLOCKS - 1 {
                        let factored = scaled as f32 * f.d_base.to_f32();
                        // (the sum of minimums is below 2^24: exact as an f32)
                        let sums = match self.kind.has_min() {
                            true => (mins as f32).mul_add(min_base, factored),
                            false => factored,
                        };
                        acc = sums.mul_add(dx, acc);
                        (scaled, mins) = (0, 0);
                    }
                } else if self.kind.halves() == 2 {
                    let half = QK4_1 / 2;
                    let [lo, hi] = [a.folded_halves[2 * at], a.folded_halves[2 * at + 1]];
                    let lo = dot(0..half, lo) * blk.d[0];
                    acc = dot(half..QK4_1, hi).mul_add(blk.d[1], lo).mul_add(dx, acc);
                } else if self.kind.has_min() {
                    acc = dot(0..QK4_1, 0).mul_add(blk.d[0] * dx, acc);
                    acc = blk.m[0].mul_add(a.sums[at], acc);
                } else {
                    acc = dot(0..QK4_1, a.folded[at]).mul_add(blk.d[0] * dx, acc);
                }
            }
            // SAFETY: (r, o) is in bounds and written by this row group only.
            unsafe { *out.at(r, o) = acc };
        }
    }
}
