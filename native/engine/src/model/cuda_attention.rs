//! Decode attention on a CUDA device in one kernel launch: each one-token sequence's query
//! heads over the keys and values it sees, read in place from the device cache's rows by
//! their slots (the paged blocks' rows), with an online softmax. The tensor path's gathers,
//! conversions, transposes, products and softmax took about a dozen launches a layer, and a
//! GPU decode step is bound by its launches, not by its bytes.
//!
//! The kernel is compiled from [`SOURCE`] by NVRTC on first use (no CUDA headers: halves
//! are widened with one PTX instruction), so a build needs no `nvcc` of its own.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::cudarc::nvrtc;
use candle_core::{CpuStorage, CudaStorage, CustomOp3, Layout, Shape, Storage, Tensor};
use half::f16;
use std::sync::OnceLock;

/// Threads per block: one key per thread when scoring, one or two output columns per
/// thread when summing values.
const THREADS: u32 = 128;
/// Head dimensions the kernel takes (two output columns per thread at most).
pub(super) const MAX_HEAD_DIM: usize = 2 * THREADS as usize;

/// One block per (sequence, query head); keys in tiles of `blockDim.x`; `UNSEEN` is
/// [`super::tensor::UNSEEN`].
const SOURCE: &str = r#"
#define UNSEEN 0xffffffffu
__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}
// every thread gets the block's maximum (max) or sum (!max) of `v`
__device__ float block_reduce(float v, float* red, bool max) {
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = max ? fmaxf(v, w) : v + w;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < warps; ++w) v = max ? fmaxf(v, red[w]) : v + red[w];
    __syncthreads();
    return v;
}
extern "C" __global__ void paged_decode_attn(
    const float* q, const unsigned int* q_rows,
    const unsigned short* kc, const unsigned short* vc,
    const unsigned int* slots, float* out,
    int l_max, int n_head, int n_kv, int hd, float scale, float softcap)
{
    const float NEG_INF = __int_as_float(0xff800000);
    const int i = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const int kvh = h / (n_head / n_kv);
    const size_t kv_row = (size_t)n_kv * hd;
    extern __shared__ float sh[];
    float* qs = sh;
    float* ps = sh + hd;
    float* red = ps + nt;
    const float* qr = q + (size_t)q_rows[i] * n_head * hd + (size_t)h * hd;
    for (int d = tid; d < hd; d += nt) qs[d] = qr[d];
    __syncthreads();
    const unsigned int* sl = slots + (size_t)i * l_max;
    float m = NEG_INF, l = 0.f, acc0 = 0.f, acc1 = 0.f;
    for (int j0 = 0; j0 < l_max; j0 += nt) {
        const int j = j0 + tid;
        const unsigned int slot = j < l_max ? sl[j] : UNSEEN;
        float s = NEG_INF;
        if (slot != UNSEEN) {
            const unsigned short* kr = kc + (size_t)slot * kv_row + (size_t)kvh * hd;
            float dot = 0.f;
            for (int d = 0; d < hd; ++d) dot += qs[d] * h2f(kr[d]);
            s = dot * scale;
            if (softcap > 0.f) s = softcap * tanhf(s / softcap);
        }
        const float m_new = fmaxf(m, block_reduce(s, red, true));
        const float p = slot != UNSEEN ? expf(s - m_new) : 0.f;
        const float corr = m == NEG_INF ? 0.f : expf(m - m_new);
        l = l * corr + block_reduce(p, red, false);
        m = m_new;
        acc0 *= corr;
        acc1 *= corr;
        ps[tid] = p;
        __syncthreads();
        const int nk = min(nt, l_max - j0);
        // (unrolled: independent loads of several keys' values in flight at once)
#pragma unroll 4
        for (int jj = 0; jj < nk; ++jj) {
            const float pj = ps[jj];
            if (pj == 0.f) continue;
            const unsigned short* vr = vc + (size_t)sl[j0 + jj] * kv_row + (size_t)kvh * hd;
            if (tid < hd) acc0 += pj * h2f(vr[tid]);
            if (tid + nt < hd) acc1 += pj * h2f(vr[tid + nt]);
        }
        __syncthreads();
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    float* o = out + (size_t)i * n_head * hd + (size_t)h * hd;
    if (tid < hd) o[tid] = acc0 * inv;
    if (tid + nt < hd) o[tid + nt] = acc1 * inv;
}
"#;

/// The kernel's PTX, compiled once per process.
fn ptx() -> candle_core::Result<&'static str> {
    static PTX: OnceLock<Result<String, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        nvrtc::compile_ptx(SOURCE)
            .map(|p| p.to_src())
            .map_err(|e| format!("compiling the decode attention kernel: {e:?}"))
    })
    .as_deref()
    .map_err(|e| candle_core::Error::Msg(e.clone()))
}

