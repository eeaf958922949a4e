//! The decoder families on candle tensors: the forward pass a GPU runs.
//!
//! Same block as [`super::decoder`] (one [`Family`] table of switches), written with candle's
//! device ops so that one code runs on every device candle has: weights stay in their GGUF
//! type on the device (`QMatMul`: candle's quantized CUDA kernels), activations never leave
//! it, what the host prepares for a pass (embeddings, rotary tables, cache rows, masks) goes
//! over in two copies ([`Staging`]), and only the logits rows (or hidden rows) the batch asks
//! for come back, in one copy: of a row that feeds only a greedy choice, its token's id. The
//! KV cache's block tables stay in the host's [`KvCache`]; the keys and values live in the
//! context's [`DeviceKv`] at the same block ids, so prefix sharing, copy-on-write and sliding
//! windows work as on the CPU. On candle's CPU device the engine's tests check this code
//! against llama.cpp's fixtures, as the CPU backend is checked.

use super::attention::visible_keys;
use super::cuda::graph::{StepGraphs, GRAPH_KEY_BUCKET, GRAPH_MAX_ROWS};
use super::cuda::{Kernels, TopCandidates};
use super::decoder::{refuse_generation, Activation, Family, PooledHeads};
use super::linear::Embedding;
use super::ops::Rope;
use super::{Architecture, Config, Pick, TensorLoader, Workspace};
use crate::batch::Batch;
use crate::device::DeviceCopies;
use crate::error::{EngineError, Result};
use crate::kv::{block_index, KvCache, KV_BLOCK_SIZE};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor, WithDType};
use std::ops::Range;

/// A key slot the CUDA decode attention kernel skips (padding, or a block its window dropped).
pub(super) const UNSEEN: u32 = u32::MAX;

/// Products whose outputs are consecutive slices of one result: each matrix gives one slice
/// (Q, K, V as separate matrices), or consecutive slices when it is stacked (Phi-3's
/// `attn_qkv`, its gate+up `ffn_up`, and neighbours of one type stacked at load).
struct Stacked {
    /// Each matrix with the widths of the slices it gives.
    mats: Vec<(QMatMul, Vec<usize>)>,
}

impl Stacked {
    /// The slices as views of the products' outputs (`views`), or each made contiguous.
    fn forward(&self, x: &Tensor, views: bool) -> Result<Vec<Tensor>> {
        let mut parts = Vec::with_capacity(3);
        for (m, widths) in &self.mats {
            let y = m.forward(x)?;
            if let [_] = widths[..] {
                parts.push(y);
                continue;
            }
            let mut at = 0;
            for &w in widths {
                let part = y.narrow(1, at, w)?;
                parts.push(if views { part } else { part.contiguous()? });
                at += w;
            }
        }
        Ok(parts)
    }
}

struct Layer {
    attn_norm: Tensor,
    qkv: Stacked,
    qkv_bias: Option<[Tensor; 3]>,
    wo: QMatMul,
    wo_bias: Option<Tensor>,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    post_attn_norm: Option<Tensor>,
    ffn_norm: Tensor,
    gate_up: Stacked,
    down: QMatMul,
    post_ffn_norm: Option<Tensor>,
    local: bool,
}

pub struct TensorDecoder {
    cfg: Config,
    family: &'static Family,
    device: Device,
    /// Rows are looked up on the host (a row per token) and uploaded: the table stays in host
    /// memory in its file type rather than dequantized on the device.
    embd: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    output: QMatMul,
    output_bias: Option<Tensor>,
    /// On the host, as the CPU backend runs them.
    heads: PooledHeads,
    inv_freq_global: Vec<f32>,
    inv_freq_local: Vec<f32>,
    inv_freq_long: Option<Vec<f32>>,
    /// `n_vocab - i` at column `i`: a row's first largest logit is where the largest of these
    /// is among its maxima ([`first_argmax`]).
    rev_index: Tensor,
    /// Which steps run as the engine's own CUDA kernels ([`super::cuda`]); none on other
    /// devices.
    kernels: Kernels,
    /// Decode steps run at bucketed shapes and, on a GPU, replay captured graphs
    /// ([`super::cuda::graph`]).
    graphs: bool,
    /// The widest input of its quantized products: how much of candle's activation scratch
    /// a pass's row needs (`graph::scratch_for`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    widest_product: usize,
}

/// A bucketed step's shapes: rows from `real` on pad the batch to `rows`, and key counts
/// are rounded up to multiples of `keys`.
#[derive(Debug, Clone, Copy)]
struct Padding {
    real: usize,
    rows: usize,
    keys: usize,
}

/// Keys and values of every layer in device memory, `[blocks × KV_BLOCK_SIZE, kv_dim]` f16
/// per layer, addressed by the host cache's block ids. One per context (in its
/// [`Workspace`]).
pub struct DeviceKv {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Decode steps captured over these caches (borrowed while a pass reads the caches).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    graphs: std::cell::RefCell<StepGraphs>,
}

impl DeviceKv {
    fn new(kv: &KvCache, n_layer: usize, kv_dim: usize, device: &Device) -> Result<Self> {
        let (mut k, mut v) = (Vec::with_capacity(n_layer), Vec::with_capacity(n_layer));
        for layer in 0..n_layer {
            let rows = kv.group_capacity(kv.layer_group(layer)) * KV_BLOCK_SIZE;
            k.push(Tensor::zeros((rows, kv_dim), DType::F16, device)?);
            v.push(Tensor::zeros((rows, kv_dim), DType::F16, device)?);
        }
        Ok(DeviceKv {
            k,
            v,
            graphs: Default::default(),
        })
    }

    /// Replays the host cache's copy-on-write copies.
    fn apply_copies(&self, kv: &mut KvCache) -> Result<()> {
        for c in kv.take_copies() {
            let (Some(src), Some(dst)) = (block_index(c.src), block_index(c.dst)) else {
                continue;
            };
            for layer in (0..self.k.len()).filter(|&l| kv.layer_group(l) == c.group) {
                for t in [&self.k[layer], &self.v[layer]] {
                    let block = t.narrow(0, src * KV_BLOCK_SIZE, KV_BLOCK_SIZE)?.copy()?;
                    t.slice_set(&block, 0, dst * KV_BLOCK_SIZE)?;
                }
            }
        }
        Ok(())
    }
}

/// Where one layer group's keys are written and read this pass.
struct GroupPlan {
    /// `[n_tokens, kv_dim]`: each token's cache row, repeated along the row (scatter indices);
    /// `None` where the rotation kernel writes the rows.
    write: Option<Tensor>,
    /// `[n_tokens]`: each token's cache row.
    write_rows: Tensor,
    /// Sequences attended together, padded to the longest of each: all one-token sequences
    /// (decode) in one, each longer one (a prompt) alone, so padding stays small.
    attn: Vec<AttnGroup>,
    /// For each token of the batch, its row in the groups' outputs laid end to end.
    out_rows: Tensor,
    /// `out_rows` is `0..n_tokens`: the groups' outputs are already in batch order.
    out_in_order: bool,
}

