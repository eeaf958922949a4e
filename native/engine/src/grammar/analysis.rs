//! Character-level FIRST/FOLLOW analysis of a GBNF grammar, used to decide when regular
//! sub-expressions may become single llguidance lexemes.
//!
//! llguidance's lexer is greedy over the union of the lexemes allowed at a position, so a
//! multi-character lexeme can swallow input that another parse needed. When the grammar is
//! LL(1) over characters there is exactly one parse path at every position and the next
//! character alone decides between continuing and stopping, so greedy lexing of any regular
//! sub-expression accepts exactly the strings GBNF accepts. Such grammars get multi-character
//! lexemes (mask computation walks the token trie through a DFA instead of calling the parser
//! on every byte); other grammars keep one-character lexemes.

use super::gbnf::{Expr, Grammar};
use std::collections::HashMap;

const MAX_CHAR: u32 = 0x10FFFF;
/// Fixpoint iterations are bounded; a grammar that does not settle is treated as not LL(1).
const MAX_ROUNDS: usize = 256;
/// Longest regex emitted for one lexeme (inlining regular rules can grow it).
pub const MAX_LEXEME_REGEX: usize = 16 * 1024;
/// Deepest chain of rules inlined into one lexeme: deeper regular parts stay parser rules
/// (a long chain of rules would otherwise become one regex nested as deep as the chain, past
/// what llguidance's regex parser accepts and deep enough to exhaust a thread's stack here).
pub const MAX_INLINE_DEPTH: usize = 16;

/// A set of code points as sorted, disjoint, non-adjacent inclusive ranges.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CharSet(Vec<(u32, u32)>);

impl CharSet {
    pub fn all() -> Self {
        CharSet(vec![(0, MAX_CHAR)])
    }

    fn from_ranges(mut r: Vec<(u32, u32)>) -> Self {
        r.sort_unstable();
        let mut out: Vec<(u32, u32)> = Vec::with_capacity(r.len());
        for (lo, hi) in r {
            match out.last_mut() {
                Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
                _ => out.push((lo, hi)),
            }
        }
        CharSet(out)
    }

    fn single(c: char) -> Self {
        CharSet(vec![(c as u32, c as u32)])
    }

    fn class(negated: bool, ranges: &[(char, char)]) -> Self {
        let set = Self::from_ranges(ranges.iter().map(|&(a, b)| (a as u32, b as u32)).collect());
        if negated {
            set.complement()
        } else {
            set
        }
    }

    fn complement(&self) -> Self {
        let mut out = Vec::new();
        let mut next = 0u32;
        for &(lo, hi) in &self.0 {
            if lo > next {
                out.push((next, lo - 1));
            }
            next = hi.saturating_add(1);
        }
        if next <= MAX_CHAR && self.0.last().is_none_or(|l| l.1 < MAX_CHAR) {
            out.push((next, MAX_CHAR));
        }
        CharSet(out)
    }

    pub fn union(&self, other: &CharSet) -> CharSet {
        let mut r = self.0.clone();
        r.extend_from_slice(&other.0);
        Self::from_ranges(r)
    }

    pub fn intersects(&self, other: &CharSet) -> bool {
        let (mut i, mut j) = (0, 0);
        while i < self.0.len() && j < other.0.len() {
            let (a, b) = (self.0[i], other.0[j]);
            if a.1 < b.0 {
                i += 1;
            } else if b.1 < a.0 {
                j += 1;
            } else {
                return true;
            }
        }
        false
    }
}

