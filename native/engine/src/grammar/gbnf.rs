//! A parser for llama.cpp's GBNF grammar syntax, with its limits checked as it goes (see
//! [`crate::limits`]). [`super::lark`] turns the result into llguidance's Lark dialect.

use super::GrammarError;
use crate::limits::Limits;
use std::collections::HashMap;

/// One GBNF expression.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    Alt(Vec<Expr>),
    Seq(Vec<Expr>),
    Literal(String),
    /// A character class: `negated` flips the set of inclusive ranges.
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    /// `.`: any single character.
    Any,
    Ref(String),
    Repeat {
        inner: Box<Expr>,
        min: u32,
        max: Option<u32>,
    },
}

/// A parsed GBNF grammar: rules in definition order (a later definition replaces an earlier
/// one, as in llama.cpp).
#[derive(Debug, Clone, PartialEq)]
pub struct Grammar {
    pub rules: Vec<(String, Expr)>,
}

/// Largest repetition bound accepted in `{m,n}` (llama.cpp expands repetitions into rules, so
/// it effectively has a similar practical limit).
const MAX_REPEAT: u32 = 10_000;

fn err(msg: impl Into<String>) -> GrammarError {
    GrammarError(msg.into())
}

struct Parser<'a> {
    src: &'a [char],
    pos: usize,
    limits: Limits,
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<char> {
        self.src.get(self.pos).copied()
    }

    fn peek_at(&self, off: usize) -> Option<char> {
        self.src.get(self.pos + off).copied()
    }

    fn line_col(&self) -> String {
        let upto = &self.src[..self.pos.min(self.src.len())];
        let line = upto.iter().filter(|&&c| c == '\n').count() + 1;
        let col = upto.iter().rev().take_while(|&&c| c != '\n').count() + 1;
        format!("line {line}, column {col}")
    }

    fn fail<T>(&self, msg: &str) -> Result<T, GrammarError> {
        Err(err(format!("{msg} at {}", self.line_col())))
    }

    /// Skips spaces, tabs, newlines and `#` comments.
    fn skip_space(&mut self) {
        while let Some(c) = self.peek() {
            if c == '#' {
                while let Some(c) = self.peek() {
                    if c == '\n' {
                        break;
                    }
                    self.pos += 1;
                }
            } else if c.is_whitespace() {
                self.pos += 1;
            } else {
                break;
            }
        }
    }

    fn name(&mut self) -> Result<String, GrammarError> {
        let start = self.pos;
        while self.peek().is_some_and(is_name_char) {
            self.pos += 1;
        }
        if start == self.pos {
            return self.fail("expected a rule name");
        }
        Ok(self.src[start..self.pos].iter().collect())
    }

    /// Whether the input at the cursor starts a new rule (`name ::=`).
    fn at_rule_start(&self) -> bool {
        let mut i = self.pos;
        while self.src.get(i).copied().is_some_and(is_name_char) {
            i += 1;
        }
        if i == self.pos {
            return false;
        }
        while self.src.get(i).is_some_and(|c| *c == ' ' || *c == '\t') {
            i += 1;
        }
        self.src.get(i..i + 3) == Some(&[':', ':', '='][..])
    }

    fn grammar(&mut self) -> Result<Grammar, GrammarError> {
        let mut rules: Vec<(String, Expr)> = Vec::new();
        self.skip_space();
        while self.peek().is_some() {
            let name = self.name()?;
            self.skip_space();
            if !(self.peek() == Some(':')
                && self.peek_at(1) == Some(':')
                && self.peek_at(2) == Some('='))
            {
                return self.fail("expected ::=");
            }
            self.pos += 3;
            let body = self.alternatives(0)?;
            if let Some(existing) = rules.iter_mut().find(|(n, _)| *n == name) {
                existing.1 = body;
            } else {
                if rules.len() == self.limits.grammar_rules {
                    return Err(err(format!(
                        "grammar has more than {} rules (limit grammar_rules)",
                        self.limits.grammar_rules
                    )));
                }
                rules.push((name, body));
            }
            self.skip_space();
        }
        Ok(Grammar { rules })
    }

    fn alternatives(&mut self, depth: usize) -> Result<Expr, GrammarError> {
        let mut alts = vec![self.sequence(depth)?];
        while self.peek() == Some('|') {
            self.pos += 1;
            alts.push(self.sequence(depth)?);
        }
        Ok(if alts.len() == 1 {
            alts.pop().unwrap_or(Expr::Seq(Vec::new()))
        } else {
            Expr::Alt(alts)
        })
    }

    fn sequence(&mut self, depth: usize) -> Result<Expr, GrammarError> {
        let mut items = Vec::new();
        loop {
            self.skip_space();
            let Some(c) = self.peek() else { break };
            if c == '|' || c == ')' || self.at_rule_start() {
                break;
            }
            let atom = self.atom(depth)?;
            let item = self.postfix(atom, depth)?;
            items.push(item);
        }
        Ok(if items.len() == 1 {
            items.pop().unwrap_or(Expr::Seq(Vec::new()))
        } else {
            Expr::Seq(items)
        })
    }

    fn atom(&mut self, depth: usize) -> Result<Expr, GrammarError> {
        match self.peek() {
            Some('"') => {
                self.pos += 1;
                let mut s = String::new();
                loop {
                    match self.peek() {
                        None => return self.fail("unterminated string literal"),
                        Some('"') => {
                            self.pos += 1;
                            break;
                        }
                        Some(_) => s.push(self.char_in_literal()?),
                    }
                }
                Ok(Expr::Literal(s))
            }
            Some('[') => {
                self.pos += 1;
                let negated = self.peek() == Some('^');
                if negated {
                    self.pos += 1;
                }
                let mut ranges = Vec::new();
                loop {
                    match self.peek() {
                        None => return self.fail("unterminated character class"),
                        Some(']') => {
                            self.pos += 1;
                            break;
                        }
                        Some(_) => {
                            let lo = self.char_in_literal()?;
                            let hi = if self.peek() == Some('-') && self.peek_at(1) != Some(']') {
                                self.pos += 1;
                                if self.peek().is_none() {
                                    return self.fail("unterminated character class");
                                }
                                self.char_in_literal()?
                            } else {
                                lo
                            };
                            if hi < lo {
                                return self.fail("character range out of order");
                            }
                            ranges.push((lo, hi));
                        }
                    }
                }
                if ranges.is_empty() && !negated {
                    return self.fail("empty character class");
                }
                Ok(Expr::Class { negated, ranges })
            }
            Some('.') => {
                self.pos += 1;
                Ok(Expr::Any)
            }
            Some('(') => {
                self.check_nesting(depth + 1)?;
                self.pos += 1;
                let inner = self.alternatives(depth + 1)?;
                self.skip_space();
                if self.peek() != Some(')') {
                    return self.fail("expected )");
                }
                self.pos += 1;
                Ok(inner)
            }
            Some(c) if is_name_char(c) => Ok(Expr::Ref(self.name()?)),
            Some('<') => self.fail("token references (<...>) are not supported"),
            Some(c) => self.fail(&format!("unexpected character {c:?}")),
            None => self.fail("unexpected end of grammar"),
        }
    }

    fn check_nesting(&self, depth: usize) -> Result<(), GrammarError> {
        if depth > self.limits.grammar_nesting {
            return Err(err(format!(
                "grammar nesting deeper than {} levels (limit grammar_nesting)",
                self.limits.grammar_nesting
            )));
        }
        Ok(())
    }

    /// Repetition operators after `atom`; each nests the expression one level deeper (every
    /// later pass over the grammar recurses through them).
    fn postfix(&mut self, mut atom: Expr, mut depth: usize) -> Result<Expr, GrammarError> {
        loop {
            let (min, max) = match self.peek() {
                Some('*') => {
                    self.pos += 1;
                    (0, None)
                }
                Some('+') => {
                    self.pos += 1;
                    (1, None)
                }
                Some('?') => {
                    self.pos += 1;
                    (0, Some(1))
                }
                Some('{') => {
                    self.pos += 1;
                    self.skip_space();
                    let min = self.number()?;
                    self.skip_space();
                    let max = if self.peek() == Some(',') {
                        self.pos += 1;
                        self.skip_space();
                        if self.peek() == Some('}') {
                            None
                        } else {
                            Some(self.number()?)
                        }
                    } else {
                        Some(min)
                    };
                    self.skip_space();
                    if self.peek() != Some('}') {
                        return self.fail("expected } after repetition bounds");
                    }
                    self.pos += 1;
                    if max.is_some_and(|m| m < min) {
                        return self.fail("repetition maximum below minimum");
                    }
                    (min, max)
                }
                _ => return Ok(atom),
            };
            depth += 1;
            self.check_nesting(depth)?;
            atom = Expr::Repeat {
                inner: Box::new(atom),
                min,
                max,
            };
        }
    }

    fn number(&mut self) -> Result<u32, GrammarError> {
        let start = self.pos;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.pos += 1;
        }
        let text: String = self.src[start..self.pos].iter().collect();
        match text.parse::<u32>() {
            Ok(n) if n <= MAX_REPEAT => Ok(n),
            Ok(_) => self.fail(&format!("repetition bound over {MAX_REPEAT}")),
            Err(_) => self.fail("expected a number"),
        }
    }

    fn hex(&mut self, digits: usize) -> Result<char, GrammarError> {
        let mut v = 0u32;
        for _ in 0..digits {
            let Some(d) = self.peek().and_then(|c| c.to_digit(16)) else {
                return self.fail("bad hex escape");
            };
            v = v * 16 + d;
            self.pos += 1;
        }
        match char::from_u32(v) {
            Some(c) => Ok(c),
            None => self.fail("escape is not a valid code point"),
        }
    }

    fn char_in_literal(&mut self) -> Result<char, GrammarError> {
        let Some(c) = self.peek() else {
            return self.fail("unexpected end of grammar");
        };
        self.pos += 1;
        if c != '\\' {
            return Ok(c);
        }
        let Some(e) = self.peek() else {
            return self.fail("unterminated escape");
        };
        self.pos += 1;
        Ok(match e {
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            '0' => '\0',
            'x' => return self.hex(2),
            'u' => return self.hex(4),
            'U' => return self.hex(8),
            '\\' | '"' | '[' | ']' | '-' | '^' | '/' | '.' | '\'' => e,
            other => return self.fail(&format!("unknown escape \\{other}")),
        })
    }
}

