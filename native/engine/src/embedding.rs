//! Embeddings from decoder models: every text of a call is one sequence of ONE batched
//! forward pass (causal attention within each sequence), the final-normed hidden states are
//! pooled per sequence and normalised, as llama.cpp's `llama-embedding` does.

use crate::batch::Batch;
use crate::context::{Context, ContextParams};
use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::tokenizer::TokenId;
use std::sync::Arc;

/// How the token states of one text become its vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// One vector per token.
    None,
    Mean,
    /// The first token's state.
    Cls,
    /// The last token's state.
    Last,
    /// A reranker's score: the first token's hidden state through the classification head.
    Rank,
}

impl Pooling {
    /// llama.cpp's `llama_pooling_type` numbering (`{arch}.pooling_type` in GGUF files).
    pub fn from_gguf(code: u64) -> Option<Self> {
        match code {
            0 => Some(Pooling::None),
            1 => Some(Pooling::Mean),
            2 => Some(Pooling::Cls),
            3 => Some(Pooling::Last),
            4 => Some(Pooling::Rank),
            _ => None,
        }
    }

    /// A caller's choice in llama.cpp's numbering, -1 meaning the model's own
    /// ([`Pooling::default_for`]).
    pub fn resolve(code: i64, model: &Model) -> Result<Self> {
        match code {
            -1 => Ok(Pooling::default_for(model)),
            p => u64::try_from(p)
                .ok()
                .and_then(Pooling::from_gguf)
                .ok_or_else(|| {
                    EngineError::InvalidArgument(format!("unsupported pooling type {p}"))
                }),
        }
    }

    /// The model's own pooling (its `{arch}.pooling_type`), else mean: a generative model
    /// has none, and mean pooling is what llama-server's embeddings endpoint users expect
    /// from one.
    pub fn default_for(model: &Model) -> Self {
        model
            .metadata
            .iter()
            .find(|(k, _)| *k == model.config.key("pooling_type"))
            .and_then(|(_, v)| v.parse::<u64>().ok())
            .and_then(Pooling::from_gguf)
            .filter(|p| *p != Pooling::None)
            .unwrap_or(Pooling::Mean)
    }
}

/// An embedding text riding in a generation step as sequence `seq` (see
/// [`Context::eval_sample`](crate::Context::eval_sample)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbedRequest {
    pub seq: usize,
    pub pooling: Pooling,
    /// [`normalize`]'s mode.
    pub normalize: i32,
}

/// llama.cpp's `embd_normalize`: 2 = Euclidean, 0 = max absolute value (scaled to int16's
/// range), -1 = none, any other p > 0 = p-norm.
pub fn normalize(v: &mut [f32], mode: i32) {
    let norm = match mode {
        -1 => return,
        0 => v.iter().fold(0f32, |m, x| m.max(x.abs())) / 32760.0,
        2 => v
            .iter()
            .map(|x| (*x as f64) * (*x as f64))
            .sum::<f64>()
            .sqrt() as f32,
        p if p > 0 => v
            .iter()
            .map(|x| (x.abs() as f64).powi(p))
            .sum::<f64>()
            .powf(1.0 / p as f64) as f32,
        _ => return,
    };
    let inv = if norm > 0.0 { 1.0 / norm } else { 0.0 };
    for x in v {
        *x *= inv;
    }
}

/// The embeddings of `texts` (token ids each, non-empty), in order: one vector of
/// `n_embd` values per text, or with [`Pooling::None`] `n_tokens × n_embd` values per text.
/// Texts go through forward passes of up to [`PASS_TOKENS`] tokens, each text its own
/// sequence; `n_ctx` bounds each text.
pub fn embed(
    model: &Arc<Model>,
    texts: &[Vec<TokenId>],
    pooling: Pooling,
    norm: i32,
    n_ctx: usize,
    n_threads: usize,
) -> Result<Vec<Vec<f32>>> {
    if texts.is_empty() {
        return Ok(Vec::new());
    }
    if let Some(i) = texts.iter().position(|t| t.is_empty()) {
        return Err(EngineError::InvalidArgument(format!(
            "text {i} has no tokens (empty text)"
        )));
    }
    if let Some((i, t)) = texts.iter().enumerate().find(|(_, t)| t.len() > n_ctx) {
        return Err(EngineError::InvalidArgument(format!(
            "text {i} has {} tokens, more than n_ctx {n_ctx}",
            t.len()
        )));
    }
    // passes of at most PASS_TOKENS tokens (a longer text alone), so that memory stays bounded
    // whatever the number of texts
    let mut out = Vec::with_capacity(texts.len());
    let mut start = 0;
    while start < texts.len() {
        let mut end = start + 1;
        let mut tokens = texts[start].len();
        while end < texts.len() && tokens + texts[end].len() <= PASS_TOKENS {
            tokens += texts[end].len();
            end += 1;
        }
        out.extend(embed_pass(
            model,
            &texts[start..end],
            pooling,
            norm,
            n_threads,
        )?);
        start = end;
    }
    Ok(out)
}

