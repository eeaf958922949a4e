//! JSON Schema → GBNF, for `LlamaCppEx.Grammar.from_json_schema/1` (users who want a grammar
//! they can read and edit). Generation with `:json_schema` hands the schema to llguidance's own
//! compiler instead, which also enforces numeric ranges exactly.
//!
//! Covered: type (and type lists), const, enum, properties/required (declaration order,
//! optional properties in order), additionalProperties, items/prefixItems with
//! minItems/maxItems, minLength/maxLength, pattern (a regular-expression subset), formats
//! date/time/date-time/uuid, anyOf/oneOf, allOf of objects, $ref into $defs/definitions.
//! Numeric minimum ≥ 0 removes the minus sign; other numeric bounds are not expressed.

use super::GrammarError;
use crate::limits::Limits;
use serde_json::{Map, Value};
use std::collections::HashMap;

const SPACE_RULE: &str = "\" \"?";

const PRIMITIVES: &[(&str, &str)] = &[
    ("space", SPACE_RULE),
    ("boolean", "(\"true\" | \"false\") space"),
    ("null", "\"null\" space"),
    ("integral-part", "[0] | [1-9] [0-9]{0,15}"),
    ("decimal-part", "[0-9]{1,16}"),
    ("integer", "(\"-\"? integral-part) space"),
    ("uinteger", "integral-part space"),
    (
        "number",
        "(\"-\"? integral-part) (\".\" decimal-part)? ([eE] [-+]? integral-part)? space",
    ),
    (
        "unumber",
        "integral-part (\".\" decimal-part)? ([eE] [-+]? integral-part)? space",
    ),
    (
        "char",
        "[^\"\\\\\\x7F\\x00-\\x1F] | [\\\\] ([\"\\\\bfnrt] | \"u\" [0-9a-fA-F]{4})",
    ),
    ("string", "\"\\\"\" char* \"\\\"\" space"),
    ("value", "object | array | string | number | boolean | null"),
    (
        "object",
        "\"{\" space ( string \":\" space value (\",\" space string \":\" space value)* )? \"}\" space",
    ),
    (
        "array",
        "\"[\" space ( value (\",\" space value)* )? \"]\" space",
    ),
    ("date", "[0-9]{4} \"-\" ( [0] [1-9] | [1] [0-2] ) \"-\" ( [0] [1-9] | [1-2] [0-9] | [3] [0-1] )"),
    ("time", "( [01] [0-9] | [2] [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" [0-9]{3} )? ( \"Z\" | ( \"+\" | \"-\" ) ( [01] [0-9] | [2] [0-3] ) \":\" [0-5] [0-9] )"),
    ("date-time", "date \"T\" time"),
    ("uuid", "[0-9a-fA-F]{8} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{12}"),
];

/// Which primitive rules each primitive needs.
fn primitive_deps(name: &str) -> &'static [&'static str] {
    match name {
        "integer" | "uinteger" => &["integral-part", "space"],
        "number" | "unumber" => &["integral-part", "decimal-part", "space"],
        "string" => &["char", "space"],
        "boolean" | "null" => &["space"],
        "value" => &["object", "array", "string", "number", "boolean", "null"],
        "object" => &["string", "value", "space"],
        "array" => &["value", "space"],
        "date-time" => &["date", "time"],
        _ => &[],
    }
}

struct Converter<'a> {
    limits: Limits,
    /// Subschemas visited so far.
    nodes: usize,
    root: &'a Value,
    rules: Vec<(String, String)>,
    by_body: HashMap<String, String>,
    refs: HashMap<String, String>,
}

fn err(msg: impl Into<String>) -> GrammarError {
    GrammarError(msg.into())
}

