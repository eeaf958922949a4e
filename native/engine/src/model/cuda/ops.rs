//! The engine's kernels ([`super::SOURCE`]) as candle ops. On a CUDA device each launches its
//! kernel with its tensors' device addresses (a view's first element, its rows' stride), so
//! views of one product's output (Q, K and V; gate and up) are read in place, without the
//! copies that made them contiguous. On candle's CPU device, which the tests use to stand in
//! for a GPU, each runs as Rust loops doing its kernel's arithmetic, so the tensor path's
//! parity tests run with the ops on (the kernels' own source is checked against candle's
//! ops in `emulate.rs`).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Device, Layout, Shape};
use candle_core::{Tensor, WithDType};
use half::f16;

use crate::model::tensor::{scatter_rows, UNSEEN};
use crate::sampler::by_logit;

#[cfg(feature = "cuda")]
use super::{
    ATTN_THREADS, CUDA_PRELUDE, GLU_THREADS, MAX_HEAD_DIM, ROPE_THREADS, ROW_THREADS, TOP_THREADS,
};
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{
    CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
#[cfg(feature = "cuda")]
use candle_core::{CudaStorage, DType, Storage};

/// The rows and columns of a matrix view whose columns are adjacent, and its rows' stride.
fn rows_of(l: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    match (l.dims(), l.stride()) {
        (&[n, c], &[rs, 1]) => Ok((n, c, rs)),
        _ => candle_core::bail!("a kernel's input is not a matrix of adjacent columns"),
    }
}

/// A CPU storage's elements from a view's first one.
fn host<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [T]> {
    Ok(&T::cpu_storage_as_slice(s)?[l.start_offset()..])
}

/// A tensor's elements in row-major order (a copy: the CPU ops are the tests' stand-in).
fn elements<T: WithDType>(t: &Tensor) -> candle_core::Result<Vec<T>> {
    t.flatten_all()?.to_vec1::<T>()
}

/// The root mean square of a row by which candle's `rms_norm` divides (its arithmetic, so
/// that the ops' results are the ops' they replace).
fn rms(row: &[f32], eps: f32) -> f32 {
    (row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32 + eps).sqrt()
}

/// Attention of `q` (`[batch rows, n_head × head_dim]` f32) over the f16 cache rows `k` and
/// `v` (`[slots, n_kv × head_dim]`), for `rows` one-token sequences: `idx` holds the batch
/// row of each sequence's query, then per sequence `l_max` cache rows of its keys
/// ([`UNSEEN`] where it sees none). The result is
/// `[rows, n_head × head_dim]`.
pub(in crate::model) struct DecodeAttention {
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
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (q, k, v) = (
            host::<f32>(q, ql)?,
            host::<f16>(k, kl)?,
            host::<f16>(v, vl)?,
        );
        let idx = elements::<u32>(&self.idx)?;
        let (rows, l_max, hd) = (self.rows, self.l_max, self.head_dim);
        let (n_head, n_kv) = (self.n_head, self.n_kv);
        let kv_row = n_kv * hd;
        let mut out = vec![0f32; rows * n_head * hd];
        let mut p = Vec::with_capacity(l_max);
        for i in 0..rows {
            let slots = &idx[rows + i * l_max..][..l_max];
            for h in 0..n_head {
                let kvh = h / (n_head / n_kv);
                let qr = &q[idx[i] as usize * n_head * hd + h * hd..][..hd];
                p.clear();
                for &slot in slots {
                    if slot == UNSEEN {
                        p.push(f32::NEG_INFINITY);
                        continue;
                    }
                    let kr = &k[slot as usize * kv_row + kvh * hd..][..hd];
                    let dot: f32 = qr.iter().zip(kr).map(|(a, b)| a * b.to_f32()).sum();
                    let mut s = dot * self.scale;
                    if let Some(cap) = self.softcap {
                        s = cap * (s / cap).tanh();
                    }
                    p.push(s);
                }
                let m = p.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let mut l = 0f32;
                for s in p.iter_mut() {
                    *s = if *s == f32::NEG_INFINITY {
                        0.0
                    } else {
                        (*s - m).exp()
                    };
                    l += *s;
                }
                let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
                let o = &mut out[i * n_head * hd + h * hd..][..hd];
                for (&slot, &pj) in slots.iter().zip(&p) {
                    if pj == 0.0 {
                        continue;
                    }
                    let vr = &v[slot as usize * kv_row + kvh * hd..][..hd];
                    for (o, x) in o.iter_mut().zip(vr) {
                        *o += pj * x.to_f32();
                    }
                }
                o.iter_mut().for_each(|o| *o *= inv);
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((rows, n_head * hd))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, l_max) = (self.rows, self.l_max);
        for l in [ql, kl, vl, self.idx.layout()] {
            if !l.is_contiguous() {
                candle_core::bail!("decode attention: a strided input");
            }
        }
        if self.idx.elem_count() != rows * (1 + l_max) || self.head_dim > MAX_HEAD_DIM {
            candle_core::bail!("decode attention: indices or head size out of range");
        }
        let dev = &q.device;
        let stream = dev.cuda_stream();
        let idx = addr(&self.idx, &stream)?;
        let width = self.n_head * self.head_dim;
        // SAFETY: the kernel writes every element (each block its own row's head).
        let out = unsafe { dev.alloc::<f32>(rows * width)? };
        use Arg::*;
        let mut args = vec![
            Ptr(storage_addr::<f32>(q, ql, &stream)?),
            Ptr(idx),
            Ptr(storage_addr::<f16>(k, kl, &stream)?),
            Ptr(storage_addr::<f16>(v, vl, &stream)?),
            Ptr(idx + 4 * rows as u64),
            Ptr(out.device_ptr(&stream).0),
        ];
        args.extend([l_max, self.n_head, self.n_kv, self.head_dim].map(Arg::int));
        args.extend([Float(self.scale), Float(self.softcap.unwrap_or(0.0))]);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, self.n_head as u32, 1),
            block_dim: (ATTN_THREADS, 1, 1),
            // the query, a tile's probabilities, one partial result per warp
            shared_mem_bytes: ((self.head_dim + ATTN_THREADS as usize + 32) * 4) as u32,
        };
        launch(dev, "paged_decode_attn", cfg, &args)?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((rows, width)),
        ))
    }
}

