//! Renders chat templates for `LlamaCppEx.Chat` in a process of its own.
//!
//! A chat template comes from the model file, which may come from the internet. Rendering it
//! is bounded inside the renderer (minijinja fuel, an output limit, value nesting; see
//! `llama_cpp_ex_engine::chat`), but minijinja materialises some values before it can charge
//! for them (a lazily repeated list turned into a string), and an allocation failure aborts a
//! process. So templates are rendered here, not in the BEAM: this process runs under an
//! address-space limit and a watchdog, and if a template takes it down the BEAM only sees the
//! port close and answers that request with an error.
//!
//! Protocol (an Erlang port with `{:packet, 4}`): each request is a 4-byte big-endian length
//! and a JSON object `{"template", "messages", "add_generation_prompt", "enable_thinking",
//! "bos_token", "eos_token", "kwargs": {..}, "limits": {"template_fuel",
//! "template_output_bytes", "template_value_depth"}, "deadline_ms"}`; each reply is a length,
//! a tag byte (0 = the prompt follows, 1 = an error message follows) and UTF-8 bytes.

use llama_cpp_ex_engine::chat::{apply_template, ChatRequest};
use llama_cpp_ex_engine::limits::{limits, set_limits, Limits};
use std::io::{Read, Write};
use std::sync::mpsc;
use std::time::Duration;

/// Address space this process may use (the renderer's fuel bounds a render far below it; the
/// limit catches what fuel does not charge).
const ADDRESS_SPACE: u64 = 2 << 30;
/// Longest a render may run when the request gives no deadline.
const DEFAULT_DEADLINE_MS: u64 = 10_000;
/// Largest request accepted (the template and the messages).
const MAX_REQUEST: usize = 64 << 20;

fn main() {
    limit_resources();
    let watchdog = start_watchdog();
    let mut input = std::io::stdin().lock();
    let mut output = std::io::stdout().lock();
    loop {
        let mut len = [0u8; 4];
        if input.read_exact(&mut len).is_err() {
            return;
        }
        let len = u32::from_be_bytes(len) as usize;
        if len > MAX_REQUEST {
            reply(
                &mut output,
                Err(format!("request of {len} bytes is too large")),
            );
            return;
        }
        let mut payload = vec![0u8; len];
        if input.read_exact(&mut payload).is_err() {
            return;
        }
        let result = serde_json::from_slice::<serde_json::Value>(&payload)
            .map_err(|e| format!("bad request: {e}"))
            .and_then(|request| {
                let deadline = request["deadline_ms"]
                    .as_u64()
                    .unwrap_or(DEFAULT_DEADLINE_MS);
                let _ = watchdog.send(Some(Duration::from_millis(deadline)));
                let result = render(&request);
                let _ = watchdog.send(None);
                result
            });
        if !reply(&mut output, result) {
            return;
        }
    }
}

fn render(request: &serde_json::Value) -> Result<String, String> {
    let text = |key: &str| request[key].as_str().unwrap_or("");
    let flag = |key: &str| request[key].as_bool().unwrap_or(false);
    let messages = request["messages"]
        .as_array()
        .ok_or("bad request: messages must be a list")?;
    let kwargs: Vec<(String, serde_json::Value)> = request["kwargs"]
        .as_object()
        .map(|o| o.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let given = &request["limits"];
    let number = |key: &str, default: u64| given[key].as_u64().unwrap_or(default);
    let current = limits();
    set_limits(Limits {
        template_fuel: number("template_fuel", current.template_fuel),
        template_output_bytes: number(
            "template_output_bytes",
            current.template_output_bytes as u64,
        ) as usize,
        template_value_depth: number("template_value_depth", current.template_value_depth as u64)
            as usize,
        ..current
    })?;
    let req = ChatRequest {
        messages,
        add_generation_prompt: flag("add_generation_prompt"),
        enable_thinking: flag("enable_thinking"),
        bos_token: text("bos_token"),
        eos_token: text("eos_token"),
        kwargs: &kwargs,
    };
    apply_template(text("template"), &req).map_err(|e| e.to_string())
}

/// Writes one reply; `false` when the port is gone.
fn reply(out: &mut impl Write, result: Result<String, String>) -> bool {
    let (tag, body) = match &result {
        Ok(prompt) => (0u8, prompt.as_bytes()),
        Err(message) => (1u8, message.as_bytes()),
    };
    let len = (body.len() + 1) as u32;
    out.write_all(&len.to_be_bytes())
        .and_then(|_| out.write_all(&[tag]))
        .and_then(|_| out.write_all(body))
        .and_then(|_| out.flush())
        .is_ok()
}

/// A thread that aborts the process when a render outlives its deadline: `Some(deadline)`
/// starts a render, `None` ends it.
fn start_watchdog() -> mpsc::Sender<Option<Duration>> {
    let (tx, rx) = mpsc::channel::<Option<Duration>>();
    std::thread::spawn(move || {
        while let Ok(message) = rx.recv() {
            let Some(deadline) = message else { continue };
            match rx.recv_timeout(deadline) {
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    eprintln!("llama_cpp_ex_render: a render ran past {deadline:?}");
                    std::process::abort();
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
    });
    tx
}

fn limit_resources() {
    #[cfg(unix)]
    // SAFETY: setrlimit only changes this process's own limits; the structs are fully
    // initialised.
    unsafe {
        let address = libc::rlimit {
            rlim_cur: ADDRESS_SPACE,
            rlim_max: ADDRESS_SPACE,
        };
        libc::setrlimit(libc::RLIMIT_AS, &address);
        let no_core = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &no_core);
    }
}
