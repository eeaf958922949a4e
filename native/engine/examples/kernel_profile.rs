//! Times the engine's quantized products alone on synthetic weights, in GB/s of weights read
//! and GMAC/s, for A/B checks of kernel changes (no model, no BEAM):
//!
//!     cargo run --release --example kernel_profile -- [THREADS] [ROWS...]
//!
//! `SHAPES=text` keeps the shapes whose label contains `text`. Each figure is the best of 15
//! timing windows. `COPIES=n` rotates each call among `n` copies of the matrix, so that a
//! small matrix is read from memory as in a model's decode rather than from cache (at most
//! 512 MB of copies per shape). `GATED=1` runs each shape as a stacked gate and up product
//! with SiLU fused into its tiles (`matmul_gated`, as the models' FFNs run), and `MEAN=1`
//! prints the mean of the windows beside the best (how much this VM's neighbours cost).
//!
//! Shapes are the ones that dominate the two real models' decode: Gemma 3's tied Q8_0 output
//! head (262144 × 640) and Q5_0 FFN (2048 × 640, 640 × 2048), SmolLM2's tied Q8_0 head
//! (49152 × 576) and Q4_1 FFN (3072 × 576, 576 × 1536), and a Llama 3.2 1B layer's FFN
//! (16384 × 2048, 2048 × 8192) in Q4_1 and in its file's Q4_K and Q6_K (run as Q4_1 and Q6_K
//! blocks with factored scales). GB/s counts the file's bytes.

use half::f16;
use llama_cpp_ex_engine::kernels::kquant::KQuant;
use llama_cpp_ex_engine::kernels::packed::{PackedMatrix, PackedType};
use llama_cpp_ex_engine::model::ops::silu_mul;
use std::time::Instant;

/// Random K-quant super-blocks: small positive f16 scales, random 6-bit sub-block scales
/// and values.
fn random_k_bytes(kind: KQuant, n_out: usize, n_in: usize) -> Vec<u8> {
    let mut seed = 9u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    };
    let bb = kind.block_bytes();
    let mut bytes = Vec::with_capacity(n_out * n_in / 256 * bb);
    for _ in 0..n_out * n_in / 256 {
        let start = bytes.len();
        bytes.extend((0..bb).map(|_| next() as u8));
        let d = f16::from_f32(1e-3 + (next() % 100) as f32 * 1e-5).to_le_bytes();
        // Q4_K/Q5_K: d and dmin lead; Q6_K: d ends the block
        match kind {
            KQuant::Q6K => bytes[start + bb - 2..start + bb].copy_from_slice(&d),
            _ => {
                bytes[start..start + 2].copy_from_slice(&d);
                bytes[start + 2..start + 4].copy_from_slice(&d);
            }
        }
    }
    bytes
}

#[derive(Clone, Copy)]
enum Kind {
    Plain(PackedType),
    K(KQuant),
}