/// Whether `root` can derive some finite string: a rule like `root ::= root` (or a schema
/// like `{"$ref": "#"}`) matches nothing and would only ever let end-of-generation through.
/// The classic worklist over the rule graph, linear in the grammar's size.
pub fn derives_something(g: &Grammar, root: &str) -> bool {
    let n = g.rules.len();
    let index: HashMap<&str, usize> = g
        .rules
        .iter()
        .enumerate()
        .map(|(i, (name, _))| (name.as_str(), i))
        .collect();
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, (_, body)) in g.rules.iter().enumerate() {
        let mut refs = Vec::new();
        collect_ref_names(body, &mut refs);
        for r in refs {
            if let Some(&j) = index.get(r) {
                users[j].push(i);
            }
        }
    }
    let mut productive = vec![false; n];
    let mut work: Vec<usize> = (0..n).collect();
    while let Some(i) = work.pop() {
        if productive[i] || !expr_productive(&g.rules[i].1, &index, &productive) {
            continue;
        }
        productive[i] = true;
        work.extend(users[i].iter().copied().filter(|&u| !productive[u]));
    }
    index.get(root).is_some_and(|&r| productive[r])
}

fn collect_ref_names<'g>(e: &'g Expr, out: &mut Vec<&'g str>) {
    match e {
        Expr::Alt(v) | Expr::Seq(v) => v.iter().for_each(|x| collect_ref_names(x, out)),
        Expr::Repeat { inner, .. } => collect_ref_names(inner, out),
        Expr::Ref(r) => out.push(r),
        _ => {}
    }
}

fn expr_productive(e: &Expr, index: &HashMap<&str, usize>, productive: &[bool]) -> bool {
    match e {
        Expr::Alt(v) => v.iter().any(|x| expr_productive(x, index, productive)),
        Expr::Seq(v) => v.iter().all(|x| expr_productive(x, index, productive)),
        Expr::Repeat { inner, min, .. } => *min == 0 || expr_productive(inner, index, productive),
        Expr::Ref(r) => index.get(r.as_str()).is_some_and(|&i| productive[i]),
        Expr::Literal(_) | Expr::Class { .. } | Expr::Any => true,
    }
}

/// FIRST/FOLLOW facts about one grammar.
pub struct Analysis<'g> {
    grammar: &'g Grammar,
    index: HashMap<&'g str, usize>,
    nullable: Vec<bool>,
    first: Vec<CharSet>,
    follow: Vec<CharSet>,
    regular: Vec<bool>,
    pub ll1: bool,
}

impl<'g> Analysis<'g> {
    pub fn new(grammar: &'g Grammar, root: &str) -> Self {
        let n = grammar.rules.len();
        let index = grammar
            .rules
            .iter()
            .enumerate()
            .map(|(i, (name, _))| (name.as_str(), i))
            .collect();
        let mut a = Analysis {
            grammar,
            index,
            nullable: vec![false; n],
            first: vec![CharSet::default(); n],
            follow: vec![CharSet::default(); n],
            regular: vec![false; n],
            ll1: false,
        };
        let settled = a.fix_first() && a.fix_follow(root);
        a.fix_regular();
        a.ll1 = settled
            && a.grammar.rules.iter().enumerate().all(|(i, (_, body))| {
                let fol = a.follow[i].clone();
                a.check(body, &fol)
            });
        a
    }

    fn rule(&self, name: &str) -> usize {
        self.index[name]
    }

    pub fn nullable(&self, e: &Expr) -> bool {
        match e {
            Expr::Alt(v) => v.iter().any(|x| self.nullable(x)),
            Expr::Seq(v) => v.iter().all(|x| self.nullable(x)),
            Expr::Literal(s) => s.is_empty(),
            Expr::Class { .. } | Expr::Any => false,
            Expr::Ref(r) => self.nullable[self.rule(r)],
            Expr::Repeat { inner, min, .. } => *min == 0 || self.nullable(inner),
        }
    }

