//! Decoder-model embeddings against llama.cpp's `llama-embedding` (mean, last and first-token
//! pooling, L2-normalised) on both real models, and a batch of texts equal to each text alone.

mod common;
use common::*;
use llama_cpp_ex_engine::embedding::{embed, Pooling};
use llama_cpp_ex_engine::Requantize;

fn cosine(a: &[f32], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * y).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[test]
fn decoder_embeddings_match_llama_cpp() {
    let fx = fixture("embeddings.json");
    let texts: Vec<&str> = fx["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    for (name, file) in [("smollm2", SMOLLM2), ("gemma3", GEMMA3)] {
        let model = load(file, Requantize::Off);
        let ids: Vec<Vec<u32>> = texts
            .iter()
            .map(|t| model.tokenizer.encode(t, true, true).unwrap())
            .collect();
        for (pname, pooling) in [
            ("mean", Pooling::Mean),
            ("last", Pooling::Last),
            ("cls", Pooling::Cls),
        ] {
            let ours = embed(&model, &ids, pooling, 2, 512, 2).unwrap();
            let theirs = fx["models"][name][pname].as_array().unwrap();
            for (i, (o, t)) in ours.iter().zip(theirs).enumerate() {
                let t: Vec<f64> = t
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect();
                let c = cosine(o, &t);
                println!("{name} {pname} text {i}: cosine {c:.6}");
                // Gemma 3's hidden states carry a few very large dimensions, and the engine's
                // K-quant kernels quantize activations per 32 values where ggml uses Q8_K
                // blocks of 256: measured cosine 0.9959-0.9994 (0.9987-0.9997 on candle's
                // kernels); SmolLM2 0.9997-0.99999.
                let bound = if name == "gemma3" { 0.995 } else { 0.999 };
                assert!(c >= bound, "{name} {pname} text {i}: cosine {c}");
                let norm: f32 = o.iter().map(|x| x * x).sum::<f32>().sqrt();
                assert!((norm - 1.0).abs() < 1e-4);
            }
            // one text alone equals the same text inside the batch
            for (i, t) in ids.iter().enumerate() {
                let alone = embed(&model, std::slice::from_ref(t), pooling, 2, 512, 2).unwrap();
                let c = cosine(
                    &alone[0],
                    &ours[i].iter().map(|x| *x as f64).collect::<Vec<_>>(),
                );
                assert!(c > 0.99999, "{name} {pname} text {i} alone vs batch: {c}");
            }
        }
    }
}

#[test]
fn bad_inputs_are_errors() {
    let model = load(SMOLLM2, Requantize::Off);
    assert!(embed(&model, &[vec![]], Pooling::Mean, 2, 512, 1).is_err());
    assert!(embed(&model, &[vec![1; 600]], Pooling::Mean, 2, 512, 1).is_err());
    let none = embed(&model, &[vec![1, 2, 3]], Pooling::None, 2, 512, 1).unwrap();
    assert_eq!(none[0].len(), 3 * model.config.n_embd);
}
