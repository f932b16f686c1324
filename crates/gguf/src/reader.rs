//! GGUF v3 reader: memory-mapped, zero-copy tensor views, strict validation.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use crate::error::GgufError;
use crate::types::GgmlType;
use crate::value::{Value, ValueType};

pub const GGUF_MAGIC: u32 = 0x4655_4747;
pub const GGUF_VERSION: u32 = 3;
pub const DEFAULT_ALIGNMENT: u64 = 32;
pub const MAX_DIMS: usize = 8;
/// Arrays of arrays are legal GGUF; nothing real nests deeper than 2. The limit keeps a
/// hostile file from recursing the parser off the stack.
const MAX_ARRAY_DEPTH: usize = 8;

/// Where the bytes of an open file live.
enum Storage {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A tensor as described in the header. `offset` is absolute in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: the fastest-varying dimension first.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset of the tensor data in the file.
    pub offset: u64,
    /// Byte size of the tensor data.
    pub size: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A borrowed view of one tensor's bytes.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub info: &'a TensorInfo,
    pub data: &'a [u8],
}

impl<'a> TensorView<'a> {
    pub fn name(&self) -> &'a str {
        &self.info.name
    }
    pub fn ty(&self) -> GgmlType {
        self.info.ty
    }
    pub fn dims(&self) -> &'a [u64] {
        &self.info.dims
    }
}

/// An open, validated GGUF v3 file.
pub struct GgufFile {
    storage: Storage,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("len", &self.len())
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and memory-maps `path` read-only, then validates the whole header.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        // Mapping a directory fails with ENODEV ("No such device"): name the real problem.
        if meta.is_dir() {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::IsADirectory,
                "it is a directory, not a GGUF file",
            )));
        }
        let len = meta.len();
        if len == 0 {
            return Err(GgufError::Truncated {
                what: "magic".into(),
                offset: 0,
                needed: 4,
                len: 0,
            });
        }
        // SAFETY: the map is read-only; the file must not be truncated by another
        // process while open, the same contract every mmap-based model loader has.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse(Storage::Mapped(map))
    }

    /// Parses a GGUF image held in memory (tests, fuzzing, small files).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<GgufFile, GgufError> {
        let header = parse_header(storage.bytes())?;
        let key_index = header
            .metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        let tensor_index = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            storage,
            version: header.version,
            alignment: header.alignment,
            data_offset: header.data_offset,
            metadata: header.metadata,
            key_index,
            tensors: header.tensors,
            tensor_index,
        })
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }
    pub fn len(&self) -> u64 {
        self.bytes().len() as u64
    }
    pub fn is_empty(&self) -> bool {
        self.bytes().is_empty()
    }
    pub fn version(&self) -> u32 {
        self.version
    }
    pub fn alignment(&self) -> u64 {
        self.alignment
    }
    /// Absolute offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }
    /// Metadata in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }
    /// Tensors in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.tensor_info(name).map(|info| self.view(info))
    }
    /// The view of a tensor info taken from this file.
    pub fn view<'a>(&'a self, info: &'a TensorInfo) -> TensorView<'a> {
        // In bounds: validated by parse_header.
        let start = info.offset as usize;
        let data = &self.bytes()[start..start + info.size as usize];
        TensorView { info, data }
    }
    /// Sum of all tensor data sizes.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.size).sum()
    }
}

struct Header {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
}

/// A bounds-checked little-endian cursor.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn len(&self) -> u64 {
        self.buf.len() as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let remaining = (self.buf.len() - self.pos) as u64;
        if n > remaining {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                needed: n,
                len: self.len(),
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let len = self.u64(&|| format!("{what} length"))?;
        let start = self.pos as u64;
        let bytes = self.take(len, &|| format!("{what} ({len} bytes)"))?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            what,
            offset: start,
        })
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }
}

