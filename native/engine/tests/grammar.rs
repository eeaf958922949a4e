//! Grammar-constrained generation on both real models: GBNF through our front end, JSON
//! Schemas through llguidance, outputs checked by an independent JSON Schema validator.

mod common;
use common::*;
use llama_cpp_ex_engine::chat::{apply_template, builtin_template, ChatRequest};
use llama_cpp_ex_engine::grammar::{json_schema, GrammarSpec};
use llama_cpp_ex_engine::{Model, Requantize, Sampler, SamplerParams};
use std::sync::Arc;
use std::time::Instant;

fn chat_prompt(model: &Model, user: &str) -> Vec<u32> {
    let template = model
        .chat_template
        .clone()
        .unwrap_or_else(|| builtin_template(&model.config.arch).to_string());
    let messages = vec![serde_json::json!({"role": "user", "content": user})];
    let req = ChatRequest {
        messages: &messages,
        add_generation_prompt: true,
        enable_thinking: false,
        bos_token: "",
        eos_token: "",
        kwargs: &[],
    };
    let text = apply_template(&template, &req).unwrap();
    model.tokenizer.encode(&text, true, true).unwrap()
}

/// Generates under `spec`; returns the text, whether the model ended it itself, and the mean
/// time spent computing masks per token.
fn run(
    model: &Arc<Model>,
    prompt: &[u32],
    spec: &GrammarSpec,
    params: SamplerParams,
    max_tokens: usize,
) -> (String, bool, f64) {
    let constraint = model.compile_grammar(spec).unwrap();
    let sampler = shared(Sampler::new(params).with_grammar(constraint));
    let mut ctx = ctx(model, 1024, 1);
    let mut mask_time = 0.0;
    let sampled = generate(&mut ctx, &sampler, prompt, max_tokens);
    let ended = sampled.last().is_some_and(|t| t.is_eog);
    let text: Vec<u8> = sampled
        .iter()
        .filter(|t| !t.is_eog)
        .flat_map(|t| t.piece.clone())
        .collect();
    let tokens = common::tokens(&sampled);
    // Mask cost measured separately: replay the accepted tokens through a fresh constraint.
    let mut replay = model.compile_grammar(spec).unwrap();
    let mut row = vec![0.0f32; model.config.n_vocab];
    for &t in &tokens {
        let t1 = Instant::now();
        replay.mask(&mut row);
        mask_time += t1.elapsed().as_secs_f64();
        replay.accept(t);
    }
    (
        String::from_utf8(text).unwrap(),
        ended,
        mask_time / tokens.len().max(1) as f64,
    )
}

fn gbnf(text: &str) -> GrammarSpec {
    GrammarSpec::Gbnf {
        text: text.into(),
        root: "root".into(),
    }
}

fn sampled(seed: u64) -> SamplerParams {
    SamplerParams {
        temp: 0.8,
        seed,
        ..Default::default()
    }
}

