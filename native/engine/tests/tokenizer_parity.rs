//! Tokenizer parity with llama.cpp on every fixture case, in every add_special/parse_special
//! combination, plus detokenization round trips.

mod common;
use common::*;

fn check(file: &str) {
    let model = load_vocab(file);
    let tok = &model.tokenizer;
    let fx = fixture(&format!(
        "tokenizer_{}.json",
        file.trim_end_matches(".gguf")
    ));
    let mut failures = Vec::new();
    let mut checked = 0;
    for case in fx["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        for add in [false, true] {
            for parse in [false, true] {
                let key = format!("ids_add_special_{add}_parse_special_{parse}");
                let expected = ids(&case[&key]);
                let got = tok.encode(text, add, parse).unwrap();
                checked += 1;
                if got != expected {
                    failures.push(format!("{name} {key}: got {got:?}, expected {expected:?}"));
                }
            }
        }
        let detok = tok
            .detokenize(&ids(&case["ids_add_special_false_parse_special_false"]))
            .unwrap();
        let expected = case["detok_of_parse_special_false_ids"].as_str().unwrap();
        if String::from_utf8_lossy(&detok) != expected {
            failures.push(format!(
                "{name}: detokenize gave {:?}",
                String::from_utf8_lossy(&detok)
            ));
        }
        if case["roundtrip_plain_exact"].as_bool() == Some(true) && detok != text.as_bytes() {
            failures.push(format!("{name}: round trip differs"));
        }
        for piece in case["pieces_parse_special_true"].as_array().unwrap() {
            let id = piece["id"].as_u64().unwrap() as u32;
            let bytes: Vec<u8> = match &piece["piece"] {
                serde_json::Value::String(s) => s.as_bytes().to_vec(),
                serde_json::Value::Array(a) => {
                    a.iter().map(|b| b.as_u64().unwrap() as u8).collect()
                }
                other => panic!("bad piece {other}"),
            };
            if tok.token_to_piece(id).unwrap() != bytes.as_slice() {
                failures.push(format!("{name}: piece of {id} differs"));
            }
        }
    }
    println!(
        "{file}: {checked} encodings checked, {} failures",
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn smollm2_matches_llama_cpp() {
    check(SMOLLM2);
}

#[test]
fn gemma3_matches_llama_cpp() {
    check(GEMMA3);
}

#[test]
fn eog_tokens() {
    let m = load_vocab(SMOLLM2);
    assert!(m.tokenizer.is_eog(2)); // <|im_end|>
    assert!(m.tokenizer.is_eog(0)); // <|endoftext|>
    assert!(!m.tokenizer.is_eog(504));
    let g = load_vocab(GEMMA3);
    assert!(g.tokenizer.is_eog(1)); // <eos>
    assert!(g.tokenizer.is_eog(106)); // <end_of_turn>
}

#[test]
fn out_of_range_ids_are_errors() {
    let m = load_vocab(SMOLLM2);
    assert!(m.tokenizer.token_to_piece(49152).is_err());
    assert!(m.tokenizer.detokenize(&[1, u32::MAX]).is_err());
    assert!(m.tokenizer.check_id(-1).is_err());
}

/// The Llama 3 (`llama-bpe`) and Qwen 2 (`qwen2`) pre-tokenizers against llama-tokenize, on
/// SmolLM2's vocabulary relabelled (scripts/pretokenizer_fixtures.py).
#[test]
fn llama3_and_qwen2_pretokenizers_match_llama_cpp() {
    let fx = fixture("pretokenizers.json");
    let texts = fx["texts"].as_array().unwrap();
    for (pre, cases) in fx["pre"].as_object().unwrap() {
        let mut g = llama_cpp_ex_engine::gguf::GgufFile::open(&model_path(SMOLLM2)).unwrap();
        g.metadata.insert(
            "tokenizer.ggml.pre".into(),
            llama_cpp_ex_engine::gguf::Value::String(pre.clone()),
        );
        let tok = llama_cpp_ex_engine::tokenizer::Tokenizer::from_gguf(&g).unwrap();
        for (text, expected) in texts.iter().zip(cases.as_array().unwrap()) {
            let text = text.as_str().unwrap();
            let ids = tok.encode(text, false, true).unwrap();
            assert_eq!(ids, common::ids(expected), "{pre}: {text:?}");
            assert_eq!(
                tok.detokenize(&ids).unwrap(),
                text.as_bytes(),
                "{pre}: {text:?}"
            );
        }
    }
}
