//! Streaming GGUF v3 writer.
//!
//! The header (metadata and tensor infos with precomputed offsets) is built first, so
//! tensor data can then be streamed in order with [`GgufWriter::write_to`] or written in
//! parallel at [`Layout::tensor_offsets`] with positioned writes.

use std::io::{self, Write};

use crate::reader::{DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, MAX_DIMS};
use crate::types::GgmlType;
use crate::value::{Value, ValueType};

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("tensor {name:?}: {msg}")]
    BadTensor { name: String, msg: String },
    #[error("metadata {key:?}: {msg}")]
    BadMetadata { key: String, msg: String },
    #[error("duplicate name {0:?}")]
    Duplicate(String),
    #[error(transparent)]
    Io(#[from] io::Error),
}

#[derive(Clone, Debug)]
struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    size: u64,
}

/// Collects metadata and tensor declarations, then lays the file out.
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

/// The byte layout of a file to be written.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Everything before the data section, padding included.
    pub header: Vec<u8>,
    pub alignment: u64,
    /// Absolute file offset of each tensor's data, in declaration order.
    pub tensor_offsets: Vec<u64>,
    pub tensor_sizes: Vec<u64>,
    /// Total file size.
    pub file_size: u64,
}

impl GgufWriter {
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Adds a metadata key (file order = call order).
    pub fn add(&mut self, key: impl Into<String>, value: Value) -> Result<(), WriteError> {
        let key = key.into();
        check_value(&key, &value)?;
        if self.metadata.iter().any(|(k, _)| *k == key) {
            return Err(WriteError::Duplicate(key));
        }
        self.metadata.push((key, value));
        Ok(())
    }

    /// Declares a tensor (data order = call order). Returns its index.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
    ) -> Result<usize, WriteError> {
        let name = name.into();
        let bad = |msg: String| WriteError::BadTensor {
            name: name.clone(),
            msg,
        };
        if dims.is_empty() || dims.len() > MAX_DIMS || dims.contains(&0) {
            return Err(bad(format!("bad dimensions {dims:?}")));
        }
        let n = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad("element count overflows".into()))?;
        if dims[0] % ty.block_elems() as u64 != 0 {
            return Err(bad(format!(
                "first dimension not a multiple of the {ty} block"
            )));
        }
        let size = ty
            .bytes_for(n)
            .ok_or_else(|| bad("size overflows".into()))?;
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(WriteError::Duplicate(name));
        }
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            ty,
            size,
        });
        Ok(self.tensors.len() - 1)
    }

    pub fn n_tensors(&self) -> usize {
        self.tensors.len()
    }

    fn alignment(&self) -> u64 {
        match self.metadata.iter().find(|(k, _)| k == "general.alignment") {
            Some((_, Value::U32(a))) => *a as u64,
            _ => DEFAULT_ALIGNMENT,
        }
    }

    /// Computes offsets and serialises the header.
    pub fn layout(&self) -> Layout {
        let alignment = self.alignment();
        let mut offsets = Vec::with_capacity(self.tensors.len());
        let mut rel = 0u64;
        for t in &self.tensors {
            offsets.push(rel);
            rel = (rel + t.size).div_ceil(alignment) * alignment;
        }
        let mut h = Vec::new();
        h.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
        h.extend_from_slice(&GGUF_VERSION.to_le_bytes());
        h.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        h.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut h, k);
            h.extend_from_slice(&v.value_type().id().to_le_bytes());
            put_value(&mut h, v);
        }
        for (t, off) in self.tensors.iter().zip(&offsets) {
            put_str(&mut h, &t.name);
            h.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                h.extend_from_slice(&d.to_le_bytes());
            }
            h.extend_from_slice(&t.ty.id().to_le_bytes());
            h.extend_from_slice(&off.to_le_bytes());
        }
        let data_offset = (h.len() as u64).div_ceil(alignment) * alignment;
        h.resize(data_offset as usize, 0);
        let data_end = self
            .tensors
            .last()
            .zip(offsets.last())
            .map_or(0, |(t, off)| off + t.size);
        Layout {
            header: h,
            alignment,
            tensor_offsets: offsets.iter().map(|o| o + data_offset).collect(),
            tensor_sizes: self.tensors.iter().map(|t| t.size).collect(),
            file_size: data_offset + data_end,
        }
    }

    /// Streams the whole file: `data(i, buf)` must fill `buf` (exactly the size of
    /// tensor `i`) with that tensor's bytes.
    pub fn write_to<W: Write>(
        &self,
        out: &mut W,
        mut data: impl FnMut(usize, &mut Vec<u8>) -> io::Result<()>,
    ) -> Result<Layout, WriteError> {
        let layout = self.layout();
        out.write_all(&layout.header)?;
        let mut pos = layout.header.len() as u64;
        let mut buf = Vec::new();
        for (i, t) in self.tensors.iter().enumerate() {
            let off = layout.tensor_offsets[i];
            write_zeros(out, off - pos)?;
            buf.clear();
            data(i, &mut buf)?;
            if buf.len() as u64 != t.size {
                return Err(WriteError::BadTensor {
                    name: t.name.clone(),
                    msg: format!("data has {} bytes, expected {}", buf.len(), t.size),
                });
            }
            out.write_all(&buf)?;
            pos = off + t.size;
        }
        Ok(layout)
    }
}

