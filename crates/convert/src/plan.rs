//! What `quantize` will write: the config, every tensor's name, dims and target type
//! (the published q2/q4 mixes, exactly the engine's layout table and the synthetic
//! writer's), the metadata (copied from a template GGUF, or built from the checkpoint's
//! config and `tokenizer.json` as the synthetic writer builds it) and the file layout.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ds4_engine::dev::layout::{self, ExpertQuant, Role, TensorSpec};
use ds4_engine::dev::Config;
use ds4_gguf::{GgmlType, GgufFile, GgufWriter, Layout, Value};
use ds4_synth::Vocab;

use crate::hf::Checkpoint;
use crate::imatrix::Imatrix;
use crate::names::{self, Source};

/// The tensor-type recipe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mix {
    /// The published 81 GB recipe: routed gate/up IQ2_XXS, down Q2_K.
    Q2,
    /// The published 153 GB recipe: routed experts Q4_K.
    Q4,
    /// Every float tensor F32 (the unquantised model, for checks; no published file).
    Plain,
}

impl Mix {
    pub fn parse(s: &str) -> Result<Mix> {
        Ok(match s {
            "q2" => Mix::Q2,
            "q4" => Mix::Q4,
            "plain" | "f32" => Mix::Plain,
            _ => bail!("unknown mix {s:?} (q2, q4 or plain)"),
        })
    }

    fn experts(self) -> ExpertQuant {
        match self {
            Mix::Q2 => ExpertQuant::Q2,
            Mix::Q4 => ExpertQuant::Q4,
            Mix::Plain => ExpertQuant::F32,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Mix::Q2 => "q2",
            Mix::Q4 => "q4",
            Mix::Plain => "plain",
        }
    }
}

/// The tensors of a file of `mix` for `cfg`, in file order, with their target types.
pub fn tensor_specs(cfg: &Config, mix: Mix) -> Vec<TensorSpec> {
    let mut specs = layout::expected_tensors(cfg, mix.experts());
    if mix == Mix::Plain {
        for s in &mut specs {
            if s.role != Role::TokenTable {
                s.published = GgmlType::F32;
            }
        }
    }
    specs
}

/// Inputs of a conversion.
#[derive(Clone, Debug)]
pub struct Options {
    pub hf: PathBuf,
    pub mix: Mix,
    pub imatrix: Option<PathBuf>,
    pub template: Option<PathBuf>,
}

/// A planned output file.
pub struct Plan {
    pub config: Config,
    pub mix: Mix,
    pub specs: Vec<TensorSpec>,
    pub layout: Layout,
    /// Where the tokenizer keys came from (for the dry-run report).
    pub vocab_note: String,
}

impl Plan {
    /// Plans the file. With `ck` (a real conversion) optional tensors the checkpoint
    /// lacks are left out and every source tensor is checked (name, shape, dtype)
    /// before anything is written; without it (a dry run on a config-only directory)
    /// every tensor of the layout is listed.
    pub fn new(opts: &Options, ck: Option<&Checkpoint>) -> Result<Plan> {
        let (config, mut meta, vocab_note) = match &opts.template {
            Some(t) => {
                let g = GgufFile::open(t)
                    .with_context(|| format!("opening template {}", t.display()))?;
                let cfg = Config::from_gguf(&g)
                    .map_err(|e| anyhow::anyhow!("template {}: {e}", t.display()))?;
                let meta: Vec<(String, Value)> = g
                    .metadata()
                    .iter()
                    .filter(|(k, _)| {
                        !k.starts_with("quantize.imatrix.") && k != "general.description"
                    })
                    .cloned()
                    .collect();
                (
                    cfg,
                    meta,
                    format!("metadata and tokenizer copied from {}", t.display()),
                )
            }
            None => {
                let cfg = crate::hfconfig::read(&opts.hf)?;
                let (vocab, note) = vocab(&opts.hf, cfg.vocab, ck.is_none())?;
                let mut meta = vec![
                    (
                        "general.architecture".to_string(),
                        Value::String("deepseek4".into()),
                    ),
                    (
                        "general.name".to_string(),
                        Value::String("DeepSeek-V4-Flash".into()),
                    ),
                    ("general.quantization_version".to_string(), Value::U32(2)),
                ];
                meta.extend(layout::metadata(&cfg));
                meta.extend(vocab.metadata());
                (cfg, meta, note)
            }
        };
        meta.push((
            "general.description".into(),
            Value::String(format!(
                "converted from the official checkpoint by ds4-tool quantize (mix {})",
                opts.mix.name()
            )),
        ));
        if let Some(p) = &opts.imatrix {
            let im = Imatrix::read(p)?;
            meta.push((
                "quantize.imatrix.file".into(),
                Value::String(p.display().to_string()),
            ));
            meta.push((
                "quantize.imatrix.entries_count".into(),
                Value::U64(im.entries.len() as u64),
            ));
            if let Some(d) = im.dataset {
                meta.push(("quantize.imatrix.dataset".into(), Value::String(d)));
            }
            if let Some(c) = im.last_call.filter(|c| *c > 0) {
                meta.push(("quantize.imatrix.chunks_count".into(), Value::U64(c as u64)));
            }
        }
        let mut specs = tensor_specs(&config, opts.mix);
        if let Some(ck) = ck {
            specs.retain(|s| !s.optional || present(ck, s));
            for s in &specs {
                check_source(ck, &config, s)?;
            }
        }
        let mut w = GgufWriter::new();
        for (k, v) in meta {
            w.add(k, v)?;
        }
        for s in &specs {
            w.add_tensor(&s.name, &s.dims, s.published)?;
        }
        let layout = w.layout();
        Ok(Plan {
            config,
            mix: opts.mix,
            specs,
            layout,
            vocab_note,
        })
    }

