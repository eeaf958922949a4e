//! Thin rustler layer over `llama_cpp_ex_engine`: resources, argument decoding and error
//! mapping. Every function that can take longer than a millisecond runs on a dirty scheduler;
//! every body runs under `guard`, so a panic becomes `{:error, "internal error: ..."}`
//! instead of taking the VM down.

use crossbeam_channel::{unbounded, Sender};
use llama_cpp_ex_engine::context::StopReason;
use llama_cpp_ex_engine::grammar::{self, GrammarSpec};
use llama_cpp_ex_engine::kv::KvType;
use llama_cpp_ex_engine::sampler::{dry_breaker_tokens, TokenLogprobs};
use llama_cpp_ex_engine::{
    Batch, Context, ContextParams, EngineError, LoadOptions, Model, Requantize, Sampler,
    SamplerParams,
};
use rustler::env::{OwnedEnv, SavedTerm};
use rustler::{Atom, Binary, Encoder, Env, LocalPid, NifResult, OwnedBinary, ResourceArc, Term};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

mod atoms {
    rustler::atoms! {
        ok,
        error,
        token,
        eog,
        done,
        part,
        invalid_seq_id,
        invalid_grammar,
        context_full,
        f16,
        f32,
        trim,
        share,
        clear,
        all,
        scalar,
        llguidance,
    }
}

pub struct ModelRes {
    model: Arc<Model>,
}

pub struct ContextRes {
    ctx: Mutex<Context>,
    // Kept outside the mutex so these reads never wait for a running forward pass.
    n_ctx: usize,
    n_seq_max: usize,
}

pub struct SamplerRes {
    sampler: Mutex<Sampler>,
}

pub struct CancelFlag {
    flag: AtomicBool,
}

/// A worker thread that owns forward passes for one context, so the calling process (the
/// Server) never blocks on one: jobs arrive over a channel, results return as messages.
pub struct EngineRes {
    tx: Mutex<Option<Sender<Job>>>,
}

struct Job {
    pid: LocalPid,
    env: OwnedEnv,
    reference: SavedTerm,
    ops: Vec<KvOp>,
    batch: Batch,
    samplers: Vec<(usize, ResourceArc<SamplerRes>)>,
    purgeable: Vec<usize>,
}

/// Cache edits applied, in order, before a job's batch.
enum KvOp {
    /// Drop positions `>= p0` (a refusal clears the sequence).
    Trim(usize, usize),
    /// Make `dst` share the first `n` positions of `src`.
    Share(usize, usize, usize),
    Clear(usize),
}

#[rustler::resource_impl]
impl rustler::Resource for ModelRes {}
#[rustler::resource_impl]
impl rustler::Resource for ContextRes {}
#[rustler::resource_impl]
impl rustler::Resource for SamplerRes {}
#[rustler::resource_impl]
impl rustler::Resource for CancelFlag {}
#[rustler::resource_impl]
impl rustler::Resource for EngineRes {}

/// The single error type of this layer; encoded as `{:error, reason}`.
enum NifError {
    Message(String),
    Atom(Atom),
}

impl From<EngineError> for NifError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::InvalidSeqId { .. } => NifError::Atom(atoms::invalid_seq_id()),
            other => NifError::Message(other.to_string()),
        }
    }
}

impl Encoder for NifError {
    fn encode<'a>(&self, env: Env<'a>) -> Term<'a> {
        match self {
            NifError::Message(m) => (atoms::error(), m.as_str()).encode(env),
            NifError::Atom(a) => (atoms::error(), *a).encode(env),
        }
    }
}

type NifOut<T> = Result<T, NifError>;

/// Runs `f`, turning a panic into an error so the VM keeps running.
fn guard<T>(f: impl FnOnce() -> NifOut<T>) -> NifOut<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(NifError::Message(format!("internal error: {msg}")))
        }
    }
}

fn ok_or_error<'a, T: Encoder>(env: Env<'a>, r: NifOut<T>) -> Term<'a> {
    match r {
        Ok(v) => (atoms::ok(), v).encode(env),
        Err(e) => e.encode(env),
    }
}

fn unit_or_error<'a>(env: Env<'a>, r: NifOut<()>) -> Term<'a> {
    match r {
        Ok(()) => atoms::ok().encode(env),
        Err(e) => e.encode(env),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside a forward pass is already reported as an error; the state it guards
    // stays usable (a failed batch rolls its KV reservation back).
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn binary<'a>(env: Env<'a>, bytes: &[u8]) -> Term<'a> {
    match OwnedBinary::new(bytes.len()) {
        Some(mut b) => {
            b.as_mut_slice().copy_from_slice(bytes);
            b.release(env).encode(env)
        }
        None => (atoms::error(), "cannot allocate binary").encode(env),
    }
}

