//! The one error type of the NIF layer.

use crate::atoms;
use llama_cpp_ex_engine::sampler::SamplerError;
use llama_cpp_ex_engine::EngineError;
use rustler::{Encoder, Env, Term};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Encoded as the reason of `{:error, reason}`: a message, or one of the contract's atoms.
#[derive(Debug, thiserror::Error)]
pub enum NifError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("{0}")]
    Message(String),
    /// `:invalid_grammar` (the contract's term for a grammar that does not compile).
    #[error("invalid grammar")]
    InvalidGrammar,
}

impl From<SamplerError> for NifError {
    fn from(e: SamplerError) -> Self {
        match e {
            SamplerError::Grammar(_) => NifError::InvalidGrammar,
            SamplerError::Invalid(m) => NifError::Message(m),
        }
    }
}

impl Encoder for NifError {
    fn encode<'a>(&self, env: Env<'a>) -> Term<'a> {
        match self {
            NifError::Engine(EngineError::InvalidSeqId { .. }) => {
                atoms::invalid_seq_id().encode(env)
            }
            NifError::InvalidGrammar => atoms::invalid_grammar().encode(env),
            other => other.to_string().encode(env),
        }
    }
}

/// A NIF's result: `{:ok, value}` or `{:error, reason}` (rustler encodes `Result` so).
pub type Out<T> = Result<T, NifError>;

/// `:ok` or `{:error, reason}`.
pub struct Status(pub Out<()>);

impl Encoder for Status {
    fn encode<'a>(&self, env: Env<'a>) -> Term<'a> {
        match &self.0 {
            Ok(()) => atoms::ok().encode(env),
            Err(e) => (atoms::error(), e).encode(env),
        }
    }
}

/// Runs `f`, turning a panic into an error so the VM keeps running.
pub fn guard<T>(f: impl FnOnce() -> Out<T>) -> Out<T> {
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|payload| Err(NifError::Engine(EngineError::internal(payload))))
}

pub fn message(m: impl Into<String>) -> NifError {
    NifError::Message(m.into())
}

/// A binary term holding `bytes`.
pub fn binary<'a>(env: Env<'a>, bytes: &[u8]) -> Term<'a> {
    match rustler::OwnedBinary::new(bytes.len()) {
        Some(mut b) => {
            b.as_mut_slice().copy_from_slice(bytes);
            b.release(env).encode(env)
        }
        None => (atoms::error(), "cannot allocate a binary").encode(env),
    }
}

pub use llama_cpp_ex_engine::error::lock;
