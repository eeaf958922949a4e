//! Weight matrices applied to activations: `Linear` (one matrix, on the engine's own packed
//! kernels or candle's), `FusedLinear` (stacked Q/K/V or gate/up products in one pass) and
//! the token `Embedding` table (its own rows, or the tied output head's).

use super::ops::{sized, sized_for_overwrite};
use crate::error::Result;
use crate::kernels::kquant::KQuant;
use crate::kernels::packed::{PackedMatrix, PackedType, MAX_PARTS};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use std::sync::{Arc, OnceLock};

/// A weight matrix `[out, in]` applied to row-major activations `[m, in]`: the engine's own
/// kernels for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights on x86_64 CPUs,
/// candle's `QMatMul` otherwise (other types, other targets, CUDA).
pub struct Linear {
    kernel: Kernel,
    pub n_in: usize,
    pub n_out: usize,
    pub dtype: GgmlDType,
}

enum Kernel {
    Candle(QMatMul),
    Packed(PackedMatrix),
}

/// Whether products run on the engine's own kernels: on x86_64 (their SIMD paths, or the
/// portable one under `LLAMA_CPP_EX_SIMD=scalar`), unless `LLAMA_CPP_EX_KERNELS=candle` asks
/// for candle's (comparisons). Other targets use candle's, which have NEON paths where ours
/// would be scalar.
pub(crate) fn own_kernels_enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| {
        cfg!(target_arch = "x86_64")
            && std::env::var("LLAMA_CPP_EX_KERNELS").map_or(true, |v| v != "candle")
    })
}

impl Linear {
    pub fn new(t: QTensor) -> Result<Self> {
        Self::from_arc(Arc::new(t))
    }

    /// From shared weights (an output head tied to the token embedding).
    pub fn from_arc(t: Arc<QTensor>) -> Result<Self> {
        let (n_out, n_in) = t.shape().dims2()?;
        if t.device().is_cpu() {
            if let Some(own) = Self::from_file_bytes(t.dtype(), &t.data()?, n_out, n_in) {
                return Ok(own);
            }
        }
        Ok(Linear {
            dtype: t.dtype(),
            kernel: Kernel::Candle(QMatMul::from_arc(t)?),
            n_in,
            n_out,
        })
    }

    /// The engine's own CPU kernel for ggml block bytes of `dtype` (e.g. straight from the
    /// file's mapping); `None` for types it does not cover or when they are turned off.
    pub fn from_file_bytes(
        dtype: GgmlDType,
        bytes: &[u8],
        n_out: usize,
        n_in: usize,
    ) -> Option<Self> {
        Self::from_file_bytes_releasing(dtype, bytes, n_out, n_in, &|_| {})
    }

    /// [`Linear::from_file_bytes`], handing each converted run of rows of `bytes` to
    /// `release` ([`PackedMatrix::build`]), so a large matrix read from a mapping (a 262k-row
    /// output head) is never resident in both layouts at once.
    pub fn from_file_bytes_releasing(
        dtype: GgmlDType,
        bytes: &[u8],
        n_out: usize,
        n_in: usize,
        release: crate::kernels::packed::Release,
    ) -> Option<Self> {
        if !own_kernels_enabled() || n_out == 0 || !bytes.len().is_multiple_of(n_out) {
            return None;
        }
        let nibble = |kind| {
            PackedMatrix::from_bytes_releasing(kind, bytes, n_out, n_in, release)
                .map(Kernel::Packed)
        };
        let k_quant = |kind| {
            PackedMatrix::from_k_quant_releasing(kind, bytes, n_out, n_in, release)
                .map(Kernel::Packed)
        };
        let kernel = match dtype {
            GgmlDType::Q8_0 => nibble(PackedType::Q8_0),
            GgmlDType::Q4_0 => nibble(PackedType::Q4_0),
            GgmlDType::Q4_1 => nibble(PackedType::Q4_1),
            GgmlDType::Q5_0 => nibble(PackedType::Q5_0),
            GgmlDType::Q5_1 => nibble(PackedType::Q5_1),
            GgmlDType::Q4K => k_quant(KQuant::Q4K),
            GgmlDType::Q5K => k_quant(KQuant::Q5K),
            GgmlDType::Q6K => k_quant(KQuant::Q6K),
            _ => None,
        }?;
        Some(Linear {
            kernel,
            n_in,
            n_out,
            dtype,
        })
    }

