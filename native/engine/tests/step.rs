//! The step API the Server and local generation run on, and the engine thread that runs the
//! Server's steps: KV edits in order, one batched forward pass, per-sequence sampling.

mod common;
use common::*;
use llama_cpp_ex_engine::sampler::SamplerSpec;
use llama_cpp_ex_engine::{
    Batch, Context, EngineThread, KvOp, Requantize, SamplerParams, SharedSampler, Step, StepOutcome,
};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

fn sampler(model: &llama_cpp_ex_engine::Model, params: SamplerParams) -> SharedSampler {
    let spec = SamplerSpec {
        params,
        seed: Some(1),
        grammar: None,
        grammar_triggers: Vec::new(),
        dry_sequence_breakers: Vec::new(),
    };
    Arc::new(Mutex::new(model.sampler(&spec).unwrap()))
}

fn greedy(model: &llama_cpp_ex_engine::Model) -> SharedSampler {
    sampler(model, SamplerParams::greedy())
}

/// A step of one follow entry per `(seq, pos, sampler)`, its tokens placeholders.
fn follow_step(rows: &[(usize, usize, &SharedSampler)]) -> Step {
    let mut batch = Batch::default();
    for &(seq, pos, _) in rows {
        batch.push(0, pos, seq, true);
    }
    Step {
        batch,
        samplers: rows.iter().map(|&(seq, _, s)| (seq, s.clone())).collect(),
        follow: rows.iter().map(|&(seq, _, _)| seq).collect(),
        ..Default::default()
    }
}

fn prefill(tokens: &[u32], seq: usize) -> Batch {
    Batch::for_sequence(tokens, 0, seq)
}

/// Greedy continuation of `prompt` alone on a fresh context, `n` tokens.
fn alone(model: &Arc<llama_cpp_ex_engine::Model>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut c = ctx(model, 256, 1);
    let sampler = greedy(model);
    let mut out = Vec::new();
    let mut step = Step {
        batch: prefill(prompt, 0),
        samplers: vec![(0, sampler.clone())],
        ..Default::default()
    };
    for i in 0..n {
        let o = c.step(&step).unwrap();
        let t = o.sampled[0].token;
        out.push(t);
        step.batch = Batch::for_sequence(&[t], prompt.len() + i, 0);
    }
    out
}

#[test]
fn a_step_samples_every_sequence_as_it_would_alone() {
    let model = load(SMOLLM2, Requantize::Off);
    let tok = &model.tokenizer;
    let a = tok.encode("The capital of France is", true, true).unwrap();
    let b = tok.encode("Once upon a time", true, true).unwrap();
    let want_a = alone(&model, &a, 4);
    let want_b = alone(&model, &b, 4);

    let mut c = ctx(&model, 256, 2);
    let (sa, sb) = (greedy(&model), greedy(&model));
    let mut batch = prefill(&a, 0);
    for (i, &t) in b.iter().enumerate() {
        batch.push(t, i, 1, i + 1 == b.len());
    }
    let mut step = Step {
        batch,
        samplers: vec![(0, sa), (1, sb)],
        ..Default::default()
    };
    let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
    for i in 0..4 {
        let o = c.step(&step).unwrap();
        assert_eq!(o.sampled.len(), 2);
        assert!(o.purged.is_empty() && o.failed.is_empty());
        let ta = o.sampled.iter().find(|s| s.seq == 0).unwrap().token;
        let tb = o.sampled.iter().find(|s| s.seq == 1).unwrap().token;
        // the piece is the token's text
        assert_eq!(
            o.sampled[0].piece,
            tok.token_to_piece(o.sampled[0].token).unwrap()
        );
        got_a.push(ta);
        got_b.push(tb);
        let mut next = Batch::default();
        next.push(ta, a.len() + i, 0, true);
        next.push(tb, b.len() + i, 1, true);
        step.batch = next;
    }
    assert_eq!(got_a, want_a);
    assert_eq!(got_b, want_b);
}

