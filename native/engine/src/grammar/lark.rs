//! The Lark text llguidance compiles, emitted from a parsed GBNF grammar.
//!
//! When the grammar is LL(1) over characters (see [`super::analysis`]), regular
//! sub-expressions become single multi-character lexemes; otherwise every terminal is a
//! one-character lexeme, so llguidance's greedy lexer cannot cut off a parse GBNF accepts.

use super::analysis::{char_regex, quantifier, Analysis};
use super::gbnf::{Expr, Grammar};
use std::collections::HashMap;
use std::fmt::Write;

/// Renders a grammar as llguidance Lark text whose start rule is `root`.
pub fn to_lark(g: &Grammar, root: &str) -> String {
    let index: HashMap<&str, usize> = g
        .rules
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (n.as_str(), i))
        .collect();
    let analysis = Analysis::new(g, root);
    let ctx = Render {
        index: &index,
        analysis: analysis.ll1.then_some(&analysis),
    };
    let mut out = String::new();
    let _ = writeln!(out, "start: {}", ctx.name(root));
    for (name, body) in &g.rules {
        let _ = writeln!(out, "{}: {}", ctx.name(name), ctx.render(body, true));
    }
    out
}

struct Render<'a> {
    index: &'a HashMap<&'a str, usize>,
    /// Present when the grammar is LL(1): regular sub-expressions become whole lexemes.
    analysis: Option<&'a Analysis<'a>>,
}

impl Render<'_> {
    fn name(&self, n: &str) -> String {
        format!("r{}", self.index[n])
    }

    /// One multi-character lexeme for a regular sub-expression, when that is safe.
    fn lexeme(&self, e: &Expr) -> Option<String> {
        let a = self.analysis?;
        if matches!(e, Expr::Ref(_)) || !a.is_regular(e) {
            return None;
        }
        if !a.nullable(e) {
            return a.regex(e).map(|re| format!("/{re}/"));
        }
        match e {
            Expr::Repeat { inner, min: 0, max } if *max != Some(0) && !a.nullable(inner) => {
                let once_or_more = Expr::Repeat {
                    inner: inner.clone(),
                    min: 1,
                    max: *max,
                };
                a.regex(&once_or_more).map(|re| format!("/{re}/?"))
            }
            _ => None,
        }
    }

    fn render(&self, e: &Expr, top: bool) -> String {
        if let Some(lexeme) = self.lexeme(e) {
            return lexeme;
        }
        match e {
            Expr::Alt(alts) => {
                let has_empty = alts.iter().any(is_empty);
                let parts: Vec<String> = alts
                    .iter()
                    .filter(|a| !is_empty(a))
                    .map(|a| self.render(a, false))
                    .collect();
                if parts.is_empty() {
                    return EMPTY.to_string();
                }
                let joined = parts.join(" | ");
                if has_empty {
                    format!("({joined})?")
                } else if top {
                    joined
                } else {
                    format!("({joined})")
                }
            }
            Expr::Seq(items) => {
                if items.is_empty() {
                    return EMPTY.to_string();
                }
                let parts: Vec<String> = items.iter().map(|i| self.render(i, false)).collect();
                if top {
                    parts.join(" ")
                } else {
                    format!("({})", parts.join(" "))
                }
            }
            Expr::Literal(s) => {
                if s.is_empty() {
                    return EMPTY.to_string();
                }
                let parts: Vec<String> =
                    s.chars().map(|c| format!("/{}/", char_regex(c))).collect();
                if parts.len() == 1 || top {
                    parts.join(" ")
                } else {
                    format!("({})", parts.join(" "))
                }
            }
            Expr::Class { negated, ranges } => {
                if ranges.is_empty() {
                    // `[^]`: any character.
                    return "/(?s:.)/".to_string();
                }
                let mut r = String::from("/[");
                if *negated {
                    r.push('^');
                }
                for (lo, hi) in ranges {
                    r.push_str(&char_regex(*lo));
                    if hi != lo {
                        r.push('-');
                        r.push_str(&char_regex(*hi));
                    }
                }
                r.push_str("]/");
                r
            }
            Expr::Any => "/(?s:.)/".to_string(),
            Expr::Ref(n) => self.name(n),
            Expr::Repeat { inner, min, max } => {
                let body = self.render(inner, false);
                if body == EMPTY {
                    return EMPTY.to_string();
                }
                format!("{body}{}", quantifier(*min, *max))
            }
        }
    }
}

/// The empty string in Lark (an optional that is never taken).
const EMPTY: &str = "\"\"";

fn is_empty(e: &Expr) -> bool {
    match e {
        Expr::Seq(v) => v.iter().all(is_empty),
        Expr::Literal(s) => s.is_empty(),
        _ => false,
    }
}