/// GBNF literal for `s` (quoted, escaped).
fn literal(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\x{:02X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn sanitize(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    if s.is_empty() {
        "r".into()
    } else {
        s
    }
}

impl<'a> Converter<'a> {
    fn add_primitive(&mut self, name: &str) -> String {
        if !self.rules.iter().any(|(n, _)| n == name) {
            let body = PRIMITIVES
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, b)| b.to_string())
                .unwrap_or_default();
            self.rules.push((name.to_string(), body));
            for dep in primitive_deps(name) {
                self.add_primitive(dep);
            }
        }
        name.to_string()
    }

    /// Adds a rule, reusing an existing rule with the same body.
    fn add_rule(&mut self, name: &str, body: String) -> String {
        if let Some(existing) = self.by_body.get(&body) {
            return existing.clone();
        }
        let base = sanitize(name);
        let mut unique = base.clone();
        let mut i = 1;
        while self.rules.iter().any(|(n, _)| *n == unique) {
            unique = format!("{base}{i}");
            i += 1;
        }
        self.rules.push((unique.clone(), body.clone()));
        self.by_body.insert(body, unique.clone());
        unique
    }

    fn resolve(&self, reference: &str) -> Result<&'a Value, GrammarError> {
        let fail = || err(format!("Error resolving ref {reference}"));
        let path = reference.strip_prefix("#").ok_or_else(fail)?;
        let mut node = self.root;
        for part in path.split('/').filter(|p| !p.is_empty()) {
            let part = part.replace("~1", "/").replace("~0", "~");
            node = match node {
                Value::Object(m) => m.get(&part).ok_or_else(fail)?,
                Value::Array(a) => a
                    .get(part.parse::<usize>().map_err(|_| fail())?)
                    .ok_or_else(fail)?,
                _ => return Err(fail()),
            };
        }
        Ok(node)
    }

    /// Returns a GBNF expression matching `schema` (a rule name or an inline expression).
    fn visit(&mut self, schema: &Value, name: &str, depth: usize) -> Result<String, GrammarError> {
        if depth > self.limits.grammar_nesting {
            return Err(err("schema nested too deeply"));
        }
        self.nodes += 1;
        if self.nodes > self.limits.schema_nodes {
            return Err(err(format!(
                "schema too large: more than {} subschemas (limit schema_nodes)",
                self.limits.schema_nodes
            )));
        }
        let obj = match schema {
            Value::Bool(true) => return Ok(self.add_primitive("value")),
            Value::Bool(false) => return Err(err("Unrecognized schema: false accepts nothing")),
            Value::Object(m) => m,
            other => return Err(err(format!("Unrecognized schema: {other}"))),
        };
        if let Some(r) = obj.get("$ref") {
            let r = r
                .as_str()
                .ok_or_else(|| err("Error resolving ref: $ref is not a string"))?;
            if let Some(rule) = self.refs.get(r) {
                return Ok(rule.clone());
            }
            let target = self.resolve(r)?;
            let rule_name = sanitize(&format!("ref-{}", r.rsplit('/').next().unwrap_or("x")));
            // Reserve the name first so recursive references terminate.
            let mut unique = rule_name.clone();
            let mut i = 1;
            while self.rules.iter().any(|(n, _)| *n == unique) {
                unique = format!("{rule_name}{i}");
                i += 1;
            }
            self.rules.push((unique.clone(), String::new()));
            self.refs.insert(r.to_string(), unique.clone());
            let body = self.visit(target, &unique, depth + 1)?;
            if let Some(slot) = self.rules.iter_mut().find(|(n, _)| *n == unique) {
                slot.1 = body;
            }
            return Ok(unique);
        }
        if let Some(c) = obj.get("const") {
            return Ok(format!("{} space", literal(&c.to_string())).pipe(|b| {
                self.add_primitive("space");
                self.add_rule(&format!("{name}-const"), b)
            }));
        }
        if let Some(e) = obj.get("enum") {
            let items = e
                .as_array()
                .ok_or_else(|| err("Unrecognized schema: enum is not an array"))?;
            if items.is_empty() {
                return Err(err("Unrecognized schema: empty enum"));
            }
            self.add_primitive("space");
            let alts: Vec<String> = items.iter().map(|v| literal(&v.to_string())).collect();
            return Ok(self.add_rule(
                &format!("{name}-enum"),
                format!("({}) space", alts.join(" | ")),
            ));
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(list) = obj.get(key) {
                let list = list
                    .as_array()
                    .ok_or_else(|| err(format!("Unrecognized schema: {key} is not an array")))?;
                let mut alts = Vec::new();
                for (i, s) in list.iter().enumerate() {
                    alts.push(self.visit(s, &format!("{name}-{i}"), depth + 1)?);
                }
                if alts.is_empty() {
                    return Err(err(format!("Unrecognized schema: empty {key}")));
                }
                return Ok(self.add_rule(name, alts.join(" | ")));
            }
        }
        if let Some(list) = obj.get("allOf") {
            let list = list
                .as_array()
                .ok_or_else(|| err("Unrecognized schema: allOf is not an array"))?;
            let mut merged = Map::new();
            let mut props = Map::new();
            let mut required: Vec<Value> = Vec::new();
            for s in list {
                let s = match s.get("$ref").and_then(Value::as_str) {
                    Some(r) => self.resolve(r)?,
                    None => s,
                };
                let Some(m) = s.as_object() else {
                    return Err(err("Unrecognized schema: allOf member is not an object"));
                };
                for (k, v) in m {
                    match k.as_str() {
                        "properties" => {
                            if let Some(p) = v.as_object() {
                                props.extend(p.clone());
                            }
                        }
                        "required" => {
                            if let Some(r) = v.as_array() {
                                required.extend(r.iter().cloned());
                            }
                        }
                        _ => {
                            merged.insert(k.clone(), v.clone());
                        }
                    }
                }
            }
            merged.insert("properties".into(), Value::Object(props));
            merged.insert("required".into(), Value::Array(required));
            merged.insert("type".into(), Value::String("object".into()));
            return self.visit(&Value::Object(merged), name, depth + 1);
        }
        match obj.get("type") {
            Some(Value::Array(types)) => {
                let mut alts = Vec::new();
                for t in types {
                    let mut single = obj.clone();
                    single.insert("type".into(), t.clone());
                    alts.push(self.visit(
                        &Value::Object(single),
                        &format!("{name}-{}", t.as_str().unwrap_or("t")),
                        depth + 1,
                    )?);
                }
                if alts.is_empty() {
                    return Err(err("Unrecognized schema: empty type list"));
                }
                Ok(self.add_rule(name, alts.join(" | ")))
            }
            Some(Value::String(t)) => self.visit_type(t, obj, name, depth),
            Some(other) => Err(err(format!("Unrecognized schema: type {other}"))),
            None => {
                if obj.contains_key("properties") {
                    self.visit_type("object", obj, name, depth)
                } else if obj.contains_key("items") || obj.contains_key("prefixItems") {
                    self.visit_type("array", obj, name, depth)
                } else {
                    Ok(self.add_primitive("value"))
                }
            }
        }
    }

    fn visit_type(
        &mut self,
        t: &str,
        obj: &Map<String, Value>,
        name: &str,
        depth: usize,
    ) -> Result<String, GrammarError> {
        let non_negative = |o: &Map<String, Value>| {
            o.get("minimum")
                .and_then(Value::as_f64)
                .is_some_and(|m| m >= 0.0)
                || o.get("exclusiveMinimum")
                    .and_then(Value::as_f64)
                    .is_some_and(|m| m >= 0.0)
        };
        match t {
            "boolean" | "null" => Ok(self.add_primitive(t)),
            "integer" => Ok(self.add_primitive(if non_negative(obj) {
                "uinteger"
            } else {
                "integer"
            })),
            "number" => Ok(self.add_primitive(if non_negative(obj) {
                "unumber"
            } else {
                "number"
            })),
            "string" => self.visit_string(obj, name),
            "array" => self.visit_array(obj, name, depth),
            "object" => self.visit_object(obj, name, depth),
            other => Err(err(format!("Unrecognized schema: unknown type {other:?}"))),
        }
    }

    fn visit_string(
        &mut self,
        obj: &Map<String, Value>,
        name: &str,
    ) -> Result<String, GrammarError> {
        self.add_primitive("space");
        if let Some(pattern) = obj.get("pattern").and_then(Value::as_str) {
            let body = regex_to_gbnf(pattern)?;
            return Ok(self.add_rule(
                &format!("{name}-pattern"),
                format!("\"\\\"\" ({body}) \"\\\"\" space"),
            ));
        }
        if let Some(format) = obj.get("format").and_then(Value::as_str) {
            if matches!(format, "date" | "time" | "date-time" | "uuid") {
                let inner = self.add_primitive(format);
                return Ok(self.add_rule(
                    &format!("{format}-string"),
                    format!("\"\\\"\" {inner} \"\\\"\" space"),
                ));
            }
        }
        let min = obj.get("minLength").and_then(Value::as_u64);
        let max = obj.get("maxLength").and_then(Value::as_u64);
        if min.is_none() && max.is_none() {
            return Ok(self.add_primitive("string"));
        }
        self.add_primitive("char");
        let min = min.unwrap_or(0);
        let rep = match max {
            Some(max) => format!("char{{{min},{max}}}"),
            None => format!("char{{{min},}}"),
        };
        Ok(self.add_rule(
            &format!("{name}-string"),
            format!("\"\\\"\" {rep} \"\\\"\" space"),
        ))
    }

    fn visit_array(
        &mut self,
        obj: &Map<String, Value>,
        name: &str,
        depth: usize,
    ) -> Result<String, GrammarError> {
        self.add_primitive("space");
        if let Some(prefix) = obj.get("prefixItems").and_then(Value::as_array) {
            let mut parts = Vec::new();
            for (i, s) in prefix.iter().enumerate() {
                parts.push(self.visit(s, &format!("{name}-tuple-{i}"), depth + 1)?);
            }
            let body = if parts.is_empty() {
                "\"[\" space \"]\" space".to_string()
            } else {
                format!("\"[\" space {} \"]\" space", parts.join(" \",\" space "))
            };
            return Ok(self.add_rule(name, body));
        }
        let item = match obj.get("items") {
            Some(s) => self.visit(s, &format!("{name}-item"), depth + 1)?,
            None => self.add_primitive("value"),
        };
        let min = obj.get("minItems").and_then(Value::as_u64).unwrap_or(0);
        let max = obj.get("maxItems").and_then(Value::as_u64);
        let more = |lo: u64, hi: Option<u64>| match hi {
            Some(h) => format!("(\",\" space {item}){{{lo},{h}}}"),
            None => format!("(\",\" space {item}){{{lo},}}"),
        };
        let list = if max == Some(0) {
            String::new()
        } else if min == 0 {
            format!("({item} {})?", more(0, max.map(|m| m - 1)))
        } else {
            format!("{item} {}", more(min - 1, max.map(|m| m - 1)))
        };
        Ok(self.add_rule(name, format!("\"[\" space {list} \"]\" space")))
    }

    fn visit_object(
        &mut self,
        obj: &Map<String, Value>,
        name: &str,
        depth: usize,
    ) -> Result<String, GrammarError> {
        self.add_primitive("space");
        let props = obj.get("properties").and_then(Value::as_object);
        let required: Vec<&str> = obj
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let additional = obj.get("additionalProperties");
        if let Some(p) = props {
            let optional = p.keys().filter(|k| !required.contains(&k.as_str())).count();
            if p.len() > self.limits.schema_properties {
                return Err(err(format!(
                    "schema too large: an object with {} properties (limit schema_properties: {})",
                    p.len(),
                    self.limits.schema_properties
                )));
            }
            if optional > self.limits.schema_optional_properties {
                return Err(err(format!(
                    "schema too large: an object with {optional} optional properties (limit schema_optional_properties: {})",
                    self.limits.schema_optional_properties
                )));
            }
        }
        let Some(props) = props.filter(|p| !p.is_empty()) else {
            return match additional {
                Some(s @ Value::Object(_)) => {
                    let string = self.add_primitive("string");
                    let v = self.visit(s, &format!("{name}-value"), depth + 1)?;
                    let kv = format!("{string} \":\" space {v}");
                    Ok(self.add_rule(
                        name,
                        format!("\"{{\" space ({kv} (\",\" space {kv})*)? \"}}\" space"),
                    ))
                }
                Some(Value::Bool(false)) => {
                    Ok(self.add_rule(name, "\"{\" space \"}\" space".into()))
                }
                _ => Ok(self.add_primitive("object")),
            };
        };
        let mut req = Vec::new();
        let mut opt = Vec::new();
        for (key, schema) in props {
            let value = self.visit(schema, &format!("{name}-{key}"), depth + 1)?;
            let kv = self.add_rule(
                &format!("{name}-{key}-kv"),
                format!(
                    "{} space \":\" space {value}",
                    literal(&format!("\"{key}\""))
                ),
            );
            if required.contains(&key.as_str()) {
                req.push(kv);
            } else {
                opt.push(kv);
            }
        }
        if matches!(additional, Some(Value::Bool(true)) | Some(Value::Object(_))) {
            let string = self.add_primitive("string");
            let v = match additional {
                Some(s @ Value::Object(_)) => {
                    self.visit(s, &format!("{name}-additional"), depth + 1)?
                }
                _ => self.add_primitive("value"),
            };
            let extra = self.add_rule(
                &format!("{name}-additional-kv"),
                format!("{string} \":\" space {v}"),
            );
            opt.push(format!("({extra} (\",\" space {extra})*)"));
        }
        let mut body = String::from("\"{\" space ");
        if !req.is_empty() {
            body.push_str(&req.join(" \",\" space "));
            for o in &opt {
                body.push_str(&format!(" (\",\" space {o})?"));
            }
        } else if !opt.is_empty() {
            // Any in-order subset of the optional properties.
            let mut starts = Vec::new();
            for i in 0..opt.len() {
                let mut s = opt[i].clone();
                for o in &opt[i + 1..] {
                    s.push_str(&format!(" (\",\" space {o})?"));
                }
                starts.push(self.add_rule(&format!("{name}-rest-{i}"), s));
            }
            body.push_str(&format!("({})?", starts.join(" | ")));
        }
        body.push_str(" \"}\" space");
        Ok(self.add_rule(name, body))
    }
}

