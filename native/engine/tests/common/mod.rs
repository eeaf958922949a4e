//! Shared helpers for the engine's integration tests: locating the cached models and the
//! llama.cpp fixtures (in the repository's `test/fixtures`).

#![allow(dead_code)]

use llama_cpp_ex_engine::context::{DraftSource, SpecRequest};
use llama_cpp_ex_engine::{
    Backend, Batch, Context, ContextParams, KvOp, LoadOptions, Model, Placement, Requantize,
    SampledToken, Sampler, SharedSampler, Step,
};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

pub fn models_dir() -> PathBuf {
    if let Some(d) =
        std::env::var_os("LLAMA_CPP_EX_MODELS").or_else(|| std::env::var_os("LLAMA_CACHE_DIR"))
    {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").expect("HOME is set");
    PathBuf::from(home).join(".cache/llama_cpp_ex/models")
}

pub fn model_path(file: &str) -> PathBuf {
    let p = models_dir().join(file);
    assert!(
        p.is_file(),
        "{} is missing: run scripts/fetch_models.py first",
        p.display()
    );
    p
}

/// llama.cpp's reference outputs, kept in the repository (`test/fixtures`, see its README);
/// `LLAMA_CPP_EX_FIXTURES` for a test binary run away from its checkout (the GPU check).
pub fn fixtures_dir() -> PathBuf {
    match std::env::var_os("LLAMA_CPP_EX_FIXTURES") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../test/fixtures"),
    }
}