    pub fn tensor_bytes(&self) -> u64 {
        self.layout.tensor_sizes.iter().sum()
    }

    /// The `--dry-run` report: one line per tensor, then the totals.
    pub fn report(&self) -> String {
        let mut s = String::new();
        for (i, spec) in self.specs.iter().enumerate() {
            s.push_str(&format!(
                "{:<44} {:<8} {:<22} {:>14}\n",
                spec.name,
                spec.published.name(),
                format!("{:?}", spec.dims),
                self.layout.tensor_sizes[i]
            ));
        }
        s.push_str(&format!(
            "{} tensors, mix {}: tensor data {} bytes, file {} bytes ({:.2} GiB); {}\n",
            self.specs.len(),
            self.mix.name(),
            self.tensor_bytes(),
            self.layout.file_size,
            self.layout.file_size as f64 / (1u64 << 30) as f64,
            self.vocab_note
        ));
        s
    }
}

/// The tokenizer keys: `tokenizer.json` of the checkpoint; for a dry run without one,
/// a placeholder vocabulary of the right size (the size report then estimates the
/// metadata; the tensor bytes stay exact).
fn vocab(dir: &Path, n: usize, dry: bool) -> Result<(Vocab, String)> {
    let p = dir.join("tokenizer.json");
    if p.exists() {
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        let v = Vocab::from_tokenizer_json(&text)?;
        if v.tokens.len() != n {
            bail!(
                "tokenizer.json has {} tokens but the config says {n}",
                v.tokens.len()
            );
        }
        return Ok((v, format!("tokenizer from {}", p.display())));
    }
    if dry {
        return Ok((
            Vocab::builtin(n)?,
            "no tokenizer.json: metadata size estimated with a placeholder vocabulary".into(),
        ));
    }
    bail!("{} is missing (or pass --template)", p.display())
}

fn present(ck: &Checkpoint, s: &TensorSpec) -> bool {
    match names::source(&s.name) {
        Some(Source::Tensor(n)) => ck.get(&n).is_some(),
        _ => true,
    }
}

/// The checkpoint tensor(s) behind `s` exist with the reversed dims and a dtype we read.
fn check_source(ck: &Checkpoint, cfg: &Config, s: &TensorSpec) -> Result<()> {
    let src =
        names::source(&s.name).with_context(|| format!("no checkpoint name for {}", s.name))?;
    match src {
        Source::Tensor(n) => {
            let t = ck.tensor(&n)?;
            let want: Vec<usize> = s.dims.iter().rev().map(|&d| d as usize).collect();
            // Vectors may be stored with a trailing unit dimension dropped or kept.
            let got: Vec<usize> = t.shape.iter().copied().filter(|&d| d != 1).collect();
            let want_nz: Vec<usize> = want.iter().copied().filter(|&d| d != 1).collect();
            if got != want_nz {
                bail!(
                    "{n}: shape {:?}, expected {want:?} (for {})",
                    t.shape,
                    s.name
                );
            }
            match t.dtype.as_str() {
                "F32" | "F16" | "BF16" => {}
                "F8_E4M3" => {
                    names::scale_names(&n)
                        .iter()
                        .find(|sn| ck.get(sn).is_some())
                        .with_context(|| format!("{n} is FP8 but has no .scale tensor"))?;
                }
                "I64" | "I32" if s.published == GgmlType::I32 => {}
                d => bail!("{n}: dtype {d} is not supported for {}", s.name),
            }
        }
        Source::Experts { layer, part } => {
            let (rows, cols) = (s.dims[1] as usize, s.dims[0] as usize);
            for e in 0..cfg.n_expert {
                let n = names::expert_name(layer, e, part);
                let t = ck.tensor(&n)?;
                let ok = match t.dtype.as_str() {
                    // FP4 packed two per byte, with its per-32 scales.
                    "I8" | "U8" => {
                        let [sn, _] = names::scale_names(&n);
                        ck.get(&sn).is_some_and(|sc| sc.shape == [rows, cols / 32])
                            && t.shape == [rows, cols / 2]
                    }
                    "F8_E4M3" | "F4" | "F32" | "F16" | "BF16" => t.shape == [rows, cols],
                    _ => false,
                };
                if !ok {
                    bail!(
                        "{n}: {} {:?} (or its scale) does not fit a [{rows}, {cols}] expert of {}",
                        t.dtype,
                        t.shape,
                        s.name
                    );
                }
            }
        }
    }
    Ok(())
}
