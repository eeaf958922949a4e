//! Attention past one segment (256 KV slots): a decoding token's logits are bitwise the same
//! whether its attention runs one task per segment (a lone sequence on 2 threads), one task
//! per KV head (1 thread, or a batch of 8 sequences), or inside a prompt.

mod common;
use common::*;
use llama_cpp_ex_engine::{Batch, Context, ContextParams, Model, Requantize};
use std::sync::Arc;

const PROMPT: usize = 700;

fn context(model: &Arc<Model>, threads: usize, n_seq: usize) -> Context {
    Context::new(
        model.clone(),
        ContextParams {
            n_ctx: 2048,
            n_batch: 1024,
            n_seq_max: n_seq,
            n_threads: threads,
            n_threads_batch: threads,
            ..Default::default()
        },
    )
    .unwrap()
}

fn tokens() -> Vec<u32> {
    (0..PROMPT as u32 + 1).map(|i| 300 + i * 7 % 1000).collect()
}

/// The logits of the token after the prompt, decoded alone with `threads` threads.
fn decoded_alone(model: &Arc<Model>, threads: usize) -> Vec<f32> {
    let t = tokens();
    let mut c = context(model, threads, 1);
    c.decode(&Batch::for_sequence(&t[..PROMPT], 0, 0)).unwrap();
    c.decode(&Batch::for_sequence(&t[PROMPT..], PROMPT, 0))
        .unwrap();
    c.logits_ith(0).unwrap().to_vec()
}

fn check(file: &str) {
    let model = load(file, Requantize::Off);
    let t = tokens();
    let split = decoded_alone(&model, 2);
    assert_eq!(
        split,
        decoded_alone(&model, 1),
        "{file}: one task per segment vs per KV head"
    );

    // in a batch with 7 other sequences decoding at other positions
    let mut c = context(&model, 2, 8);
    c.decode(&Batch::for_sequence(&t[..PROMPT], 0, 0)).unwrap();
    for s in 1..8 {
        c.decode(&Batch::for_sequence(&t[..40 * s], 0, s)).unwrap();
    }
    let mut b = Batch::default();
    for s in 1..8 {
        b.push(t[40 * s], 40 * s, s, true);
    }
    b.push(t[PROMPT], PROMPT, 0, true);
    c.decode(&b).unwrap();
    assert_eq!(
        split,
        c.logits_ith(7).unwrap(),
        "{file}: alone vs in a batch of 8"
    );

    // the last token of a prompt (query tiles of 32 tokens)
    let mut c = context(&model, 2, 1);
    c.decode(&Batch::for_sequence(&t, 0, 0)).unwrap();
    let row = c.logits_ith(-1).unwrap();
    let diff = rel_close(&split, row);
    assert!(diff <= 1e-3, "{file}: decode vs prompt: {diff}");
}

#[test]
fn smollm2_long_context_is_invariant() {
    check(SMOLLM2);
}

#[test]
fn gemma3_long_context_is_invariant() {
    check(GEMMA3);
}
