//! CPU matmul kernels owned by the engine.
//!
//! candle's quantized matmul costs the same per activation row whatever the batch size for
//! our shapes, so a batch of B rows costs B single-row products. These kernels quantize the
//! activations once per matmul and keep a tile of weight rows in L1 while every activation
//! row streams past it, so the weights are read from memory once per matmul instead of once
//! per row. Paths are chosen at run time (AVX2+FMA, else portable scalar).

pub mod nibble;
pub mod q8;

/// Output pointer shared by tasks that write disjoint elements.
pub(crate) struct SharedMut(pub *mut f32);
// SAFETY: every task writes a distinct set of output elements (its own weight rows' columns).
unsafe impl Sync for SharedMut {}
unsafe impl Send for SharedMut {}
