//! Hugging Face checkpoints: a directory with `config.json`, `*.safetensors` (one file, or
//! shards listed in `model.safetensors.index.json`), `tokenizer.json`, and optionally
//! `tokenizer_config.json` (chat template, special tokens), `chat_template.jinja` and
//! `generation_config.json`.
//!
//! A checkpoint is converted at load into the in-memory form of the GGUF file that llama.cpp's
//! `convert_hf_to_gguf.py` would write — its tensor names, Llama's interleaved Q/K row order,
//! Gemma's `1 + weight` norms, Llama 3's `rope_freqs`, its metadata keys — so that every
//! architecture has one loader and one forward pass, whichever format the weights came in.
//! Matrices are quantized while they are converted (the "quantize at load" of infer and
//! mistral.rs), one tensor at a time.

use crate::error::{EngineError, Result};
use crate::gguf::{GgufBuilder, GgufFile, Value};
use crate::model::{LoadOptions, Model};
use crate::tokenizer::{HfSpecials, TokenId, Tokenizer};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use memmap2::Mmap;
use serde_json::Value as Json;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The type matrices are stored in after loading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantize {
    /// As stored (f32, f16 or bf16).
    None,
    Q8_0,
    Q4_0,
    /// Q4_K; rows whose length is not a multiple of 256 fall back to Q8_0.
    Q4K,
}

impl Quantize {
    /// The default for a checkpoint of GGUF architecture `arch`: an encoder as stored, so its
    /// vectors are the ones sentence-transformers computes; a decoder Q8_0, a quarter of the
    /// bytes of f32 to read per token.
    pub fn default_for(arch: &str) -> Self {
        if arch == "bert" {
            Quantize::None
        } else {
            Quantize::Q8_0
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "none" => Some(Quantize::None),
            "q8_0" => Some(Quantize::Q8_0),
            "q4_0" => Some(Quantize::Q4_0),
            "q4_k" => Some(Quantize::Q4K),
            _ => None,
        }
    }

    /// llama.cpp's `general.file_type` for a checkpoint stored as `stored`.
    fn file_type(self, stored: GgmlDType) -> u32 {
        match (self, stored) {
            (Quantize::Q8_0, _) => 7,
            (Quantize::Q4_0, _) => 2,
            (Quantize::Q4K, _) => 15,
            (Quantize::None, GgmlDType::F32) => 0,
            (Quantize::None, GgmlDType::BF16) => 32,
            (Quantize::None, _) => 1,
        }
    }
}

fn invalid(msg: impl Into<String>) -> EngineError {
    EngineError::InvalidCheckpoint(msg.into())
}

/// Model types this loader converts, and the GGUF architecture each becomes.
const ARCHITECTURES: &[(&str, &str)] = &[
    ("llama", "llama"),
    ("mistral", "llama"),
    ("qwen2", "qwen2"),
    ("qwen3", "qwen3"),
    ("gemma3_text", "gemma3"),
    ("bert", "bert"),
];

/// Loads a checkpoint directory as a model, its matrices stored as `quantize` (`None`: the
/// architecture's default, [`Quantize::default_for`]).
pub fn load(dir: &Path, quantize: Option<Quantize>, opts: &LoadOptions) -> Result<Model> {
    let checkpoint = HfDir::open(dir)?;
    let quantize = match quantize {
        Some(q) => q,
        None => Quantize::default_for(checkpoint.architecture()?),
    };
    let gguf = checkpoint.convert(quantize, !opts.vocab_only)?;
    let tokenizer = checkpoint.tokenizer;
    Model::from_parts(gguf, tokenizer, opts).map_err(|e| match e {
        EngineError::MissingTensor(name) => invalid(format!(
            "missing tensor {} (GGUF {name}) in {}",
            hf_name(&name),
            dir.display()
        )),
        other => other,
    })
}

/// Whether `path` looks like a checkpoint directory (it holds a `config.json`).
pub fn is_checkpoint(path: &Path) -> bool {
    path.is_dir() && path.join("config.json").is_file()
}

/// One tensor of a safetensors file.
struct StTensor {
    shard: usize,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    /// Byte range in the shard's mapping.
    start: usize,
    end: usize,
}

/// A decoder's GGUF metadata, and the rope frequency factors it needs as a tensor (Llama 3.1).
type DecoderMetadata = (HashMap<String, Value>, Option<Vec<f32>>);