fn hello_world(file: &str) {
    let model = load(file, Requantize::Q8_0);
    let prompt = chat_prompt(&model, "Say something.");
    let (text, ended, _) = run(
        &model,
        &prompt,
        &gbnf(r#"root ::= "hello world""#),
        SamplerParams::greedy(),
        32,
    );
    assert_eq!(text, "hello world");
    assert!(ended, "the grammar forces end-of-generation after the text");
}

#[test]
fn hello_world_smollm2() {
    hello_world(SMOLLM2);
}

#[test]
fn hello_world_gemma3() {
    hello_world(GEMMA3);
}

fn regex_like(file: &str) {
    let model = load(file, Requantize::Q8_0);
    let cases = [
        (
            r#"root ::= [0-9]{3} "-" [0-9]{4}"#,
            "Give me a phone number.",
            r"^[0-9]{3}-[0-9]{4}$",
        ),
        (
            r#"root ::= ("yes" | "no") "."
            "#,
            "Is the sky blue? Answer yes or no.",
            r"^(yes|no)\.$",
        ),
        (
            "root ::= word (\" \" word){2}\nword ::= [a-z]{1,12}",
            "Name three fruits.",
            r"^[a-z]+ [a-z]+ [a-z]+$",
        ),
        (
            r##"root ::= "#" [A-F0-9]{6}"##,
            "What is the hex code of red?",
            r"^#[A-F0-9]{6}$",
        ),
    ];
    for (g, q, re) in cases {
        let prompt = chat_prompt(&model, q);
        for params in [SamplerParams::greedy(), sampled(3)] {
            let (text, ended, _) = run(&model, &prompt, &gbnf(g), params, 40);
            let ok = regex_lite_match(re, &text);
            assert!(ended && ok, "{file}: {g:?} gave {text:?} (ended {ended})");
        }
    }
}

/// Tiny checker for the anchored patterns above (no regex crate in the engine).
fn regex_lite_match(re: &str, text: &str) -> bool {
    match re {
        r"^[0-9]{3}-[0-9]{4}$" => {
            text.len() == 8
                && text.as_bytes()[3] == b'-'
                && text
                    .chars()
                    .enumerate()
                    .all(|(i, c)| i == 3 || c.is_ascii_digit())
        }
        r"^(yes|no)\.$" => text == "yes." || text == "no.",
        r"^[a-z]+ [a-z]+ [a-z]+$" => {
            let parts: Vec<&str> = text.split(' ').collect();
            parts.len() == 3
                && parts
                    .iter()
                    .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_lowercase()))
        }
        r"^#[A-F0-9]{6}$" => {
            text.len() == 7
                && text.starts_with('#')
                && text[1..]
                    .chars()
                    .all(|c| c.is_ascii_digit() || ('A'..='F').contains(&c))
        }
        _ => unreachable!(),
    }
}

#[test]
fn regex_like_gbnf_smollm2() {
    regex_like(SMOLLM2);
}

#[test]
fn regex_like_gbnf_gemma3() {
    regex_like(GEMMA3);
}

