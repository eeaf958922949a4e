//! Model loading and the architecture trait.

pub mod attention;
pub mod bert;
mod cuda;
pub mod decoder;
pub mod linear;
pub mod ops;
pub mod tensor;

use crate::batch::Batch;
use crate::device::{Backend, Placement};
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
use crate::grammar::{Constraint, GrammarError, GrammarFactory, GrammarSpec};
use crate::kv::KvCache;
use crate::tokenizer::Tokenizer;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// What to do with weight types whose candle CPU kernels are scalar-only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requantize {
    /// Keep the file's types.
    Off,
    /// Re-quantize the types that would otherwise run on candle's scalar kernels (Q4_1,
    /// Q5_0, Q5_1: only when the engine's own kernels are disabled) to Q8_0.
    Q8_0,
    /// Re-quantize every quantized matrix that is not Q8_0 (K-quants included) to Q8_0, so
    /// every product runs on the engine's own kernel.
    AllQ8_0,
}

#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub requantize: Requantize,
    /// Load only the vocabulary (no weights).
    pub vocab_only: bool,
    /// Where the forward runs (the CPU by default).
    pub placement: Placement,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            requantize: Requantize::Q8_0,
            vocab_only: false,
            placement: Placement::default(),
        }
    }
}

/// Hyper-parameters read from GGUF metadata.
#[derive(Debug, Clone)]
pub struct Config {
    pub arch: String,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_rot: usize,
    pub rope_base: f32,
    /// Rope base of sliding-window layers (Gemma 3 uses a smaller one than its global layers).
    pub rope_base_local: f32,
    pub eps: f32,
    pub n_ctx_train: usize,
    /// Sliding window per layer (None = full attention).
    pub layer_windows: Vec<Option<usize>>,
    /// Linear rope scaling: positions are multiplied by this (`1 / rope.scaling.factor`).
    pub rope_freq_scale: f32,
    /// Rope's magnitude scale (`rope.scaling.attn_factor`, Phi-3 LongRoPE's
    /// `√(1 + ln(scale) / ln(original context))`): cos and sin are multiplied by it.
    pub rope_attn_factor: f32,
    /// The context the model was pre-trained with before its rope was extended
    /// (`rope.scaling.original_context_length`; LongRoPE switches factor sets past it).
    pub n_ctx_orig: usize,
    /// Scale of attention scores (`1/√head_dim`).
    pub attn_scale: f32,
    /// `cap · tanh(x / cap)` on attention scores and on the final logits (Gemma 2).
    pub attn_softcap: Option<f32>,
    pub final_softcap: Option<f32>,
}

/// One architecture the engine implements: how it reads the hyper-parameters that are its
/// own (after the common ones) and how it builds its forward pass.
pub struct ArchSpec {
    /// `general.architecture` in GGUF files.
    pub name: &'static str,
    /// How its block differs from the other decoder families (`None`: not a decoder).
    pub family: Option<&'static decoder::Family>,
    pub configure: fn(&GgufFile, &mut Config) -> Result<()>,
    pub(crate) load: fn(&Config, &TensorLoader) -> Result<Box<dyn Architecture>>,
}

/// Architectures this engine implements.
pub const ARCHITECTURES: &[&ArchSpec] = &[
    &decoder::LLAMA,
    &decoder::QWEN2,
    &decoder::QWEN3,
    &decoder::PHI3,
    &decoder::GEMMA2,
    &decoder::GEMMA3,
    &decoder::GEMMA_EMBEDDING,
    &bert::BERT,
];

/// The architecture named `name`, if implemented.
pub fn arch_spec(name: &str) -> Option<&'static ArchSpec> {
    ARCHITECTURES.iter().copied().find(|a| a.name == name)
}

/// Upper bounds that keep hostile metadata from sizing absurd buffers.
const MAX_EMBD: u64 = 1 << 16;
const MAX_LAYERS: u64 = 1 << 10;
const MAX_HEADS: u64 = 1 << 10;

