//! The engine's single error type. The NIF layer maps every variant to `{:error, message}`
//! (or to a contract atom such as `:context_full`).

use thiserror::Error;

#[derive(Debug, Error)]
pub enum EngineError {
    #[error("failed to load model from: {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("invalid GGUF file: {0}")]
    InvalidGguf(String),
    #[error("invalid Hugging Face checkpoint: {0}")]
    InvalidCheckpoint(String),
    #[error("unsupported model architecture: {0}")]
    UnsupportedArchitecture(String),
    /// A feature of a model file that the engine does not implement ("rope scaling: yarn",
    /// "tensor: blk.0.ffn_gate.bias"): refusing it beats generating garbage.
    #[error("unsupported {0}")]
    Unsupported(String),
    #[error("unsupported tokenizer: {0}")]
    UnsupportedTokenizer(String),
    #[error("missing tensor: {0}")]
    MissingTensor(String),
    #[error("invalid token id {id} (vocabulary size {n_vocab})")]
    InvalidToken { id: i64, n_vocab: usize },
    #[error("invalid sequence id {seq} (n_seq_max {n_seq_max})")]
    InvalidSeqId { seq: i64, n_seq_max: usize },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("context full: no room for sequence {seq} (n_ctx reached or no free KV block)")]
    ContextFull { seq: usize },
    #[error("context full: sequence {seq} holds {held} tokens, {more} more exceed n_ctx {n_ctx}")]
    PastContext {
        seq: usize,
        held: usize,
        more: usize,
        n_ctx: usize,
    },
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    #[error("tokenize failed: {0}")]
    Tokenize(String),
    #[error("tensor error: {0}")]
    Tensor(String),
    #[error("chat template failed: {0}")]
    Template(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl EngineError {
    /// The error for a caught panic, with its message.
    pub fn internal(payload: Box<dyn std::any::Any + Send>) -> Self {
        let msg = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        EngineError::Internal(msg)
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// Locks a mutex whose holder may have panicked: the engine's state stays usable after a
/// panic (a failed batch rolls its KV reservation back), and the panic itself is reported as
/// that call's error.
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> Self {
        EngineError::Tensor(e.to_string())
    }
}

impl From<std::io::Error> for EngineError {
    fn from(e: std::io::Error) -> Self {
        EngineError::InvalidGguf(e.to_string())
    }
}