/// (prompt, schema) pairs covering the keywords the issue lists.
const SCHEMAS: &[(&str, &str)] = &[
    (
        "Describe a person.",
        r#"{"type":"object","properties":{"name":{"type":"string","maxLength":20},"age":{"type":"integer","minimum":0,"maximum":120}},"required":["name","age"],"additionalProperties":false}"#,
    ),
    (
        "Give a city and its country.",
        r#"{"type":"object","properties":{"city":{"type":"string","maxLength":24},"country":{"type":"string","maxLength":24}},"required":["city","country"],"additionalProperties":false}"#,
    ),
    (
        "List three colors.",
        r#"{"type":"array","items":{"type":"string","maxLength":12},"minItems":3,"maxItems":3}"#,
    ),
    (
        "List some primes.",
        r#"{"type":"array","items":{"type":"integer","minimum":2,"maximum":100},"minItems":1,"maxItems":5}"#,
    ),
    (
        "Pick a size.",
        r#"{"type":"string","enum":["small","medium","large"]}"#,
    ),
    (
        "Report the status.",
        r#"{"type":"object","properties":{"status":{"const":"ok"},"code":{"type":"integer","minimum":100,"maximum":599}},"required":["status","code"],"additionalProperties":false}"#,
    ),
    (
        "Is water wet?",
        r#"{"type":"object","properties":{"answer":{"type":"boolean"}},"required":["answer"],"additionalProperties":false}"#,
    ),
    (
        "What is a warm day's temperature in Celsius, e.g. 21.5?",
        r#"{"type":"object","properties":{"celsius":{"type":"number","minimum":-50,"maximum":60}},"required":["celsius"],"additionalProperties":false}"#,
    ),
    (
        "Describe a book.",
        r#"{"type":"object","properties":{"title":{"type":"string","maxLength":30},"author":{"type":"string","maxLength":30},"year":{"type":"integer","minimum":1000,"maximum":2100},"isbn":{"type":"string","maxLength":20}},"required":["title","year"],"additionalProperties":false}"#,
    ),
    (
        "Describe an order.",
        r#"{"type":"object","properties":{"id":{"type":"integer","minimum":1,"maximum":99999},"customer":{"type":"object","properties":{"name":{"type":"string","maxLength":20},"email":{"type":"string","maxLength":30}},"required":["name"],"additionalProperties":false}},"required":["id","customer"],"additionalProperties":false}"#,
    ),
    (
        "Give a product code.",
        r#"{"type":"object","properties":{"code":{"type":"string","pattern":"^[A-Z]{3}-[0-9]{4}$"}},"required":["code"],"additionalProperties":false}"#,
    ),
    (
        "When is the meeting?",
        r#"{"type":"object","properties":{"date":{"type":"string","format":"date"}},"required":["date"],"additionalProperties":false}"#,
    ),
    (
        "Give an identifier.",
        r#"{"type":"object","properties":{"id":{"type":"string","format":"uuid"}},"required":["id"],"additionalProperties":false}"#,
    ),
    (
        "Give a value or nothing.",
        r#"{"anyOf":[{"type":"integer","minimum":0,"maximum":9},{"type":"null"}]}"#,
    ),
    (
        "Describe a shape.",
        r#"{"oneOf":[{"type":"object","properties":{"kind":{"const":"circle"},"radius":{"type":"number","minimum":0,"maximum":100}},"required":["kind","radius"],"additionalProperties":false},{"type":"object","properties":{"kind":{"const":"square"},"side":{"type":"number","minimum":0,"maximum":100}},"required":["kind","side"],"additionalProperties":false}]}"#,
    ),
    (
        "Give a point.",
        r##"{"$defs":{"coord":{"type":"integer","minimum":-100,"maximum":100}},"type":"object","properties":{"x":{"$ref":"#/$defs/coord"},"y":{"$ref":"#/$defs/coord"}},"required":["x","y"],"additionalProperties":false}"##,
    ),
    (
        "Describe a team.",
        r##"{"$defs":{"member":{"type":"object","properties":{"name":{"type":"string","maxLength":16},"role":{"enum":["dev","pm","qa"]}},"required":["name","role"],"additionalProperties":false}},"type":"object","properties":{"team":{"type":"string","maxLength":16},"members":{"type":"array","items":{"$ref":"#/$defs/member"},"minItems":1,"maxItems":2}},"required":["team","members"],"additionalProperties":false}"##,
    ),
    (
        "Give a score.",
        r#"{"type":"object","properties":{"score":{"type":"number","minimum":0,"maximum":1}},"required":["score"],"additionalProperties":false}"#,
    ),
    (
        "Name a username.",
        r#"{"type":"object","properties":{"username":{"type":"string","minLength":3,"maxLength":12,"pattern":"^[a-z][a-z0-9_]*$"}},"required":["username"],"additionalProperties":false}"#,
    ),
    (
        "Give some tags.",
        r#"{"type":"object","properties":{"tags":{"type":"array","items":{"type":"string","maxLength":10},"maxItems":3}},"required":["tags"],"additionalProperties":false}"#,
    ),
    (
        "Describe a matrix.",
        r#"{"type":"array","items":{"type":"array","items":{"type":"integer","minimum":0,"maximum":9},"minItems":2,"maxItems":2},"minItems":2,"maxItems":2}"#,
    ),
    (
        "Give a setting.",
        r#"{"type":"object","properties":{"key":{"type":"string","maxLength":12},"value":{"type":["string","integer","boolean"],"maxLength":12}},"required":["key","value"],"additionalProperties":false}"#,
    ),
    (
        "Describe a flight.",
        r#"{"type":"object","properties":{"from":{"type":"string","pattern":"^[A-Z]{3}$"},"to":{"type":"string","pattern":"^[A-Z]{3}$"},"departs":{"type":"string","pattern":"^([01][0-9]|2[0-3]):[0-5][0-9]$"},"seats":{"type":"integer","exclusiveMinimum":0,"maximum":500}},"required":["from","to","seats"],"additionalProperties":false}"#,
    ),
];