/// A decoder's dimensions, as config.json gives them.
#[derive(Debug, Clone, Copy)]
struct DecoderShape {
    gemma: bool,
    d: usize,
    n_layer: usize,
    n_head: usize,
    n_head_kv: usize,
    n_ff: usize,
    n_vocab: usize,
    head_dim: usize,
}

/// A checkpoint directory, read and checked but not converted.
pub struct HfDir {
    pub dir: PathBuf,
    pub config: Json,
    pub model_type: String,
    shards: Vec<(String, Mmap)>,
    tensors: BTreeMap<String, StTensor>,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<String>,
}

fn read(dir: &Path, file: &str) -> Result<Option<Vec<u8>>> {
    match std::fs::read(dir.join(file)) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(invalid(format!("cannot read {file}: {e}"))),
    }
}

fn read_json(dir: &Path, file: &str) -> Result<Option<Json>> {
    match read(dir, file)? {
        None => Ok(None),
        Some(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| invalid(format!("{file}: {e}"))),
    }
}

/// A special token in tokenizer_config.json: a string or `{"content": …}`.
fn token_text(v: &Json) -> Option<String> {
    v.as_str()
        .or_else(|| v["content"].as_str())
        .map(str::to_owned)
}

/// The mapped weight files and where each tensor lies in them.
type Shards = (Vec<(String, Mmap)>, BTreeMap<String, StTensor>);

/// The weight files: the shards the index names, or `model.safetensors`.
fn shard_files(dir: &Path, index: Option<&Json>) -> Result<Vec<String>> {
    let files: Vec<String> = match index {
        Some(index) => {
            let map = index["weight_map"]
                .as_object()
                .ok_or_else(|| invalid("model.safetensors.index.json: no weight_map"))?;
            let mut files: Vec<String> = map
                .values()
                .map(|f| f.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    invalid("model.safetensors.index.json: a file name is not a string")
                })?;
            files.sort();
            files.dedup();
            files
        }
        None if dir.join("model.safetensors").is_file() => vec!["model.safetensors".into()],
        None => {
            let bin = dir.join("pytorch_model.bin").exists();
            return Err(invalid(format!(
                "no model.safetensors or model.safetensors.index.json in {}{}",
                dir.display(),
                if bin {
                    " (only safetensors weights are read, not pytorch_model.bin)"
                } else {
                    ""
                }
            )));
        }
    };
    Ok(files)
}

/// Each weight file mapped, and where each tensor lies in them (checked against the files'
/// lengths; a tensor in two files is an error).
fn map_shards(dir: &Path, files: Vec<String>) -> Result<Shards> {
    let mut shards = Vec::with_capacity(files.len());
    let mut tensors = BTreeMap::new();
    for (i, file) in files.into_iter().enumerate() {
        // the index names files inside the directory, never paths
        if file.is_empty() || file.contains(['/', '\\', '\0']) || file.starts_with('.') {
            return Err(invalid(format!(
                "model.safetensors.index.json names {file:?}, not a file in the directory"
            )));
        }
        let f = std::fs::File::open(dir.join(&file))
            .map_err(|e| invalid(format!("cannot open {file}: {e}")))?;
        // SAFETY: a read-only private mapping of a file; as for GGUF files, a concurrent
        // truncation by another process is the documented mmap caveat. Every range read
        // from it is checked against its length below.
        let map =
            unsafe { Mmap::map(&f) }.map_err(|e| invalid(format!("cannot map {file}: {e}")))?;
        let (header, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| invalid(format!("{file}: {e}")))?;
        for (name, t) in meta.tensors() {
            let start = 8 + header + t.data_offsets.0;
            let end = 8 + header + t.data_offsets.1;
            if end > map.len() || start > end {
                return Err(invalid(format!(
                    "{file}: tensor {name} lies beyond the end of the file"
                )));
            }
            if tensors.contains_key(&name) {
                return Err(invalid(format!(
                    "tensor {name} appears in more than one file"
                )));
            }
            tensors.insert(
                name,
                StTensor {
                    shard: i,
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    start,
                    end,
                },
            );
        }
        shards.push((file, map));
    }
    Ok((shards, tensors))
}

