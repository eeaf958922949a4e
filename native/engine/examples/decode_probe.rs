use llama_cpp_ex_engine::{Batch, Context, ContextParams, LoadOptions, Model, Requantize};
use std::sync::Arc;
use std::time::Instant;

fn main() {
    let path = std::env::args().nth(1).unwrap();
    let nseq: usize = std::env::args().nth(2).map_or(8, |s| s.parse().unwrap());
    let steps: usize = std::env::args().nth(3).map_or(64, |s| s.parse().unwrap());
    let model = Arc::new(
        Model::load(
            std::path::Path::new(&path),
            &LoadOptions {
                requantize: Requantize::Off,
                vocab_only: false,
            },
        )
        .unwrap(),
    );
    let mut ctx = Context::new(
        model.clone(),
        ContextParams {
            n_ctx: 4096,
            n_batch: 4096,
            n_seq_max: nseq,
            ..Default::default()
        },
    )
    .unwrap();
    let prompt: Vec<u32> = (0..100).map(|i| 100 + i * 7).collect();
    for s in 0..nseq {
        let b = Batch::for_sequence(&prompt, 0, s);
        ctx.decode(&b).unwrap();
    }
    let t0 = Instant::now();
    for step in 0..steps {
        let mut b = Batch::with_capacity(nseq);
        for s in 0..nseq {
            b.push(
                200 + (step as u32 * 13 + s as u32) % 1000,
                100 + step,
                s,
                true,
            );
        }
        ctx.decode(&b).unwrap();
    }
    let dt = t0.elapsed().as_secs_f64();
    println!(
        "nseq {nseq}: {:.1} ms/step, {:.1} tok/s",
        dt * 1e3 / steps as f64,
        (nseq * steps) as f64 / dt
    );
}
