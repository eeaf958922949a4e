//! Decode steps replayed as CUDA graphs. Through candle a step is a few hundred kernel
//! launches, each with several microseconds of host work; a graph captured from one step
//! launches them all in one call. A graph replays fixed addresses and shapes, so a step that
//! may replay one runs at its bucket's shapes (the tensor path pads the batch to a power of
//! two and the key counts to a multiple of [`GRAPH_KEY_BUCKET`]: padding rows write no cache
//! row and see no key) and its staged arrays are copied into the buffers the graph was
//! captured with. The first step of a bucket runs eagerly (its result is the step's, and it
//! fills candle's cache of parameter uploads) and is then captured; the next ones replay.
//! A capture that fails leaves its bucket eager.

use candle_core::Tensor;

/// The most rows a replayed step takes (buckets of 1, 2, 4, … rows); larger decode batches
/// run eagerly.
pub(in crate::model) const GRAPH_MAX_ROWS: usize = 64;
/// A replayed step's key counts are rounded up to a multiple of this (the attention kernel
/// skips the padding's slots), so one graph serves that many positions of growth.
pub(in crate::model) const GRAPH_KEY_BUCKET: usize = 256;
/// Graphs kept per context; the one replayed least recently gives way to a new one.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(in crate::model) const GRAPH_CACHE: usize = 32;

/// Whether decode steps replay captured graphs, from `LLAMA_CPP_EX_CUDA_GRAPHS` (`1` or `0`;
/// off by default until a GPU has run the parity tests with it). They need every kernel of
/// [`super::Kernels`]. On candle's CPU device (the tests' stand-in) the steps are bucketed
/// as on a GPU and run eagerly, which checks that padding leaves every row's result as it is.
pub fn graphs_from_env() -> Result<bool, String> {
    static CHOICE: std::sync::OnceLock<Result<bool, String>> = std::sync::OnceLock::new();
    CHOICE
        .get_or_init(|| parse(std::env::var("LLAMA_CPP_EX_CUDA_GRAPHS").ok().as_deref()))
        .clone()
}

fn parse(value: Option<&str>) -> Result<bool, String> {
    match value.map(str::trim) {
        None | Some("" | "0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(format!(
            "LLAMA_CPP_EX_CUDA_GRAPHS: {other:?} is neither 1 nor 0"
        )),
    }
}

/// A context's captured steps, by the signature of their shapes.
#[derive(Default)]
pub(in crate::model) struct StepGraphs {
    #[cfg(feature = "cuda")]
    steps: std::collections::HashMap<Vec<usize>, Step>,
    /// Signatures whose capture failed: those steps stay eager.
    #[cfg(feature = "cuda")]
    failed: std::collections::HashSet<Vec<usize>>,
    /// Where every graph leaves its result, one buffer of `GRAPH_MAX_ROWS` rows per row
    /// shape (greedy ids, best candidates, logits), shared so that a context holds one
    /// logits buffer however many graphs it has; read right after each replay.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    outs: Vec<Tensor>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    tick: u64,
    /// The scratch generation the graphs were captured in ([`scratch_for`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    generation: u64,
}