/// Attention of `q` (`[batch rows, n_head × head_dim]` f32) over the f16 cache rows `k` and
/// `v` (`[slots, n_kv × head_dim]`), for `rows` one-token sequences: `idx` holds the batch
/// row of each sequence's query, then per sequence `l_max` cache rows of its keys
/// ([`super::tensor::UNSEEN`] where it sees none). The result is `[rows, n_head × head_dim]`.
pub(super) struct DecodeAttention {
    pub idx: Tensor,
    pub rows: usize,
    pub l_max: usize,
    pub n_head: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub softcap: Option<f32>,
}

impl CustomOp3 for DecodeAttention {
    fn name(&self) -> &'static str {
        "paged-decode-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("paged decode attention runs on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (idx, il) = self.idx.storage_and_layout();
        let Storage::Cuda(idx) = &*idx else {
            candle_core::bail!("decode attention: its indices are not on the GPU");
        };
        for l in [ql, kl, vl, il] {
            if !l.is_contiguous() {
                candle_core::bail!("decode attention: a strided input");
            }
        }
        let (rows, l_max) = (self.rows, self.l_max);
        if il.shape().elem_count() != rows * (1 + l_max) || self.head_dim > MAX_HEAD_DIM {
            candle_core::bail!("decode attention: indices or head size out of range");
        }
        let dev = &q.device;
        let width = self.n_head * self.head_dim;
        let at = il.start_offset();
        let idx = idx.as_cuda_slice::<u32>()?;
        let q_rows = idx.slice(at..at + rows);
        let slots = idx.slice(at + rows..at + rows * (1 + l_max));
        let qs = q.as_cuda_slice::<f32>()?.slice(ql.start_offset()..);
        let ks = k.as_cuda_slice::<f16>()?.slice(kl.start_offset()..);
        let vs = v.as_cuda_slice::<f16>()?.slice(vl.start_offset()..);
        // SAFETY: the kernel writes every element (each block its own row's head).
        let mut out = unsafe { dev.alloc::<f32>(rows * width)? };
        let func =
            dev.get_or_load_custom_func("paged_decode_attn", "llama_cpp_ex_attention", ptx()?)?;
        let ints = [l_max, self.n_head, self.n_kv, self.head_dim].map(|x| x as i32);
        let softcap = self.softcap.unwrap_or(0.0);
        let mut b = func.builder();
        b.arg(&qs)
            .arg(&q_rows)
            .arg(&ks)
            .arg(&vs)
            .arg(&slots)
            .arg(&mut out);
        for x in &ints {
            b.arg(x);
        }
        b.arg(&self.scale).arg(&softcap);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, self.n_head as u32, 1),
            block_dim: (THREADS, 1, 1),
            // the query, a tile's probabilities, one partial result per warp
            shared_mem_bytes: ((self.head_dim + THREADS as usize + 32) * 4) as u32,
        };
        // SAFETY: the arguments match the kernel's parameters in order and type; `q_rows`
        // name rows of `q` and `slots` rows of the caches (or UNSEEN), as the plan made
        // them; `out` holds `rows × width` floats.
        unsafe { b.launch(cfg) }.map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((rows, width)),
        ))
    }
}

#[cfg(test)]
mod tests {
    /// NVRTC compiles the kernel (no GPU needed: it is a compiler), so a CUDA build's tests
    /// catch a kernel that would only fail when a GPU first runs it.
    #[test]
    fn kernel_compiles() {
        let ptx = super::ptx().expect("NVRTC compiles the kernel");
        assert!(ptx.contains(".entry paged_decode_attn"), "{ptx}");
        // a function NVRTC left to be linked would fail only when a GPU loads the module
        assert!(!ptx.contains(".extern .func"), "{ptx}");
    }
}