fn schema_suite(file: &str) {
    let model = load(file, Requantize::Q8_0);
    let mut worst_mask = 0.0f64;
    let mut total_mask = 0.0f64;
    let mut runs = 0;
    for (i, (q, schema_text)) in SCHEMAS.iter().enumerate() {
        let schema: serde_json::Value = serde_json::from_str(schema_text).unwrap();
        let validator = jsonschema::validator_for(&schema).unwrap();
        let prompt = chat_prompt(
            &model,
            &format!("{q} Answer with JSON matching this schema: {schema_text}"),
        );
        let spec = GrammarSpec::JsonSchema(schema_text.to_string());
        for params in [SamplerParams::greedy(), sampled(1000 + i as u64)] {
            let (text, ended, mask) = run(&model, &prompt, &spec, params.clone(), 160);
            worst_mask = worst_mask.max(mask);
            total_mask += mask;
            runs += 1;
            assert!(
                ended,
                "{file} schema {i} (temp {}): not finished: {text:?}",
                params.temp
            );
            let value: serde_json::Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{file} schema {i}: {e}: {text:?}"));
            let errors: Vec<String> = validator
                .iter_errors(&value)
                .map(|e| e.to_string())
                .collect();
            assert!(errors.is_empty(), "{file} schema {i}: {text} -> {errors:?}");
        }
    }
    eprintln!(
        "{file}: {runs} constrained generations valid; mean mask {:.3} ms/token, worst request mean {:.3} ms",
        total_mask / runs as f64 * 1e3,
        worst_mask * 1e3
    );
}

#[test]
fn json_schema_suite_smollm2() {
    assert!(SCHEMAS.len() >= 20);
    schema_suite(SMOLLM2);
}

#[test]
fn json_schema_suite_gemma3() {
    schema_suite(GEMMA3);
}

/// Sampled steps with top-k check the best candidates against the grammar instead of
/// computing a full mask; with the same seed they draw exactly the tokens the full-mask path
/// draws, on a free-text grammar (mostly lazy) and a JSON Schema (lazy inside strings, full
/// masks where few tokens fit).
fn lazy_grammar_matches_full_mask(file: &str) {
    let model = load(file, Requantize::Q8_0);
    let person = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":20},
        "age":{"type":"integer","minimum":0,"maximum":120}},"required":["name","age"]}"#;
    let cases = [
        (
            "List a few fruits.",
            gbnf("root ::= item{3,5}\nitem ::= \"- \" [A-Za-z ]{1,30} \"\\n\""),
        ),
        (
            "Describe a person as JSON.",
            GrammarSpec::JsonSchema(person.into()),
        ),
    ];
    for (question, spec) in cases {
        let prompt = chat_prompt(&model, question);
        let mut outs = Vec::new();
        for lazy in [true, false] {
            let constraint = model.compile_grammar(&spec).unwrap();
            let mut sampler = Sampler::new(sampled(11)).with_grammar(constraint);
            sampler.lazy_grammar = lazy;
            let sampler = shared(sampler);
            let mut ctx = ctx(&model, 1024, 1);
            let tokens = common::tokens(&generate(&mut ctx, &sampler, &prompt, 48));
            let stats = sampler.lock().unwrap().grammar_stats();
            outs.push((tokens, stats));
        }
        assert_eq!(outs[0].0, outs[1].0, "{question}");
        let (lazy, full) = (outs[0].1, outs[1].1);
        assert_eq!(full.masks, full.steps);
        assert!(lazy.masks < full.masks, "{question}: {lazy:?}");
        if matches!(spec, GrammarSpec::Gbnf { .. }) {
            // free text: at least a quarter of the steps decide without a mask
            assert!(lazy.masks * 4 <= lazy.steps * 3, "{question}: {lazy:?}");
        }
    }
}

#[test]
fn lazy_grammar_matches_full_mask_smollm2() {
    lazy_grammar_matches_full_mask(SMOLLM2);
}

