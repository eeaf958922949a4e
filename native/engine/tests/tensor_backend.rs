//! The GPU's code path (the decoder on candle tensors, its keys and values in device memory
//! at the host cache's block ids) against the engine's CPU kernels: shared prefixes and
//! copy-on-write, sliding windows past their length, embedding rows, and what it refuses.
//! It runs on candle's CPU device here, on GPU 0 with `LLAMA_CPP_EX_TEST_BACKEND=cuda` in a
//! `cuda` build (`scripts/gpu_check.sh`). Parity with llama.cpp on every architecture and
//! quantization type is `arch_parity` under `LLAMA_CPP_EX_TEST_BACKEND=tensor` / `cuda`.

mod common;
use common::*;
use llama_cpp_ex_engine::embedding::{embed, Pooling};
use llama_cpp_ex_engine::kv::KvType;
use llama_cpp_ex_engine::sampler::argmax;
use llama_cpp_ex_engine::{
    Backend, Batch, Context, ContextParams, DeviceCopies, LoadOptions, Model, Placement,
    Requantize, Sampler, SamplerParams, SharedSampler, Step,
};
use std::sync::{Arc, Mutex};

/// The device backend under test: `cuda` when asked, else candle's CPU device.
fn device_placement() -> Placement {
    if testing_on_cuda() {
        test_placement()
    } else {
        Placement::Backend(Backend::Tensor(candle_core::Device::Cpu))
    }
}

/// How closely two evaluations of the same rows in different batches agree on the device.
/// cuBLAS picks its f32 GEMM kernel by the number of rows, so on a GPU a row's rounding
/// depends on its batch (6.9e-5 measured on an H200); keys read from a block that was not
/// copied before a write differ by orders of magnitude more.
fn same_within() -> f32 {
    if testing_on_cuda() {
        1e-3
    } else {
        1e-5
    }
}

fn tiny_on(file: &str, placement: Placement) -> Arc<Model> {
    let opts = LoadOptions {
        requantize: Requantize::Off,
        vocab_only: false,
        placement,
    };
    let path = fixtures_dir().join(format!("tiny/{file}.gguf"));
    Arc::new(Model::load(&path, &opts).unwrap_or_else(|e| panic!("{file}: {e}")))
}

/// The same file on the CPU kernels and on the device path.
fn both(file: &str) -> (Arc<Model>, Arc<Model>) {
    let dev = tiny_on(file, device_placement());
    assert!(matches!(dev.backend, Backend::Tensor(_)));
    (tiny_on(file, Placement::default()), dev)
}

fn tokens(model: &Model, n: usize, salt: u32) -> Vec<u32> {
    let v = model.config.n_vocab as u32;
    (0..n as u32)
        .map(|i| (i * 7919 + salt * 104_729) % v)
        .collect()
}

/// The largest per-row `rel_close` of the two contexts' logits rows `rows`.
fn max_diff(a: &Context, b: &Context, rows: usize) -> f32 {
    (0..rows as i64)
        .map(|i| rel_close(a.logits_ith(i).unwrap(), b.logits_ith(i).unwrap()))
        .fold(0.0, f32::max)
}

/// Two sequences share a 20-token prefix (its second block half full), then each writes its
/// own tokens into that block: the device must copy the block before either writes, as the
/// host cache does. Both continuations equal the sequences evaluated alone.
#[test]
fn shared_prefixes_are_copied_on_write_in_device_memory() {
    let (_, model) = both("tiny-llama3-f32");
    let prefix = tokens(&model, 20, 1);
    let tails = [tokens(&model, 5, 2), tokens(&model, 5, 3)];
    let mut c = ctx(&model, 256, 2);
    c.decode(&Batch::for_sequence(&prefix, 0, 0)).unwrap();
    c.kv.seq_share_prefix(0, 1, prefix.len()).unwrap();
    let mut b = Batch::with_capacity(10);
    for (s, tail) in tails.iter().enumerate() {
        for (i, &t) in tail.iter().enumerate() {
            b.push(t, prefix.len() + i, s, true);
        }
    }
    c.decode(&b).unwrap();
    for (s, tail) in tails.iter().enumerate() {
        let mut all = prefix.clone();
        all.extend(tail);
        let alone = logits_all(&model, &all, 256);
        for i in 0..tail.len() {
            let got = c.logits_ith((s * tail.len() + i) as i64).unwrap();
            let d = rel_close(&alone[prefix.len() + i], got);
            assert!(d < same_within(), "sequence {s}, token {i}: {d}");
        }
    }
    c.kv.audit().unwrap();
}

