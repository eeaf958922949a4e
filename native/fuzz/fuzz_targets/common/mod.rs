//! What the fuzz targets share: the real models' vocabularies, loaded once.
#![allow(dead_code)]

use llama_cpp_ex_engine::{LoadOptions, Model};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

fn models_dir() -> PathBuf {
    std::env::var_os("LLAMA_CPP_EX_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME"))
                .join(".cache/llama_cpp_ex/models")
        })
}

fn vocab(file: &str) -> Arc<Model> {
    let path = models_dir().join(file);
    let opts = LoadOptions {
        vocab_only: true,
        ..Default::default()
    };
    Arc::new(Model::load(&path, &opts).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run scripts/fetch_models.py first)",
            path.display()
        )
    }))
}

/// SmolLM2's vocabulary and chat template (byte-level BPE).
pub fn smollm2() -> &'static Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| vocab("SmolLM2-135M-Instruct.Q4_1.gguf"))
}

/// Gemma 3's vocabulary and chat template (SentencePiece).
pub fn gemma3() -> &'static Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| vocab("gemma-3-270m-q4_k_m.gguf"))
}

/// The tiny byte-level vocabulary of scripts/tiny_gguf.py (103 tokens), for targets whose cost
/// grows with the vocabulary.
pub fn tiny() -> &'static Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| {
        let bytes = include_bytes!("../../seeds/gguf/tiny-llama-f32").to_vec();
        let gguf = llama_cpp_ex_engine::gguf::GgufFile::from_bytes(bytes).expect("tiny gguf");
        let opts = LoadOptions {
            vocab_only: true,
            ..Default::default()
        };
        Arc::new(Model::from_gguf(gguf, &opts).expect("tiny model"))
    })
}

/// One of the two, chosen by a byte of the input.
pub fn model(pick: u8) -> &'static Arc<Model> {
    if pick & 1 == 0 {
        smollm2()
    } else {
        gemma3()
    }
}
