//! A cap on the digits of JSON numbers, for grammars whose whole output is one JSON value.
//!
//! llguidance's JSON compiler lets a number's fraction run on (`1.000…` is still ≤ 1), and a
//! small model under greedy sampling can keep choosing `0` until `max_tokens`. llama.cpp's
//! schema converter bounds each part of a number at 16 digits; this applies the same bound on
//! top of llguidance's mask: outside strings, no token may extend a run of digits past
//! [`MAX_RUN`]. Where the grammar allows nothing else (a range that needs more digits), the
//! cap steps aside, so it never makes a valid schema unsatisfiable.

use super::{TokEnv, TokTrie, TokenId};
use std::sync::Arc;

/// Digits in one run: llama.cpp's `integral-part` and `decimal-part` bounds.
pub const MAX_RUN: usize = 16;

fn leading_digits(bytes: &[u8]) -> usize {
    bytes.iter().take_while(|b| b.is_ascii_digit()).count()
}

/// The vocabulary's digit-leading tokens, built once per model.
#[derive(Debug, Default)]
pub struct DigitTokens {
    /// `(token, how many ASCII digits its text starts with)`, for tokens starting with one.
    leading: Vec<(TokenId, usize)>,
    /// The most leading digits of any token: runs shorter than `MAX_RUN - longest + 1` need
    /// no check.
    longest: usize,
}

impl DigitTokens {
    pub fn new(trie: &TokTrie) -> Self {
        let mut leading = Vec::new();
        for id in 0..trie.vocab_size() as TokenId {
            let n = leading_digits(trie.token(id));
            if n > 0 {
                leading.push((id, n));
            }
        }
        let longest = leading.iter().map(|&(_, n)| n).max().unwrap_or(0);
        DigitTokens { leading, longest }
    }
}

/// Where the output stands lexically: inside a string or in a run of digits.
#[derive(Clone)]
pub struct DigitCap {
    tokens: Arc<DigitTokens>,
    env: TokEnv,
    in_string: bool,
    escaped: bool,
    run: usize,
}

impl DigitCap {
    pub fn new(tokens: Arc<DigitTokens>, env: TokEnv) -> Self {
        DigitCap {
            tokens,
            env,
            in_string: false,
            escaped: false,
            run: 0,
        }
    }

    /// Digits the next token may still add to the current run; `None` when unconstrained.
    fn budget(&self) -> Option<usize> {
        let near = self.run > 0 && self.run + self.tokens.longest > MAX_RUN;
        (!self.in_string && near).then(|| MAX_RUN.saturating_sub(self.run))
    }

    /// Whether `token` would extend the run of digits past the cap.
    pub fn forbids(&self, token: TokenId) -> bool {
        self.budget()
            .is_some_and(|budget| leading_digits(self.env.tok_trie().token(token)) > budget)
    }

    /// Forbids (in `logits`, already masked by the grammar) the tokens that would extend the
    /// run past the cap, unless they are all the grammar allows.
    pub fn mask(&self, logits: &mut [f32]) {
        let Some(budget) = self.budget() else {
            return;
        };
        let over = |&&(t, n): &&(TokenId, usize)| {
            n > budget && logits.get(t as usize).is_some_and(|l| l.is_finite())
        };
        let n_over = self.tokens.leading.iter().filter(over).count();
        if n_over == 0 || logits.iter().filter(|l| l.is_finite()).count() == n_over {
            return;
        }
        for &(t, n) in &self.tokens.leading {
            if n > budget {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Follows an accepted token's text.
    pub fn accept(&mut self, token: TokenId) {
        let bytes = self.env.tok_trie().token(token);
        if bytes.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
            return;
        }
        for &b in bytes {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
            } else if b == b'"' {
                self.in_string = true;
                self.run = 0;
            } else if b.is_ascii_digit() {
                self.run += 1;
            } else {
                self.run = 0;
            }
        }
    }

    pub fn reset(&mut self) {
        self.in_string = false;
        self.escaped = false;
        self.run = 0;
    }
}
