//! The blocking generation loop of `LlamaCppEx.Context.generate/4` and its cancel flags.

use crate::context::ContextRes;
use crate::error::{binary, guard, lock, message, Out};
use crate::sampler::SamplerRes;
use rustler::{Atom, Env, ResourceArc, Term};
use std::sync::atomic::{AtomicBool, Ordering};

pub struct CancelFlag {
    flag: AtomicBool,
}

#[rustler::resource_impl]
impl rustler::Resource for CancelFlag {}

#[rustler::nif]
fn cancel_flag_new() -> ResourceArc<CancelFlag> {
    ResourceArc::new(CancelFlag {
        flag: AtomicBool::new(false),
    })
}

#[rustler::nif]
fn request_cancel(flag: ResourceArc<CancelFlag>) -> Atom {
    flag.flag.store(true, Ordering::Relaxed);
    crate::atoms::ok()
}

/// Evaluates `prompt` from an empty sequence 0 and generates up to `max_tokens` tokens; the
/// cancel flag is checked before every forward pass (cancelling returns the text so far).
#[rustler::nif(schedule = "DirtyCpu")]
fn generate<'a>(
    env: Env<'a>,
    c: ResourceArc<ContextRes>,
    s: ResourceArc<SamplerRes>,
    prompt: Vec<u32>,
    max_tokens: usize,
    cancel: ResourceArc<CancelFlag>,
) -> Out<Term<'a>> {
    guard(|| {
        if max_tokens == 0 {
            return Err(message("max_tokens must be positive"));
        }
        let mut ctx = lock(&c.ctx);
        let mut sampler = lock(&s.sampler);
        let model = ctx.model.clone();
        let mut text = Vec::new();
        ctx.generate(
            &mut sampler,
            &prompt,
            max_tokens,
            Some(&cancel.flag),
            |t, eog, _| {
                if !eog {
                    text.extend_from_slice(model.tokenizer.token_to_piece(t).unwrap_or(&[]));
                }
                true
            },
        )?;
        Ok(binary(env, &text))
    })
}
