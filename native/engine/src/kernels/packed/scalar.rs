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
            // with super-block scales, the super-block's two sums before its activation scale
            // (the dots times their scales; split types' second halves), and for types with a
            // minimum its integer sum of minimums times block sums, and their factor
            let (mut sup, mut sup2) = (0f32, 0f32);
            let (mut mins, mut min_base) = (0i32, 0f32);
            for (b, blk) in blocks.iter().enumerate() {
                let x = &a.quants[r * k + b * QK4_1..][..QK4_1];
                let dot = |range: std::ops::Range<usize>, folded: i32| -> f32 {
                    let d = range.map(|i| blk.vals[i] as i32 * x[i] as i32).sum::<i32>();
                    (d + folded) as f32
                };
                let at = r * nb + b;
                let dx = a.scales[at];
                if a.super_scales {
                    // (K-quants: split or with a minimum)
                    if self.kind.halves() == 2 {
                        let half = QK4_1 / 2;
                        let [lo, hi] = [a.folded_halves[2 * at], a.folded_halves[2 * at + 1]];
                        sup = dot(0..half, lo).mul_add(blk.d[0], sup);
                        sup2 = dot(half..QK4_1, hi).mul_add(blk.d[1], sup2);
                    } else {
                        sup = dot(0..QK4_1, a.folded[at]).mul_add(blk.d[0], sup);
                        if self.kind.has_min() {
                            let f = blk.factors.expect("super-block scales are factored");
                            mins += f.m_mul as i32 * a.block_sums[at] as i32;
                            min_base = f.m_base.to_f32();
                        }
                    }
                    if b % SUPER_BLOCKS == SUPER_BLOCKS - 1 {
                        // (the sum of minimums is below 2^24: exact as an f32)
                        let sums = match self.kind.has_min() {
                            true => (mins as f32).mul_add(min_base, sup),
                            false => sup + sup2,
                        };
                        acc = sums.mul_add(dx, acc);
                        (sup, sup2, mins) = (0.0, 0.0, 0);
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
