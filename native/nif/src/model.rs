//! Models: loading, hyper-parameters, metadata and the chat template.

use crate::atoms;
use crate::error::{guard, message, Out};
use llama_cpp_ex_engine::{hf, EngineError, LoadOptions, Model, Placement, Requantize};
use rustler::{Atom, Encoder, Env, NifMap, ResourceArc, Term};
use std::path::Path;
use std::sync::Arc;

pub struct ModelRes {
    pub model: Arc<Model>,
}

#[rustler::resource_impl]
impl rustler::Resource for ModelRes {}

/// What `LlamaCppEx.Model`'s accessors read.
#[derive(NifMap)]
pub struct ModelInfo {
    architecture: String,
    desc: String,
    n_ctx_train: usize,
    n_embd: usize,
    n_layer: usize,
    n_head: usize,
    n_head_kv: usize,
    n_params: u64,
    size: u64,
    n_vocab: usize,
    bos: i64,
    eos: i64,
    /// The smallest sliding window of the model's layers, 0 when every layer attends globally.
    swa_window: usize,
    vocab_only: bool,
    /// Where the forward runs ("CPU", "CUDA0", …).
    backend: String,
    /// Whether the model generates text: a decoder (causal attention and an output head), not
    /// an encoder such as BERT, which only embeds.
    generative: bool,
}

#[rustler::nif(schedule = "DirtyIo")]
fn model_load<'a>(
    env: Env<'a>,
    path: String,
    requantize: Atom,
    vocab_only: bool,
    quantize: String,
    (n_gpu_layers, main_gpu): (i64, usize),
) -> Term<'a> {
    let r: Out<ResourceArc<ModelRes>> = guard(|| {
        let opts = LoadOptions {
            requantize: if requantize == atoms::all() {
                Requantize::AllQ8_0
            } else if requantize == atoms::scalar() {
                Requantize::Q8_0
            } else {
                Requantize::Off
            },
            vocab_only,
            placement: Placement::Layers {
                n_gpu_layers,
                main_gpu,
            },
        };
        let p = Path::new(&path);
        let loaded = if hf::is_checkpoint(p) {
            // "default": the architecture's own (encoders as stored, decoders Q8_0)
            let q = match quantize.as_str() {
                "default" => None,
                other => Some(
                    hf::Quantize::parse(other)
                        .ok_or_else(|| message(format!("invalid quantize: {quantize}")))?,
                ),
            };
            hf::load(p, q, &opts)
        } else {
            Model::load(p, &opts)
        };
        let model = loaded.map_err(|e| match e {
            EngineError::UnsupportedArchitecture(_) => message(e.to_string()),
            other => message(format!("failed to load model from: {path}: {other}")),
        })?;
        Ok(ResourceArc::new(ModelRes {
            model: Arc::new(model),
        }))
    });
    r.encode(env)
}

/// One GPU of `LlamaCppEx.devices/0`.
#[derive(NifMap)]
struct GpuDevice {
    index: usize,
    name: String,
    memory_total: u64,
    memory_free: u64,
}

/// The GPUs this build can run on (none in a CPU build).
#[rustler::nif(schedule = "DirtyIo")]
fn gpu_devices() -> Vec<GpuDevice> {
    llama_cpp_ex_engine::device::gpus()
        .into_iter()
        .map(|g| GpuDevice {
            index: g.index,
            name: g.name,
            memory_total: g.memory_total,
            memory_free: g.memory_free,
        })
        .collect()
}

#[rustler::nif]
fn model_info(m: ResourceArc<ModelRes>) -> ModelInfo {
    let model = &m.model;
    let c = &model.config;
    let id = |t: Option<u32>| t.map_or(-1, i64::from);
    ModelInfo {
        architecture: c.arch.clone(),
        desc: model.desc.clone(),
        n_ctx_train: c.n_ctx_train,
        n_embd: c.n_embd,
        n_layer: c.n_layer,
        n_head: c.n_head,
        n_head_kv: c.n_head_kv,
        n_params: model.n_params,
        size: model.size_bytes,
        n_vocab: model.tokenizer.n_vocab(),
        bos: id(model.tokenizer.bos),
        eos: id(model.tokenizer.eos),
        swa_window: c.layer_windows.iter().flatten().copied().min().unwrap_or(0),
        vocab_only: model.arch.is_none(),
        backend: model.backend.name(),
        generative: model.architecture().is_ok_and(|a| a.causal()),
    }
}

#[rustler::nif(schedule = "DirtyCpu")]
fn model_metadata(m: ResourceArc<ModelRes>) -> Vec<(String, String)> {
    m.model.metadata.clone()
}

/// `{template, own?, bos_text, eos_text}`: the file's chat template (or the built-in one for
/// its architecture, `own?` false) and the texts of its BOS and EOS tokens, for the renderer.
#[rustler::nif(schedule = "DirtyCpu")]
fn model_chat_template(m: ResourceArc<ModelRes>) -> (String, bool, String, String) {
    let model = &m.model;
    let text = |id: Option<u32>| {
        id.and_then(|t| model.tokenizer.token_text(t))
            .unwrap_or("")
            .to_string()
    };
    let (template, own) = match &model.chat_template {
        Some(t) => (t.clone(), true),
        None => (
            llama_cpp_ex_engine::chat::builtin_template(&model.config.arch).to_string(),
            false,
        ),
    };
    (
        template,
        own,
        text(model.tokenizer.bos),
        text(model.tokenizer.eos),
    )
}