impl Config {
    pub fn from_gguf(g: &GgufFile, n_vocab: usize) -> Result<Self> {
        let arch = g
            .get_str("general.architecture")
            .ok_or_else(|| EngineError::InvalidGguf("missing general.architecture".into()))?
            .to_string();
        let key = |k: &str| format!("{arch}.{k}");
        let bounded = |k: &str, max: u64| -> Result<usize> {
            let v = g.require_u64(&key(k))?;
            if v == 0 || v > max {
                return Err(EngineError::InvalidGguf(format!(
                    "implausible {arch}.{k} = {v}"
                )));
            }
            Ok(v as usize)
        };
        let n_embd = bounded("embedding_length", MAX_EMBD)?;
        let n_layer = bounded("block_count", MAX_LAYERS)?;
        let n_head = bounded("attention.head_count", MAX_HEADS)?;
        let n_head_kv = match g.get_u64(&key("attention.head_count_kv")) {
            Some(_) => bounded("attention.head_count_kv", MAX_HEADS)?,
            None => n_head,
        };
        if n_head % n_head_kv != 0 {
            return Err(EngineError::InvalidGguf(format!(
                "head_count {n_head} is not a multiple of head_count_kv {n_head_kv}"
            )));
        }
        let head_dim = match g.get_u64(&key("attention.key_length")) {
            Some(_) => bounded("attention.key_length", MAX_EMBD)?,
            None => n_embd / n_head,
        };
        if let Some(v) = g.get_u64(&key("attention.value_length")) {
            if v as usize != head_dim {
                return Err(EngineError::Unsupported(format!(
                    "attention layout: value_length {v} differs from key_length {head_dim}"
                )));
            }
        }
        let n_ff = bounded("feed_forward_length", MAX_EMBD * 16)?;
        let n_rot = match g.get_u64(&key("rope.dimension_count")) {
            Some(v) if v as usize <= head_dim && v % 2 == 0 && v > 0 => v as usize,
            Some(v) => {
                return Err(EngineError::InvalidGguf(format!(
                    "bad rope.dimension_count {v}"
                )))
            }
            None => head_dim,
        };
        let rope_base = g.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0) as f32;
        let eps = g
            .get_f64(&key("attention.layer_norm_rms_epsilon"))
            .unwrap_or(1e-5) as f32;
        let n_ctx_train = g
            .get_u64(&key("context_length"))
            .unwrap_or(4096)
            .min(1 << 24) as usize;
        if !(rope_base.is_finite() && rope_base > 0.0 && eps.is_finite() && eps >= 0.0) {
            return Err(EngineError::InvalidGguf(
                "bad rope base or norm epsilon".into(),
            ));
        }
        let rope_freq_scale = match g.get_str(&key("rope.scaling.type")) {
            None | Some("none") => 1.0,
            Some("linear") => match g.get_f64(&key("rope.scaling.factor")) {
                Some(f) if f.is_finite() && f >= 1.0 => (1.0 / f) as f32,
                None => 1.0,
                Some(f) => {
                    return Err(EngineError::InvalidGguf(format!(
                        "bad rope.scaling.factor {f}"
                    )))
                }
            },
            Some(other) => {
                return Err(EngineError::Unsupported(format!(
                    "rope scaling: {other} ({arch}.rope.scaling.type)"
                )))
            }
        };
        let rope_attn_factor = match g.get_f64(&key("rope.scaling.attn_factor")) {
            None => 1.0,
            Some(f) if f.is_finite() && f > 0.0 && f < 16.0 => f as f32,
            Some(f) => {
                return Err(EngineError::InvalidGguf(format!(
                    "bad rope.scaling.attn_factor {f}"
                )))
            }
        };
        let n_ctx_orig = g
            .get_u64(&key("rope.scaling.original_context_length"))
            .map_or(n_ctx_train, |v| v.min(1 << 24) as usize);
        let mut cfg = Config {
            arch,
            n_vocab,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            n_rot,
            rope_base,
            rope_base_local: rope_base,
            eps,
            n_ctx_train,
            layer_windows: vec![None; n_layer],
            rope_freq_scale,
            rope_attn_factor,
            n_ctx_orig,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            attn_softcap: None,
            final_softcap: None,
        };
        if let Some(spec) = arch_spec(&cfg.arch) {
            (spec.configure)(g, &mut cfg)?;
        }
        Ok(cfg)
    }

    /// The GGUF metadata key `{arch}.{k}`.
    pub fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
}

