//! The GBNF parser, its analysis and translation, and llguidance's compilation of the result
//! against a real vocabulary: arbitrary grammar text gives a constraint or an error.
#![no_main]

#[path = "common/mod.rs"]
mod common;

use libfuzzer_sys::fuzz_target;
use llama_cpp_ex_engine::grammar::{gbnf, GrammarSpec};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // the parser alone (fast: most inputs stop here)
    if gbnf::parse(text, "root").is_err() {
        return;
    }
    let spec = GrammarSpec::Gbnf {
        text: text.to_string(),
        root: "root".into(),
    };
    if let Ok(mut c) = common::smollm2().compile_grammar(&spec) {
        // a compiled constraint masks logits and follows the tokens it allows
        let mut logits = vec![0.0f32; common::smollm2().tokenizer.n_vocab()];
        for _ in 0..4 {
            c.mask(&mut logits);
            let Some(t) = logits.iter().position(|l| l.is_finite()) else {
                break;
            };
            c.accept(t as u32);
            logits.iter_mut().for_each(|l| *l = 0.0);
        }
    }
});
