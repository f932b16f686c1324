//! The plan of a synthetic file (metadata, tensor table, layout) and its writing, to
//! disk or to memory, chunk by chunk in parallel.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ds4_engine::dev::config::Config;
use ds4_engine::dev::layout::{self, ExpertQuant, TensorSpec};
use ds4_engine::dev::mtp::layout::mtp_tensors;
use ds4_gguf::{write_at, GgmlType, GgufWriter, Layout, Value};
use rayon::prelude::*;

use crate::fill::fill_tensor_chunk;
use crate::rng::Rng;
use crate::vocab::Vocab;

/// Bytes generated per work item (a whole number of blocks of every type).
const CHUNK_BLOCKS_BYTES: usize = 4 << 20;

/// The full-size DeepSeek V4 Flash shapes cut to `layers` layers (the real model has
/// 43), with the per-layer tables sized to match.
pub fn flash_config(layers: usize) -> Config {
    let mut c = Config::flash();
    c.n_layer = layers;
    c.compress_ratios = Config::flash_ratios(layers);
    c.swiglu_clamp = vec![10.0; layers];
    c.swiglu_clamp_shexp = vec![10.0; layers];
    c.n_hash_layer = c.n_hash_layer.min(layers);
    c
}

/// A planned synthetic file.
pub struct Plan {
    pub config: Config,
    pub experts: ExpertQuant,
    pub specs: Vec<TensorSpec>,
    pub writer: GgufWriter,
    pub layout: Layout,
}

impl Plan {
    pub fn new(
        config: Config,
        experts: ExpertQuant,
        vocab: &Vocab,
        description: &str,
    ) -> Result<Plan> {
        if vocab.tokens.len() != config.vocab {
            bail!(
                "the tokenizer has {} tokens but the model's vocabulary is {}",
                vocab.tokens.len(),
                config.vocab
            );
        }
        let specs = layout::expected_tensors(&config, experts);
        let name = format!("DeepSeek-V4-Flash synthetic ({experts:?} experts)");
        let mut meta = layout::metadata(&config);
        meta.extend(vocab.metadata());
        Plan::with(config, experts, specs, &name, description, meta)
    }

    /// The MTP GGUF (architecture.md §2.5) matching a main model of `config`: the
    /// `mtp.0.*` block with `experts` routed experts (the shipped file uses Q4), no
    /// tokenizer (the embedding and `output` come from the main file).
    pub fn mtp(config: Config, experts: ExpertQuant, description: &str) -> Result<Plan> {
        let specs = mtp_tensors(&config, experts);
        let name = format!("DeepSeek-V4-Flash MTP synthetic ({experts:?} experts)");
        Plan::with(config, experts, specs, &name, description, Vec::new())
    }

    /// The general.* keys, then `meta`, then the tensor table of `specs`.
    fn with(
        config: Config,
        experts: ExpertQuant,
        specs: Vec<TensorSpec>,
        name: &str,
        description: &str,
        meta: Vec<(String, Value)>,
    ) -> Result<Plan> {
        let mut w = GgufWriter::new();
        w.add("general.architecture", Value::String("deepseek4".into()))?;
        w.add("general.name", Value::String(name.into()))?;
        w.add("general.description", Value::String(description.into()))?;
        w.add("general.quantization_version", Value::U32(2))?;
        for (k, v) in meta {
            w.add(k, v)?;
        }
        for s in &specs {
            w.add_tensor(&s.name, &s.dims, s.published)?;
        }
        let layout = w.layout();
        Ok(Plan {
            config,
            experts,
            specs,
            writer: w,
            layout,
        })
    }

    pub fn tensor_bytes(&self) -> u64 {
        self.layout.tensor_sizes.iter().sum()
    }

    /// (type, tensor count, bytes) per type, ordered by type id.
    pub fn bytes_per_type(&self) -> Vec<(GgmlType, usize, u64)> {
        let mut m = std::collections::BTreeMap::<GgmlType, (usize, u64)>::new();
        for (s, &b) in self.specs.iter().zip(&self.layout.tensor_sizes) {
            let e = m.entry(s.published).or_default();
            e.0 += 1;
            e.1 += b;
        }
        m.into_iter().map(|(t, (n, b))| (t, n, b)).collect()
    }

