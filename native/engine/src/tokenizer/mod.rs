//! Tokenizers rebuilt from GGUF metadata alone, matching llama.cpp id for id.
//!
//! * `gpt2` vocabularies: byte-level BPE with the merges stored in the file and the
//!   pre-tokenizer named by `tokenizer.ggml.pre`.
//! * `llama` vocabularies (SentencePiece style, with scores): llama.cpp's SPM bigram merging
//!   (`Spm`): characters merge pairwise, best-scoring vocabulary token first, then leftover
//!   characters fall back to byte tokens; spaces are written as "▁". Implemented here rather
//!   than through the tokenizers crate, whose BPE would need every split of every token as a
//!   merge (millions of string pairs on a 262k vocabulary, ~200 MB while building).
//!
//! Special tokens are split out of the text before the BPE runs, longest first, the way
//! llama.cpp's `tokenizer_st_partition` does: control and unknown tokens only when
//! `parse_special` is on, user-defined tokens always.

//!
//! `gguf.rs` and `hf.rs` build a tokenizer from a GGUF file's metadata or a checkpoint's
//! `tokenizer.json`; `spm.rs` is the SentencePiece algorithm. This module encodes and decodes
//! with whichever was built.

mod gguf;
mod hf;
mod spm;

use crate::error::{EngineError, Result};
use crate::gguf::StrArray;
use spm::Spm;
use std::collections::HashMap;
use tokenizers::Tokenizer as HfTokenizer;

pub type TokenId = u32;

const SPM_SPACE: &str = "\u{2581}";

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_code(code: u64) -> Self {
        match code {
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Normal,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabKind {
    /// Byte-level BPE (GPT-2 style).
    Gpt2,
    /// SentencePiece-style vocabulary with scores.
    Spm,
    /// BERT's WordPiece ("##" continuations); from tokenizer.json only.
    Wpm,
}

/// What a Hugging Face checkpoint says about its special tokens outside tokenizer.json
/// (`tokenizer_config.json`, `generation_config.json`).
#[derive(Debug, Clone, Default)]
pub struct HfSpecials {
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    /// `generation_config.json`'s `eos_token_id`s: each ends a generation.
    pub eos_ids: Vec<TokenId>,
}

/// The pieces [`Tokenizer::assemble`] builds a tokenizer from.
struct Parts {
    kind: VocabKind,
    tokens: StrArray,
    types: Vec<TokenType>,
    model: TextModel,
    bos: Option<TokenId>,
    eos: Option<TokenId>,
    extra_eog: Vec<TokenId>,
    add_bos: bool,
    add_eos: bool,
    sep: Option<TokenId>,
    add_sep: bool,
    add_space_prefix: bool,
}

/// Token texts that llama.cpp detects as end-of-generation besides EOS/EOT/EOM; it also
/// forces them to be control tokens (so they are only parsed with `parse_special`).
const EOG_TEXTS: &[&str] = &[
    "</s>",
    "<|return|>",
    "<|call|>",
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

pub struct Tokenizer {
    kind: VocabKind,
    tokens: StrArray,
    types: Vec<TokenType>,
    /// Raw bytes each token renders as (special tokens render as their text), back to back.
    pieces: Vec<u8>,
    piece_ends: Vec<usize>,
    /// Special tokens considered by the partition step, longest text first.
    specials: Vec<(String, TokenId, TokenType)>,
    model: TextModel,
    pub bos: Option<TokenId>,
    pub eos: Option<TokenId>,
    pub add_bos: bool,
    pub add_eos: bool,
    /// BERT's separator: closes a WordPiece input and, with `add_sep`, separates a
    /// reranker's query from its document.
    pub sep: Option<TokenId>,
    pub add_sep: bool,
    add_space_prefix: bool,
    eog: Vec<TokenId>,
}

/// What turns a fragment of plain text into ids.
enum TextModel {
    Bpe(Box<HfTokenizer>),
    Spm(Box<Spm>),
}

fn meta_err(msg: impl Into<String>) -> EngineError {
    EngineError::UnsupportedTokenizer(msg.into())
}

/// GPT-2's byte → unicode table (printable bytes map to themselves).
fn byte_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap_or('\0')
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\0');
            n += 1;
            c
        };
    }
    table
}

fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl Tokenizer {
    fn assemble(p: Parts) -> Self {
        let Parts {
            kind,
            tokens,
            mut types,
            model,
            bos,
            eos,
            extra_eog,
            add_bos,
            add_eos,
            sep,
            add_sep,
            add_space_prefix,
        } = p;
        for (i, t) in tokens.iter().enumerate() {
            if EOG_TEXTS.contains(&t) {
                types[i] = TokenType::Control;
            }
        }

        let b2u = byte_to_unicode();
        let mut u2b: HashMap<char, u8> = HashMap::with_capacity(256);
        for (b, c) in b2u.iter().enumerate() {
            u2b.insert(*c, b as u8);
        }
        let mut pieces: Vec<u8> = Vec::new();
        let mut piece_ends: Vec<usize> = Vec::with_capacity(tokens.len());
        for (text, ty) in tokens.iter().zip(&types) {
            match (kind, ty) {
                (_, TokenType::Control | TokenType::Unknown | TokenType::UserDefined) => {
                    pieces.extend_from_slice(text.as_bytes())
                }
                (VocabKind::Gpt2, _) => {
                    for c in text.chars() {
                        match u2b.get(&c) {
                            Some(b) => pieces.push(*b),
                            None => {
                                let mut buf = [0u8; 4];
                                pieces.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                            }
                        }
                    }
                }
                (VocabKind::Spm, TokenType::Byte) => match parse_byte_token(text) {
                    Some(b) => pieces.push(b),
                    None => pieces.extend_from_slice(text.as_bytes()),
                },
                (VocabKind::Wpm, _) => match text.strip_prefix("##") {
                    // WordPiece continuations join the previous piece; words start with a space
                    Some(rest) => pieces.extend_from_slice(rest.as_bytes()),
                    None => {
                        pieces.push(b' ');
                        pieces.extend_from_slice(text.as_bytes());
                    }
                },
                (VocabKind::Spm, _) => {
                    pieces.extend_from_slice(text.replace(SPM_SPACE, " ").as_bytes())
                }
            }
            piece_ends.push(pieces.len());
        }

        let mut specials: Vec<(String, TokenId, TokenType)> = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (t, ty))| {
                !t.is_empty()
                    && matches!(
                        ty,
                        TokenType::Control | TokenType::UserDefined | TokenType::Unknown
                    )
            })
            .map(|(i, (t, ty))| (t.to_owned(), i as TokenId, *ty))
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));

        let mut eog: Vec<TokenId> = eos.into_iter().chain(extra_eog).collect();
        for (i, t) in tokens.iter().enumerate() {
            if EOG_TEXTS.contains(&t) {
                eog.push(i as TokenId);
            }
        }
        eog.sort_unstable();
        eog.dedup();

        Tokenizer {
            kind,
            tokens,
            types,
            pieces,
            piece_ends,
            specials,
            model,
            bos,
            eos,
            add_bos,
            add_eos,
            sep,
            add_sep,
            add_space_prefix,
            eog,
        }
    }

    pub fn kind(&self) -> VocabKind {
        self.kind
    }

    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }

    pub fn token_text(&self, id: TokenId) -> Option<&str> {
        self.tokens.get(id as usize)
    }

    pub fn token_type(&self, id: TokenId) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    pub fn is_eog(&self, id: TokenId) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    pub fn eog_tokens(&self) -> &[TokenId] {
        &self.eog
    }

    /// Checks that an id (as received from outside) names a vocabulary entry.
    pub fn check_id(&self, id: i64) -> Result<TokenId> {
        if id >= 0 && (id as usize) < self.tokens.len() {
            Ok(id as TokenId)
        } else {
            Err(EngineError::InvalidToken {
                id,
                n_vocab: self.tokens.len(),
            })
        }
    }

    /// The bytes a token renders as (llama.cpp's `token_to_piece` with special = true).
    pub fn token_to_piece(&self, id: TokenId) -> Result<&[u8]> {
        let i = id as usize;
        let end = *self.piece_ends.get(i).ok_or(EngineError::InvalidToken {
            id: id as i64,
            n_vocab: self.tokens.len(),
        })?;
        let start = if i == 0 { 0 } else { self.piece_ends[i - 1] };
        Ok(&self.pieces[start..end])
    }

    /// Concatenation of the pieces of `ids`; may be invalid UTF-8 when it ends mid-codepoint.
    pub fn detokenize(&self, ids: &[TokenId]) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.token_to_piece(id)?);
        }
        Ok(out)
    }

    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<TokenId>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            if let Some(bos) = self.bos {
                out.push(bos);
            }
        }
        let mut prev_special = out.len() == 1;
        for fragment in self.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(t) => {
                    if self.kind == VocabKind::Spm && self.add_space_prefix && prev_special {
                        let prefixed = format!(" {t}");
                        self.encode_text(&prefixed, &mut out)?;
                    } else {
                        self.encode_text(t, &mut out)?;
                    }
                    prev_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            if let Some(eos) = self.eos {
                out.push(eos);
            }
        }
        if add_special && self.kind == VocabKind::Wpm {
            out.extend(self.sep);
        }
        Ok(out)
    }

    /// A reranker's input for `query` and `document`, as llama-server's
    /// `format_prompt_rerank` builds it without a rerank template: BOS, query, EOS, SEP,
    /// document, EOS (each special where the vocabulary adds it; SEP for EOS when it has none).
    pub fn rerank_input(&self, query: &str, document: &str) -> Result<Vec<TokenId>> {
        let q = self.encode(query, false, false)?;
        let d = self.encode(document, false, false)?;
        let eos = self.eos.or(self.sep);
        let mut out = Vec::with_capacity(q.len() + d.len() + 4);
        if self.add_bos {
            out.extend(self.bos);
        }
        out.extend(q);
        if self.add_eos {
            out.extend(eos);
        }
        if self.add_sep {
            out.extend(self.sep);
        }
        out.extend(d);
        if self.add_eos {
            out.extend(eos);
        }
        Ok(out)
    }

    fn encode_text(&self, text: &str, out: &mut Vec<TokenId>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        match &self.model {
            TextModel::Bpe(hf) => {
                let enc = hf
                    .encode(text, false)
                    .map_err(|e| EngineError::Tokenize(e.to_string()))?;
                out.extend_from_slice(enc.get_ids());
                Ok(())
            }
            TextModel::Spm(spm) => spm.encode(&self.tokens, &text.replace(' ', SPM_SPACE), out),
        }
    }

    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut fragments = vec![Fragment::Text(text)];
        for (special, id, ty) in &self.specials {
            if !parse_special && matches!(ty, TokenType::Control | TokenType::Unknown) {
                continue;
            }
            if !fragments
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(special.as_str())))
            {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for f in fragments {
                match f {
                    Fragment::Text(t) if t.contains(special.as_str()) => {
                        let mut rest = t;
                        while let Some(at) = rest.find(special.as_str()) {
                            if at > 0 {
                                next.push(Fragment::Text(&rest[..at]));
                            }
                            next.push(Fragment::Token(*id));
                            rest = &rest[at + special.len()..];
                        }
                        if !rest.is_empty() {
                            next.push(Fragment::Text(rest));
                        }
                    }
                    other => next.push(other),
                }
            }
            fragments = next;
        }
        fragments
    }
}

enum Fragment<'t> {
    Text(&'t str),
    Token(TokenId),
}