struct AttnGroup {
    n_seqs: usize,
    /// Tokens and key positions per sequence, after padding.
    t_max: usize,
    l_max: usize,
    /// `[n_seqs × t_max]`: the batch row of each (sequence, token); 0 for padding.
    q_rows: Tensor,
    /// `q_rows` is the batch's rows in order: the group's queries are the batch's.
    q_in_order: bool,
    /// `[n_seqs × l_max]`: the cache row of each (sequence, key position); 0 for padding.
    slots: Tensor,
    /// `[n_seqs, 1, 1, t_max, l_max]` (every head of a token sees the same keys): 0 where a
    /// query sees a key, -inf elsewhere (a padding row sees every key, so no row is empty);
    /// `None` where every query sees every key (a decode batch of sequences of one length):
    /// adding zeros would be one more kernel launch.
    mask: Option<Tensor>,
    /// One-token sequences with [`Kernels::attention`]: `q_rows`, then `slots` (`UNSEEN`
    /// where the mask would hide a key, and no mask), for the one-launch kernel
    /// ([`super::cuda`]) that replaces the gathers, products and softmax.
    kernel_idx: Option<Tensor>,
}

/// Host data a pass sends to the device, gathered so that it travels as one copy per element
/// type: on a GPU each copy from pageable host memory is a synchronous driver call, and a
/// pass has its embeddings, rotary tables and a dozen small index and mask arrays.
#[derive(Default)]
struct Staging {
    u32s: Vec<u32>,
    f32s: Vec<f32>,
}

impl Staging {
    fn u32s(&mut self, v: impl IntoIterator<Item = u32>) -> Range<usize> {
        let at = self.u32s.len();
        self.u32s.extend(v);
        at..self.u32s.len()
    }

    fn f32s(&mut self, v: &[f32]) -> Range<usize> {
        let at = self.f32s.len();
        self.f32s.extend_from_slice(v);
        at..self.f32s.len()
    }

    /// Both arrays on `device`: one copy each (none for an empty one).
    fn upload(self, device: &Device, copies: &mut DeviceCopies) -> Result<Staged> {
        fn send<T: WithDType>(
            v: Vec<T>,
            device: &Device,
            copies: &mut DeviceCopies,
        ) -> Result<Option<Tensor>> {
            if v.is_empty() {
                return Ok(None);
            }
            copies.to_device += 1;
            let n = v.len();
            Ok(Some(Tensor::from_vec(v, n, device)?))
        }
        Ok(Staged {
            u32s: send(self.u32s, device, copies)?,
            f32s: send(self.f32s, device, copies)?,
        })
    }
}

/// The staged arrays on the device; parts are views of them.
struct Staged {
    u32s: Option<Tensor>,
    f32s: Option<Tensor>,
}

impl Staged {
    fn part(t: &Option<Tensor>, r: &Range<usize>, shape: &[usize]) -> Result<Tensor> {
        let t = t
            .as_ref()
            .ok_or_else(|| EngineError::Internal("a part of nothing staged".into()))?;
        Ok(t.narrow(0, r.start, r.len())?.reshape(shape)?)
    }

    fn u32s(&self, r: &Range<usize>, shape: &[usize]) -> Result<Tensor> {
        Self::part(&self.u32s, r, shape)
    }

    fn f32s(&self, r: &Range<usize>, shape: &[usize]) -> Result<Tensor> {
        Self::part(&self.f32s, r, shape)
    }
}

/// A [`GroupPlan`] while staged: where its arrays are in the [`Staging`].
struct GroupRanges {
    write: Option<Range<usize>>,
    write_rows: Range<usize>,
    attn: Vec<AttnRanges>,
    out_rows: Range<usize>,
    out_in_order: bool,
}

struct AttnRanges {
    n_seqs: usize,
    t_max: usize,
    l_max: usize,
    q_rows: Range<usize>,
    q_in_order: bool,
    slots: Range<usize>,
    mask: Option<Range<usize>>,
    kernel_idx: Option<Range<usize>>,
}

impl GroupRanges {
    fn on_device(&self, staged: &Staged, kv_dim: usize) -> Result<GroupPlan> {
        let attn = self
            .attn
            .iter()
            .map(|a| -> Result<AttnGroup> {
                let (g, t, l) = (a.n_seqs, a.t_max, a.l_max);
                Ok(AttnGroup {
                    n_seqs: g,
                    t_max: t,
                    l_max: l,
                    q_rows: staged.u32s(&a.q_rows, &[g * t])?,
                    q_in_order: a.q_in_order,
                    slots: staged.u32s(&a.slots, &[g * l])?,
                    mask: a
                        .mask
                        .as_ref()
                        .map(|m| staged.f32s(m, &[g, 1, 1, t, l]))
                        .transpose()?,
                    kernel_idx: a
                        .kernel_idx
                        .as_ref()
                        .map(|r| staged.u32s(r, &[r.len()]))
                        .transpose()?,
                })
            })
            .collect::<Result<_>>()?;
        let n = self.out_rows.len();
        Ok(GroupPlan {
            write: self
                .write
                .as_ref()
                .map(|w| staged.u32s(w, &[n, kv_dim]))
                .transpose()?,
            write_rows: staged.u32s(&self.write_rows, &[n])?,
            attn,
            out_rows: staged.u32s(&self.out_rows, &[n])?,
            out_in_order: self.out_in_order,
        })
    }
}

/// One sequence's part of a pass: its batch rows, one past its last position in the batch,
/// and the key positions some row sees.
struct SeqRows {
    seq: usize,
    rows: Vec<usize>,
    end: usize,
    keys: Range<usize>,
}

/// The most best candidates a sampled row brings back: a sampler whose top-k keeps up to
/// this many ([`crate::Sampler::candidates_decide`]; llama.cpp's default keeps 40) draws
/// from them instead of the whole row.
pub const CANDIDATES: usize = 64;

impl TensorDecoder {
    /// Before a pass of `rows` rows with graphs on a GPU: candle's activation scratch grown
    /// to what the pass needs ([`super::cuda::graph::scratch_for`]), by the model's products
    /// run on 8 rows of zeros and on `rows`, one of each input width.
    #[cfg(feature = "cuda")]
    fn grow_scratch(&self, cuda: &candle_core::CudaDevice, rows: usize) -> Result<()> {
        super::cuda::graph::scratch_for(cuda, rows, self.widest_product, || {
            for (m, k) in product_widths(&self.layers, &self.output)? {
                for r in [8, rows].into_iter().take(if rows > 8 { 2 } else { 1 }) {
                    m.forward(&Tensor::zeros((r, k), DType::F32, &self.device)?)?;
                }
            }
            Ok(())
        })
    }

    /// How many best candidates a [`Pick::Best`] row brings back: none without the
    /// kernel that picks them.
    fn window(&self) -> usize {
        if self.kernels.candidates {
            CANDIDATES.min(self.cfg.n_vocab)
        } else {
            0
        }
    }