/// Parses GBNF text and checks it: size, nesting, undefined rules and the root rule.
pub fn parse(text: &str, root: &str) -> Result<Grammar, GrammarError> {
    let limits = crate::limits::limits();
    if text.len() > limits.grammar_bytes {
        return Err(err(format!(
            "grammar larger than {} bytes (limit grammar_bytes)",
            limits.grammar_bytes
        )));
    }
    let chars: Vec<char> = text.chars().collect();
    let grammar = Parser {
        src: &chars,
        pos: 0,
        limits,
    }
    .grammar()?;
    let names: HashMap<&str, ()> = grammar
        .rules
        .iter()
        .map(|(n, _)| (n.as_str(), ()))
        .collect();
    if !names.contains_key(root) {
        return Err(err(format!(
            "grammar does not define the root rule '{root}'"
        )));
    }
    for (_, body) in &grammar.rules {
        check_refs(body, &names)?;
    }
    Ok(grammar)
}

fn check_refs(e: &Expr, names: &HashMap<&str, ()>) -> Result<(), GrammarError> {
    match e {
        Expr::Ref(n) if !names.contains_key(n.as_str()) => {
            Err(err(format!("undefined rule identifier '{n}'")))
        }
        Expr::Alt(v) | Expr::Seq(v) => v.iter().try_for_each(|x| check_refs(x, names)),
        Expr::Repeat { inner, .. } => check_refs(inner, names),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::lark::to_lark;

    #[test]
    fn parses_the_common_constructs() {
        let g = parse(
            r#"
            # a comment
            root ::= "a\n\x41\u00e9" [a-z0-9_] [^"\\] . item{2} item{1,} item{0,3} (x | "y")* x? x+
            item ::= ("b" | "c") # trailing
            x ::=
               "x"
               | "z"
            "#,
            "root",
        )
        .unwrap();
        assert_eq!(g.rules.len(), 3);
        let Expr::Seq(items) = &g.rules[0].1 else {
            panic!("root is a sequence")
        };
        assert_eq!(items[0], Expr::Literal("a\nAé".into()));
        assert_eq!(items.len(), 10);
        assert!(matches!(g.rules[2].1, Expr::Alt(ref v) if v.len() == 2));
    }

    #[test]
    fn errors_are_reported() {
        for (text, needle) in [
            ("root ::= foo", "undefined rule"),
            ("other ::= \"a\"", "root rule"),
            ("root ::= \"abc", "unterminated"),
            ("root ::= [a-", "unterminated"),
            ("root ::= (\"a\"", "expected )"),
            ("root = \"a\"", "::="),
            ("root ::= \"a\"{3,1}", "maximum below"),
            ("root ::= [z-a]", "out of order"),
            ("root ::= \"\\q\"", "unknown escape"),
        ] {
            let e = parse(text, "root").unwrap_err();
            assert!(e.0.contains(needle), "{text}: {}", e.0);
        }
    }

    #[test]
    fn nesting_limit() {
        let nest = |n: usize| format!("root ::= {}\"a\"{}", "(".repeat(n), ")".repeat(n));
        assert!(parse(&nest(60), "root").is_ok());
        assert!(parse(&nest(64), "root").is_ok());
        assert!(parse(&nest(65), "root").is_err());
        assert!(parse(&nest(200), "root").is_err());
    }

    #[test]
    fn size_limit() {
        let big = format!(
            "root ::= \"{}\"",
            "a".repeat(crate::limits::DEFAULT_LIMITS.grammar_bytes)
        );
        assert!(parse(&big, "root").unwrap_err().0.contains("larger"));
    }

    #[test]
    fn custom_root_and_redefinition() {
        let g = parse("a ::= \"1\"\nb ::= a a\na ::= \"2\"", "b").unwrap();
        assert_eq!(g.rules.len(), 2);
        assert_eq!(g.rules[0].1, Expr::Literal("2".into()));
        let lark = to_lark(&g, "b");
        assert!(lark.starts_with("start: r1\n"), "{lark}");
    }

    /// Runs text byte by byte through llguidance on a one-byte-per-token vocabulary.
    fn accepts(gbnf: &str, input: &str) -> bool {
        use llguidance::api::TopLevelGrammar;
        use llguidance::toktrie::ApproximateTokEnv;
        use llguidance::{Matcher, ParserFactory};
        let env = ApproximateTokEnv::single_byte_env();
        let mut f = ParserFactory::new_simple(&env).unwrap();
        f.quiet();
        let g = parse(gbnf, "root").unwrap();
        let lark = to_lark(&g, "root");
        let mut m = Matcher::new(f.create_parser(TopLevelGrammar::from_lark(lark.clone())));
        assert!(m.get_error().is_none(), "{lark}: {:?}", m.get_error());
        for b in input.bytes() {
            let t = env.tok_trie().token_id(&[b]).unwrap();
            if m.is_stopped() || !m.compute_mask().unwrap().is_allowed(t) {
                return false;
            }
            m.consume_token(t).unwrap();
        }
        m.is_accepting().unwrap()
    }

    #[test]
    fn gbnf_semantics_survive_translation() {
        let cases: &[(&str, &[&str], &[&str])] = &[
            // not LL(1): one-character lexemes keep the parses greedy lexing would lose
            (r#"root ::= [a-z]+ "x""#, &["abcx", "xx"], &["abc", "x"]),
            (
                r#"root ::= [a-z]+ ";" | "abc" "x""#,
                &["abcx", "abc;", "q;"],
                &["abc"],
            ),
            (
                r#"root ::= "ab" | "a" "bc""#,
                &["ab", "abc"],
                &["a", "abcd"],
            ),
            // LL(1): whole regular parts become lexemes
            (
                "root ::= item{3,5}\nitem ::= \"- \" [A-Za-z ]{1,30} \"\\n\"",
                &["- a\n- b c\n- d\n", "- a\n- b\n- c\n- d\n- e\n"],
                &[
                    "- a\n- b\n",
                    "- a\n- b\n- c\n- d\n- e\n- f\n",
                    "- \n- b\n- c\n",
                ],
            ),
            (
                r#"root ::= [0-9]{3} "-" [0-9]{4}"#,
                &["555-1234"],
                &["55-1234", "5555-123"],
            ),
            (
                r#"root ::= "hello world""#,
                &["hello world"],
                &["hello", "hello world!"],
            ),
            (
                r#"root ::= "é" [^a-z]? . "\x41""#,
                &["éZ!A", "é!A"],
                &["éa!A"],
            ),
            (
                r#"root ::= "{" ws (pair ("," ws pair)*)? "}"
                pair ::= str ":" ws [0-9]+ ws
                str ::= "\"" [^"]* "\"" ws
                ws ::= " "?"#,
                &[r#"{}"#, r#"{"a": 1, "b":22 }"#],
                &[r#"{"a": }"#, r#"{"a" 1}"#],
            ),
        ];
        for (g, good, bad) in cases {
            for input in *good {
                assert!(accepts(g, input), "{g:?} should accept {input:?}");
            }
            for input in *bad {
                assert!(!accepts(g, input), "{g:?} should reject {input:?}");
            }
        }
        let g = parse(cases[3].0, "root").unwrap();
        assert!(
            to_lark(&g, "root").contains("{1,30}"),
            "LL(1) grammars get whole lexemes"
        );
        let g = parse(cases[0].0, "root").unwrap();
        assert!(
            to_lark(&g, "root").contains("]/+"),
            "other grammars keep one-character lexemes"
        );
    }
}
