//! llama.cpp-style batches: every token carries its own position, sequence and logits flag.

use crate::tokenizer::TokenId;

#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub tokens: Vec<TokenId>,
    pub pos: Vec<usize>,
    pub seq: Vec<usize>,
    pub logits: Vec<bool>,
    /// Entries whose final-normed hidden state is kept (embedding rows riding in a generation
    /// pass); empty when none is. Independent of `logits`.
    pub embd: Vec<bool>,
}

impl Batch {
    pub fn with_capacity(n: usize) -> Self {
        Batch {
            tokens: Vec::with_capacity(n),
            pos: Vec::with_capacity(n),
            seq: Vec::with_capacity(n),
            logits: Vec::with_capacity(n),
            embd: Vec::new(),
        }
    }

    pub fn push(&mut self, token: TokenId, pos: usize, seq: usize, logits: bool) {
        self.tokens.push(token);
        self.pos.push(pos);
        self.seq.push(seq);
        self.logits.push(logits);
        if !self.embd.is_empty() {
            self.embd.push(false);
        }
    }

    /// Marks every entry of the sequences in `seqs` as an embedding row (hidden state kept,
    /// no logits).
    pub fn mark_embedding_rows(&mut self, seqs: &[usize]) {
        if seqs.is_empty() {
            return;
        }
        self.embd = self.seq.iter().map(|s| seqs.contains(s)).collect();
        for (l, &e) in self.logits.iter_mut().zip(&self.embd) {
            *l &= !e;
        }
    }

    /// Entries `range`, flags included.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Batch {
        Batch {
            tokens: self.tokens[range.clone()].to_vec(),
            pos: self.pos[range.clone()].to_vec(),
            seq: self.seq[range.clone()].to_vec(),
            logits: self.logits[range.clone()].to_vec(),
            embd: if self.embd.is_empty() {
                Vec::new()
            } else {
                self.embd[range].to_vec()
            },
        }
    }

    /// The entries for which `keep(i)` holds, flags included.
    pub fn filter(&self, keep: impl Fn(usize) -> bool) -> Batch {
        let mut out = Batch::with_capacity(self.len());
        let with_embd = !self.embd.is_empty();
        for i in (0..self.len()).filter(|&i| keep(i)) {
            out.tokens.push(self.tokens[i]);
            out.pos.push(self.pos[i]);
            out.seq.push(self.seq[i]);
            out.logits.push(self.logits[i]);
            if with_embd {
                out.embd.push(self.embd[i]);
            }
        }
        out
    }

    /// The batch without the entries of `seqs`.
    pub fn without(&self, seqs: &[usize]) -> Batch {
        if seqs.is_empty() {
            return self.clone();
        }
        self.filter(|i| !seqs.contains(&self.seq[i]))
    }

    /// Whether entry `i` is an embedding row.
    pub fn is_embd(&self, i: usize) -> bool {
        self.embd.get(i).copied().unwrap_or(false)
    }

    /// Whether any entry is an embedding row.
    pub fn has_embd(&self) -> bool {
        self.embd.iter().any(|&e| e)
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