fn count(v: i64, what: &str) -> NifOut<usize> {
    usize::try_from(v).map_err(|_| NifError::Message(format!("{what} must not be negative")))
}

fn tokens_of(model: &Model, ids: &[i64]) -> NifOut<Vec<u32>> {
    ids.iter()
        .map(|&id| model.tokenizer.check_id(id).map_err(NifError::from))
        .collect()
}

// ---------------------------------------------------------------- backend

#[rustler::nif]
fn backend_init() -> Atom {
    atoms::ok()
}

#[rustler::nif]
fn cancel_flag_new() -> ResourceArc<CancelFlag> {
    ResourceArc::new(CancelFlag {
        flag: AtomicBool::new(false),
    })
}

#[rustler::nif]
fn request_cancel(flag: ResourceArc<CancelFlag>) -> Atom {
    flag.flag.store(true, Ordering::Relaxed);
    atoms::ok()
}

#[rustler::nif]
fn cancel_requested(flag: ResourceArc<CancelFlag>) -> bool {
    flag.flag.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------- model

#[rustler::nif(schedule = "DirtyIo")]
fn model_load<'a>(env: Env<'a>, path: String, requantize: Atom, vocab_only: bool) -> Term<'a> {
    let r = guard(|| {
        let opts = LoadOptions {
            requantize: if requantize == atoms::all() {
                Requantize::AllQ8_0
            } else if requantize == atoms::scalar() {
                Requantize::Q8_0
            } else {
                Requantize::Off
            },
            vocab_only,
        };
        let model = Model::load(Path::new(&path), &opts).map_err(|e| match e {
            EngineError::UnsupportedArchitecture(_) => NifError::Message(e.to_string()),
            other => NifError::Message(format!("failed to load model from: {path}: {other}")),
        })?;
        Ok(ResourceArc::new(ModelRes {
            model: Arc::new(model),
        }))
    });
    ok_or_error(env, r)
}

#[rustler::nif]
fn model_n_ctx_train(m: ResourceArc<ModelRes>) -> usize {
    m.model.config.n_ctx_train
}

#[rustler::nif]
fn model_n_embd(m: ResourceArc<ModelRes>) -> usize {
    m.model.config.n_embd
}

#[rustler::nif]
fn model_n_layer(m: ResourceArc<ModelRes>) -> usize {
    m.model.config.n_layer
}

#[rustler::nif]
fn model_n_params(m: ResourceArc<ModelRes>) -> u64 {
    m.model.n_params
}

#[rustler::nif]
fn model_size(m: ResourceArc<ModelRes>) -> u64 {
    m.model.size_bytes
}

#[rustler::nif]
fn model_desc(m: ResourceArc<ModelRes>) -> String {
    m.model.desc.clone()
}

#[rustler::nif]
fn model_chat_template(m: ResourceArc<ModelRes>) -> String {
    m.model.chat_template.clone().unwrap_or_default()
}

/// The smallest sliding window of the model's layers, 0 when every layer attends globally.
#[rustler::nif]
fn model_swa_window(m: ResourceArc<ModelRes>) -> usize {
    m.model
        .config
        .layer_windows
        .iter()
        .flatten()
        .copied()
        .min()
        .unwrap_or(0)
}

#[rustler::nif]
fn model_architecture(m: ResourceArc<ModelRes>) -> String {
    m.model.config.arch.clone()
}

#[rustler::nif(schedule = "DirtyCpu")]
fn model_metadata(m: ResourceArc<ModelRes>) -> Vec<(String, String)> {
    m.model.metadata.clone()
}

#[rustler::nif]
fn vocab_n_tokens(m: ResourceArc<ModelRes>) -> usize {
    m.model.tokenizer.n_vocab()
}

#[rustler::nif]
fn vocab_bos(m: ResourceArc<ModelRes>) -> i64 {
    m.model.tokenizer.bos.map(i64::from).unwrap_or(-1)
}

#[rustler::nif]
fn vocab_eos(m: ResourceArc<ModelRes>) -> i64 {
    m.model.tokenizer.eos.map(i64::from).unwrap_or(-1)
}

#[rustler::nif]
fn vocab_is_eog(m: ResourceArc<ModelRes>, token: i64) -> bool {
    m.model
        .tokenizer
        .check_id(token)
        .map(|t| m.model.tokenizer.is_eog(t))
        .unwrap_or(false)
}

#[rustler::nif(schedule = "DirtyCpu")]
fn tokenize<'a>(
    env: Env<'a>,
    m: ResourceArc<ModelRes>,
    text: Binary<'a>,
    add_special: bool,
    parse_special: bool,
) -> Term<'a> {
    let r = guard(|| {
        let text = std::str::from_utf8(text.as_slice()).map_err(|e| {
            NifError::Message(format!("tokenize failed: text is not valid UTF-8 ({e})"))
        })?;
        Ok(m.model.tokenizer.encode(text, add_special, parse_special)?)
    });
    ok_or_error(env, r)
}

