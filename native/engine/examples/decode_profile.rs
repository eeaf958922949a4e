//! Times the engine's forward passes without the BEAM, for profiling (`perf record`) and for
//! A/B checks of kernel changes:
//!
//!     cargo run --release --example decode_profile -- MODEL.gguf [THREADS] [STEPS] [STREAMS]
//!
//! prints the load time, pp512 (one 512-token prompt), tg (STEPS one-token decodes) and,
//! with STREAMS > 1, batched decode (STREAMS sequences at different positions, one token each
//! per pass).
//! Environment: `PROMPT=N` starts decoding after N prompt tokens (decode at depth N, as
//! llama-bench's `-d N`), `PP_REPS=N` prints the best of N pp512 runs, `TG_ONLY=1` skips pp512,
//! `STREAMS_ONLY=1` runs only the batched decode, `KV_TYPE=f16|f32|q8_0|q4_0` sets the cache's
//! type (default f16), `GPU=1` places the model on GPU 0 (a build with the `cuda` feature).
//! `CEILING=N` runs only N rounds of a memory read-rate probe followed by a decode run, and
//! prints each round's share of the read ceiling (weight bytes × tok/s ÷ read rate) and their
//! median: on a machine whose bandwidth drifts between runs, a share from the same moment.
//! `SECTIONS=1` prints where the decode steps' time went: each product, attention, the steps
//! between them ([`llama_cpp_ex_engine::profile`]), in microseconds a step, and the same for
//! the pp512 runs (a "step" there is one whole prompt), and how much of the decode steps the
//! pool's workers sat idle and its caller waited for them. `DMMV=1` (a `cuda` build) has candle's
//! quantized products take their f32 activations as they are, one launch per product, where
//! its default quantizes them to Q8_1 first (two launches); rows beyond one then dequantize
//! whole matrices, so it is for timing one stream. With `LLAMA_CPP_EX_CUDA_GRAPHS=1` it
//! prints how many decode steps replayed a captured graph. `SAMPLE=1` has the batched decode
//! draw each stream's token with llama.cpp's default sampler chain (the engine's step, as
//! the Server runs it) instead of bringing back whole rows, and prints the bytes a step
//! copied back.

