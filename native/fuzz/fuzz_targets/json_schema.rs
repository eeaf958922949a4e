//! JSON Schema to GBNF conversion and llguidance's schema compiler on arbitrary JSON.
#![no_main]

#[path = "common/mod.rs"]
mod common;

use libfuzzer_sys::fuzz_target;
use llama_cpp_ex_engine::grammar::{json_schema, json_schema_grammar, GrammarSpec};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if serde_json::from_str::<serde_json::Value>(text).is_err() {
        return;
    }
    let _ = json_schema::to_gbnf(text);
    if json_schema_grammar(text).is_ok() {
        let spec = GrammarSpec::JsonSchema(text.to_string());
        let _ = common::smollm2().compile_grammar(&spec);
    }
});