    pub(crate) fn load(cfg: &Config, l: &TensorLoader, device: &Device) -> Result<Self> {
        let family = super::arch_spec(&cfg.arch)
            .and_then(|s| s.family)
            .ok_or_else(|| EngineError::UnsupportedArchitecture(cfg.arch.clone()))?;
        let d = cfg.n_embd;
        let hd = cfg.head_dim;
        let (q_dim, kv_dim) = (cfg.n_head * hd, cfg.n_head_kv * hd);
        // the loader's host tensor (types converted as for the CPU), copied to the device
        let on_device = |t: &QTensor, rows: usize, cols: usize| -> Result<QMatMul> {
            let t = qtensor_from_ggml(t.dtype(), &t.data()?, vec![rows, cols], device)?;
            Ok(QMatMul::from_qtensor(t)?)
        };
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<QMatMul> {
            on_device(&l.matrix(name, rows, cols)?, rows, cols)
        };
        // Matrices that read the same input, neighbours of one type stacked into one
        // product (a row's blocks do not depend on the other rows): on a GPU each product
        // is an activation quantization and a kernel launch, and a decode step is bound by
        // the launches, not by the bytes.
        let stacked = |names: &[String], widths: &[usize]| -> Result<Stacked> {
            let hosts = names
                .iter()
                .zip(widths)
                .map(|(n, &w)| l.matrix(n, w, d))
                .collect::<Result<Vec<_>>>()?;
            let mut mats = Vec::new();
            let mut i = 0;
            while i < hosts.len() {
                let dtype = hosts[i].dtype();
                let run = hosts[i..].iter().take_while(|t| t.dtype() == dtype).count();
                let mut bytes = Vec::new();
                for t in &hosts[i..i + run] {
                    bytes.extend_from_slice(&t.data()?);
                }
                let ws = widths[i..i + run].to_vec();
                let rows = ws.iter().sum();
                let t = qtensor_from_ggml(dtype, &bytes, vec![rows, d], device)?;
                mats.push((QMatMul::from_qtensor(t)?, ws));
                i += run;
            }
            Ok(Stacked { mats })
        };
        let vector = |name: &str, len: usize| -> Result<Tensor> {
            Ok(Tensor::from_vec(l.vector(name, len)?, len, device)?)
        };
        let optional = |name: &str, len: usize| -> Result<Option<Tensor>> {
            l.gguf
                .has_tensor(name)
                .then(|| vector(name, len))
                .transpose()
        };
        l.info("token_embd.weight")?;
        let table = std::sync::Arc::new(l.gguf.qtensor("token_embd.weight", &Device::Cpu)?);
        let output = if l.gguf.has_tensor("output.weight") {
            matrix("output.weight", cfg.n_vocab, d)?
        } else {
            on_device(&table, cfg.n_vocab, d)?
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let has = |s: &str| l.gguf.has_tensor(&n(s));
            let qkv = if has("attn_qkv.weight") {
                Stacked {
                    mats: vec![(
                        matrix(&n("attn_qkv.weight"), q_dim + 2 * kv_dim, d)?,
                        vec![q_dim, kv_dim, kv_dim],
                    )],
                }
            } else {
                stacked(
                    &[n("attn_q.weight"), n("attn_k.weight"), n("attn_v.weight")],
                    &[q_dim, kv_dim, kv_dim],
                )?
            };
            let gate_up = if has("ffn_gate.weight") {
                stacked(&[n("ffn_gate.weight"), n("ffn_up.weight")], &[cfg.n_ff; 2])?
            } else {
                Stacked {
                    mats: vec![(
                        matrix(&n("ffn_up.weight"), 2 * cfg.n_ff, d)?,
                        vec![cfg.n_ff; 2],
                    )],
                }
            };
            let qkv_bias = if has("attn_qkv.bias") {
                let b = vector(&n("attn_qkv.bias"), q_dim + 2 * kv_dim)?;
                Some([
                    b.narrow(0, 0, q_dim)?,
                    b.narrow(0, q_dim, kv_dim)?,
                    b.narrow(0, q_dim + kv_dim, kv_dim)?,
                ])
            } else {
                match (
                    optional(&n("attn_q.bias"), q_dim)?,
                    optional(&n("attn_k.bias"), kv_dim)?,
                    optional(&n("attn_v.bias"), kv_dim)?,
                ) {
                    (Some(q), Some(k), Some(v)) => Some([q, k, v]),
                    (None, None, None) => None,
                    _ => {
                        return Err(EngineError::Unsupported(format!(
                            "bias layout in block {i}: some but not all of attn_q/k/v.bias"
                        )))
                    }
                }
            };
            let (qk, post) = (family.qk_norm, family.post_norms);
            layers.push(Layer {
                attn_norm: vector(&n("attn_norm.weight"), d)?,
                qkv,
                qkv_bias,
                wo: matrix(&n("attn_output.weight"), d, q_dim)?,
                wo_bias: optional(&n("attn_output.bias"), d)?,
                q_norm: qk
                    .then(|| vector(&n("attn_q_norm.weight"), hd))
                    .transpose()?,
                k_norm: qk
                    .then(|| vector(&n("attn_k_norm.weight"), hd))
                    .transpose()?,
                post_attn_norm: post
                    .then(|| vector(&n("post_attention_norm.weight"), d))
                    .transpose()?,
                ffn_norm: vector(&n("ffn_norm.weight"), d)?,
                down: matrix(&n("ffn_down.weight"), d, cfg.n_ff)?,
                gate_up,
                post_ffn_norm: post
                    .then(|| vector(&n("post_ffw_norm.weight"), d))
                    .transpose()?,
                local: cfg.layer_windows[i].is_some(),
            });
        }
        let freqs = super::decoder::rope_freqs(cfg, l)?;
        let kernels = kernels_for(cfg, device)?;
        // (a graph's steps are the kernels' launches: candle's gathers and masks take
        // shapes a step's arrays would have to carry)
        let graphs = kernels == Kernels::ALL
            && (device.is_cuda() || device.is_cpu())
            && super::cuda::graph::graphs_from_env().map_err(EngineError::InvalidArgument)?;
        let widest_product = product_widths(&layers, &output)?
            .iter()
            .map(|w| w.1)
            .max()
            .unwrap_or(0);
        let model = TensorDecoder {
            cfg: cfg.clone(),
            family,
            device: device.clone(),
            embd: Embedding::new(table, None),
            layers,
            norm: vector("output_norm.weight", d)?,
            output,
            output_bias: optional("output.bias", cfg.n_vocab)?,
            heads: PooledHeads::load(l, d)?,
            inv_freq_global: freqs.global,
            inv_freq_local: freqs.local,
            inv_freq_long: freqs.long,
            rev_index: Tensor::from_iter(
                (0..cfg.n_vocab).map(|i| (cfg.n_vocab - i) as f32),
                device,
            )?,
            kernels,
            graphs,
            widest_product,
        };
        l.check_all_used()?;
        Ok(model)
    }

