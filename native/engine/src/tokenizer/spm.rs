//! llama.cpp's SentencePiece (SPM) tokenization: characters merge pairwise, best-scoring
//! vocabulary token first, then leftover characters fall back to byte tokens.

use super::*;
use crate::gguf::StrArray;

/// llama.cpp's SentencePiece tokenizer (`llm_tokenizer_spm`).
pub(super) struct Spm {
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
pub(super) struct Bigram {
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
pub(super) struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    pub(super) fn new(tokens: &StrArray, scores: Vec<f32>) -> Self {
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

    pub(super) fn id(&self, tokens: &StrArray, text: &str) -> Option<TokenId> {
        use std::hash::BuildHasher;
        self.ids
            .find(self.hasher.hash_one(text), |&id| {
                tokens.get(id as usize) == Some(text)
            })
            .copied()
    }

    /// `text` has its spaces already escaped as "▁".
    pub(super) fn encode(
        &self,
        tokens: &StrArray,
        text: &str,
        out: &mut Vec<TokenId>,
    ) -> Result<()> {
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
