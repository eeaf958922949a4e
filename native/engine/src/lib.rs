//! LlamaCppEx's inference engine: GGUF loading, tokenizers rebuilt from GGUF metadata, model
//! architectures with one batched forward over tokens that carry their own position and
//! sequence id, a paged KV cache with shared prefix blocks, and samplers.
//!
//! This crate has no Erlang dependency; the NIF crate is a thin layer over it.

//!
//! Layers point down: `context` (the step, speculation) and `engine_thread` use `model`,
//! `kv`, `sampler`, `grammar` and `embedding`; `model` and `kv` use `kernels`; `kernels` use
//! only the leaves `math`, `pages` and `pool`; `model` times its passes with the leaf
//! `profile`.

pub mod batch;
pub mod chat;
pub mod context;
pub mod device;
pub mod embedding;
pub mod engine_thread;
pub mod error;
pub mod gguf;
pub mod grammar;
pub mod hf;
pub mod kernels;
pub mod kv;
pub mod limits;
pub mod math;
pub mod membw;
pub mod model;
pub mod pages;
pub mod pool;
pub mod profile;
pub mod sampler;
pub mod stack;
pub mod tokenizer;

pub use batch::Batch;
pub use context::{Context, ContextParams, KvOp, SampledToken, SharedSampler, Step, StepOutcome};
pub use device::{Backend, DeviceCopies, Placement};
pub use engine_thread::EngineThread;
pub use error::{EngineError, Result};
pub use model::{LoadOptions, Model, Requantize};
pub use sampler::{Sampler, SamplerParams};
pub use tokenizer::{TokenId, Tokenizer};

/// Largest allocation glibc's malloc serves from its heap instead of a fresh mapping (the
/// most `M_MMAP_THRESHOLD` accepts on 64-bit targets).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const HEAP_ALLOCATION_LIMIT: i32 = 32 << 20;

/// Keeps activation buffers in malloc's heap. A forward pass allocates and frees buffers of
/// megabytes; above glibc's mmap threshold each is a fresh mapping, and a heap whose free top
/// exceeds the trim threshold is given back to the kernel, so either way the next pass
/// page-faults and zeroes the same memory again. glibc normally raises both thresholds as such
/// blocks are freed, but an explicit `mallopt` (the BEAM makes several at start-up) turns that
/// off: inside the VM a Gemma 3 prefill ran at 60% of its bare speed, a quarter of its time in
/// page faults. Freed memory is then kept up to the trim threshold (below the peak of a pass).
/// Call once per process before heavy work; a no-op off glibc.
pub fn keep_activations_in_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes a malloc tuning parameter; it is thread-safe in glibc.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, HEAP_ALLOCATION_LIMIT);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 4 * HEAP_ALLOCATION_LIMIT);
    }
}