    /// The cache rows and attention masks of one layer group for this batch, staged.
    fn plan(
        &self,
        batch: &Batch,
        kv: &KvCache,
        layer: usize,
        pad: Option<Padding>,
        st: &mut Staging,
    ) -> Result<GroupRanges> {
        let kv_dim = self.cfg.n_head_kv * self.cfg.head_dim;
        let causal = self.family.causal;
        let window = kv.layer_window(layer);
        let slot = |seq: usize, pos: usize| -> Option<u32> {
            let blocks = kv.seq_view(layer, seq).blocks;
            let b = block_index(*blocks.get(pos / KV_BLOCK_SIZE)?)?;
            Some((b * KV_BLOCK_SIZE + pos % KV_BLOCK_SIZE) as u32)
        };
        let n = batch.len();
        // rows from `real` on are a bucketed step's padding: no cache row, no keys
        let real = pad.map_or(n, |p| p.real);
        let mut write = Vec::with_capacity(n);
        for t in 0..real {
            write.push(slot(batch.seq[t], batch.pos[t]).ok_or_else(|| {
                EngineError::Internal(format!("no KV block reserved for token {t}"))
            })?);
        }
        write.resize(n, UNSEEN);
        let write_rows = st.u32s(write.iter().copied());
        let write = (!self.kernels.rope).then(|| st.u32s(scatter_rows(&write, kv_dim)));
        let mut seqs: Vec<SeqRows> = Vec::new();
        for t in 0..n {
            match seqs.iter_mut().find(|s| s.seq == batch.seq[t]) {
                Some(s) => s.rows.push(t),
                None => seqs.push(SeqRows {
                    seq: batch.seq[t],
                    rows: vec![t],
                    end: 0,
                    keys: 0..0,
                }),
            }
        }
        let visible = |t: usize, end: usize| visible_keys(causal, window, batch.pos[t], end);
        for s in seqs.iter_mut().filter(|s| s.rows[0] < real) {
            s.end = s.rows.iter().map(|&t| batch.pos[t] + 1).max().unwrap_or(0);
            let lo = s.rows.iter().map(|&t| visible(t, s.end).start).min();
            let hi = s.rows.iter().map(|&t| visible(t, s.end).end).max();
            s.keys = lo.unwrap_or(0)..hi.unwrap_or(0);
        }
        let (single, multi): (Vec<&SeqRows>, Vec<&SeqRows>) =
            seqs.iter().partition(|s| s.rows.len() == 1);
        let mut groups: Vec<Vec<&SeqRows>> = multi.into_iter().map(|s| vec![s]).collect();
        if !single.is_empty() {
            groups.push(single);
        }
        let mut out_rows = vec![0u32; n];
        let mut offset = 0;
        let mut attn = Vec::with_capacity(groups.len());
        for group in groups {
            let t_max = group.iter().map(|s| s.rows.len()).max().unwrap_or(1);
            let mut l_max = group.iter().map(|s| s.keys.len()).max().unwrap_or(1).max(1);
            if let Some(p) = pad {
                l_max = l_max.next_multiple_of(p.keys);
            }
            let g = group.len();
            let mut q_rows = vec![0u32; g * t_max];
            let mut slots = vec![0u32; g * l_max];
            let mut mask = vec![0f32; g * t_max * l_max];
            for (i, s) in group.iter().enumerate() {
                // a key of a block the window dropped is never seen
                let held: Vec<Option<u32>> = s.keys.clone().map(|p| slot(s.seq, p)).collect();
                for (k, h) in held.iter().enumerate() {
                    slots[i * l_max + k] = h.unwrap_or(0);
                }
                for (j, &t) in s.rows.iter().enumerate() {
                    q_rows[i * t_max + j] = t as u32;
                    out_rows[t] = (offset + i * t_max + j) as u32;
                    let sees = visible(t, s.end);
                    let row = (i * t_max + j) * l_max;
                    for (k, m) in mask[row..row + l_max].iter_mut().enumerate() {
                        let p = s.keys.start + k;
                        let seen = sees.contains(&p) && held.get(k).is_some_and(Option::is_some);
                        *m = if seen { 0.0 } else { f32::NEG_INFINITY };
                    }
                }
            }
            offset += g * t_max;
            // the kernel reads the mask from the slots themselves, and its index array is
            // the query rows and slots as staged here, one after the other
            let kernel = t_max == 1 && self.kernels.attention;
            if kernel {
                for (s, &m) in slots.iter_mut().zip(&mask) {
                    if m != 0.0 {
                        *s = UNSEEN;
                    }
                }
            }
            let q_in_order = in_order(&q_rows, n);
            let q_rows = st.u32s(q_rows);
            let slots = st.u32s(slots);
            attn.push(AttnRanges {
                n_seqs: g,
                t_max,
                l_max,
                q_in_order,
                kernel_idx: kernel.then_some(q_rows.start..slots.end),
                q_rows,
                slots,
                mask: (!kernel && mask.iter().any(|&m| m != 0.0)).then(|| st.f32s(&mask)),
            });
        }
        Ok(GroupRanges {
            write,
            write_rows,
            attn,
            out_in_order: offset == n && in_order(&out_rows, n),
            out_rows: st.u32s(out_rows),
        })
    }

    /// Rotates `x` (`[n, heads × head_dim]`) at each token's position.
    fn rope(&self, x: &Tensor, heads: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (n, hd) = (x.dim(0)?, self.cfg.head_dim);
        let x = x.reshape((n, heads, 1, hd))?;
        let rot = 2 * cos.dim(2)?;
        let rotate = |x: &Tensor| -> candle_core::Result<Tensor> {
            if self.family.neox {
                candle_nn::rotary_emb::rope(x, cos, sin)
            } else {
                candle_nn::rotary_emb::rope_i(x, cos, sin)
            }
        };
        let y = if rot == hd {
            rotate(&x)?
        } else {
            let head = rotate(&x.narrow(3, 0, rot)?.contiguous()?)?;
            Tensor::cat(&[head, x.narrow(3, rot, hd - rot)?], 3)?
        };
        Ok(y.reshape((n, heads * hd))?)
    }