/// The residual step between sublayers of `x` (`[n, d]` f32, contiguous): the result is
/// `[2, n, d]`, `x + o` (`o` RMS-normed by `post` first where given; `x` alone without `o`),
/// then that sum RMS-normed by `w`.
pub(in crate::model) struct ResidualNorm {
    pub o: Option<Tensor>,
    pub post: Option<Tensor>,
    pub w: Tensor,
    pub eps: f32,
}

impl ResidualNorm {
    fn check(&self, xl: &Layout) -> candle_core::Result<(usize, usize)> {
        let (n, d, rs) = rows_of(xl)?;
        if rs != d || self.o.as_ref().is_some_and(|o| o.dims() != [n, d]) {
            candle_core::bail!("residual norm: x or o is not a contiguous [n, d]");
        }
        Ok((n, d))
    }
}

impl CustomOp1 for ResidualNorm {
    fn name(&self) -> &'static str {
        "residual-norm"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, d) = self.check(xl)?;
        let x = host::<f32>(x, xl)?;
        let o = self.o.as_ref().map(elements::<f32>).transpose()?;
        let post = self.post.as_ref().map(elements::<f32>).transpose()?;
        let w = elements::<f32>(&self.w)?;
        let mut out = vec![0f32; 2 * n * d];
        let (sums, normed) = out.split_at_mut(n * d);
        for r in 0..n {
            let at = r * d;
            let y = &mut sums[at..at + d];
            y.copy_from_slice(&x[at..at + d]);
            if let Some(o) = &o {
                let o = &o[at..at + d];
                match &post {
                    Some(p) => {
                        let m = rms(o, self.eps);
                        for ((y, o), p) in y.iter_mut().zip(o).zip(p) {
                            *y += o / m * p;
                        }
                    }
                    None => y.iter_mut().zip(o).for_each(|(y, o)| *y += o),
                }
            }
            let m = rms(y, self.eps);
            for ((h, y), w) in normed[at..at + d].iter_mut().zip(y.iter()).zip(&w) {
                *h = y / m * w;
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((2, n, d))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (n, d) = self.check(xl)?;
        if self.o.as_ref().is_some_and(|o| !o.is_contiguous()) {
            candle_core::bail!("residual norm: o is strided");
        }
        let dev = &x.device;
        let stream = dev.cuda_stream();
        // SAFETY: the kernel writes all `2 × n × d` outputs.
        let out = unsafe { dev.alloc::<f32>(2 * n * d)? };
        use Arg::*;
        let args = [
            Ptr(storage_addr::<f32>(x, xl, &stream)?),
            Ptr(addr_or_null(self.o.as_ref(), &stream)?),
            Ptr(addr_or_null(self.post.as_ref(), &stream)?),
            Ptr(addr(&self.w, &stream)?),
            Ptr(out.device_ptr(&stream).0),
            Arg::int(n),
            Arg::int(d),
            Float(self.eps),
        ];
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 32 * 4,
        };
        launch(dev, "residual_norm", cfg, &args)?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((2, n, d)),
        ))
    }
}

