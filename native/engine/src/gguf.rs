//! A bounds-checked GGUF reader.
//!
//! candle's reader trusts the lengths it reads, so a hostile file can ask for a multi-exabyte
//! allocation and abort the process. Every length here is checked against the bytes that are
//! actually left in the file before anything is allocated, and tensor data is only ever
//! borrowed from the memory map.

use crate::error::{EngineError, Result};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;
use memmap2::Mmap;
use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_TENSOR_DIMS: u32 = 4;
const MAX_ARRAY_NESTING: usize = 4;
const MAX_TENSORS: u64 = 1 << 20;

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Arrays of other types (nested arrays, integers other than i32, ...).
    Array(Vec<Value>),
    /// Compact forms of the large arrays of tokenizer metadata (a 262k-token vocabulary as
    /// `Value`s is ~35 MiB; as these, ~5 MiB).
    Strings(StrArray),
    I32s(Vec<i32>),
    F32s(Vec<f32>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    pub fn is_array(&self) -> bool {
        matches!(
            self,
            Value::Array(_) | Value::Strings(_) | Value::I32s(_) | Value::F32s(_)
        )
    }

    /// An array of strings.
    pub fn as_strings(&self) -> Option<&StrArray> {
        match self {
            Value::Strings(a) => Some(a),
            _ => None,
        }
    }

    /// An array of numbers, whatever their stored type (`None` if any item is not one).
    pub fn numbers(&self) -> Option<Vec<f64>> {
        match self {
            Value::I32s(a) => Some(a.iter().map(|&v| v as f64).collect()),
            Value::F32s(a) => Some(a.iter().map(|&v| v as f64).collect()),
            Value::Array(a) => a.iter().map(Value::as_f64).collect(),
            _ => None,
        }
    }
}

/// Strings stored back to back: item `i` is `data[ends[i - 1]..ends[i]]`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StrArray {
    data: String,
    ends: Vec<usize>,
}

impl StrArray {
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        Some(&self.data[start..end])
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        (0..self.len()).filter_map(|i| self.get(i))
    }

    pub(crate) fn push(&mut self, s: &str) {
        self.data.push_str(s);
        self.ends.push(self.data.len());
    }
}

#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in candle order (outermost first), i.e. GGUF's order reversed.
    pub shape: Vec<usize>,
    /// The type of the tensor [`GgufFile::qtensor`] returns: the file's, or Q8_0 for the
    /// types candle has no kernels for (`converted`).
    pub dtype: GgmlDType,
    /// A file type that is converted to `dtype` when loaded (the bytes are in this type).
    pub converted: Option<Iq4>,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    pub n_bytes: usize,
}

pub struct GgufFile {
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    pub file_size: usize,
    data: Storage,
}

