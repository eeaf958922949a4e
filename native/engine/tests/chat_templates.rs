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

/// The model families' own templates (`test/fixtures/templates`, from the model authors via
/// llama.cpp's models/templates) render exactly as llama-server `--jinja` renders them
/// (`/apply-template`, recorded by `scripts/chat_template_fixtures.py`), tool calls included.
#[test]
fn family_templates_render_like_llama_cpp() {
    let fx = fixture("templates/expected.json");
    // templates that print today's date cannot be compared on another day
    let undate = |s: &str| {
        let mut out = String::new();
        for line in s.split_inclusive('\n') {
            if line.starts_with("Today Date: ") {
                out.push_str("Today Date: <date>\n");
            } else {
                out.push_str(line);
            }
        }
        out
    };
    let mut checked = 0;
    for (family, f) in fx["families"].as_object().unwrap() {
        let file = f["template"].as_str().unwrap();
        let template =
            std::fs::read_to_string(fixtures_dir().join("templates").join(file)).unwrap();
        for (name, expected) in f["cases"].as_object().unwrap() {
            let conv = &fx["conversations"][name];
            let messages = conv["messages"].as_array().unwrap().clone();
            let mut kwargs = Vec::new();
            if let Some(tools) = conv.get("tools") {
                kwargs.push(("tools".to_string(), tools.clone()));
            }
            let req = ChatRequest {
                messages: &messages,
                add_generation_prompt: true,
                enable_thinking: true,
                bos_token: "<|endoftext|>",
                eos_token: "<|im_end|>",
                kwargs: &kwargs,
            };
            let rendered =
                apply_template(&template, &req).unwrap_or_else(|e| panic!("{family} {name}: {e}"));
            assert_eq!(
                undate(&rendered),
                undate(expected.as_str().unwrap()),
                "{family} {name}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 22);
}
