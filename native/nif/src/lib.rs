//! The rustler NIF over `llama_cpp_ex_engine`: a codec between Erlang terms and the engine.
//! Every file is one family of NIFs; none holds engine logic. Errors are one type
//! ([`error::NifError`], encoded as `{:error, reason}`), every body runs under
//! [`error::guard`] (a panic becomes `{:error, "internal error: ..."}`), and anything that can
//! take more than about a millisecond runs on a dirty scheduler.
//!
//! | file | NIFs |
//! |---|---|
//! | `embedding.rs` | embeddings of decoder models (one batched pass per call) |
//! | `model.rs` | loading, hyper-parameters, metadata, the chat template |
//! | `tokenizer.rs` | encode, decode, token pieces, vocabulary queries |
//! | `context.rs` | contexts, KV cache operations, decode, logits, one step |
//! | `sampler.rs` | samplers, grammars, JSON Schema conversion |
//! | `engine.rs` | the Server's engine thread: start, submit a step, stop |
//! | `step.rs` | the step and outcome structs shared by `context.rs` and `engine.rs` |
//! | `snapshot.rs` | KV snapshots (the level-2 prompt cache's entries) and their byte form |
//! | `limits.rs` | input limits, the engine's constants, the KV cache's prefix rule |

mod atoms;
mod context;
mod embedding;
mod engine;
mod error;
mod limits;
mod model;
mod sampler;
mod snapshot;
mod step;
mod tokenizer;

fn load(_env: rustler::Env, _info: rustler::Term) -> bool {
    llama_cpp_ex_engine::keep_activations_in_heap();
    true
}

rustler::init!("Elixir.LlamaCppEx.NIF", load = load);