/// The file's bytes: a read-only mapping of the file, or bytes in memory (tests, fuzzing).
enum Storage {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Storage {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Storage::Map(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

fn bad(msg: impl Into<String>) -> EngineError {
    EngineError::InvalidGguf(msg.into())
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(bad(format!(
                "truncated: need {n} bytes at offset {}, {} left",
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A length that must be satisfiable by the bytes left, given a minimum item size.
    fn len(&mut self, min_item_size: usize) -> Result<usize> {
        let n = self.u64()?;
        let max = (self.remaining() / min_item_size.max(1)) as u64;
        if n > max {
            return Err(bad(format!(
                "length {n} at offset {} exceeds the {} bytes left in the file",
                self.pos - 8,
                self.remaining()
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String> {
        let n = self.len(1)?;
        let bytes = self.take(n)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(self.array::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                if depth >= MAX_ARRAY_NESTING {
                    return Err(bad("metadata arrays nested too deeply"));
                }
                let item_ty = self.u32()?;
                let min_size = value_min_size(item_ty)?;
                let n = self.len(min_size)?;
                match item_ty {
                    5 => Value::I32s(
                        (0..n)
                            .map(|_| Ok(i32::from_le_bytes(self.array()?)))
                            .collect::<Result<_>>()?,
                    ),
                    6 => Value::F32s(
                        (0..n)
                            .map(|_| Ok(f32::from_le_bytes(self.array()?)))
                            .collect::<Result<_>>()?,
                    ),
                    8 => {
                        let mut items = StrArray {
                            data: String::new(),
                            ends: Vec::with_capacity(n),
                        };
                        for _ in 0..n {
                            let len = self.len(1)?;
                            items.push(&String::from_utf8_lossy(self.take(len)?));
                        }
                        Value::Strings(items)
                    }
                    _ => {
                        let mut items = Vec::with_capacity(n);
                        for _ in 0..n {
                            items.push(self.value(item_ty, depth + 1)?);
                        }
                        Value::Array(items)
                    }
                }
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(bad(format!("unknown metadata value type {other}"))),
        })
    }
}

fn value_min_size(ty: u32) -> Result<usize> {
    Ok(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        10..=12 => 8,
        other => return Err(bad(format!("unknown metadata value type {other}"))),
    })
}

/// The non-linear 4-bit types, which candle cannot hold: they are converted to Q8_0 at load
/// (their values are 16 int8 levels × a scale, so Q8_0 keeps them within one rounding step),
/// at 8.5 bits per weight instead of 4.5 / 4.25, and run on the Q8_0 kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Iq4 {
    /// IQ4_NL: blocks of 32, an f16 scale and 16 bytes of level indices.
    Nl,
    /// IQ4_XS: super-blocks of 256, an f16 scale, 6-bit scales per 32 and level indices.
    Xs,
}

/// llama.cpp's `kvalues_iq4nl`.
const IQ4_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

impl Iq4 {
    fn block(self) -> (u64, u64) {
        match self {
            Iq4::Nl => (32, 18),
            Iq4::Xs => (256, 136),
        }
    }

    /// Dequantizes whole blocks (`bytes.len()` a multiple of the block size) into `out`.
    pub fn dequantize(self, bytes: &[u8], out: &mut Vec<f32>) {
        let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let levels = |out: &mut Vec<f32>, qs: &[u8], d: f32| {
            out.extend(qs.iter().map(|q| d * IQ4_LEVELS[(q & 0xf) as usize] as f32));
            out.extend(qs.iter().map(|q| d * IQ4_LEVELS[(q >> 4) as usize] as f32));
        };
        match self {
            Iq4::Nl => {
                for b in bytes.chunks_exact(18) {
                    levels(out, &b[2..18], f16(b));
                }
            }
            Iq4::Xs => {
                for b in bytes.chunks_exact(136) {
                    let d = f16(b);
                    let scales_h = u16::from_le_bytes([b[2], b[3]]);
                    let (scales_l, qs) = (&b[4..8], &b[8..136]);
                    for ib in 0..8 {
                        let ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0xf) as i32
                            | ((((scales_h >> (2 * ib)) & 3) as i32) << 4);
                        levels(out, &qs[ib * 16..ib * 16 + 16], d * (ls - 32) as f32);
                    }
                }
            }
        }
    }
}

/// A tensor type id: the type candle holds and, for converted types, the file's.
fn tensor_type(t: u32) -> Result<(GgmlDType, Option<Iq4>)> {
    match t {
        20 => Ok((GgmlDType::Q8_0, Some(Iq4::Nl))),
        23 => Ok((GgmlDType::Q8_0, Some(Iq4::Xs))),
        other => Ok((ggml_dtype(other)?, None)),
    }
}

fn ggml_dtype(t: u32) -> Result<GgmlDType> {
    Ok(match t {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        other => return Err(bad(format!("unsupported tensor type {other}"))),
    })
}

/// Builds a GGUF file in memory (a Hugging Face checkpoint converted at load): metadata,
/// then tensors appended one by one into a single buffer.
pub struct GgufBuilder {
    metadata: HashMap<String, Value>,
    tensors: HashMap<String, TensorInfo>,
    data: Vec<u8>,
}

impl GgufBuilder {
    pub fn new(metadata: HashMap<String, Value>) -> Self {
        GgufBuilder {
            metadata,
            tensors: HashMap::new(),
            data: Vec::new(),
        }
    }

    /// Appends a tensor of `dtype` (whose bytes must be `shape`'s worth; `shape` in candle
    /// order, outermost first).
    pub fn add(
        &mut self,
        name: &str,
        shape: &[usize],
        dtype: GgmlDType,
        bytes: &[u8],
    ) -> Result<()> {
        let n: usize = shape.iter().product();
        let block = dtype.block_size();
        let row = shape.last().copied().unwrap_or(0);
        if row % block != 0 || n / block * dtype.type_size() != bytes.len() {
            return Err(bad(format!(
                "tensor {name}: {} bytes do not hold {shape:?} of {dtype:?}",
                bytes.len()
            )));
        }
        let offset =
            self.data.len().div_ceil(DEFAULT_ALIGNMENT as usize) * DEFAULT_ALIGNMENT as usize;
        self.data.resize(offset, 0);
        self.data.extend_from_slice(bytes);
        self.tensors.insert(
            name.to_string(),
            TensorInfo {
                name: name.to_string(),
                shape: shape.to_vec(),
                dtype,
                converted: None,
                offset,
                n_bytes: bytes.len(),
            },
        );
        Ok(())
    }

    pub fn finish(mut self) -> GgufFile {
        self.data.shrink_to_fit();
        GgufFile {
            version: 3,
            metadata: self.metadata,
            tensors: self.tensors,
            file_size: self.data.len(),
            data: Storage::Owned(self.data),
        }
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| bad(format!("cannot open: {e}")))?;
        let meta = file.metadata().map_err(|e| bad(e.to_string()))?;
        if !meta.is_file() {
            return Err(bad("not a regular file"));
        }
        if meta.len() < 24 {
            return Err(bad(format!("file too small ({} bytes)", meta.len())));
        }
        // SAFETY: the map is read-only and private to this struct; a concurrent truncation of
        // the file by another process could fault, which is the documented mmap caveat shared
        // by every GGUF loader (llama.cpp included). Lengths are validated against the size
        // observed here.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| bad(format!("cannot map: {e}")))?;
        Self::parse(Storage::Map(mmap))
    }

    /// A GGUF file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        if bytes.len() < 24 {
            return Err(bad(format!("file too small ({} bytes)", bytes.len())));
        }
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(data: Storage) -> Result<Self> {
        let file_size = data.len();
        let mut r = Reader { buf: &data, pos: 0 };
        if r.take(4)? != GGUF_MAGIC {
            return Err(bad("bad magic (not a GGUF file)"));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(bad(format!("unsupported GGUF version {version}")));
        }
        let n_tensors = r.u64()?;
        if n_tensors > MAX_TENSORS {
            return Err(bad(format!("implausible tensor count {n_tensors}")));
        }
        let n_kv = r.u64()?;
        if n_kv > (r.remaining() / 12) as u64 {
            return Err(bad(format!(
                "the header announces {n_kv} metadata entries, which cannot fit in the {} bytes \
                 left in the file (truncated or corrupt)",
                r.remaining()
            )));
        }
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let value = r.value(ty, 0)?;
            metadata.insert(key, value);
        }
        let alignment = match metadata.get("general.alignment") {
            Some(v) => v.as_u64().filter(|a| a.is_power_of_two() && *a <= 1 << 16),
            None => Some(DEFAULT_ALIGNMENT),
        }
        .ok_or_else(|| bad("invalid general.alignment"))?;

        let mut infos = Vec::with_capacity(n_tensors.min(4096) as usize);
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims == 0 || n_dims > MAX_TENSOR_DIMS {
                return Err(bad(format!("tensor {name}: bad dimension count {n_dims}")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64()?);
            }
            let (dtype, converted) =
                tensor_type(r.u32()?).map_err(|e| bad(format!("tensor {name}: {e}")))?;
            let offset = r.u64()?;
            infos.push((name, dims, dtype, converted, offset));
        }
        let data_start = (r.pos as u64).div_ceil(alignment) * alignment;

        let mut tensors = HashMap::with_capacity(infos.len());
        for (name, dims, dtype, converted, offset) in infos {
            let mut n_elems: u64 = 1;
            for &d in &dims {
                n_elems = n_elems
                    .checked_mul(d)
                    .filter(|n| *n <= file_size as u64 * 8)
                    .ok_or_else(|| bad(format!("tensor {name}: implausible dimensions")))?;
            }
            let (block, type_size) = match converted {
                Some(iq) => iq.block(),
                None => (dtype.block_size() as u64, dtype.type_size() as u64),
            };
            if dims[0] % block != 0 {
                return Err(bad(format!(
                    "tensor {name}: row length {} is not a multiple of the block size {block}",
                    dims[0]
                )));
            }
            let n_bytes = n_elems / block * type_size;
            let start = data_start
                .checked_add(offset)
                .ok_or_else(|| bad(format!("tensor {name}: bad offset")))?;
            let end = start
                .checked_add(n_bytes)
                .ok_or_else(|| bad(format!("tensor {name}: bad size")))?;
            if end > file_size as u64 {
                return Err(bad(format!(
                    "tensor {name}: data [{start}, {end}) lies beyond the end of the file ({file_size} bytes)"
                )));
            }
            if start % 4 != 0 {
                return Err(bad(format!(
                    "tensor {name}: misaligned data offset {start}"
                )));
            }
            let shape = dims.iter().rev().map(|&d| d as usize).collect();
            tensors.insert(
                name.clone(),
                TensorInfo {
                    name,
                    shape,
                    dtype,
                    converted,
                    offset: start as usize,
                    n_bytes: n_bytes as usize,
                },
            );
        }
        Ok(GgufFile {
            version,
            metadata,
            tensors,
            file_size,
            data,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(Value::as_f64)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(Value::as_bool)
    }

    pub fn require_u64(&self, key: &str) -> Result<u64> {
        self.get_u64(key)
            .ok_or_else(|| bad(format!("missing or invalid metadata key {key}")))
    }

    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .ok_or_else(|| EngineError::MissingTensor(name.to_string()))
    }

    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.data[info.offset..info.offset + info.n_bytes]
    }

    /// Loads a tensor as a candle `QTensor` (copied out of the map).
    pub fn qtensor(&self, name: &str, device: &Device) -> Result<QTensor> {
        let info = self.tensor_info(name)?;
        let data = self.tensor_bytes(info);
        if let Some(iq) = info.converted {
            let mut values = Vec::with_capacity(info.shape.iter().product());
            iq.dequantize(data, &mut values);
            self.release(info);
            let t = candle_core::Tensor::from_vec(values, info.shape.as_slice(), device)?;
            return Ok(QTensor::quantize(&t, GgmlDType::Q8_0)?);
        }
        let storage = QStorage::from_data(Cow::Borrowed(data), device, info.dtype)?;
        self.release(info);
        Ok(QTensor::new(storage, info.shape.as_slice())?)
    }

    /// Drops the mapped pages of a tensor that has been copied, so that the file's pages and
    /// the loaded weights are not resident at the same time (peak memory while loading).
    pub fn release(&self, info: &TensorInfo) {
        #[cfg(unix)]
        if let Storage::Map(mmap) = &self.data {
            // SAFETY: the mapping is read-only and backed by the file, so MADV_DONTNEED only
            // drops pages from this process; a later read faults them back in from the file.
            // No slice into the range is held (the tensor's bytes were copied above).
            unsafe {
                let _ = mmap.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    info.offset,
                    info.n_bytes,
                );
            }
        }
    }

    /// Drops the mapped pages under `bytes`, a slice of this file's mapping that has been
    /// copied (pages it shares with neighbouring data fault back in from the file if read).
    pub fn release_bytes(&self, bytes: &[u8]) {
        #[cfg(unix)]
        if let Storage::Map(mmap) = &self.data {
            let base = mmap.as_ptr() as usize;
            let start = bytes.as_ptr() as usize;
            if bytes.is_empty() || start < base || start + bytes.len() > base + mmap.len() {
                return;
            }
            // SAFETY: as in `release`; the range was checked to lie inside the mapping.
            unsafe {
                let _ = mmap.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start - base,
                    bytes.len(),
                );
            }
        }
    }

    /// Loads a tensor dequantized to f32 as a flat vector.
    pub fn f32_vec(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.qtensor(name, &Device::Cpu)?;
        let t = t.dequantize(&Device::Cpu)?.flatten_all()?;
        Ok(t.to_vec1::<f32>()?)
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}
