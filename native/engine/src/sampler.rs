//! Token sampling with llama.cpp's stage order and semantics:
//! logit bias → grammar → penalties → DRY → top-n-sigma → top-k → typical → top-p → min-p →
//! XTC → temperature (dynamic when `dynatemp_range` > 0) → seeded draw; greedy when temp ≤ 0
//! (after bias, grammar, penalties and DRY). Mirostat v1/v2 replace the truncation stages with
//! temperature → mirostat, as in llama.cpp's common sampler. Candidates with equal logits
//! are ordered by token id, the lower first, so that a seeded draw has one result.

use crate::grammar::Constraint;
use crate::tokenizer::{TokenId, Tokenizer};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

/// Penalties look at this many most recent tokens by default (llama.cpp's `penalty_last_n`).
pub const PENALTY_LAST_N: usize = 64;
/// Longest history kept for penalties and DRY (`-1`, "the whole context", is capped here).
pub const MAX_HISTORY: usize = 4096;
/// Mirostat v1 estimates the distribution's shape from this many top tokens (llama.cpp's m).
const MIROSTAT_M: usize = 100;
/// llama.cpp's default DRY sequence breakers.
pub const DEFAULT_DRY_BREAKERS: &[&str] = &["\n", ":", "\"", "*"];

#[derive(Debug, Clone, PartialEq)]
pub struct SamplerParams {
    pub seed: u64,
    pub temp: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub penalty_repeat: f32,
    pub penalty_freq: f32,
    pub penalty_present: f32,
    /// Tokens of history the penalties see: 0 disables them, -1 means all (up to MAX_HISTORY).
    pub penalty_last_n: i32,
    /// Fewest candidates the truncation stages (top-p, min-p, typical, XTC) may leave.
    pub min_keep: usize,
    /// Locally typical sampling; 1.0 disables it.
    pub typical_p: f32,
    /// Keep logits within n standard deviations of the maximum; ≤ 0 disables it.
    pub top_n_sigma: f32,
    pub xtc_probability: f32,
    pub xtc_threshold: f32,
    /// DRY repetition penalty; 0 disables it.
    pub dry_multiplier: f32,
    pub dry_base: f32,
    pub dry_allowed_length: i32,
    /// History DRY looks at: 0 disables, -1 means all (up to MAX_HISTORY).
    pub dry_penalty_last_n: i32,
    /// 0 off, 1 Mirostat, 2 Mirostat 2.0.
    pub mirostat: u8,
    pub mirostat_tau: f32,
    pub mirostat_eta: f32,
    /// Dynamic temperature: temp ± range scaled by the normalized entropy^exponent.
    pub dynatemp_range: f32,
    pub dynatemp_exponent: f32,
    /// Added to the logits before anything else (-inf bans a token).
    pub logit_bias: Vec<(TokenId, f32)>,
    /// Report log-probabilities of sampled tokens: `None` off, `Some(n)` with the `n` most
    /// likely alternatives (from the raw logits, before any sampler stage).
    pub logprobs: Option<usize>,
}

/// Maximum number of alternatives reported per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Log-probability of a token and the most likely alternatives, from raw logits.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(TokenId, f32)>,
}

/// Log-softmax of `logits` at `token` plus the `n` most likely tokens (descending).
pub fn token_logprobs(logits: &[f32], token: TokenId, n: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    let lp = |l: f32| (l as f64 - lse) as f32;
    let n = n.min(MAX_TOP_LOGPROBS).min(logits.len());
    let mut top: Vec<(TokenId, f32)> = Vec::with_capacity(n);
    if n > 0 {
        let mut idx: Vec<(TokenId, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as TokenId, l))
            .collect();
        idx.select_nth_unstable_by(n - 1, by_logit);
        idx.truncate(n);
        idx.sort_by(by_logit);
        top = idx.into_iter().map(|(i, l)| (i, lp(l))).collect();
    }
    TokenLogprobs {
        logprob: logits
            .get(token as usize)
            .map(|&l| lp(l))
            .unwrap_or(f32::NEG_INFINITY),
        top,
    }
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            seed: 0,
            temp: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            penalty_repeat: 1.0,
            penalty_freq: 0.0,
            penalty_present: 0.0,
            penalty_last_n: PENALTY_LAST_N as i32,
            min_keep: 0,
            typical_p: 1.0,
            top_n_sigma: -1.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: -1,
            mirostat: 0,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
            dynatemp_range: 0.0,
            dynatemp_exponent: 1.0,
            logit_bias: Vec::new(),
            logprobs: None,
        }
    }
}

impl SamplerParams {
    pub fn greedy() -> Self {
        SamplerParams {
            temp: 0.0,
            ..Default::default()
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        let finite = [
            self.temp,
            self.top_p,
            self.min_p,
            self.penalty_repeat,
            self.penalty_freq,
            self.penalty_present,
            self.typical_p,
            self.top_n_sigma,
            self.xtc_probability,
            self.xtc_threshold,
            self.dry_multiplier,
            self.dry_base,
            self.mirostat_tau,
            self.mirostat_eta,
            self.dynatemp_range,
            self.dynatemp_exponent,
        ]
        .iter()
        .all(|v| v.is_finite());
        if !finite {
            return Err("sampler parameters must be finite numbers".into());
        }
        if self.penalty_repeat <= 0.0 {
            return Err("penalty_repeat must be positive".into());
        }
        if self.mirostat > 2 {
            return Err("mirostat must be 0, 1 or 2".into());
        }
        if self.penalty_last_n < -1 || self.dry_penalty_last_n < -1 {
            return Err("penalty_last_n and dry_penalty_last_n must be >= -1".into());
        }
        if self.logit_bias.iter().any(|(_, b)| b.is_nan()) {
            return Err("logit_bias values must be numbers".into());
        }
        Ok(())
    }

    fn penalties_active(&self) -> bool {
        self.penalty_last_n != 0
            && (self.penalty_repeat != 1.0
                || self.penalty_freq != 0.0
                || self.penalty_present != 0.0)
    }

    fn dry_active(&self) -> bool {
        self.dry_multiplier > 0.0 && self.dry_base >= 1.0 && self.dry_penalty_last_n != 0
    }

    fn history_len(&self) -> usize {
        let want = |n: i32| if n < 0 { MAX_HISTORY } else { n as usize };
        let mut len = 0;
        if self.penalties_active() {
            len = want(self.penalty_last_n);
        }
        if self.dry_active() {
            len = len.max(want(self.dry_penalty_last_n));
        }
        len.min(MAX_HISTORY)
    }
}

/// Everything one request's sampler is built from (see `Model::sampler`).
#[derive(Debug, Clone)]
pub struct SamplerSpec {
    pub params: SamplerParams,
    /// `None`: a seed drawn from the OS's randomness.
    pub seed: Option<u64>,
    pub grammar: Option<crate::grammar::GrammarSpec>,
    /// When not empty, the grammar applies from the first of these strings in the output on
    /// (a lazy grammar); before it, output is free.
    pub grammar_triggers: Vec<String>,
    /// Strings whose tokens end a DRY repetition.
    pub dry_sequence_breakers: Vec<String>,
}

/// Why a sampler could not be built.
#[derive(Debug, Clone, PartialEq)]
pub enum SamplerError {
    /// A parameter out of range.
    Invalid(String),
    /// The grammar (or JSON Schema) does not compile.
    Grammar(crate::grammar::GrammarError),
}

impl std::fmt::Display for SamplerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SamplerError::Invalid(m) => f.write_str(m),
            SamplerError::Grammar(e) => write!(f, "invalid grammar: {e}"),
        }
    }
}