    pub fn first(&self, e: &Expr) -> CharSet {
        match e {
            Expr::Alt(v) => v
                .iter()
                .fold(CharSet::default(), |acc, x| acc.union(&self.first(x))),
            Expr::Seq(v) => {
                let mut acc = CharSet::default();
                for x in v {
                    acc = acc.union(&self.first(x));
                    if !self.nullable(x) {
                        break;
                    }
                }
                acc
            }
            Expr::Literal(s) => s.chars().next().map(CharSet::single).unwrap_or_default(),
            Expr::Class { negated, ranges } => CharSet::class(*negated, ranges),
            Expr::Any => CharSet::all(),
            Expr::Ref(r) => self.first[self.rule(r)].clone(),
            Expr::Repeat { inner, max, .. } => {
                if *max == Some(0) {
                    CharSet::default()
                } else {
                    self.first(inner)
                }
            }
        }
    }

    fn fix_first(&mut self) -> bool {
        for _ in 0..MAX_ROUNDS {
            let mut changed = false;
            for i in 0..self.grammar.rules.len() {
                let body = &self.grammar.rules[i].1;
                let (n, f) = (self.nullable(body), self.first(body));
                if n != self.nullable[i] || f != self.first[i] {
                    self.nullable[i] = n;
                    self.first[i] = f;
                    changed = true;
                }
            }
            if !changed {
                return true;
            }
        }
        false
    }

    /// Adds `fol` to the FOLLOW of every rule referenced in `e`; returns whether any grew.
    fn spread(&self, e: &Expr, fol: &CharSet, out: &mut Vec<CharSet>) -> bool {
        match e {
            Expr::Alt(v) => v.iter().fold(false, |c, x| self.spread(x, fol, out) | c),
            Expr::Seq(v) => {
                let mut changed = false;
                let mut after = fol.clone();
                for x in v.iter().rev() {
                    changed |= self.spread(x, &after, out);
                    after = if self.nullable(x) {
                        after.union(&self.first(x))
                    } else {
                        self.first(x)
                    };
                }
                changed
            }
            Expr::Ref(r) => {
                let i = self.rule(r);
                let grown = out[i].union(fol);
                if grown != out[i] {
                    out[i] = grown;
                    true
                } else {
                    false
                }
            }
            Expr::Repeat { inner, max, .. } => {
                let fol = if max.is_none_or(|m| m > 1) {
                    fol.union(&self.first(inner))
                } else {
                    fol.clone()
                };
                self.spread(inner, &fol, out)
            }
            _ => false,
        }
    }

    fn fix_follow(&mut self, _root: &str) -> bool {
        for _ in 0..MAX_ROUNDS {
            let mut follow = self.follow.clone();
            let mut changed = false;
            for (i, (_, body)) in self.grammar.rules.iter().enumerate() {
                let fol = follow[i].clone();
                changed |= self.spread(body, &fol, &mut follow);
            }
            self.follow = follow;
            if !changed {
                return true;
            }
        }
        false
    }

    /// LL(1) conditions at every choice point of `e`, given what may follow it.
    fn check(&self, e: &Expr, fol: &CharSet) -> bool {
        match e {
            Expr::Alt(v) => {
                let firsts: Vec<CharSet> = v.iter().map(|x| self.first(x)).collect();
                for i in 0..v.len() {
                    for j in i + 1..v.len() {
                        if firsts[i].intersects(&firsts[j]) {
                            return false;
                        }
                    }
                }
                let nullables: Vec<usize> =
                    (0..v.len()).filter(|&i| self.nullable(&v[i])).collect();
                if nullables.len() > 1 {
                    return false;
                }
                if let Some(&n) = nullables.first() {
                    if (0..v.len()).any(|i| i != n && firsts[i].intersects(fol)) {
                        return false;
                    }
                }
                v.iter().all(|x| self.check(x, fol))
            }
            Expr::Seq(v) => {
                let mut after = fol.clone();
                for x in v.iter().rev() {
                    if !self.check(x, &after) {
                        return false;
                    }
                    after = if self.nullable(x) {
                        after.union(&self.first(x))
                    } else {
                        self.first(x)
                    };
                }
                true
            }
            Expr::Repeat { inner, min, max } => {
                if self.nullable(inner) {
                    return false;
                }
                let optional_more = max.is_none_or(|m| m > *min);
                if optional_more && self.first(inner).intersects(fol) {
                    return false;
                }
                let inner_fol = if max.is_none_or(|m| m > 1) {
                    fol.union(&self.first(inner))
                } else {
                    fol.clone()
                };
                self.check(inner, &inner_fol)
            }
            _ => true,
        }
    }