/// Every tensor the index lists lies in the file it names.
fn check_index(
    index: &Json,
    shards: &[(String, Mmap)],
    tensors: &BTreeMap<String, StTensor>,
) -> Result<()> {
    for (name, file) in index["weight_map"].as_object().into_iter().flatten() {
        let listed = file.as_str().unwrap_or("");
        match tensors.get(name) {
            Some(t) if shards[t.shard].0 == listed => {}
            _ => {
                return Err(invalid(format!(
                    "model.safetensors.index.json lists {name} in {listed}, which does not hold it"
                )))
            }
        }
    }
    Ok(())
}

/// The tokenizer (`tokenizer.json`, with the special tokens of `tokenizer_config.json` and
/// `generation_config.json`) and the chat template (`chat_template.jinja`, else
/// `tokenizer_config.json`'s).
fn read_tokenizer(dir: &Path, config: &Json) -> Result<(Tokenizer, Option<String>)> {
    let tokenizer_config = read_json(dir, "tokenizer_config.json")?.unwrap_or(Json::Null);
    let generation = read_json(dir, "generation_config.json")?.unwrap_or(Json::Null);
    let eos_ids: Vec<TokenId> = match &generation["eos_token_id"] {
        Json::Array(a) => a
            .iter()
            .filter_map(|v| v.as_u64())
            .map(|v| v as TokenId)
            .collect(),
        v => v.as_u64().map(|v| v as TokenId).into_iter().collect(),
    };
    let specials = HfSpecials {
        bos: token_text(&tokenizer_config["bos_token"]),
        eos: token_text(&tokenizer_config["eos_token"]),
        add_bos: tokenizer_config["add_bos_token"].as_bool(),
        add_eos: tokenizer_config["add_eos_token"].as_bool(),
        eos_ids,
    };
    let json = read(dir, "tokenizer.json")?.ok_or_else(|| {
        invalid(format!(
            "no tokenizer.json in {} (the tokenizer is read from it)",
            dir.display()
        ))
    })?;
    let n_vocab = config["vocab_size"].as_u64().unwrap_or(0) as usize;
    let tokenizer = Tokenizer::from_hf_json(&json, n_vocab, &specials)?;
    let chat_template = match read(dir, "chat_template.jinja")? {
        Some(b) => {
            Some(String::from_utf8(b).map_err(|_| invalid("chat_template.jinja is not UTF-8"))?)
        }
        None => match &tokenizer_config["chat_template"] {
            Json::String(s) => Some(s.clone()),
            // named templates: the default one
            Json::Array(a) => a
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(str::to_owned),
            _ => None,
        },
    };
    Ok((tokenizer, chat_template))
}