    /// Attention of every token of the batch over its sequence's cached keys.
    fn attend(&self, q: &Tensor, plan: &GroupPlan, layer: usize, kv: &DeviceKv) -> Result<Tensor> {
        let c = &self.cfg;
        let (hd, n_kv) = (c.head_dim, c.n_head_kv);
        let ratio = c.n_head / n_kv;
        let mut outs = Vec::with_capacity(plan.attn.len());
        for a in &plan.attn {
            let (g, t, l) = (a.n_seqs, a.t_max, a.l_max);
            if let Some(idx) = &a.kernel_idx {
                let op = super::cuda::DecodeAttention {
                    idx: idx.clone(),
                    rows: g,
                    l_max: l,
                    n_head: c.n_head,
                    n_kv,
                    head_dim: hd,
                    scale: c.attn_scale,
                    softcap: c.attn_softcap,
                };
                outs.push(
                    q.contiguous()?
                        .apply_op3_no_bwd(&kv.k[layer], &kv.v[layer], &op)?,
                );
                continue;
            }
            // [g × t, heads × hd] → [g × kv heads, ratio × t, hd]
            // the gathers of rows are kernel launches: skipped where they would not move
            // a row (a decode batch of one-token sequences, a prompt alone)
            let qs = if a.q_in_order {
                q.clone()
            } else {
                q.index_select(&a.q_rows, 0)?
            };
            let qs = qs
                .reshape((g, t, n_kv, ratio, hd))?
                .permute((0, 2, 3, 1, 4))?
                .contiguous()?
                .reshape((g * n_kv, ratio * t, hd))?;
            let gather = |cache: &Tensor| -> candle_core::Result<Tensor> {
                cache
                    .index_select(&a.slots, 0)?
                    .to_dtype(DType::F32)?
                    .reshape((g, l, n_kv, hd))?
                    .transpose(1, 2)?
                    .contiguous()?
                    .reshape((g * n_kv, l, hd))
            };
            let (ks, vs) = (gather(&kv.k[layer])?, gather(&kv.v[layer])?);
            let mut scores = (qs.matmul(&ks.t()?)? * c.attn_scale as f64)?;
            if let Some(cap) = c.attn_softcap {
                scores = ((scores / cap as f64)?.tanh()? * cap as f64)?;
            }
            let scores = match &a.mask {
                Some(mask) => scores
                    .reshape((g, n_kv, ratio, t, l))?
                    .broadcast_add(mask)?
                    .reshape((g * n_kv, ratio * t, l))?,
                None => scores,
            };
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            let out = probs
                .matmul(&vs)?
                .reshape((g, n_kv, ratio, t, hd))?
                .permute((0, 3, 1, 2, 4))?
                .contiguous()?
                .reshape((g * t, c.n_head * hd))?;
            outs.push(out);
        }
        let out = if outs.len() == 1 {
            outs.pop().expect("one")
        } else {
            Tensor::cat(&outs, 0)?
        };
        if plan.out_in_order {
            return Ok(out);
        }
        Ok(out.index_select(&plan.out_rows, 0)?)
    }

    /// `x += post-normed o` where a sublayer's output waits, then `rms_norm(x) * w`: one
    /// kernel launch with [`Kernels::norm`], else candle's add and norm.
    fn residual(
        &self,
        x: &mut Tensor,
        pending: Option<(Tensor, Option<&Tensor>)>,
        w: &Tensor,
    ) -> Result<Tensor> {
        let eps = self.cfg.eps;
        if self.kernels.norm {
            let (o, post) = pending.unzip();
            let op = super::cuda::ResidualNorm {
                o: o.map(|o| o.contiguous()).transpose()?,
                post: post.flatten().cloned(),
                w: w.clone(),
                eps,
            };
            // [the sum, its norm]: contiguous views of one buffer
            let out = x.contiguous()?.apply_op1_no_bwd(&op)?;
            *x = out.get(0)?;
            return Ok(out.get(1)?);
        }
        if let Some((o, post)) = pending {
            *x = (&*x + post_normed(o, post, eps)?)?;
        }
        rms(x, w, eps)
    }

    /// Q, K and V of the normed rows `h`, with K and V written to the layer's cache rows and
    /// Q returned, rotated: one kernel launch after the product with [`Kernels::rope`].
    fn qkv_into_cache(
        &self,
        layer: &Layer,
        h: &Tensor,
        plan: &GroupPlan,
        (cos, sin): (&Tensor, &Tensor),
        k_cache: &Tensor,
        v_cache: &Tensor,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let (n, hd) = (h.dim(0)?, c.head_dim);
        let qkv = layer.qkv.forward(h, self.kernels.rope)?;
        let [mut q, mut k, v]: [Tensor; 3] = qkv
            .try_into()
            .map_err(|_| EngineError::Internal("three Q/K/V parts".into()))?;
        if self.kernels.rope {
            let op = super::cuda::RopeStore {
                k,
                v,
                bias: layer.qkv_bias.clone(),
                norms: layer.q_norm.clone().zip(layer.k_norm.clone()),
                eps: c.eps,
                cos: cos.clone(),
                sin: sin.clone(),
                neox: self.family.neox,
                write_rows: plan.write_rows.clone(),
                k_cache: k_cache.clone(),
                v_cache: v_cache.clone(),
                n_head: c.n_head,
                n_kv: c.n_head_kv,
                head_dim: hd,
            };
            return Ok(q.apply_op1_no_bwd(&op)?);
        }
        let write = plan
            .write
            .as_ref()
            .ok_or_else(|| EngineError::Internal("no scatter rows staged".into()))?;
        if let Some(b) = &layer.qkv_bias {
            q = q.broadcast_add(&b[0])?;
            k = k.broadcast_add(&b[1])?;
        }
        let v = match &layer.qkv_bias {
            Some(b) => v.broadcast_add(&b[2])?,
            None => v,
        };
        if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
            q = rms(&q.reshape((n * c.n_head, hd))?, qn, c.eps)?.reshape((n, c.n_head * hd))?;
            k = rms(&k.reshape((n * c.n_head_kv, hd))?, kn, c.eps)?
                .reshape((n, c.n_head_kv * hd))?;
        }
        let q = self.rope(&q, c.n_head, cos, sin)?;
        let k = self.rope(&k, c.n_head_kv, cos, sin)?;
        k_cache.scatter_set(write, &k.to_dtype(DType::F16)?, 0)?;
        v_cache.scatter_set(write, &v.to_dtype(DType::F16)?.contiguous()?, 0)?;
        Ok(q)
    }

    /// The gated unit's activation times its up half: one kernel launch over the stacked
    /// product's halves in place with [`Kernels::glu`].
    fn glu(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let gelu = match self.family.act {
            Activation::Silu => false,
            Activation::GeluTanh => true,
        };
        if self.kernels.glu {
            return Ok(gate.apply_op2_no_bwd(up, &super::cuda::Glu { gelu })?);
        }
        let act = if gelu { gate.gelu()? } else { gate.silu()? };
        Ok((act * up)?)
    }

    /// Rows `rows` of `x` (its flagged entries, staged: ascending, so as many as `x` has
    /// are all of them, in order, and need no gather), final-normed.
    fn normed_rows(&self, x: &Tensor, rows: &Tensor) -> Result<Tensor> {
        let h = if rows.dim(0)? == x.dim(0)? {
            x.clone()
        } else {
            x.index_select(rows, 0)?
        };
        Ok(candle_nn::ops::rms_norm(&h, &self.norm, self.cfg.eps)?)
    }
}

/// The engine's CUDA kernels a model runs: those `LLAMA_CPP_EX_CUDA_KERNELS` names
/// ([`Kernels`]), attention only for the head sizes it takes. On candle's CPU device (the
/// tests' stand-in for a GPU) the ops run their kernels' arithmetic as Rust loops.
fn kernels_for(cfg: &Config, device: &Device) -> Result<Kernels> {
    if !(device.is_cuda() || device.is_cpu()) {
        return Ok(Kernels::default());
    }
    let mut k = Kernels::from_env().map_err(EngineError::InvalidArgument)?;
    k.attention &= cfg.head_dim <= super::cuda::MAX_HEAD_DIM;
    Ok(k)
}

fn rms(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm(&x.contiguous()?, w, eps)?)
}