/// Gemma 3's sliding-window layers (window 32 in the tiny file) keep only the blocks inside
/// the window; decoding one token at a time far past it matches the CPU kernels.
#[test]
fn sliding_windows_match_the_cpu_kernels_past_their_length() {
    let (cpu, dev) = both("tiny-gemma3-f32");
    let all = tokens(&cpu, 120, 4);
    let (mut a, mut b) = (ctx(&cpu, 256, 1), ctx(&dev, 256, 1));
    let mut prompt = Batch::with_capacity(40);
    for (i, &t) in all[..40].iter().enumerate() {
        prompt.push(t, i, 0, true);
    }
    for c in [&mut a, &mut b] {
        c.decode(&prompt).unwrap();
    }
    assert!(
        max_diff(&a, &b, 40) < 1e-3,
        "prompt: {}",
        max_diff(&a, &b, 40)
    );
    for (i, &t) in all.iter().enumerate().skip(40) {
        for c in [&mut a, &mut b] {
            let mut one = Batch::with_capacity(1);
            one.push(t, i, 0, true);
            c.decode(&one).unwrap();
        }
        let d = max_diff(&a, &b, 1);
        assert!(d < 1e-3, "position {i}: {d}");
    }
    // blocks fell out of the window on the host tables both backends share
    assert_eq!(a.kv_usage(), b.kv_usage());
}

/// Every family, a batch mixing a prompt with other sequences' decode steps: equal to the
/// CPU kernels' logits.
#[test]
fn every_family_matches_the_cpu_kernels_in_a_mixed_batch() {
    for arch in ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"] {
        let (cpu, dev) = both(&format!("tiny-{arch}-f32"));
        let (mut a, mut b) = (ctx(&cpu, 256, 4), ctx(&dev, 256, 4));
        let mut mixed = Batch::with_capacity(64);
        for s in 1..4 {
            let t = tokens(&cpu, 3 * s, s as u32);
            for c in [&mut a, &mut b] {
                c.decode(&Batch::for_sequence(&t, 0, s)).unwrap();
            }
            mixed.push(t[0], 3 * s, s, true);
        }
        for (i, t) in tokens(&cpu, 30, 9).into_iter().enumerate() {
            mixed.push(t, i, 0, true);
        }
        for c in [&mut a, &mut b] {
            c.decode(&mixed).unwrap();
        }
        let d = max_diff(&a, &b, mixed.len());
        assert!(d < 1e-3, "{arch}: {d}");
    }
}