fn random_bytes(kind: PackedType, n_out: usize, n_in: usize) -> Vec<u8> {
    let block = match kind {
        PackedType::Q4_0 => 18,
        PackedType::Q4_1 => 20,
        PackedType::Q5_0 => 22,
        PackedType::Q5_1 => 24,
        PackedType::Q8_0 => 34,
        PackedType::Q6K => unreachable!(),
    };
    let mut seed = 7u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    };
    let mut bytes = Vec::with_capacity(n_out * n_in / 32 * block);
    for _ in 0..n_out * n_in / 32 {
        let d = f16::from_f32(0.01 + (next() % 100) as f32 * 1e-4).to_le_bytes();
        bytes.extend_from_slice(&d);
        let rest = block - 2;
        let start = bytes.len();
        bytes.extend((0..rest).map(|_| next() as u8));
        if matches!(kind, PackedType::Q4_1 | PackedType::Q5_1) {
            bytes[start..start + 2].copy_from_slice(&f16::from_f32(-0.05).to_le_bytes());
        }
    }
    bytes
}

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let rows: Vec<usize> = args.filter_map(|a| a.parse().ok()).collect();
    let rows = if rows.is_empty() { vec![1, 8] } else { rows };
    println!(
        "simd: {}, threads: {threads}",
        llama_cpp_ex_engine::kernels::simd_level().name()
    );
    let shapes = [
        (
            "gemma head q8_0",
            Kind::Plain(PackedType::Q8_0),
            262144,
            640,
        ),
        (
            "gemma ffn_up q5_0",
            Kind::Plain(PackedType::Q5_0),
            2048,
            640,
        ),
        (
            "gemma ffn_down q5_0",
            Kind::Plain(PackedType::Q5_0),
            640,
            2048,
        ),
        (
            "smollm2 head q8_0",
            Kind::Plain(PackedType::Q8_0),
            49152,
            576,
        ),
        (
            "smollm2 gate_up q4_1",
            Kind::Plain(PackedType::Q4_1),
            3072,
            576,
        ),
        (
            "smollm2 down q4_1",
            Kind::Plain(PackedType::Q4_1),
            576,
            1536,
        ),
        // a Llama 3.2 1B layer's FFN
        (
            "llama1b gate_up q4_1",
            Kind::Plain(PackedType::Q4_1),
            16384,
            2048,
        ),
        (
            "llama1b down q4_1",
            Kind::Plain(PackedType::Q4_1),
            2048,
            8192,
        ),
        ("llama1b gate_up q4_k", Kind::K(KQuant::Q4K), 16384, 2048),
        ("llama1b down q4_k", Kind::K(KQuant::Q4K), 2048, 8192),
        ("llama1b down q6_k", Kind::K(KQuant::Q6K), 2048, 8192),
    ];
    // SHAPES=text: only the shapes whose label contains it (e.g. `ffn` skips the head)
    let only = std::env::var("SHAPES").unwrap_or_default();
    for (label, kind, n_out, n_in) in shapes {
        if !label.contains(only.as_str()) {
            continue;
        }
        let bytes = match kind {
            Kind::Plain(kind) => random_bytes(kind, n_out, n_in),
            Kind::K(kind) => random_k_bytes(kind, n_out, n_in),
        };
        // (at most 512 MB of copies: the head alone is 178 MB)
        let copies: usize = std::env::var("COPIES")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(1)
            .min((512 << 20) / bytes.len())
            .max(1);
        let ws: Vec<PackedMatrix> = (0..copies)
            .map(|_| match kind {
                Kind::Plain(kind) => PackedMatrix::from_bytes(kind, &bytes, n_out, n_in),
                Kind::K(kind) => PackedMatrix::from_k_quant(kind, &bytes, n_out, n_in),
            })
            .map(Option::unwrap)
            .collect();
        let mut next = 0;
        let mut w = || {
            next = (next + 1) % ws.len();
            &ws[next]
        };
        for &m in &rows {
            let x: Vec<f32> = (0..m * n_in)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let mut out = vec![0f32; m * n_out];
            // enough repetitions for ~0.3 s and to stream more than any cache holds
            // (prompt-sized batches: by multiply-adds, ~0.3 s at 100 GMAC/s)
            let reps = if m > 32 {
                (30_000_000_000 / (m * n_out * n_in)).clamp(3, 20_000)
            } else {
                (2_000_000_000 / (bytes.len() * m.max(1))).clamp(3, 20_000)
            };
            // GATED=1: the fused gate, up and SiLU product, where the shape splits in two
            // halves of whole row groups (else the plain product)
            let gated = std::env::var_os("GATED").is_some();
            let product = |w: &PackedMatrix, out: &mut Vec<f32>| {
                if !gated || w.matmul_gated(&x, m, out, silu_mul).is_none() {
                    out.resize(m * n_out, 0.0);
                    w.matmul(&x, m, out);
                }
            };
            llama_cpp_ex_engine::pool::with_threads(threads, || {
                product(w(), &mut out);
                // the best of 15 windows: this VM's neighbours slow whole windows down
                let window = reps.div_ceil(15);
                let s = (0..15)
                    .map(|_| {
                        let t = Instant::now();
                        for _ in 0..window {
                            product(w(), &mut out);
                        }
                        t.elapsed().as_secs_f64() / window as f64
                    })
                    .collect::<Vec<f64>>();
                let best = s.iter().copied().fold(f64::INFINITY, f64::min);
                let mean = match std::env::var_os("MEAN") {
                    Some(_) => format!("  (mean {:.1} us)", 1e6 * s.iter().sum::<f64>() / 15.0),
                    None => String::new(),
                };
                println!(
                    "{label:22} {n_out:6}x{n_in:<5} m={m:<3} {:8.1} us  {:6.1} GB/s  {:6.1} GMAC/s{mean}",
                    best * 1e6,
                    bytes.len() as f64 / best / 1e9,
                    (m * n_out * n_in) as f64 / best / 1e9
                );
            });
        }
    }
}