#[rustler::nif(schedule = "DirtyCpu")]
fn detokenize<'a>(env: Env<'a>, m: ResourceArc<ModelRes>, ids: Vec<i64>) -> Term<'a> {
    let r = guard(|| {
        let ids = tokens_of(&m.model, &ids)?;
        Ok(m.model.tokenizer.detokenize(&ids)?)
    });
    match r {
        Ok(bytes) => (atoms::ok(), binary(env, &bytes)).encode(env),
        Err(e) => e.encode(env),
    }
}

#[rustler::nif]
fn token_to_piece<'a>(env: Env<'a>, m: ResourceArc<ModelRes>, id: i64) -> Term<'a> {
    let r = guard(|| {
        let t = m.model.tokenizer.check_id(id)?;
        Ok(m.model.tokenizer.token_to_piece(t)?.to_vec())
    });
    match r {
        Ok(bytes) => (atoms::ok(), binary(env, &bytes)).encode(env),
        Err(e) => e.encode(env),
    }
}

/// Renders the model's chat template (or the built-in one for its architecture).
/// `kwargs` values arrive as JSON text.
#[rustler::nif(schedule = "DirtyCpu")]
fn chat_apply_template<'a>(
    env: Env<'a>,
    m: ResourceArc<ModelRes>,
    messages: Vec<(String, String)>,
    add_assistant: bool,
    enable_thinking: bool,
    kwargs: Vec<(String, String)>,
) -> Term<'a> {
    let r = guard(|| {
        let model = &m.model;
        let template = model
            .chat_template
            .as_deref()
            .unwrap_or_else(|| llama_cpp_ex_engine::chat::builtin_template(&model.config.arch));
        let kwargs = kwargs
            .into_iter()
            .map(|(k, v)| {
                serde_json::from_str(&v)
                    .map(|v| (k, v))
                    .map_err(|e| NifError::Message(format!("chat template failed: bad kwarg: {e}")))
            })
            .collect::<NifOut<Vec<_>>>()?;
        let text = |id: Option<u32>| {
            id.and_then(|t| model.tokenizer.token_text(t))
                .unwrap_or("")
                .to_string()
        };
        let bos = text(model.tokenizer.bos);
        let eos = text(model.tokenizer.eos);
        let messages: Vec<serde_json::Value> = messages
            .into_iter()
            .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
            .collect();
        let req = llama_cpp_ex_engine::chat::ChatRequest {
            messages: &messages,
            add_generation_prompt: add_assistant,
            enable_thinking,
            bos_token: &bos,
            eos_token: &eos,
            kwargs: &kwargs,
        };
        Ok(llama_cpp_ex_engine::chat::apply_template(template, &req)?)
    });
    ok_or_error(env, r)
}

// ---------------------------------------------------------------- context

#[rustler::nif(schedule = "DirtyCpu")]
#[allow(clippy::too_many_arguments)]
fn context_create<'a>(
    env: Env<'a>,
    m: ResourceArc<ModelRes>,
    n_ctx: i64,
    n_batch: i64,
    n_ubatch: i64,
    n_threads: i64,
    n_threads_batch: i64,
    n_seq_max: i64,
    kv_type: Atom,
) -> Term<'a> {
    let r = guard(|| {
        let n_threads = count(n_threads, "n_threads")?;
        let n_threads_batch = count(n_threads_batch, "n_threads_batch")?;
        if n_threads == 0 || n_threads_batch == 0 {
            return Err(NifError::Message("n_threads must be positive".into()));
        }
        llama_cpp_ex_engine::set_worker_threads(n_threads);
        let kv_type = if kv_type == atoms::f32() {
            KvType::F32
        } else {
            KvType::F16
        };
        let params = ContextParams {
            n_ctx: count(n_ctx, "n_ctx")?,
            n_batch: count(n_batch, "n_batch")?,
            n_ubatch: count(n_ubatch, "n_ubatch")?,
            n_seq_max: count(n_seq_max, "n_seq_max")?,
            kv_type,
            n_threads,
            n_threads_batch,
        };
        let ctx = Context::new(m.model.clone(), params.clone())?;
        Ok(ResourceArc::new(ContextRes {
            ctx: Mutex::new(ctx),
            n_ctx: params.n_ctx,
            n_seq_max: params.n_seq_max,
        }))
    });
    ok_or_error(env, r)
}

#[rustler::nif]
fn context_n_ctx(c: ResourceArc<ContextRes>) -> usize {
    c.n_ctx
}

#[rustler::nif]
fn context_n_seq_max(c: ResourceArc<ContextRes>) -> usize {
    c.n_seq_max
}

#[rustler::nif]
fn context_can_seq_rm(_c: ResourceArc<ContextRes>) -> Atom {
    atoms::part()
}