/// A gated unit's activation `act(gate) * up` of two `[n, ff]` views (the halves of one
/// stacked product read in place): SiLU, or GELU's tanh form.
pub(in crate::model) struct Glu {
    pub gelu: bool,
}

impl Glu {
    fn check(gl: &Layout, ul: &Layout) -> candle_core::Result<(usize, usize, usize, usize)> {
        let ((n, ff, gs), (un, uff, us)) = (rows_of(gl)?, rows_of(ul)?);
        if (n, ff) != (un, uff) {
            candle_core::bail!("glu: gate and up differ in shape");
        }
        Ok((n, ff, gs, us))
    }
}

impl CustomOp2 for Glu {
    fn name(&self) -> &'static str {
        "glu"
    }

    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        gl: &Layout,
        u: &CpuStorage,
        ul: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, ff, gs, us) = Self::check(gl, ul)?;
        let (g, u) = (host::<f32>(g, gl)?, host::<f32>(u, ul)?);
        let mut out = Vec::with_capacity(n * ff);
        for r in 0..n {
            for (&g, &u) in g[r * gs..][..ff].iter().zip(&u[r * us..][..ff]) {
                let a = if self.gelu {
                    0.5 * g * (1.0 + (0.797_884_6 * g * (1.0 + 0.044715 * g * g)).tanh())
                } else {
                    g / (1.0 + (-g).exp())
                };
                out.push(a * u);
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((n, ff))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &CudaStorage,
        gl: &Layout,
        u: &CudaStorage,
        ul: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (n, ff, gs, us) = Self::check(gl, ul)?;
        let dev = &g.device;
        let stream = dev.cuda_stream();
        // SAFETY: the kernel writes all `n × ff` outputs.
        let out = unsafe { dev.alloc::<f32>(n * ff)? };
        let mut args = vec![
            Arg::Ptr(storage_addr::<f32>(g, gl, &stream)?),
            Arg::Ptr(storage_addr::<f32>(u, ul, &stream)?),
            Arg::Ptr(out.device_ptr(&stream).0),
        ];
        args.extend([n, ff, gs, us, self.gelu as usize].map(Arg::int));
        let cfg = LaunchConfig {
            grid_dim: ((n * ff).div_ceil(GLU_THREADS as usize) as u32, 1, 1),
            block_dim: (GLU_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        launch(dev, "glu", cfg, &args)?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((n, ff)),
        ))
    }
}

/// Q, K and V of a pass into place (the op's input is Q, `[n, n_head × hd]`; `k` and `v` are
/// views of the same rows' keys and values): biases added, Q and K RMS-normed per head
/// where the family does, rotated by `cos`/`sin` (`[n, 1, half]`), K and V written as halves
/// to the caches' rows `write_rows` (`[n]` u32; none for an [`UNSEEN`] row, a bucketed
/// step's padding) and the rotated Q returned. The caches are written through candle's
/// shared references: they are the context's own.
pub(in crate::model) struct RopeStore {
    pub k: Tensor,
    pub v: Tensor,
    pub bias: Option<[Tensor; 3]>,
    pub norms: Option<(Tensor, Tensor)>,
    pub eps: f32,
    pub cos: Tensor,
    pub sin: Tensor,
    pub neox: bool,
    pub write_rows: Tensor,
    pub k_cache: Tensor,
    pub v_cache: Tensor,
    pub n_head: usize,
    pub n_kv: usize,
    pub head_dim: usize,
}

impl RopeStore {
    /// The tokens, the rotated pairs per head, and the strides of Q, K and V's rows.
    fn check(&self, ql: &Layout) -> candle_core::Result<(usize, usize, [usize; 3])> {
        let hd = self.head_dim;
        let (n, qw, qs) = rows_of(ql)?;
        let (kn, kw, ks) = rows_of(self.k.layout())?;
        let (vn, vw, vs) = rows_of(self.v.layout())?;
        let half = self.cos.dim(2)?;
        let kv_dim = self.n_kv * hd;
        if qw != self.n_head * hd
            || (kn, kw, vn, vw) != (n, kv_dim, n, kv_dim)
            || self.write_rows.dims() != [n]
            || 2 * half > hd
            || self.k_cache.dim(1)? != kv_dim
            || self.v_cache.dim(1)? != kv_dim
        {
            candle_core::bail!("rope store: shapes out of range");
        }
        Ok((n, half, [qs, ks, vs]))
    }

