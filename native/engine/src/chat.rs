//! Chat templates: the GGUF's Jinja `tokenizer.chat_template` rendered with minijinja (with
//! Python string methods, `raise_exception`, `strftime_now`, `tojson`), or a built-in template
//! chosen by architecture when the file carries none.

use crate::error::{EngineError, Result};
use minijinja::{context, Environment, Error, ErrorKind, Value};

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
    pub messages: &'a [(String, String)],
    pub add_generation_prompt: bool,
    pub enable_thinking: bool,
    pub bos_token: &'a str,
    pub eos_token: &'a str,
    /// Extra template variables (`chat_template_kwargs`), as JSON values.
    pub kwargs: &'a [(String, serde_json::Value)],
}

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
        serde_json::Value::Object(o) => {
            Value::from_iter(o.iter().map(|(k, v)| (k.clone(), json_value(v))))
        }
    }
}

/// Renders `template` for `req`.
pub fn apply_template(template: &str, req: &ChatRequest) -> Result<String> {
    let fail = |e: Error| EngineError::Template(format!("{e:#}"));
    let mut env = Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_template("chat", template).map_err(fail)?;
    let messages: Vec<Value> = req
        .messages
        .iter()
        .map(|(role, content)| context! { role => role, content => content })
        .collect();
    let mut vars: std::collections::BTreeMap<String, Value> = std::collections::BTreeMap::new();
    for (k, v) in req.kwargs {
        vars.insert(k.clone(), json_value(v));
    }
    let base = context! {
        messages => messages,
        add_generation_prompt => req.add_generation_prompt,
        enable_thinking => req.enable_thinking,
        bos_token => req.bos_token,
        eos_token => req.eos_token,
    };
    let ctx = context! { ..Value::from(vars), ..base };
    env.get_template("chat")
        .and_then(|t| t.render(ctx))
        .map_err(fail)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(r, c)| (r.to_string(), c.to_string()))
            .collect()
    }

    fn req<'a>(
        m: &'a [(String, String)],
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

    #[test]
    fn strftime_formats_known_dates() {
        assert_eq!(strftime(0, "%d %b %Y %H:%M:%S"), "01 Jan 1970 00:00:00");
        assert_eq!(
            strftime(1_700_000_000, "%Y-%m-%d %B"),
            "2023-11-14 November"
        );
    }
}