#[rustler::nif(schedule = "DirtyCpu")]
fn memory_clear(c: ResourceArc<ContextRes>) -> Atom {
    lock(&c.ctx).kv.clear();
    atoms::ok()
}

#[rustler::nif(schedule = "DirtyCpu")]
fn memory_seq_rm<'a>(
    env: Env<'a>,
    c: ResourceArc<ContextRes>,
    seq: i64,
    p0: i64,
    p1: i64,
) -> Term<'a> {
    let r = guard(|| {
        let mut ctx = lock(&c.ctx);
        let s = ctx.kv.check_seq(seq)?;
        let p0 = p0.max(0) as usize;
        let p1 = if p1 < 0 { None } else { Some(p1 as usize) };
        Ok(ctx.kv.seq_rm(s, p0, p1)?)
    });
    ok_or_error(env, r)
}

#[rustler::nif(schedule = "DirtyCpu")]
fn memory_seq_cp<'a>(
    env: Env<'a>,
    c: ResourceArc<ContextRes>,
    src: i64,
    dst: i64,
    p0: i64,
    p1: i64,
) -> Term<'a> {
    let r = guard(|| {
        let mut ctx = lock(&c.ctx);
        let s = ctx.kv.check_seq(src)?;
        let d = ctx.kv.check_seq(dst)?;
        if p0 > 0 {
            return Err(NifError::Message(
                "only prefixes (p0 = 0) can be shared".into(),
            ));
        }
        let n = if p1 < 0 { usize::MAX } else { p1 as usize };
        ctx.kv.seq_share_prefix(s, d, n)?;
        Ok(())
    });
    unit_or_error(env, r)
}

#[rustler::nif(schedule = "DirtyCpu")]
fn memory_seq_pos_max<'a>(env: Env<'a>, c: ResourceArc<ContextRes>, seq: i64) -> Term<'a> {
    let r = guard(|| {
        let ctx = lock(&c.ctx);
        let s = ctx.kv.check_seq(seq)?;
        Ok(ctx.kv.seq_pos_max(s))
    });
    ok_or_error(env, r)
}

/// `{:ok, %{n_blocks, used, owners}}`: the KV audit used by tests.
#[rustler::nif(schedule = "DirtyCpu")]
fn context_kv_usage<'a>(env: Env<'a>, c: ResourceArc<ContextRes>) -> Term<'a> {
    let r = guard(|| {
        let ctx = lock(&c.ctx);
        ctx.kv.audit().map_err(NifError::Message)?;
        let u = ctx.kv.usage();
        Ok((u.n_blocks, u.used, u.owners))
    });
    ok_or_error(env, r)
}

#[rustler::nif(schedule = "DirtyCpu")]
fn decode<'a>(env: Env<'a>, c: ResourceArc<ContextRes>, tokens: Vec<i64>) -> Term<'a> {
    let r = guard(|| {
        let mut ctx = lock(&c.ctx);
        if tokens.is_empty() {
            return Err(NifError::Message("empty token list".into()));
        }
        let toks = tokens_of(&ctx.model, &tokens)?;
        for chunk in toks.chunks(ctx.params.n_batch) {
            let pos = ctx.kv.seq_len(0);
            ctx.decode(&Batch::for_sequence(chunk, pos, 0))?;
        }
        Ok(())
    });
    unit_or_error(env, r)
}

/// Evaluates `[{token, pos, seq, logits?}]` in one batch.
#[rustler::nif(schedule = "DirtyCpu")]
fn batch_eval<'a>(
    env: Env<'a>,
    c: ResourceArc<ContextRes>,
    entries: Vec<(i64, i64, i64, bool)>,
) -> Term<'a> {
    let r = guard(|| {
        let mut ctx = lock(&c.ctx);
        let mut batch = Batch::with_capacity(entries.len());
        for &(t, p, s, l) in &entries {
            let t = ctx.model.tokenizer.check_id(t)?;
            let s = ctx.kv.check_seq(s)?;
            batch.push(t, count(p, "position")?, s, l);
        }
        ctx.decode(&batch)?;
        Ok(())
    });
    unit_or_error(env, r)
}

/// Logits of entry `idx` of the last batch (-1 = last with logits) as a list of floats.
#[rustler::nif(schedule = "DirtyCpu")]
fn get_logits<'a>(env: Env<'a>, c: ResourceArc<ContextRes>, idx: i64) -> Term<'a> {
    let r = guard(|| {
        let ctx = lock(&c.ctx);
        Ok(ctx.logits_ith(idx)?.to_vec())
    });
    ok_or_error(env, r)
}