    /// One head's row of a token after bias, norm and rotation, as the kernel makes it.
    #[allow(clippy::too_many_arguments)]
    fn head_row(
        &self,
        src: &[f32],
        bias: Option<&[f32]>,
        norm: Option<&[f32]>,
        rotate: Option<(&[f32], &[f32])>,
        half: usize,
        row: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) {
        let hd = self.head_dim;
        row.clear();
        row.extend(
            src[..hd]
                .iter()
                .enumerate()
                .map(|(d, x)| x + bias.map_or(0.0, |b| b[d])),
        );
        if let Some(w) = norm {
            let m = rms(row, self.eps);
            row.iter_mut().zip(w).for_each(|(x, w)| *x = *x / m * w);
        }
        out.clear();
        out.extend_from_slice(row);
        let Some((cos, sin)) = rotate else {
            return;
        };
        for d in 0..2 * half {
            let (i, first, other) = if self.neox {
                let first = d < half;
                (d % half, first, if first { d + half } else { d - half })
            } else {
                let first = d % 2 == 0;
                (d / 2, first, if first { d + 1 } else { d - 1 })
            };
            let (c, s) = (cos[i], sin[i]);
            out[d] = if first {
                row[d] * c - row[other] * s
            } else {
                row[other] * s + row[d] * c
            };
        }
    }
}

impl CustomOp1 for RopeStore {
    fn name(&self) -> &'static str {
        "rope-store"
    }

    fn cpu_fwd(&self, q: &CpuStorage, ql: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, half, [qs, ..]) = self.check(ql)?;
        let (hd, n_head, n_kv) = (self.head_dim, self.n_head, self.n_kv);
        let q = host::<f32>(q, ql)?;
        let (k, v) = (elements::<f32>(&self.k)?, elements::<f32>(&self.v)?);
        let bias = match &self.bias {
            Some(b) => Some([elements(&b[0])?, elements(&b[1])?, elements(&b[2])?]),
            None => None,
        };
        let norms = match &self.norms {
            Some((qn, kn)) => Some((elements::<f32>(qn)?, elements::<f32>(kn)?)),
            None => None,
        };
        let (cos, sin) = (elements::<f32>(&self.cos)?, elements::<f32>(&self.sin)?);
        let kv_dim = n_kv * hd;
        let mut q_out = Vec::with_capacity(n * n_head * hd);
        let (mut k_out, mut v_out) = (Vec::with_capacity(n * kv_dim), Vec::new());
        let (mut row, mut out) = (Vec::new(), Vec::new());
        for t in 0..n {
            let rot = Some((&cos[t * half..][..half], &sin[t * half..][..half]));
            for h in 0..n_head {
                let b = bias.as_ref().map(|b| &b[0][h * hd..]);
                let w = norms.as_ref().map(|n| &n.0[..]);
                self.head_row(&q[t * qs + h * hd..], b, w, rot, half, &mut row, &mut out);
                q_out.extend_from_slice(&out);
            }
            for h in 0..n_kv {
                let at = t * kv_dim + h * hd;
                let b = bias.as_ref().map(|b| &b[1][h * hd..]);
                let w = norms.as_ref().map(|n| &n.1[..]);
                self.head_row(&k[at..], b, w, rot, half, &mut row, &mut out);
                k_out.extend(out.iter().map(|&x| f16::from_f32(x)));
                let b = bias.as_ref().map(|b| &b[2][h * hd..]);
                self.head_row(&v[at..], b, None, None, half, &mut row, &mut out);
                v_out.extend(out.iter().map(|&x| f16::from_f32(x)));
            }
        }
        // the kernel's stores into the caches, as scatters (none for an UNSEEN row: the
        // padding of a bucketed step)
        let rows = elements::<u32>(&self.write_rows)?;
        let kept: Vec<usize> = (0..n).filter(|&t| rows[t] != UNSEEN).collect();
        let kept_rows: Vec<u32> = kept.iter().map(|&t| rows[t]).collect();
        let index = scatter_rows(&kept_rows, kv_dim).collect();
        let index = Tensor::from_vec(index, (kept.len(), kv_dim), &Device::Cpu)?;
        for (cache, vals) in [(&self.k_cache, k_out), (&self.v_cache, v_out)] {
            let vals = kept
                .iter()
                .flat_map(|&t| vals[t * kv_dim..][..kv_dim].iter().copied())
                .collect();
            cache.scatter_set(
                &index,
                &Tensor::from_vec(vals, (kept.len(), kv_dim), &Device::Cpu)?,
                0,
            )?;
        }
        Ok((CpuStorage::F32(q_out), Shape::from((n, n_head * hd))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, q: &CudaStorage, ql: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (n, half, strides) = self.check(ql)?;
        let hd = self.head_dim;
        let dev = &q.device;
        let stream = dev.cuda_stream();
        let bias = self.bias.as_ref();
        let norms = self.norms.as_ref();
        // SAFETY: the kernel writes all `n × n_head × hd` outputs.
        let out = unsafe { dev.alloc::<f32>(n * self.n_head * hd)? };
        use Arg::*;
        let mut args = vec![
            Ptr(storage_addr::<f32>(q, ql, &stream)?),
            Ptr(addr(&self.k, &stream)?),
            Ptr(addr(&self.v, &stream)?),
        ];
        args.extend(strides.map(Arg::int));
        for i in 0..3 {
            args.push(Ptr(addr_or_null(bias.map(|b| &b[i]), &stream)?));
        }
        args.push(Ptr(addr_or_null(norms.map(|n| &n.0), &stream)?));
        args.push(Ptr(addr_or_null(norms.map(|n| &n.1), &stream)?));
        args.push(Float(self.eps));
        args.extend([
            Ptr(addr(&self.cos, &stream)?),
            Ptr(addr(&self.sin, &stream)?),
        ]);
        args.extend([Arg::int(half), Arg::int(self.neox as usize)]);
        args.extend([
            Ptr(addr(&self.write_rows, &stream)?),
            Ptr(out.device_ptr(&stream).0),
            Ptr(addr(&self.k_cache, &stream)?),
            Ptr(addr(&self.v_cache, &stream)?),
        ]);
        args.extend([self.n_head, self.n_kv, hd].map(Arg::int));
        let cfg = LaunchConfig {
            grid_dim: (n as u32, (self.n_head + 2 * self.n_kv) as u32, 1),
            block_dim: (ROPE_THREADS, 1, 1),
            shared_mem_bytes: ((hd + 32) * 4) as u32,
        };
        launch(dev, "rope_store", cfg, &args)?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((n, self.n_head * hd)),
        ))
    }
}

