//! Building a tokenizer from GGUF metadata: byte-level BPE vocabularies (`gpt2`, with the
//! pre-tokenizer `tokenizer.ggml.pre` names), SentencePiece-style ones (`llama`, with scores)
//! and WordPiece (`bert`), matching llama.cpp id for id.

use super::*;
use crate::gguf::{GgufFile, StrArray};
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

    pub(super) fn build_gpt2(gguf: &GgufFile, tokens: &StrArray) -> Result<HfTokenizer> {
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
    pub(super) fn build_wpm(
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
    pub(super) fn build_spm(gguf: &GgufFile, tokens: &StrArray) -> Result<Spm> {
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
}