/// Decode steps of one-token sequences, the steps a GPU may replay as CUDA graphs, match
/// the CPU kernels step after step. With `LLAMA_CPP_EX_CUDA_GRAPHS=1` (as `make test` runs
/// this file a second time) they run at a bucket's shapes — three rows padded to four, each
/// layer group's keys to 256 — so this checks that padding leaves the rows' results as they
/// are; on a GPU every step after each bucket's first replays its graph. Midway a fourth
/// sequence's prompt, longer than any pass before, grows candle's activation scratch on a
/// GPU: the graphs captured before it are dropped, and the next step is captured afresh
/// (the fourth sequence fills the padding row: the same bucket).
#[test]
fn decode_steps_match_the_cpu_kernels_step_after_step() {
    let graphs = std::env::var("LLAMA_CPP_EX_CUDA_GRAPHS").as_deref() == Ok("1");
    // (Gemma 3: a sliding-window layer group beside the global one)
    for arch in ["llama3", "gemma3"] {
        let (cpu, dev) = both(&format!("tiny-{arch}-f32"));
        let (mut a, mut b) = (ctx(&cpu, 256, 4), ctx(&dev, 256, 4));
        let prompt = |s: usize, n: usize, a: &mut Context, b: &mut Context| {
            let t = tokens(&cpu, n, s as u32);
            for c in [a, b] {
                c.decode(&Batch::for_sequence(&t, 0, s)).unwrap();
            }
            t.len()
        };
        let mut pos: Vec<usize> = (0..3)
            .map(|s| prompt(s, 4 + 3 * s, &mut a, &mut b))
            .collect();
        let before = b.device_copies();
        let steps = 6;
        for step in 0..steps {
            if step == 3 {
                pos.push(prompt(3, 40, &mut a, &mut b));
            }
            let mut batch = Batch::with_capacity(4);
            for (s, p) in pos.iter_mut().enumerate() {
                let salt = (20 + 3 * step + s) as u32;
                batch.push(tokens(&cpu, 1, salt)[0], *p, s, true);
                *p += 1;
            }
            for c in [&mut a, &mut b] {
                c.decode(&batch).unwrap();
            }
            let d = max_diff(&a, &b, batch.len());
            assert!(d < 1e-3, "{arch}, step {step}: {d}");
        }
        let after = b.device_copies();
        let (bucketed, replayed) = (
            after.bucketed - before.bucketed,
            after.replayed - before.replayed,
        );
        if graphs {
            assert_eq!(bucketed, steps, "{arch}");
            let want = if testing_on_cuda() { steps - 2 } else { 0 };
            assert_eq!(replayed, want, "{arch}");
        } else {
            assert_eq!((bucketed, replayed), (0, 0), "{arch}");
        }
    }
}

/// A pass sends what it staged — embeddings, rotary tables, every layer group's cache rows
/// and masks, the rows to bring back — in two copies (indices, values), and brings back only
/// the logits rows asked for: on a GPU each copy is a synchronous driver call, so their
/// number must not grow with the layers, layer groups, sequences or attention groups.
#[test]
fn a_pass_makes_two_copies_in_and_one_back() {
    // Gemma 3: a global and a sliding-window layer group, two rotary tables
    let model = tiny_on("tiny-gemma3-f32", device_placement());
    let mut c = ctx(&model, 256, 4);
    assert_eq!(c.device_copies(), DeviceCopies::default());
    let mut last = DeviceCopies::default();
    let mut pass = |c: &mut Context, b: &Batch| {
        c.decode(b).unwrap();
        let now = c.device_copies();
        let d = (now.to_device - last.to_device, now.to_host - last.to_host);
        last = now;
        d
    };
    // prompts, their last token's logits
    for s in 1..4 {
        let b = Batch::for_sequence(&tokens(&model, 3 * s, s as u32), 0, s);
        assert_eq!(pass(&mut c, &b), (2, 1), "prompt {s}");
    }
    // a prompt and three decode rows: two attention groups in each layer group
    let mut mixed = Batch::with_capacity(32);
    for s in 1..4 {
        mixed.push(tokens(&model, 1, 7)[0], 3 * s, s, true);
    }
    for (i, t) in tokens(&model, 20, 9).into_iter().enumerate() {
        mixed.push(t, i, 0, i == 19);
    }
    assert_eq!(pass(&mut c, &mixed), (2, 1));
    // no logits asked for: nothing comes back
    let mut quiet = Batch::with_capacity(1);
    quiet.push(tokens(&model, 1, 8)[0], 20, 0, false);
    assert_eq!(pass(&mut c, &quiet), (2, 0));
}

/// A context of four sequences, each after a prompt of its own (5 to 8 tokens).
fn prompted(model: &Arc<Model>) -> Context {
    let mut c = ctx(model, 256, 4);
    for s in 0..4 {
        let b = Batch::for_sequence(&tokens(model, 5 + s, s as u32), 0, s);
        c.decode(&b).unwrap();
    }
    c
}

