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

use crate::error::{EngineError, Result};
use crate::gguf::{GgufFile, StrArray};
use std::collections::HashMap;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;
use tokenizers::{ModelWrapper, Tokenizer as HfTokenizer};

/// `tokenizer.ggml.pre` names that llama.cpp splits like Llama 3 (its LLAMA3 pre-type).
const LLAMA3_PRE: &[&str] = &["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"];
/// Llama 3's pre-tokenizer regex (its tokenizer.json): digits in runs of up to three.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Names llama.cpp splits like Qwen 2 (its QWEN2 pre-type).
const QWEN2_PRE: &[&str] = &["qwen2", "deepseek-r1-qwen", "stablelm2"];
/// Qwen 2's pre-tokenizer regex (its tokenizer.json): every digit on its own.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

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

/// The special tokens a tokenizer.json post-processor puts before and after a single
/// sequence: `TemplateProcessing`'s leading and trailing `SpecialToken`s, BERT's and
/// RoBERTa's CLS/SEP, searched inside a `Sequence` of processors.
fn post_processor_specials(pp: &serde_json::Value) -> (Option<TokenId>, Option<TokenId>) {
    let id_of = |v: &serde_json::Value| v.get(1).and_then(|i| i.as_u64()).map(|i| i as TokenId);
    match pp["type"].as_str() {
        Some("TemplateProcessing") => {
            let single = pp["single"].as_array().cloned().unwrap_or_default();
            let special_id = |item: Option<&serde_json::Value>| -> Option<TokenId> {
                let name = item?.get("SpecialToken")?["id"].as_str()?;
                pp["special_tokens"][name]["ids"][0]
                    .as_u64()
                    .map(|i| i as TokenId)
            };
            (special_id(single.first()), special_id(single.last()))
        }
        Some("BertProcessing") | Some("RobertaProcessing") => {
            (id_of(&pp["cls"]), id_of(&pp["sep"]))
        }
        Some("Sequence") => pp["processors"]
            .as_array()
            .into_iter()
            .flatten()
            .map(post_processor_specials)
            .find(|(a, b)| a.is_some() || b.is_some())
            .unwrap_or((None, None)),
        _ => (None, None),
    }
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

/// llama.cpp's SentencePiece tokenizer (`llm_tokenizer_spm`).
struct Spm {
    /// Text → id as a table of ids hashed by their text (the texts stay in the tokenizer's
    /// `tokens`); for duplicate texts the later id wins, as in llama.cpp.
    ids: hashbrown::HashTable<TokenId>,
    hasher: std::collections::hash_map::RandomState,
    scores: Vec<f32>,
    /// `<0xXX>` tokens (or the byte's own one-character token) for byte fallback.
    bytes: [Option<TokenId>; 256],
}

/// A pair of adjacent symbols whose concatenation is a vocabulary token.
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    /// llama.cpp's queue order: the highest score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.score
            .total_cmp(&other.score)
            .then(other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// A run of text: a character at first, a merged token later (`len == 0` once merged away).
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    fn new(tokens: &StrArray, scores: Vec<f32>) -> Self {
        use std::hash::BuildHasher;
        let hasher = std::collections::hash_map::RandomState::new();
        let mut ids = hashbrown::HashTable::with_capacity(tokens.len());
        let text_of = |id: &TokenId| tokens.get(*id as usize).unwrap_or("");
        for (i, t) in tokens.iter().enumerate() {
            let hash = hasher.hash_one(t);
            match ids.find_mut(hash, |id| text_of(id) == t) {
                Some(id) => *id = i as TokenId,
                None => {
                    ids.insert_unique(hash, i as TokenId, |id| hasher.hash_one(text_of(id)));
                }
            }
        }
        let mut spm = Spm {
            ids,
            hasher,
            scores,
            bytes: [None; 256],
        };
        for b in 0..256usize {
            let hex = format!("<0x{b:02X}>");
            spm.bytes[b] = spm.id(tokens, &hex).or_else(|| {
                let c = char::from_u32(b as u32).filter(|_| b < 0x80)?;
                spm.id(tokens, &c.to_string())
            });
        }
        spm
    }

    fn id(&self, tokens: &StrArray, text: &str) -> Option<TokenId> {
        use std::hash::BuildHasher;
        self.ids
            .find(self.hasher.hash_one(text), |&id| {
                tokens.get(id as usize) == Some(text)
            })
            .copied()
    }

    /// `text` has its spaces already escaped as "▁".
    fn encode(&self, tokens: &StrArray, text: &str, out: &mut Vec<TokenId>) -> Result<()> {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            let end = start + c.len_utf8();
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: (end < text.len()).then_some(i + 1),
            });
        }
        let mut queue = std::collections::BinaryHeap::new();
        let try_add = |queue: &mut std::collections::BinaryHeap<Bigram>,
                       symbols: &[Symbol],
                       left: Option<usize>,
                       right: Option<usize>| {
            let (Some(left), Some(right)) = (left, right) else {
                return;
            };
            let (l, r) = (symbols[left], symbols[right]);
            let piece = &text[l.start..r.start + r.len];
            if let Some(id) = self.id(tokens, piece) {
                queue.push(Bigram {
                    score: self.scores[id as usize],
                    left,
                    right,
                    size: piece.len(),
                });
            }
        };
        for i in 1..symbols.len() {
            try_add(&mut queue, &symbols, Some(i - 1), Some(i));
        }
        while let Some(bigram) = queue.pop() {
            let (l, r) = (symbols[bigram.left], symbols[bigram.right]);
            // stale: one side was merged into something else since this pair was queued
            if l.len == 0 || r.len == 0 || l.len + r.len != bigram.size {
                continue;
            }
            symbols[bigram.left].len += r.len;
            symbols[bigram.left].next = r.next;
            symbols[bigram.right].len = 0;
            if let Some(next) = r.next {
                symbols[next].prev = Some(bigram.left);
            }
            try_add(&mut queue, &symbols, l.prev, Some(bigram.left));
            try_add(&mut queue, &symbols, Some(bigram.left), r.next);
        }
        let mut at = (!symbols.is_empty()).then_some(0);
        while let Some(i) = at {
            let sym = symbols[i];
            let piece = &text[sym.start..sym.start + sym.len];
            // merged symbols are always tokens; a leftover character may not be
            match self.id(tokens, piece) {
                Some(id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        let id = self.bytes[b as usize].ok_or_else(|| {
                            EngineError::Tokenize(format!("no byte token for 0x{b:02X}"))
                        })?;
                        out.push(id);
                    }
                }
            }
            at = sym.next;
        }
        Ok(())
    }
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
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let model = gguf
            .get_str("tokenizer.ggml.model")
            .ok_or_else(|| meta_err("missing tokenizer.ggml.model"))?;
        let kind = match model {
            "gpt2" => VocabKind::Gpt2,
            "llama" => VocabKind::Spm,
            "bert" => VocabKind::Wpm,
            other => return Err(meta_err(format!("tokenizer model {other:?}"))),
        };
        let mut tokens: StrArray = gguf
            .get("tokenizer.ggml.tokens")
            .ok_or_else(|| meta_err("missing tokenizer.ggml.tokens"))?
            .as_strings()
            .ok_or_else(|| meta_err("tokenizer.ggml.tokens is not an array of strings"))?
            .clone();
        let n_vocab = tokens.len();
        if n_vocab == 0 || n_vocab > u32::MAX as usize {
            return Err(meta_err("empty or oversized vocabulary"));
        }
        let types: Vec<TokenType> = match gguf
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.numbers())
        {
            Some(a) if a.len() == n_vocab => a
                .iter()
                .map(|&v| TokenType::from_code(if v >= 0.0 { v as u64 } else { 1 }))
                .collect(),
            Some(_) => return Err(meta_err("token_type length differs from the vocabulary")),
            None => vec![TokenType::Normal; n_vocab],
        };
        let token_id = |key: &str| -> Result<Option<TokenId>> {
            match gguf.get_u64(key) {
                Some(id) if (id as usize) < n_vocab => Ok(Some(id as TokenId)),
                Some(id) => Err(meta_err(format!("{key} = {id} is outside the vocabulary"))),
                None => Ok(None),
            }
        };
        let mut bos = token_id("tokenizer.ggml.bos_token_id")?;
        let eos = token_id("tokenizer.ggml.eos_token_id")?;
        let eot = token_id("tokenizer.ggml.eot_token_id")?;
        let eom = token_id("tokenizer.ggml.eom_token_id")?;
        let add_bos = gguf
            .get_bool("tokenizer.ggml.add_bos_token")
            .unwrap_or(kind != VocabKind::Gpt2);
        let add_eos = gguf
            .get_bool("tokenizer.ggml.add_eos_token")
            .unwrap_or(false);
        // (llama.cpp spells the key "seperator")
        let sep = token_id("tokenizer.ggml.seperator_token_id")?;
        let add_sep = gguf
            .get_bool("tokenizer.ggml.add_sep_token")
            .unwrap_or(kind == VocabKind::Wpm);
        if kind == VocabKind::Wpm {
            // llama.cpp wraps WordPiece input in CLS … SEP
            bos = bos.or(token_id("tokenizer.ggml.cls_token_id")?);
        }
        let add_space_prefix = gguf
            .get_bool("tokenizer.ggml.add_space_prefix")
            .unwrap_or(kind == VocabKind::Spm);

        let model = match kind {
            VocabKind::Gpt2 => TextModel::Bpe(Box::new(Self::build_gpt2(gguf, &tokens)?)),
            VocabKind::Spm => TextModel::Spm(Box::new(Self::build_spm(gguf, &tokens)?)),
            VocabKind::Wpm => {
                let (hf, hf_tokens) = Self::build_wpm(gguf, &tokens, &types)?;
                tokens = hf_tokens;
                TextModel::Bpe(Box::new(hf))
            }
        };
        Ok(Self::assemble(Parts {
            kind,
            tokens,
            types,
            model,
            bos,
            eos,
            extra_eog: [eot, eom].into_iter().flatten().collect(),
            add_bos: add_bos || kind == VocabKind::Wpm,
            add_eos,
            sep,
            add_sep,
            add_space_prefix,
        }))
    }

    /// A tokenizer from a Hugging Face `tokenizer.json` (normalizer, pre-tokenizer and model
    /// run by the tokenizers crate; its added tokens split out by [`Tokenizer::partition`]
    /// like GGUF special tokens). `n_vocab` pads the vocabulary to the embedding's rows, as
    /// llama.cpp's converter does ("[PAD<id>]" tokens).
    pub fn from_hf_json(json: &[u8], n_vocab: usize, sp: &HfSpecials) -> Result<Self> {
        let hf =
            HfTokenizer::from_bytes(json).map_err(|e| meta_err(format!("tokenizer.json: {e}")))?;
        let raw: serde_json::Value =
            serde_json::from_slice(json).map_err(|e| meta_err(format!("tokenizer.json: {e}")))?;
        let vocab = hf.get_vocab(true);
        let max_id = vocab.values().copied().max().unwrap_or(0) as usize;
        let n_vocab = n_vocab.max(max_id + 1);
        if vocab.is_empty() || n_vocab > 1 << 22 {
            return Err(meta_err(format!(
                "tokenizer.json: empty or oversized vocabulary ({n_vocab})"
            )));
        }
        let model_type = raw["model"]["type"].as_str().unwrap_or("");
        let mentions = |key: &str, what: &str| raw[key].to_string().contains(what);
        let kind = match model_type {
            "WordPiece" => VocabKind::Wpm,
            "BPE" if mentions("pre_tokenizer", "ByteLevel") || mentions("decoder", "ByteLevel") => {
                VocabKind::Gpt2
            }
            "BPE" | "Unigram" => VocabKind::Spm,
            other => {
                return Err(meta_err(format!(
                    "tokenizer.json model type {other:?} (BPE, Unigram and WordPiece load)"
                )))
            }
        };
        let mut texts: Vec<Option<String>> = vec![None; n_vocab];
        for (text, id) in vocab {
            texts[id as usize] = Some(text);
        }
        let added = hf.get_added_tokens_decoder();
        let mut types = Vec::with_capacity(n_vocab);
        let mut tokens = StrArray::default();
        for (id, text) in texts.into_iter().enumerate() {
            let ty = match (&text, added.get(&(id as u32))) {
                (None, _) => TokenType::Unused,
                (_, Some(a)) if a.special => TokenType::Control,
                (_, Some(_)) => TokenType::UserDefined,
                (Some(t), None) if kind == VocabKind::Spm && parse_byte_token(t).is_some() => {
                    TokenType::Byte
                }
                _ => TokenType::Normal,
            };
            tokens.push(text.as_deref().unwrap_or(&format!("[PAD{id}]")));
            types.push(ty);
        }
        let id_of = |text: &Option<String>, what: &str| -> Result<Option<TokenId>> {
            match text {
                None => Ok(None),
                Some(t) => hf
                    .token_to_id(t)
                    .map(Some)
                    .ok_or_else(|| meta_err(format!("{what} {t:?} is not in the vocabulary"))),
            }
        };
        let (mut bos, mut eos) = (id_of(&sp.bos, "bos_token")?, id_of(&sp.eos, "eos_token")?);
        // what the post-processor wraps a single sequence in (Llama 3's BOS, BERT's CLS/SEP)
        let (pp_first, pp_last) = post_processor_specials(&raw["post_processor"]);
        let wpm = kind == VocabKind::Wpm;
        let add_bos = sp.add_bos.unwrap_or(pp_first.is_some());
        // BERT's closing SEP is its separator, not an EOS (as llama.cpp's conversion has it)
        let add_eos = sp.add_eos.unwrap_or(pp_last.is_some() && !wpm);
        let sep = if wpm { pp_last } else { None };
        if add_bos && pp_first.is_some() {
            bos = pp_first.or(bos);
        }
        if add_eos && pp_last.is_some() {
            eos = pp_last.or(eos);
        }
        let mut extra_eog: Vec<TokenId> = Vec::new();
        for &id in &sp.eos_ids {
            if (id as usize) < n_vocab {
                eos = eos.or(Some(id));
                extra_eog.push(id);
            }
        }
        if kind == VocabKind::Wpm {
            // an encoder's SEP ends its input, never a generation
            extra_eog.clear();
        }
        let mut text_model = HfTokenizer::new(hf.get_model().clone());
        text_model.with_normalizer(hf.get_normalizer().cloned());
        text_model.with_pre_tokenizer(hf.get_pre_tokenizer().cloned());
        Ok(Self::assemble(Parts {
            kind,
            tokens,
            types,
            model: TextModel::Bpe(Box::new(text_model)),
            bos,
            eos,
            extra_eog,
            add_bos,
            add_eos,
            sep,
            add_sep: sep.is_some(),
            // the normalizer / pre-tokenizer of tokenizer.json own the space handling
            add_space_prefix: false,
        }))
    }

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

    fn build_gpt2(gguf: &GgufFile, tokens: &StrArray) -> Result<HfTokenizer> {
        // llama.cpp's text → id map: later duplicates win.
        let mut vocab = tokenizers::models::bpe::Vocab::default();
        for (i, t) in tokens.iter().enumerate() {
            vocab.insert(t.to_owned(), i as u32);
        }
        let merges: Vec<(String, String)> = gguf
            .get("tokenizer.ggml.merges")
            .and_then(|v| v.as_strings())
            .ok_or_else(|| meta_err("gpt2 vocabulary without tokenizer.ggml.merges"))?
            .iter()
            .filter_map(|m| m.split_once(' '))
            .filter(|(a, b)| {
                vocab.contains_key(*a)
                    && vocab.contains_key(*b)
                    && vocab.contains_key(&format!("{a}{b}"))
            })
            .map(|(a, b)| (a.to_owned(), b.to_owned()))
            .collect();
        let pre = gguf.get_str("tokenizer.ggml.pre").unwrap_or("default");
        // Llama 3's vocabulary takes a whole pre-token that is itself a token before merging
        let ignore_merges = LLAMA3_PRE.contains(&pre);
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(ignore_merges)
            .build()
            .map_err(|e| meta_err(format!("BPE: {e}")))?;
        let byte_level = PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, true));
        // the models' own split (their tokenizer.json), then byte-level without its regex
        let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
            let split = Split::new(
                SplitPattern::Regex(pattern.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| meta_err(format!("pre-tokenizer regex: {e}")))?;
            Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Split(split),
                PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)),
            ])))
        };
        let pre_tokenizer = match pre {
            p if LLAMA3_PRE.contains(&p) => split(LLAMA3_SPLIT)?,
            p if QWEN2_PRE.contains(&p) => split(QWEN2_SPLIT)?,
            // llama.cpp splits every digit before the GPT-2 regex for these.
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva" | "default" | "gpt-2" | "gpt2" => {
                if pre == "default" || pre == "gpt-2" || pre == "gpt2" {
                    byte_level
                } else {
                    PreTokenizerWrapper::Sequence(Sequence::new(vec![
                        PreTokenizerWrapper::Digits(Digits::new(true)),
                        byte_level,
                    ]))
                }
            }
            other => return Err(meta_err(format!("gpt2 pre-tokenizer {other:?}"))),
        };
        let mut hf = HfTokenizer::new(ModelWrapper::BPE(bpe));
        hf.with_pre_tokenizer(Some(pre_tokenizer));
        Ok(hf)
    }

    /// llama.cpp's WordPiece (`bert` vocabularies): tokens in phantom-space form ("▁word"
    /// starts a word, a bare piece continues one) become the tokenizers crate's WordPiece
    /// ("word", "##piece"), with BERT's normalizer (lower-casing and accent stripping unless
    /// `tokenizer.ggml.normalizer.lowercase` is false) and pre-tokenizer (whitespace and
    /// punctuation). Returns the tokenizer and the vocabulary in WordPiece form.
    fn build_wpm(
        gguf: &GgufFile,
        tokens: &StrArray,
        types: &[TokenType],
    ) -> Result<(HfTokenizer, StrArray)> {
        use tokenizers::models::wordpiece::WordPiece;
        use tokenizers::normalizers::bert::BertNormalizer;
        use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
        // (the same map type as WordPiece's, whose alias is private)
        let mut vocab = tokenizers::models::bpe::Vocab::default();
        let mut hf_tokens = StrArray::default();
        for (i, (t, ty)) in tokens.iter().zip(types).enumerate() {
            let text = match (ty, t.strip_prefix(SPM_SPACE)) {
                (TokenType::Control | TokenType::Unknown | TokenType::UserDefined, _) => {
                    t.to_string()
                }
                (_, Some(word)) => word.to_string(),
                (_, None) => format!("##{t}"),
            };
            vocab.insert(text.clone(), i as u32);
            hf_tokens.push(&text);
        }
        let unk = gguf
            .get_u64("tokenizer.ggml.unknown_token_id")
            .and_then(|id| hf_tokens.get(id as usize))
            .unwrap_or("[UNK]")
            .to_string();
        let wp = WordPiece::builder()
            .vocab(vocab)
            .unk_token(unk)
            .continuing_subword_prefix("##".into())
            .build()
            .map_err(|e| meta_err(format!("WordPiece: {e}")))?;
        let lowercase = gguf
            .get_bool("tokenizer.ggml.normalizer.lowercase")
            .unwrap_or(true);
        let strip = gguf
            .get_bool("tokenizer.ggml.normalizer.strip_accents")
            .unwrap_or(lowercase);
        let mut hf = HfTokenizer::new(ModelWrapper::WordPiece(wp));
        hf.with_normalizer(Some(BertNormalizer::new(
            true,
            true,
            Some(strip),
            lowercase,
        )));
        hf.with_pre_tokenizer(Some(BertPreTokenizer));
        Ok((hf, hf_tokens))
    }

    fn build_spm(gguf: &GgufFile, tokens: &StrArray) -> Result<Spm> {
        let scores: Vec<f32> = match gguf.get("tokenizer.ggml.scores").and_then(|v| v.numbers()) {
            Some(a) if a.len() == tokens.len() => a.iter().map(|&v| v as f32).collect(),
            _ => {
                return Err(meta_err(
                    "llama vocabulary without matching tokenizer.ggml.scores",
                ))
            }
        };
        Ok(Spm::new(tokens, scores))
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