    /// The matrix in the engine's layout, when it runs on the engine's kernels.
    fn packed(&self) -> Option<&PackedMatrix> {
        match &self.kernel {
            Kernel::Packed(m) => Some(m),
            Kernel::Candle(_) => None,
        }
    }

    /// The matrix in the engine's layout, for [`crate::kernels::weights::pin`].
    pub(crate) fn packed_mut(&mut self) -> Option<&mut PackedMatrix> {
        match &mut self.kernel {
            Kernel::Packed(m) => Some(m),
            Kernel::Candle(_) => None,
        }
    }

    /// Moves this matrix's weights into huge pages on its own (see
    /// [`crate::kernels::weights`]): a head that is shared before the rest of its model is
    /// pinned.
    pub fn pin_weights(&mut self) {
        if let Some(m) = self.packed_mut() {
            crate::kernels::weights::pin(&mut [m]);
        }
    }

    /// Row `o` of the weights in f32, when the kernel's layout can give it back.
    pub fn dequantize_row(&self, o: usize, out: &mut [f32]) -> bool {
        match &self.kernel {
            Kernel::Packed(w) => {
                w.dequantize_row(o, out);
                true
            }
            _ => false,
        }
    }

    fn can_dequantize_rows(&self) -> bool {
        matches!(self.kernel, Kernel::Packed(_))
    }

    /// `out = x · Wᵀ` (`[m, n_out]`), reusing `out`'s allocation on the engine's kernels.
    pub fn forward_into(&self, x: &[f32], m: usize, out: &mut Vec<f32>) -> Result<()> {
        match &self.kernel {
            Kernel::Packed(w) => w.matmul(x, m, sized_for_overwrite(out, m * self.n_out)),
            Kernel::Candle(w) => {
                let t = Tensor::from_slice(x, (m, self.n_in), &Device::Cpu)?;
                let y = w.forward(&t)?;
                *out = y.flatten_all()?.to_vec1::<f32>()?;
            }
        }
        Ok(())
    }
}

/// Several products of the same input (Q/K/V, gate/up) computed as one when their weights
/// can be stacked, which saves a pass over the activations and a worker-pool round trip; as
/// one call of the pool when they are of different types on the engine's kernels.
pub enum FusedLinear {
    Stacked {
        w: Linear,
        widths: Vec<usize>,
    },
    /// Matrices of different types ([`PackedMatrix::matmul_each`]).
    Mixed(Vec<Linear>),
    Separate(Vec<Linear>),
}

impl FusedLinear {
    pub fn new(parts: Vec<Linear>) -> Self {
        let widths: Vec<usize> = parts.iter().map(|p| p.n_out).collect();
        let own: Vec<&PackedMatrix> = parts.iter().filter_map(Linear::packed).collect();
        let all_own = own.len() == parts.len();
        let stacked = if all_own {
            let dtype = parts[0].dtype;
            PackedMatrix::concat(&own).map(|m| (m.n_in, m.n_out, dtype, Kernel::Packed(m)))
        } else {
            None
        };
        match stacked {
            Some((n_in, n_out, dtype, kernel)) => FusedLinear::Stacked {
                w: Linear {
                    n_in,
                    n_out,
                    dtype,
                    kernel,
                },
                widths,
            },
            None if all_own && parts.len() <= MAX_PARTS => FusedLinear::Mixed(parts),
            None => FusedLinear::Separate(parts),
        }
    }

    /// The matrices in the engine's layout, for [`crate::kernels::weights::pin`].
    pub(crate) fn packed_mut(&mut self) -> Vec<&mut PackedMatrix> {
        match self {
            FusedLinear::Stacked { w, .. } => w.packed_mut().into_iter().collect(),
            FusedLinear::Mixed(parts) | FusedLinear::Separate(parts) => {
                parts.iter_mut().filter_map(|p| p.packed_mut()).collect()
            }
        }
    }

    /// One matrix whose rows are already the parts stacked (a file's fused `attn_qkv`), split
    /// into outputs of `widths` rows.
    pub fn split(w: Linear, widths: Vec<usize>) -> Self {
        debug_assert_eq!(widths.iter().sum::<usize>(), w.n_out);
        FusedLinear::Stacked { w, widths }
    }