/// One architecture's forward pass over a batch.
pub trait Architecture: Send + Sync {
    /// Runs the batch, writing keys/values into `kv` (blocks already reserved), and leaves the
    /// logits of the tokens whose logits flag is set in `ws.logits`, in batch order
    /// (`[n_outputs, n_vocab]`).
    fn forward(&self, batch: &Batch, kv: &mut KvCache, ws: &mut Workspace) -> Result<()>;

    /// Whether the architecture honours [`Workspace::pick_rows`] where the logits are
    /// (device memory): `Some(window)` when it brings back a [`Pick::Greedy`] row's token id
    /// and a [`Pick::Best`] row's `window` best candidates instead of their rows.
    fn picks(&self) -> Option<usize> {
        None
    }

    /// Whether the KV cache's contents live in the architecture's device memory (the host
    /// cache then keeps only block tables: [`KvCache::keep_on_device`]).
    fn kv_on_device(&self) -> bool {
        false
    }

    /// Whether attention is causal: a decoder's reranker reads its last token, an encoder's
    /// its first.
    fn causal(&self) -> bool {
        true
    }

    /// Projections applied to a pooled vector (or to each token's state without pooling)
    /// before it is normalised: sentence-transformers' dense modules stored in the file.
    fn project_pooled(&self, _v: &mut Vec<f32>) -> Result<()> {
        Ok(())
    }

    /// A reranker's classification head over a pooled hidden state (llama.cpp's pooling
    /// `rank`): one score per output label.
    fn classify(&self, _pooled: &[f32]) -> Result<Vec<f32>> {
        Err(EngineError::Unsupported(
            "pooling rank: the model has no classification head (not a reranker)".into(),
        ))
    }
}

/// The buffers of a forward pass, kept by the context from one pass to the next: once they
/// have grown to the largest batch seen, a pass allocates nothing.
#[derive(Default)]
pub struct Workspace {
    pub(crate) x: Vec<f32>,
    pub(crate) h: Vec<f32>,
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) attn: Vec<f32>,
    pub(crate) o: Vec<f32>,
    pub(crate) g: Vec<f32>,
    pub(crate) u: Vec<f32>,
    pub(crate) stacked: Vec<f32>,
    pub(crate) rope: ops::Rope,
    pub(crate) rope_local: ops::Rope,
    /// Positions one sequence may reach (the context's `n_ctx`): Phi-3's LongRoPE picks its
    /// factor set by it, as llama.cpp does by its per-sequence context.
    pub(crate) n_ctx_seq: usize,
    pub(crate) tiles: Vec<(usize, usize)>,
    /// Logits of the last pass.
    pub logits: Vec<f32>,
    /// When set, a pass leaves the final-normed hidden states of the flagged tokens in
    /// `hidden` (`[n_outputs, n_embd]`) instead of logits (embeddings).
    pub(crate) hidden_only: bool,
    pub hidden: Vec<f32>,
    /// Keys and values in device memory, for an architecture that keeps them there.
    pub(crate) device_kv: Option<tensor::DeviceKv>,
    /// Host↔device copies of the passes so far (device backends only).
    pub(crate) device_copies: crate::device::DeviceCopies,
    /// Per batch entry, set by the context when the architecture [`picks`]: how the
    /// entry's logits row comes back. Empty: every flagged row comes back whole.
    ///
    /// [`picks`]: Architecture::picks
    pub(crate) pick_rows: Vec<Pick>,
    /// The greedy ids of the [`Pick::Greedy`] entries, in batch order.
    pub(crate) picked: Vec<u32>,
    /// The best candidates of the [`Pick::Best`] entries, in batch order: the
    /// architecture's window of them each, in the sampler's candidate order.
    pub(crate) candidates: Vec<(u32, f32)>,
}

