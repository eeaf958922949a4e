//! Samplers and grammars.

use crate::context::ContextRes;
use crate::error::{guard, lock, message, NifError, Out, Status};
use crate::model::ModelRes;
use llama_cpp_ex_engine::grammar::{self, GrammarSpec};
use llama_cpp_ex_engine::sampler::{SamplerSpec, DEFAULT_DRY_BREAKERS};
use llama_cpp_ex_engine::{SamplerParams, SharedSampler};
use rustler::{Atom, Encoder, Env, NifMap, ResourceArc, Term};
use std::sync::{Arc, Mutex};

pub struct SamplerRes {
    pub sampler: SharedSampler,
    n_vocab: usize,
}

#[rustler::resource_impl]
impl rustler::Resource for SamplerRes {}

/// Every sampler option, as `LlamaCppEx.Sampler` sends them (validated and complete) and as
/// `sampler_defaults` reports the engine's defaults: the one list of the fields on this side.
#[derive(NifMap)]
struct SamplerOpts {
    seed: Option<u64>,
    temp: f64,
    top_k: i64,
    top_p: f64,
    min_p: f64,
    penalty_repeat: f64,
    penalty_freq: f64,
    penalty_present: f64,
    penalty_last_n: i64,
    min_keep: u64,
    typical_p: f64,
    top_n_sigma: f64,
    xtc_probability: f64,
    xtc_threshold: f64,
    dry_multiplier: f64,
    dry_base: f64,
    dry_allowed_length: i64,
    dry_penalty_last_n: i64,
    dry_sequence_breakers: Vec<String>,
    mirostat: u8,
    mirostat_tau: f64,
    mirostat_eta: f64,
    dynatemp_range: f64,
    dynatemp_exponent: f64,
    logit_bias: Vec<(u32, f64)>,
    /// Tokens banned outright (a bias of minus infinity, which Erlang floats cannot hold).
    logit_ban: Vec<u32>,
    logprobs: Option<usize>,
    grammar: Option<String>,
    grammar_root: String,
    grammar_triggers: Vec<String>,
}

fn i32_of(v: i64, name: &str) -> Out<i32> {
    i32::try_from(v).map_err(|_| message(format!("{name} must fit in 32 bits, got {v}")))
}

impl SamplerOpts {
    /// The engine's defaults under `LlamaCppEx.Sampler`'s option names.
    fn defaults() -> Self {
        let p = SamplerParams::default();
        SamplerOpts {
            seed: None,
            temp: p.temp as f64,
            top_k: p.top_k as i64,
            top_p: p.top_p as f64,
            min_p: p.min_p as f64,
            penalty_repeat: p.penalty_repeat as f64,
            penalty_freq: p.penalty_freq as f64,
            penalty_present: p.penalty_present as f64,
            penalty_last_n: p.penalty_last_n as i64,
            min_keep: p.min_keep as u64,
            typical_p: p.typical_p as f64,
            top_n_sigma: p.top_n_sigma as f64,
            xtc_probability: p.xtc_probability as f64,
            xtc_threshold: p.xtc_threshold as f64,
            dry_multiplier: p.dry_multiplier as f64,
            dry_base: p.dry_base as f64,
            dry_allowed_length: p.dry_allowed_length as i64,
            dry_penalty_last_n: p.dry_penalty_last_n as i64,
            dry_sequence_breakers: DEFAULT_DRY_BREAKERS.iter().map(|s| s.to_string()).collect(),
            mirostat: p.mirostat,
            mirostat_tau: p.mirostat_tau as f64,
            mirostat_eta: p.mirostat_eta as f64,
            dynatemp_range: p.dynatemp_range as f64,
            dynatemp_exponent: p.dynatemp_exponent as f64,
            logit_bias: Vec::new(),
            logit_ban: Vec::new(),
            logprobs: None,
            grammar: None,
            grammar_root: "root".into(),
            grammar_triggers: Vec::new(),
        }
    }