#[test]
fn a_follow_entry_feeds_what_the_step_before_sampled() {
    let model = load(SMOLLM2, Requantize::Off);
    let tok = &model.tokenizer;
    let a = tok.encode("The capital of France is", true, true).unwrap();
    let b = tok.encode("Once upon a time", true, true).unwrap();
    let (want_a, want_b) = (alone(&model, &a, 5), alone(&model, &b, 5));

    let mut c = ctx(&model, 256, 3);
    let (sa, sb) = (greedy(&model), greedy(&model));
    let mut batch = prefill(&a, 0);
    for (i, &t) in b.iter().enumerate() {
        batch.push(t, i, 1, i + 1 == b.len());
    }
    let o = c
        .step(&Step {
            batch,
            samplers: vec![(0, sa.clone()), (1, sb.clone())],
            ..Default::default()
        })
        .unwrap();
    let (mut got_a, mut got_b) = (vec![o.sampled[0].token], vec![o.sampled[1].token]);
    // every later step is built without the tokens: placeholders the engine fills in
    for i in 0..4 {
        let o = c
            .step(&follow_step(&[
                (0, a.len() + i, &sa),
                (1, b.len() + i, &sb),
            ]))
            .unwrap();
        got_a.push(o.sampled.iter().find(|s| s.seq == 0).unwrap().token);
        got_b.push(o.sampled.iter().find(|s| s.seq == 1).unwrap().token);
    }
    assert_eq!(got_a, want_a);
    assert_eq!(got_b, want_b);

    // a sequence the step before sampled nothing for is left out, the others still run
    let o = c
        .step(&follow_step(&[
            (0, a.len() + 4, &sa),
            (2, 0, &greedy(&model)),
        ]))
        .unwrap();
    assert_eq!(o.sampled.len(), 1);
    assert_eq!(o.sampled[0].seq, 0);
    assert_eq!(c.kv.seq_len(2), 0);
    // an end-of-generation token is not fed
    let eog = tok.eog_tokens()[0];
    let mut params = SamplerParams::greedy();
    params.logit_bias = vec![(eog, 1e9)];
    let ending = sampler(&model, params);
    let o = c
        .step(&Step {
            batch: prefill(&b, 2),
            samplers: vec![(2, ending.clone())],
            ..Default::default()
        })
        .unwrap();
    assert!(o.sampled[0].is_eog);
    let o = c.step(&follow_step(&[(2, b.len(), &ending)])).unwrap();
    assert!(o.sampled.is_empty());
    assert_eq!(c.kv.seq_len(2), b.len());
    // after a step that failed, no entry follows it
    assert!(c
        .step(&Step {
            ops: vec![KvOp::Trim { seq: 9, keep: 0 }],
            ..Default::default()
        })
        .is_err());
    let o = c.step(&follow_step(&[(0, a.len() + 5, &sa)])).unwrap();
    assert!(o.sampled.is_empty());
    assert_eq!(c.kv.seq_len(0), a.len() + 5);
}

#[test]
fn kv_ops_apply_in_order_before_the_batch() {
    let model = load(SMOLLM2, Requantize::Off);
    let tok = &model.tokenizer;
    let prompt = tok
        .encode("The quick brown fox jumps over the lazy dog", true, true)
        .unwrap();
    let mut c = ctx(&model, 256, 3);
    c.step(&Step {
        batch: prefill(&prompt, 0),
        ..Default::default()
    })
    .unwrap();
    let n = prompt.len();
    // share seq 0's prefix with seq 1, trim seq 1, and continue it: its next token must be the
    // one seq 0 would produce at that point
    let keep = n - 2;
    let sampler = greedy(&model);
    let out = c
        .step(&Step {
            ops: vec![
                KvOp::Share {
                    src: 0,
                    dst: 1,
                    len: n,
                },
                KvOp::Trim { seq: 1, keep },
                KvOp::Clear { seq: 2 },
            ],
            batch: Batch::for_sequence(&prompt[keep..], keep, 1),
            samplers: vec![(1, sampler)],
            ..Default::default()
        })
        .unwrap();
    assert_eq!(c.kv.seq_len(1), n);
    assert_eq!(out.sampled[0].token, alone(&model, &prompt, 1)[0]);
    c.kv.audit().unwrap();
    // shared blocks, copied only where seq 1 wrote
    let blocks = |s| c.kv_usage().owners[0].iter().find(|o| o.0 == s).unwrap().1;
    assert_eq!(blocks(0), blocks(1));
}