trait Pipe: Sized {
    fn pipe<R>(self, f: impl FnOnce(Self) -> R) -> R {
        f(self)
    }
}
impl<T> Pipe for T {}

/// Converts a JSON Schema (as JSON text) into GBNF whose start rule is `root`.
pub fn to_gbnf(schema_json: &str) -> Result<String, GrammarError> {
    let limits = crate::limits::limits();
    if schema_json.len() > limits.grammar_bytes {
        return Err(err("schema too large"));
    }
    if text_depth(schema_json) > 2 * limits.grammar_nesting + 2 {
        return Err(err("schema nested too deeply"));
    }
    let schema: Value = serde_json::from_str(schema_json)
        .map_err(|e| err(format!("Unrecognized schema: not JSON: {e}")))?;
    if json_depth(&schema) > limits.grammar_nesting {
        return Err(err("schema nested too deeply"));
    }
    let mut c = Converter {
        limits,
        nodes: 0,
        root: &schema,
        rules: Vec::new(),
        by_body: HashMap::new(),
        refs: HashMap::new(),
    };
    let top = c.visit(&schema, "root", 0)?;
    let mut out = String::new();
    match c.rules.iter().position(|(n, _)| n == "root") {
        Some(i) => {
            let root = c.rules.remove(i);
            c.rules.insert(0, root);
        }
        None => out.push_str(&format!("root ::= {top}\n")),
    }
    for (n, b) in &c.rules {
        out.push_str(&format!("{n} ::= {b}\n"));
    }
    if out.len() > limits.grammar_bytes {
        return Err(err("schema too large"));
    }
    Ok(out)
}