/// How a logits row of a pass comes back from a device (see [`Workspace::pick_rows`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Pick {
    /// The whole row.
    #[default]
    Whole,
    /// Its greedy token's id: the row feeds only a greedy choice
    /// ([`Sampler::argmax_decides`]).
    ///
    /// [`Sampler::argmax_decides`]: crate::Sampler::argmax_decides
    Greedy,
    /// Its best candidates: the sampler reads no more of the row than they are
    /// ([`Sampler::candidates_decide`]).
    ///
    /// [`Sampler::candidates_decide`]: crate::Sampler::candidates_decide
    Best,
}

/// Loads one tensor, re-quantizing scalar-only types when asked, and remembers which
/// tensors were read (a file with tensors nobody reads is refused, see
/// [`TensorLoader::check_all_used`]).
pub(crate) struct TensorLoader<'a> {
    pub gguf: &'a GgufFile,
    pub requantize: Requantize,
    pub used: std::cell::RefCell<std::collections::HashSet<String>>,
}

impl<'a> TensorLoader<'a> {
    pub fn new(gguf: &'a GgufFile, requantize: Requantize) -> Self {
        TensorLoader {
            gguf,
            requantize,
            used: Default::default(),
        }
    }

    fn info(&self, name: &str) -> Result<&'a crate::gguf::TensorInfo> {
        let info = self.gguf.tensor_info(name)?;
        self.used.borrow_mut().insert(name.to_string());
        Ok(info)
    }

    /// An error naming the first tensors of the file that the architecture did not read.
    pub fn check_all_used(&self) -> Result<()> {
        let used = self.used.borrow();
        let mut unused: Vec<&String> = self
            .gguf
            .tensors
            .keys()
            .filter(|n| !used.contains(*n))
            .collect();
        if unused.is_empty() {
            return Ok(());
        }
        unused.sort();
        let names: Vec<&str> = unused.iter().take(4).map(|s| s.as_str()).collect();
        Err(EngineError::Unsupported(format!(
            "tensor{}: {}{} (the architecture does not use {})",
            if unused.len() > 1 { "s" } else { "" },
            names.join(", "),
            if unused.len() > 4 {
                format!(" and {} more", unused.len() - 4)
            } else {
                String::new()
            },
            if unused.len() > 1 { "them" } else { "it" },
        )))
    }

    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QTensor> {
        let info = self.info(name)?;
        if info.shape != [rows, cols] {
            return Err(EngineError::InvalidGguf(format!(
                "tensor {name} has shape {:?}, expected [{rows}, {cols}]",
                info.shape
            )));
        }
        let t = self.gguf.qtensor(name, &Device::Cpu)?;
        // Types with neither an own kernel nor a SIMD candle kernel on CPU.
        let scalar_only = matches!(
            info.dtype,
            GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1
        ) && !linear::own_kernels_enabled();
        let quantized = !matches!(
            info.dtype,
            GgmlDType::Q8_0 | GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16
        );
        let convert = match self.requantize {
            Requantize::Off => false,
            Requantize::Q8_0 => scalar_only,
            Requantize::AllQ8_0 => quantized,
        };
        if convert && cols.is_multiple_of(32) {
            let f = t.dequantize(&Device::Cpu)?;
            return Ok(QTensor::quantize(&f, GgmlDType::Q8_0)?);
        }
        Ok(t)
    }

    /// The token embedding `[n_vocab, n_embd]`, kept in its file type, and the output head:
    /// `output.weight` when present, else the embedding itself (shared, not copied).
    pub fn embedding_and_output(
        &self,
        n_vocab: usize,
        d: usize,
    ) -> Result<(linear::Embedding, std::sync::Arc<linear::Linear>)> {
        let info = self.info("token_embd.weight")?;
        if info.shape != [n_vocab, d] {
            return Err(EngineError::InvalidGguf(format!(
                "token_embd.weight has shape {:?}, expected [{n_vocab}, {d}]",
                info.shape
            )));
        }
        if !self.gguf.has_tensor("output.weight") && info.converted.is_none() {
            // tied: build the head straight from the mapping and read embeddings back from
            // it, so the table is never resident twice (not even while loading)
            let bytes = self.gguf.tensor_bytes(info);
            let release = |done: &[u8]| self.gguf.release_bytes(done);
            if let Some(mut head) =
                linear::Linear::from_file_bytes_releasing(info.dtype, bytes, n_vocab, d, &release)
            {
                // (shared with the embedding below, so pinned now rather than with the rest)
                head.pin_weights();
                let head = std::sync::Arc::new(head);
                if let Some(embd) = linear::Embedding::tied(&head) {
                    self.gguf.release(info);
                    return Ok((embd, head));
                }
            }
        }
        let table = std::sync::Arc::new(self.gguf.qtensor("token_embd.weight", &Device::Cpu)?);
        if self.gguf.has_tensor("output.weight") {
            let output = linear::Linear::new(self.matrix("output.weight", n_vocab, d)?)?;
            return Ok((
                linear::Embedding::new(table, None),
                std::sync::Arc::new(output),
            ));
        }
        let mut output = linear::Linear::from_arc(table.clone())?;
        output.pin_weights();
        let output = std::sync::Arc::new(output);
        Ok((linear::Embedding::new(table, Some(&output)), output))
    }

    /// The attention and feed-forward products of block `i`, shared by every architecture
    /// with llama-style tensor names.
    pub fn projections(&self, cfg: &Config, i: usize) -> Result<Projections> {
        let d = cfg.n_embd;
        let q_dim = cfg.n_head * cfg.head_dim;
        let kv_dim = cfg.n_head_kv * cfg.head_dim;
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        let linear = |name: &str, rows: usize, cols: usize| {
            linear::Linear::new(self.matrix(&n(name), rows, cols)?)
        };
        // Phi-3 stores Q/K/V as one matrix and gate+up as one `ffn_up` of twice the width
        // (gate first): they are already stacked, so they split like fused products do.
        let qkv = if self.gguf.has_tensor(&n("attn_qkv")) {
            linear::FusedLinear::split(
                linear("attn_qkv", q_dim + 2 * kv_dim, d)?,
                vec![q_dim, kv_dim, kv_dim],
            )
        } else {
            linear::FusedLinear::new(vec![
                linear("attn_q", q_dim, d)?,
                linear("attn_k", kv_dim, d)?,
                linear("attn_v", kv_dim, d)?,
            ])
        };
        let gate_up = if self.gguf.has_tensor(&n("ffn_gate")) {
            linear::FusedLinear::new(vec![
                linear("ffn_gate", cfg.n_ff, d)?,
                linear("ffn_up", cfg.n_ff, d)?,
            ])
        } else {
            linear::FusedLinear::split(linear("ffn_up", 2 * cfg.n_ff, d)?, vec![cfg.n_ff; 2])
        };
        Ok(Projections {
            qkv,
            wo: linear("attn_output", d, q_dim)?,
            gate_up,
            down: linear("ffn_down", d, cfg.n_ff)?,
        })
    }

    /// A vector of `len` values when the file has tensor `name`.
    pub fn optional_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
        if self.gguf.has_tensor(name) {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let info = self.info(name)?;
        if info.shape.iter().product::<usize>() != len {
            return Err(EngineError::InvalidGguf(format!(
                "tensor {name} has shape {:?}, expected {len} elements",
                info.shape
            )));
        }
        self.gguf.f32_vec(name)
    }
}

