//! Chat prompts rendered from each model's template (SmolLM2's Jinja template, Gemma's
//! built-in format) tokenize to exactly the prompt ids of the fixture's chat cases.

mod common;
use common::*;
use llama_cpp_ex_engine::chat::{apply_template, builtin_template, ChatRequest};

fn between<'a>(text: &'a str, open: &str, close: &str) -> &'a str {
    let start = text.find(open).unwrap() + open.len();
    let end = start + text[start..].find(close).unwrap();
    &text[start..end]
}

fn check(file: &str, user_open: &str, user_close: &str) {
    let model = load_vocab(file);
    let fx = fixture(&format!("greedy_{}.json", file.trim_end_matches(".gguf")));
    let template = model
        .chat_template
        .clone()
        .unwrap_or_else(|| builtin_template(&model.config.arch).to_string());
    let mut checked = 0;
    for case in fx["cases"].as_array().unwrap() {
        if case["kind"] == "raw" {
            continue;
        }
        let text = case["prompt_text"].as_str().unwrap();
        let user = between(text, user_open, user_close);
        let system = "You are a helpful assistant.";
        let messages: Vec<serde_json::Value> = if case["name"] == "chat_system_haiku" {
            let user = user.rsplit("\n\n").next().unwrap();
            vec![
                serde_json::json!({"role": "system", "content": system}),
                serde_json::json!({"role": "user", "content": user}),
            ]
        } else {
            vec![serde_json::json!({"role": "user", "content": user})]
        };
        let req = ChatRequest {
            messages: &messages,
            add_generation_prompt: true,
            enable_thinking: false,
            bos_token: "",
            eos_token: "",
            kwargs: &[],
        };
        let rendered = apply_template(&template, &req).unwrap();
        assert_eq!(rendered, text, "{file} {}", case["name"]);
        let ids = model.tokenizer.encode(&rendered, true, true).unwrap();
        assert_eq!(
            ids,
            common::ids(&case["prompt_ids"]),
            "{file} {}",
            case["name"]
        );
        checked += 1;
    }
    assert_eq!(checked, 4);
}

#[test]
fn smollm2_chat_prompts_match_llama_cpp() {
    check(SMOLLM2, "<|im_start|>user\n", "<|im_end|>");
}

#[test]
fn gemma3_chat_prompts_match_llama_cpp() {
    check(GEMMA3, "<start_of_turn>user\n", "<end_of_turn>");
}
