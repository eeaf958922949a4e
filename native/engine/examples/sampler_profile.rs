//! Times one sampling step on a vocabulary-sized row of logits (no model), for A/B checks
//! of the sampler's serial cost between two forward passes:
//!
//!     cargo run --release --example sampler_profile -- [VOCAB...]
//!
//! Rows are model-like (Gaussian logits, fresh each step). Each figure is the best median
//! of 5 rounds of 200 steps, in µs a token: greedy, and llama.cpp's default sampled chain
//! (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) with top-k's one-pass candidates and
//! with the whole row's list, each without and with a 3-token ban list.

use llama_cpp_ex_engine::sampler::{Rng, Sampler, SamplerParams};
use std::time::Instant;

fn gaussian_rows(vocab: usize, count: usize) -> Vec<Vec<f32>> {
    let mut rng = Rng::new(3);
    (0..count)
        .map(|_| {
            (0..vocab)
                .map(|_| {
                    // Box-Muller
                    let (u, v) = (rng.next_f64().max(1e-12), rng.next_f64());
                    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * 2.5) as f32
                })
                .collect()
        })
        .collect()
}

fn time(sampler: &mut Sampler, rows: &[Vec<f32>]) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let mut per: Vec<f64> = rows
            .iter()
            .cycle()
            .take(200)
            .map(|row| {
                let t = Instant::now();
                std::hint::black_box(sampler.sample(row));
                t.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        per.sort_by(f64::total_cmp);
        best = best.min(per[per.len() / 2]);
    }
    best
}

fn main() {
    let vocabs: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let vocabs = if vocabs.is_empty() {
        vec![49_152, 262_144]
    } else {
        vocabs
    };
    println!("vocab\tchain\tban list\tµs/token");
    for vocab in vocabs {
        let rows = gaussian_rows(vocab, 16);
        let ban = vec![
            (0, f32::NEG_INFINITY),
            (1, f32::NEG_INFINITY),
            (2, f32::NEG_INFINITY),
        ];
        for banned in [false, true] {
            let logit_bias = if banned { ban.clone() } else { Vec::new() };
            let greedy = SamplerParams {
                logit_bias: logit_bias.clone(),
                ..SamplerParams::greedy()
            };
            let sampled = SamplerParams {
                seed: 1,
                logit_bias,
                ..Default::default()
            };
            let mut whole = Sampler::new(sampled.clone());
            whole.top_k_scan = false;
            for (label, mut s) in [
                ("greedy", Sampler::new(greedy)),
                ("sampled, one pass", Sampler::new(sampled)),
                ("sampled, whole list", whole),
            ] {
                println!("{vocab}\t{label}\t{banned}\t{:.1}", time(&mut s, &rows));
            }
        }
    }
}
