//! Every decoder family against llama.cpp, on tiny random-weight F32 models
//! (`test/fixtures/tiny`, made by `scripts/tiny_parity.py`): llama.cpp's greedy continuation
//! of four token prompts is teacher-forced through the engine, and at every generated position
//! the argmax and the top-5 log-probabilities must match; then the longest prompt evaluated
//! inside a batch of 8 sequences at other positions must give the logits it gives alone.

mod common;
use common::*;
use llama_cpp_ex_engine::sampler::log_softmax;
use llama_cpp_ex_engine::{Batch, LoadOptions, Model, Requantize};
use std::sync::Arc;

const ARCHS: [&str; 7] = [
    "llama", "llama3", "qwen2", "qwen3", "phi3", "gemma2", "gemma3",
];
/// Largest |log-probability difference| over llama.cpp's top-5 at any position. Measured
/// (F32 weights, f16 KV cache on both sides, llama.cpp's flash attention off): 5.8e-4
/// (gemma2) to 9.9e-3 (llama); with its flash attention on, up to 1.5e-2. A wrong rope
/// variant, norm or scale gives differences above 0.1.
const MAX_LOGPROB_DIFF: f64 = 2e-2;
/// The same for quantized weights (a well-conditioned 2-layer model of width 256). Measured:
/// F16 3.5e-3, BF16 1.7e-2 (llama.cpp rounds activations to the weights' 16-bit
/// type), Q8_0…IQ4_XS 4e-2…1.1e-1: both sides quantize activations (ggml to Q8_0/Q8_K, the
/// engine's kernels to their own 8-bit blocks), and those roundings differ.
const MAX_QUANT_LOGPROB_DIFF: f64 = 0.15;
/// The same on a GPU: candle's CUDA kernels quantize the activations to Q8_1 blocks and sum
/// in another order than ggml's CPU kernels that made the fixtures. Measured on an H200:
/// F16 3.5e-3, Q8_0 4.5e-2, Q4_K_M 1.73e-1, Q2_K 1.66e-1, Q4_1, Q5_1 and Q5_K_M 1.50e-1
/// (the engine's CPU kernels: 5.5e-2 to 1.1e-1 on those), argmax equal at every step.
const MAX_QUANT_LOGPROB_DIFF_CUDA: f64 = 0.2;

/// `test/fixtures/tiny/<file>.gguf` with its weights as stored, on the backend
/// `LLAMA_CPP_EX_TEST_BACKEND` names (the CPU kernels by default).
fn load_tiny(file: &str) -> Arc<Model> {
    let path = fixtures_dir().join(format!("tiny/{file}.gguf"));
    let opts = LoadOptions {
        requantize: Requantize::Off,
        vocab_only: false,
        placement: test_placement(),
    };
    Arc::new(Model::load(&path, &opts).unwrap_or_else(|e| panic!("{file}: {e}")))
}

fn tiny(arch: &str) -> Arc<Model> {
    load_tiny(&format!("tiny-{arch}-f32"))
}

/// Argmax agreement at the required margin and the log-probability bound.
fn assert_matches(label: &str, result: (usize, usize, f64), bound: f64) {
    if let Some(failure) = mismatch(label, result, bound) {
        panic!("{failure}");
    }
}

/// What fails [`assert_matches`], if anything (printed either way).
fn mismatch(
    label: &str,
    (agree, total, max_diff): (usize, usize, f64),
    bound: f64,
) -> Option<String> {
    println!("{label}: argmax {agree}/{total} at margin >= 0.5, max |Δ logprob| {max_diff:.2e}");
    if total == 0 {
        Some(format!("{label}: no position with a clear winner"))
    } else if (agree as f64) < REQUIRED_AGREEMENT * total as f64 {
        Some(format!("{label}: argmax agreement {agree}/{total}"))
    } else if max_diff > bound {
        Some(format!(
            "{label}: log-probabilities differ from llama.cpp's by {max_diff}"
        ))
    } else {
        None
    }
}

fn cases(arch: &str) -> Vec<serde_json::Value> {
    fixture("tiny/parity.json")["models"][arch]
        .as_array()
        .unwrap()
        .clone()
}

/// Logits of every position of `tokens` evaluated alone.
fn alone(model: &Arc<Model>, tokens: &[u32]) -> Vec<Vec<f32>> {
    alone_in(model, tokens, 256)
}

/// The same in a context of `n_ctx` positions.
fn alone_in(model: &Arc<Model>, tokens: &[u32], n_ctx: usize) -> Vec<Vec<f32>> {
    logits_all(model, tokens, n_ctx)
}

/// Teacher-forces llama.cpp's continuations: (argmax agreements, positions with a clear
/// winner, largest |Δ logprob| over llama.cpp's top-5).
fn compare(arch: &str, model: &Arc<Model>, cases: &[serde_json::Value]) -> (usize, usize, f64) {
    compare_in(arch, model, cases, 256)
}