fn parse_header(buf: &[u8]) -> Result<Header, GgufError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.u32(&|| "magic".into())?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic(magic));
    }
    let version = c.u32(&|| "version".into())?;
    if version != GGUF_VERSION {
        return Err(GgufError::BadVersion(version));
    }
    let n_tensors = c.u64(&|| "tensor count".into())?;
    let n_kv = c.u64(&|| "metadata count".into())?;
    // A tensor info takes at least 8 (name len) + 4 (ndim) + 8 (one dim) + 4 + 8 bytes,
    // a key/value at least 8 (key len) + 4 (type) + 1 byte.
    if n_tensors > c.remaining() / 32 {
        return Err(GgufError::AbsurdCount {
            what: "tensor",
            count: n_tensors,
            len: c.len(),
        });
    }
    if n_kv > c.remaining() / 13 {
        return Err(GgufError::AbsurdCount {
            what: "metadata",
            count: n_kv,
            len: c.len(),
        });
    }

    let mut metadata = Vec::with_capacity(n_kv as usize);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let type_id = c.u32(&|| format!("type of metadata {key:?}"))?;
        let ty = ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
            key: key.clone(),
            type_id,
        })?;
        let value = read_value(&mut c, &key, ty, 0)?;
        if !seen.insert(key.clone()) {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((k, Value::U32(a))) => {
            if *a == 0 || !a.is_power_of_two() {
                return Err(GgufError::BadMetadata {
                    key: k.clone(),
                    msg: format!("alignment {a} is not a power of two"),
                });
            }
            *a as u64
        }
        Some((k, v)) => {
            return Err(GgufError::BadMetadata {
                key: k.clone(),
                msg: format!("must be u32, found {}", v.value_type().name()),
            })
        }
    };

    struct RawTensor {
        name: String,
        dims: Vec<u64>,
        ty: GgmlType,
        rel_offset: u64,
        size: u64,
    }
    let mut raw = Vec::with_capacity(n_tensors as usize);
    let mut names = std::collections::HashSet::new();
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let bad = |msg: String| GgufError::BadTensor {
            name: name.clone(),
            msg,
        };
        let ndim = c.u32(&|| format!("ndim of tensor {name:?}"))?;
        if ndim == 0 || ndim as usize > MAX_DIMS {
            return Err(bad(format!("{ndim} dimensions (allowed 1..={MAX_DIMS})")));
        }
        let mut dims = Vec::with_capacity(ndim as usize);
        for _ in 0..ndim {
            dims.push(c.u64(&|| format!("dims of tensor {name:?}"))?);
        }
        let type_id = c.u32(&|| format!("type of tensor {name:?}"))?;
        let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
            name: name.clone(),
            type_id,
        })?;
        let rel_offset = c.u64(&|| format!("offset of tensor {name:?}"))?;
        if dims.contains(&0) {
            return Err(bad(format!("zero-sized dimension in {dims:?}")));
        }
        let n_elems = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| bad(format!("element count of {dims:?} overflows")))?;
        if dims[0] % ty.block_elems() as u64 != 0 {
            return Err(bad(format!(
                "first dimension {} is not a multiple of the {ty} block size {}",
                dims[0],
                ty.block_elems()
            )));
        }
        let size = ty
            .bytes_for(n_elems)
            .ok_or_else(|| bad(format!("byte size of {dims:?} overflows")))?;
        if rel_offset % alignment != 0 {
            return Err(bad(format!(
                "data offset {rel_offset} is not a multiple of the alignment {alignment}"
            )));
        }
        if !names.insert(name.clone()) {
            return Err(GgufError::DuplicateTensor(name));
        }
        raw.push(RawTensor {
            name,
            dims,
            ty,
            rel_offset,
            size,
        });
    }

    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    let file_len = c.len();
    if n_tensors > 0 && data_offset > file_len {
        return Err(GgufError::Truncated {
            what: "data section".into(),
            offset: data_offset,
            needed: 0,
            len: file_len,
        });
    }

    let mut tensors = Vec::with_capacity(raw.len());
    for t in raw {
        let end = data_offset
            .checked_add(t.rel_offset)
            .and_then(|s| s.checked_add(t.size));
        match end {
            Some(end) if end <= file_len => {}
            _ => {
                return Err(GgufError::Truncated {
                    what: format!("data of tensor {:?}", t.name),
                    offset: data_offset.saturating_add(t.rel_offset),
                    needed: t.size,
                    len: file_len,
                })
            }
        }
        tensors.push(TensorInfo {
            name: t.name,
            dims: t.dims,
            ty: t.ty,
            offset: data_offset + t.rel_offset,
            size: t.size,
        });
    }

    let mut by_offset: Vec<&TensorInfo> = tensors.iter().collect();
    by_offset.sort_by_key(|t| (t.offset, t.size));
    for pair in by_offset.windows(2) {
        if pair[0].offset + pair[0].size > pair[1].offset {
            return Err(GgufError::Overlap {
                first: pair[0].name.clone(),
                second: pair[1].name.clone(),
            });
        }
    }

    Ok(Header {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
    })
}

fn read_value(
    c: &mut Cursor<'_>,
    key: &str,
    ty: ValueType,
    depth: usize,
) -> Result<Value, GgufError> {
    let what = || format!("value of metadata {key:?}");
    Ok(match ty {
        ValueType::U8 => Value::U8(c.array::<1>(&what)?[0]),
        ValueType::I8 => Value::I8(c.array::<1>(&what)?[0] as i8),
        ValueType::U16 => Value::U16(u16::from_le_bytes(c.array(&what)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(c.array(&what)?)),
        ValueType::U32 => Value::U32(u32::from_le_bytes(c.array(&what)?)),
        ValueType::I32 => Value::I32(i32::from_le_bytes(c.array(&what)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(c.array(&what)?)),
        ValueType::U64 => Value::U64(u64::from_le_bytes(c.array(&what)?)),
        ValueType::I64 => Value::I64(i64::from_le_bytes(c.array(&what)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(c.array(&what)?)),
        ValueType::Bool => match c.array::<1>(&what)?[0] {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            b => {
                return Err(GgufError::BadMetadata {
                    key: key.to_string(),
                    msg: format!("bool byte {b} is neither 0 nor 1"),
                })
            }
        },
        ValueType::String => Value::String(c.string("metadata string")?),
        ValueType::Array => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(GgufError::TooDeep {
                    key: key.to_string(),
                    limit: MAX_ARRAY_DEPTH,
                });
            }
            let item_id = c.u32(&what)?;
            let item_ty =
                ValueType::from_id(item_id).ok_or_else(|| GgufError::UnknownValueType {
                    key: key.to_string(),
                    type_id: item_id,
                })?;
            let count = c.u64(&what)?;
            if count > c.remaining() / item_ty.min_encoded_size() {
                return Err(GgufError::Truncated {
                    what: format!("array {key:?} of {count} {}", item_ty.name()),
                    offset: c.pos as u64,
                    needed: count.saturating_mul(item_ty.min_encoded_size()),
                    len: c.len(),
                });
            }
            let mut items = Vec::with_capacity(count as usize);
            for _ in 0..count {
                items.push(read_value(c, key, item_ty, depth + 1)?);
            }
            Value::Array(item_ty, items)
        }
    })
}
