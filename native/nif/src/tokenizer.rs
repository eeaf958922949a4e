//! Tokenization and vocabulary queries.

use crate::error::{binary, guard, message, Out};
use crate::model::ModelRes;
use rustler::{Binary, Env, ResourceArc, Term};

#[rustler::nif(schedule = "DirtyCpu")]
fn tokenize(
    m: ResourceArc<ModelRes>,
    text: Binary,
    add_special: bool,
    parse_special: bool,
) -> Out<Vec<u32>> {
    guard(|| {
        let text = std::str::from_utf8(text.as_slice())
            .map_err(|e| message(format!("tokenize failed: text is not valid UTF-8 ({e})")))?;
        Ok(m.model.tokenizer.encode(text, add_special, parse_special)?)
    })
}

#[rustler::nif(schedule = "DirtyCpu")]
fn detokenize<'a>(env: Env<'a>, m: ResourceArc<ModelRes>, ids: Vec<u32>) -> Out<Term<'a>> {
    guard(|| Ok(binary(env, &m.model.tokenizer.detokenize(&ids)?)))
}

#[rustler::nif]
fn token_to_piece<'a>(env: Env<'a>, m: ResourceArc<ModelRes>, id: u32) -> Out<Term<'a>> {
    guard(|| Ok(binary(env, m.model.tokenizer.token_to_piece(id)?)))
}

#[rustler::nif]
fn vocab_is_eog(m: ResourceArc<ModelRes>, token: u32) -> bool {
    m.model.tokenizer.is_eog(token)
}