/// [`compare`] in a context of `n_ctx` positions.
fn compare_in(
    arch: &str,
    model: &Arc<Model>,
    cases: &[serde_json::Value],
    n_ctx: usize,
) -> (usize, usize, f64) {
    let (mut agree, mut total, mut max_diff) = (0, 0, 0f64);
    for case in cases {
        let prompt = ids(&case["prompt"]);
        let generated = ids(&case["tokens"]);
        let mut all = prompt.clone();
        all.extend_from_slice(&generated);
        let rows = alone_in(model, &all, n_ctx);
        for (k, top) in case["top"].as_array().unwrap().iter().enumerate() {
            let top = top.as_array().unwrap();
            let row = &rows[prompt.len() - 1 + k];
            let lps = log_softmax(row);
            for entry in top {
                let id = entry[0].as_u64().unwrap() as usize;
                let lp = entry[1].as_f64().unwrap();
                max_diff = max_diff.max((lps[id] as f64 - lp).abs());
            }
            let margin = top[0][1].as_f64().unwrap() - top[1][1].as_f64().unwrap();
            // llama.cpp's argmax is its top-1 (the generated token differs where it is an
            // end-of-generation token: the fixture was made with ignore_eos)
            let best = top[0][0].as_u64().unwrap() as u32;
            if margin >= REQUIRED_MARGIN {
                total += 1;
                if argmax(row) == best {
                    agree += 1;
                } else {
                    println!(
                            "{arch}: case of {} prompt tokens, step {k}: ours {} ({:.4}), llama.cpp {} ({:.4} ours {:.4}), margin {margin:.3}",
                            prompt.len(),
                            argmax(row),
                            lps[argmax(row) as usize],
                            best,
                            top[0][1].as_f64().unwrap(),
                            lps[best as usize]
                        );
                }
            }
        }
    }
    (agree, total, max_diff)
}

#[test]
fn every_family_matches_llama_cpp_teacher_forced() {
    for arch in ARCHS {
        let model = tiny(arch);
        let result = compare(arch, &model, &cases(arch));
        assert_matches(arch, result, MAX_LOGPROB_DIFF);
    }
}

/// Phi-3 LongRoPE (`rope_factors_long` / `_short`, `rope.scaling.attn_factor`): llama.cpp's
/// continuations in a context beyond the original 512 positions (long factors) and within it
/// (short factors), which differ by up to 1.9 in log-probability.
#[test]
fn phi3_longrope_matches_llama_cpp_at_both_context_sizes() {
    let model = load_tiny("phi3-longrope");
    let fx = fixture("tiny/parity.json");
    for n_ctx in [1024usize, 256] {
        let cases = fx["longrope"][n_ctx.to_string()].as_array().unwrap();
        let result = compare_in("phi3-longrope", &model, cases, n_ctx);
        assert_matches(
            &format!("phi3 LongRoPE, n_ctx {n_ctx}"),
            result,
            MAX_LOGPROB_DIFF,
        );
    }
}

/// llama-quantize's types (`--pure`: every matrix, the tied embedding/output head included).
const QUANTS: [&str; 14] = [
    "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M",
    "Q6_K", "IQ4_NL", "IQ4_XS",
];

#[test]
fn every_quantization_type_matches_llama_cpp() {
    let fx = fixture("tiny/parity.json");
    let bound = if testing_on_cuda() {
        MAX_QUANT_LOGPROB_DIFF_CUDA
    } else {
        MAX_QUANT_LOGPROB_DIFF
    };
    // every type is reported before the test fails
    let failures: Vec<String> = QUANTS
        .iter()
        .filter_map(|q| {
            let model = load_tiny(&format!("quant-{}", q.to_lowercase()));
            let result = compare(q, &model, fx["quants"][*q].as_array().unwrap());
            mismatch(&format!("{q} ({})", model.desc), result, bound)
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_family_is_batch_invariant() {
    for arch in ARCHS {
        let model = tiny(arch);
        let cases = cases(arch);
        let target: Vec<u32> = {
            let c = cases.last().unwrap();
            let mut t = ids(&c["prompt"]);
            t.extend(ids(&c["tokens"]));
            t
        };
        let expected = alone(&model, &target);

        // seven other sequences with caches of different lengths, then one forward that
        // mixes their next tokens with the whole target prompt
        let mut c = ctx(&model, 512, 8);
        let others: Vec<Vec<u32>> = cases
            .iter()
            .cycle()
            .take(7)
            .map(|c| {
                let mut t = ids(&c["prompt"]);
                t.extend(ids(&c["tokens"]));
                t
            })
            .collect();
        for (s, o) in others.iter().enumerate() {
            let n = 2 + 3 * s;
            c.decode(&Batch::for_sequence(&o[..n], 0, s + 1)).unwrap();
        }
        let mut b = Batch::with_capacity(64);
        for (i, &t) in target.iter().enumerate() {
            b.push(t, i, 0, true);
            if i < others.len() {
                let n = 2 + 3 * i;
                b.push(others[i][n], n, i + 1, true);
            }
        }
        c.decode(&b).unwrap();
        let mut row = 0;
        for (i, want) in expected.iter().enumerate() {
            let got = c.logits_ith(row as i64).unwrap();
            assert!(
                rel_close(want, got) < 1e-5,
                "{arch}: position {i} differs inside the batch ({})",
                rel_close(want, got)
            );
            row += if i < others.len() { 2 } else { 1 };
        }
    }
}

#[test]
fn unsupported_features_are_named_errors() {
    let load = |name: &str| {
        Model::load(
            &fixtures_dir().join(format!("tiny/{name}.gguf")),
            &LoadOptions::default(),
        )
        .err()
        .map(|e| e.to_string())
    };
    assert_eq!(
        load("refuse-extra-tensor").as_deref(),
        Some("unsupported tensor: blk.0.ffn_gate.bias (the architecture does not use it)")
    );
    assert_eq!(
        load("refuse-yarn").as_deref(),
        Some("unsupported rope scaling: yarn (llama.rope.scaling.type)")
    );
    // linear scaling is implemented (positions × 1/factor)
    assert_eq!(load("linear-rope"), None);
}
