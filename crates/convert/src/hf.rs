//! The Hugging Face checkpoint directory: `model.safetensors.index.json` (or a single
//! `model.safetensors`), the shards memory-mapped, tensors found by name. Only the
//! headers are parsed up front; tensor bytes are touched when a tensor is converted,
//! so memory stays bounded by what one tensor needs (the kernel drops clean pages).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use memmap2::Mmap;

/// One tensor of a shard.
#[derive(Clone, Debug)]
pub struct HfTensor {
    pub dtype: String,
    pub shape: Vec<usize>,
    shard: usize,
    /// Absolute byte range in the shard file.
    start: usize,
    end: usize,
}

impl HfTensor {
    pub fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An opened checkpoint.
pub struct Checkpoint {
    pub dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    tensors: HashMap<String, HfTensor>,
}

impl Checkpoint {
    /// Opens `dir`: the index's shards, or `model.safetensors` alone.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<String> = if index.exists() {
            let text = std::fs::read_to_string(&index)
                .with_context(|| format!("reading {}", index.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("parsing {}", index.display()))?;
            let Some(map) = v["weight_map"].as_object() else {
                bail!("{} has no weight_map", index.display());
            };
            let mut files: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect();
            files.sort();
            files.dedup();
            files
        } else if dir.join("model.safetensors").exists() {
            vec!["model.safetensors".into()]
        } else {
            bail!(
                "{} has neither model.safetensors.index.json nor model.safetensors",
                dir.display()
            );
        };
        let mut ck = Checkpoint {
            dir: dir.to_path_buf(),
            shards: Vec::new(),
            tensors: HashMap::new(),
        };
        for f in files {
            let path = dir.join(&f);
            let file = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
            // SAFETY: read-only map of a file nobody should modify while we convert it.
            let map = unsafe { Mmap::map(&file) }
                .with_context(|| format!("mapping {}", path.display()))?;
            let (n, meta) = safetensors::SafeTensors::read_metadata(&map)
                .map_err(|e| anyhow::anyhow!("{}: {e:?}", path.display()))?;
            let base = 8 + n;
            let shard = ck.shards.len();
            for (name, info) in meta.tensors() {
                let dtype = format!("{:?}", info.dtype);
                ck.tensors.insert(
                    name,
                    HfTensor {
                        dtype,
                        shape: info.shape.clone(),
                        shard,
                        start: base + info.data_offsets.0,
                        end: base + info.data_offsets.1,
                    },
                );
            }
            ck.shards.push((path, map));
        }
        Ok(ck)
    }

    pub fn get(&self, name: &str) -> Option<&HfTensor> {
        self.tensors.get(name)
    }

    pub fn tensor(&self, name: &str) -> Result<&HfTensor> {
        self.get(name)
            .with_context(|| format!("the checkpoint has no tensor {name}"))
    }

    /// The bytes of a tensor (from the memory map).
    pub fn bytes(&self, t: &HfTensor) -> &[u8] {
        &self.shards[t.shard].1[t.start..t.end]
    }

    /// Tells the kernel a tensor's pages may go (bounded memory on a 160 GB input).
    pub fn release(&self, t: &HfTensor) {
        #[cfg(unix)]
        {
            let map = &self.shards[t.shard].1;
            let page = 4096;
            let start = t.start / page * page;
            let len = t.end - start;
            // Advice only: a failure changes nothing but memory use.
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len)
            };
        }
        #[cfg(not(unix))]
        let _ = t;
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }
}