/// Each row's `window` best entries of `[rows, n_vocab]` logits (contiguous rows) in the
/// host sampler's candidate order ([`by_logit`]: the larger logit as `total_cmp` has it,
/// then the lower id): `[rows, 2 × window]`, per row the ids (as floats, exact below 2^24)
/// then the logits, so that a sampled row's step brings back `2 × window` floats instead of
/// its vocabulary-wide row.
pub(in crate::model) struct TopCandidates {
    pub window: usize,
}

impl TopCandidates {
    fn check(&self, l: &Layout) -> candle_core::Result<(usize, usize)> {
        let (rows, vocab, rs) = rows_of(l)?;
        if rs != vocab || self.window == 0 || self.window > vocab || vocab >= 1 << 24 {
            candle_core::bail!("top candidates: a window past the row, or strided rows");
        }
        Ok((rows, vocab))
    }
}

impl CustomOp1 for TopCandidates {
    fn name(&self) -> &'static str {
        "top-candidates"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, vocab) = self.check(l)?;
        let x = host::<f32>(x, l)?;
        let w = self.window;
        let mut out = Vec::with_capacity(rows * 2 * w);
        let mut cand = Vec::with_capacity(vocab);
        for r in 0..rows {
            cand.clear();
            cand.extend(
                x[r * vocab..][..vocab]
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| (i as u32, v)),
            );
            cand.select_nth_unstable_by(w - 1, by_logit);
            cand.truncate(w);
            cand.sort_unstable_by(by_logit);
            out.extend(cand.iter().map(|c| c.0 as f32));
            out.extend(cand.iter().map(|c| c.1));
        }
        Ok((CpuStorage::F32(out), Shape::from((rows, 2 * w))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, vocab) = self.check(l)?;
        let dev = &x.device;
        let stream = dev.cuda_stream();
        let w = self.window;
        // SAFETY: the kernel writes every row's `2 × window` outputs.
        let out = unsafe { dev.alloc::<f32>(rows * 2 * w)? };
        let args = [
            Arg::Ptr(storage_addr::<f32>(x, l, &stream)?),
            Arg::int(vocab),
            Arg::int(w),
            Arg::Ptr(out.device_ptr(&stream).0),
        ];
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (TOP_THREADS, 1, 1),
            // the digit counts and the selection's state, then the gathered 64-bit keys
            shared_mem_bytes: ((264 + 2 * w) * 4) as u32,
        };
        launch(dev, "top_candidates", cfg, &args)?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((rows, 2 * w)),
        ))
    }
}