pub fn fixture(name: &str) -> serde_json::Value {
    let p = fixtures_dir().join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

/// The backend a test loads with: `LLAMA_CPP_EX_TEST_BACKEND=tensor` runs the GPU's code path
/// (candle tensors) on the CPU device, `=cuda` on GPU 0 (a build with the `cuda` feature);
/// unset, the engine's own CPU kernels.
pub fn test_placement() -> Placement {
    match std::env::var("LLAMA_CPP_EX_TEST_BACKEND").as_deref() {
        Ok("tensor") => Placement::Backend(Backend::Tensor(candle_core::Device::Cpu)),
        Ok("cuda") => Placement::Backend(Backend::gpu(0).expect("GPU 0")),
        Ok("cpu") | Err(_) => Placement::default(),
        Ok(other) => panic!("LLAMA_CPP_EX_TEST_BACKEND={other}: expected cpu, tensor or cuda"),
    }
}

/// Whether `LLAMA_CPP_EX_TEST_BACKEND` puts the tests on a GPU (`cuda`): the bounds that
/// depend on the device's arithmetic read it.
pub fn testing_on_cuda() -> bool {
    std::env::var("LLAMA_CPP_EX_TEST_BACKEND").as_deref() == Ok("cuda")
}

pub fn load(file: &str, requantize: Requantize) -> Arc<Model> {
    let opts = LoadOptions {
        requantize,
        vocab_only: false,
        ..Default::default()
    };
    Arc::new(Model::load(&model_path(file), &opts).unwrap())
}

pub fn load_vocab(file: &str) -> Arc<Model> {
    let opts = LoadOptions {
        requantize: Requantize::Off,
        vocab_only: true,
        ..Default::default()
    };
    Arc::new(Model::load(&model_path(file), &opts).unwrap())
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub const THRESHOLDS: [f64; 5] = [0.0, 0.1, 0.25, 0.5, 1.0];
pub const REQUIRED_AGREEMENT: f64 = 0.99;
pub const REQUIRED_MARGIN: f64 = 0.5;

pub fn argmax(row: &[f32]) -> u32 {
    llama_cpp_ex_engine::sampler::argmax(row) as u32
}

/// A sampler the steps of a test can share.
pub fn shared(sampler: Sampler) -> SharedSampler {
    Arc::new(Mutex::new(sampler))
}

/// Generates on sequence 0 of `ctx` as a generation on a model does, through engine steps:
/// the sequence cleared, the prompt in chunks of `n_batch`, then one token per step. Returns
/// up to `max_tokens` sampled tokens, ending at (and with) an end-of-generation token.
pub fn generate(
    ctx: &mut Context,
    sampler: &SharedSampler,
    prompt: &[u32],
    max_tokens: usize,
) -> Vec<SampledToken> {
    let chunks: Vec<&[u32]> = prompt.chunks(ctx.params.n_batch).collect();
    let mut ops = vec![KvOp::Clear { seq: 0 }];
    let mut pos = 0;
    let mut out: Vec<SampledToken> = Vec::new();
    for (k, chunk) in chunks.iter().enumerate() {
        let last = k + 1 == chunks.len();
        let mut batch = Batch::for_sequence(chunk, pos, 0);
        batch.logits.iter_mut().for_each(|l| *l &= last);
        pos += chunk.len();
        let step = Step {
            ops: std::mem::take(&mut ops),
            batch,
            samplers: if last {
                vec![(0, sampler.clone())]
            } else {
                vec![]
            },
            ..Default::default()
        };
        out.extend(ctx.step(&step).unwrap().sampled);
    }
    while out.len() < max_tokens && !out.last().is_some_and(|t| t.is_eog) {
        let token = out.last().unwrap().token;
        let step = Step {
            batch: Batch::for_sequence(&[token], pos, 0),
            samplers: vec![(0, sampler.clone())],
            ..Default::default()
        };
        pos += 1;
        out.extend(ctx.step(&step).unwrap().sampled);
    }
    out
}

/// The token ids of sampled tokens.
pub fn tokens(sampled: &[SampledToken]) -> Vec<u32> {
    sampled.iter().map(|s| s.token).collect()
}

/// One speculative step of sequence `seq`: `token` evaluated at `pos` with a draft from
/// `source`; `fed` are the tokens the sequence took since its last speculative step (with
/// `reset`, all of them), `token` last. Returns the tokens emitted and the draft's length.
#[allow(clippy::too_many_arguments)]
pub fn speculate(
    ctx: &mut Context,
    sampler: &SharedSampler,
    seq: usize,
    token: u32,
    pos: usize,
    fed: &[u32],
    reset: bool,
    source: DraftSource,
) -> llama_cpp_ex_engine::Result<(Vec<SampledToken>, usize)> {
    let mut batch = Batch::with_capacity(1);
    batch.push(token, pos, seq, true);
    let step = Step {
        batch,
        samplers: vec![(seq, sampler.clone())],
        specs: vec![SpecRequest {
            seq,
            tokens: fed.to_vec(),
            reset,
            source,
        }],
        ..Default::default()
    };
    let out = ctx.step(&step)?;
    let drafted = out.drafted.iter().find(|d| d.0 == seq).map_or(0, |d| d.1);
    Ok((out.sampled, drafted))
}

pub fn ctx(model: &Arc<Model>, n_ctx: usize, n_seq: usize) -> Context {
    Context::new(
        model.clone(),
        ContextParams {
            n_ctx,
            n_batch: n_ctx,
            n_seq_max: n_seq,
            ..Default::default()
        },
    )
    .unwrap()
}

/// Returns (agreement per threshold, steps per threshold).
pub fn teacher_forced(model: &Arc<Model>, fixture_name: &str) -> Vec<(f64, usize, usize)> {
    use llama_cpp_ex_engine::kv::KvType;
    teacher_forced_kv(model, fixture_name, (KvType::F16, KvType::F16))
}

/// [`teacher_forced`] with the keys and values cached in the given precisions.
#[allow(dead_code)]
pub fn teacher_forced_kv(
    model: &Arc<Model>,
    fixture_name: &str,
    (k, v): (
        llama_cpp_ex_engine::kv::KvType,
        llama_cpp_ex_engine::kv::KvType,
    ),
) -> Vec<(f64, usize, usize)> {
    let fx = fixture(fixture_name);
    let mut agree = vec![0usize; THRESHOLDS.len()];
    let mut total = vec![0usize; THRESHOLDS.len()];
    let mut max_lp_diff = 0f64;
    for case in fx["cases"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        let steps = case["steps"].as_array().unwrap();
        let generated: Vec<u32> = steps
            .iter()
            .map(|s| s["id"].as_u64().unwrap() as u32)
            .collect();
        let mut all = prompt.clone();
        all.extend_from_slice(&generated);
        let mut c = Context::new(
            model.clone(),
            ContextParams {
                n_ctx: 1024,
                n_batch: 1024,
                kv_type: k,
                kv_type_v: Some(v),
                ..Default::default()
            },
        )
        .unwrap();
        let mut batch = Batch::with_capacity(all.len());
        for (i, &t) in all.iter().enumerate() {
            batch.push(t, i, 0, i + 1 >= prompt.len());
        }
        c.decode(&batch).unwrap();
        for (k, step) in steps.iter().enumerate() {
            let row = c.logits_ith((prompt.len() - 1 + k) as i64).unwrap();
            let top5 = step["top5"].as_array().unwrap();
            let lp1 = top5[0]["logprob"].as_f64().unwrap();
            let lp2 = top5[1]["logprob"].as_f64().unwrap();
            let margin = lp1 - lp2;
            let ours = argmax(row);
            let expected = step["id"].as_u64().unwrap() as u32;
            let lps = llama_cpp_ex_engine::sampler::log_softmax(row);
            max_lp_diff = max_lp_diff
                .max((lps[expected as usize] as f64 - step["logprob"].as_f64().unwrap()).abs());
            for (i, &th) in THRESHOLDS.iter().enumerate() {
                if margin >= th {
                    total[i] += 1;
                    if ours == expected {
                        agree[i] += 1;
                    }
                }
            }
        }
    }
    println!("{fixture_name}: max |logprob difference| of llama.cpp's token: {max_lp_diff:.3}");
    THRESHOLDS
        .iter()
        .enumerate()
        .map(|(i, _)| (agree[i] as f64 / total[i].max(1) as f64, agree[i], total[i]))
        .collect()
}

pub fn report(label: &str, rates: &[(f64, usize, usize)]) {
    for (th, (rate, a, t)) in THRESHOLDS.iter().zip(rates) {
        println!("{label}: margin >= {th:<4}: {a}/{t} = {:.2}%", rate * 100.0);
    }
}

/// Asserts the required agreement at the required margin.
pub fn assert_parity(label: &str, rates: &[(f64, usize, usize)], required: f64) {
    report(label, rates);
    let at = THRESHOLDS
        .iter()
        .position(|&t| t == REQUIRED_MARGIN)
        .unwrap();
    assert!(
        rates[at].0 >= required,
        "{label}: agreement {:.4} below {required}",
        rates[at].0
    );
}

/// Largest absolute difference relative to the largest magnitude of `a` (at least 1).
pub fn rel_close(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().map(|v| v.abs()).fold(1.0f32, f32::max);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

/// Logits of every position of `tokens`, evaluated alone in a context of `n_ctx`.
pub fn logits_all(model: &Arc<Model>, tokens: &[u32], n_ctx: usize) -> Vec<Vec<f32>> {
    let mut c = ctx(model, n_ctx, 1);
    let mut b = Batch::with_capacity(tokens.len());
    for (i, &t) in tokens.iter().enumerate() {
        b.push(t, i, 0, true);
    }
    c.decode(&b).unwrap();
    (0..tokens.len())
        .map(|i| c.logits_ith(i as i64).unwrap().to_vec())
        .collect()
}

/// Cosine similarity, in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// A fixture's array of strings.
pub fn strs(v: &serde_json::Value) -> Vec<&str> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect()
}

/// A fixture's array of numbers, as f32.
pub fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}
