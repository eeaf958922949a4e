//! Chat templates: the GGUF's Jinja `tokenizer.chat_template` rendered with minijinja (with
//! Python string methods, `raise_exception`, `strftime_now`, `tojson`), or a built-in template
//! chosen by architecture when the file carries none.

use crate::error::{EngineError, Result};
use minijinja::{Environment, Error, ErrorKind, Value};

/// llama.cpp's built-in Gemma format: system text merged into the first user turn,
/// "assistant" spelled "model", contents trimmed.
const GEMMA_TEMPLATE: &str = "{%- set ns = namespace(system='') -%}\
{%- for m in messages -%}\
{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + (m['content'] | trim) -%}\
{%- else -%}\
{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}\
{{ '<start_of_turn>' + role + '\\n' }}\
{%- if ns.system != '' and role != 'model' -%}{{ ns.system + '\\n\\n' }}{%- set ns.system = '' -%}{%- endif -%}\
{{ (m['content'] | trim) + '<end_of_turn>\\n' }}\
{%- endif -%}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}";

/// ChatML, the generic fallback.
const CHATML_TEMPLATE: &str = "{%- for m in messages -%}\
{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}";

/// The template used for an architecture whose GGUF has none.
pub fn builtin_template(arch: &str) -> &'static str {
    match arch {
        "gemma" | "gemma2" | "gemma3" => GEMMA_TEMPLATE,
        _ => CHATML_TEMPLATE,
    }
}

pub struct ChatRequest<'a> {
    /// Messages as JSON objects: `role` and `content` (a string, `null`, or structured parts)
    /// plus any other fields a template reads (`tool_calls`, `name`, `tool_call_id`, ...).
    pub messages: &'a [serde_json::Value],
    pub add_generation_prompt: bool,
    pub enable_thinking: bool,
    pub bos_token: &'a str,
    pub eos_token: &'a str,
    /// Extra template variables (`chat_template_kwargs`), as JSON values. They may set
    /// `enable_thinking`, not the variables the renderer owns ([`RESERVED_VARIABLES`]).
    pub kwargs: &'a [(String, serde_json::Value)],
}

