//! llama.cpp-style batches: every token carries its own position, sequence and logits flag.

use crate::tokenizer::TokenId;

#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub tokens: Vec<TokenId>,
    pub pos: Vec<usize>,
    pub seq: Vec<usize>,
    pub logits: Vec<bool>,
}

impl Batch {
    pub fn with_capacity(n: usize) -> Self {
        Batch {
            tokens: Vec::with_capacity(n),
            pos: Vec::with_capacity(n),
            seq: Vec::with_capacity(n),
            logits: Vec::with_capacity(n),
        }
    }

    pub fn push(&mut self, token: TokenId, pos: usize, seq: usize, logits: bool) {
        self.tokens.push(token);
        self.pos.push(pos);
        self.seq.push(seq);
        self.logits.push(logits);
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn n_outputs(&self) -> usize {
        self.logits.iter().filter(|&&l| l).count()
    }

    /// A batch holding `tokens` for one sequence at consecutive positions, with logits for the
    /// last token only.
    pub fn for_sequence(tokens: &[TokenId], start_pos: usize, seq: usize) -> Self {
        let mut b = Batch::with_capacity(tokens.len());
        for (i, &t) in tokens.iter().enumerate() {
            b.push(t, start_pos + i, seq, i + 1 == tokens.len());
        }
        b
    }
}
