//! Grammar-constrained sampling on llguidance: GBNF (our front end → llguidance Lark), Lark
//! text (`%llguidance` prefix, llama.cpp's convention) and JSON Schema (llguidance's compiler).
//!
//! A [`GrammarFactory`] is built once per model (lazily: the token trie of a 262k vocabulary
//! takes a moment) and compiles grammars into [`Constraint`]s, one per request.

pub mod analysis;
mod digits;
pub mod gbnf;
pub mod json_schema;
pub mod lark;

use crate::tokenizer::{TokenId, TokenType, Tokenizer};
use digits::{DigitCap, DigitTokens};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;

/// Grammar text starting with this is llguidance Lark, passed through (llama.cpp's rule).
pub const LLGUIDANCE_PREFIX: &str = "%llguidance";

/// Why a grammar was rejected; the NIF maps it to `{:error, :invalid_grammar}`.
#[derive(Debug, Clone, PartialEq)]
pub struct GrammarError(pub String);

impl std::fmt::Display for GrammarError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A grammar as the user gave it.
#[derive(Debug, Clone)]
pub enum GrammarSpec {
    /// GBNF text and the name of its start rule (or Lark text behind [`LLGUIDANCE_PREFIX`]).
    Gbnf { text: String, root: String },
    /// A JSON Schema document (JSON text).
    JsonSchema(String),
}

/// Compact, bounded JSON layout: a small model that may emit arbitrary whitespace can loop on
/// it until `max_tokens`; these separators keep output readable and finite.
const JSON_LAYOUT: &str =
    r#"{"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}"#;

impl GrammarSpec {
    /// Whether the whole output is one JSON value: a schema, or the Lark text of
    /// [`json_schema_grammar`]. Such grammars cap the digits of numbers ([`digits`]).
    fn is_json_value(&self) -> bool {
        match self {
            GrammarSpec::JsonSchema(_) => true,
            GrammarSpec::Gbnf { text, .. } => text
                .trim()
                .strip_prefix(LLGUIDANCE_PREFIX)
                .and_then(|rest| rest.trim_start().strip_prefix("{}"))
                .is_some_and(|rest| {
                    let rest = rest.trim();
                    rest.starts_with("start: %json") && !rest.contains('\n')
                }),
        }
    }

    /// Checks the text and translates it into llguidance's input.
    pub fn to_llguidance(&self) -> Result<TopLevelGrammar, GrammarError> {
        match self {
            GrammarSpec::Gbnf { text, root } => {
                let limits = crate::limits::limits();
                if text.len() > limits.grammar_bytes {
                    return Err(GrammarError(format!(
                        "grammar larger than {} bytes (limit grammar_bytes)",
                        limits.grammar_bytes
                    )));
                }
                if text.trim_start().starts_with(LLGUIDANCE_PREFIX) {
                    // llguidance parses Lark recursively: bound its nesting first
                    if lark_nesting(text) > limits.grammar_nesting {
                        return Err(GrammarError(format!(
                            "grammar nesting deeper than {} levels (limit grammar_nesting)",
                            limits.grammar_nesting
                        )));
                    }
                    return Ok(TopLevelGrammar::from_lark(text.clone()));
                }
                let g = gbnf::parse(text, root)?;
                if !analysis::derives_something(&g, root) {
                    return Err(GrammarError(format!(
                        "the grammar matches nothing: rule '{root}' never ends"
                    )));
                }
                Ok(TopLevelGrammar::from_lark(lark::to_lark(&g, root)))
            }
            GrammarSpec::JsonSchema(json) => {
                check_schema(json)?;
                let mut schema: serde_json::Value = serde_json::from_str(json)
                    .map_err(|e| GrammarError(format!("schema is not JSON: {e}")))?;
                with_layout(&mut schema)?;
                Ok(TopLevelGrammar::from_json_schema(schema))
            }
        }
    }
}

/// Grammar text (llguidance Lark behind [`LLGUIDANCE_PREFIX`]) that constrains output to a
/// JSON Schema with llguidance's own compiler. The schema is first run through the GBNF
/// converter so unsupported or broken schemas fail with the same errors as
/// `Grammar.from_json_schema/1`.
pub fn json_schema_grammar(schema_json: &str) -> Result<String, GrammarError> {
    check_schema(schema_json)?;
    let mut schema: serde_json::Value = serde_json::from_str(schema_json)
        .map_err(|e| GrammarError(format!("Unrecognized schema: not JSON: {e}")))?;
    with_layout(&mut schema)?;
    Ok(format!("{LLGUIDANCE_PREFIX} {{}}\nstart: %json {schema}\n"))
}