    /// One output per part, each `[m, part.n_out]`, into `outs` (as many as parts);
    /// `stacked` holds the stacked product in between.
    pub fn forward_into(
        &self,
        x: &[f32],
        m: usize,
        outs: &mut [&mut Vec<f32>],
        stacked: &mut Vec<f32>,
    ) -> Result<()> {
        match self {
            FusedLinear::Mixed(parts) | FusedLinear::Separate(parts) => {
                if let (FusedLinear::Mixed(_), Some(first)) = (self, parts[0].packed()) {
                    let mats: [&PackedMatrix; MAX_PARTS] = std::array::from_fn(|i| {
                        parts.get(i).and_then(Linear::packed).unwrap_or(first)
                    });
                    let n = parts.len().min(MAX_PARTS);
                    if PackedMatrix::matmul_each(&mats[..n], x, m, outs).is_some() {
                        return Ok(());
                    }
                }
                for (p, out) in parts.iter().zip(outs.iter_mut()) {
                    p.forward_into(x, m, out)?;
                }
            }
            FusedLinear::Stacked { w, widths } => {
                if let Kernel::Packed(k) = &w.kernel {
                    if k.matmul_parts(x, m, widths, outs).is_some() {
                        return Ok(());
                    }
                }
                w.forward_into(x, m, stacked)?;
                for out in outs.iter_mut() {
                    out.clear();
                }
                for row in stacked.chunks_exact(w.n_out) {
                    let mut off = 0;
                    for (out, &n) in outs.iter_mut().zip(widths) {
                        out.extend_from_slice(&row[off..off + n]);
                        off += n;
                    }
                }
            }
        }
        Ok(())
    }

    /// A gate and an up projection (two parts of equal width) gated by `act` into `out`
    /// (`act(gate, up)` overwrites the gate values), fused into the product's tiles where
    /// the kernels can ([`PackedMatrix::matmul_gated`]); else both products into `out` and
    /// `up` and `act` over them. The results are the same bits either way.
    pub fn forward_gated(
        &self,
        x: &[f32],
        m: usize,
        out: &mut Vec<f32>,
        up: &mut Vec<f32>,
        stacked: &mut Vec<f32>,
        act: impl Fn(&mut [f32], &[f32]) + Sync,
    ) -> Result<()> {
        if let FusedLinear::Stacked { w, widths } = self {
            if let (Kernel::Packed(k), [a, b]) = (&w.kernel, widths.as_slice()) {
                if a == b && k.matmul_gated(x, m, out, &act).is_some() {
                    return Ok(());
                }
            }
        }
        self.forward_into(x, m, &mut [out, up], stacked)?;
        act(out, up);
        Ok(())
    }
}

/// The token embedding, kept quantized; rows are dequantized on lookup.
pub enum Embedding {
    /// In the file's type.
    Table(Arc<QTensor>),
    /// Tied to the output head: the head's kernel layout is the only copy of the weights.
    Tied(Arc<Linear>),
}

impl Embedding {
    /// The embedding for `table`, tied to `output` when the head was built from the same
    /// tensor and its kernel can give rows back (the table is then dropped).
    pub fn new(table: Arc<QTensor>, tied_output: Option<&Arc<Linear>>) -> Self {
        tied_output
            .and_then(Self::tied)
            .unwrap_or(Embedding::Table(table))
    }

    /// Reads rows back from `head`, when its kernel layout can give them.
    pub fn tied(head: &Arc<Linear>) -> Option<Self> {
        head.can_dequantize_rows()
            .then(|| Embedding::Tied(head.clone()))
    }

    pub fn lookup(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.lookup_into(tokens, &mut out)?;
        Ok(out)
    }

    /// The rows of `tokens` into `out` (`[tokens.len(), n_embd]`).
    pub fn lookup_into(&self, tokens: &[u32], out: &mut Vec<f32>) -> Result<()> {
        match self {
            Embedding::Table(table) => {
                let ids = Tensor::from_slice(tokens, tokens.len(), &Device::Cpu)?;
                *out = table.embedding(&ids)?.flatten_all()?.to_vec1::<f32>()?;
            }
            Embedding::Tied(head) => {
                let d = head.n_in;
                let out = sized(out, tokens.len() * d);
                for (row, &t) in out.chunks_exact_mut(d).zip(tokens) {
                    if t as usize >= head.n_out || !head.dequantize_row(t as usize, row) {
                        return Err(crate::error::EngineError::InvalidArgument(format!(
                            "token id {t} is out of range"
                        )));
                    }
                }
            }
        }
        Ok(())
    }
}
