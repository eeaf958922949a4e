//! Shared helpers for the engine's integration tests: locating the cached models and the
//! llama.cpp fixtures.

#![allow(dead_code)]

use llama_cpp_ex_engine::{LoadOptions, Model, Requantize};
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

pub fn fixtures_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("LLAMA_CPP_EX_FIXTURES") {
        return PathBuf::from(d);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures")
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