#[test]
fn a_sequence_past_n_ctx_fails_alone() {
    let model = load(SMOLLM2, Requantize::Off);
    let mut c = ctx(&model, 32, 2);
    let long: Vec<u32> = (0..40).map(|i| 100 + i).collect();
    let mut batch = prefill(&long, 0);
    batch.push(7, 0, 1, true);
    let sampler = greedy(&model);
    let o = c
        .step(&Step {
            batch,
            samplers: vec![(1, sampler)],
            ..Default::default()
        })
        .unwrap();
    assert_eq!(o.failed, vec![0]);
    assert_eq!(o.sampled.len(), 1);
    assert_eq!(c.kv.seq_len(0), 0);
    assert_eq!(c.kv.seq_len(1), 1);
    c.kv.audit().unwrap();
}

#[test]
fn the_engine_thread_runs_steps_in_order_and_survives_errors() {
    let model = load(SMOLLM2, Requantize::Off);
    let c = Arc::new(Mutex::new(ctx(&model, 256, 1)));
    let engine = EngineThread::start(c.clone()).unwrap();
    let (tx, rx) = mpsc::channel::<(usize, Result<StepOutcome, String>)>();
    let reply = |i: usize| {
        let tx = tx.clone();
        Box::new(move |r: llama_cpp_ex_engine::error::Result<StepOutcome>| {
            let _ = tx.send((i, r.map_err(|e| e.to_string())));
        }) as llama_cpp_ex_engine::engine_thread::Reply
    };
    let prompt = model.tokenizer.encode("Hello there", true, true).unwrap();
    let sampler = greedy(&model);
    engine
        .submit(
            Step {
                batch: prefill(&prompt, 0),
                samplers: vec![(0, sampler.clone())],
                ..Default::default()
            },
            reply(0),
        )
        .unwrap();
    // a position that does not continue the sequence: this step fails
    engine
        .submit(
            Step {
                batch: Batch::for_sequence(&[5], 99, 0),
                ..Default::default()
            },
            reply(1),
        )
        .unwrap();
    engine
        .submit(
            Step {
                batch: Batch::for_sequence(&[5], prompt.len(), 0),
                samplers: vec![(0, sampler)],
                ..Default::default()
            },
            reply(2),
        )
        .unwrap();
    let wait = || rx.recv_timeout(Duration::from_secs(60)).unwrap();
    let (i0, r0) = wait();
    let (i1, r1) = wait();
    let (i2, r2) = wait();
    assert_eq!((i0, i1, i2), (0, 1, 2));
    assert_eq!(r0.unwrap().sampled.len(), 1);
    assert!(r1.unwrap_err().contains("does not continue"));
    assert_eq!(r2.unwrap().sampled.len(), 1);
    engine.stop();
    assert!(engine.submit(Step::default(), Box::new(|_| {})).is_err());
    assert_eq!(c.lock().unwrap().kv.seq_len(0), prompt.len() + 1);
}

#[test]
fn the_context_is_usable_directly_too() {
    // Context::step with an empty batch only edits the cache
    let model = load(SMOLLM2, Requantize::Off);
    let mut c: Context = ctx(&model, 64, 1);
    c.step(&Step {
        batch: prefill(&[1, 2, 3], 0),
        ..Default::default()
    })
    .unwrap();
    let o = c
        .step(&Step {
            ops: vec![KvOp::Trim { seq: 0, keep: 1 }],
            ..Default::default()
        })
        .unwrap();
    assert!(o.sampled.is_empty());
    assert_eq!(c.kv.seq_len(0), 1);
}

#[test]
fn decode_tokens_is_all_or_nothing() {
    let model = load(SMOLLM2, Requantize::Off);
    let mut c = ctx(&model, 64, 1);
    // one more than n_ctx: refused before any evaluation, the cache untouched
    let err = c.decode_tokens(&[42; 65], 0).unwrap_err().to_string();
    assert!(err.contains("exceed n_ctx 64"), "{err}");
    assert_eq!(c.kv.seq_len(0), 0);
    // 64 fit (in several n_batch chunks when n_batch is smaller), then nothing more
    c.decode_tokens(&[42; 30], 0).unwrap();
    c.decode_tokens(&[42; 34], 0).unwrap();
    assert_eq!(c.kv.seq_len(0), 64);
    assert!(c.decode_tokens(&[42], 0).is_err());
    assert_eq!(c.kv.seq_len(0), 64);
    assert!(c.decode_tokens(&[], 0).is_err());
    assert!(c.decode_tokens(&[42], 1).is_err());
}