/// A model's quantized products, one of each input width, with that width.
fn product_widths<'a>(
    layers: &'a [Layer],
    output: &'a QMatMul,
) -> Result<Vec<(&'a QMatMul, usize)>> {
    let mats = layers.iter().flat_map(|l| {
        let stacked = l.qkv.mats.iter().chain(&l.gate_up.mats).map(|(m, _)| m);
        stacked.chain([&l.wo, &l.down])
    });
    let mut widths: Vec<(&QMatMul, usize)> = Vec::new();
    for m in mats.chain([output]) {
        if let QMatMul::QTensor(q) = m {
            let (_, k) = q.shape().dims2()?;
            if !widths.iter().any(|w| w.1 == k) {
                widths.push((m, k));
            }
        }
    }
    Ok(widths)
}

/// Scatter indices that write whole cache rows: each row repeated along its `width` values.
pub(super) fn scatter_rows(rows: &[u32], width: usize) -> impl Iterator<Item = u32> + '_ {
    rows.iter()
        .flat_map(move |&r| std::iter::repeat_n(r, width))
}

/// A sublayer's output, RMS-normed by its post-norm where the family has one.
fn post_normed(o: Tensor, post: Option<&Tensor>, eps: f32) -> Result<Tensor> {
    match post {
        Some(w) => rms(&o, w, eps),
        None => Ok(o),
    }
}

fn host_vec(t: &Tensor, out: &mut Vec<f32>, copies: &mut DeviceCopies) -> Result<()> {
    *out = t.flatten_all()?.to_vec1::<f32>()?;
    copies.to_host += 1;
    copies.bytes_to_host += std::mem::size_of_val(out.as_slice());
    Ok(())
}

/// Which logits rows of a pass come back whole, which as their greedy token's id and which
/// as their best candidates (see [`Workspace::pick_rows`]): positions among the pass's
/// output rows, staged.
struct PickRows {
    full: Range<usize>,
    greedy: Range<usize>,
    best: Range<usize>,
    /// How many of the greedy and best rows are the batch's own (not a bucketed step's
    /// padding, which comes last).
    real: (usize, usize),
}

impl PickRows {
    /// `None` when no output row is picked (every row comes back whole).
    fn stage(outputs: &[u32], pick_rows: &[Pick], real: usize, st: &mut Staging) -> Option<Self> {
        let kind = |r: u32| {
            pick_rows
                .get(outputs[r as usize] as usize)
                .copied()
                .unwrap_or_default()
        };
        let rows = |k: Pick| (0..outputs.len() as u32).filter(move |&r| kind(r) == k);
        let own = |k: Pick| {
            rows(k)
                .filter(|&r| (outputs[r as usize] as usize) < real)
                .count()
        };
        if rows(Pick::Whole).count() == outputs.len() {
            return None;
        }
        Some(PickRows {
            full: st.u32s(rows(Pick::Whole)),
            greedy: st.u32s(rows(Pick::Greedy)),
            best: st.u32s(rows(Pick::Best)),
            real: (own(Pick::Greedy), own(Pick::Best)),
        })
    }
}

/// Per row of `logits`, the index of its first largest value (the host sampler's greedy
/// rule, [`crate::sampler::argmax`]), as f32 (exact: vocabularies are far below 2^24);
/// `rev_index` holds `n - i` at column `i`. A row holding NaN may pick differently from the
/// host, which skips NaNs.
fn first_argmax(logits: &Tensor, rev_index: &Tensor) -> Result<Tensor> {
    let shape = logits.shape();
    let hit = logits.broadcast_eq(&logits.max_keepdim(1)?)?;
    let rev = rev_index.broadcast_as(shape)?;
    let zero = Tensor::zeros((), DType::F32, logits.device())?.broadcast_as(shape)?;
    let last = hit.where_cond(&rev, &zero)?.max(1)?;
    Ok(last.affine(-1.0, rev_index.dim(0)? as f64)?)
}