/// Log-probabilities of the `n` most likely tokens of entry `idx` of the last batch
/// (llama.cpp's `n_probs`): `{:ok, [{id, logprob}]}`.
#[rustler::nif(schedule = "DirtyCpu")]
fn get_top_logprobs<'a>(env: Env<'a>, c: ResourceArc<ContextRes>, idx: i64, n: i64) -> Term<'a> {
    let r = guard(|| {
        let ctx = lock(&c.ctx);
        let row = ctx.logits_ith(idx)?;
        let n = count(n, "n")?;
        let lp = llama_cpp_ex_engine::sampler::token_logprobs(row, 0, n);
        Ok(lp
            .top
            .into_iter()
            .map(|(id, l)| (id, l as f64))
            .collect::<Vec<_>>())
    });
    ok_or_error(env, r)
}

// ---------------------------------------------------------------- sampler

/// Sampler settings beyond the contract's positional ones (Elixir always sends every key).
#[derive(rustler::NifMap)]
struct SamplerExtras {
    penalty_last_n: i64,
    min_keep: i64,
    typical_p: f64,
    top_n_sigma: f64,
    xtc_probability: f64,
    xtc_threshold: f64,
    dry_multiplier: f64,
    dry_base: f64,
    dry_allowed_length: i64,
    dry_penalty_last_n: i64,
    dry_sequence_breakers: Vec<String>,
    mirostat: i64,
    mirostat_tau: f64,
    mirostat_eta: f64,
    dynatemp_range: f64,
    dynatemp_exponent: f64,
    logit_bias: Vec<(i64, f64)>,
}

fn clamp_i32(v: i64) -> i32 {
    v.clamp(i32::MIN as i64, i32::MAX as i64) as i32
}

fn grammar_spec(grammar: String, root: String) -> GrammarSpec {
    GrammarSpec::Gbnf {
        text: grammar,
        root: if root.is_empty() { "root".into() } else { root },
    }
}

#[rustler::nif(schedule = "DirtyCpu")]
#[allow(clippy::too_many_arguments)]
fn sampler_init<'a>(
    env: Env<'a>,
    m: ResourceArc<ModelRes>,
    seed: u64,
    temp: f64,
    top_k: i64,
    top_p: f64,
    min_p: f64,
    penalty_repeat: f64,
    penalty_freq: f64,
    penalty_present: f64,
    grammar: String,
    grammar_root: String,
    logprobs: i64,
    extras: SamplerExtras,
) -> Term<'a> {
    let r = guard(|| {
        let tokenizer = &m.model.tokenizer;
        let mut logit_bias = Vec::with_capacity(extras.logit_bias.len());
        for &(id, bias) in &extras.logit_bias {
            let bias = if bias <= -1.0e30 {
                f32::NEG_INFINITY
            } else {
                bias as f32
            };
            logit_bias.push((tokenizer.check_id(id)?, bias));
        }
        let mirostat = u8::try_from(extras.mirostat)
            .map_err(|_| NifError::Message("mirostat must be 0, 1 or 2".into()))?;
        let params = SamplerParams {
            seed,
            temp: temp as f32,
            top_k: clamp_i32(top_k),
            top_p: top_p as f32,
            min_p: min_p as f32,
            penalty_repeat: penalty_repeat as f32,
            penalty_freq: penalty_freq as f32,
            penalty_present: penalty_present as f32,
            penalty_last_n: clamp_i32(extras.penalty_last_n),
            min_keep: usize::try_from(extras.min_keep).unwrap_or(0),
            typical_p: extras.typical_p as f32,
            top_n_sigma: extras.top_n_sigma as f32,
            xtc_probability: extras.xtc_probability as f32,
            xtc_threshold: extras.xtc_threshold as f32,
            dry_multiplier: extras.dry_multiplier as f32,
            dry_base: extras.dry_base as f32,
            dry_allowed_length: clamp_i32(extras.dry_allowed_length),
            dry_penalty_last_n: clamp_i32(extras.dry_penalty_last_n),
            mirostat,
            mirostat_tau: extras.mirostat_tau as f32,
            mirostat_eta: extras.mirostat_eta as f32,
            dynatemp_range: extras.dynatemp_range as f32,
            dynatemp_exponent: extras.dynatemp_exponent as f32,
            logit_bias,
            logprobs: usize::try_from(logprobs).ok(),
        };
        params.validate().map_err(NifError::Message)?;
        let dry_active = params.dry_multiplier > 0.0;
        let mut sampler = Sampler::new(params);
        if dry_active {
            let breakers = dry_breaker_tokens(tokenizer, &extras.dry_sequence_breakers);
            sampler = sampler.with_dry_breakers(Arc::new(breakers));
        }
        if !grammar.is_empty() {
            let constraint = m
                .model
                .compile_grammar(&grammar_spec(grammar, grammar_root))
                .map_err(|_| NifError::Atom(atoms::invalid_grammar()))?;
            sampler = sampler.with_grammar(constraint);
        }
        Ok(ResourceArc::new(SamplerRes {
            sampler: Mutex::new(sampler),
        }))
    });
    ok_or_error(env, r)
}