#[test]
fn lazy_grammar_matches_full_mask_gemma3() {
    lazy_grammar_matches_full_mask(GEMMA3);
}

#[test]
fn gbnf_from_json_schema_drives_generation() {
    let model = load(SMOLLM2, Requantize::Q8_0);
    let schema = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":16},"ok":{"type":"boolean"}},"required":["name","ok"]}"#;
    let g = json_schema::to_gbnf(schema).unwrap();
    let prompt = chat_prompt(&model, "Describe yourself in JSON.");
    let (text, ended, _) = run(&model, &prompt, &gbnf(&g), SamplerParams::greedy(), 80);
    assert!(ended, "{text:?}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(v["name"].is_string() && v["ok"].is_boolean(), "{text}");
}

#[test]
fn json_schema_as_grammar_text() {
    let model = load(SMOLLM2, Requantize::Q8_0);
    let schema = r#"{"type":"object","properties":{"n":{"type":"integer","minimum":1,"maximum":9}},"required":["n"],"additionalProperties":false}"#;
    let text = llama_cpp_ex_engine::grammar::json_schema_grammar(schema).unwrap();
    assert!(text.starts_with("%llguidance"));
    let prompt = chat_prompt(&model, "Pick a digit, answer in JSON.");
    let (out, ended, _) = run(&model, &prompt, &gbnf(&text), SamplerParams::greedy(), 40);
    assert!(ended, "{out:?}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let n = v["n"].as_i64().unwrap();
    assert!((1..=9).contains(&n), "{out}");
    assert!(out.starts_with("{\"n\": "), "layout applied: {out}");
    assert!(llama_cpp_ex_engine::grammar::json_schema_grammar(r#"{"type":"frob"}"#).is_err());
}

/// Drives a constraint from `prefix` on with logits that always prefer `favourite`, as a
/// model stuck on one token would; ties go to the lowest token id. Returns the text and
/// whether the grammar let it end within 80 tokens.
fn drive(model: &Model, spec: &GrammarSpec, prefix: &str, favourite: &str) -> (String, bool) {
    let mut c = model.compile_grammar(spec).unwrap();
    let fav = model.tokenizer.encode(favourite, false, false).unwrap();
    assert_eq!(fav.len(), 1, "{favourite:?} is one token");
    for t in model.tokenizer.encode(prefix, false, false).unwrap() {
        c.accept(t);
    }
    let mut text = prefix.as_bytes().to_vec();
    for _ in 0..80 {
        let mut logits = vec![0.0f32; model.config.n_vocab];
        logits[fav[0] as usize] = 10.0;
        c.mask(&mut logits);
        let best = (0..logits.len())
            .filter(|&i| logits[i].is_finite())
            .fold(None, |b: Option<usize>, i| match b {
                Some(j) if logits[j] >= logits[i] => Some(j),
                _ => Some(i),
            })
            .expect("the grammar allows a token") as u32;
        if model.tokenizer.is_eog(best) {
            return (String::from_utf8(text).unwrap(), true);
        }
        c.accept(best);
        text.extend_from_slice(model.tokenizer.token_to_piece(best).unwrap());
    }
    (String::from_utf8(text).unwrap(), false)
}

fn longest_digit_run(text: &str) -> usize {
    text.split(|c: char| !c.is_ascii_digit())
        .map(str::len)
        .max()
        .unwrap_or(0)
}

/// A model that keeps choosing "0" after `1.` would fill `max_tokens` (1.000… is still ≤ 1);
/// JSON-valued grammars cap each run of digits at 16, as llama.cpp's converter does, on both
/// routes to llguidance's compiler. Where the schema needs more digits the cap steps aside.
#[test]
fn json_number_digits_are_capped() {
    for file in [SMOLLM2, GEMMA3] {
        let model = load_vocab(file);
        let schema = r#"{"type":"object","properties":{"score":{"type":"number","minimum":0,"maximum":1}},"required":["score"]}"#;
        let lark = llama_cpp_ex_engine::grammar::json_schema_grammar(schema).unwrap();
        for spec in [GrammarSpec::JsonSchema(schema.into()), gbnf(&lark)] {
            let (text, ended) = drive(&model, &spec, "{\"score\": 1.", "0");
            assert!(ended, "{file}: {text:?}");
            assert!(longest_digit_run(&text) <= 16, "{file}: {text:?}");
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["score"].as_f64(), Some(1.0), "{file}: {text}");
        }
        // 18 integral digits are needed: the cap gives way
        let big = r#"{"type":"number","minimum":100000000000000000}"#;
        let (text, ended) = drive(&model, &GrammarSpec::JsonSchema(big.into()), "1", "0");
        assert!(ended, "{file}: {text:?}");
        assert!(text.starts_with("100000000000000000"), "{file}: {text:?}");
        assert!(
            serde_json::from_str::<f64>(&text).unwrap() >= 1e17,
            "{file}: {text}"
        );
        // a grammar that is not one JSON value is not capped
        let digits = "%llguidance {}\nstart: /[0-9]+/ \"x\"";
        let (text, _) = drive(&model, &gbnf(digits), "1", "0");
        assert!(longest_digit_run(&text) > 16, "{file}: {text:?}");
    }
}

#[test]
fn invalid_grammars_are_errors() {
    let model = load_vocab(SMOLLM2);
    for bad in [
        "root ::= undefined",
        "root ::= \"unterminated",
        "nothing here",
        "",
        "%llguidance {}\nstart: ??",
    ] {
        assert!(model.compile_grammar(&gbnf(bad)).is_err(), "{bad:?}");
    }
    assert!(model
        .compile_grammar(&GrammarSpec::JsonSchema("{not json".into()))
        .is_err());
    let lark = "%llguidance {}\nstart: \"a\" | \"b\"";
    assert!(model.compile_grammar(&gbnf(lark)).is_ok());
}

/// A triggered (lazy) grammar lets anything through until its trigger appears in the output,
/// even split across tokens, then constrains the rest, fed from the trigger's first byte.
fn triggered_grammar(file: &str) {
    let model = load_vocab(file);
    let factory = model.grammar_factory().unwrap();
    let spec = GrammarSpec::Gbnf {
        text: "%llguidance {}\nstart: \"<call>\" /[0-9]+/ \"</call>\"\n".into(),
        root: "root".into(),
    };
    let triggers = vec!["<call>".to_string()];
    let tok = |s: &str| model.tokenizer.encode(s, false, false).unwrap();
    let letter = tok("z")[0];
    let digit = tok("7")[0];

    let mut c = factory.compile_lazy(&spec, &triggers).unwrap();
    // before the trigger: free text, no mask, never stopped
    for &t in &tok("Let me think about it <ca") {
        assert!(c.allows(t));
        c.accept(t);
    }
    let mut row = vec![1.0f32; model.config.n_vocab];
    c.mask(&mut row);
    assert!(
        row.iter().all(|&l| l == 1.0),
        "a waiting grammar masks nothing"
    );
    assert!(!c.is_stopped());
    // the trigger completes inside the next tokens, with a digit after it
    for &t in &tok("ll>4") {
        c.accept(t);
    }
    assert!(c.allows(digit));
    assert!(!c.allows(letter), "after the trigger the grammar decides");
    for &t in &tok("2</call>") {
        assert!(c.allows(t));
        c.accept(t);
    }
    assert!(c.is_stopped());

    // reset waits again; no triggers is an ordinary grammar
    c.reset();
    assert!(c.allows(letter));
    let mut plain = factory.compile_lazy(&spec, &[]).unwrap();
    assert!(!plain.allows(letter));
}

#[test]
fn triggered_grammar_smollm2() {
    triggered_grammar(SMOLLM2);
}

#[test]
fn triggered_grammar_gemma3() {
    triggered_grammar(GEMMA3);
}