/// The checks of the GBNF converter (size, nesting, property counts, unresolved `$ref`s) and
/// of its output (a schema that matches nothing), so that llguidance's compiler and
/// `Grammar.from_json_schema/1` reject the same schemas.
fn check_schema(schema_json: &str) -> Result<(), GrammarError> {
    let gbnf = json_schema::to_gbnf(schema_json)?;
    let g = gbnf::parse(&gbnf, "root")?;
    if !analysis::derives_something(&g, "root") {
        return Err(GrammarError("the schema matches nothing".into()));
    }
    Ok(())
}

/// Bracket nesting of Lark text outside its string literals and regexes.
fn lark_nesting(text: &str) -> usize {
    let (mut depth, mut max) = (0usize, 0usize);
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for c in text.chars() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '"' | '/' => quote = Some(c),
            '(' | '[' | '{' => {
                depth += 1;
                max = max.max(depth);
            }
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

/// Keywords whose value is one subschema, a map of subschemas, or a list of subschemas.
const SCHEMA_KEYWORDS: &[&str] = &[
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "additionalProperties",
    "unevaluatedItems",
];
const SCHEMA_MAP_KEYWORDS: &[&str] = &[
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
];
const SCHEMA_LIST_KEYWORDS: &[&str] = &["allOf", "anyOf", "oneOf", "prefixItems"];

/// llama.cpp's rule, on every route: an object schema that lists `properties` and says
/// nothing about others allows no others (`additionalProperties: false`). llguidance would
/// allow them. Walks the subschemas by keyword (a property may itself be named
/// "properties"), without recursion; the schema's depth was checked by the converter.
fn close_objects(schema: &mut serde_json::Value) {
    let mut stack = vec![schema];
    while let Some(node) = stack.pop() {
        let Some(obj) = node.as_object_mut() else {
            continue;
        };
        if obj.contains_key("properties") && !obj.contains_key("additionalProperties") {
            obj.insert(
                "additionalProperties".into(),
                serde_json::Value::Bool(false),
            );
        }
        for (key, value) in obj.iter_mut() {
            if SCHEMA_KEYWORDS.contains(&key.as_str()) {
                match value {
                    serde_json::Value::Array(items) => stack.extend(items.iter_mut()),
                    other => stack.push(other),
                }
            } else if SCHEMA_MAP_KEYWORDS.contains(&key.as_str()) {
                if let Some(map) = value.as_object_mut() {
                    stack.extend(map.values_mut());
                }
            } else if SCHEMA_LIST_KEYWORDS.contains(&key.as_str()) {
                if let Some(items) = value.as_array_mut() {
                    stack.extend(items.iter_mut());
                }
            }
        }
    }
}

fn with_layout(schema: &mut serde_json::Value) -> Result<(), GrammarError> {
    close_objects(schema);
    if let Some(obj) = schema.as_object_mut() {
        if !obj.contains_key("x-guidance") {
            let layout: serde_json::Value =
                serde_json::from_str(JSON_LAYOUT).map_err(|e| GrammarError(e.to_string()))?;
            obj.insert("x-guidance".into(), layout);
        }
    }
    Ok(())
}

/// The tokenizer as llguidance sees it: every token's bytes, special tokens behind 0xFF.
struct Env {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => match self.tokenizer.encode(text, false, false) {
                Ok(ids) => ids,
                Err(_) => self.trie.greedy_tokenize(s),
            },
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiles grammars for one model's vocabulary.
pub struct GrammarFactory {
    factory: ParserFactory,
    env: TokEnv,
    eog: Arc<[TokenId]>,
    eos: TokenId,
    n_vocab: usize,
    digits: Arc<DigitTokens>,
}

impl std::fmt::Debug for GrammarFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarFactory")
            .field("n_vocab", &self.n_vocab)
            .finish()
    }
}

impl GrammarFactory {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Self, GrammarError> {
        let n_vocab = tokenizer.n_vocab();
        let eog: Arc<[TokenId]> = tokenizer.eog_tokens().to_vec().into();
        let eos = tokenizer
            .eos
            .or_else(|| eog.first().copied())
            .ok_or_else(|| GrammarError("the vocabulary has no end-of-generation token".into()))?;
        let mut words = Vec::with_capacity(n_vocab);
        for id in 0..n_vocab as TokenId {
            let piece = tokenizer.token_to_piece(id).unwrap_or(&[]);
            let special = matches!(
                tokenizer.token_type(id),
                Some(TokenType::Control | TokenType::Unknown | TokenType::Unused)
            ) || eog.contains(&id)
                || piece.is_empty();
            if special {
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                match tokenizer.token_text(id) {
                    Some(t) if !t.is_empty() => w.extend_from_slice(t.as_bytes()),
                    _ => w.extend_from_slice(format!("<[{id}]>").as_bytes()),
                }
                words.push(w);
            } else {
                words.push(piece.to_vec());
            }
        }
        let info = TokRxInfo {
            vocab_size: n_vocab as u32,
            tok_eos: eos,
            tok_bos: tokenizer.bos,
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let env: TokEnv = Arc::new(Env {
            trie: TokTrie::from(&info, &words),
            tokenizer,
        });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError(e.to_string()))?;
        factory.quiet();
        Ok(GrammarFactory {
            factory,
            digits: Arc::new(DigitTokens::new(env.tok_trie())),
            env,
            eog,
            eos,
            n_vocab,
        })
    }