/// `batch` with padding entries up to `rows`: token 0 at position 0, each its own sequence
/// (ids no real sequence has), wanting its logits; their results are dropped.
fn padded_batch(batch: &Batch, rows: usize) -> Batch {
    let mut b = batch.clone();
    for t in batch.len()..rows {
        b.push(0, 0, usize::MAX - t, true);
    }
    b
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
/// What shapes a pass's launches (its graph's identity): the staged arrays' lengths, each
/// attention group's, the gathers it skips, whether rows are picked.
fn signature(p: &PassLayout, st: &Staging) -> Vec<usize> {
    let mut key = vec![
        p.n,
        st.u32s.len(),
        st.f32s.len(),
        p.picks.as_ref().map_or(0, |k| 1 + k.full.len()),
        p.picks.as_ref().map_or(0, |k| k.greedy.len()),
        p.embd_rows.is_some() as usize,
    ];
    for r in p.ranges.iter().flatten() {
        key.extend([
            r.out_in_order as usize,
            r.write.is_some() as usize,
            r.attn.len(),
        ]);
        for a in &r.attn {
            key.extend([
                a.n_seqs,
                a.t_max,
                a.l_max,
                a.q_in_order as usize,
                a.mask.is_some() as usize,
                a.kernel_idx.is_some() as usize,
            ]);
        }
    }
    key
}

/// Whether `rows` is `0..n`.
fn in_order(rows: &[u32], n: usize) -> bool {
    rows.len() == n && rows.iter().enumerate().all(|(i, &r)| r as usize == i)
}

/// The flagged entries of a batch, as row indices.
fn flagged(flags: &[bool]) -> Vec<u32> {
    (0..flags.len())
        .filter(|&t| flags[t])
        .map(|t| t as u32)
        .collect()
}

impl Architecture for TensorDecoder {
    fn causal(&self) -> bool {
        self.family.causal
    }

    fn kv_on_device(&self) -> bool {
        true
    }

    fn picks(&self) -> Option<usize> {
        Some(self.window())
    }

    fn project_pooled(&self, v: &mut Vec<f32>) -> Result<()> {
        self.heads.project(v)
    }

    fn classify(&self, pooled: &[f32]) -> Result<Vec<f32>> {
        self.heads.classify(&self.cfg.arch, pooled)
    }

    fn forward(&self, batch: &Batch, kv: &mut KvCache, ws: &mut Workspace) -> Result<()> {
        let c = &self.cfg;
        let f = self.family;
        refuse_generation(f, &c.arch, ws.hidden_only, batch)?;
        let kv_dim = c.n_head_kv * c.head_dim;
        if ws.device_kv.is_none() {
            ws.device_kv = Some(DeviceKv::new(kv, c.n_layer, kv_dim, &self.device)?);
        }
        ws.device_kv.as_ref().expect("just made").apply_copies(kv)?;

        // a decode step that may replay a captured graph runs at its bucket's shapes
        let real = batch.len();
        let pad = self.padding(batch, ws);
        let padded;
        let batch = match pad {
            Some(p) => {
                padded = padded_batch(batch, p.rows);
                &padded
            }
            None => batch,
        };
        #[cfg(feature = "cuda")]
        if let (true, Device::Cuda(cuda)) = (self.graphs, &self.device) {
            self.grow_scratch(cuda, batch.len())?;
        }
        let mut pick_rows = std::mem::take(&mut ws.pick_rows);
        if let (Some(p), Some(&first)) = (pad, pick_rows.first()) {
            // (picks are uniform in a bucketed step)
            pick_rows.resize(p.rows, first);
        }
        let mut st = Staging::default();
        let layout = self.prepare(batch, kv, ws, pad, &pick_rows, &mut st);
        pick_rows.truncate(real);
        ws.pick_rows = pick_rows;
        let layout = layout?;
        let groups: Vec<usize> = (0..self.layers.len()).map(|l| kv.layer_group(l)).collect();
        let dkv = ws.device_kv.as_ref().expect("made above");
        let out = match pad {
            Some(_) => {
                ws.device_copies.bucketed += 1;
                let copies = &mut ws.device_copies;
                let mut out = self.graph_pass(&layout, st, &groups, dkv, copies)?;
                // the padding rows' results stay on the device
                out.back = out.back.map(|b| b.narrow(0, 0, real)).transpose()?;
                out
            }
            None => {
                let staged = st.upload(&self.device, &mut ws.device_copies)?;
                self.device_pass(&layout, &staged, &groups, dkv, ws.hidden_only)?
            }
        };
        self.finish(out, &layout, ws)
    }
}

/// Where a pass's arrays are staged and what comes back (the host's half of a pass).
struct PassLayout {
    n: usize,
    ranges: Vec<Option<GroupRanges>>,
    x_at: Range<usize>,
    rope_global: (Range<usize>, Range<usize>, usize),
    rope_local: Option<(Range<usize>, Range<usize>, usize)>,
    embd_rows: Option<Range<usize>>,
    picks: Option<PickRows>,
    logit_rows: Range<usize>,
}

/// What a pass leaves on the device for the host: the final-normed hidden rows asked for,
/// and the logits rows (whole, then the greedy rows' ids and the best rows' candidates, as
/// one vector where there are several kinds).
struct PassOut {
    hidden: Option<Tensor>,
    back: Option<Tensor>,
}

impl TensorDecoder {
    /// The host's work of a pass: embeddings, rotary tables and every layer group's plan,
    /// staged before anything is sent.
    fn prepare(
        &self,
        batch: &Batch,
        kv: &KvCache,
        ws: &mut Workspace,
        pad: Option<Padding>,
        pick_rows: &[Pick],
        st: &mut Staging,
    ) -> Result<PassLayout> {
        let c = &self.cfg;
        let (n, d) = (batch.len(), c.n_embd);
        self.embd.lookup_into(&batch.tokens, &mut ws.x)?;
        let x_at = st.f32s(&ws.x[..n * d]);
        let global = match &self.inv_freq_long {
            Some(long) if ws.n_ctx_seq > c.n_ctx_orig => long,
            _ => &self.inv_freq_global,
        };
        let mut tables = |rope: &mut Rope, freqs: &[f32]| {
            rope.fill(&batch.pos, freqs, c.rope_attn_factor);
            (st.f32s(&rope.cos), st.f32s(&rope.sin), rope.half)
        };
        let rope_global = tables(&mut ws.rope, global);
        let rope_local = self
            .family
            .swa
            .is_some()
            .then(|| tables(&mut ws.rope_local, &self.inv_freq_local));
        let mut ranges: Vec<Option<GroupRanges>> = Vec::new();
        for li in 0..self.layers.len() {
            let g = kv.layer_group(li);
            if ranges.len() <= g {
                ranges.resize_with(g + 1, || None);
            }
            if ranges[g].is_none() {
                ranges[g] = Some(self.plan(batch, kv, li, pad, st)?);
            }
        }
        let embd_rows =
            (!ws.hidden_only && batch.has_embd()).then(|| st.u32s(flagged(&batch.embd)));
        let outputs = flagged(&batch.logits);
        let picks = PickRows::stage(&outputs, pick_rows, pad.map_or(n, |p| p.real), st);
        let logit_rows = st.u32s(outputs);
        Ok(PassLayout {
            n,
            ranges,
            x_at,
            rope_global,
            rope_local,
            embd_rows,
            picks,
            logit_rows,
        })
    }

    /// The device's work of a pass, from the staged arrays to what comes back: no copy to
    /// or from the host, so that a decode step can be captured as a graph.
    fn device_pass(
        &self,
        p: &PassLayout,
        staged: &Staged,
        groups: &[usize],
        dkv: &DeviceKv,
        hidden_only: bool,
    ) -> Result<PassOut> {
        let c = &self.cfg;
        let f = self.family;
        let (n, d) = (p.n, c.n_embd);
        let kv_dim = c.n_head_kv * c.head_dim;
        let plans = p
            .ranges
            .iter()
            .map(|r| r.as_ref().map(|r| r.on_device(staged, kv_dim)).transpose())
            .collect::<Result<Vec<_>>>()?;
        let table =
            |(cos, sin, half): &(Range<usize>, Range<usize>, usize)| -> Result<(Tensor, Tensor)> {
                Ok((
                    staged.f32s(cos, &[n, 1, *half])?,
                    staged.f32s(sin, &[n, 1, *half])?,
                ))
            };
        let rope_global = table(&p.rope_global)?;
        let rope_local = p.rope_local.as_ref().map(table).transpose()?;
        let mut x = staged.f32s(&p.x_at, &[n, d])?;
        if f.embed_scale {
            x = (x * (d as f64).sqrt())?;
        }
        // each sublayer's output waits to be added (with its post-norm) until the next norm,
        // so that the add and the norm can be one kernel
        let mut pending: Option<(Tensor, Option<&Tensor>)> = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let plan = plans[groups[li]].as_ref().expect("a plan per layer group");
            let (cos, sin) = match (&rope_local, layer.local) {
                (Some(local), true) => local,
                _ => &rope_global,
            };
            let h = self.residual(&mut x, pending.take(), &layer.attn_norm)?;
            let q = self.qkv_into_cache(layer, &h, plan, (cos, sin), &dkv.k[li], &dkv.v[li])?;
            let attn = self.attend(&q, plan, li, dkv)?;
            let mut o = layer.wo.forward(&attn)?;
            if let Some(b) = &layer.wo_bias {
                o = o.broadcast_add(b)?;
            }
            let post = layer.post_attn_norm.as_ref();
            let h = self.residual(&mut x, Some((o, post)), &layer.ffn_norm)?;
            let gu = layer.gate_up.forward(&h, self.kernels.glu)?;
            let act = self.glu(&gu[0], &gu[1])?;
            pending = Some((layer.down.forward(&act)?, layer.post_ffn_norm.as_ref()));
        }
        if let Some((o, post)) = pending {
            x = (x + post_normed(o, post, c.eps)?)?;
        }
        let rows = |r: &Range<usize>| -> Result<Option<Tensor>> {
            (!r.is_empty())
                .then(|| staged.u32s(r, &[r.len()]))
                .transpose()
        };
        if hidden_only {
            let hidden = rows(&p.logit_rows)?
                .map(|r| self.normed_rows(&x, &r))
                .transpose()?;
            return Ok(PassOut { hidden, back: None });
        }
        let hidden = match p.embd_rows.as_ref().map(rows).transpose()?.flatten() {
            Some(r) => Some(self.normed_rows(&x, &r)?),
            None => None,
        };
        let Some(r) = rows(&p.logit_rows)? else {
            return Ok(PassOut { hidden, back: None });
        };
        let h = self.normed_rows(&x, &r)?;
        let mut logits = self.output.forward(&h)?;
        if let Some(b) = &self.output_bias {
            logits = logits.broadcast_add(b)?;
        }
        if let Some(cap) = c.final_softcap {
            logits = ((logits / cap as f64)?.tanh()? * cap as f64)?;
        }
        let Some(picks) = &p.picks else {
            return Ok(PassOut {
                hidden,
                back: Some(logits),
            });
        };
        // the whole rows first, the greedy ids, then the best candidates, in one copy (a
        // kind that is every row's reads the logits as they are)
        let n_out = p.logit_rows.len();
        let select = |r: &Range<usize>| -> Result<Option<Tensor>> {
            Ok(match r.len() {
                0 => None,
                len if len == n_out => Some(logits.clone()),
                len => Some(logits.index_select(&staged.u32s(r, &[len])?, 0)?),
            })
        };
        let window = TopCandidates {
            window: self.window(),
        };
        let mut parts = Vec::new();
        if let Some(rows) = select(&picks.full)? {
            parts.push(rows);
        }
        if let Some(rows) = select(&picks.greedy)? {
            parts.push(first_argmax(&rows, &self.rev_index)?);
        }
        if let Some(rows) = select(&picks.best)? {
            parts.push(rows.apply_op1_no_bwd(&window)?);
        }
        // (one part keeps its rows, which a bucketed step narrows to the batch's own)
        let back = match parts.len() {
            1 => parts.pop().expect("one part"),
            _ => {
                let flat = parts.iter().map(|t| t.flatten_all());
                Tensor::cat(&flat.collect::<candle_core::Result<Vec<_>>>()?, 0)?
            }
        };
        Ok(PassOut {
            hidden,
            back: Some(back),
        })
    }

    /// The shapes a decode step runs at when steps are bucketed ([`Self::graphs`]): every
    /// entry a one-token sequence whose logits come back (all as greedy ids or all whole),
    /// at most [`GRAPH_MAX_ROWS`] of them. `None`: the pass runs at its own shapes.
    fn padding(&self, batch: &Batch, ws: &Workspace) -> Option<Padding> {
        let n = batch.len();
        if !self.graphs || ws.hidden_only || batch.has_embd() || n == 0 || n > GRAPH_MAX_ROWS {
            return None;
        }
        let picks = &ws.pick_rows;
        let uniform = picks
            .first()
            .is_none_or(|&first| picks.iter().all(|&p| p == first));
        if !uniform || !batch.logits.iter().all(|&l| l) {
            return None;
        }
        let mut seqs = batch.seq.clone();
        seqs.sort_unstable();
        seqs.dedup();
        (seqs.len() == n).then_some(Padding {
            real: n,
            rows: n.next_power_of_two(),
            keys: GRAPH_KEY_BUCKET,
        })
    }

    /// A bucketed step: on a GPU, the replay of its bucket's graph, or its eager pass and
    /// then its capture; elsewhere the eager pass.
    fn graph_pass(
        &self,
        p: &PassLayout,
        st: Staging,
        groups: &[usize],
        dkv: &DeviceKv,
        copies: &mut DeviceCopies,
    ) -> Result<PassOut> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cuda) = &self.device {
            let mut graphs = dkv.graphs.borrow_mut();
            let key = signature(p, &st);
            if !graphs.failed(&key) {
                if let Some(back) = graphs.replay(cuda, &key, &st.u32s, &st.f32s)? {
                    copies.to_device += (!st.u32s.is_empty()) as usize;
                    copies.to_device += (!st.f32s.is_empty()) as usize;
                    copies.replayed += 1;
                    return Ok(PassOut {
                        hidden: None,
                        back: Some(back),
                    });
                }
                // the buffers the graph will read: this step's own upload
                let staged = st.upload(&self.device, copies)?;
                // candle's parameter uploads are cached from here on, so that the capture
                // finds every one the eager pass made
                let _uploads = cuda.enable_cuda_graph_htod_cache();
                let out = self.device_pass(p, &staged, groups, dkv, false)?;
                if let Some(back) = &out.back {
                    let buffers = (staged.u32s.clone(), staged.f32s.clone());
                    graphs.capture(cuda, key, buffers, back, || {
                        self.device_pass(p, &staged, groups, dkv, false)?
                            .back
                            .ok_or_else(|| EngineError::Internal("a step without logits".into()))
                    })?;
                }
                return Ok(out);
            }
        }
        let staged = st.upload(&self.device, copies)?;
        self.device_pass(p, &staged, groups, dkv, false)
    }

    /// What a pass left on the device, copied to the workspace.
    fn finish(&self, out: PassOut, p: &PassLayout, ws: &mut Workspace) -> Result<()> {
        match &out.hidden {
            Some(h) => host_vec(h, &mut ws.hidden, &mut ws.device_copies)?,
            None => ws.hidden.clear(),
        }
        ws.picked.clear();
        ws.candidates.clear();
        if ws.hidden_only {
            return Ok(());
        }
        let Some(back) = &out.back else {
            ws.logits.clear();
            return Ok(());
        };
        host_vec(back, &mut ws.logits, &mut ws.device_copies)?;
        if let Some(picks) = &p.picks {
            // (a bucketed step's padding rows were left behind on the device)
            // (no best rows without a window)
            let w = self.window().max(1);
            let (greedy, best) = picks.real;
            let best_at = ws.logits.len() - best * 2 * w;
            for c in ws.logits[best_at..].chunks_exact(2 * w) {
                let (ids, logits) = c.split_at(w);
                ws.candidates
                    .extend(ids.iter().zip(logits).map(|(&id, &l)| (id as u32, l)));
            }
            let greedy_at = best_at - greedy;
            ws.picked
                .extend(ws.logits[greedy_at..best_at].iter().map(|&id| id as u32));
            ws.logits.truncate(greedy_at);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ties go to the first of the largest values, as the host sampler has it.
    #[test]
    fn first_argmax_takes_the_first_of_equal_maxima() {
        let dev = Device::Cpu;
        let ninf = f32::NEG_INFINITY;
        let rows = [
            [1.0, 3.0, 3.0, 2.0],
            [5.0; 4],
            [ninf, ninf, 0.0, ninf],
            [0.5, -1.0, 0.0, 0.7],
        ];
        let logits = Tensor::from_iter(rows.iter().flatten().copied(), &dev)
            .unwrap()
            .reshape((4, 4))
            .unwrap();
        let rev = Tensor::from_iter((0..4).map(|i| (4 - i) as f32), &dev).unwrap();
        let got = first_argmax(&logits, &rev)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let host: Vec<f32> = rows
            .iter()
            .map(|r| crate::sampler::argmax(r) as f32)
            .collect();
        assert_eq!(got, vec![1.0, 0.0, 2.0, 3.0]);
        assert_eq!(got, host);
    }
}