/// Template variables that `chat_template_kwargs` cannot replace.
pub const RESERVED_VARIABLES: &[&str] = &[
    "messages",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

fn raise_exception(msg: String) -> std::result::Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(format)` for the common directives, in UTC.
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(secs, &fmt)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

fn strftime(secs: i64, fmt: &str) -> String {
    // Howard Hinnant's civil-from-days.
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

fn json_value(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(i) => Value::from(i),
            None => Value::from(n.as_f64().unwrap_or(0.0)),
        },
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(a) => Value::from(a.iter().map(json_value).collect::<Vec<_>>()),
        serde_json::Value::Object(o) => Value::from_object(JsonObject(
            o.iter()
                .map(|(k, v)| (Value::from(k.as_str()), json_value(v)))
                .collect(),
        )),
    }
}

/// A JSON object as a template map that keeps its keys in document order (tool schemas are
/// printed with `tojson` in the order they were given).
#[derive(Debug)]
struct JsonObject(Vec<(Value, Value)>);

impl minijinja::value::Object for JsonObject {
    fn repr(self: &std::sync::Arc<Self>) -> minijinja::value::ObjectRepr {
        minijinja::value::ObjectRepr::Map
    }

    fn get_value(self: &std::sync::Arc<Self>, key: &Value) -> Option<Value> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &std::sync::Arc<Self>) -> minijinja::value::Enumerator {
        minijinja::value::Enumerator::Values(self.0.iter().map(|(k, _)| k.clone()).collect())
    }
}

/// A message whose tool calls carry their `arguments` as a JSON string (the OpenAI wire form)
/// with those arguments parsed: Hugging Face templates print them with `tojson` and expect an
/// object (llama.cpp and transformers parse them the same way). Arguments that are not valid
/// JSON stay strings.
fn tool_arguments_as_objects(message: &serde_json::Value) -> serde_json::Value {
    let mut m = message.clone();
    if let Some(calls) = m.get_mut("tool_calls").and_then(|c| c.as_array_mut()) {
        // `get_mut` rather than indexing: indexing a non-object for writing panics
        let args = calls
            .iter_mut()
            .filter_map(|c| c.get_mut("function")?.get_mut("arguments"));
        for args in args {
            if let Some(parsed) = args
                .as_str()
                .and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok())
            {
                *args = parsed;
            }
        }
    }
    m
}

/// Renders `template` for `req` within [`crate::limits::Limits`]: minijinja fuel bounds the
/// work and the data a render may create (about one fuel per instruction and per 64 bytes),
/// the prompt may not exceed `template_output_bytes`, values printed or serialised may not nest
/// deeper than `template_value_depth`, and the few Python string methods whose output size
/// depends on their arguments are charged before they allocate. The render runs on a thread
/// with a large stack ([`crate::stack`]): the nesting a render can build is bounded by its
/// fuel, and minijinja walks nested values recursively.
pub fn apply_template(template: &str, req: &ChatRequest) -> Result<String> {
    let limits = crate::limits::limits();
    if let Some((k, _)) = req
        .kwargs
        .iter()
        .find(|(k, _)| RESERVED_VARIABLES.contains(&k.as_str()))
    {
        return Err(EngineError::Template(format!(
            "chat_template_kwargs cannot set {k}"
        )));
    }
    crate::stack::on_deep_stack(|| render(template, req, &limits)).map_err(EngineError::Template)?
}

/// Prepares the messages as llama.cpp does before rendering: tool-call arguments parsed, and
/// a leading system message folded into the next message (`system + "\n" + content`) when the
/// template ignores or rejects the system role (Gemma's), found by rendering a probe.
fn render(template: &str, req: &ChatRequest, limits: &crate::limits::Limits) -> Result<String> {
    let mut messages: Vec<serde_json::Value> =
        req.messages.iter().map(tool_arguments_as_objects).collect();
    if messages.first().is_some_and(|m| m["role"] == "system")
        && !supports_system_role(template, req, limits)
    {
        let system = messages.remove(0);
        if let Some(next) = messages.first_mut() {
            if let (Some(sys), Some(content)) =
                (system["content"].as_str(), next["content"].as_str())
            {
                next["content"] = serde_json::Value::String(format!("{sys}\n{content}"));
            }
        }
    }
    render_messages(template, &messages, req, limits)
}

/// Whether the template prints a system message's content.
fn supports_system_role(template: &str, req: &ChatRequest, limits: &crate::limits::Limits) -> bool {
    const MARKER: &str = "\u{1}system-probe\u{1}";
    let probe = [
        serde_json::json!({"role": "system", "content": MARKER}),
        serde_json::json!({"role": "user", "content": "x"}),
    ];
    render_messages(template, &probe, req, limits).is_ok_and(|out| out.contains(MARKER))
}

fn render_messages(
    template: &str,
    messages: &[serde_json::Value],
    req: &ChatRequest,
    limits: &crate::limits::Limits,
) -> Result<String> {
    let fail = |e: Error| EngineError::Template(format!("{e:#}"));
    let depth = limits.template_value_depth;
    let mut env = Environment::new();
    env.set_fuel(Some(limits.template_fuel));
    env.set_unknown_method_callback(guarded_methods);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter(
        "tojson",
        move |state: &minijinja::State,
              value: &Value,
              indent: Option<Value>,
              kwargs: minijinja::value::Kwargs| {
            walk_value(state, value, depth)?;
            minijinja::filters::tojson(value, indent, kwargs)
        },
    );
    env.add_filter("string", move |state: &minijinja::State, value: &Value| {
        walk_value(state, value, depth)?;
        minijinja::filters::string(state, value)
    });
    // Debug formatting indents every level (quadratic output); chat templates do not use it
    env.remove_filter("pprint");
    env.set_formatter(move |out, state, value| {
        walk_value(state, value, depth)?;
        minijinja::escape_formatter(out, state, value)
    });
    env.add_template("chat", template).map_err(fail)?;
    let messages: Vec<Value> = messages.iter().map(json_value).collect();
    let mut vars: std::collections::BTreeMap<String, Value> = std::collections::BTreeMap::new();
    vars.insert("enable_thinking".into(), Value::from(req.enable_thinking));
    for (k, v) in req.kwargs {
        vars.insert(k.clone(), json_value(v));
    }
    vars.insert("messages".into(), Value::from(messages));
    vars.insert(
        "add_generation_prompt".into(),
        Value::from(req.add_generation_prompt),
    );
    vars.insert("bos_token".into(), Value::from(req.bos_token));
    vars.insert("eos_token".into(), Value::from(req.eos_token));
    let mut out = CappedWriter {
        buf: Vec::new(),
        cap: limits.template_output_bytes,
    };
    env.get_template("chat")
        .and_then(|t| t.render_captured_to(Value::from(vars), &mut out).map(drop))
        .map_err(|e| {
            if out.buf.len() >= out.cap {
                EngineError::Template(format!(
                    "the rendered prompt exceeds {} bytes (limit template_output_bytes)",
                    out.cap
                ))
            } else {
                fail(e)
            }
        })?;
    String::from_utf8(out.buf)
        .map_err(|_| EngineError::Template("the rendered prompt is not valid UTF-8".into()))
}

/// Collects rendered output, failing once it would exceed `cap` bytes.
struct CappedWriter {
    buf: Vec<u8>,
    cap: usize,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > self.cap {
            self.buf.resize(self.cap, 0);
            return Err(std::io::Error::other("output limit"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Walks `value` before it is printed or serialised (which minijinja does recursively and
/// only charges for afterwards): fails when it nests deeper than `max`, and charges one fuel
/// per item plus one per 64 bytes of every string in it, so a huge (lazily repeated) list
/// runs out of fuel here instead of being turned into gigabytes of text. No recursion: a stack
/// of iterators, at most `max` deep.
fn walk_value(
    state: &minijinja::State,
    value: &Value,
    max: usize,
) -> std::result::Result<(), Error> {
    use minijinja::value::ValueKind;
    let too_deep = || {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("value nested deeper than {max} levels (limit template_value_depth)"),
        )
    };
    let mut stack: Vec<(Value, minijinja::value::ValueIter)> = Vec::new();
    let visit = |v: Value, stack: &mut Vec<(Value, minijinja::value::ValueIter)>| {
        if let Some(s) = v.as_str() {
            state.consume_fuel(1 + s.len() as u64 / 64)?;
        } else {
            state.consume_fuel(1)?;
        }
        if matches!(
            v.kind(),
            ValueKind::Seq | ValueKind::Iterable | ValueKind::Map
        ) {
            if stack.len() == max {
                return Err(too_deep());
            }
            if let Ok(items) = v.try_iter() {
                stack.push((v, items));
            }
        }
        Ok(())
    };
    visit(value.clone(), &mut stack)?;
    while let Some((container, items)) = stack.last_mut() {
        match items.next() {
            None => {
                stack.pop();
            }
            Some(item) => {
                let child = if container.kind() == ValueKind::Map {
                    container.get_item(&item).unwrap_or_default()
                } else {
                    item
                };
                visit(child, &mut stack)?;
            }
        }
    }
    Ok(())
}

/// Python string methods (minijinja-contrib's `pycompat`), with the output of `replace`,
/// `join` and `format` paid for in fuel before it is built: their size is a product of their
/// arguments' sizes (a separator joined between many items, a replacement for many matches, a
/// field width), which fuel charged for the arguments alone would not bound.
fn guarded_methods(
    state: &mut minijinja::State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let arg = |i: usize| args.get(i).and_then(Value::as_str);
        let bytes: Option<u64> = match method {
            "replace" => match (arg(0), arg(1)) {
                (Some(old), Some(new)) => {
                    let n = if old.is_empty() {
                        s.chars().count() + 1
                    } else {
                        s.matches(old).count()
                    };
                    Some(s.len() as u64 + n as u64 * new.len() as u64)
                }
                _ => None,
            },
            "join" => args.first().and_then(|items| items.len()).map(|n| {
                let items: u64 = args[0]
                    .try_iter()
                    .map(|it| it.map(|x| x.to_string().len() as u64).sum())
                    .unwrap_or(0);
                items + n as u64 * s.len() as u64
            }),
            "format" => Some(s.len() as u64 + format_widths(s)),
            _ => None,
        };
        if let Some(bytes) = bytes {
            state.consume_fuel(bytes / 64 + 1)?;
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// The sum of the numbers in `{...}` replacement fields of a `str.format` string (widths and
/// precisions, an upper bound of the padding they can ask for).
fn format_widths(s: &str) -> u64 {
    let mut total = 0u64;
    let mut in_field = false;
    let mut number = 0u64;
    for c in s.chars() {
        match c {
            '{' => in_field = true,
            '}' => in_field = false,
            _ if in_field => {
                if let Some(d) = c.to_digit(10) {
                    number = number.saturating_mul(10).saturating_add(d as u64);
                    continue;
                }
            }
            _ => {}
        }
        total = total.saturating_add(number);
        number = 0;
    }
    total.saturating_add(number)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(pairs: &[(&str, &str)]) -> Vec<serde_json::Value> {
        pairs
            .iter()
            .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
            .collect()
    }

    fn req<'a>(
        m: &'a [serde_json::Value],
        kwargs: &'a [(String, serde_json::Value)],
    ) -> ChatRequest<'a> {
        ChatRequest {
            messages: m,
            add_generation_prompt: true,
            enable_thinking: true,
            bos_token: "<s>",
            eos_token: "</s>",
            kwargs,
        }
    }

    #[test]
    fn gemma_builtin_merges_system_into_the_first_user_turn() {
        let m = msgs(&[
            ("system", " Be brief. "),
            ("user", "Hi"),
            ("assistant", "Hello"),
            ("user", "Bye"),
        ]);
        let out = apply_template(GEMMA_TEMPLATE, &req(&m, &[])).unwrap();
        assert_eq!(
            out,
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
    }

    #[test]
    fn python_methods_exceptions_kwargs_and_dates() {
        let t = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}\
                 {{ messages[0]['content'].strip().upper() }}|{{ custom }}|{{ messages | tojson }}|{{ strftime_now('%Y') | length }}";
        let m = msgs(&[("user", "  hi  ")]);
        let kw = vec![("custom".to_string(), serde_json::json!("x"))];
        let out = apply_template(t, &req(&m, &kw)).unwrap();
        assert!(out.starts_with("HI|x|[{"), "{out}");
        assert!(out.ends_with("|4"));
        let m = msgs(&[("assistant", "no")]);
        let err = apply_template(t, &req(&m, &[])).unwrap_err().to_string();
        assert!(err.contains("first must be user"), "{err}");
        assert!(apply_template("{% for %}", &req(&m, &[])).is_err());
    }

    /// Renders a template with no messages' influence; the error text when it fails.
    fn render_err(t: &str) -> String {
        let m = msgs(&[("user", "hi")]);
        apply_template(t, &req(&m, &[])).unwrap_err().to_string()
    }

    #[test]
    fn hostile_templates_fail_within_their_limits() {
        // a deeply nested value serialised or printed
        let nest = "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}";
        let e = render_err(&format!("{nest}{{{{ ns.x|tojson|length }}}}"));
        assert!(e.contains("template_value_depth"), "{e}");
        let e = render_err(&format!("{nest}{{{{ ns.x }}}}"));
        assert!(e.contains("template_value_depth"), "{e}");
        // doubling a string 40 times, huge widths, nested loops: out of fuel
        let e = render_err("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}");
        assert!(e.contains("fuel"), "{e}");
        for t in [
            "{{ '%09999999999d'|format(1) }}",
            "{{ ('%0999999999d'|format(1))|length }}",
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
            "{{ ('a' * 100000).replace('a', 'b' * 100000)|length }}",
            "{{ ('b' * 1000000).join(range(100000))|length }}",
            "{{ '{:>999999999}'.format(1)|length }}",
        ] {
            let e = render_err(t);
            assert!(e.contains("fuel"), "{t}: {e}");
        }
        // output past the prompt limit
        let limits = crate::limits::limits();
        let big = "x".repeat(limits.template_output_bytes + 10);
        let m = msgs(&[("user", &big)]);
        let e = apply_template("{{ messages[0].content }}", &req(&m, &[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("template_output_bytes"), "{e}");
    }

    #[test]
    fn kwargs_cannot_replace_the_messages() {
        let m = msgs(&[("user", "hi")]);
        let kw = vec![("messages".to_string(), serde_json::json!([]))];
        let e = apply_template("{{ messages|length }}", &req(&m, &kw)).unwrap_err();
        assert!(e.to_string().contains("cannot set messages"), "{e}");
        // enable_thinking may be set through kwargs, as in llama.cpp
        let kw = vec![("enable_thinking".to_string(), serde_json::json!(false))];
        let t = "{% if enable_thinking %}on{% else %}off{% endif %}";
        assert_eq!(apply_template(t, &req(&m, &kw)).unwrap(), "off");
    }

    #[test]
    fn structured_content_and_extra_fields_reach_the_template() {
        let m = vec![serde_json::json!({
            "role": "assistant",
            "content": [{"type": "text", "text": "part"}],
            "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]
        })];
        let t = "{{ messages[0].content[0].text }} {{ messages[0].tool_calls[0].function.name }}";
        assert_eq!(apply_template(t, &req(&m, &[])).unwrap(), "part f");
    }

    #[test]
    fn strftime_formats_known_dates() {
        assert_eq!(strftime(0, "%d %b %Y %H:%M:%S"), "01 Jan 1970 00:00:00");
        assert_eq!(
            strftime(1_700_000_000, "%Y-%m-%d %B"),
            "2023-11-14 November"
        );
    }
}
