//! Synthetic DeepSeek V4 models in the exact published layout, with random weights.
//!
//! Every tensor is generated directly as quantised blocks (random quants, scales set
//! for a target RMS), chunk by chunk from independent seeded streams, so a full-size
//! file can be written by all cores at disk speed with positioned writes and is the
//! same for the same seed whatever the thread count.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use ds4_engine::dev::config::Config;
use ds4_engine::dev::layout::{self, ExpertQuant, Role, TensorSpec};
use ds4_gguf::quant::f32_to_f16;
use ds4_gguf::quant::random::fill_blocks;
use ds4_gguf::{GgmlType, GgufWriter, Layout, Value};
use rayon::prelude::*;

use crate::rng::Rng;
use crate::vocab::Vocab;

/// Bytes generated per work item (a whole number of blocks of every type).
const CHUNK_BLOCKS_BYTES: usize = 4 << 20;

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
        let mut w = GgufWriter::new();
        w.add("general.architecture", Value::String("deepseek4".into()))?;
        w.add(
            "general.name",
            Value::String(format!("DeepSeek-V4-Flash synthetic ({experts:?} experts)")),
        )?;
        w.add("general.description", Value::String(description.into()))?;
        w.add("general.quantization_version", Value::U32(2))?;
        for (k, v) in layout::metadata(&config)
            .into_iter()
            .chain(vocab.metadata())
        {
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

    /// Writes the file at `path` (through a temporary file renamed into place).
    /// `progress` is called with the number of bytes just written.
    pub fn write(&self, path: &Path, seed: u64, progress: &(dyn Fn(u64) + Sync)) -> Result<()> {
        let tmp = path.with_extension("gguf.tmp");
        let file =
            File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
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
        std::fs::rename(&tmp, path)
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

#[cfg(unix)]
fn write_at(f: &File, buf: &[u8], off: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    f.write_all_at(buf, off)
}

#[cfg(windows)]
fn write_at(f: &File, mut buf: &[u8], mut off: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        let n = f.seek_write(buf, off)?;
        buf = &buf[n..];
        off += n as u64;
    }
    Ok(())
}

/// Target RMS of a tensor's values. Projections get gain/√fan-in; output-side
/// projections are small so the residual (HC) streams stay bounded over 43 layers.
fn target_rms(spec: &TensorSpec) -> f32 {
    let short = spec
        .name
        .rsplit_once('.')
        .map(|(a, _)| a.rsplit('.').next().unwrap_or(a))
        .unwrap_or(&spec.name);
    let base = spec.name.split('.').nth(2).unwrap_or(short);
    let fan_in = spec.dims[0] as f32;
    let gain = match base {
        "attn_output_b" => 0.1,
        "ffn_down_shexp" => 0.05,
        "ffn_down_exps" => 0.07,
        "ffn_gate_inp" => 2.0,
        "attn_compressor_ape" | "indexer_compressor_ape" => return 0.5,
        _ if spec.name == "token_embd.weight" => return 1.0,
        _ if spec.name == "output.weight" => 2.5,
        _ => 1.0,
    };
    gain / fan_in.sqrt()
}

/// Fills `buf` (bytes `start..start+buf.len()` of the tensor) with random data.
fn fill_tensor_chunk(spec: &TensorSpec, cfg: &Config, start: usize, buf: &mut [u8], rng: &mut Rng) {
    match spec.role {
        Role::TokenTable => fill_tid2eid(cfg, start, buf, rng),
        Role::Vector => fill_vector(spec, buf, rng),
        _ => fill_blocks(spec.published, target_rms(spec), buf, rng),
    }
}

fn fill_vector(spec: &TensorSpec, buf: &mut [u8], rng: &mut Rng) {
    let name = spec.name.as_str();
    let gen = |rng: &mut Rng| -> f32 {
        if name.contains("norm") {
            1.0 + 0.1 * rng.normal()
        } else if name.contains("attn_sinks") {
            0.5 + rng.normal()
        } else if name.contains("exp_probs_b") {
            0.2 * rng.normal()
        } else if name.contains("_scale") {
            0.5 + 0.25 * rng.uniform()
        } else {
            0.5 * rng.normal()
        }
    };
    match spec.published {
        GgmlType::F32 => {
            for c in buf.chunks_exact_mut(4) {
                c.copy_from_slice(&gen(rng).to_le_bytes());
            }
        }
        _ => {
            for c in buf.chunks_exact_mut(2) {
                c.copy_from_slice(&f32_to_f16(gen(rng)).to_le_bytes());
            }
        }
    }
}

/// Hash routing table: each token gets `n_expert_used` distinct experts.
fn fill_tid2eid(cfg: &Config, start: usize, buf: &mut [u8], rng: &mut Rng) {
    let k = cfg.n_expert_used;
    debug_assert_eq!(start % (4 * k), 0, "chunks hold whole rows");
    let mut chosen = Vec::with_capacity(k);
    for row in buf.chunks_exact_mut(4 * k) {
        chosen.clear();
        while chosen.len() < k {
            let e = rng.below(cfg.n_expert as u64) as i32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        for (c, e) in row.chunks_exact_mut(4).zip(&chosen) {
            c.copy_from_slice(&e.to_le_bytes());
        }
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