impl HfDir {
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(invalid(format!("{} is not a directory", dir.display())));
        }
        let config = read_json(dir, "config.json")?
            .ok_or_else(|| invalid(format!("no config.json in {}", dir.display())))?;
        let model_type = config["model_type"]
            .as_str()
            .ok_or_else(|| invalid("config.json: no model_type"))?
            .to_string();
        let index = read_json(dir, "model.safetensors.index.json")?;
        let files = shard_files(dir, index.as_ref())?;
        let (shards, tensors) = map_shards(dir, files)?;
        if let Some(index) = &index {
            check_index(index, &shards, &tensors)?;
        }
        let (tokenizer, chat_template) = read_tokenizer(dir, &config)?;
        Ok(HfDir {
            dir: dir.to_path_buf(),
            config,
            model_type,
            shards,
            tensors,
            tokenizer,
            chat_template,
        })
    }

    /// The checkpoint's tensor names with their shapes and stored types.
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &[usize], String)> {
        self.tensors
            .iter()
            .map(|(n, t)| (n.as_str(), t.shape.as_slice(), format!("{:?}", t.dtype)))
    }

    fn file_of(&self, t: &StTensor) -> &str {
        &self.shards[t.shard].0
    }

    /// A tensor's values as f32.
    fn values(&self, name: &str, t: &StTensor) -> Result<Vec<f32>> {
        let bytes = &self.shards[t.shard].1[t.start..t.end];
        let n: usize = t.shape.iter().product();
        let width = match t.dtype {
            safetensors::Dtype::F32 => 4,
            safetensors::Dtype::F16 | safetensors::Dtype::BF16 => 2,
            other => {
                return Err(EngineError::Unsupported(format!(
                    "tensor type: {name} in {} is {other:?} (f32, f16 and bf16 load)",
                    self.file_of(t)
                )))
            }
        };
        if bytes.len() != n * width {
            return Err(invalid(format!(
                "tensor {name} in {}: {} bytes for shape {:?}",
                self.file_of(t),
                bytes.len(),
                t.shape
            )));
        }
        let chunks = bytes.chunks_exact(width);
        Ok(match t.dtype {
            safetensors::Dtype::F32 => chunks
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            safetensors::Dtype::F16 => chunks
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => chunks
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        })
    }

    /// The type the weights are stored in (the first non-f32 tensor's; f32 if all are).
    fn stored_type(&self) -> GgmlDType {
        match self
            .tensors
            .values()
            .map(|t| t.dtype)
            .find(|t| *t != safetensors::Dtype::F32)
        {
            None => GgmlDType::F32,
            Some(safetensors::Dtype::BF16) => GgmlDType::BF16,
            Some(_) => GgmlDType::F16,
        }
    }

    /// `general.name`: the directory's name.
    fn name(&self) -> Value {
        Value::String(
            self.dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        )
    }

    fn cfg_u64(&self, key: &str) -> Result<u64> {
        self.config[key]
            .as_u64()
            .filter(|v| *v > 0)
            .ok_or_else(|| invalid(format!("config.json: missing or invalid {key}")))
    }

    fn cfg_f64(&self, key: &str, default: f64) -> f64 {
        self.config[key].as_f64().unwrap_or(default)
    }

    /// The GGUF file llama.cpp's converter would write for this checkpoint.
    /// `weights: false` converts the metadata only (a vocabulary-only load).
    pub fn convert(&self, quantize: Quantize, weights: bool) -> Result<GgufFile> {
        let arch = self.architecture()?;
        if arch == "bert" {
            return self.convert_bert(quantize, weights);
        }
        let shape = self.decoder_shape(arch)?;
        let (meta, rope_freqs) = self.decoder_metadata(arch, &shape, quantize)?;
        let mut out = GgufBuilder::new(meta);
        if weights {
            self.put_decoder_tensors(&mut out, arch, &shape, quantize)?;
            if let Some(f) = rope_freqs {
                out.add(
                    "rope_freqs.weight",
                    &[f.len()],
                    GgmlDType::F32,
                    &f32_bytes(&f),
                )?;
            }
        }
        Ok(out.finish())
    }

    /// llama.cpp's architecture for the checkpoint's `model_type`.
    fn architecture(&self) -> Result<&'static str> {
        ARCHITECTURES
            .iter()
            .find(|(t, _)| *t == self.model_type)
            .map(|(_, a)| *a)
            .ok_or_else(|| {
                EngineError::UnsupportedArchitecture(format!(
                    "{} (config.json model_type; Hugging Face checkpoints load for {}{})",
                    self.model_type,
                    ARCHITECTURES
                        .iter()
                        .map(|(t, _)| *t)
                        .collect::<Vec<_>>()
                        .join(", "),
                    if self.model_type == "bert" {
                        "; BERT encoders are not run yet"
                    } else {
                        ""
                    }
                ))
            })
    }

    /// A decoder's dimensions from config.json, checked: what the converter supports and
    /// what is consistent.
    fn decoder_shape(&self, arch: &str) -> Result<DecoderShape> {
        let gemma = arch == "gemma3";
        let d = self.cfg_u64("hidden_size")? as usize;
        let n_layer = self.cfg_u64("num_hidden_layers")? as usize;
        let n_head = self.cfg_u64("num_attention_heads")? as usize;
        let n_head_kv = self.config["num_key_value_heads"]
            .as_u64()
            .unwrap_or(n_head as u64) as usize;
        let n_ff = self.cfg_u64("intermediate_size")? as usize;
        let n_vocab = self.cfg_u64("vocab_size")? as usize;
        let head_dim = self.config["head_dim"]
            .as_u64()
            .map(|v| v as usize)
            .unwrap_or(d / n_head.max(1));
        if n_head_kv == 0
            || !n_head.is_multiple_of(n_head_kv)
            || head_dim == 0
            || !head_dim.is_multiple_of(2)
        {
            return Err(invalid(
                "config.json: inconsistent attention heads / head_dim",
            ));
        }
        let act = self.config["hidden_act"]
            .as_str()
            .or(self.config["hidden_activation"].as_str())
            .unwrap_or(if gemma { "gelu_pytorch_tanh" } else { "silu" });
        let expected_act = if gemma { "gelu_pytorch_tanh" } else { "silu" };
        if act != expected_act {
            return Err(EngineError::Unsupported(format!(
                "activation: {act} (config.json hidden_act)"
            )));
        }
        if self.config["num_experts"].as_u64().unwrap_or(0) > 0
            || self.config["num_local_experts"].as_u64().unwrap_or(0) > 0
        {
            return Err(EngineError::Unsupported(
                "mixture of experts (config.json num_experts)".into(),
            ));
        }

        Ok(DecoderShape {
            gemma,
            d,
            n_layer,
            n_head,
            n_head_kv,
            n_ff,
            n_vocab,
            head_dim,
        })
    }

    /// The decoder's GGUF metadata, and the rope frequency factors Llama 3.1 scaling needs as
    /// a tensor.
    fn decoder_metadata(
        &self,
        arch: &str,
        shape: &DecoderShape,
        quantize: Quantize,
    ) -> Result<DecoderMetadata> {
        let DecoderShape {
            gemma,
            d,
            n_layer,
            n_head,
            n_head_kv,
            n_ff,
            head_dim,
            ..
        } = *shape;
        let key = |k: &str| format!("{arch}.{k}");
        let mut meta: HashMap<String, Value> = HashMap::new();
        let mut put = |k: String, v: Value| {
            meta.insert(k, v);
        };
        put("general.architecture".into(), Value::String(arch.into()));
        put("general.name".into(), self.name());
        put(
            key("context_length"),
            Value::U64(
                self.config["max_position_embeddings"]
                    .as_u64()
                    .unwrap_or(4096),
            ),
        );
        put(key("embedding_length"), Value::U64(d as u64));
        put(key("block_count"), Value::U64(n_layer as u64));
        put(key("feed_forward_length"), Value::U64(n_ff as u64));
        put(key("attention.head_count"), Value::U64(n_head as u64));
        put(key("attention.head_count_kv"), Value::U64(n_head_kv as u64));
        put(key("attention.key_length"), Value::U64(head_dim as u64));
        put(key("attention.value_length"), Value::U64(head_dim as u64));
        put(key("rope.dimension_count"), Value::U64(head_dim as u64));
        put(
            key("attention.layer_norm_rms_epsilon"),
            Value::F64(self.cfg_f64("rms_norm_eps", 1e-6)),
        );
        let rope_base = self.cfg_f64("rope_theta", 10_000.0);
        put(key("rope.freq_base"), Value::F64(rope_base));

        let mut rope_freqs: Option<Vec<f32>> = None;
        let scaling = &self.config["rope_scaling"];
        if !scaling.is_null() {
            let kind = scaling["rope_type"]
                .as_str()
                .or(scaling["type"].as_str())
                .unwrap_or("");
            let factor = scaling["factor"].as_f64().unwrap_or(1.0);
            match kind {
                "linear" => {
                    put(key("rope.scaling.type"), Value::String("linear".into()));
                    put(key("rope.scaling.factor"), Value::F64(factor));
                }
                "llama3" if arch == "llama" => {
                    rope_freqs = Some(llama3_rope_factors(scaling, rope_base, head_dim));
                }
                "default" => {}
                other => {
                    return Err(EngineError::Unsupported(format!(
                        "rope scaling: {other} (config.json rope_scaling)"
                    )))
                }
            }
        }
        if gemma {
            let window = self.config["sliding_window"].as_u64().unwrap_or(512);
            put(key("attention.sliding_window"), Value::U64(window));
            put(
                key("rope.freq_base_swa"),
                Value::F64(self.cfg_f64("rope_local_base_freq", 10_000.0)),
            );
            match self.config["layer_types"].as_array() {
                Some(types) => {
                    let flags = types
                        .iter()
                        .map(|t| Value::Bool(t.as_str() == Some("sliding_attention")))
                        .collect();
                    put(key("attention.sliding_window_pattern"), Value::Array(flags));
                }
                None => put(
                    key("attention.sliding_window_pattern"),
                    Value::U64(self.config["sliding_window_pattern"].as_u64().unwrap_or(6)),
                ),
            }
            let qpas = self.config["query_pre_attn_scalar"]
                .as_u64()
                .unwrap_or(head_dim as u64);
            if qpas as usize != head_dim {
                return Err(EngineError::Unsupported(format!(
                    "attention scale: query_pre_attn_scalar {qpas} differs from head_dim {head_dim}"
                )));
            }
            for k in ["attn_logit_softcapping", "final_logit_softcapping"] {
                if !self.config[k].is_null() {
                    return Err(EngineError::Unsupported(format!(
                        "gemma3 {k} (config.json)"
                    )));
                }
            }
        }
        put(
            "general.file_type".into(),
            Value::U32(quantize.file_type(self.stored_type())),
        );
        if let Some(t) = &self.chat_template {
            put("tokenizer.chat_template".into(), Value::String(t.clone()));
        }

        Ok((meta, rope_freqs))
    }

    /// Every weight under its GGUF name, shape-checked against config.json, in llama.cpp's
    /// layout (Llama's Q/K rows interleaved, Gemma's norms as `1 + weight`), quantized.
    fn put_decoder_tensors(
        &self,
        out: &mut GgufBuilder,
        arch: &str,
        shape: &DecoderShape,
        quantize: Quantize,
    ) -> Result<()> {
        let DecoderShape {
            gemma,
            d,
            n_head,
            n_head_kv,
            n_ff,
            n_vocab,
            head_dim,
            ..
        } = *shape;
        let tied = self.config["tie_word_embeddings"]
            .as_bool()
            .unwrap_or(gemma);
        let q_dim = n_head * head_dim;
        let kv_dim = n_head_kv * head_dim;
        for (name, t) in &self.tensors {
            if name.ends_with("rotary_emb.inv_freq") || (tied && name == "lm_head.weight") {
                continue;
            }
            let file = self.file_of(t);
            let gguf = gguf_name(name, gemma).ok_or_else(|| {
                EngineError::Unsupported(format!(
                    "tensor: {name} in {file} (no {arch} tensor corresponds to it)"
                ))
            })?;
            // "blk.3.attn_q.weight" → "attn_q"
            let (stem, suffix) = gguf.rsplit_once('.').unwrap_or((&gguf, ""));
            let role = match stem.strip_prefix("blk.") {
                Some(r) => r.split_once('.').map(|(_, m)| m).unwrap_or(r),
                None => stem,
            };
            let bias = suffix == "bias";
            let expected: Vec<usize> = match (role, bias) {
                ("token_embd" | "output", false) => vec![n_vocab, d],
                ("attn_q", false) => vec![q_dim, d],
                ("attn_k" | "attn_v", false) => vec![kv_dim, d],
                ("attn_q", true) => vec![q_dim],
                ("attn_k" | "attn_v", true) => vec![kv_dim],
                ("attn_output", false) => vec![d, q_dim],
                ("ffn_gate" | "ffn_up", false) => vec![n_ff, d],
                ("ffn_down", false) => vec![d, n_ff],
                ("attn_q_norm" | "attn_k_norm", false) => vec![head_dim],
                _ => vec![d],
            };
            if t.shape != expected {
                return Err(invalid(format!(
                    "tensor {name} in {file} has shape {:?}; config.json implies {expected:?}",
                    t.shape
                )));
            }
            let mut values = self.values(name, t)?;
            if arch == "llama" && !bias && (role == "attn_q" || role == "attn_k") {
                // llama.cpp's llama rotates interleaved pairs; Hugging Face's halves
                let heads = if role == "attn_q" { n_head } else { n_head_kv };
                values = permute_rows(&values, heads, head_dim, d);
            }
            if gemma && role.ends_with("norm") {
                // Gemma's RMSNorm multiplies by (1 + weight); GGUF files store 1 + weight
                values.iter_mut().for_each(|v| *v += 1.0);
            }
            self.put_tensor(out, &gguf, &t.shape, t.dtype, values, quantize)?;
        }
        Ok(())
    }

    /// A BERT encoder as llama.cpp's converter writes it (`bert`), with the pooling of the
    /// sentence-transformers layout when the directory has one (`1_Pooling/config.json`;
    /// mean otherwise).
    fn convert_bert(&self, quantize: Quantize, weights: bool) -> Result<GgufFile> {
        let act = self.config["hidden_act"].as_str().unwrap_or("gelu");
        if act != "gelu" {
            return Err(EngineError::Unsupported(format!(
                "activation: {act} (config.json hidden_act)"
            )));
        }
        let pos_type = self.config["position_embedding_type"]
            .as_str()
            .unwrap_or("absolute");
        if pos_type != "absolute" {
            return Err(EngineError::Unsupported(format!(
                "position embeddings: {pos_type} (config.json position_embedding_type)"
            )));
        }
        let pooling = read_json(&self.dir, "1_Pooling/config.json")?
            .map(|p| {
                if p["pooling_mode_cls_token"] == true {
                    2
                } else if p["pooling_mode_lasttoken"] == true {
                    3
                } else {
                    1
                }
            })
            .unwrap_or(1);
        let n_head = self.cfg_u64("num_attention_heads")?;
        let mut meta: HashMap<String, Value> = HashMap::new();
        for (k, v) in [
            ("general.architecture", Value::String("bert".into())),
            (
                "bert.context_length",
                Value::U64(self.cfg_u64("max_position_embeddings")?),
            ),
            (
                "bert.embedding_length",
                Value::U64(self.cfg_u64("hidden_size")?),
            ),
            (
                "bert.block_count",
                Value::U64(self.cfg_u64("num_hidden_layers")?),
            ),
            (
                "bert.feed_forward_length",
                Value::U64(self.cfg_u64("intermediate_size")?),
            ),
            ("bert.attention.head_count", Value::U64(n_head)),
            ("bert.attention.head_count_kv", Value::U64(n_head)),
            (
                "bert.attention.layer_norm_epsilon",
                Value::F64(self.cfg_f64("layer_norm_eps", 1e-12)),
            ),
            ("bert.attention.causal", Value::Bool(false)),
            ("bert.pooling_type", Value::U32(pooling)),
            (
                "general.file_type",
                Value::U32(quantize.file_type(self.stored_type())),
            ),
        ] {
            meta.insert(k.to_string(), v);
        }
        meta.insert("general.name".into(), self.name());
        let mut out = GgufBuilder::new(meta);
        for (name, t) in self.tensors.iter().filter(|_| weights) {
            let short = name.strip_prefix("bert.").unwrap_or(name);
            if short == "embeddings.position_ids" || short.starts_with("pooler.") {
                continue;
            }
            let gguf = bert_name(short).ok_or_else(|| {
                EngineError::Unsupported(format!(
                    "tensor: {name} in {} (no bert tensor corresponds to it)",
                    self.file_of(t)
                ))
            })?;
            let values = self.values(name, t)?;
            // the embedding tables are looked up, not multiplied: kept as stored
            let q = if gguf.starts_with("blk.") {
                quantize
            } else {
                Quantize::None
            };
            self.put_tensor(&mut out, &gguf, &t.shape, t.dtype, values, q)?;
        }
        Ok(out.finish())
    }

    fn put_tensor(
        &self,
        out: &mut GgufBuilder,
        name: &str,
        shape: &[usize],
        stored: safetensors::Dtype,
        values: Vec<f32>,
        quantize: Quantize,
    ) -> Result<()> {
        if shape.len() != 2 {
            return out.add(name, shape, GgmlDType::F32, &f32_bytes(&values));
        }
        let cols = shape[1];
        let target = match quantize {
            Quantize::Q8_0 if cols.is_multiple_of(32) => Some(GgmlDType::Q8_0),
            Quantize::Q4_0 if cols.is_multiple_of(32) => Some(GgmlDType::Q4_0),
            Quantize::Q4K if cols.is_multiple_of(256) => Some(GgmlDType::Q4K),
            Quantize::Q4K if cols.is_multiple_of(32) => Some(GgmlDType::Q8_0),
            _ => None,
        };
        match target {
            Some(dtype) => {
                let t = Tensor::from_vec(values, shape, &Device::Cpu)?;
                let q = QTensor::quantize(&t, dtype)?;
                out.add(name, shape, dtype, &q.data()?)
            }
            None => match stored {
                safetensors::Dtype::BF16 => {
                    let b: Vec<u8> = values
                        .iter()
                        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                        .collect();
                    out.add(name, shape, GgmlDType::BF16, &b)
                }
                safetensors::Dtype::F16 => {
                    let b: Vec<u8> = values
                        .iter()
                        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                        .collect();
                    out.add(name, shape, GgmlDType::F16, &b)
                }
                _ => out.add(name, shape, GgmlDType::F32, &f32_bytes(&values)),
            },
        }
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// convert_hf_to_gguf's `permute`: the rows of each head, `[2, head_dim / 2]` → `[head_dim / 2, 2]`.
fn permute_rows(w: &[f32], heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let dst = (h * head_dim + i * 2 + j) * cols;
                let src = (h * head_dim + j * half + i) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

/// Llama 3.1's per-frequency rope factors (convert_hf_to_gguf's `rope_freqs`).
fn llama3_rope_factors(s: &Json, base: f64, head_dim: usize) -> Vec<f32> {
    let factor = s["factor"].as_f64().unwrap_or(8.0);
    let low = s["low_freq_factor"].as_f64().unwrap_or(1.0);
    let high = s["high_freq_factor"].as_f64().unwrap_or(4.0);
    let old = s["original_max_position_embeddings"]
        .as_f64()
        .unwrap_or(8192.0);
    let (low_wavelen, high_wavelen) = (old / low, old / high);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / base.powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            f as f32
        })
        .collect()
}

