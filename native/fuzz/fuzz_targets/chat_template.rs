//! Chat template rendering with a template and messages from the input: the template of a
//! downloaded GGUF is untrusted. Input: template, a NUL byte, messages as JSON (optional).
#![no_main]

use libfuzzer_sys::fuzz_target;
use llama_cpp_ex_engine::chat::{apply_template, ChatRequest};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (template, messages) = text.split_once('\0').unwrap_or((text, ""));
    let messages: Vec<serde_json::Value> = serde_json::from_str(messages).unwrap_or_else(|_| {
        serde_json::from_str(
            r#"[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"},
               {"role":"assistant","content":"Hello!"},{"role":"user","content":"Bye"}]"#,
        )
        .unwrap()
    });
    let req = ChatRequest {
        messages: &messages,
        add_generation_prompt: true,
        enable_thinking: data.len().is_multiple_of(2),
        bos_token: "<s>",
        eos_token: "</s>",
        kwargs: &[],
    };
    let _ = apply_template(template, &req);
});