    /// A rule is regular when it only uses terminals and regular rules, without recursion:
    /// one depth-first walk of the reference graph (no recursion here: a chain of thousands
    /// of rules must not exhaust the stack), where reaching a rule still being walked means a
    /// cycle.
    fn fix_regular(&mut self) {
        #[derive(Clone, Copy, PartialEq)]
        enum Mark {
            New,
            Open,
            Done,
        }
        let n = self.grammar.rules.len();
        let refs: Vec<Vec<usize>> = self
            .grammar
            .rules
            .iter()
            .map(|(_, body)| {
                let mut out = Vec::new();
                self.collect_refs(body, &mut out);
                out
            })
            .collect();
        let mut mark = vec![Mark::New; n];
        let mut regular = vec![true; n];
        for start in 0..n {
            if mark[start] != Mark::New {
                continue;
            }
            mark[start] = Mark::Open;
            let mut stack = vec![(start, 0usize)];
            while let Some(&mut (rule, ref mut next)) = stack.last_mut() {
                if let Some(&child) = refs[rule].get(*next) {
                    *next += 1;
                    match mark[child] {
                        Mark::New => {
                            mark[child] = Mark::Open;
                            stack.push((child, 0));
                        }
                        // a cycle: every rule on the walk from `child` to here recurses
                        Mark::Open => {
                            for &(r, _) in stack.iter().skip_while(|(r, _)| *r != child) {
                                regular[r] = false;
                            }
                        }
                        Mark::Done => regular[rule] &= regular[child],
                    }
                } else {
                    mark[rule] = Mark::Done;
                    stack.pop();
                    if let Some(&(parent, _)) = stack.last() {
                        regular[parent] &= regular[rule];
                    }
                }
            }
        }
        self.regular = regular;
    }

    fn collect_refs(&self, e: &Expr, out: &mut Vec<usize>) {
        match e {
            Expr::Alt(v) | Expr::Seq(v) => v.iter().for_each(|x| self.collect_refs(x, out)),
            Expr::Repeat { inner, .. } => self.collect_refs(inner, out),
            Expr::Ref(r) => out.push(self.rule(r)),
            _ => {}
        }
    }

    /// Whether `e` only uses terminals and regular rules.
    pub fn is_regular(&self, e: &Expr) -> bool {
        match e {
            Expr::Alt(v) | Expr::Seq(v) => v.iter().all(|x| self.is_regular(x)),
            Expr::Repeat { inner, .. } => self.is_regular(inner),
            Expr::Ref(r) => self.regular[self.rule(r)],
            _ => true,
        }
    }

    /// `e` as a regex (llguidance/Rust syntax), inlining regular rules; `None` when it does
    /// not fit in [`MAX_LEXEME_REGEX`].
    pub fn regex(&self, e: &Expr) -> Option<String> {
        let mut out = String::new();
        self.regex_into(e, &mut out, 0).then_some(out)
    }