/// Per-layer tensor names: Hugging Face's → GGUF's (Gemma's norms around attention and the
/// feed-forward have their own names).
const LAYER_NAMES: &[(&str, &str)] = &[
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
    ("input_layernorm", "attn_norm"),
    ("pre_feedforward_layernorm", "ffn_norm"),
    ("post_feedforward_layernorm", "post_ffw_norm"),
];

/// The GGUF name of a Hugging Face tensor.
fn gguf_name(hf: &str, gemma: bool) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let mapped = match module {
        "post_attention_layernorm" if gemma => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        m => LAYER_NAMES.iter().find(|(h, _)| *h == m)?.1,
    };
    Some(format!("blk.{layer}.{mapped}.{suffix}"))
}

/// The GGUF name of a BERT tensor (its Hugging Face name without the `bert.` prefix).
fn bert_name(hf: &str) -> Option<String> {
    let (stem, suffix) = hf.rsplit_once('.')?;
    // old checkpoints name layer-norm parameters gamma/beta
    let suffix = match suffix {
        "gamma" => "weight",
        "beta" => "bias",
        s @ ("weight" | "bias") => s,
        _ => return None,
    };
    let top = match stem {
        "embeddings.word_embeddings" => Some("token_embd"),
        "embeddings.position_embeddings" => Some("position_embd"),
        "embeddings.token_type_embeddings" => Some("token_types"),
        "embeddings.LayerNorm" => Some("token_embd_norm"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(format!("{t}.{suffix}"));
    }
    let rest = stem.strip_prefix("encoder.layer.")?;
    let (layer, module) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let mapped = match module {
        "attention.self.query" => "attn_q",
        "attention.self.key" => "attn_k",
        "attention.self.value" => "attn_v",
        "attention.output.dense" => "attn_output",
        "attention.output.LayerNorm" => "attn_output_norm",
        "intermediate.dense" => "ffn_up",
        "output.dense" => "ffn_down",
        "output.LayerNorm" => "layer_output_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{mapped}.{suffix}"))
}

