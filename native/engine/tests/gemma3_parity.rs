//! Gemma 3 against llama.cpp's greedy fixture (teacher forced), batch invariance, and the
//! sliding-window KV groups.

mod common;
use common::*;
use llama_cpp_ex_engine::{Batch, Requantize};

const FIXTURE: &str = "greedy_gemma-3-270m-q4_k_m.json";

#[test]
fn gemma3_greedy_parity_native_types() {
    let model = load(GEMMA3, Requantize::Off);
    let rates = teacher_forced(&model, FIXTURE);
    assert_parity("Gemma 3 (file types)", &rates, REQUIRED_AGREEMENT);
}

/// A sequence longer than the 512-token window, evaluated in one batch and then again in
/// chunks (so sliding-window blocks are dropped between chunks), gives the same logits; and a
/// decode step batched with other sequences equals the same step alone.
#[test]
fn gemma3_sliding_window_and_batch_invariance() {
    let model = load(GEMMA3, Requantize::Q8_0);
    let tok = &model.tokenizer;
    let text =
        "The history of computing is longer than the history of computing hardware. ".repeat(60);
    let mut ids = tok.encode(&text, true, true).unwrap();
    ids.truncate(700);
    assert_eq!(ids.len(), 700);

    let mut whole = ctx(&model, 2048, 4);
    whole.decode(&Batch::for_sequence(&ids, 0, 0)).unwrap();
    let reference = whole.logits_ith(-1).unwrap().to_vec();

    let mut chunked = ctx(&model, 2048, 4);
    for (i, chunk) in ids.chunks(128).enumerate() {
        chunked
            .decode(&Batch::for_sequence(chunk, i * 128, 0))
            .unwrap();
    }
    assert!(rel_close(&reference, chunked.logits_ith(-1).unwrap()) <= 1e-3);
    let usage = chunked.kv_usage();
    // window layers keep ~512 positions (+ partial blocks), global layers all 700
    assert_eq!(usage.used.len(), 2);
    assert!(usage.used[0] < usage.used[1], "{usage:?}");
    chunked.kv.audit().unwrap();

    // decode step alone vs batched with a prefill and another decode
    let next = argmax(&reference);
    whole.decode(&Batch::for_sequence(&[next], 700, 0)).unwrap();
    let alone = whole.logits_ith(-1).unwrap().to_vec();
    let other = tok
        .encode("Once upon a time, there was a", true, true)
        .unwrap();
    chunked
        .decode(&Batch::for_sequence(&other[..3], 0, 1))
        .unwrap();
    let mut b = Batch::with_capacity(16);
    b.push(other[3], 3, 1, true);
    b.push(next, 700, 0, true);
    for (i, &t) in other.iter().enumerate() {
        b.push(t, i, 2, i + 1 == other.len());
    }
    chunked.decode(&b).unwrap();
    assert!(rel_close(&alone, chunked.logits_ith(1).unwrap()) <= 1e-3);
    chunked.kv.audit().unwrap();
}

#[test]
fn gemma3_greedy_parity_everything_q8_0() {
    let model = load(GEMMA3, Requantize::AllQ8_0);
    let rates = teacher_forced(&model, FIXTURE);
    assert_parity("Gemma 3 (every matrix re-quantized to Q8_0)", &rates, 0.95);
}