/// A seed from the OS's randomness (through the standard library's hash keys).
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// Tokens that end a DRY repetition: those whose text contains a breaker string.
pub fn dry_breaker_tokens(tokenizer: &Tokenizer, breakers: &[String]) -> HashSet<TokenId> {
    let mut out = HashSet::new();
    if breakers.is_empty() {
        return out;
    }
    for id in 0..tokenizer.n_vocab() as TokenId {
        let Ok(piece) = tokenizer.token_to_piece(id) else {
            continue;
        };
        let text = String::from_utf8_lossy(piece);
        if breakers
            .iter()
            .any(|b| !b.is_empty() && text.contains(b.as_str()))
        {
            out.insert(id);
        }
    }
    out
}

/// xoshiro256** seeded through splitmix64: small, fast and reproducible across platforms.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut z = seed;
        let mut s = [0u64; 4];
        for x in &mut s {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut v = z;
            v = (v ^ (v >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            v = (v ^ (v >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            *x = v ^ (v >> 31);
        }
        Rng { s }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[derive(Debug, Clone)]
pub struct Sampler {
    pub params: SamplerParams,
    rng: Rng,
    history: VecDeque<TokenId>,
    history_cap: usize,
    candidates: Vec<(TokenId, f32)>,
    scratch: Vec<f32>,
    /// The row with bias, penalties and DRY applied (see `prepared_row`).
    prepared: Vec<f32>,
    /// Scratch of `best_by_logit`.
    block_max: Vec<f32>,
    /// The bias entries in token order, for [`Sampler::greedy_row`].
    biased: Vec<(TokenId, f32)>,
    grammar: Option<Box<Constraint>>,
    dry_breakers: Arc<HashSet<TokenId>>,
    mirostat_mu: f32,
    grammar_stats: GrammarStats,
    /// Whether sampled steps may check only the best candidates against the grammar (see
    /// `pick_top_k_allowed`); off only to compare against the full-mask path in tests.
    pub lazy_grammar: bool,
    /// Whether sampled steps that top-k decides find its candidates in one pass over the row
    /// (see `best_by_logit`); off only to compare against the whole row's list in tests.
    pub top_k_scan: bool,
    /// Returned when logit bias and grammar leave no candidate (generation then ends).
    end_token: Option<TokenId>,
}

/// How many of the best candidates a sampled step with `top_k` checks against the grammar
/// before it falls back to a full mask: at least this many, or four times `top_k`.
const LAZY_GRAMMAR_WINDOW: usize = 128;
/// Rejected candidates after which a sampled step stops checking and computes the full mask:
/// a grammar that rejects this many of the model's favourites allows few tokens, and then the
/// mask is cheap.
const LAZY_GRAMMAR_MAX_REJECTS: usize = 32;

/// Grammar cost (for benchmarks and telemetry): sampling steps under a grammar, how many
/// needed a full token mask, the time those took, and the time of the steps that did not.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GrammarStats {
    pub steps: u64,
    pub masks: u64,
    pub total_ns: u64,
    pub max_ns: u64,
    pub check_ns: u64,
}

impl Sampler {
    pub fn new(params: SamplerParams) -> Self {
        let history_cap = params.history_len();
        Sampler {
            rng: Rng::new(params.seed),
            mirostat_mu: 2.0 * params.mirostat_tau,
            params,
            history: VecDeque::with_capacity(history_cap),
            history_cap,
            candidates: Vec::new(),
            scratch: Vec::new(),
            prepared: Vec::new(),
            block_max: Vec::new(),
            biased: Vec::new(),
            grammar: None,
            dry_breakers: Arc::new(HashSet::new()),
            grammar_stats: GrammarStats::default(),
            lazy_grammar: true,
            top_k_scan: true,
            end_token: None,
        }
    }

    /// The token to return when logit bias and grammar together leave no candidate: the
    /// vocabulary's end-of-generation token, so the request ends instead of ignoring them.
    pub fn with_end_token(mut self, token: TokenId) -> Self {
        self.end_token = Some(token);
        self
    }

    /// Constrains every sampled token to `grammar`.
    pub fn with_grammar(mut self, grammar: Constraint) -> Self {
        self.grammar = Some(Box::new(grammar));
        self
    }

    /// Sets the tokens that end a DRY repetition (see [`dry_breaker_tokens`]).
    pub fn with_dry_breakers(mut self, breakers: Arc<HashSet<TokenId>>) -> Self {
        self.dry_breakers = breakers;
        self
    }

    pub fn has_grammar(&self) -> bool {
        self.grammar.is_some()
    }

    pub fn grammar_stats(&self) -> GrammarStats {
        self.grammar_stats
    }

    /// Restores the initial state (RNG, history, Mirostat's mu and the grammar).
    pub fn reset(&mut self) {
        self.rng = Rng::new(self.params.seed);
        self.history.clear();
        self.mirostat_mu = 2.0 * self.params.mirostat_tau;
        if let Some(g) = self.grammar.as_mut() {
            g.reset();
        }
    }

    /// Whether the next token is the first largest logit of the raw row and nothing else is
    /// read from it (greedy, no grammar, bias, penalties, DRY or log-probabilities): a device
    /// backend may then pick it where the logits are and bring back only the id (see
    /// [`argmax`]; accept the id with [`Sampler::accept`]).
    pub fn argmax_decides(&self) -> bool {
        self.params.temp <= 0.0 && self.reads_the_raw_row_only()
    }

    /// Whether the next token depends on the raw row's values alone, as the chain's later
    /// stages read them: no grammar, logit bias, penalties, DRY or log-probabilities.
    fn reads_the_raw_row_only(&self) -> bool {
        let p = &self.params;
        self.grammar.is_none()
            && p.logit_bias.is_empty()
            && !p.penalties_active()
            && !p.dry_active()
            && p.logprobs.is_none()
    }

    /// How many of the raw row's best candidates decide the next token, when nothing else
    /// of the row is read: a sampled step without grammar, bias, penalties, DRY or
    /// log-probabilities, whose chain top-k starts (top-n-sigma and Mirostat off). A device
    /// backend may then bring back only that many candidates, in [`by_logit`]'s order
    /// (ties: the lower id first), for [`Sampler::sample_candidates`].
    pub fn candidates_decide(&self) -> Option<usize> {
        (self.params.temp > 0.0 && self.reads_the_raw_row_only() && self.top_k_decides())
            .then(|| self.top_k_len())
    }

    /// Samples a token from the best candidates of a row, in [`by_logit`]'s order and at
    /// least [`Sampler::candidates_decide`] of them (all of the row where it is shorter),
    /// and accepts it: the token [`Sampler::sample`] draws from the whole row.
    pub fn sample_candidates(&mut self, best: &[(TokenId, f32)]) -> TokenId {
        let mut cand = std::mem::take(&mut self.candidates);
        cand.clear();
        cand.extend_from_slice(&best[..self.top_k_len().min(best.len())]);
        let token = self.draw_sampled(&mut cand);
        self.candidates = cand;
        self.accept(token);
        token
    }

    /// Records a token in the history and advances the grammar past it.
    pub fn accept(&mut self, token: TokenId) {
        if self.history_cap > 0 {
            if self.history.len() == self.history_cap {
                self.history.pop_front();
            }
            self.history.push_back(token);
        }
        if let Some(g) = self.grammar.as_mut() {
            g.accept(token);
        }
    }

    /// Samples a token from one row of logits and accepts it.
    pub fn sample(&mut self, logits: &[f32]) -> TokenId {
        let t = self.pick(logits);
        self.accept(t);
        t
    }

    /// Like `sample`, also returning log-probabilities when the sampler reports them.
    pub fn sample_with_logprobs(&mut self, logits: &[f32]) -> (TokenId, Option<TokenLogprobs>) {
        let t = self.sample(logits);
        let lp = self.params.logprobs.map(|n| token_logprobs(logits, t, n));
        (t, lp)
    }

    fn pick(&mut self, logits: &[f32]) -> TokenId {
        if self.grammar.is_none() {
            return self.pick_row(logits, logits);
        }
        self.grammar_stats.steps += 1;
        // Greedy: pick without the grammar and keep the token when the grammar allows it (a
        // cheap check; llama.cpp's shortcut). The argmax of the allowed tokens is then the
        // same token, so this is exact; sampled requests always use the full mask, which
        // keeps their distribution exactly the masked one.
        if self.params.temp <= 0.0 {
            let token = self.pick_row(logits, logits);
            let t0 = std::time::Instant::now();
            let allowed = self.grammar.as_mut().is_some_and(|g| g.allows(token));
            self.grammar_stats.check_ns += t0.elapsed().as_nanos() as u64;
            if allowed {
                return token;
            }
        } else if self.lazy_grammar && self.top_k_decides() {
            if let Some(token) = self.pick_top_k_allowed(logits) {
                return token;
            }
        }
        let mut row = std::mem::take(&mut self.scratch);
        row.clear();
        row.extend_from_slice(logits);
        let t1 = std::time::Instant::now();
        if let Some(g) = self.grammar.as_mut() {
            g.mask(&mut row);
        }
        let ns = t1.elapsed().as_nanos() as u64;
        let st = &mut self.grammar_stats;
        st.masks += 1;
        st.total_ns += ns;
        st.max_ns = st.max_ns.max(ns);
        let token = self.pick_row(&row, logits);
        self.scratch = row;
        token
    }

    /// Whether a sampled step's outcome depends only on the `top_k` best allowed candidates:
    /// every stage between the grammar and top-k (bias, penalties, DRY) changes one token's
    /// logit independently of the others, and top-n-sigma and Mirostat, which look at the
    /// whole row, are off.
    fn top_k_decides(&self) -> bool {
        let p = &self.params;
        p.top_k > 0 && p.mirostat == 0 && p.top_n_sigma <= 0.0
    }

    /// A sampled step without a full mask: the best candidates, in logit order, are checked
    /// one by one against the grammar until `top_k` allowed ones are found; the rest of the
    /// chain then runs on exactly the candidates the masked row's top-k would have kept, so
    /// the distribution is the masked one. `None` when the window holds too few allowed
    /// tokens (the caller computes the full mask).
    fn pick_top_k_allowed(&mut self, logits: &[f32]) -> Option<TokenId> {
        let k = self.top_k_len();
        let window = (4 * k).max(LAZY_GRAMMAR_WINDOW).min(logits.len());
        if window == 0 {
            return None;
        }
        let mut prepared = std::mem::take(&mut self.prepared);
        let row = self.prepared_row(&mut prepared, logits);
        let mut cand = std::mem::take(&mut self.candidates);
        // a NaN logit: the full mask's chain decides where it goes
        let found = best_by_logit(row, window, false, &mut self.block_max, &mut cand);
        self.prepared = prepared;
        if !found {
            self.candidates = cand;
            return None;
        }
        let t0 = std::time::Instant::now();
        let Some(grammar) = self.grammar.as_mut() else {
            self.candidates = cand;
            return None;
        };
        let (mut kept, mut rejected, mut complete) = (0, 0, true);
        for i in 0..window {
            let c = cand[i];
            if c.1 == f32::NEG_INFINITY {
                break;
            }
            if grammar.allows(c.0) {
                cand[kept] = c;
                kept += 1;
                if kept == k {
                    break;
                }
            } else {
                rejected += 1;
                if rejected == LAZY_GRAMMAR_MAX_REJECTS {
                    complete = false;
                    break;
                }
            }
        }
        self.grammar_stats.check_ns += t0.elapsed().as_nanos() as u64;
        // Fewer than k allowed decides nothing, unless every candidate was checked.
        let whole_row = complete && window == logits.len();
        if kept == 0 || (kept < k && !whole_row) {
            self.candidates = cand;
            return None;
        }
        cand.truncate(kept);
        let token = self.draw_sampled(&mut cand);
        self.candidates = cand;
        Some(token)
    }

    /// How many candidates top-k keeps.
    fn top_k_len(&self) -> usize {
        (self.params.top_k.max(0) as usize).max(self.params.min_keep.max(1))
    }

    /// The row with logit bias, repetition penalties and DRY applied: `logits` itself when
    /// none of them changes it, else a copy in `prepared`.
    fn prepared_row<'a>(&self, prepared: &'a mut Vec<f32>, logits: &'a [f32]) -> &'a [f32] {
        let p = &self.params;
        let penalties = p.penalties_active() && !self.history.is_empty();
        if p.logit_bias.is_empty() && !penalties && !p.dry_active() {
            return logits;
        }
        prepared.clear();
        prepared.extend_from_slice(logits);
        for &(t, b) in &p.logit_bias {
            if let Some(l) = prepared.get_mut(t as usize) {
                *l += b;
            }
        }
        if penalties {
            self.apply_penalties(prepared);
        }
        if p.dry_active() {
            self.apply_dry(prepared);
        }
        prepared
    }

    /// Truncation, temperature and the seeded draw.
    fn draw_sampled(&mut self, cand: &mut Vec<(TokenId, f32)>) -> TokenId {
        self.truncate(cand);
        let temp = self.dynamic_temperature(cand);
        let probs = softmax(cand, temp);
        self.draw(cand, &probs)
    }

    /// The sampler chain on one row (`raw` is the unmasked row, the fallback when every
    /// candidate was banned).
    fn pick_row(&mut self, logits: &[f32], raw: &[f32]) -> TokenId {
        if self.params.temp <= 0.0 && !self.params.penalties_active() && !self.params.dry_active() {
            return self.greedy_row(logits, raw);
        }
        let (temp, mirostat) = (self.params.temp, self.params.mirostat);
        let mut prepared = std::mem::take(&mut self.prepared);
        let row = self.prepared_row(&mut prepared, logits);
        let mut cand = std::mem::take(&mut self.candidates);
        let drop_banned = self.grammar.is_some() || !self.params.logit_bias.is_empty();
        // Sampled with top-k deciding: only its candidates, found in one pass over the row
        // (exactly the chain's: its order has no ties); the whole row's list otherwise.
        if temp > 0.0
            && self.top_k_scan
            && self.top_k_decides()
            && best_by_logit(
                row,
                self.top_k_len(),
                drop_banned,
                &mut self.block_max,
                &mut cand,
            )
            && !cand.is_empty()
        {
            self.prepared = prepared;
            let token = self.draw_sampled(&mut cand);
            self.candidates = cand;
            return token;
        }
        cand.clear();
        cand.extend(row.iter().enumerate().map(|(i, &l)| (i as TokenId, l)));
        self.prepared = prepared;
        if drop_banned {
            cand.retain(|c| c.1 > f32::NEG_INFINITY);
            if cand.is_empty() {
                if let Some(end) = self.end_token {
                    self.candidates = cand;
                    return end;
                }
                // no end token to fall back to (bare engine use): the unmasked row
                cand.extend(raw.iter().enumerate().map(|(i, &l)| (i as TokenId, l)));
            }
        }
        let token = if temp <= 0.0 {
            greedy(&cand)
        } else if mirostat == 1 {
            self.mirostat_v1(&mut cand)
        } else if mirostat == 2 {
            self.mirostat_v2(&mut cand)
        } else {
            self.draw_sampled(&mut cand)
        };
        self.candidates = cand;
        token
    }

    /// [`Self::pick_row`] at temperature 0 without penalties or DRY: the same token (bias,
    /// the banned entries dropped when a grammar or bias is set, the first largest, the same
    /// fallbacks) from the row itself, one vectorised pass and a lookup per biased token,
    /// instead of a candidate list the size of the vocabulary (~0.3-0.5 ms a token on
    /// Gemma 3's 262k entries, serial between two forward passes).
    fn greedy_row(&mut self, logits: &[f32], raw: &[f32]) -> TokenId {
        let bias = &self.params.logit_bias;
        if self.grammar.is_none() && bias.is_empty() {
            return argmax(logits) as TokenId;
        }
        // each biased token's logit, its entries added in the list's order (as `prepare`),
        // between the runs of unbiased ones
        let biased = &mut self.biased;
        biased.clear();
        biased.extend(
            bias.iter()
                .filter(|b| (b.0 as usize) < logits.len())
                .copied(),
        );
        biased.sort_by_key(|b| b.0);
        let mut best = None;
        let mut from = 0;
        let mut i = 0;
        while i < biased.len() {
            let t = biased[i].0 as usize;
            let mut v = logits[t];
            while i < biased.len() && biased[i].0 as usize == t {
                v += biased[i].1;
                i += 1;
            }
            best = later_if_larger(best, first_max_above_neg_inf(logits, from..t));
            best = later_if_larger(best, Some((t, v)));
            from = t + 1;
        }
        let best = later_if_larger(best, first_max_above_neg_inf(logits, from..logits.len()));
        match (best, self.end_token) {
            (Some((t, _)), _) => t as TokenId,
            (None, Some(end)) => end,
            (None, None) => argmax(raw) as TokenId,
        }
    }

    /// top-n-sigma → top-k → typical → top-p → min-p → XTC; leaves `cand` sorted by logit.
    fn truncate(&mut self, cand: &mut Vec<(TokenId, f32)>) {
        let p = &self.params;
        let min_keep = p.min_keep.max(1);
        if p.top_n_sigma > 0.0 && cand.len() > 1 {
            let n = cand.len() as f64;
            let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
            let mean = cand.iter().map(|c| c.1 as f64).sum::<f64>() / n;
            let var = cand
                .iter()
                .map(|c| (c.1 as f64 - mean).powi(2))
                .sum::<f64>()
                / n;
            let threshold = max as f64 - p.top_n_sigma as f64 * var.sqrt();
            // Infinite logits (a huge penalty or bias) make the spread NaN, and a NaN
            // threshold would drop every candidate: the stage then keeps them all.
            if !threshold.is_nan() {
                cand.retain(|c| c.1 as f64 >= threshold);
            }
        }
        if p.top_k > 0 {
            let k = self.top_k_len();
            if k < cand.len() {
                cand.select_nth_unstable_by(k - 1, by_logit);
                cand.truncate(k);
            }
        }
        cand.sort_unstable_by(by_logit);
        if p.typical_p < 1.0 && cand.len() > 1 {
            let probs = softmax(cand, 1.0);
            let entropy = entropy(&probs);
            let mut order: Vec<(usize, f64)> = probs
                .iter()
                .enumerate()
                .map(|(i, pr)| (i, (-pr.ln() - entropy).abs()))
                .collect();
            order.sort_by(|a, b| a.1.total_cmp(&b.1));
            let mut cum = 0.0;
            let mut last = order.len();
            for (i, (idx, _)) in order.iter().enumerate() {
                cum += probs[*idx];
                if cum > p.typical_p as f64 && i + 1 >= min_keep {
                    last = i + 1;
                    break;
                }
            }
            let kept: Vec<(TokenId, f32)> = order[..last].iter().map(|(i, _)| cand[*i]).collect();
            *cand = kept;
            cand.sort_unstable_by(by_logit);
        }
        if p.top_p < 1.0 {
            let probs = softmax(cand, 1.0);
            let mut cum = 0.0;
            let mut keep = cand.len();
            for (i, pr) in probs.iter().enumerate() {
                cum += pr;
                if cum >= p.top_p as f64 && i + 1 >= min_keep {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if p.min_p > 0.0 && !cand.is_empty() {
            let threshold = cand[0].1 + p.min_p.ln();
            let keep = cand.iter().take_while(|c| c.1 >= threshold).count();
            cand.truncate(keep.max(min_keep));
        }
        if p.xtc_probability > 0.0 && p.xtc_threshold <= 0.5 && cand.len() >= 2 {
            let r = self.rng.next_f64();
            if r <= self.params.xtc_probability as f64 {
                let probs = softmax(cand, 1.0);
                let above = probs
                    .iter()
                    .take_while(|&&pr| pr >= self.params.xtc_threshold as f64)
                    .count();
                // Remove every token above the threshold except the least likely of them.
                let pos_last = above.saturating_sub(1);
                if pos_last > 0 && cand.len() - pos_last >= min_keep {
                    cand.drain(..pos_last);
                }
            }
        }
    }

    fn dynamic_temperature(&self, cand: &[(TokenId, f32)]) -> f32 {
        let p = &self.params;
        if p.dynatemp_range <= 0.0 || cand.len() <= 1 {
            return p.temp;
        }
        let min_t = (p.temp - p.dynatemp_range).max(0.0);
        let max_t = p.temp + p.dynatemp_range;
        let probs = softmax(cand, 1.0);
        let entropy = entropy(&probs);
        let max_entropy = (cand.len() as f64).ln();
        let normalized = (entropy / max_entropy).clamp(0.0, 1.0);
        let t = min_t as f64 + (max_t - min_t) as f64 * normalized.powf(p.dynatemp_exponent as f64);
        (t as f32).max(f32::MIN_POSITIVE)
    }

    fn draw(&mut self, cand: &[(TokenId, f32)], probs: &[f64]) -> TokenId {
        let r = self.rng.next_f64();
        let mut cum = 0.0;
        for (c, pr) in cand.iter().zip(probs) {
            cum += pr;
            if r < cum {
                return c.0;
            }
        }
        cand[cand.len() - 1].0
    }

    fn draw_index(&mut self, probs: &[f64]) -> usize {
        let r = self.rng.next_f64();
        let mut cum = 0.0;
        for (i, pr) in probs.iter().enumerate() {
            cum += pr;
            if r < cum {
                return i;
            }
        }
        probs.len() - 1
    }

    /// Draws from the truncated candidates and moves mu toward the target surprise.
    fn mirostat_draw(&mut self, cand: &[(TokenId, f32)], temp: f32) -> TokenId {
        let probs = softmax(cand, temp);
        let i = self.draw_index(&probs);
        self.mirostat_update(probs[i]);
        cand[i].0
    }

    fn mirostat_update(&mut self, prob: f64) {
        let surprise = -(prob.max(f64::MIN_POSITIVE)).log2() as f32;
        self.mirostat_mu -= self.params.mirostat_eta * (surprise - self.params.mirostat_tau);
    }

    fn mirostat_v1(&mut self, cand: &mut Vec<(TokenId, f32)>) -> TokenId {
        let temp = self.params.temp;
        cand.sort_unstable_by(by_logit);
        let probs = softmax(cand, temp);
        let m = MIROSTAT_M.min(probs.len());
        let (mut sum_tb, mut sum_t2) = (0.0f64, 0.0f64);
        for i in 0..m.saturating_sub(1) {
            if probs[i + 1] <= 0.0 {
                break;
            }
            let t = ((i as f64 + 2.0) / (i as f64 + 1.0)).ln();
            let b = (probs[i] / probs[i + 1]).ln();
            sum_tb += t * b;
            sum_t2 += t * t;
        }
        let s_hat = if sum_t2 > 0.0 { sum_tb / sum_t2 } else { 1.0 };
        let eps = s_hat - 1.0;
        let n = cand.len() as f64;
        let mu = self.mirostat_mu as f64;
        let k = if eps.abs() < 1e-9 {
            n
        } else {
            ((eps * 2f64.powf(mu)) / (1.0 - n.powf(-eps))).powf(1.0 / s_hat)
        };
        let k = if k.is_finite() {
            (k as usize).clamp(1, cand.len())
        } else {
            cand.len()
        };
        cand.truncate(k);
        self.mirostat_draw(cand, temp)
    }

    fn mirostat_v2(&mut self, cand: &mut Vec<(TokenId, f32)>) -> TokenId {
        let temp = self.params.temp;
        cand.sort_unstable_by(by_logit);
        let probs = softmax(cand, temp);
        let mu = self.mirostat_mu as f64;
        let keep = probs
            .iter()
            .take_while(|&&pr| -(pr.max(f64::MIN_POSITIVE)).log2() <= mu)
            .count();
        cand.truncate(keep.max(1));
        self.mirostat_draw(cand, temp)
    }

    fn recent(&self, last_n: i32) -> impl Iterator<Item = &TokenId> {
        let n = if last_n < 0 {
            self.history.len()
        } else {
            (last_n as usize).min(self.history.len())
        };
        self.history.iter().skip(self.history.len() - n)
    }

    fn apply_penalties(&self, row: &mut [f32]) {
        let p = &self.params;
        let mut counts: HashMap<TokenId, u32> = HashMap::new();
        for &t in self.recent(p.penalty_last_n) {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            let Some(l) = row.get_mut(t as usize) else {
                continue;
            };
            if *l <= 0.0 {
                *l *= p.penalty_repeat;
            } else {
                *l /= p.penalty_repeat;
            }
            *l -= c as f32 * p.penalty_freq + p.penalty_present;
        }
    }

    /// DRY ("don't repeat yourself"): penalises the token that would extend a repetition of
    /// the recent history, growing exponentially with the repeated length.
    fn apply_dry(&self, row: &mut [f32]) {
        let p = &self.params;
        let last: Vec<TokenId> = self.recent(p.dry_penalty_last_n).copied().collect();
        let n = last.len();
        if n < 2 {
            return;
        }
        let allowed = p.dry_allowed_length.max(0) as usize;
        let rep_limit = last
            .iter()
            .rev()
            .take_while(|t| !self.dry_breakers.contains(t))
            .count();
        if rep_limit < allowed {
            return;
        }
        let mut max_len: HashMap<TokenId, usize> = HashMap::new();
        for i in 0..n - 1 {
            let mut k = 0;
            while k < rep_limit && k <= i && last[i - k] == last[n - 1 - k] {
                k += 1;
            }
            if k >= allowed && k > 0 {
                let next = last[i + 1];
                let e = max_len.entry(next).or_default();
                *e = (*e).max(k);
            }
        }
        let max_exponent = if p.dry_base > 1.0 {
            (f32::MAX.ln() / p.dry_base.ln()) as i32
        } else {
            0
        };
        for (t, len) in max_len {
            let exponent = ((len - allowed) as i32).min(max_exponent);
            let penalty = p.dry_multiplier * p.dry_base.powi(exponent);
            if let Some(l) = row.get_mut(t as usize) {
                *l -= penalty;
            }
        }
    }
}

/// The greedy choice among candidates.
fn greedy(cand: &[(TokenId, f32)]) -> TokenId {
    cand[first_largest(cand.iter().map(|c| c.1))].0
}

/// The index of the largest value, the first of equal ones (0 when empty or all NaN, and
/// when the first is NaN): the engine's one greedy rule (the sampler at temperature 0,
/// draft models' drafts).
pub fn first_largest(values: impl IntoIterator<Item = f32>) -> usize {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, v) in values.into_iter().enumerate() {
        if v > best.1 || i == 0 {
            best = (i, v);
        }
    }
    best.0
}

/// [`first_largest`] of a row, in two vectorised passes (its largest value, then the first
/// place of it): ~5x faster on a vocabulary-sized row.
pub fn argmax(values: &[f32]) -> usize {
    match values.first() {
        None => 0,
        Some(v) if v.is_nan() => 0,
        // the first value is a number, so the largest is found
        Some(_) => first_place_of(values, largest(values)).unwrap_or(0),
    }
}

/// The first place in `values[range]` of its largest value above `-inf` (NaN never
/// counts), as a place in `values`, and that value.
fn first_max_above_neg_inf(values: &[f32], range: std::ops::Range<usize>) -> Option<(usize, f32)> {
    let (from, values) = (range.start, &values[range]);
    let max = largest(values);
    if max > f32::NEG_INFINITY {
        first_place_of(values, max).map(|i| (from + i, max))
    } else {
        None
    }
}

/// Of two (place, value) picks in row order, the later only when its value is larger.
fn later_if_larger(a: Option<(usize, f32)>, b: Option<(usize, f32)>) -> Option<(usize, f32)> {
    match (a, b) {
        (Some(x), Some(y)) if y.1 > x.1 => Some(y),
        (Some(x), _) => Some(x),
        (None, y) => y.filter(|y| y.1 > f32::NEG_INFINITY),
    }
}

/// The candidates' one order: the larger logit first (as `f32::total_cmp` orders them),
/// then the lower token id, so that every selection and sort of them has one result.
pub fn by_logit(a: &(TokenId, f32), b: &(TokenId, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The first `n` candidates of `row` in [`by_logit`]'s order (all of them when fewer;
/// those at `-inf` left out when `above_neg_inf`), into `out` in that order; `false` when
/// the row holds a NaN. Instead of a candidate list the size of the vocabulary: one
/// vectorised pass for each block's largest value, then only the blocks whose largest
/// reaches the `n`-th largest of those (the `n` blocks above it hold `n` values at least
/// that large, so no value below it is among the first `n`). `maxima` is scratch.
fn best_by_logit(
    row: &[f32],
    n: usize,
    above_neg_inf: bool,
    maxima: &mut Vec<f32>,
    out: &mut Vec<(TokenId, f32)>,
) -> bool {
    const BLOCK: usize = 8 * SCAN_LANES;
    out.clear();
    maxima.clear();
    for block in row.chunks(BLOCK) {
        // `largest` passes NaN over; the order would put it first or last
        if block.iter().fold(false, |any, v| any | v.is_nan()) {
            return false;
        }
        maxima.push(largest(block));
    }
    if n == 0 {
        return true;
    }
    // A float comparison with it (-0 equals +0) keeps every value the order puts at or
    // above it.
    let least = if maxima.len() > n {
        let blocks = maxima.len();
        maxima.extend_from_within(..);
        let (_, nth, _) = maxima[blocks..].select_nth_unstable_by(n - 1, |a, b| b.total_cmp(a));
        let nth = *nth;
        maxima.truncate(blocks);
        nth
    } else {
        f32::NEG_INFINITY
    };
    for (b, (block, &max)) in row.chunks(BLOCK).zip(maxima.iter()).enumerate() {
        if max >= least {
            let base = b * BLOCK;
            out.extend(
                block
                    .iter()
                    .enumerate()
                    .filter(|&(_, &v)| v >= least && (v > f32::NEG_INFINITY || !above_neg_inf))
                    .map(|(i, &v)| ((base + i) as TokenId, v)),
            );
        }
    }
    if out.len() > n {
        out.select_nth_unstable_by(n - 1, by_logit);
        out.truncate(n);
    }
    out.sort_unstable_by(by_logit);
    true
}

/// Lanes of the vectorised row scans.
const SCAN_LANES: usize = 16;

/// The largest value (`-inf` when empty or all NaN), lane by lane so that it vectorises.
fn largest(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; SCAN_LANES];
    let chunks = values.chunks_exact(SCAN_LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    lanes
        .iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// The first place of a value equal to `x`.
fn first_place_of(values: &[f32], x: f32) -> Option<usize> {
    let mut base = 0;
    for c in values.chunks(SCAN_LANES) {
        if c.iter().fold(false, |any, &v| any | (v == x)) {
            return c.iter().position(|&v| v == x).map(|i| base + i);
        }
        base += c.len();
    }
    None
}

/// Softmax of candidate logits divided by `temp`, in f64 for a stable cumulative sum.
/// Shannon entropy (nats) of a probability vector.
fn entropy(probs: &[f64]) -> f64 {
    -probs
        .iter()
        .filter(|&&x| x > 0.0)
        .map(|x| x * x.ln())
        .sum::<f64>()
}

fn softmax(cand: &[(TokenId, f32)], temp: f32) -> Vec<f64> {
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max) as f64;
    let t = temp as f64;
    let mut out: Vec<f64> = cand
        .iter()
        .map(|c| ((c.1 as f64 - max) / t).exp())
        .collect();
    let sum: f64 = out.iter().sum();
    for v in &mut out {
        *v /= sum;
    }
    out
}

/// Log-softmax of a logits row, for log-probability reporting.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    logits.iter().map(|&l| (l as f64 - lse) as f32).collect()
}

/// Logits that orders and selections must place as `f32::total_cmp` does: both zeros, both
/// infinities, NaNs of both signs.
#[cfg(test)]
pub(crate) const EDGE_LOGITS: [f32; 6] = [
    0.0,
    -0.0,
    f32::NEG_INFINITY,
    f32::INFINITY,
    f32::NAN,
    -f32::NAN,
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The greedy shortcut picks what the candidate chain picks: ties, NaN, `-inf`, banned
    /// and boosted tokens (repeated, out of range), everything banned, with and without an
    /// end token. The chain runs with a repetition penalty and no history yet, which
    /// changes no logit but takes the long way.
    #[test]
    fn greedy_row_picks_what_the_candidate_chain_picks() {
        let mut rng = Rng::new(7);
        let pick = |rng: &mut Rng, xs: &[f32]| xs[rng.next_u64() as usize % xs.len()];
        let values = [
            0.0,
            -0.0,
            1.0,
            2.5,
            -3.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NAN,
        ];
        let biases = [f32::NEG_INFINITY, 0.5, -0.5, 1.0, f32::INFINITY, f32::NAN];
        for case in 0..3000usize {
            let n = 1 + rng.next_u64() as usize % 70;
            let row: Vec<f32> = (0..n)
                .map(|_| {
                    if rng.next_u64().is_multiple_of(4) {
                        pick(&mut rng, &values)
                    } else {
                        (rng.next_u64() % 9) as f32 / 4.0
                    }
                })
                .collect();
            let n_bias = rng.next_u64() as usize % 6;
            let bias: Vec<(TokenId, f32)> = (0..n_bias)
                .map(|_| {
                    let t = (rng.next_u64() as usize % (n + 2)) as TokenId;
                    (t, pick(&mut rng, &biases))
                })
                .collect();
            let ban_all = case.is_multiple_of(50);
            let bias = if ban_all {
                (0..n as TokenId).map(|t| (t, f32::NEG_INFINITY)).collect()
            } else {
                bias
            };
            for end in [None, Some(3)] {
                let params = |penalty: f32| SamplerParams {
                    temp: 0.0,
                    penalty_repeat: penalty,
                    logit_bias: bias.clone(),
                    ..Default::default()
                };
                let (mut fast, mut chain) = (Sampler::new(params(1.0)), Sampler::new(params(1.5)));
                if let Some(e) = end {
                    fast = fast.with_end_token(e);
                    chain = chain.with_end_token(e);
                }
                assert_eq!(
                    fast.pick(&row),
                    chain.pick(&row),
                    "row {row:?} bias {bias:?} end {end:?}"
                );
            }
            assert_eq!(argmax(&row), first_largest(row.iter().copied()), "{row:?}");
        }
        assert_eq!(argmax(&[]), 0);
    }

    /// `best_by_logit` keeps what sorting the whole row by `by_logit` keeps, in that order:
    /// ties, ±0, ±inf, rows of fewer blocks than `n` and of many more; a NaN anywhere is
    /// refused.
    #[test]
    fn best_by_logit_is_the_sorted_rows_head() {
        let mut rng = Rng::new(11);
        let special = [0.0, -0.0, f32::NEG_INFINITY, f32::INFINITY, 1.0, -1.0];
        let (mut maxima, mut out) = (Vec::new(), Vec::new());
        for case in 0..400usize {
            let len = 1 + rng.next_u64() as usize % 5000;
            let levels = 1 + rng.next_u64() % 400;
            let row: Vec<f32> = (0..len)
                .map(|_| {
                    if rng.next_u64().is_multiple_of(8) {
                        special[rng.next_u64() as usize % special.len()]
                    } else {
                        (rng.next_u64() % levels) as f32 / 8.0 - 20.0
                    }
                })
                .collect();
            let n = 1 + rng.next_u64() as usize % if case % 4 < 2 { 8 } else { 300 };
            let above_neg_inf = case % 2 == 0;
            let mut all: Vec<(TokenId, f32)> = row
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as TokenId, l))
                .filter(|c| !above_neg_inf || c.1 > f32::NEG_INFINITY)
                .collect();
            all.sort_by(by_logit);
            all.truncate(n);
            assert!(best_by_logit(&row, n, above_neg_inf, &mut maxima, &mut out));
            let same = out.len() == all.len()
                && out
                    .iter()
                    .zip(&all)
                    .all(|(a, b)| a.0 == b.0 && a.1.to_bits() == b.1.to_bits());
            assert!(same, "case {case}: n {n} len {len}");
            let mut with_nan = row.clone();
            with_nan[rng.next_u64() as usize % len] =
                if case % 3 == 0 { -f32::NAN } else { f32::NAN };
            assert!(!best_by_logit(
                &with_nan,
                n,
                above_neg_inf,
                &mut maxima,
                &mut out
            ));
        }
    }

    /// A sampled step that top-k decides draws the same tokens from the one-pass candidates
    /// as from the whole row's list: bias (bans included), penalties over a history, DRY,
    /// min_keep, the truncation stages after top-k, ties.
    #[test]
    fn top_k_scan_draws_what_the_whole_list_draws() {
        let mut rng = Rng::new(5);
        for case in 0..300u64 {
            let len = 2 + rng.next_u64() as usize % 900;
            let rows: Vec<Vec<f32>> = (0..8)
                .map(|_| {
                    (0..len)
                        .map(|_| (rng.next_u64() % 64) as f32 / 4.0)
                        .collect()
                })
                .collect();
            let mut bias: Vec<(TokenId, f32)> = (0..rng.next_u64() % 4)
                .map(|_| ((rng.next_u64() as usize % len) as TokenId, 2.0))
                .collect();
            if case % 3 == 0 {
                bias.push((
                    (rng.next_u64() as usize % len) as TokenId,
                    f32::NEG_INFINITY,
                ));
            }
            let params = SamplerParams {
                seed: case,
                top_k: 1 + (rng.next_u64() % 80) as i32,
                min_keep: (rng.next_u64() % 3) as usize,
                top_p: if case % 2 == 0 { 0.9 } else { 1.0 },
                min_p: if case % 4 == 0 { 0.0 } else { 0.05 },
                typical_p: if case % 5 == 0 { 0.8 } else { 1.0 },
                penalty_repeat: if case % 3 == 1 { 1.3 } else { 1.0 },
                dry_multiplier: if case % 7 == 0 { 0.8 } else { 0.0 },
                logit_bias: bias,
                ..Default::default()
            };
            let mut fast = Sampler::new(params.clone());
            let mut slow = Sampler::new(params);
            slow.top_k_scan = false;
            for row in rows.iter().cycle().take(40) {
                assert_eq!(fast.sample(row), slow.sample(row), "case {case}");
            }
        }
    }

    /// A step that its best candidates decide draws from them what it draws from the whole
    /// row: ties, both zeros, infinities and NaN in the row, top-k above and below the
    /// candidates' count, the truncation stages after top-k, rows shorter than the window.
    #[test]
    fn candidates_draw_what_the_whole_row_draws() {
        const WINDOW: usize = 64;
        let special = EDGE_LOGITS;
        let mut rng = Rng::new(17);
        let mut decided = 0;
        for case in 0..300u64 {
            let len = 1 + rng.next_u64() as usize % 700;
            let rows: Vec<Vec<f32>> = (0..4)
                .map(|r| {
                    (0..len)
                        .map(|_| match rng.next_u64() % 64 {
                            0 if r > 0 => special[rng.next_u64() as usize % special.len()],
                            v => v as f32 / 4.0,
                        })
                        .collect()
                })
                .collect();
            let params = SamplerParams {
                seed: case,
                top_k: if case % 9 == 0 {
                    0
                } else {
                    1 + (rng.next_u64() % 80) as i32
                },
                min_keep: (rng.next_u64() % 3) as usize,
                top_p: if case % 2 == 0 { 0.9 } else { 1.0 },
                typical_p: if case % 5 == 0 { 0.8 } else { 1.0 },
                dynatemp_range: if case % 7 == 0 { 0.5 } else { 0.0 },
                ..Default::default()
            };
            let mut whole = Sampler::new(params.clone());
            let mut best = Sampler::new(params);
            for row in rows.iter().cycle().take(12) {
                let want = whole.sample(row);
                match best.candidates_decide().filter(|&k| k <= WINDOW) {
                    Some(_) => {
                        let mut cand: Vec<(TokenId, f32)> = row
                            .iter()
                            .enumerate()
                            .map(|(i, &l)| (i as TokenId, l))
                            .collect();
                        cand.sort_by(by_logit);
                        cand.truncate(WINDOW);
                        assert_eq!(best.sample_candidates(&cand), want, "case {case}");
                        decided += 1;
                    }
                    None => assert_eq!(best.sample(row), want, "case {case}"),
                }
            }
        }
        assert!(decided > 1000, "{decided}");
        let mut s = Sampler::new(SamplerParams::default());
        assert_eq!(s.candidates_decide(), Some(40));
        for p in [
            SamplerParams::greedy(),
            SamplerParams {
                logprobs: Some(1),
                ..Default::default()
            },
            SamplerParams {
                penalty_repeat: 1.1,
                ..Default::default()
            },
            SamplerParams {
                mirostat: 2,
                ..Default::default()
            },
            SamplerParams {
                top_k: 0,
                ..Default::default()
            },
        ] {
            assert_eq!(Sampler::new(p).candidates_decide(), None);
        }
        s.params.logit_bias = vec![(0, 1.0)];
        assert_eq!(s.candidates_decide(), None);
    }

    #[test]
    fn greedy_picks_the_maximum() {
        let mut s = Sampler::new(SamplerParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 / 10.0).collect();
        let params = SamplerParams {
            seed: 42,
            temp: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        };
        let run = || {
            let mut s = Sampler::new(params.clone());
            (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
        let distinct: std::collections::HashSet<_> = run().into_iter().collect();
        assert!(
            distinct.len() > 5,
            "temperature 1 over a flat-ish distribution varies"
        );
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(SamplerParams {
            top_k: 1,
            temp: 5.0,
            ..Default::default()
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.0, 1.0, 0.5]), 1);
        }
    }

    #[test]
    fn min_p_cuts_unlikely_tokens() {
        // token 0 dominates; min_p 0.5 keeps only it.
        let mut s = Sampler::new(SamplerParams {
            top_k: 0,
            top_p: 1.0,
            min_p: 0.5,
            temp: 1.0,
            seed: 7,
            ..Default::default()
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&[5.0, 1.0, 1.0, 1.0]), 0);
        }
    }

    #[test]
    fn repeat_penalty_discourages_recent_tokens() {
        let mut s = Sampler::new(SamplerParams {
            penalty_repeat: 2.0,
            temp: 0.0,
            ..Default::default()
        });
        s.accept(0);
        // 3.0 / 2 = 1.5 < 2.0
        assert_eq!(s.sample(&[3.0, 2.0]), 1);
        let mut s = Sampler::new(SamplerParams {
            penalty_present: 5.0,
            temp: 0.0,
            ..Default::default()
        });
        s.accept(1);
        assert_eq!(s.sample(&[1.0, 4.0]), 0);
    }

    #[test]
    fn token_logprobs_match_log_softmax() {
        let logits = [1.0, 3.0, 2.0, -1.0];
        let lp = token_logprobs(&logits, 2, 2);
        let full = log_softmax(&logits);
        assert!((lp.logprob - full[2]).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((lp.top[0].1 - full[1]).abs() < 1e-6);
        assert!(token_logprobs(&logits, 0, 0).top.is_empty());
    }

    #[test]
    fn log_softmax_normalises() {
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        let total: f32 = lp.iter().map(|v| v.exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    fn sampled(params: SamplerParams, logits: &[f32], n: usize) -> HashSet<TokenId> {
        let mut s = Sampler::new(params);
        (0..n).map(|_| s.sample(logits)).collect()
    }

    fn open(seed: u64) -> SamplerParams {
        SamplerParams {
            seed,
            temp: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        }
    }

    #[test]
    fn a_row_with_every_token_banned_ends_generation() {
        let mut p = SamplerParams::greedy();
        p.logit_bias = vec![(0, f32::NEG_INFINITY), (1, f32::NEG_INFINITY)];
        let mut s = Sampler::new(p.clone()).with_end_token(7);
        assert_eq!(s.sample(&[1.0, 2.0]), 7);
        let mut s = Sampler::new(SamplerParams { temp: 0.9, ..p }).with_end_token(7);
        assert_eq!(s.sample(&[1.0, 2.0]), 7);
    }

    #[test]
    fn logit_bias_bans_and_boosts() {
        let mut p = SamplerParams::greedy();
        p.logit_bias = vec![(1, f32::NEG_INFINITY), (3, 0.5)];
        let mut s = Sampler::new(p);
        // 1 is the argmax but banned; 3 gets +0.5 and overtakes 0.
        assert_eq!(s.sample(&[2.0, 5.0, 0.0, 1.8]), 3);
    }

    #[test]
    fn penalty_last_n_limits_the_window() {
        let mut p = SamplerParams::greedy();
        p.penalty_present = 10.0;
        p.penalty_last_n = 1;
        let mut s = Sampler::new(p);
        s.accept(0);
        s.accept(2);
        // Only token 2 is inside the window, so token 0 keeps its lead.
        assert_eq!(s.sample(&[3.0, 1.0, 2.9]), 0);
    }

    #[test]
    fn top_n_sigma_keeps_the_head() {
        let mut logits = vec![0.0f32; 50];
        logits[0] = 10.0;
        logits[1] = 9.8;
        let p = SamplerParams {
            top_n_sigma: 1.0,
            ..open(3)
        };
        let got = sampled(p, &logits, 200);
        assert!(got.is_subset(&[0, 1].into_iter().collect()), "{got:?}");
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn typical_p_prefers_typical_tokens() {
        // A dominant token is "atypical" when the entropy is spread by many small ones.
        let mut logits = vec![0.0f32; 100];
        logits[0] = 3.0;
        let p = SamplerParams {
            typical_p: 0.2,
            min_keep: 1,
            ..open(9)
        };
        let got = sampled(p, &logits, 100);
        assert!(!got.contains(&0), "{got:?}");
    }

    #[test]
    fn xtc_removes_top_choices() {
        let logits = [(0.5f32).ln(), (0.3f32).ln(), (0.2f32).ln()];
        let p = SamplerParams {
            xtc_probability: 1.0,
            xtc_threshold: 0.1,
            ..open(1)
        };
        // All three are above the threshold: all but the least likely of them go.
        assert_eq!(sampled(p, &logits, 50), [2].into_iter().collect());
        let p = SamplerParams {
            xtc_probability: 1.0,
            xtc_threshold: 0.1,
            min_keep: 2,
            ..open(1)
        };
        assert!(sampled(p, &logits, 100).len() > 1, "min_keep stops XTC");
    }

    #[test]
    fn min_keep_bounds_min_p() {
        let p = SamplerParams {
            min_p: 0.9,
            min_keep: 3,
            ..open(5)
        };
        assert_eq!(sampled(p, &[5.0, 4.0, 3.9, -10.0], 300).len(), 3);
    }

    #[test]
    fn dry_penalises_the_continuation_of_a_repeat() {
        let p = SamplerParams {
            dry_multiplier: 1.0,
            dry_allowed_length: 2,
            ..SamplerParams::greedy()
        };
        let mut s = Sampler::new(p.clone());
        for t in [1, 2, 3, 1, 2] {
            s.accept(t);
        }
        // "1 2" repeats; "3" would continue it and is pushed below token 0.
        assert_eq!(s.sample(&[2.0, 0.0, 0.0, 2.5]), 0);
        // A breaker inside the repeat stops it.
        let mut s = Sampler::new(p).with_dry_breakers(Arc::new([2].into_iter().collect()));
        for t in [1, 2, 3, 1, 2] {
            s.accept(t);
        }
        assert_eq!(s.sample(&[2.0, 0.0, 0.0, 2.5]), 3);
    }

    #[test]
    fn mirostat_is_seeded_and_tracks_surprise() {
        let logits: Vec<f32> = (0..200).map(|i| -(i as f32) * 0.05).collect();
        for mirostat in [1u8, 2] {
            let p = SamplerParams {
                mirostat,
                mirostat_tau: 3.0,
                ..open(77)
            };
            let run = || {
                let mut s = Sampler::new(p.clone());
                (0..40).map(|_| s.sample(&logits)).collect::<Vec<_>>()
            };
            assert_eq!(run(), run());
            let mut s = Sampler::new(p.clone());
            for _ in 0..40 {
                s.sample(&logits);
            }
            assert_ne!(s.mirostat_mu, 2.0 * p.mirostat_tau, "mu adapts");
            s.reset();
            assert_eq!(s.mirostat_mu, 2.0 * p.mirostat_tau);
        }
        // A tiny target surprise keeps Mirostat 2.0 on the top token.
        let p = SamplerParams {
            mirostat: 2,
            mirostat_tau: 0.01,
            mirostat_eta: 0.0,
            ..open(1)
        };
        assert_eq!(sampled(p, &logits, 30), [0].into_iter().collect());
    }

    #[test]
    fn dynamic_temperature_follows_entropy() {
        let s = Sampler::new(SamplerParams {
            temp: 1.0,
            dynatemp_range: 0.5,
            ..open(1)
        });
        let flat: Vec<(TokenId, f32)> = (0..10).map(|i| (i, 0.0)).collect();
        let peaked: Vec<(TokenId, f32)> = (0..10)
            .map(|i| (i, if i == 0 { 20.0 } else { 0.0 }))
            .collect();
        assert!((s.dynamic_temperature(&flat) - 1.5).abs() < 1e-3);
        assert!(s.dynamic_temperature(&peaked) < 0.6);
    }
}

#[cfg(test)]
mod fuzz_regressions {
    use super::*;

    /// The xorshift logits of the sampler fuzz target.
    fn fuzz_logits(seed: u32, n: usize) -> Vec<f32> {
        let mut x = seed | 1;
        let mut logits: Vec<f32> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x % 2000) as f32 / 100.0 - 10.0
            })
            .collect();
        logits[(x as usize) % n] = 1e30;
        logits
    }

    /// Found by `scripts/fuzz.sh sampler`: extreme (finite) parameters left no candidate
    /// and the draw indexed an empty list.
    #[test]
    fn extreme_parameters_still_sample_a_token() {
        let params = SamplerParams {
            seed: 12016889922377622117,
            temp: 565321400000000.0,
            top_k: 766648858,
            top_p: -4.6267407e23,
            min_p: 2660716.3,
            penalty_repeat: 2.527773e-16,
            penalty_freq: -3.2694672e38,
            penalty_present: -9.435702e-9,
            penalty_last_n: 1912923437,
            min_keep: 15683,
            typical_p: -2236550300000000.0,
            top_n_sigma: 6.6262e-41,
            xtc_probability: 0.0,
            xtc_threshold: 1.99e-43,
            dry_multiplier: 1.8e-43,
            dry_base: 0.0,
            dry_allowed_length: 0,
            dry_penalty_last_n: 0,
            mirostat: 0,
            mirostat_tau: 0.0,
            mirostat_eta: 2.9775e-41,
            dynatemp_range: -8.0,
            dynatemp_exponent: -4.1019506e-18,
            logit_bias: vec![],
            logprobs: Some(241),
        };
        params.validate().unwrap();
        let n = 103;
        let mut s = Sampler::new(params);
        let mut logits = fuzz_logits(1363349907, n);
        for _ in 0..3 {
            let (t, _) = s.sample_with_logprobs(&logits);
            assert!((t as usize) < n);
            s.accept(t);
            logits.rotate_left(7);
        }
    }
}