/// `:ok`, or `{:error, message}` explaining why the grammar does not compile.
#[rustler::nif(schedule = "DirtyCpu")]
fn grammar_validate<'a>(
    env: Env<'a>,
    m: ResourceArc<ModelRes>,
    grammar: String,
    grammar_root: String,
) -> Term<'a> {
    let r = guard(|| {
        m.model
            .compile_grammar(&grammar_spec(grammar, grammar_root))
            .map(|_| ())
            .map_err(|e| NifError::Message(e.0))
    });
    match r {
        Ok(()) => atoms::ok().encode(env),
        Err(e) => e.encode(env),
    }
}

/// JSON Schema (JSON text) → `{:ok, text}`: GBNF for `:gbnf`, llguidance Lark for
/// `:llguidance`; or `{:error, message}`.
#[rustler::nif(schedule = "DirtyCpu")]
fn grammar_from_json_schema<'a>(env: Env<'a>, schema_json: String, mode: Atom) -> Term<'a> {
    let r = guard(|| {
        let out = if mode == atoms::llguidance() {
            grammar::json_schema_grammar(&schema_json)
        } else {
            grammar::json_schema::to_gbnf(&schema_json)
        };
        out.map_err(|e| NifError::Message(e.0))
    });
    ok_or_error(env, r)
}

/// `{steps, masks, mask_total_ns, mask_max_ns, check_ns}` of the sampler's grammar.
#[rustler::nif]
fn sampler_grammar_stats(s: ResourceArc<SamplerRes>) -> (u64, u64, u64, u64, u64) {
    let st = lock(&s.sampler).grammar_stats();
    (st.steps, st.masks, st.total_ns, st.max_ns, st.check_ns)
}

#[rustler::nif]
fn sampler_reset(s: ResourceArc<SamplerRes>) -> Atom {
    lock(&s.sampler).reset();
    atoms::ok()
}

#[rustler::nif]
fn sampler_accept<'a>(env: Env<'a>, s: ResourceArc<SamplerRes>, token: i64) -> Term<'a> {
    match u32::try_from(token) {
        Ok(t) => {
            lock(&s.sampler).accept(t);
            atoms::ok().encode(env)
        }
        Err(_) => (atoms::error(), "invalid token id").encode(env),
    }
}

#[rustler::nif(schedule = "DirtyCpu")]
fn sampler_sample_at<'a>(
    env: Env<'a>,
    s: ResourceArc<SamplerRes>,
    c: ResourceArc<ContextRes>,
    idx: i64,
) -> Term<'a> {
    let r = guard(|| {
        let ctx = lock(&c.ctx);
        let logits = ctx.logits_ith(idx)?;
        Ok(lock(&s.sampler).sample(logits))
    });
    ok_or_error(env, r)
}

// ---------------------------------------------------------------- engine thread

type EvalReply = (
    Vec<(usize, u32, Vec<u8>, bool, Option<TokenLogprobs>)>,
    Vec<usize>,
    usize,
    Vec<usize>,
    u64,
);

/// `{logprob, [{id, piece, logprob}]}`.
fn encode_logprobs<'a>(env: Env<'a>, model: &Model, lp: &TokenLogprobs) -> Term<'a> {
    let top: Vec<Term> = lp
        .top
        .iter()
        .map(|&(id, l)| {
            let piece = model.tokenizer.token_to_piece(id).unwrap_or(&[]);
            (id, binary(env, piece), l as f64).encode(env)
        })
        .collect();
    (lp.logprob as f64, top).encode(env)
}