/// Bracket depth of JSON text (strings skipped), checked before parsing so a deep document is
/// reported as too deeply nested rather than tripping the parser's recursion limit.
fn text_depth(text: &str) -> usize {
    let (mut depth, mut max, mut in_str, mut esc) = (0usize, 0usize, false, false);
    for b in text.bytes() {
        if in_str {
            match (esc, b) {
                (true, _) => esc = false,
                (false, b'\\') => esc = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'{' | b'[' => {
                depth += 1;
                max = max.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

fn json_depth(v: &Value) -> usize {
    // Iterative, so a hostile document cannot overflow the stack.
    let mut max = 0;
    let mut stack = vec![(v, 1usize)];
    while let Some((v, d)) = stack.pop() {
        max = max.max(d);
        match v {
            Value::Object(m) => stack.extend(m.values().map(|x| (x, d + 1))),
            Value::Array(a) => stack.extend(a.iter().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    // Schemas nest two JSON levels per schema level (`properties` → name → schema).
    max / 2
}

/// Translates a JSON Schema `pattern` (an ECMA regular expression subset: literals, escapes,
/// `\d \w \s`, classes, groups, alternation, `* + ? {m,n}`; anchors are implied) into GBNF
/// that matches the string's characters as they appear inside JSON quotes.
pub fn regex_to_gbnf(pattern: &str) -> Result<String, GrammarError> {
    let chars: Vec<char> = pattern.chars().collect();
    let mut pos = 0;
    let out = regex_alt(&chars, &mut pos, 0)?;
    if pos != chars.len() {
        return Err(err(format!(
            "Unrecognized schema: unsupported pattern {pattern:?}"
        )));
    }
    Ok(out)
}

fn regex_alt(c: &[char], pos: &mut usize, depth: usize) -> Result<String, GrammarError> {
    if depth > crate::limits::limits().grammar_nesting {
        return Err(err("schema nested too deeply"));
    }
    let mut alts = vec![regex_seq(c, pos, depth)?];
    while c.get(*pos) == Some(&'|') {
        *pos += 1;
        alts.push(regex_seq(c, pos, depth)?);
    }
    Ok(if alts.len() == 1 {
        alts.pop().unwrap_or_default()
    } else {
        format!("({})", alts.join(" | "))
    })
}

fn class_char(ch: char) -> String {
    match ch {
        ']' | '[' | '\\' | '^' | '-' | '"' => format!("\\{ch}"),
        c if (c as u32) < 0x20 => format!("\\x{:02X}", c as u32),
        c => c.to_string(),
    }
}

fn escape_class(e: char) -> Option<&'static str> {
    Some(match e {
        'd' => "[0-9]",
        'w' => "[a-zA-Z0-9_]",
        's' => "[ \\t]",
        'D' => "[^0-9\"\\\\]",
        'W' => "[^a-zA-Z0-9_\"\\\\]",
        'S' => "[^ \\t\\n\"\\\\]",
        _ => return None,
    })
}

fn regex_seq(c: &[char], pos: &mut usize, depth: usize) -> Result<String, GrammarError> {
    let mut items: Vec<String> = Vec::new();
    while let Some(&ch) = c.get(*pos) {
        let atom = match ch {
            '|' | ')' => break,
            '^' | '$' => {
                *pos += 1;
                continue;
            }
            '(' => {
                *pos += 1;
                if c.get(*pos) == Some(&'?') {
                    if c.get(*pos + 1) == Some(&':') {
                        *pos += 2;
                    } else {
                        return Err(err("Unrecognized schema: unsupported group in pattern"));
                    }
                }
                let inner = regex_alt(c, pos, depth + 1)?;
                if c.get(*pos) != Some(&')') {
                    return Err(err("Unrecognized schema: unbalanced ( in pattern"));
                }
                *pos += 1;
                format!("({inner})")
            }
            '[' => {
                *pos += 1;
                let mut s = String::from("[");
                if c.get(*pos) == Some(&'^') {
                    s.push('^');
                    *pos += 1;
                }
                loop {
                    match c.get(*pos) {
                        None => {
                            return Err(err("Unrecognized schema: unterminated class in pattern"))
                        }
                        Some(']') => {
                            *pos += 1;
                            break;
                        }
                        Some('\\') => {
                            let e = *c
                                .get(*pos + 1)
                                .ok_or_else(|| err("Unrecognized schema: bad escape in pattern"))?;
                            *pos += 2;
                            match escape_class(e) {
                                Some(cls) if !cls.starts_with("[^") => {
                                    s.push_str(&cls[1..cls.len() - 1])
                                }
                                _ => s.push_str(&class_char(unescape(e))),
                            }
                        }
                        Some('-') => {
                            s.push('-');
                            *pos += 1;
                        }
                        Some(&x) => {
                            s.push_str(&class_char(x));
                            *pos += 1;
                        }
                    }
                }
                s.push(']');
                s
            }
            '.' => {
                *pos += 1;
                "[^\"\\\\\\x00-\\x1F]".to_string()
            }
            '\\' => {
                let e = *c
                    .get(*pos + 1)
                    .ok_or_else(|| err("Unrecognized schema: bad escape in pattern"))?;
                *pos += 2;
                match escape_class(e) {
                    Some(cls) => cls.to_string(),
                    None => literal_json_char(unescape(e)),
                }
            }
            '*' | '+' | '?' | '{' => {
                return Err(err("Unrecognized schema: dangling quantifier in pattern"))
            }
            x => {
                *pos += 1;
                literal_json_char(x)
            }
        };
        let quant = match c.get(*pos) {
            Some('*') => {
                *pos += 1;
                "*".to_string()
            }
            Some('+') => {
                *pos += 1;
                "+".to_string()
            }
            Some('?') => {
                *pos += 1;
                "?".to_string()
            }
            Some('{') => {
                let end = c[*pos..]
                    .iter()
                    .position(|&x| x == '}')
                    .ok_or_else(|| err("Unrecognized schema: bad {} in pattern"))?;
                let q: String = c[*pos..*pos + end + 1].iter().collect();
                *pos += end + 1;
                q
            }
            _ => String::new(),
        };
        items.push(format!("{atom}{quant}"));
    }
    Ok(if items.is_empty() {
        "\"\"".into()
    } else {
        items.join(" ")
    })
}

fn unescape(e: char) -> char {
    match e {
        'n' => '\n',
        't' => '\t',
        'r' => '\r',
        other => other,
    }
}

/// A GBNF expression for one character as it is written inside a JSON string.
fn literal_json_char(ch: char) -> String {
    match ch {
        '"' => "\"\\\\\\\"\"".to_string(),
        '\\' => "\"\\\\\\\\\"".to_string(),
        '\n' => "\"\\\\n\"".to_string(),
        '\t' => "\"\\\\t\"".to_string(),
        c => literal(&c.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::gbnf;

    fn ok(schema: &str) -> String {
        let g = to_gbnf(schema).unwrap();
        gbnf::parse(&g, "root").unwrap_or_else(|e| panic!("{schema}: {}\n{g}", e.0));
        g
    }

    #[test]
    fn converts_common_schemas() {
        let g = ok(
            r#"{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer","minimum":0}},"required":["name","age"]}"#,
        );
        assert!(g.starts_with("root ::= "), "{g}");
        ok(r#"{"type":"array","items":{"type":"number"},"minItems":1,"maxItems":3}"#);
        ok(r#"{"enum":["a","b",1,null]}"#);
        ok(r#"{"const":{"x":1}}"#);
        ok(r#"{"anyOf":[{"type":"string"},{"type":"null"}]}"#);
        ok(r#"{"type":["string","integer"]}"#);
        ok(r#"{"type":"string","pattern":"^[A-Z]{2}-\\d{3}$"}"#);
        ok(r#"{"type":"string","format":"date-time"}"#);
        ok(
            r##"{"$defs":{"n":{"type":"object","properties":{"next":{"$ref":"#/$defs/n"}}}},"$ref":"#/$defs/n"}"##,
        );
        ok(r#"{"type":"object","properties":{"a":{"type":"string"},"b":{"type":"boolean"}}}"#);
        ok(r#"{"type":"object","additionalProperties":{"type":"integer"}}"#);
        ok(
            r#"{"allOf":[{"properties":{"a":{"type":"string"}},"required":["a"]},{"properties":{"b":{"type":"null"}}}]}"#,
        );
        ok("{}");
    }

    #[test]
    fn contract_errors() {
        assert!(to_gbnf(r#"{"type":"frob"}"#)
            .unwrap_err()
            .0
            .contains("Unrecognized schema"));
        assert!(to_gbnf(r##"{"$ref":"#/$defs/missing"}"##)
            .unwrap_err()
            .0
            .contains("Error resolving ref"));
        let mut deep = String::from(r#"{"type":"string"}"#);
        for _ in 0..70 {
            deep = format!(r#"{{"type":"object","properties":{{"a":{deep}}}}}"#);
        }
        assert_eq!(to_gbnf(&deep).unwrap_err().0, "schema nested too deeply");
        let big = format!(
            r#"{{"enum":["{}"]}}"#,
            "a".repeat(crate::limits::DEFAULT_LIMITS.grammar_bytes)
        );
        assert_eq!(to_gbnf(&big).unwrap_err().0, "schema too large");
    }
}
