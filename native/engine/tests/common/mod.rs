//! Shared helpers for the engine's integration tests: locating the cached models and the
//! llama.cpp fixtures (in the repository's `test/fixtures`).

#![allow(dead_code)]

use llama_cpp_ex_engine::{Batch, Context, ContextParams, LoadOptions, Model, Requantize};
use std::path::PathBuf;
use std::sync::Arc;

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

/// llama.cpp's reference outputs, kept in the repository (`test/fixtures`, see its README).
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../test/fixtures")
}

pub fn fixture(name: &str) -> serde_json::Value {
    let p = fixtures_dir().join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

pub fn load(file: &str, requantize: Requantize) -> Arc<Model> {
    let opts = LoadOptions {
        requantize,
        vocab_only: false,
    };
    Arc::new(Model::load(&model_path(file), &opts).unwrap())
}

pub fn load_vocab(file: &str) -> Arc<Model> {
    let opts = LoadOptions {
        requantize: Requantize::Off,
        vocab_only: true,
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
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
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
