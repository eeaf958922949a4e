//! Whether a decode step written with candle's CUDA ops can be captured as one CUDA graph,
//! and what that saves: a stack of layers at Llama 3.2 1B shapes (random Q4_K weights, a
//! Q6_K head, attention over 128 cached f16 keys with the tensor path's ops) run eagerly and
//! replayed from a graph, both timed per step (a step ends with its result copied back, as a
//! decode step does).
//!
//!     cargo run --release --features cuda --example graph_probe -- [LAYERS] [STEPS]
//!
//! Prints the eager and the replayed step time, the graph's node count and how many logits
//! differ between the two results (0 when the replay computes what the eager run did). A
//! CPU build runs the eager step alone on the CPU, a check of the probe's shapes.

fn main() {
    if let Err(e) = probe::run() {
        eprintln!("graph_probe: {e}");
        std::process::exit(1);
    }
}

mod probe {
    #[cfg(feature = "cuda")]
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QMatMul};
    use candle_core::{DType, Device, Module, Result, Tensor};
    use half::f16;
    use std::time::Instant;

    const D: usize = 2048;
    const FF: usize = 8192;
    const HEADS: usize = 32;
    const KV_HEADS: usize = 8;
    const HD: usize = 64;
    const VOCAB: usize = 49152;
    const KEYS: usize = 128;

    fn lcg(s: &mut u64) -> u64 {
        *s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *s >> 33
    }

    /// A `[rows, cols]` matrix of random blocks with small finite scales.
    fn matrix(
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        seed: &mut u64,
        dev: &Device,
    ) -> Result<QMatMul> {
        let (block, scale_at): (usize, &[usize]) = match dtype {
            GgmlDType::Q4K => (144, &[0, 2]),
            GgmlDType::Q6K => (210, &[208]),
            _ => unreachable!("Q4_K and Q6_K only"),
        };
        let mut bytes: Vec<u8> = (0..rows * cols / 256 * block)
            .map(|_| lcg(seed) as u8)
            .collect();
        let small = f16::from_f32(1e-5).to_le_bytes();
        for b in bytes.chunks_mut(block) {
            for &at in scale_at {
                b[at..at + 2].copy_from_slice(&small);
            }
        }
        QMatMul::from_qtensor(qtensor_from_ggml(dtype, &bytes, vec![rows, cols], dev)?)
    }

    struct Layer {
        norm: Tensor,
        qkv: QMatMul,
        wo: QMatMul,
        gate: QMatMul,
        up: QMatMul,
        down: QMatMul,
        k: Tensor,
        v: Tensor,
    }

    struct Net {
        layers: Vec<Layer>,
        head: QMatMul,
        cos: Tensor,
        sin: Tensor,
        slots: Tensor,
        write: Tensor,
    }

    impl Net {
        /// One decode step of one token: every layer, then the head's logits.
        fn step(&self, x: &Tensor) -> Result<Tensor> {
            let kv = KV_HEADS * HD;
            let mut x = x.clone();
            for l in &self.layers {
                let h = candle_nn::ops::rms_norm(&x, &l.norm, 1e-5)?;
                let qkv = l.qkv.forward(&h)?;
                let q = qkv.narrow(1, 0, D)?.contiguous()?;
                let k = qkv.narrow(1, D, kv)?.contiguous()?;
                let v = qkv.narrow(1, D + kv, kv)?.contiguous()?;
                let q = candle_nn::rotary_emb::rope_i(
                    &q.reshape((1, HEADS, 1, HD))?,
                    &self.cos,
                    &self.sin,
                )?;
                let k = candle_nn::rotary_emb::rope_i(
                    &k.reshape((1, KV_HEADS, 1, HD))?,
                    &self.cos,
                    &self.sin,
                )?;
                // caches head-major ([kv heads, rows, hd]): a gather along the rows is then
                // already in the products' layout, without the tensor path's transposing
                // copies (two `ucopy` kernels a layer)
                let k = k.reshape((KV_HEADS, 1, HD))?.to_dtype(DType::F16)?;
                let v = v.reshape((KV_HEADS, 1, HD))?.to_dtype(DType::F16)?;
                l.k.scatter_set(&self.write, &k, 1)?;
                l.v.scatter_set(&self.write, &v, 1)?;
                let ratio = HEADS / KV_HEADS;
                let qs = q.reshape((KV_HEADS, ratio, HD))?;
                let gather = |c: &Tensor| -> Result<Tensor> {
                    c.index_select(&self.slots, 1)?.to_dtype(DType::F32)
                };
                let (ks, vs) = (gather(&l.k)?, gather(&l.v)?);
                let scores = (qs.matmul(&ks.t()?)? * 0.125)?;
                let probs = candle_nn::ops::softmax_last_dim(&scores)?;
                let attn = probs.matmul(&vs)?.reshape((1, D))?;
                x = (x + l.wo.forward(&attn)?)?;
                let h = candle_nn::ops::rms_norm(&x, &l.norm, 1e-5)?;
                let act = (l.gate.forward(&h)?.silu()? * l.up.forward(&h)?)?;
                x = (x + l.down.forward(&act)?)?;
            }
            self.head.forward(&x)
        }
    }

    pub fn run() -> std::result::Result<(), Box<dyn std::error::Error>> {
        let mut args = std::env::args().skip(1);
        let n_layers: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(16);
        let steps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(100);
        let dev = if cfg!(feature = "cuda") {
            Device::new_cuda(0)?
        } else {
            Device::Cpu
        };
        let seed = &mut 7u64;
        let kv = KV_HEADS * HD;
        let mut layers = Vec::with_capacity(n_layers);
        for _ in 0..n_layers {
            layers.push(Layer {
                norm: Tensor::ones(D, DType::F32, &dev)?,
                qkv: matrix(GgmlDType::Q4K, D + 2 * kv, D, seed, &dev)?,
                wo: matrix(GgmlDType::Q4K, D, D, seed, &dev)?,
                gate: matrix(GgmlDType::Q4K, FF, D, seed, &dev)?,
                up: matrix(GgmlDType::Q4K, FF, D, seed, &dev)?,
                down: matrix(GgmlDType::Q4K, D, FF, seed, &dev)?,
                k: Tensor::randn(0f32, 1.0, (KV_HEADS, 4096, HD), &dev)?.to_dtype(DType::F16)?,
                v: Tensor::randn(0f32, 1.0, (KV_HEADS, 4096, HD), &dev)?.to_dtype(DType::F16)?,
            });
        }
        let net = Net {
            layers,
            head: matrix(GgmlDType::Q6K, VOCAB, D, seed, &dev)?,
            cos: Tensor::ones((1, 1, HD / 2), DType::F32, &dev)?,
            sin: Tensor::zeros((1, 1, HD / 2), DType::F32, &dev)?,
            slots: Tensor::from_iter((0..KEYS as u32).map(|i| i * 3), &dev)?,
            write: Tensor::from_iter(std::iter::repeat_n(KEYS as u32 * 3, kv), &dev)?
                .reshape((KV_HEADS, 1, HD))?,
        };
        let x = Tensor::randn(0f32, 1.0, (1, D), &dev)?;

        // eager: a step's ops, then its logits back to the host
        let mut eager = Vec::new();
        for _ in 0..3 {
            eager = net.step(&x)?.flatten_all()?.to_vec1::<f32>()?;
        }
        let t = Instant::now();
        for _ in 0..steps {
            eager = net.step(&x)?.flatten_all()?.to_vec1::<f32>()?;
        }
        let eager_ms = t.elapsed().as_secs_f64() * 1e3 / steps as f64;
        println!(
            "eager: {eager_ms:.3} ms a step ({:.0} steps/s), {n_layers} layers",
            1e3 / eager_ms
        );

        let finite = eager.iter().filter(|v| v.is_finite()).count();
        println!("eager logits: {finite} of {} finite", eager.len());
        #[cfg(feature = "cuda")]
        replay(&net, &x, &dev, steps, &eager, eager_ms)?;
        Ok(())
    }

    /// The same step captured: its result lands in a tensor allocated before the capture.
    #[cfg(feature = "cuda")]
    fn replay(
        net: &Net,
        x: &Tensor,
        dev: &Device,
        steps: usize,
        eager: &[f32],
        eager_ms: f64,
    ) -> std::result::Result<(), Box<dyn std::error::Error>> {
        let out = Tensor::zeros((1, VOCAB), DType::F32, dev)?;
        let cuda = dev.as_cuda_device()?;
        // SAFETY: every tensor of the probe lives on this one stream, so no cross-stream
        // event is needed; events recorded before a capture cannot be waited on inside it
        unsafe { cuda.disable_event_tracking() };
        let stream = cuda.cuda_stream();
        // many of candle's ops upload their operands' dims and strides from host memory; a
        // graph would replay those copies from freed host buffers (an illegal address on
        // the H200). With this cache on, each upload is kept in device memory by its bytes,
        // and a capture reuses the copy one eager step made (a miss fails the capture).
        let _htod_cache = cuda.enable_cuda_graph_htod_cache();
        net.step(x)?;
        dev.synchronize()?;
        let t = Instant::now();
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let captured = net.step(x).and_then(|logits| out.slice_set(&logits, 0, 0));
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        captured?;
        let graph = graph?.ok_or("the capture recorded nothing")?;
        let mut nodes = 0usize;
        // SAFETY: a count query on a graph the probe owns
        let _ = unsafe { sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut nodes) };
        println!(
            "captured {nodes} nodes in {:.1} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        graph.upload()?;
        let mut replayed = Vec::new();
        for _ in 0..3 {
            graph.launch()?;
            replayed = out.flatten_all()?.to_vec1::<f32>()?;
        }
        let t = Instant::now();
        for _ in 0..steps {
            graph.launch()?;
            replayed = out.flatten_all()?.to_vec1::<f32>()?;
        }
        let graph_ms = t.elapsed().as_secs_f64() * 1e3 / steps as f64;
        // bitwise, so that non-finite logits compare too
        let differ = eager
            .iter()
            .zip(&replayed)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        println!(
            "graph: {graph_ms:.3} ms a step ({:.0} steps/s), {:.2}x eager; {differ} logits differ from the eager step's",
            1e3 / graph_ms,
            eager_ms / graph_ms
        );
        Ok(())
    }
}
