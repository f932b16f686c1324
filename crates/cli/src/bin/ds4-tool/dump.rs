use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use ds4_cli::paths::{PathFlag, Want};
use ds4_gguf::{quant, GgufFile};

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file.
    file: PathBuf,
    /// Tensor name, e.g. blk.0.attn_q_a.weight
    name: String,
    /// Write the values here (raw little-endian f32); otherwise print statistics.
    #[arg(long)]
    out: Option<PathBuf>,
}

impl Args {
    /// The path flags checked before the file is opened (#19 item 4).
    pub fn path_flags(&self) -> Vec<PathFlag<'_>> {
        let mut v = vec![PathFlag::new("file", &self.file, Want::Model)];
        if let Some(o) = &self.out {
            v.push(PathFlag::new("out", o, Want::OutFile));
        }
        v
    }
}

pub fn run(a: Args) -> Result<()> {
    let g = GgufFile::open(&a.file).with_context(|| format!("cannot open {}", a.file.display()))?;
    let Some(t) = g.tensor(&a.name) else {
        let near: Vec<&str> = g
            .tensors()
            .iter()
            .map(|t| t.name.as_str())
            .filter(|n| n.contains(a.name.trim_end_matches(".weight")))
            .take(8)
            .collect();
        bail!(
            "no tensor named {:?} (similar: {near:?}; `ds4-tool inspect` lists all)",
            a.name
        );
    };
    let n = t.info.n_elements() as usize;
    let v = quant::dequantize_to_vec(t.ty(), t.data, n)?;
    match a.out {
        Some(path) => {
            let mut f = std::io::BufWriter::new(
                std::fs::File::create(&path)
                    .with_context(|| format!("cannot create {}", path.display()))?,
            );
            for x in &v {
                f.write_all(&x.to_le_bytes())?;
            }
            f.flush()?;
            eprintln!(
                "wrote {n} f32 values of {} ({}, dims {:?}) to {}",
                a.name,
                t.ty(),
                t.dims(),
                path.display()
            );
        }
        None => {
            let sum: f64 = v.iter().map(|&x| x as f64).sum();
            let sq: f64 = v.iter().map(|&x| (x as f64).powi(2)).sum();
            let (mn, mx) = v
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
                    (a.min(x), b.max(x))
                });
            println!("{} {} dims {:?}: {n} values", a.name, t.ty(), t.dims());
            println!(
                "mean {:.6e} rms {:.6e} min {mn:.6e} max {mx:.6e}",
                sum / n as f64,
                (sq / n as f64).sqrt()
            );
            println!("first values: {:?}", &v[..n.min(8)]);
        }
    }
    Ok(())
}
