//! The engine's kernels against a dequantize-then-f32 reference on real weights.

mod common;
use candle_core::Device;
use common::*;
use llama_cpp_ex_engine::gguf::GgufFile;
use llama_cpp_ex_engine::kernels::kquant::KQuant;
use llama_cpp_ex_engine::kernels::packed::{PackedMatrix, PackedType};

/// Rows `start..start + n_out` of a real matrix through `matmul` (built from the rows' raw
/// bytes) against candle's dequantized f32 values, for the batch sizes the issue lists.
fn check_real_rows(
    file: &str,
    name: &str,
    start: usize,
    n_out: usize,
    matmul: impl Fn(&[u8], usize, usize) -> Box<dyn Fn(&[f32], usize, &mut [f32])>,
) {
    let gguf = GgufFile::open(&model_path(file)).unwrap();
    let info = gguf.tensor_info(name).unwrap().clone();
    let (rows, cols) = (info.shape[0], info.shape[1]);
    let bytes = gguf.tensor_bytes(&info);
    let row_bytes = bytes.len() / rows;
    let run = matmul(
        &bytes[start * row_bytes..(start + n_out) * row_bytes],
        n_out,
        cols,
    );
    let dense = gguf
        .qtensor(name, &Device::Cpu)
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap()
        .narrow(0, start, n_out)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let mut seed = 1u64;
    for m in [1usize, 2, 3, 7, 8, 16, 33, 512] {
        let x: Vec<f32> = (0..m * cols)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect();
        let mut out = vec![0f32; m * n_out];
        run(&x, m, &mut out);
        for r in 0..m {
            for o in 0..n_out {
                let w = &dense[o * cols..(o + 1) * cols];
                let exact: f32 = (0..cols).map(|i| w[i] * x[r * cols + i]).sum();
                let norm: f32 = w.iter().map(|v| v.abs()).sum();
                // activation quantization: at most half a step (|x| ≤ 0.5 → 0.5/127 · 0.5) per term
                let bound = norm * 0.5 / 127.0 * 0.5 + 1e-4;
                let got = out[r * n_out + o];
                assert!(
                    (got - exact).abs() <= bound,
                    "{name} m={m} r={r} o={o}: {got} vs {exact} (bound {bound})"
                );
            }
        }
    }
}

#[test]
fn interleaved_q8_0_kernel_on_real_weights() {
    // the layout every Q8_0 matrix (the tied embeddings of both models) uses
    check_real_rows(SMOLLM2, "token_embd.weight", 30_000, 203, |b, n, k| {
        let w = PackedMatrix::from_bytes(PackedType::Q8_0, b, n, k).unwrap();
        Box::new(move |x, m, out| w.matmul(x, m, out))
    });
}

#[test]
fn q4_1_kernel_on_real_weights() {
    check_real_rows(SMOLLM2, "blk.3.ffn_gate.weight", 100, 203, |b, n, k| {
        let w = PackedMatrix::from_bytes(PackedType::Q4_1, b, n, k).unwrap();
        Box::new(move |x, m, out| w.matmul(x, m, out))
    });
}

#[test]
fn q5_0_kernel_on_real_weights() {
    let gguf = GgufFile::open(&model_path(GEMMA3)).unwrap();
    let mut q5: Vec<&String> = gguf
        .tensors
        .iter()
        .filter(|(n, t)| n.starts_with("blk.") && format!("{:?}", t.dtype) == "Q5_0")
        .map(|(n, _)| n)
        .collect();
    q5.sort();
    let name = q5
        .first()
        .expect("Gemma 3 Q4_K_M has Q5_0 matrices")
        .to_string();
    check_real_rows(GEMMA3, &name, 7, 97, |b, n, k| {
        let w = PackedMatrix::from_bytes(PackedType::Q5_0, b, n, k).unwrap();
        Box::new(move |x, m, out| w.matmul(x, m, out))
    });
}

#[test]
fn k_quant_kernels_on_real_weights() {
    // Gemma 3 Q4_K_M keeps attn_output in Q4_K and splits ffn_down between Q6_K and Q4_K
    for (name, kind, dtype) in [
        ("blk.0.attn_output.weight", KQuant::Q4K, "Q4K"),
        ("blk.0.ffn_down.weight", KQuant::Q6K, "Q6K"),
        ("blk.2.ffn_down.weight", KQuant::Q4K, "Q4K"),
    ] {
        let gguf = GgufFile::open(&model_path(GEMMA3)).unwrap();
        let info = gguf.tensor_info(name).unwrap();
        assert_eq!(format!("{:?}", info.dtype), dtype, "{name}");
        check_real_rows(GEMMA3, name, 5, 101, move |b, n, k| {
            let w = PackedMatrix::from_k_quant(kind, b, n, k).unwrap();
            Box::new(move |x, m, out| w.matmul(x, m, out))
        });
    }
}

#[test]
#[cfg(target_arch = "x86_64")]
fn tied_embedding_rows_come_back_exactly_from_the_output_head() {
    use llama_cpp_ex_engine::model::linear::{Embedding, Linear};
    use std::sync::Arc;
    // both models tie their output head to a Q8_0 token embedding
    for file in [SMOLLM2, GEMMA3] {
        let gguf = GgufFile::open(&model_path(file)).unwrap();
        let table = Arc::new(gguf.qtensor("token_embd.weight", &Device::Cpu).unwrap());
        let head = Arc::new(Linear::from_arc(table.clone()).unwrap());
        let tied = Embedding::new(table.clone(), Some(&head));
        assert!(
            matches!(tied, Embedding::Tied(_)),
            "{file}: the output head's kernel gives rows back"
        );
        let tokens = [0u32, 1, 2, 17, 1000, head.n_out as u32 - 1];
        let want = Embedding::Table(table).lookup(&tokens).unwrap();
        assert_eq!(tied.lookup(&tokens).unwrap(), want, "{file}");
        assert!(tied.lookup(&[head.n_out as u32]).is_err());
    }
}
