//! `ds4-tool splice`: a mixed GGUF, the routed experts of chosen layers from a donor
//! (e.g. q4) and everything else from a base (e.g. q2), like the reference's mixed
//! files (#24 part 2).

use std::path::PathBuf;

use anyhow::Result;
use ds4_cli::paths::{PathFlag, Want};

#[derive(clap::Args)]
pub struct Args {
    /// The file most tensors come from (e.g. the q2 GGUF).
    #[arg(long)]
    base: PathBuf,
    /// The file the chosen layers' routed experts come from (e.g. the q4 GGUF).
    #[arg(long)]
    donor: PathBuf,
    /// The layers whose experts come from the donor: `0-3,40-42`.
    #[arg(long)]
    layers: String,
    /// Output GGUF (written as OUT.partial, renamed at the end).
    #[arg(short, long)]
    out: PathBuf,
}

impl Args {
    /// The path flags checked before any work (#19 item 4).
    pub fn path_flags(&self) -> Vec<PathFlag<'_>> {
        vec![
            PathFlag::new("base", &self.base, Want::Model),
            PathFlag::new("donor", &self.donor, Want::Model),
            PathFlag::new("out", &self.out, Want::OutFile),
        ]
    }
}

pub fn run(a: Args) -> Result<()> {
    let layers = ds4_convert::splice::parse_layers(&a.layers)?;
    let n = ds4_convert::splice::splice(&a.base, &a.donor, &layers, &a.out)?;
    eprintln!(
        "wrote {}: {n} expert tensors of layers {layers:?} from {}",
        a.out.display(),
        a.donor.display()
    );
    Ok(())
}