    /// Compiles `spec` into a fresh constraint; errors are grammar errors. Runs on a thread
    /// with a large stack ([`crate::stack`]): llguidance recurses per required property of a
    /// JSON object and per level of a grammar, within the bounds of [`crate::limits`].
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint, GrammarError> {
        crate::stack::on_deep_stack(|| self.compile_here(spec)).map_err(GrammarError)?
    }

    fn compile_here(&self, spec: &GrammarSpec) -> Result<Constraint, GrammarError> {
        let grammar = spec.to_llguidance()?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError(first_line(&e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError(first_line(&e)));
        }
        Ok(Constraint {
            matcher,
            eog: self.eog.clone(),
            eos: self.eos,
            n_vocab: self.n_vocab,
            lazy: None,
            digit_cap: spec
                .is_json_value()
                .then(|| DigitCap::new(self.digits.clone(), self.env.clone())),
        })
    }

    /// Like [`compile`](Self::compile), the constraint applying only from the first of
    /// `triggers` in the output on (llama.cpp's lazy grammars; see [`Lazy`]). No triggers:
    /// an ordinary constraint.
    pub fn compile_lazy(
        &self,
        spec: &GrammarSpec,
        triggers: &[String],
    ) -> Result<Constraint, GrammarError> {
        let mut c = self.compile(spec)?;
        let triggers: Vec<Vec<u8>> = triggers
            .iter()
            .filter(|t| !t.is_empty())
            .map(|t| t.as_bytes().to_vec())
            .collect();
        if !triggers.is_empty() {
            // the cap follows JSON from the output's first byte; a lazy grammar's starts later
            c.digit_cap = None;
            c.lazy = Some(Box::new(Lazy {
                triggers,
                seen: Vec::new(),
                active: false,
                env: self.env.clone(),
            }));
        }
        Ok(c)
    }
}

/// A grammar that waits for a trigger: until one of `triggers` appears in the output, tokens
/// are free (masks and checks pass everything); then the grammar is fed the output from the
/// trigger's first byte on (retokenized: llguidance follows bytes, not token boundaries) and
/// constrains the rest. Tool calls use it so that a model may talk before it calls.
#[derive(Clone)]
struct Lazy {
    triggers: Vec<Vec<u8>>,
    /// The output's last bytes, as many as a trigger split across tokens needs.
    seen: Vec<u8>,
    active: bool,
    env: TokEnv,
}

impl Lazy {
    fn longest(&self) -> usize {
        self.triggers.iter().map(|t| t.len()).max().unwrap_or(0)
    }