use llama_cpp_ex_engine::kv::KvType;
use llama_cpp_ex_engine::profile;
use llama_cpp_ex_engine::{
    Batch, Context, ContextParams, DeviceCopies, LoadOptions, Model, Placement, Requantize,
    Sampler, SamplerParams, SharedSampler, Step,
};
use std::sync::{Arc, Mutex};
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .expect("usage: decode_profile MODEL.gguf [THREADS] [STEPS] [STREAMS]");
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let steps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(128);
    let streams: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1);
    let opts = LoadOptions {
        requantize: Requantize::Off,
        vocab_only: false,
        placement: if std::env::var_os("GPU").is_some() {
            Placement::Layers {
                n_gpu_layers: -1,
                main_gpu: 0,
            }
        } else {
            Placement::default()
        },
    };
    #[cfg(feature = "cuda")]
    if std::env::var_os("DMMV").is_some() {
        candle_core::quantized::cuda::set_force_dmmv(true);
    }
    let t = Instant::now();
    let model = Arc::new(Model::load(std::path::Path::new(&path), &opts).unwrap());
    println!(
        "{} on {}, loaded in {:.0} ms",
        model.desc,
        model.backend.name(),
        t.elapsed().as_secs_f64() * 1e3
    );
    // PROMPT=N: decoding starts after N prompt tokens (stream s of the batched run after
    // N + 7 * s), to measure decode at a longer context; default 1 (an empty context)
    let start: usize = std::env::var("PROMPT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        .max(1);
    let kv_type = match std::env::var("KV_TYPE").as_deref() {
        Err(_) | Ok("f16") => KvType::F16,
        Ok("f32") => KvType::F32,
        Ok("q8_0") => KvType::Q8_0,
        Ok("q4_0") => KvType::Q4_0,
        Ok(other) => panic!("KV_TYPE: unknown cache type {other:?}"),
    };
    let params = |n_seq_max| ContextParams {
        n_ctx: ((start + 7 * streams + steps + 16) * streams).max(4096),
        n_seq_max,
        kv_type,
        n_threads: threads,
        n_threads_batch: threads,
        ..Default::default()
    };
    let prompt: Vec<u32> = (0..(start + 7 * streams).max(512) as u32)
        .map(|i| 300 + i % 1000)
        .collect();
    let sections = std::env::var_os("SECTIONS").is_some();
    let decode_run = |ctx: &mut Context, run: usize, ncu_step: bool| {
        ctx.decode(&Batch::for_sequence(&prompt[..start], 0, 0))
            .unwrap();
        profile::enable(sections);
        let t = Instant::now();
        for i in 0..steps {
            let bracket = ncu_step && run == 0 && i == 2;
            if bracket {
                profiler(true);
            }
            ctx.decode(&Batch::for_sequence(&[400 + i as u32 % 500], start + i, 0))
                .unwrap();
            if bracket {
                profiler(false);
            }
        }
        let tps = steps as f64 / t.elapsed().as_secs_f64();
        profile::enable(false);
        tps
    };
    if let Some(rounds) = std::env::var("CEILING").ok().and_then(|v| v.parse().ok()) {
        let probe = llama_cpp_ex_engine::membw::Probe::new(1024);
        let gb = model.size_bytes as f64 / 1e9;
        let mut shares: Vec<f64> = (0..rounds)
            .map(|round| {
                let rate = probe.read_rate(threads, 3);
                let mut ctx = Context::new(model.clone(), params(1)).unwrap();
                let tps = decode_run(&mut ctx, 1, false);
                let share = 100.0 * gb * tps / rate;
                println!(
                    "round {round}: tg{steps} {tps:.1} tok/s x {:.1} MB = {:.2} GB/s of {rate:.2} GB/s read: {share:.0}% of the ceiling ({:.1} tok/s)",
                    gb * 1e3,
                    gb * tps,
                    rate / gb
                );
                share
            })
            .collect();
        shares.sort_by(f64::total_cmp);
        if !shares.is_empty() {
            println!("median share: {:.0}%", shares[shares.len() / 2]);
        }
        return;
    }
    // STREAMS_ONLY=1: only the batched decode (for profiling it alone)
    let single = std::env::var_os("STREAMS_ONLY").is_none();
    if single {
        profile::take();
        // TG_ONLY=1: skip the prompt (for profiling decode alone)
        if std::env::var_os("TG_ONLY").is_none() {
            let mut ctx = Context::new(model.clone(), params(1)).unwrap();
            ctx.decode(&Batch::for_sequence(&prompt, 0, 0)).unwrap();
            // PP_REPS=N: the best of N prompts (for profiling prefill alone)
            let reps: usize = std::env::var("PP_REPS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(1);
            let mut best = f64::INFINITY;
            profile::take();
            profile::enable(sections);
            for _ in 0..reps.max(1) {
                let mut ctx = Context::new(model.clone(), params(1)).unwrap();
                let t = Instant::now();
                ctx.decode(&Batch::for_sequence(&prompt, 0, 0)).unwrap();
                best = best.min(t.elapsed().as_secs_f64());
            }
            profile::enable(false);
            println!("pp512: {:.1} tok/s", 512.0 / best);
            if sections {
                // a "step" here is one 512-token prompt
                print_sections(reps.max(1));
            }
        }

        // NCU_STEP=1: the first run's third step alone is bracketed for a profiler started
        // with profiling off (`ncu --profile-from-start off`): one decode step's kernels
        let ncu_step = std::env::var_os("NCU_STEP").is_some();
        // the median of 5 runs from an empty context (as llama-bench's tg runs) or after
        // PROMPT tokens
        let pool_before = llama_cpp_ex_engine::pool::stats();
        let mut copies = DeviceCopies::default();
        let mut runs: Vec<f64> = (0..5)
            .map(|run| {
                let mut ctx = Context::new(model.clone(), params(1)).unwrap();
                let tps = decode_run(&mut ctx, run, ncu_step);
                let c = ctx.device_copies();
                copies.bucketed += c.bucketed;
                copies.replayed += c.replayed;
                tps
            })
            .collect();
        runs.sort_by(f64::total_cmp);
        let at = if start > 1 {
            format!(" after {start}")
        } else {
            String::new()
        };
        // the timed steps' wall time, while the pool's accounting was on
        let timed: f64 = runs.iter().map(|tps| steps as f64 / tps).sum();
        println!("tg{steps}{at}: {:.1} tok/s", runs[2]);
        print_graphs(&copies);
        if sections {
            print_sections(5 * steps);
            print_pool_time(&pool_before, timed, threads);
        }
        // (the 5 runs' prompts included: a few calls against hundreds of steps)
        let pool = llama_cpp_ex_engine::pool::stats();
        let per_step = |n: usize| n as f64 / (5 * steps) as f64;
        println!(
            "pool per step: {:.1} worker wake-ups, {:.2} unparks",
            per_step(pool.wakeups - pool_before.wakeups),
            per_step(pool.unparks - pool_before.unparks)
        );
    }

    if streams > 1 {
        let mut ctx = Context::new(model, params(streams)).unwrap();
        for s in 0..streams {
            ctx.decode(&Batch::for_sequence(&prompt[..start + 7 * s], 0, s))
                .unwrap();
        }
        let sample = std::env::var_os("SAMPLE").is_some();
        let samplers: Vec<(usize, SharedSampler)> = (0..streams)
            .map(|s| {
                let params = SamplerParams {
                    seed: s as u64,
                    ..Default::default()
                };
                (s, Arc::new(Mutex::new(Sampler::new(params))))
            })
            .collect();
        profile::take();
        let pool_before = llama_cpp_ex_engine::pool::stats();
        profile::enable(sections);
        let before = ctx.device_copies();
        let t = Instant::now();
        for i in 0..steps {
            let mut b = Batch::default();
            for s in 0..streams {
                b.push(400 + (i + s) as u32 % 500, start + 7 * s + i, s, true);
            }
            if sample {
                let step = Step {
                    batch: b,
                    samplers: samplers.clone(),
                    ..Default::default()
                };
                ctx.step(&step).unwrap();
            } else {
                ctx.decode(&b).unwrap();
            }
        }
        let timed = t.elapsed().as_secs_f64();
        let n = (steps * streams) as f64;
        let how = if sample { " (sampled)" } else { "" };
        println!("{streams} streams{how}: {:.1} tok/s", n / timed);
        let after = ctx.device_copies();
        if sample && after.to_host > before.to_host {
            println!(
                "bytes back a step: {}",
                (after.bytes_to_host - before.bytes_to_host) / steps
            );
        }
        print_graphs(&DeviceCopies {
            bucketed: after.bucketed - before.bucketed,
            replayed: after.replayed - before.replayed,
            ..after
        });
        profile::enable(false);
        if sections {
            print_sections(steps);
            print_pool_time(&pool_before, timed, threads);
        }
    }
}

/// How the pool's threads spent `timed` seconds of timed steps since `before`: the workers'
/// share of their time idle (the caller's serial steps, waking, or done before it), and the
/// caller's time in three: its part of the pool's calls, waiting for the workers after it,
/// and alone (serial steps, and calls too short for the pool).
fn print_pool_time(before: &llama_cpp_ex_engine::pool::PoolStats, timed: f64, threads: usize) {
    let after = llama_cpp_ex_engine::pool::stats();
    let share =
        |a: std::time::Duration, b: std::time::Duration| 100.0 * (a - b).as_secs_f64() / timed;
    let helpers = threads.saturating_sub(1).max(1) as f64;
    let (work, wait) = (
        share(after.caller_work, before.caller_work),
        share(after.join_wait, before.join_wait),
    );
    println!(
        "pool: workers idle {:.1}% of their time; the caller in its part of calls {work:.1}%, waiting for the workers {wait:.1}%, alone {:.1}%",
        (100.0 - share(after.helper_work, before.helper_work) / helpers).max(0.0),
        (100.0 - work - wait).max(0.0)
    );
}

/// How many decode steps ran bucketed and how many of them replayed a CUDA graph
/// (`LLAMA_CPP_EX_CUDA_GRAPHS=1`); nothing when none was bucketed.
fn print_graphs(c: &DeviceCopies) {
    if c.bucketed > 0 {
        println!(
            "graphs: {} of {} bucketed steps replayed",
            c.replayed, c.bucketed
        );
    }
}

/// The time per step of each section of the `steps` steps timed since the last
/// `profile::take`, and its share of their sum.
fn print_sections(steps: usize) {
    let times = profile::take();
    let total: f64 = times.iter().map(|(_, d)| d.as_secs_f64()).sum();
    for (section, d) in times {
        println!(
            "  {:15} {:8.1} us a step  {:5.1}%",
            section.name(),
            d.as_secs_f64() * 1e6 / steps as f64,
            100.0 * d.as_secs_f64() / total.max(f64::MIN_POSITIVE)
        );
    }
}

/// Turns a CUDA profiler's collection on or off (no-op in a CPU build).
fn profiler(on: bool) {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::sys;
        // SAFETY: plain driver calls without arguments; a failure only means no profiler.
        unsafe {
            let _ = if on {
                sys::cuProfilerStart()
            } else {
                sys::cuProfilerStop()
            };
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = on;
}