    fn regex_into(&self, e: &Expr, out: &mut String, inlined: usize) -> bool {
        if out.len() > MAX_LEXEME_REGEX {
            return false;
        }
        match e {
            Expr::Alt(v) => {
                out.push_str("(?:");
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        out.push('|');
                    }
                    if !self.regex_into(x, out, inlined) {
                        return false;
                    }
                }
                out.push(')');
            }
            Expr::Seq(v) => {
                out.push_str("(?:");
                for x in v {
                    if !self.regex_into(x, out, inlined) {
                        return false;
                    }
                }
                out.push(')');
            }
            Expr::Literal(s) => {
                out.push_str("(?:");
                for c in s.chars() {
                    out.push_str(&char_regex(c));
                }
                out.push(')');
            }
            Expr::Class { negated, ranges } => {
                if ranges.is_empty() {
                    out.push_str("(?s:.)");
                } else {
                    out.push('[');
                    if *negated {
                        out.push('^');
                    }
                    for &(lo, hi) in ranges {
                        out.push_str(&char_regex(lo));
                        if hi != lo {
                            out.push('-');
                            out.push_str(&char_regex(hi));
                        }
                    }
                    out.push(']');
                }
            }
            Expr::Any => out.push_str("(?s:.)"),
            Expr::Ref(r) => {
                let body = &self.grammar.rules[self.rule(r)].1;
                if inlined == MAX_INLINE_DEPTH || !self.regex_into(body, out, inlined + 1) {
                    return false;
                }
            }
            Expr::Repeat { inner, min, max } => {
                out.push_str("(?:");
                if !self.regex_into(inner, out, inlined) {
                    return false;
                }
                out.push(')');
                out.push_str(&quantifier(*min, *max));
            }
        }
        out.len() <= MAX_LEXEME_REGEX
    }
}

pub fn char_regex(c: char) -> String {
    format!("\\x{{{:x}}}", c as u32)
}

pub fn quantifier(min: u32, max: Option<u32>) -> String {
    match (min, max) {
        (0, None) => "*".into(),
        (1, None) => "+".into(),
        (0, Some(1)) => "?".into(),
        (m, None) => format!("{{{m},}}"),
        (m, Some(n)) if m == n => format!("{{{m}}}"),
        (m, Some(n)) => format!("{{{m},{n}}}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::gbnf::parse;

    fn ll1(g: &str) -> bool {
        let g = parse(g, "root").unwrap();
        Analysis::new(&g, "root").ll1
    }

    #[test]
    fn charset_ops() {
        let a = CharSet::class(false, &[('a', 'c'), ('b', 'f')]);
        assert_eq!(a, CharSet(vec![(97, 102)]));
        let n = CharSet::class(true, &[('a', 'z')]);
        assert!(!n.intersects(&CharSet::single('q')));
        assert!(n.intersects(&CharSet::single('A')));
        assert_eq!(n.complement(), CharSet(vec![(97, 122)]));
        assert_eq!(CharSet::all().complement(), CharSet::default());
    }

    #[test]
    fn grammars_that_match_nothing_are_found() {
        let derives = |g: &str| derives_something(&parse(g, "root").unwrap(), "root");
        assert!(!derives("root ::= root"));
        assert!(!derives("root ::= \"a\" root"));
        assert!(!derives("root ::= x\nx ::= \"b\" x | root"));
        assert!(derives("root ::= \"a\" root | \"b\""));
        assert!(derives("root ::= root*"));
        assert!(derives("root ::= x\nx ::= \"b\" x?"));
    }

    #[test]
    fn recognises_ll1_grammars() {
        assert!(ll1(r#"root ::= item{3,5}
            item ::= "- " [A-Za-z ]{1,30} "\n""#));
        assert!(ll1(r#"root ::= "{" ws (pair ("," ws pair)*)? "}"
            pair ::= str ":" ws [0-9]+ ws
            str ::= "\"" [^"]* "\"" ws
            ws ::= " "?"#));
        // a word followed by a character it may contain: greedy lexing would be wrong
        assert!(!ll1(r#"root ::= [a-z]+ "x""#));
        assert!(!ll1(r#"root ::= "ab" | "ac""#));
        assert!(!ll1(r#"root ::= [0-9] | [1-9] [0-9]{0,15}"#));
        assert!(!ll1(r#"root ::= x x
            x ::= "a"?"#));
        // left recursion never settles into LL(1)
        assert!(!ll1(r#"root ::= root "a" | "b""#));
    }
}