#[cfg(feature = "cuda")]
pub(in crate::model) use cuda::*;

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use crate::error::{EngineError, Result};
    use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaGraph, DevicePtr};
    use candle_core::cuda_backend::DeviceId;
    use candle_core::{CudaDevice, DType, Storage};
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Per device, how far candle's quantized products have grown their two activation
    /// scratch buffers (in rows times padded widths); and how many times any grew.
    static SCRATCH: std::sync::Mutex<Vec<(DeviceId, [usize; 2])>> =
        std::sync::Mutex::new(Vec::new());
    static GENERATION: AtomicU64 = AtomicU64::new(0);

    /// candle's quantized products quantize their activations into scratch buffers of its
    /// own, one per device for up to 8 rows (`fast_mmvq`) and one for more (`fast_mmq`),
    /// each sized by rows times the padded input width and only growing: a call needing
    /// more frees the buffer and allocates a larger one, and a graph captured before would
    /// then read freed memory. So before a pass of `rows` rows, whose products are at most
    /// `widest` wide, on a device whose steps are captured, `grow` runs the model's products
    /// on that many rows (and on 8, the first buffer's most) unless the device's buffers
    /// have grown as far; a growth starts a new generation, and a context drops the graphs
    /// of an older one before its next replay. The device's passes wait meanwhile (one
    /// stream: the old buffers are freed after the replays already queued).
    pub fn scratch_for(
        cuda: &CudaDevice,
        rows: usize,
        widest: usize,
        grow: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        // (candle pads a product's width to 512)
        let width = widest.div_ceil(512) * 512;
        let need = [8 * width, if rows > 8 { rows * width } else { 0 }];
        let mut grown = SCRATCH.lock().unwrap_or_else(|e| e.into_inner());
        let at = grown.iter().position(|(d, _)| *d == cuda.id());
        let had = at.map_or([0, 0], |i| grown[i].1);
        if need[0] <= had[0] && need[1] <= had[1] {
            return Ok(());
        }
        grow()?;
        let now = [had[0].max(need[0]), had[1].max(need[1])];
        match at {
            Some(i) => grown[i].1 = now,
            None => grown.push((cuda.id(), now)),
        }
        GENERATION.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// One captured step: the buffers its staged arrays are copied into, and its graph.
    pub(in crate::model) struct Step {
        u32s: Option<Tensor>,
        f32s: Option<Tensor>,
        /// The result's shape in its shared buffer.
        back: Vec<usize>,
        graph: Captured,
        used: u64,
    }

    struct Captured(CudaGraph);
    // SAFETY: a graph is the driver's object, usable from any thread with its context bound
    // (cudarc binds it on every call); a context's graphs are used by one thread at a time,
    // the one holding its workspace.
    unsafe impl Send for Captured {}

    fn driver(e: result::DriverError) -> EngineError {
        candle_core::Error::Cuda(Box::new(e)).into()
    }

    /// Copies `v` into `t`'s device memory (its first `v.len()` elements).
    fn copy_into<T: candle_core::cuda_backend::CudaDType + candle_core::WithDType>(
        cuda: &CudaDevice,
        t: &Tensor,
        v: &[T],
    ) -> Result<()> {
        let (s, l) = t.storage_and_layout();
        let Storage::Cuda(s) = &*s else {
            return Err(EngineError::Internal(
                "a graph's buffer is not on the GPU".into(),
            ));
        };
        if t.elem_count() != v.len() || l.start_offset() != 0 {
            return Err(EngineError::Internal(
                "a graph's buffer has another size".into(),
            ));
        }
        let stream = cuda.cuda_stream();
        let (ptr, _sync) = s.as_cuda_slice::<T>()?.device_ptr(&stream);
        // SAFETY: `ptr` addresses `v.len()` elements of `T` (checked above), written in
        // stream order before the replay that reads them; `v` is copied before the call
        // returns (pageable host memory).
        unsafe { result::memcpy_htod_async(ptr, v, stream.cu_stream()) }.map_err(driver)
    }

    /// `pass` captured from the device's stream as an instantiated graph, uploaded.
    fn record(cuda: &CudaDevice, pass: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
        let stream = cuda.cuda_stream();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver)?;
        let ran = pass();
        // (memory the graph allocates is freed before each relaunch)
        let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
        let graph = stream.end_capture(flags).map_err(driver);
        ran?;
        let graph =
            graph?.ok_or_else(|| EngineError::Internal("the capture recorded nothing".into()))?;
        graph.upload().map_err(driver)?;
        Ok(graph)
    }

    impl StepGraphs {
        /// Drops the graphs captured before candle's scratch last grew ([`scratch_for`]).
        fn current(&mut self) {
            let now = GENERATION.load(Ordering::Relaxed);
            if self.generation != now {
                self.steps.clear();
                self.generation = now;
            }
        }

        /// Whether the capture of `key` failed (its steps stay eager).
        pub fn failed(&self, key: &[usize]) -> bool {
            self.failed.contains(key)
        }

        /// Replays the step of signature `key` on `u32s` and `f32s` (the pass's staged
        /// arrays) if one was captured: its result, a view of the shared buffer.
        pub fn replay(
            &mut self,
            cuda: &CudaDevice,
            key: &[usize],
            u32s: &[u32],
            f32s: &[f32],
        ) -> Result<Option<Tensor>> {
            self.tick += 1;
            self.current();
            let Some(step) = self.steps.get_mut(key) else {
                return Ok(None);
            };
            step.used = self.tick;
            if let Some(t) = &step.u32s {
                copy_into(cuda, t, u32s)?;
            }
            if let Some(t) = &step.f32s {
                copy_into(cuda, t, f32s)?;
            }
            step.graph.0.launch().map_err(driver)?;
            let out = self
                .outs
                .iter()
                .find(|o| o.dims()[1..] == step.back[1..])
                .ok_or_else(|| EngineError::Internal("a graph without its output".into()))?;
            Ok(Some(out.narrow(0, 0, step.back[0])?))
        }

        /// Captures `pass` (the step's device work, whose result is `back`'s shape) as the
        /// graph of `key`, reading its arrays from `u32s` and `f32s` (kept as its buffers).
        /// A failed capture marks `key` so that its steps stay eager, and is not an error:
        /// this step's result came from its eager pass.
        pub fn capture(
            &mut self,
            cuda: &CudaDevice,
            key: Vec<usize>,
            (u32s, f32s): (Option<Tensor>, Option<Tensor>),
            back: &Tensor,
            pass: impl FnOnce() -> Result<Tensor>,
        ) -> Result<()> {
            self.current();
            let dims = back.dims().to_vec();
            if dims.is_empty() || dims.len() > 2 || dims[0] > GRAPH_MAX_ROWS {
                self.failed.insert(key);
                return Ok(());
            }
            let out = match self.outs.iter().find(|o| o.dims()[1..] == dims[1..]) {
                Some(o) => o.clone(),
                None => {
                    let mut shape = dims.clone();
                    shape[0] = GRAPH_MAX_ROWS;
                    let o = Tensor::zeros(shape, DType::F32, back.device())?;
                    self.outs.push(o.clone());
                    o
                }
            };
            let graph = match record(cuda, || pass().and_then(|b| Ok(out.slice_set(&b, 0, 0)?))) {
                Ok(g) => g,
                Err(e) => {
                    // (said once per process: the switch is opt-in, and a GPU session's
                    // logs should say why its steps stayed eager)
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| {
                        eprintln!("llama_cpp_ex: a decode step's CUDA graph capture failed, steps of its shape stay eager: {e}")
                    });
                    self.failed.insert(key);
                    return Ok(());
                }
            };
            if self.steps.len() >= GRAPH_CACHE {
                let oldest = self
                    .steps
                    .iter()
                    .min_by_key(|(_, s)| s.used)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    self.steps.remove(&k);
                }
            }
            self.steps.insert(
                key,
                Step {
                    u32s,
                    f32s,
                    back: dims,
                    graph: Captured(graph),
                    used: self.tick,
                },
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_graph_switch_takes_one_or_zero() {
        assert_eq!(super::parse(None), Ok(false));
        assert_eq!(super::parse(Some("0")), Ok(false));
        assert_eq!(super::parse(Some("1")), Ok(true));
        let err = super::parse(Some("yes")).unwrap_err();
        assert!(err.contains("\"yes\""), "{err}");
    }
}