/// Q/K/V (stacked), attention output, gate/up (stacked) and down products of one block.
pub struct Projections {
    pub qkv: linear::FusedLinear,
    pub wo: linear::Linear,
    pub gate_up: linear::FusedLinear,
    pub down: linear::Linear,
}

pub struct Model {
    pub config: Config,
    pub tokenizer: Arc<Tokenizer>,
    /// Built on first use: grammar compilation needs a token trie over the whole vocabulary.
    grammar: OnceLock<std::result::Result<Arc<GrammarFactory>, GrammarError>>,
    pub arch: Option<Box<dyn Architecture>>,
    /// Where the forward runs.
    pub backend: Backend,
    pub desc: String,
    pub size_bytes: u64,
    pub n_params: u64,
    pub chat_template: Option<String>,
    pub metadata: Vec<(String, String)>,
    /// DRY breaker token sets by breaker strings (a scan of the whole vocabulary each).
    dry_breakers: std::sync::Mutex<Vec<(Vec<String>, BreakerSet)>>,
}

/// The tokens that end a DRY repetition.
type BreakerSet = Arc<std::collections::HashSet<u32>>;

/// DRY breaker sets kept per model (requests mostly use the default set).
const DRY_BREAKER_CACHE: usize = 8;

fn ftype_name(code: u64) -> &'static str {
    match code {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        25 => "IQ4_NL",
        30 => "IQ4_XS",
        32 => "BF16",
        _ => "?",
    }
}