/// The Hugging Face name of a GGUF tensor (for errors about missing tensors).
fn hf_name(gguf: &str) -> String {
    match gguf {
        "token_embd.weight" => return "model.embed_tokens.weight".into(),
        "output_norm.weight" => return "model.norm.weight".into(),
        "output.weight" => return "lm_head.weight".into(),
        _ => {}
    }
    let parsed = gguf.strip_prefix("blk.").and_then(|r| {
        let (layer, rest) = r.split_once('.')?;
        let (module, suffix) = rest.rsplit_once('.')?;
        let hf = match module {
            "ffn_norm" => "post_attention_layernorm",
            "post_attention_norm" => "post_attention_layernorm",
            m => LAYER_NAMES.iter().find(|(_, g)| *g == m)?.0,
        };
        Some(format!("model.layers.{layer}.{hf}.{suffix}"))
    });
    parsed.unwrap_or_else(|| gguf.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for hf in [
            "model.layers.3.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.bias",
            "model.layers.11.mlp.down_proj.weight",
            "model.layers.2.input_layernorm.weight",
        ] {
            let g = gguf_name(hf, false).unwrap();
            assert_eq!(hf_name(&g), hf);
        }
        assert_eq!(
            gguf_name("model.layers.1.post_attention_layernorm.weight", true).unwrap(),
            "blk.1.post_attention_norm.weight"
        );
        assert_eq!(
            gguf_name("model.layers.1.post_attention_layernorm.weight", false).unwrap(),
            "blk.1.ffn_norm.weight"
        );
        assert_eq!(
            gguf_name("model.layers.1.mlp.experts.0.w1.weight", false),
            None
        );
    }

    #[test]
    fn permutation_interleaves_halves() {
        // one head of 4 dims, 1 column: rows [a0 a1 b0 b1] → [a0 b0 a1 b1]
        assert_eq!(
            permute_rows(&[0., 1., 2., 3.], 1, 4, 1),
            vec![0., 2., 1., 3.]
        );
    }
}