/// A step's greedy rows (no grammar, bias, penalties or log-probabilities) come back as
/// their token's id alone: the token the host's greedy rule picks from the whole row. A row
/// whose sampler reads more (here log-probabilities) comes back whole, bitwise the row
/// `decode` brings back, in the same single copy.
#[test]
fn greedy_rows_bring_back_only_their_token() {
    let model = tiny_on("tiny-llama3-f32", device_placement());
    let n_vocab = model.config.n_vocab;
    let mut next = Batch::with_capacity(4);
    for s in 0..4 {
        next.push(tokens(&model, 1, 10 + s as u32)[0], 5 + s, s, true);
    }
    // the whole rows, through `decode`
    let mut whole = prompted(&model);
    whole.decode(&next).unwrap();
    let want: Vec<u32> = (0..4)
        .map(|i| argmax(whole.logits_ith(i).unwrap()) as u32)
        .collect();

    let mut c = prompted(&model);
    let sampler = |logprobs| {
        Arc::new(Mutex::new(Sampler::new(SamplerParams {
            logprobs,
            ..SamplerParams::greedy()
        })))
    };
    let samplers: Vec<(usize, SharedSampler)> = (0..4)
        .map(|s| (s, sampler((s == 3).then_some(2))))
        .collect();
    let before = c.device_copies();
    let step = Step {
        batch: next.clone(),
        samplers: samplers.clone(),
        ..Default::default()
    };
    let out = c.step(&step).unwrap();
    let after = c.device_copies();
    let got: Vec<u32> = out.sampled.iter().map(|t| t.token).collect();
    assert_eq!(got, want);
    assert!(out.sampled[3].logprobs.is_some());
    assert_eq!(after.to_host - before.to_host, 1);
    assert_eq!(
        after.bytes_to_host - before.bytes_to_host,
        4 * (n_vocab + 3)
    );
    assert_eq!(c.logits_ith(3).unwrap(), whole.logits_ith(3).unwrap());
    assert!(c.logits_ith(0).is_err(), "a picked row has no logits");

    // every row greedy: four ids come back
    let mut again = Batch::with_capacity(4);
    for (s, t) in got.iter().enumerate() {
        again.push(*t, 6 + s, s, true);
    }
    let greedy: Vec<(usize, SharedSampler)> = (0..4).map(|s| (s, sampler(None))).collect();
    let before = c.device_copies();
    let out = c
        .step(&Step {
            batch: again.clone(),
            samplers: greedy,
            ..Default::default()
        })
        .unwrap();
    let after = c.device_copies();
    assert_eq!(after.bytes_to_host - before.bytes_to_host, 16);
    whole.decode(&again).unwrap();
    for (i, t) in out.sampled.iter().enumerate() {
        let row = whole.logits_ith(i as i64).unwrap();
        assert_eq!(t.token, argmax(row) as u32, "row {i}");
    }
}

/// Whether `LLAMA_CPP_EX_CUDA_KERNELS` turns on the kernel `name`.
fn kernel_on(name: &str) -> bool {
    let v = std::env::var("LLAMA_CPP_EX_CUDA_KERNELS").unwrap_or_default();
    v.split(',')
        .map(str::trim)
        .any(|k| k == name || k == "all" || k == "1")
}