impl Model {
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Self> {
        Self::from_gguf(GgufFile::open(path)?, opts)
    }

    /// A model from a parsed GGUF file (a mapped file, or bytes in memory).
    pub fn from_gguf(gguf: GgufFile, opts: &LoadOptions) -> Result<Self> {
        let arch_name = gguf.get_str("general.architecture").unwrap_or("");
        let spec = arch_spec(arch_name);
        if !opts.vocab_only && spec.is_none() {
            return Err(EngineError::UnsupportedArchitecture(
                if arch_name.is_empty() {
                    "the file names no architecture (general.architecture is missing or empty)"
                        .to_string()
                } else {
                    arch_name.to_string()
                },
            ));
        }
        let tokenizer = Tokenizer::from_gguf(&gguf)?;
        Self::from_parts(gguf, tokenizer, opts)
    }

    /// A model from GGUF weights and metadata and a tokenizer built elsewhere (a Hugging
    /// Face checkpoint's tokenizer.json).
    pub fn from_parts(gguf: GgufFile, tokenizer: Tokenizer, opts: &LoadOptions) -> Result<Self> {
        let arch_name = gguf.get_str("general.architecture").unwrap_or("");
        let spec = arch_spec(arch_name);
        let config = Config::from_gguf(&gguf, tokenizer.n_vocab())?;
        let loader = TensorLoader::new(&gguf, opts.requantize);
        let backend = match (&opts.placement, spec.and_then(|s| s.family)) {
            // only decoders have a device path: the vocabulary and encoders stay on the CPU
            _ if opts.vocab_only => Backend::Cpu,
            (_, None) => Backend::Cpu,
            (
                Placement::Layers {
                    n_gpu_layers,
                    main_gpu,
                },
                _,
            ) => Backend::select(*n_gpu_layers, *main_gpu, config.n_layer)?,
            (Placement::Backend(b), _) => b.clone(),
        };
        let arch = match (spec, &backend) {
            _ if opts.vocab_only => None,
            (Some(spec), Backend::Cpu) => Some((spec.load)(&config, &loader)?),
            (Some(_), Backend::Tensor(device)) => Some(Box::new(tensor::TensorDecoder::load(
                &config, &loader, device,
            )?) as Box<dyn Architecture>),
            (None, _) => None,
        };
        let size_bytes = gguf.tensors.values().map(|t| t.n_bytes as u64).sum();
        let n_params = gguf
            .tensors
            .values()
            .map(|t| t.shape.iter().product::<usize>() as u64)
            .sum();
        let size_label = gguf
            .get_str("general.size_label")
            .map(str::to_owned)
            .unwrap_or_else(|| format!("{:.0}M", n_params as f64 / 1e6));
        let ftype = gguf
            .get_u64("general.file_type")
            .map(ftype_name)
            .unwrap_or("?");
        let desc = format!("{} {} {}", config.arch, size_label, ftype);
        let chat_template = gguf.get_str("tokenizer.chat_template").map(str::to_owned);
        let mut metadata: Vec<(String, String)> = gguf
            .metadata
            .iter()
            .filter(|(_, v)| !v.is_array())
            .map(|(k, v)| {
                let s = match v {
                    crate::gguf::Value::String(s) => s.clone(),
                    other => match other.as_f64() {
                        Some(f) if other.as_u64().is_some() => format!("{}", f as u64),
                        Some(f) => format!("{f}"),
                        None => format!("{:?}", other.as_bool().unwrap_or(false)),
                    },
                };
                (k.clone(), s)
            })
            .collect();
        metadata.sort();
        Ok(Model {
            config,
            tokenizer: Arc::new(tokenizer),
            grammar: OnceLock::new(),
            arch,
            backend,
            desc,
            size_bytes,
            n_params,
            chat_template,
            metadata,
            dry_breakers: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Builds one request's sampler: parameters checked, logit-bias ids checked against the
    /// vocabulary (a bias banning every token is refused), DRY breakers resolved to tokens,
    /// the grammar compiled, and end-of-generation as the token to return when bias and
    /// grammar leave no candidate.
    pub fn sampler(
        &self,
        spec: &crate::sampler::SamplerSpec,
    ) -> std::result::Result<crate::sampler::Sampler, crate::sampler::SamplerError> {
        use crate::sampler::{Sampler, SamplerError};
        let invalid = SamplerError::Invalid;
        let mut params = spec.params.clone();
        params.seed = spec.seed.unwrap_or_else(crate::sampler::random_seed);
        params.validate().map_err(invalid)?;
        let n_vocab = self.tokenizer.n_vocab();
        let mut banned = std::collections::HashSet::new();
        for &(id, bias) in &params.logit_bias {
            self.tokenizer
                .check_id(id as i64)
                .map_err(|e| invalid(format!("logit_bias: {e}")))?;
            if bias == f32::NEG_INFINITY {
                banned.insert(id);
            }
        }
        if banned.len() == n_vocab {
            return Err(invalid(
                "logit_bias bans every token of the vocabulary".into(),
            ));
        }
        let dry = params.dry_multiplier > 0.0;
        let mut sampler = Sampler::new(params);
        if dry {
            sampler =
                sampler.with_dry_breakers(self.dry_breaker_tokens(&spec.dry_sequence_breakers));
        }
        if let Some(end) = self
            .tokenizer
            .eos
            .or_else(|| self.tokenizer.eog_tokens().first().copied())
        {
            sampler = sampler.with_end_token(end);
        }
        if let Some(grammar) = &spec.grammar {
            let constraint = self
                .grammar_factory()
                .and_then(|f| f.compile_lazy(grammar, &spec.grammar_triggers))
                .map_err(SamplerError::Grammar)?;
            sampler = sampler.with_grammar(constraint);
        }
        Ok(sampler)
    }

    fn dry_breaker_tokens(&self, breakers: &[String]) -> BreakerSet {
        let mut cache = self.dry_breakers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, set)) = cache.iter().find(|(b, _)| b.as_slice() == breakers) {
            return set.clone();
        }
        let set = Arc::new(crate::sampler::dry_breaker_tokens(
            &self.tokenizer,
            breakers,
        ));
        if cache.len() == DRY_BREAKER_CACHE {
            cache.remove(0);
        }
        cache.push((breakers.to_vec(), set.clone()));
        set
    }

    /// The model's grammar compiler (built on first call, then shared).
    pub fn grammar_factory(&self) -> std::result::Result<Arc<GrammarFactory>, GrammarError> {
        self.grammar
            .get_or_init(|| GrammarFactory::new(self.tokenizer.clone()).map(Arc::new))
            .clone()
    }

    /// Compiles a grammar for this model's vocabulary.
    pub fn compile_grammar(
        &self,
        spec: &GrammarSpec,
    ) -> std::result::Result<Constraint, GrammarError> {
        self.grammar_factory()?.compile(spec)
    }

    pub fn architecture(&self) -> Result<&dyn Architecture> {
        self.arch
            .as_deref()
            .ok_or_else(|| EngineError::InvalidArgument("model was loaded with vocab_only".into()))
    }
}
