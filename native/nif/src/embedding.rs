//! Embeddings of decoder models: one batched forward pass per call.

use crate::error::{binary, guard, Out};
use crate::model::ModelRes;
use llama_cpp_ex_engine::embedding::{embed as engine_embed, rerank as engine_rerank, Pooling};
use rustler::{Encoder, Env, ResourceArc, Term};

/// `{:ok, [binary]}` (f32 native-endian, one per text) or `{:error, reason}`. `pooling`:
/// llama.cpp's numbering (0 none, 1 mean, 2 cls, 3 last), -1 for the model's own.
#[rustler::nif(schedule = "DirtyCpu")]
fn embed<'a>(
    env: Env<'a>,
    m: ResourceArc<ModelRes>,
    texts: Vec<Vec<u32>>,
    pooling: i64,
    normalize: i32,
    n_ctx: usize,
    n_threads: usize,
) -> Term<'a> {
    let r: Out<Vec<Vec<f32>>> = guard(|| {
        let model = &m.model;
        model.architecture()?;
        let pooling = Pooling::resolve(pooling, model)?;
        Ok(engine_embed(
            model,
            &texts,
            pooling,
            normalize,
            n_ctx,
            n_threads.max(1),
        )?)
    });
    match r {
        Ok(vectors) => {
            let items: Vec<Term> = vectors
                .iter()
                .map(|v| {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_ne_bytes()).collect();
                    binary(env, &bytes)
                })
                .collect();
            (crate::atoms::ok(), items).encode(env)
        }
        Err(e) => (crate::atoms::error(), e).encode(env),
    }
}

/// `{:ok, [score]}` (document order) or `{:error, reason}`.
#[rustler::nif(schedule = "DirtyCpu")]
fn rerank<'a>(
    env: Env<'a>,
    m: ResourceArc<ModelRes>,
    query: String,
    documents: Vec<String>,
    n_ctx: usize,
    n_threads: usize,
) -> Term<'a> {
    let r: Out<Vec<f64>> = guard(|| {
        let model = &m.model;
        model.architecture()?;
        let scores = engine_rerank(model, &query, &documents, n_ctx, n_threads.max(1))?;
        Ok(scores.into_iter().map(f64::from).collect())
    });
    r.encode(env)
}