/// A step's sampled rows whose top-k keeps at most the window's candidates (here llama.cpp's
/// default chain: top-k 40, top-p, min-p, temperature) come back as their 64 best
/// candidates where the candidates kernel is on, and draw the tokens a twin context draws
/// from whole rows (the same samplers reporting log-probabilities, which need the row): all
/// rows sampled (a bucketed step under graphs), then greedy, whole and sampled rows mixed.
#[test]
fn sampled_rows_bring_back_their_best_candidates() {
    let on = kernel_on("candidates");
    let graphs = std::env::var("LLAMA_CPP_EX_CUDA_GRAPHS").as_deref() == Ok("1");
    let model = tiny_on("tiny-llama3-f32", device_placement());
    let n_vocab = model.config.n_vocab;
    let (mut c, mut twin) = (prompted(&model), prompted(&model));
    let mut next: Vec<u32> = (0..4).map(|s| tokens(&model, 1, 30 + s)[0]).collect();
    let mut pos: Vec<usize> = (0..4).map(|s| 5 + s).collect();
    // per phase, each sequence's top-k (0: greedy); 100 is past the window
    for (phase, top_ks) in [[40, 40, 40, 40], [0, 40, 100, 5]].iter().enumerate() {
        let params = |s: usize, logprobs| {
            let base = if top_ks[s] == 0 {
                SamplerParams::greedy()
            } else {
                SamplerParams {
                    seed: 7 + s as u64,
                    temp: 1.5,
                    top_k: top_ks[s],
                    ..Default::default()
                }
            };
            // the twin's sampled rows come back whole (its greedy row as an id, like ours)
            let logprobs = logprobs && top_ks[s] > 0;
            Arc::new(Mutex::new(Sampler::new(SamplerParams {
                logprobs: logprobs.then_some(1),
                ..base
            })))
        };
        let ours: Vec<(usize, SharedSampler)> = (0..4).map(|s| (s, params(s, false))).collect();
        let theirs: Vec<(usize, SharedSampler)> = (0..4).map(|s| (s, params(s, true))).collect();
        let (steps, before) = (4, c.device_copies());
        for step in 0..steps {
            let mut batch = Batch::with_capacity(4);
            for s in 0..4 {
                batch.push(next[s], pos[s], s, true);
                pos[s] += 1;
            }
            let run = |c: &mut Context, samplers: &[(usize, SharedSampler)]| {
                let out = c
                    .step(&Step {
                        batch: batch.clone(),
                        samplers: samplers.to_vec(),
                        ..Default::default()
                    })
                    .unwrap();
                out.sampled.iter().map(|t| t.token).collect::<Vec<u32>>()
            };
            let copied = c.device_copies().bytes_to_host;
            let got = run(&mut c, &ours);
            let copied = c.device_copies().bytes_to_host - copied;
            let want = run(&mut twin, &theirs);
            assert_eq!(got, want, "phase {phase}, step {step}");
            let rows: usize = top_ks
                .iter()
                .map(|&k| match k {
                    0 => 1,
                    k if k <= 64 && on => 2 * 64,
                    _ => n_vocab,
                })
                .sum();
            assert_eq!(copied, 4 * rows, "phase {phase}, step {step}");
            next = got;
        }
        let after = c.device_copies();
        let bucketed = after.bucketed - before.bucketed;
        let replayed = after.replayed - before.replayed;
        if graphs && phase == 0 {
            assert_eq!(bucketed, steps);
            assert_eq!(replayed, if testing_on_cuda() { steps - 1 } else { 0 });
        } else {
            // mixed kinds of rows run at their own shapes
            assert_eq!((bucketed, replayed), (0, 0), "phase {phase}");
        }
    }
}

/// EmbeddingGemma on the device path equals llama.cpp's vectors (bidirectional attention,
/// symmetric windows, pooling and the dense projections on the host).
#[test]
fn embeddings_match_llama_cpp() {
    let model = tiny_on("tiny-gemma-embedding-f32", device_placement());
    let fx = &fixture("tiny/bert.json")["gemma_embedding"];
    let ids: Vec<Vec<u32>> = strs(&fx["texts"])
        .iter()
        .map(|t| model.tokenizer.encode(t, true, true).unwrap())
        .collect();
    let ours = embed(&model, &ids, Pooling::Mean, 2, 256, 1).unwrap();
    for (o, t) in ours.iter().zip(fx["embeddings"].as_array().unwrap()) {
        let c = cosine(o, &floats(t));
        assert!(c > 0.9999, "cosine {c}");
    }
}

/// What the device cache cannot do is an error, not a silent substitute.
#[test]
fn other_kv_types_and_snapshots_are_refused_and_encoders_stay_on_the_cpu() {
    let model = tiny_on("tiny-llama-f32", device_placement());
    let params = |k| ContextParams {
        n_ctx: 64,
        kv_type: k,
        ..Default::default()
    };
    let err = Context::new(model.clone(), params(KvType::F32))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("other than f16"), "{err}");
    let mut c = Context::new(model.clone(), params(KvType::F16)).unwrap();
    c.decode(&Batch::for_sequence(&[1, 2, 3], 0, 0)).unwrap();
    let err = c.kv.snapshot(0, 3).unwrap_err().to_string();
    assert!(err.contains("GPU memory"), "{err}");
    let opts = LoadOptions {
        placement: device_placement(),
        ..Default::default()
    };
    // an encoder has no device path: it runs on the CPU kernels whatever the placement
    let bert = Model::load(&fixtures_dir().join("tiny/tiny-bert-f32.gguf"), &opts).unwrap();
    assert!(matches!(bert.backend, Backend::Cpu));
}