fn write_zeros<W: Write>(out: &mut W, n: u64) -> io::Result<()> {
    const Z: [u8; 256] = [0; 256];
    let mut left = n;
    while left > 0 {
        let k = left.min(Z.len() as u64) as usize;
        out.write_all(&Z[..k])?;
        left -= k as u64;
    }
    Ok(())
}

fn check_value(key: &str, v: &Value) -> Result<(), WriteError> {
    if key == "general.alignment" {
        match v {
            Value::U32(a) if *a > 0 && a.is_power_of_two() => {}
            _ => {
                return Err(WriteError::BadMetadata {
                    key: key.into(),
                    msg: "must be a u32 power of two".into(),
                })
            }
        }
    }
    if let Value::Array(t, items) = v {
        for it in items {
            if it.value_type() != *t {
                return Err(WriteError::BadMetadata {
                    key: key.into(),
                    msg: format!("array of {} holds a {}", t.name(), it.value_type().name()),
                });
            }
            check_value(key, it)?;
        }
    }
    Ok(())
}

fn put_str(h: &mut Vec<u8>, s: &str) {
    h.extend_from_slice(&(s.len() as u64).to_le_bytes());
    h.extend_from_slice(s.as_bytes());
}

fn put_value(h: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => h.push(*x),
        Value::I8(x) => h.push(*x as u8),
        Value::U16(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => h.push(*x as u8),
        Value::String(s) => put_str(h, s),
        Value::Array(t, items) => {
            h.extend_from_slice(&t.id().to_le_bytes());
            h.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                put_value(h, it);
            }
        }
        Value::U64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => h.extend_from_slice(&x.to_le_bytes()),
    }
}

/// Convenience constructors for common metadata values.
impl Value {
    pub fn string_array<S: AsRef<str>>(items: &[S]) -> Value {
        Value::Array(
            ValueType::String,
            items
                .iter()
                .map(|s| Value::String(s.as_ref().to_string()))
                .collect(),
        )
    }
    pub fn i32_array(items: &[i32]) -> Value {
        Value::Array(
            ValueType::I32,
            items.iter().map(|&v| Value::I32(v)).collect(),
        )
    }
    pub fn f32_array(items: &[f32]) -> Value {
        Value::Array(
            ValueType::F32,
            items.iter().map(|&v| Value::F32(v)).collect(),
        )
    }
}

/// Writes all of `buf` at byte `off` of `f` without moving its cursor: the tensor
/// writers that fill a preallocated GGUF from several threads (ds4-tool synth, quantize).
#[cfg(unix)]
pub fn write_at(f: &std::fs::File, buf: &[u8], off: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    f.write_all_at(buf, off)
}

/// See the Unix version.
#[cfg(windows)]
pub fn write_at(f: &std::fs::File, mut buf: &[u8], mut off: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        let n = f.seek_write(buf, off)?;
        buf = &buf[n..];
        off += n as u64;
    }
    Ok(())
}