    /// Work items: (tensor, chunk index, byte offset in the tensor, length), in file
    /// order. Each is generated from its own seeded stream.
    fn work(&self) -> Vec<(usize, usize, usize, usize)> {
        let mut work = Vec::new();
        for (i, s) in self.specs.iter().enumerate() {
            let bb = s.published.block_bytes();
            let chunk = (CHUNK_BLOCKS_BYTES / bb).max(1) * bb;
            let size = self.layout.tensor_sizes[i] as usize;
            for (c, start) in (0..size).step_by(chunk).enumerate() {
                work.push((i, c, start, chunk.min(size - start)));
            }
        }
        work
    }

    fn fill(&self, seed: u64, (i, c, start, _len): (usize, usize, usize, usize), buf: &mut [u8]) {
        let mut rng = Rng::stream(seed, i as u64, c as u64);
        fill_tensor_chunk(&self.specs[i], &self.config, start, buf, &mut rng);
    }

    /// The temporary file [`Plan::write`] fills before renaming it to `path` (callers
    /// remove it when interrupted).
    pub fn temp_path(path: &Path) -> PathBuf {
        path.with_extension("gguf.tmp")
    }

    /// Writes the file at `path` (through a temporary file renamed into place; on any
    /// error the temporary file is removed, #19 item 4).
    /// `progress` is called with the number of bytes just written.
    pub fn write(&self, path: &Path, seed: u64, progress: &(dyn Fn(u64) + Sync)) -> Result<()> {
        let tmp = Plan::temp_path(path);
        // A half-written multi-GB file is only in the way (nothing resumes from it): the
        // guard removes it on an error and on a panic alike.
        let guard = RemoveOnDrop(&tmp);
        self.write_via(&tmp, path, seed, progress)?;
        std::mem::forget(guard);
        Ok(())
    }

    fn write_via(
        &self,
        tmp: &Path,
        path: &Path,
        seed: u64,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<()> {
        let file = File::create(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        file.set_len(self.layout.file_size).with_context(|| {
            format!(
                "cannot size {} to {} bytes (disk full?)",
                tmp.display(),
                self.layout.file_size
            )
        })?;
        (&file).write_all(&self.layout.header)?;
        progress(self.layout.header.len() as u64);
        self.work()
            .par_iter()
            .try_for_each_init(Vec::new, |buf, &item| -> Result<()> {
                buf.resize(item.3, 0);
                self.fill(seed, item, buf);
                write_at(
                    &file,
                    buf,
                    self.layout.tensor_offsets[item.0] + item.2 as u64,
                )
                .with_context(|| format!("writing {}", tmp.display()))?;
                progress(item.3 as u64);
                Ok(())
            })?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(tmp, path)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
        Ok(())
    }

    /// The whole file image in memory, byte-identical to [`Plan::write`]'s file (for
    /// benchmarks on machines whose disk cannot hold the model).
    pub fn build(&self, seed: u64, progress: &(dyn Fn(u64) + Sync)) -> Vec<u8> {
        // Zeroed allocation: untouched pages cost nothing, padding stays zero.
        let mut image = vec![0u8; self.layout.file_size as usize];
        image[..self.layout.header.len()].copy_from_slice(&self.layout.header);
        let work = self.work();
        // Carve the disjoint chunk ranges out of the image, in file order.
        let mut slices = Vec::with_capacity(work.len());
        let mut rest: &mut [u8] = &mut image[..];
        let mut at = 0usize;
        for &item in &work {
            let off = self.layout.tensor_offsets[item.0] as usize + item.2;
            let (_, tail) = rest.split_at_mut(off - at);
            let (chunk, tail) = tail.split_at_mut(item.3);
            slices.push((item, chunk));
            rest = tail;
            at = off + item.3;
        }
        slices.into_par_iter().for_each(|(item, chunk)| {
            self.fill(seed, item, chunk);
            progress(item.3 as u64);
        });
        image
    }
}

/// Removes the file when dropped (forgotten once the file has its final name).
struct RemoveOnDrop<'a>(&'a Path);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_in_memory_image_equals_the_written_file() {
        let cfg = Config::tiny(3);
        let vocab = Vocab::builtin(cfg.vocab).unwrap();
        let plan = Plan::new(cfg, ExpertQuant::Q2, &vocab, "test").unwrap();
        let path =
            std::env::temp_dir().join(format!("ds4-synth-image-{}.gguf", std::process::id()));
        plan.write(&path, 9, &|_| {}).unwrap();
        let file = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(plan.build(9, &|_| {}), file);
    }