    /// Appends a token's text; `Some(bytes from the trigger on)` when a trigger has appeared.
    fn push(&mut self, token: TokenId) -> Option<Vec<u8>> {
        let bytes = self.env.tok_trie().token(token);
        // a special token's text follows its marker byte
        let bytes = match bytes.first() {
            Some(&TokTrie::SPECIAL_TOKEN_MARKER) => &bytes[1..],
            _ => bytes,
        };
        self.seen.extend_from_slice(bytes);
        let start = self
            .triggers
            .iter()
            .filter_map(|t| find(&self.seen, t))
            .min();
        match start {
            Some(p) => {
                self.active = true;
                Some(self.seen.split_off(p))
            }
            None => {
                let keep = self.longest().saturating_sub(1);
                if self.seen.len() > keep {
                    self.seen.drain(..self.seen.len() - keep);
                }
                None
            }
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("invalid grammar").to_string()
}

/// One request's grammar state: masks logits and follows accepted tokens.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    eog: Arc<[TokenId]>,
    eos: TokenId,
    n_vocab: usize,
    lazy: Option<Box<Lazy>>,
    digit_cap: Option<DigitCap>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// Sets the logit of every token the grammar forbids to -inf. End-of-generation tokens are
    /// allowed exactly when the grammar can end here. A matcher in an error state allows only
    /// end-of-generation, so the request finishes instead of producing unconstrained text.
    pub fn mask(&mut self, logits: &mut [f32]) {
        if self.waiting() {
            return;
        }
        let Ok(set) = self.matcher.compute_mask_or_eos() else {
            return self.only_eog(logits);
        };
        let eos_ok = set.is_allowed(self.eos);
        let saved: Vec<(usize, f32)> = self
            .eog
            .iter()
            .filter_map(|&t| logits.get(t as usize).map(|&l| (t as usize, l)))
            .collect();
        let covered = (set.as_slice().len() * 32)
            .min(self.n_vocab)
            .min(logits.len());
        for (w, chunk) in set.as_slice().iter().zip(logits[..covered].chunks_mut(32)) {
            match *w {
                u32::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                bits => {
                    for (j, l) in chunk.iter_mut().enumerate() {
                        if bits >> j & 1 == 0 {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        logits[covered..].fill(f32::NEG_INFINITY);
        for (i, l) in saved {
            logits[i] = if eos_ok { l } else { f32::NEG_INFINITY };
        }
        if let Some(cap) = &self.digit_cap {
            cap.mask(logits);
        }
    }

    fn only_eog(&self, logits: &mut [f32]) {
        let keep: Vec<(usize, f32)> = self
            .eog
            .iter()
            .filter_map(|&t| logits.get(t as usize).map(|&l| (t as usize, l)))
            .collect();
        logits.fill(f32::NEG_INFINITY);
        for (i, l) in keep {
            logits[i] = if l.is_finite() { l } else { 0.0 };
        }
    }

    /// Whether the grammar allows `token` next, without computing a mask.
    pub fn allows(&mut self, token: TokenId) -> bool {
        if self.waiting() {
            return true;
        }
        if self.eog.contains(&token) {
            return self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false);
        }
        // a token the cap forbids goes to the full mask, where the cap may step aside
        !self.matcher.is_stopped()
            && !self.digit_cap.as_ref().is_some_and(|c| c.forbids(token))
            && self.matcher.validate_tokens(&[token]).is_ok_and(|n| n == 1)
    }

    /// Advances the grammar past a sampled token (end-of-generation tokens count as EOS).
    pub fn accept(&mut self, token: TokenId) {
        if let Some(lazy) = self.lazy.as_mut().filter(|l| !l.active) {
            if self.eog.contains(&token) {
                return;
            }
            if let Some(from_trigger) = lazy.push(token) {
                let tokens = lazy.env.tokenize_bytes(&from_trigger);
                // output the grammar rejects leaves the matcher in its error state: only
                // end-of-generation may follow
                let _ = self.matcher.consume_tokens(&tokens);
            }
            return;
        }
        let t = if self.eog.contains(&token) {
            self.eos
        } else {
            token
        };
        if !self.matcher.is_stopped() {
            let _ = self.matcher.consume_token(t);
        }
        if let Some(cap) = self.digit_cap.as_mut() {
            cap.accept(t);
        }
    }

    /// Whether the grammar is complete (only end-of-generation may follow).
    pub fn is_stopped(&self) -> bool {
        !self.waiting() && self.matcher.is_stopped()
    }

    /// Whether a lazy grammar still waits for its trigger.
    fn waiting(&self) -> bool {
        self.lazy.as_ref().is_some_and(|l| !l.active)
    }

    pub fn reset(&mut self) {
        let _ = self.matcher.reset();
        if let Some(cap) = self.digit_cap.as_mut() {
            cap.reset();
        }
        if let Some(l) = self.lazy.as_mut() {
            l.active = false;
            l.seen.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_without_additional_properties_are_closed() {
        let mut schema = serde_json::json!({
            "type": "object",
            "properties": {
                "properties": {"type": "object", "properties": {"a": {"type": "string"}}},
                "open": {"type": "object", "properties": {}, "additionalProperties": true},
                "list": {"type": "array", "items": {"properties": {"b": {}}}}
            },
            "$defs": {"d": {"anyOf": [{"properties": {"c": {}}}]}}
        });
        close_objects(&mut schema);
        let closed = |v: &serde_json::Value| v["additionalProperties"] == false;
        assert!(closed(&schema));
        // the property named "properties" is a schema, not a keyword of its parent's map
        assert!(closed(&schema["properties"]["properties"]));
        assert!(schema["properties"].get("additionalProperties").is_none());
        assert_eq!(schema["properties"]["open"]["additionalProperties"], true);
        assert!(closed(&schema["properties"]["list"]["items"]));
        assert!(closed(&schema["$defs"]["d"]["anyOf"][0]));
    }

    #[test]
    fn schemas_that_match_nothing_are_rejected() {
        for schema in [
            r##"{"$ref": "#"}"##,
            r##"{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}"##,
        ] {
            let err = json_schema_grammar(schema).unwrap_err();
            assert!(err.0.contains("matches nothing"), "{schema}: {err}");
        }
        // recursion with a way out is fine
        let tree = r##"{"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]}"##;
        json_schema_grammar(tree).unwrap();
    }
}
