//! Sampler parameters as a caller could send them (any values the NIF's decoder lets through:
//! every integer and float of the field's type), validated by the engine, then a few samples
//! on random logits: a sampler that builds must sample without panicking.
#![no_main]

#[path = "common/mod.rs"]
mod common;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use llama_cpp_ex_engine::sampler::SamplerSpec;
use llama_cpp_ex_engine::SamplerParams;

#[derive(Arbitrary, Debug)]
struct Input {
    pick: u16,
    seed: Option<u64>,
    temp: f32,
    top_k: i32,
    top_p: f32,
    min_p: f32,
    penalty_repeat: f32,
    penalty_freq: f32,
    penalty_present: f32,
    penalty_last_n: i32,
    min_keep: u16,
    typical_p: f32,
    top_n_sigma: f32,
    xtc_probability: f32,
    xtc_threshold: f32,
    dry_multiplier: f32,
    dry_base: f32,
    dry_allowed_length: i32,
    dry_penalty_last_n: i32,
    mirostat: u8,
    mirostat_tau: f32,
    mirostat_eta: f32,
    dynatemp_range: f32,
    dynatemp_exponent: f32,
    logit_bias: Vec<(u32, f32)>,
    logprobs: Option<u8>,
    breakers: Vec<String>,
    logits_seed: u32,
    accepted: Vec<u32>,
}

fuzz_target!(|input: Input| {
    // mostly the tiny vocabulary (sampling cost grows with it), one input in 2^15 a real one
    let model = match input.pick {
        0 => common::smollm2(),
        1 => common::gemma3(),
        _ => common::tiny(),
    };
    let params = SamplerParams {
        seed: 0,
        temp: input.temp,
        top_k: input.top_k,
        top_p: input.top_p,
        min_p: input.min_p,
        penalty_repeat: input.penalty_repeat,
        penalty_freq: input.penalty_freq,
        penalty_present: input.penalty_present,
        penalty_last_n: input.penalty_last_n,
        min_keep: input.min_keep as usize,
        typical_p: input.typical_p,
        top_n_sigma: input.top_n_sigma,
        xtc_probability: input.xtc_probability,
        xtc_threshold: input.xtc_threshold,
        dry_multiplier: input.dry_multiplier,
        dry_base: input.dry_base,
        dry_allowed_length: input.dry_allowed_length,
        dry_penalty_last_n: input.dry_penalty_last_n,
        mirostat: input.mirostat,
        mirostat_tau: input.mirostat_tau,
        mirostat_eta: input.mirostat_eta,
        dynatemp_range: input.dynatemp_range,
        dynatemp_exponent: input.dynatemp_exponent,
        logit_bias: input.logit_bias.iter().take(64).copied().collect(),
        logprobs: input.logprobs.map(|n| n as usize),
    };
    let spec = SamplerSpec {
        params,
        seed: input.seed,
        grammar: None,
        grammar_triggers: Vec::new(),
        dry_sequence_breakers: input.breakers.into_iter().take(16).collect(),
    };
    let Ok(mut sampler) = model.sampler(&spec) else {
        return;
    };
    let n_vocab = model.tokenizer.n_vocab();
    for &t in input.accepted.iter().take(32) {
        if (t as usize) < n_vocab {
            sampler.accept(t);
        }
    }
    // deterministic pseudo-random logits (xorshift) with a few extreme values
    let mut x = input.logits_seed | 1;
    let mut logits: Vec<f32> = (0..n_vocab)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 2000) as f32 / 100.0 - 10.0
        })
        .collect();
    logits[(x as usize) % n_vocab] = 1e30;
    for _ in 0..3 {
        let (t, _) = sampler.sample_with_logprobs(&logits);
        assert!((t as usize) < n_vocab, "sampled {t} of {n_vocab}");
        sampler.accept(t);
        logits.rotate_left(7);
    }
});