    fn into_spec(self) -> Out<SamplerSpec> {
        let mut logit_bias: Vec<(u32, f32)> = self
            .logit_bias
            .iter()
            .map(|&(t, b)| (t, b as f32))
            .collect();
        logit_bias.extend(self.logit_ban.iter().map(|&t| (t, f32::NEG_INFINITY)));
        let params = SamplerParams {
            seed: 0,
            temp: self.temp as f32,
            top_k: i32_of(self.top_k, "top_k")?,
            top_p: self.top_p as f32,
            min_p: self.min_p as f32,
            penalty_repeat: self.penalty_repeat as f32,
            penalty_freq: self.penalty_freq as f32,
            penalty_present: self.penalty_present as f32,
            penalty_last_n: i32_of(self.penalty_last_n, "penalty_last_n")?,
            min_keep: self.min_keep as usize,
            typical_p: self.typical_p as f32,
            top_n_sigma: self.top_n_sigma as f32,
            xtc_probability: self.xtc_probability as f32,
            xtc_threshold: self.xtc_threshold as f32,
            dry_multiplier: self.dry_multiplier as f32,
            dry_base: self.dry_base as f32,
            dry_allowed_length: i32_of(self.dry_allowed_length, "dry_allowed_length")?,
            dry_penalty_last_n: i32_of(self.dry_penalty_last_n, "dry_penalty_last_n")?,
            mirostat: self.mirostat,
            mirostat_tau: self.mirostat_tau as f32,
            mirostat_eta: self.mirostat_eta as f32,
            dynatemp_range: self.dynatemp_range as f32,
            dynatemp_exponent: self.dynatemp_exponent as f32,
            logit_bias,
            logprobs: self.logprobs,
        };
        Ok(SamplerSpec {
            params,
            seed: self.seed,
            grammar: self.grammar.map(|g| grammar_spec(g, self.grammar_root)),
            grammar_triggers: self.grammar_triggers,
            dry_sequence_breakers: self.dry_sequence_breakers,
        })
    }
}

/// The engine's sampler defaults (`LlamaCppEx.Sampler.defaults/0`): the one place they are
/// defined is the engine's `SamplerParams::default`.
#[rustler::nif]
fn sampler_defaults() -> SamplerOpts {
    SamplerOpts::defaults()
}

fn grammar_spec(text: String, root: String) -> GrammarSpec {
    GrammarSpec::Gbnf {
        text,
        root: if root.is_empty() { "root".into() } else { root },
    }
}

#[rustler::nif(schedule = "DirtyCpu")]
fn sampler_init<'a>(env: Env<'a>, m: ResourceArc<ModelRes>, o: SamplerOpts) -> Term<'a> {
    let r: Out<ResourceArc<SamplerRes>> = guard(|| {
        let spec = o.into_spec()?;
        let sampler = m.model.sampler(&spec)?;
        Ok(ResourceArc::new(SamplerRes {
            sampler: Arc::new(Mutex::new(sampler)),
            n_vocab: m.model.tokenizer.n_vocab(),
        }))
    });
    r.encode(env)
}

/// `:ok`, or `{:error, message}` explaining why the grammar does not compile.
#[rustler::nif(schedule = "DirtyCpu")]
fn grammar_validate(m: ResourceArc<ModelRes>, grammar: String, root: String) -> Status {
    Status(guard(|| {
        m.model
            .compile_grammar(&grammar_spec(grammar, root))
            .map(|_| ())
            .map_err(|e| message(e.0))
    }))
}

/// JSON Schema text → GBNF (`:gbnf`) or llguidance Lark (`:llguidance`).
#[rustler::nif(schedule = "DirtyCpu")]
fn grammar_from_json_schema(schema_json: String, mode: Atom) -> Out<String> {
    guard(|| {
        let out = if mode == crate::atoms::llguidance() {
            grammar::json_schema_grammar(&schema_json)
        } else {
            grammar::json_schema::to_gbnf(&schema_json)
        };
        out.map_err(|e| message(e.0))
    })
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
    crate::atoms::ok()
}

#[rustler::nif]
fn sampler_accept(s: ResourceArc<SamplerRes>, token: u32) -> Status {
    Status(if (token as usize) < s.n_vocab {
        lock(&s.sampler).accept(token);
        Ok(())
    } else {
        Err(NifError::Engine(
            llama_cpp_ex_engine::EngineError::InvalidToken {
                id: token as i64,
                n_vocab: s.n_vocab,
            },
        ))
    })
}

#[rustler::nif(schedule = "DirtyCpu")]
fn sampler_sample_at(s: ResourceArc<SamplerRes>, c: ResourceArc<ContextRes>, idx: i64) -> Out<u32> {
    guard(|| {
        let ctx = lock(&c.ctx);
        let logits = ctx.logits_ith(idx)?;
        Ok(lock(&s.sampler).sample(logits))
    })
}
