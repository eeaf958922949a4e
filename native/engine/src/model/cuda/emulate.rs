//! The CUDA kernels run as C++ on CPU threads (`emulate.hpp`), checked against candle's CPU
//! ops for the steps they replace (or, for attention, a float64 softmax), so their indexing,
//! barriers and arithmetic are tested on every machine, GPU or not. What this cannot check
//! (the launch code, the PTX) the GPU parity tests do (`scripts/gpu_check.sh run`).

use super::{ATTN_THREADS, GLU_THREADS, ROPE_THREADS, ROW_THREADS, SOURCE};
use crate::kernels::lcg;
use crate::model::tensor::UNSEEN;
use candle_core::{DType, Device, Tensor};
use half::f16;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A kernel driver compiled with the kernels: `main` reads its arrays from files and its
/// scalars from its arguments.
struct Emulator {
    dir: PathBuf,
}

impl Emulator {
    /// Compiles `driver`; `None` (with a message) where the machine has no C++ compiler.
    fn build(name: &str, driver: &str) -> Option<Self> {
        let dir = std::env::temp_dir().join(format!(
            "llama_cpp_ex_emulate_{}_{name}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("a scratch folder");
        let src = format!("{}\n{SOURCE}\n{driver}\n", include_str!("emulate.hpp"));
        std::fs::write(dir.join("emu.cpp"), src).expect("writing the source");
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = match Command::new(&cxx)
            .current_dir(&dir)
            .args([
                "-std=c++20",
                "-O1",
                "-pthread",
                "-w",
                "emu.cpp",
                "-o",
                "emu",
            ])
            .output()
        {
            Ok(out) => out,
            Err(e) => {
                eprintln!("skipped: no C++ compiler ({cxx}: {e}) to emulate the CUDA kernels");
                return None;
            }
        };
        assert!(
            out.status.success(),
            "compiling the kernels as C++: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(Emulator { dir })
    }

    /// Runs the driver on `inputs` with `args`, returning the files named `outputs`.
    fn run(
        &self,
        inputs: &[(&str, Vec<u8>)],
        args: &[&dyn std::fmt::Display],
        outputs: &[&str],
    ) -> Vec<Vec<u8>> {
        for (name, bytes) in inputs {
            std::fs::write(self.dir.join(name), bytes).expect("writing an input");
        }
        let mut child = Command::new(self.dir.join("emu"))
            .current_dir(&self.dir)
            .args(args.iter().map(|a| a.to_string()))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running the emulated kernel");
        // a kernel whose threads miss a barrier would wait forever
        let deadline = Instant::now() + Duration::from_secs(120);
        while child.try_wait().expect("waiting on the kernel").is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("the emulated kernel did not finish: a barrier some threads missed?");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let out = child.wait_with_output().expect("the kernel's output");
        assert!(
            out.status.success(),
            "emulated kernel failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        outputs
            .iter()
            .map(|n| std::fs::read(self.dir.join(n)).expect("an output"))
            .collect()
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_u32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_f16(v: &[f16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f16s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| f16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f32())
        .collect()
}

/// `n` of the kernel tests' deterministic values in [-1, 1), from `seed`.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n).map(|_| lcg(&mut s)).collect()
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}: element {i}: {g} against {w}"
        );
    }
}

fn cpu(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape, &Device::Cpu).unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

const ATTENTION_DRIVER: &str = r#"
int main(int argc, char** argv) {
    const int rows = atoi(argv[1]), l_max = atoi(argv[2]), n_head = atoi(argv[3]),
              n_kv = atoi(argv[4]), hd = atoi(argv[5]), threads = atoi(argv[8]);
    const float scale = atof(argv[6]), softcap = atof(argv[7]);
    auto q = emu_read<float>("q");
    auto idx = emu_read<unsigned>("idx");
    auto k = emu_read<unsigned short>("k");
    auto v = emu_read<unsigned short>("v");
    std::vector<float> out((size_t)rows * n_head * hd, -7.f);
    emu_launch({(unsigned)rows, (unsigned)n_head, 1}, threads, [&] {
        paged_decode_attn(q.data(), idx.data(), k.data(), v.data(), idx.data() + rows,
                          out.data(), l_max, n_head, n_kv, hd, scale, softcap);
    });
    emu_write("out", out);
}
"#;

/// Decode attention against a float64 softmax over the keys each sequence sees: grouped
/// heads, several tiles of keys with a partial last one, hidden keys mid-row and at its end
/// (padding), queries out of batch order, heads of one and two columns per thread, softcap.
#[test]
fn decode_attention_matches_a_float64_softmax() {
    let Some(emu) = Emulator::build("attention", ATTENTION_DRIVER) else {
        return;
    };
    let (n_head, n_kv, slots_total) = (6usize, 2usize, 400usize);
    for (hd, l_max, softcap) in [(64usize, 300usize, 0.0f32), (160, 129, 30.0), (32, 7, 0.0)] {
        let rows = 3usize;
        let batch_rows = 5usize;
        let kv_dim = n_kv * hd;
        let q = values(batch_rows * n_head * hd, 1);
        let k: Vec<f16> = values(slots_total * kv_dim, 2)
            .iter()
            .map(|&x| f16::from_f32(x))
            .collect();
        let v: Vec<f16> = values(slots_total * kv_dim, 3)
            .iter()
            .map(|&x| f16::from_f32(x))
            .collect();
        let q_rows = [4u32, 0, 2];
        let mut slots = vec![UNSEEN; rows * l_max];
        for i in 0..rows {
            // sequence i sees l_max - 2i keys, the third of them hidden (a dropped block)
            for j in 0..l_max - 2 * i {
                if j != 2 {
                    slots[i * l_max + j] = ((i * 131 + j * 7) % slots_total) as u32;
                }
            }
        }
        let mut idx = q_rows.to_vec();
        idx.extend(&slots);
        let scale = 1.0 / (hd as f32).sqrt();
        let args: [&dyn std::fmt::Display; 8] = [
            &rows,
            &l_max,
            &n_head,
            &n_kv,
            &hd,
            &scale,
            &softcap,
            &ATTN_THREADS,
        ];
        let out = emu.run(
            &[
                ("q", bytes_f32(&q)),
                ("idx", bytes_u32(&idx)),
                ("k", bytes_f16(&k)),
                ("v", bytes_f16(&v)),
            ],
            &args,
            &["out"],
        );
        let got = f32s(&out[0]);
        let mut want = vec![0f32; rows * n_head * hd];
        for i in 0..rows {
            for h in 0..n_head {
                let kvh = h / (n_head / n_kv);
                let qr = &q[q_rows[i] as usize * n_head * hd + h * hd..][..hd];
                let seen: Vec<usize> = slots[i * l_max..(i + 1) * l_max]
                    .iter()
                    .filter(|&&s| s != UNSEEN)
                    .map(|&s| s as usize)
                    .collect();
                let scores: Vec<f64> = seen
                    .iter()
                    .map(|&s| {
                        let kr = &k[s * kv_dim + kvh * hd..][..hd];
                        let dot: f64 = qr.iter().zip(kr).map(|(a, b)| *a as f64 * b.to_f64()).sum();
                        let s = dot * scale as f64;
                        if softcap > 0.0 {
                            softcap as f64 * (s / softcap as f64).tanh()
                        } else {
                            s
                        }
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let sum: f64 = p.iter().sum();
                for d in 0..hd {
                    let acc: f64 = seen
                        .iter()
                        .zip(&p)
                        .map(|(&s, p)| p * v[s * kv_dim + kvh * hd + d].to_f64())
                        .sum();
                    want[i * n_head * hd + h * hd + d] = (acc / sum) as f32;
                }
            }
        }
        assert_close(&got, &want, 1e-5, &format!("attention, head size {hd}"));
    }
}

const NORM_DRIVER: &str = r#"
int main(int argc, char** argv) {
    const int n = atoi(argv[1]), d = atoi(argv[2]), with_o = atoi(argv[3]),
              with_post = atoi(argv[4]), threads = atoi(argv[6]);
    const float eps = atof(argv[5]);
    auto x = emu_read<float>("x");
    auto o = emu_read<float>("o");
    auto post = emu_read<float>("post");
    auto w = emu_read<float>("w");
    std::vector<float> out(2 * (size_t)n * d, -7.f);
    emu_launch({(unsigned)n, 1, 1}, threads, [&] {
        residual_norm(x.data(), with_o ? o.data() : nullptr, with_post ? post.data() : nullptr,
                      w.data(), out.data(), n, d, eps);
    });
    emu_write("out", out);
}
"#;

/// The residual step against the tensor path's candle ops: `x + rms_norm(o, post)`, `x + o`
/// or `x` alone, then `rms_norm` of that with `w`.
#[test]
fn residual_norm_matches_candles_ops() {
    let Some(emu) = Emulator::build("norm", NORM_DRIVER) else {
        return;
    };
    let eps = 1e-6f32;
    for (n, d) in [(3usize, 576usize), (1, 2048), (2, 100)] {
        let x = values(n * d, 4);
        let o: Vec<f32> = values(n * d, 5).iter().map(|v| v * 3.0).collect();
        let post = values(d, 6);
        let w = values(d, 7);
        for (with_o, with_post) in [(1, 1), (1, 0), (0, 0)] {
            let args: [&dyn std::fmt::Display; 6] =
                [&n, &d, &with_o, &with_post, &eps, &ROW_THREADS];
            let out = emu.run(
                &[
                    ("x", bytes_f32(&x)),
                    ("o", bytes_f32(&o)),
                    ("post", bytes_f32(&post)),
                    ("w", bytes_f32(&w)),
                ],
                &args,
                &["out"],
            );
            let got = f32s(&out[0]);
            let mut xt = cpu(&x, &[n, d]);
            if with_o == 1 {
                let mut ot = cpu(&o, &[n, d]);
                if with_post == 1 {
                    ot = candle_nn::ops::rms_norm(&ot, &cpu(&post, &[d]), eps).unwrap();
                }
                xt = (xt + ot).unwrap();
            }
            let h = candle_nn::ops::rms_norm(&xt, &cpu(&w, &[d]), eps).unwrap();
            let what = format!("n {n}, d {d}, parts {with_o}{with_post}");
            assert_close(&got[..n * d], &flat(&xt), 1e-6, &format!("{what}: x"));
            assert_close(&got[n * d..], &flat(&h), 1e-5, &format!("{what}: h"));
        }
    }
}

const GLU_DRIVER: &str = r#"
int main(int argc, char** argv) {
    const int n = atoi(argv[1]), ff = atoi(argv[2]), gelu = atoi(argv[3]), threads = atoi(argv[4]);
    auto gu = emu_read<float>("gu");
    std::vector<float> out((size_t)n * ff, -7.f);
    const unsigned blocks = ((size_t)n * ff + threads - 1) / threads;
    // the halves of one stacked product: rows 2 * ff apart
    emu_launch({blocks, 1, 1}, threads, [&] {
        glu(gu.data(), gu.data() + ff, out.data(), n, ff, 2 * ff, 2 * ff, gelu);
    });
    emu_write("out", out);
}
"#;

/// The gated activation against candle's `silu` / `gelu` times the up half, reading both
/// halves of a stacked product in place.
#[test]
fn gated_activation_matches_candles_ops() {
    let Some(emu) = Emulator::build("glu", GLU_DRIVER) else {
        return;
    };
    let (n, ff) = (3usize, 300usize);
    let gu: Vec<f32> = values(n * 2 * ff, 8).iter().map(|v| v * 6.0).collect();
    for gelu in [0, 1] {
        let args: [&dyn std::fmt::Display; 4] = [&n, &ff, &gelu, &GLU_THREADS];
        let out = emu.run(&[("gu", bytes_f32(&gu))], &args, &["out"]);
        let t = cpu(&gu, &[n, 2 * ff]);
        let (g, u) = (t.narrow(1, 0, ff).unwrap(), t.narrow(1, ff, ff).unwrap());
        let a = if gelu == 1 {
            g.gelu().unwrap()
        } else {
            g.silu().unwrap()
        };
        let want = (a * u).unwrap();
        assert_close(
            &f32s(&out[0]),
            &flat(&want),
            1e-5,
            &format!("glu, gelu {gelu}"),
        );
    }
}

const ROPE_DRIVER: &str = r#"
int main(int argc, char** argv) {
    const int n = atoi(argv[1]), n_head = atoi(argv[2]), n_kv = atoi(argv[3]), hd = atoi(argv[4]),
              half = atoi(argv[5]), neox = atoi(argv[6]), with_bias = atoi(argv[7]),
              with_norm = atoi(argv[8]), slots = atoi(argv[9]), threads = atoi(argv[11]);
    const float eps = atof(argv[10]);
    auto qkv = emu_read<float>("qkv");
    auto bias = emu_read<float>("bias");
    auto qn = emu_read<float>("qn");
    auto kn = emu_read<float>("kn");
    auto cos = emu_read<float>("cos");
    auto sin = emu_read<float>("sin");
    auto rows = emu_read<unsigned>("rows");
    const int width = (n_head + 2 * n_kv) * hd;
    std::vector<float> q_out((size_t)n * n_head * hd, -7.f);
    std::vector<unsigned short> kc((size_t)slots * n_kv * hd, 0), vc((size_t)slots * n_kv * hd, 0);
    const float* b = with_bias ? bias.data() : nullptr;
    emu_launch({(unsigned)n, (unsigned)(n_head + 2 * n_kv), 1}, threads, [&] {
        rope_store(qkv.data(), qkv.data() + n_head * hd, qkv.data() + (n_head + n_kv) * hd,
                   width, width, width, b, b ? b + n_head * hd : nullptr,
                   b ? b + (n_head + n_kv) * hd : nullptr, with_norm ? qn.data() : nullptr,
                   with_norm ? kn.data() : nullptr, eps, cos.data(), sin.data(), half, neox,
                   rows.data(), q_out.data(), kc.data(), vc.data(), n_head, n_kv, hd);
    });
    emu_write("q", q_out);
    emu_write("k", kc);
    emu_write("v", vc);
}
"#;

/// Q, K and V into place against the tensor path's ops (bias adds, per-head `rms_norm`,
/// candle's `rope` / `rope_i` on `[n, heads, 1, hd]`, f16 conversion, rows written at the
/// tokens' slots, none for a padding row), for both rotations, a partial one, biases and
/// norms.
#[test]
fn rope_and_cache_writes_match_candles_ops() {
    let Some(emu) = Emulator::build("rope", ROPE_DRIVER) else {
        return;
    };
    let (n, n_head, n_kv, slots) = (4usize, 4usize, 2usize, 9usize);
    let eps = 1e-6f32;
    // (a padding row of a bucketed step writes nothing)
    let rows_of = [7u32, 2, UNSEEN, 5];
    for (hd, half, neox, with_bias, with_norm) in [
        (64usize, 32usize, 1, 0, 0),
        (64, 32, 0, 1, 0),
        (256, 128, 1, 0, 1),
        (64, 16, 1, 1, 1),
        (32, 8, 0, 0, 0),
    ] {
        let width = (n_head + 2 * n_kv) * hd;
        let qkv: Vec<f32> = values(n * width, 9).iter().map(|v| v * 4.0).collect();
        let bias = values(width, 10);
        let qn = values(hd, 11);
        let kn = values(hd, 12);
        let angles: Vec<f32> = (0..n * half).map(|i| (i as f32) * 0.37).collect();
        let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
        let args: [&dyn std::fmt::Display; 11] = [
            &n,
            &n_head,
            &n_kv,
            &hd,
            &half,
            &neox,
            &with_bias,
            &with_norm,
            &slots,
            &eps,
            &ROPE_THREADS,
        ];
        let out = emu.run(
            &[
                ("qkv", bytes_f32(&qkv)),
                ("bias", bytes_f32(&bias)),
                ("qn", bytes_f32(&qn)),
                ("kn", bytes_f32(&kn)),
                ("cos", bytes_f32(&cos)),
                ("sin", bytes_f32(&sin)),
                ("rows", bytes_u32(&rows_of)),
            ],
            &args,
            &["q", "k", "v"],
        );
        // the tensor path's steps on candle's CPU device
        let mut t = cpu(&qkv, &[n, width]);
        if with_bias == 1 {
            t = t.broadcast_add(&cpu(&bias, &[width])).unwrap();
        }
        let part = |at: usize, heads: usize| t.narrow(1, at * hd, heads * hd).unwrap();
        let (mut q, mut k, v) = (
            part(0, n_head),
            part(n_head, n_kv),
            part(n_head + n_kv, n_kv),
        );
        if with_norm == 1 {
            let norm = |x: &Tensor, heads: usize, w: &[f32]| {
                let x = x.contiguous().unwrap().reshape((n * heads, hd)).unwrap();
                candle_nn::ops::rms_norm(&x, &cpu(w, &[hd]), eps)
                    .unwrap()
                    .reshape((n, heads * hd))
                    .unwrap()
            };
            q = norm(&q, n_head, &qn);
            k = norm(&k, n_kv, &kn);
        }
        let (ct, st) = (cpu(&cos, &[n, 1, half]), cpu(&sin, &[n, 1, half]));
        let rope = |x: &Tensor, heads: usize| -> Tensor {
            let x = x.contiguous().unwrap().reshape((n, heads, 1, hd)).unwrap();
            let rotate = |x: &Tensor| {
                if neox == 1 {
                    candle_nn::rotary_emb::rope(x, &ct, &st).unwrap()
                } else {
                    candle_nn::rotary_emb::rope_i(x, &ct, &st).unwrap()
                }
            };
            let y = if 2 * half == hd {
                rotate(&x)
            } else {
                let head = rotate(&x.narrow(3, 0, 2 * half).unwrap().contiguous().unwrap());
                Tensor::cat(&[head, x.narrow(3, 2 * half, hd - 2 * half).unwrap()], 3).unwrap()
            };
            y.reshape((n, heads * hd)).unwrap()
        };
        let what = format!(
            "head size {hd}, {half} pairs, neox {neox}, bias {with_bias}, norm {with_norm}"
        );
        assert_close(
            &f32s(&out[0]),
            &flat(&rope(&q, n_head)),
            1e-5,
            &format!("{what}: q"),
        );
        let kv_dim = n_kv * hd;
        for (got, want, name) in [
            (&out[1], rope(&k, n_kv), "k"),
            (&out[2], v.contiguous().unwrap(), "v"),
        ] {
            let want = flat(
                &want
                    .to_dtype(DType::F16)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap(),
            );
            let got = f16s(got);
            let mut expected = vec![0f32; slots * kv_dim];
            for (t, &r) in rows_of.iter().enumerate().filter(|(_, &r)| r != UNSEEN) {
                expected[r as usize * kv_dim..][..kv_dim]
                    .copy_from_slice(&want[t * kv_dim..][..kv_dim]);
            }
            // a value on a rounding boundary may round to the neighbouring half
            assert_close(&got, &expected, 1e-3, &format!("{what}: {name}"));
        }
    }
}

const TOP_DRIVER: &str = r#"
int main(int argc, char** argv) {
    const int rows = atoi(argv[1]), vocab = atoi(argv[2]), window = atoi(argv[3]),
              threads = atoi(argv[4]);
    auto logits = emu_read<float>("logits");
    std::vector<float> out((size_t)rows * 2 * window, -7.f);
    emu_launch({(unsigned)rows, 1, 1}, threads, [&] {
        top_candidates(logits.data(), vocab, window, out.data());
    });
    emu_write("out", out);
}
"#;

/// Each row's best candidates against the host sampler's order (`by_logit` over the whole
/// row), bitwise, and the op's CPU form against the same: rows of few distinct values (ties
/// that the ids decide, down to the selection's last pass), both zeros, both infinities,
/// NaNs of both signs, a row all alike, windows of one entry and of the whole row.
#[test]
fn top_candidates_are_the_samplers_best() {
    use crate::sampler::{by_logit, EDGE_LOGITS as special};
    let Some(emu) = Emulator::build("top", TOP_DRIVER) else {
        return;
    };
    for (vocab, window, levels) in [(1000, 64, 7u64), (700, 17, 300), (64, 64, 3), (300, 1, 40)] {
        let rows = 4;
        let mut s = vocab as u64 * 31 + window as u64;
        let mut next = || {
            lcg(&mut s);
            s >> 33
        };
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|i| match (i / vocab, next() % 16) {
                (0, _) => 1.5,
                (1, 0) => special[next() as usize % special.len()],
                _ => (next() % levels) as f32 / 4.0 - 2.0,
            })
            .collect();
        let threads = super::TOP_THREADS.min(256);
        let args: [&dyn std::fmt::Display; 4] = [&rows, &vocab, &window, &threads];
        let got = f32s(&emu.run(&[("logits", bytes_f32(&logits))], &args, &["out"])[0]);
        let op = super::TopCandidates { window };
        let cpu_form = cpu(&logits, &[rows, vocab]).apply_op1_no_bwd(&op).unwrap();
        let cpu_form = flat(&cpu_form);
        for r in 0..rows {
            let mut want: Vec<(u32, f32)> = logits[r * vocab..][..vocab]
                .iter()
                .enumerate()
                .map(|(i, &v)| (i as u32, v))
                .collect();
            want.sort_by(by_logit);
            want.truncate(window);
            let want: Vec<u32> = want
                .iter()
                .map(|c| (c.0 as f32).to_bits())
                .chain(want.iter().map(|c| c.1.to_bits()))
                .collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let at = r * 2 * window..(r + 1) * 2 * window;
            let what = format!("vocab {vocab}, window {window}, row {r}");
            assert_eq!(bits(&got[at.clone()]), want, "kernel: {what}");
            assert_eq!(bits(&cpu_form[at]), want, "CPU form: {what}");
        }
    }
}
