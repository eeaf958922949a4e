//! Building a tokenizer from a Hugging Face checkpoint's `tokenizer.json`.

use super::*;

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

impl Tokenizer {
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
}
