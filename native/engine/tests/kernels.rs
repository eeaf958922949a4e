//! The engine's kernels against a dequantize-then-f32 reference on real weights.

mod common;
use candle_core::Device;
use common::*;
use llama_cpp_ex_engine::gguf::GgufFile;
use llama_cpp_ex_engine::kernels::nibble::NibbleMatrix;
use llama_cpp_ex_engine::kernels::q8::Q8Matrix;

#[test]
fn q8_0_kernel_on_real_weights() {
    let gguf = GgufFile::open(&model_path(SMOLLM2)).unwrap();
    let info = gguf.tensor_info("token_embd.weight").unwrap().clone();
    let (rows, cols) = (info.shape[0], info.shape[1]);
    let bytes = gguf.tensor_bytes(&info);
    // 301 rows (an odd count) from the middle of the vocabulary
    let (start, n_out) = (20_000usize, 301usize);
    let row_bytes = bytes.len() / rows;
    let slice = &bytes[start * row_bytes..(start + n_out) * row_bytes];
    let w = Q8Matrix::from_q8_0_bytes(slice, n_out, cols).unwrap();
    let dense = gguf
        .qtensor("token_embd.weight", &Device::Cpu)
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
        w.matmul(&x, m, &mut out);
        for r in 0..m {
            for o in 0..n_out {
                let exact: f32 = (0..cols)
                    .map(|i| dense[o * cols + i] * x[r * cols + i])
                    .sum();
                let norm: f32 = (0..cols).map(|i| dense[o * cols + i].abs()).sum();
                // activation quantization: at most half a step (|x| ≤ 0.5 → 0.5/127 · 0.5) per term
                let bound = norm * 0.5 / 127.0 * 0.5 + 1e-4;
                let got = out[r * n_out + o];
                assert!(
                    (got - exact).abs() <= bound,
                    "m={m} r={r} o={o}: {got} vs {exact} (bound {bound})"
                );
            }
        }
    }
}

#[test]
fn q4_1_kernel_on_real_weights() {
    let gguf = GgufFile::open(&model_path(SMOLLM2)).unwrap();
    let name = "blk.3.ffn_gate.weight";
    let info = gguf.tensor_info(name).unwrap().clone();
    assert_eq!(format!("{:?}", info.dtype), "Q4_1");
    let (rows, cols) = (info.shape[0], info.shape[1]);
    let bytes = gguf.tensor_bytes(&info);
    let (start, n_out) = (100usize, 203usize);
    let row_bytes = bytes.len() / rows;
    let slice = &bytes[start * row_bytes..(start + n_out) * row_bytes];
    let w = NibbleMatrix::from_q4_1_bytes(slice, n_out, cols).unwrap();
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
    let mut seed = 5u64;
    for m in [1usize, 2, 3, 7, 8, 16, 33, 512] {
        let x: Vec<f32> = (0..m * cols)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect();
        let mut out = vec![0f32; m * n_out];
        w.matmul(&x, m, &mut out);
        for r in 0..m {
            for o in 0..n_out {
                let exact: f32 = (0..cols)
                    .map(|i| dense[o * cols + i] * x[r * cols + i])
                    .sum();
                let norm: f32 = (0..cols).map(|i| dense[o * cols + i].abs()).sum();
                let bound = norm * 0.5 / 127.0 * 0.5 + 1e-4;
                let got = out[r * n_out + o];
                assert!(
                    (got - exact).abs() <= bound,
                    "m={m} r={r} o={o}: {got} vs {exact} (bound {bound})"
                );
            }
        }
    }
}
