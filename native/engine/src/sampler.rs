//! Token sampling with llama.cpp's stage order and semantics:
//! penalties → top-k → top-p → min-p → temperature → seeded draw (or greedy when temp ≤ 0).

use crate::tokenizer::TokenId;
use std::collections::VecDeque;

/// Penalties look at this many most recent tokens (llama.cpp's `penalty_last_n` default).
pub const PENALTY_LAST_N: usize = 64;

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
        idx.select_nth_unstable_by(n - 1, |a, b| b.1.total_cmp(&a.1));
        idx.truncate(n);
        idx.sort_by(|a, b| b.1.total_cmp(&a.1));
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
        ]
        .iter()
        .all(|v| v.is_finite());
        if !finite {
            return Err("sampler parameters must be finite numbers".into());
        }
        if self.penalty_repeat <= 0.0 {
            return Err("penalty_repeat must be positive".into());
        }
        Ok(())
    }

    fn penalties_active(&self) -> bool {
        self.penalty_repeat != 1.0 || self.penalty_freq != 0.0 || self.penalty_present != 0.0
    }
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
    candidates: Vec<(TokenId, f32)>,
}

impl Sampler {
    pub fn new(params: SamplerParams) -> Self {
        Sampler {
            rng: Rng::new(params.seed),
            params,
            history: VecDeque::with_capacity(PENALTY_LAST_N),
            candidates: Vec::new(),
        }
    }

    /// Restores the initial state (RNG and penalty history).
    pub fn reset(&mut self) {
        self.rng = Rng::new(self.params.seed);
        self.history.clear();
    }

    pub fn accept(&mut self, token: TokenId) {
        if self.history.len() == PENALTY_LAST_N {
            self.history.pop_front();
        }
        self.history.push_back(token);
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
        let p = self.params.clone();
        let mut cand = std::mem::take(&mut self.candidates);
        cand.clear();
        cand.extend(logits.iter().enumerate().map(|(i, &l)| (i as TokenId, l)));
        if p.penalties_active() && !self.history.is_empty() {
            self.apply_penalties(&mut cand);
        }
        let token = if p.temp <= 0.0 {
            argmax(&cand)
        } else {
            if p.top_k > 0 && (p.top_k as usize) < cand.len() {
                let k = p.top_k as usize;
                cand.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
                cand.truncate(k);
            }
            cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
            if p.top_p < 1.0 {
                let probs = softmax(&cand, 1.0);
                let mut cum = 0.0;
                let mut keep = cand.len();
                for (i, pr) in probs.iter().enumerate() {
                    cum += pr;
                    if cum >= p.top_p as f64 {
                        keep = i + 1;
                        break;
                    }
                }
                cand.truncate(keep.max(1));
            }
            if p.min_p > 0.0 && !cand.is_empty() {
                let threshold = cand[0].1 + p.min_p.ln();
                let keep = cand.iter().take_while(|c| c.1 >= threshold).count();
                cand.truncate(keep.max(1));
            }
            let probs = softmax(&cand, p.temp);
            let r = self.rng.next_f64();
            let mut cum = 0.0;
            let mut chosen = cand[cand.len() - 1].0;
            for (c, pr) in cand.iter().zip(&probs) {
                cum += pr;
                if r < cum {
                    chosen = c.0;
                    break;
                }
            }
            chosen
        };
        self.candidates = cand;
        token
    }

    fn apply_penalties(&self, cand: &mut [(TokenId, f32)]) {
        let p = &self.params;
        let mut counts: std::collections::HashMap<TokenId, u32> = std::collections::HashMap::new();
        for &t in &self.history {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            let Some(entry) = cand.get_mut(t as usize) else {
                continue;
            };
            if entry.1 <= 0.0 {
                entry.1 *= p.penalty_repeat;
            } else {
                entry.1 /= p.penalty_repeat;
            }
            entry.1 -= c as f32 * p.penalty_freq + p.penalty_present;
        }
    }
}

fn argmax(cand: &[(TokenId, f32)]) -> TokenId {
    let mut best = 0;
    for i in 1..cand.len() {
        if cand[i].1 > cand[best].1 {
            best = i;
        }
    }
    cand[best].0
}

/// Softmax of candidate logits divided by `temp`, in f64 for a stable cumulative sum.
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