    // #19 item 4: a failed write leaves no temporary file behind.
    #[test]
    fn a_failed_write_removes_its_temporary_file() {
        let cfg = Config::tiny(1);
        let vocab = Vocab::builtin(cfg.vocab).unwrap();
        let plan = Plan::new(cfg, ExpertQuant::Q2, &vocab, "test").unwrap();
        // The final name is a non-empty directory: every byte is written, then the
        // rename fails.
        let dir = std::env::temp_dir().join(format!("ds4-synth-fail-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("occupied")).unwrap();
        let tmp = Plan::temp_path(&dir);
        let err = plan.write(&dir, 1, &|_| {}).unwrap_err();
        assert!(format!("{err:#}").contains("cannot rename"), "{err:#}");
        assert!(!tmp.exists(), "{} left behind", tmp.display());
        assert!(dir.join("occupied").is_dir());
        std::fs::remove_dir_all(&dir).unwrap();
        // A directory that does not exist: nothing is created at all.
        let missing = std::env::temp_dir().join("ds4-synth-no-such-dir/x.gguf");
        assert!(plan.write(&missing, 1, &|_| {}).is_err());
        assert!(!Plan::temp_path(&missing).exists());
    }

    #[test]
    fn a_seed_gives_the_same_bytes_as_before() {
        // Synthetic files are compared across versions (benchmarks, bug reports): a change
        // to the generator must show up here, not as a silent difference in results.
        let cfg = Config::tiny(2);
        let vocab = Vocab::builtin(cfg.vocab).unwrap();
        let plan = Plan::new(cfg, ExpertQuant::Q2, &vocab, "pinned").unwrap();
        let image = plan.build(7, &|_| {});
        let fnv1a = image.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        });
        assert_eq!((image.len(), fnv1a), (2_248_736, 0x031e_ad62_e605_bd72));
    }

    #[test]
    fn mtp_plan_matches_the_shipped_file_and_is_seeded() {
        let p = Plan::mtp(Config::flash(), ExpertQuant::Q4, "test").unwrap();
        // "about 3.55 GiB" for the shipped MTP-Q4K-Q8_0-F32 file (architecture.md §2.5).
        let gib = p.tensor_bytes() as f64 / (1u64 << 30) as f64;
        assert!((3.5..3.6).contains(&gib), "{gib}");
        let tiny = Plan::mtp(Config::tiny(2), ExpertQuant::Q4, "t").unwrap();
        assert_eq!(tiny.build(3, &|_| {}), tiny.build(3, &|_| {}));
        assert_ne!(tiny.build(3, &|_| {}), tiny.build(4, &|_| {}));
    }

    #[test]
    fn flash_plan_has_the_published_size() {
        let cfg = Config::flash();
        let vocab = Vocab::builtin(cfg.vocab).unwrap();
        let p = Plan::new(cfg.clone(), ExpertQuant::Q2, &vocab, "test").unwrap();
        assert_eq!(p.specs.len(), 1328);
        assert_eq!(p.tensor_bytes(), 86_714_775_900);
        let p = Plan::new(cfg, ExpertQuant::Q4, &vocab, "test").unwrap();
        assert_eq!(p.tensor_bytes(), 164_628_167_004);
    }
}