/// The kernels' PTX, compiled once per process.
#[cfg(feature = "cuda")]
fn ptx() -> candle_core::Result<&'static str> {
    use candle_core::cuda_backend::cudarc::nvrtc;
    static PTX: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();
    PTX.get_or_init(|| {
        nvrtc::compile_ptx(format!("{CUDA_PRELUDE}\n{}", super::SOURCE))
            .map(|p| p.to_src())
            .map_err(|e| format!("compiling the engine's CUDA kernels: {e:?}"))
    })
    .as_deref()
    .map_err(|e| candle_core::Error::Msg(e.clone()))
}

/// A kernel parameter: a device address, an integer or a float.
#[cfg(feature = "cuda")]
#[derive(Clone, Copy)]
enum Arg {
    Ptr(u64),
    Int(i32),
    Float(f32),
}

#[cfg(feature = "cuda")]
impl Arg {
    fn int(x: usize) -> Self {
        Arg::Int(x as i32)
    }
}

/// Loads kernel `name` (the module is compiled once) and queues it with `args`.
#[cfg(feature = "cuda")]
fn launch(
    dev: &candle_core::CudaDevice,
    name: &str,
    cfg: LaunchConfig,
    args: &[Arg],
) -> candle_core::Result<()> {
    let func = dev.get_or_load_custom_func(name, "llama_cpp_ex_kernels", ptx()?)?;
    let mut b = func.builder();
    for a in args {
        match a {
            Arg::Ptr(p) => b.arg(p),
            Arg::Int(i) => b.arg(i),
            Arg::Float(f) => b.arg(f),
        };
    }
    // SAFETY: each caller pushes the kernel's parameters in order and type, with addresses
    // of live device buffers of the sizes the kernel reads and writes (checked shapes).
    unsafe { b.launch(cfg) }.map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
    Ok(())
}

/// The device address of a storage's element where `l` starts.
#[cfg(feature = "cuda")]
fn storage_addr<T: candle_core::cuda_backend::CudaDType>(
    s: &CudaStorage,
    l: &Layout,
    stream: &CudaStream,
) -> candle_core::Result<u64> {
    let base = s.as_cuda_slice::<T>()?.device_ptr(stream).0;
    Ok(base + (l.start_offset() * std::mem::size_of::<T>()) as u64)
}

/// The device address of `t`'s first element (its view's start).
#[cfg(feature = "cuda")]
fn addr(t: &Tensor, stream: &CudaStream) -> candle_core::Result<u64> {
    let (s, l) = t.storage_and_layout();
    let Storage::Cuda(s) = &*s else {
        candle_core::bail!("a kernel's input is not on the GPU");
    };
    match t.dtype() {
        DType::F32 => storage_addr::<f32>(s, l, stream),
        DType::F16 => storage_addr::<f16>(s, l, stream),
        DType::U32 => storage_addr::<u32>(s, l, stream),
        other => candle_core::bail!("a kernel's input of type {other:?}"),
    }
}

/// [`addr`] of an optional tensor, 0 (a null pointer) for none.
#[cfg(feature = "cuda")]
fn addr_or_null(t: Option<&Tensor>, stream: &CudaStream) -> candle_core::Result<u64> {
    t.map_or(Ok(0), |t| addr(t, stream))
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    /// NVRTC compiles the kernels (no GPU needed: it is a compiler), so a CUDA build's tests
    /// catch a kernel that would only fail when a GPU first loads it.
    #[test]
    fn kernels_compile() {
        let ptx = super::ptx().expect("NVRTC compiles the kernels");
        for name in [
            "paged_decode_attn",
            "residual_norm",
            "glu",
            "rope_store",
            "top_candidates",
        ] {
            assert!(ptx.contains(&format!(".entry {name}")), "{name}: {ptx}");
        }
        // a function NVRTC left to be linked would fail only when a GPU loads the module
        assert!(!ptx.contains(".extern .func"), "{ptx}");
    }
}