fn run_job(ctx: &ContextRes, job: &Job) -> NifOut<EvalReply> {
    guard(|| {
        let started = std::time::Instant::now();
        let mut guards: Vec<(usize, MutexGuard<'_, Sampler>)> = job
            .samplers
            .iter()
            .map(|(seq, s)| (*seq, lock(&s.sampler)))
            .collect();
        let mut refs: Vec<(usize, &mut Sampler)> =
            guards.iter_mut().map(|(seq, g)| (*seq, &mut **g)).collect();
        let mut c = lock(&ctx.ctx);
        for op in &job.ops {
            match *op {
                KvOp::Trim(seq, p0) => {
                    let seq = c.kv.check_seq(seq as i64)?;
                    if !c.kv.seq_rm(seq, p0, None)? {
                        c.kv.seq_clear(seq);
                    }
                }
                KvOp::Share(src, dst, n) => {
                    let src = c.kv.check_seq(src as i64)?;
                    let dst = c.kv.check_seq(dst as i64)?;
                    c.kv.seq_share_prefix(src, dst, n)?;
                }
                KvOp::Clear(seq) => {
                    let seq = c.kv.check_seq(seq as i64)?;
                    c.kv.seq_clear(seq);
                }
            }
        }
        let outcome = c.eval_sample(&job.batch, &mut refs, &job.purgeable)?;
        let tok = &c.model.tokenizer;
        let sampled = outcome
            .sampled
            .iter()
            .map(|s| {
                let piece = tok
                    .token_to_piece(s.token)
                    .map(<[u8]>::to_vec)
                    .unwrap_or_default();
                (s.seq, s.token, piece, s.is_eog, s.logprobs.clone())
            })
            .collect();
        let eval_us = started.elapsed().as_micros() as u64;
        Ok((
            sampled,
            outcome.purged,
            outcome.n_splits,
            outcome.failed,
            eval_us,
        ))
    })
}

#[rustler::nif]
fn engine_start(c: ResourceArc<ContextRes>) -> NifResult<ResourceArc<EngineRes>> {
    let (tx, rx) = unbounded::<Job>();
    std::thread::Builder::new()
        .name("llama_cpp_ex-engine".into())
        .spawn(move || {
            let model = lock(&c.ctx).model.clone();
            for mut job in rx {
                let reply = run_job(&c, &job);
                let reference = job.reference;
                let _ = job.env.send_and_clear(&job.pid, |env| {
                    let r = reference.load(env);
                    match reply {
                        Ok((sampled, purged, splits, failed, eval_us)) => {
                            let sampled: Vec<Term> = sampled
                                .iter()
                                .map(|(seq, t, piece, eog, lp)| {
                                    let lp = match lp {
                                        Some(lp) => encode_logprobs(env, &model, lp),
                                        None => rustler::types::atom::nil().encode(env),
                                    };
                                    (*seq, *t, binary(env, piece), *eog, lp).encode(env)
                                })
                                .collect();
                            (r, (atoms::ok(), sampled, purged, splits, failed, eval_us)).encode(env)
                        }
                        Err(e) => (r, e).encode(env),
                    }
                });
            }
        })
        .map_err(|e| rustler::Error::Term(Box::new(format!("cannot start engine thread: {e}"))))?;
    Ok(ResourceArc::new(EngineRes {
        tx: Mutex::new(Some(tx)),
    }))
}

/// Queues `[{token, pos, seq, logits?}]` for evaluation with `[{seq, sampler}]`; the result
/// arrives as `{ref, {:ok, [{seq, token, piece, eog?}], purged, n_splits, failed, eval_us}}`
/// or `{ref, {:error, reason}}`.
#[rustler::nif]
#[allow(clippy::too_many_arguments)]
fn engine_submit<'a>(
    env: Env<'a>,
    engine: ResourceArc<EngineRes>,
    pid: LocalPid,
    reference: Term<'a>,
    ops: Vec<Term<'a>>,
    entries: Vec<(i64, i64, i64, bool)>,
    samplers: Vec<(i64, ResourceArc<SamplerRes>)>,
    purgeable: Vec<i64>,
) -> Term<'a> {
    let r = guard(|| {
        let ops = ops
            .iter()
            .map(|t| decode_op(*t))
            .collect::<NifOut<Vec<KvOp>>>()?;
        let mut batch = Batch::with_capacity(entries.len());
        for &(t, p, s, l) in &entries {
            let t =
                u32::try_from(t).map_err(|_| NifError::Message(format!("invalid token id {t}")))?;
            batch.push(t, count(p, "position")?, count(s, "seq_id")?, l);
        }
        let samplers = samplers
            .into_iter()
            .map(|(s, r)| Ok((count(s, "seq_id")?, r)))
            .collect::<NifOut<Vec<_>>>()?;
        let purgeable = purgeable
            .into_iter()
            .map(|s| count(s, "seq_id"))
            .collect::<NifOut<Vec<_>>>()?;
        let owned = OwnedEnv::new();
        let saved = owned.save(reference);
        let job = Job {
            pid,
            env: owned,
            reference: saved,
            ops,
            batch,
            samplers,
            purgeable,
        };
        let tx = lock(&engine.tx);
        let tx = tx
            .as_ref()
            .ok_or_else(|| NifError::Message("engine stopped".into()))?;
        tx.send(job)
            .map_err(|_| NifError::Message("engine thread is gone".into()))
    });
    unit_or_error(env, r)
}

fn decode_op(t: Term) -> NifOut<KvOp> {
    let bad = || NifError::Message("invalid KV operation".into());
    if let Ok((tag, seq, p0)) = t.decode::<(Atom, i64, i64)>() {
        if tag == atoms::trim() {
            return Ok(KvOp::Trim(count(seq, "seq_id")?, count(p0, "position")?));
        }
    }
    if let Ok((tag, src, dst, n)) = t.decode::<(Atom, i64, i64, i64)>() {
        if tag == atoms::share() {
            return Ok(KvOp::Share(
                count(src, "seq_id")?,
                count(dst, "seq_id")?,
                count(n, "length")?,
            ));
        }
    }
    if let Ok((tag, seq)) = t.decode::<(Atom, i64)>() {
        if tag == atoms::clear() {
            return Ok(KvOp::Clear(count(seq, "seq_id")?));
        }
    }
    Err(bad())
}

