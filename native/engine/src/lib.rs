//! LlamaCppEx's inference engine: GGUF loading, tokenizers rebuilt from GGUF metadata, model
//! architectures with one batched forward over tokens that carry their own position and
//! sequence id, a paged KV cache with shared prefix blocks, and samplers.
//!
//! This crate has no Erlang dependency; the NIF crate is a thin layer over it.

pub mod batch;
pub mod chat;
pub mod context;
pub mod error;
pub mod gguf;
pub mod grammar;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod sampler;
pub mod tokenizer;

pub use batch::Batch;
pub use context::{Context, ContextParams, StopReason};
pub use error::{EngineError, Result};
pub use model::{LoadOptions, Model, Requantize};
pub use sampler::{Sampler, SamplerParams};
pub use tokenizer::{TokenId, Tokenizer};

/// Sets the number of worker threads of the matmul/attention pool. It only takes effect before
/// the first forward pass of the process (candle sizes its pool once); returns whether it did.
pub fn set_worker_threads(n: usize) -> bool {
    static SET: std::sync::Once = std::sync::Once::new();
    let mut applied = false;
    SET.call_once(|| {
        if std::env::var_os("CANDLE_NUM_THREADS").is_none() && n > 0 {
            std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
            applied = true;
        }
    });
    applied
}