/// Relevance scores of `documents` for `query` from a reranker (a cross-encoder with a
/// classification head), in document order: each pair is one sequence of a pass, formatted
/// as llama-server formats it ([`Tokenizer::rerank_input`](crate::Tokenizer::rerank_input)).
pub fn rerank(
    model: &Arc<Model>,
    query: &str,
    documents: &[String],
    n_ctx: usize,
    n_threads: usize,
) -> Result<Vec<f32>> {
    // the model's rerank template (Qwen3 rerankers), else the tokenizer's pair format
    let template = model
        .metadata
        .iter()
        .find(|(k, _)| k == "tokenizer.chat_template.rerank")
        .map(|(_, v)| v.clone());
    let inputs = documents
        .iter()
        .map(|d| match &template {
            Some(t) => model.tokenizer.encode(
                &t.replace("{query}", query).replace("{document}", d),
                false,
                true,
            ),
            None => model.tokenizer.rerank_input(query, d),
        })
        .collect::<Result<Vec<_>>>()?;
    let scores = embed(model, &inputs, Pooling::Rank, -1, n_ctx, n_threads)?;
    Ok(scores
        .into_iter()
        .map(|s| s.first().copied().unwrap_or(f32::NAN))
        .collect())
}

/// One text's vector from the final-normed hidden states of its tokens (in order), pooled
/// and normalised; with [`Pooling::None`] every token's state, normalised, one after another;
/// with [`Pooling::Rank`] the classification head's scores.
pub fn pool(model: &Model, rows: &[&[f32]], pooling: Pooling, norm: i32) -> Result<Vec<f32>> {
    let d = model.config.n_embd;
    let n = rows.len();
    if n == 0 {
        return Err(EngineError::InvalidArgument("nothing to pool".into()));
    }
    let arch = model.architecture()?;
    let finish = |mut v: Vec<f32>| -> Result<Vec<f32>> {
        arch.project_pooled(&mut v)?;
        normalize(&mut v, norm);
        Ok(v)
    };
    Ok(match pooling {
        Pooling::None => {
            let mut all = Vec::with_capacity(n * d);
            for r in rows {
                all.extend(finish(r.to_vec())?);
            }
            all
        }
        Pooling::Mean => {
            let mut sum = vec![0f32; d];
            for r in rows {
                for (s, x) in sum.iter_mut().zip(*r) {
                    *s += x;
                }
            }
            let inv = 1.0 / n as f32;
            sum.iter_mut().for_each(|s| *s *= inv);
            finish(sum)?
        }
        Pooling::Rank => {
            let i = if arch.causal() { n - 1 } else { 0 };
            arch.classify(rows[i])?
        }
        Pooling::Cls | Pooling::Last => {
            let i = if pooling == Pooling::Cls { 0 } else { n - 1 };
            finish(rows[i].to_vec())?
        }
    })
}

/// Tokens evaluated together by one pass of [`embed`].
pub const PASS_TOKENS: usize = 4096;

/// One forward pass over `texts`, each its own sequence.
fn embed_pass(
    model: &Arc<Model>,
    texts: &[Vec<TokenId>],
    pooling: Pooling,
    norm: i32,
    n_threads: usize,
) -> Result<Vec<Vec<f32>>> {
    let total: usize = texts.iter().map(Vec::len).sum();
    let mut ctx = Context::new(
        model.clone(),
        ContextParams {
            // the KV budget holds every text of the pass
            n_ctx: total,
            n_batch: total,
            n_seq_max: texts.len(),
            n_threads,
            n_threads_batch: n_threads,
            ..Default::default()
        },
    )?;
    ctx.set_embeddings(true);
    let mut batch = Batch::with_capacity(total);
    for (s, t) in texts.iter().enumerate() {
        for (i, &tok) in t.iter().enumerate() {
            batch.push(tok, i, s, true);
        }
    }
    ctx.decode(&batch)?;
    let mut out = Vec::with_capacity(texts.len());
    let mut at = 0;
    for t in texts {
        let rows: Vec<&[f32]> = (0..t.len())
            .map(|i| ctx.embeddings_ith(at + i).expect("every token was flagged"))
            .collect();
        out.push(pool(model, &rows, pooling, norm)?);
        at += t.len();
    }
    Ok(out)
}