#[rustler::nif]
fn engine_stop(engine: ResourceArc<EngineRes>) -> Atom {
    lock(&engine.tx).take();
    atoms::ok()
}

// ---------------------------------------------------------------- generation

fn generate_loop(
    ctx: &mut Context,
    sampler: &mut Sampler,
    prompt: &[i64],
    max_tokens: i64,
    cancel: &AtomicBool,
    mut emit: impl FnMut(u32, &[u8], bool, Option<TokenLogprobs>) -> bool,
) -> NifOut<(Vec<u32>, StopReason)> {
    if prompt.is_empty() {
        return Err(NifError::Message("prompt cannot be empty".into()));
    }
    if max_tokens <= 0 {
        return Err(NifError::Message("max_tokens must be positive".into()));
    }
    let prompt = tokens_of(&ctx.model, prompt)?;
    let model = ctx.model.clone();
    let r = ctx.generate(
        sampler,
        &prompt,
        max_tokens as usize,
        Some(cancel),
        |t, eog, lp| {
            let piece = if eog {
                &[][..]
            } else {
                model.tokenizer.token_to_piece(t).unwrap_or(&[])
            };
            emit(t, piece, eog, lp)
        },
    )?;
    Ok(r)
}

#[rustler::nif(schedule = "DirtyCpu")]
fn generate<'a>(
    env: Env<'a>,
    c: ResourceArc<ContextRes>,
    s: ResourceArc<SamplerRes>,
    prompt: Vec<i64>,
    max_tokens: i64,
    cancel: ResourceArc<CancelFlag>,
) -> Term<'a> {
    let r = guard(|| {
        let mut ctx = lock(&c.ctx);
        let mut sampler = lock(&s.sampler);
        let mut text = Vec::new();
        generate_loop(
            &mut ctx,
            &mut sampler,
            &prompt,
            max_tokens,
            &cancel.flag,
            |_, piece, _, _| {
                text.extend_from_slice(piece);
                true
            },
        )?;
        Ok(text)
    });
    match r {
        Ok(bytes) => (atoms::ok(), binary(env, &bytes)).encode(env),
        Err(e) => e.encode(env),
    }
}

/// Streams `{ref, {:token, id, piece}}` to `pid`, then `{ref, :eog}`, `{ref, :done}` or
/// `{ref, {:error, msg}}`. A cancel stops it silently within one token.
#[rustler::nif(schedule = "DirtyCpu")]
#[allow(clippy::too_many_arguments)]
fn generate_tokens<'a>(
    env: Env<'a>,
    c: ResourceArc<ContextRes>,
    s: ResourceArc<SamplerRes>,
    prompt: Vec<i64>,
    max_tokens: i64,
    pid: LocalPid,
    reference: Term<'a>,
    cancel: ResourceArc<CancelFlag>,
) -> NifResult<(Atom, usize)> {
    let r = guard(|| {
        let mut ctx = lock(&c.ctx);
        let mut sampler = lock(&s.sampler);
        let model = ctx.model.clone();
        generate_loop(
            &mut ctx,
            &mut sampler,
            &prompt,
            max_tokens,
            &cancel.flag,
            |t, piece, eog, lp| {
                if eog || cancel.flag.load(Ordering::Relaxed) {
                    return true;
                }
                let sent = match lp {
                    None => env.send(&pid, (reference, (atoms::token(), t, binary(env, piece)))),
                    Some(lp) => {
                        let lp = encode_logprobs(env, &model, &lp);
                        env.send(
                            &pid,
                            (reference, (atoms::token(), t, binary(env, piece), lp)),
                        )
                    }
                };
                sent.is_ok()
            },
        )
    });
    let n = r.as_ref().map(|(t, _)| t.len()).unwrap_or(0);
    if cancel.flag.load(Ordering::Relaxed) {
        return Ok((atoms::ok(), n));
    }
    let _ = match r {
        Ok((_, StopReason::Eog)) => env.send(&pid, (reference, atoms::eog())),
        Ok((_, StopReason::MaxTokens)) => env.send(&pid, (reference, atoms::done())),
        Ok((_, StopReason::Cancelled)) => Ok(()),
        Err(e) => env.send(&pid, (reference, e)),
    };
    Ok((atoms::ok(), n))
}

fn load(_env: Env, _info: Term) -> bool {
    llama_cpp_ex_engine::keep_activations_in_heap();
    true
}

rustler::init!("Elixir.LlamaCppEx.NIF", load = load);