/// The level-2 prompt cache's primitives: a saved prefix restored into another sequence
/// continues exactly as the original, a purge can keep a copy, and a restore that cannot fit
/// leaves only its own sequence out of the step.
#[test]
fn saved_prefixes_restore_and_continue_exactly() {
    let model = load(SMOLLM2, Requantize::Off);
    let prompt = model
        .tokenizer
        .encode(
            &"The capital of France is Paris, and the capital of Italy is Rome. ".repeat(5),
            true,
            true,
        )
        .unwrap();
    let n = prompt.len();
    // the small cache below (n_ctx n + 1, one spare block per sequence) holds one prompt, not two
    assert!(n > 4 * 16, "{n} tokens");
    let want = alone(&model, &prompt, 1)[0];
    let mut c = ctx(&model, 256, 3);
    c.step(&Step {
        batch: prefill(&prompt, 0),
        ..Default::default()
    })
    .unwrap();
    // too small a budget copies nothing; a large one copies every block
    let o = c
        .step(&Step {
            ops: vec![
                KvOp::Save {
                    seq: 0,
                    len: n,
                    max_bytes: 1000,
                    tag: 6,
                },
                KvOp::Save {
                    seq: 0,
                    len: n,
                    max_bytes: usize::MAX,
                    tag: 7,
                },
                KvOp::Clear { seq: 0 },
            ],
            ..Default::default()
        })
        .unwrap();
    assert_eq!(o.saved.len(), 1);
    let (seq, tag, snap) = o.saved[0].clone();
    assert_eq!((seq, tag, snap.len()), (0, 7, n));
    assert_eq!(c.kv.seq_len(0), 0);
    let out = c
        .step(&Step {
            ops: vec![KvOp::Restore {
                seq: 1,
                snapshot: snap.clone(),
                len: n - 1,
            }],
            batch: Batch::for_sequence(&prompt[n - 1..], n - 1, 1),
            samplers: vec![(1, greedy(&model))],
            ..Default::default()
        })
        .unwrap();
    assert_eq!(out.sampled[0].token, want);
    assert_eq!(c.kv.seq_len(1), n);
    c.kv.audit().unwrap();

    // a cache just big enough for one prompt: a new prompt on seq 2 purges seq 1 (copied)
    let mut small = ctx(&model, n + 1, 3);
    small
        .step(&Step {
            batch: prefill(&prompt, 1),
            ..Default::default()
        })
        .unwrap();
    let o = small
        .step(&Step {
            batch: prefill(&prompt, 2),
            purgeable: vec![1],
            save_purged_max_bytes: usize::MAX,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(o.purged, vec![1]);
    assert_eq!((o.saved[0].0, o.saved[0].1, o.saved[0].2.len()), (1, 0, n));
    // restoring into seq 0 purges seq 2 (copied) and continues
    let o = small
        .step(&Step {
            ops: vec![KvOp::Restore {
                seq: 0,
                snapshot: o.saved[0].2.clone(),
                len: n - 1,
            }],
            batch: Batch::for_sequence(&prompt[n - 1..], n - 1, 0),
            samplers: vec![(0, greedy(&model))],
            purgeable: vec![2],
            save_purged_max_bytes: usize::MAX,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(o.purged, vec![2]);
    assert_eq!(o.saved.len(), 1);
    assert_eq!(o.sampled[0].token, want);
    // nothing left to purge: the restore fails alone, the other sequence is still evaluated
    let o = small
        .step(&Step {
            ops: vec![KvOp::Restore {
                seq: 1,
                snapshot: snap,
                len: n - 1,
            }],
            batch: {
                let mut b = Batch::for_sequence(&prompt[n - 1..], n - 1, 1);
                b.push(want, n, 0, true);
                b
            },
            samplers: vec![(0, greedy(&model)), (1, greedy(&model))],
            ..Default::default()
        })
        .unwrap();
    assert_eq!(o.restore_failed, vec![1]);
    assert_eq!(o.sampled.len(), 1);
    assert_eq!(o.sampled[0].seq, 0);
    assert_eq!(small.kv.seq_len(1), 0);
    small.kv.audit().unwrap();
}
