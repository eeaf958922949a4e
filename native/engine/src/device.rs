//! Where a model computes: the engine's own CPU kernels, or candle's tensors on a device (an
//! NVIDIA GPU in a build with the `cuda` feature).
//!
//! The choice is made once, at load ([`Backend::select`]), from the contract's
//! `n_gpu_layers` and `main_gpu`; everything above the model (context, KV block tables,
//! samplers, the step) is the same on every backend. A further backend (Metal) would be one
//! more [`Backend::Tensor`] device and its build feature.

use crate::error::{EngineError, Result};
use candle_core::{Device, DeviceLocation};

/// The compute backend of a loaded model.
#[derive(Debug, Clone, Default)]
pub enum Backend {
    /// The engine's own kernels on the CPU's SIMD units.
    #[default]
    Cpu,
    /// The decoder's forward on candle tensors on this device, with the KV cache's contents
    /// in its memory. A CUDA GPU in production; candle's CPU device runs the same code in the
    /// engine's tests, which is how the path is checked on machines without a GPU.
    Tensor(Device),
}

/// How a load picks its backend.
#[derive(Debug, Clone)]
pub enum Placement {
    /// The contract's options, see [`Backend::select`].
    Layers { n_gpu_layers: i64, main_gpu: usize },
    /// A backend named by the caller (the engine's tests run [`Backend::Tensor`] on the CPU).
    Backend(Backend),
}

impl Default for Placement {
    fn default() -> Self {
        Placement::Backend(Backend::Cpu)
    }
}

/// Copies between host and device memory that a context's forward passes made, counted so
/// that tests can hold them to their number: on a GPU each is a synchronous driver call.
/// A pass sends its staged inputs in at most two copies (`u32` indices, `f32` values) and
/// brings back, in one copy, the logits rows it computed (only the token id of a row that
/// feeds a greedy choice), and the embedding rows asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceCopies {
    pub to_device: usize,
    pub to_host: usize,
    /// Bytes of the copies to the host.
    pub bytes_to_host: usize,
    /// Passes run at a bucket's shapes: decode steps that may replay a CUDA graph
    /// (`LLAMA_CPP_EX_CUDA_GRAPHS=1`).
    pub bucketed: usize,
    /// Of those, the passes a captured graph replayed (on a GPU).
    pub replayed: usize,
}

/// One GPU the engine can run on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    pub index: usize,
    pub name: String,
    pub memory_total: u64,
    pub memory_free: u64,
}

/// Whether this build carries a GPU backend (the `cuda` feature).
pub const fn gpu_built() -> bool {
    cfg!(feature = "cuda")
}

/// The GPUs this process can use: none in a CPU build, or when no driver or device answers.
pub fn gpus() -> Vec<GpuInfo> {
    #[cfg(feature = "cuda")]
    {
        cuda::gpus()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Vec::new()
    }
}

impl Backend {
    /// The backend for the contract's placement options: `n_gpu_layers` 0 (or no GPU, or a
    /// CPU build) → the CPU; every layer (`n_gpu_layers` ≥ the model's layers, or negative, as
    /// llama.cpp's `-1`) → `main_gpu`. Part of the layers is an error: splitting a model
    /// between host and device is not implemented, and running it wholly on either would not
    /// be what was asked.
    pub fn select(n_gpu_layers: i64, main_gpu: usize, n_layer: usize) -> Result<Backend> {
        if n_gpu_layers == 0 {
            return Ok(Backend::Cpu);
        }
        let gpus = gpus();
        if gpus.is_empty() {
            return Ok(Backend::Cpu);
        }
        if main_gpu >= gpus.len() {
            return Err(EngineError::InvalidArgument(format!(
                "main_gpu {main_gpu}: this machine has {} GPU(s)",
                gpus.len()
            )));
        }
        if n_gpu_layers > 0 && (n_gpu_layers as usize) < n_layer {
            return Err(EngineError::Unsupported(format!(
                "n_gpu_layers {n_gpu_layers} of {n_layer}: a model runs wholly on the GPU \
                 (n_gpu_layers >= {n_layer} or -1) or wholly on the CPU (0)"
            )));
        }
        Self::gpu(main_gpu)
    }

    /// The backend of GPU `ordinal`.
    pub fn gpu(ordinal: usize) -> Result<Backend> {
        #[cfg(feature = "cuda")]
        {
            let device = Device::new_cuda(ordinal).map_err(|e| EngineError::Load {
                path: format!("cuda:{ordinal}"),
                reason: e.to_string(),
            })?;
            if let Device::Cuda(cuda) = &device {
                // SAFETY: the engine issues all of a device's work on candle's one stream,
                // so no use needs an event to order it against another stream; with
                // tracking on, each allocation (every op's output) creates two events.
                unsafe { cuda.disable_event_tracking() };
            }
            Ok(Backend::Tensor(device))
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(EngineError::Unsupported(format!(
                "GPU {ordinal}: this build has no GPU backend (build with LLAMA_BACKEND=cuda)"
            )))
        }
    }

    /// The device's name as `LlamaCppEx.devices/0` lists it: "CPU", "CUDA0", …
    pub fn name(&self) -> String {
        match self {
            Backend::Cpu => "CPU".into(),
            Backend::Tensor(d) => match d.location() {
                DeviceLocation::Cpu => "CPU (tensors)".into(),
                DeviceLocation::Cuda { gpu_id } => format!("CUDA{gpu_id}"),
                DeviceLocation::Metal { gpu_id } => format!("Metal{gpu_id}"),
            },
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::GpuInfo;
    use candle_core::cuda_backend::cudarc::driver::{result, CudaContext};

    pub(super) fn gpus() -> Vec<GpuInfo> {
        // the stub libcuda of a GPU-less build machine (and a host without a driver) fails here
        if result::init().is_err() {
            return Vec::new();
        }
        let n = CudaContext::device_count().unwrap_or(0).max(0) as usize;
        (0..n)
            .filter_map(|i| {
                // the primary context: the one candle's device for this ordinal uses as well
                let ctx = CudaContext::new(i).ok()?;
                let name = ctx.name().ok()?;
                let memory_total = ctx.total_mem().ok()? as u64;
                let (free, _) = ctx.mem_get_info().ok()?;
                Some(GpuInfo {
                    index: i,
                    name,
                    memory_total,
                    memory_free: free as u64,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_options_pick_the_cpu_without_a_gpu() {
        if !gpus().is_empty() {
            return;
        }
        for n in [0, 1, 16, 99, -1] {
            assert!(matches!(Backend::select(n, 0, 16).unwrap(), Backend::Cpu));
        }
        // a GPU index is only checked against GPUs that exist
        assert!(matches!(Backend::select(99, 3, 16).unwrap(), Backend::Cpu));
    }
}
