use std::path::PathBuf;

use anyhow::{Context, Result};
use ds4_cli::paths::{PathFlag, Want};
use ds4_engine::dev::config::Config;
use ds4_engine::dev::layout::check_layout;
use ds4_engine::dev::mtp::layout::{
    check_mtp_layout, is_fatal_for_mtp, not_mtp_reason, MTP_MARKER,
};
use ds4_gguf::{GgmlType, GgufFile};

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file.
    file: PathBuf,
    /// Leave out the per-tensor table.
    #[arg(long)]
    no_tensors: bool,
    /// Print every array item instead of a summary.
    #[arg(long)]
    full_arrays: bool,
    /// For an MTP GGUF: the main model it is for, to check the block's layout against.
    #[arg(short = 'm', long = "main")]
    main: Option<PathBuf>,
}

impl Args {
    /// The path flags checked before the file is opened (#19 item 4).
    pub fn path_flags(&self) -> Vec<PathFlag<'_>> {
        vec![PathFlag::new("file", &self.file, Want::Model)]
    }
}

pub fn run(a: Args) -> Result<()> {
    let g = GgufFile::open(&a.file).with_context(|| format!("cannot open {}", a.file.display()))?;
    println!("file: {}", a.file.display());
    println!(
        "GGUF v{}, {} bytes, {} metadata keys, {} tensors, alignment {}, data at offset {}",
        g.version(),
        g.len(),
        g.metadata().len(),
        g.tensors().len(),
        g.alignment(),
        g.data_offset()
    );
    println!("\n== metadata");
    for (k, v) in g.metadata() {
        let text = if a.full_arrays {
            format!("{v:?}")
        } else {
            v.summary()
        };
        println!("{k:<50} {:<8} {text}", v.value_type().name());
    }
    if !a.no_tensors {
        println!("\n== tensors");
        println!(
            "{:<44} {:<8} {:>26} {:>14} {:>14}",
            "name", "type", "dims", "bytes", "offset"
        );
        for t in g.tensors() {
            println!(
                "{:<44} {:<8} {:>26} {:>14} {:>14}",
                t.name,
                t.ty.name(),
                format!("{:?}", t.dims),
                t.size,
                t.offset
            );
        }
    }
    println!("\n== bytes per type");
    let mut per = std::collections::BTreeMap::<GgmlType, (usize, u64)>::new();
    for t in g.tensors() {
        let e = per.entry(t.ty).or_default();
        e.0 += 1;
        e.1 += t.size;
    }
    for (ty, (n, b)) in &per {
        println!(
            "{:<8} {n:>6} tensors {b:>16} bytes  {:>9.2} GiB",
            ty.name(),
            *b as f64 / (1u64 << 30) as f64
        );
    }
    let total = g.tensor_bytes();
    println!(
        "{:<8} {:>6} tensors {total:>16} bytes  {:>9.2} GiB",
        "total",
        g.tensors().len(),
        total as f64 / (1u64 << 30) as f64
    );

    if not_mtp_reason(&g).is_none() {
        return mtp_profile(&g, a.main.as_deref());
    }
    if a.main.is_some() {
        anyhow::bail!(
            "--main is for MTP files, and {} is not one: {}",
            a.file.display(),
            not_mtp_reason(&g).unwrap_or_default()
        );
    }
    println!("\n== DeepSeek V4 profile");
    match Config::from_gguf(&g) {
        Err(e) => println!("not a loadable DS4 model: {e}"),
        Ok(cfg) => {
            println!(
                "{} layers, n_embd {}, vocab {}, {} heads × {}, {} experts ({} used, width {}), ratios {:?}",
                cfg.n_layer, cfg.n_embd, cfg.vocab, cfg.n_head, cfg.head_dim, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.compress_ratios
            );
            // Fewer keys are checked than the 40 that print_findings shows.
            let dev = cfg.profile_deviations();
            print_findings(
                "hyperparameters: DeepSeek V4 Flash (all checked keys match)",
                format!(
                    "hyperparameters differ from DeepSeek V4 Flash in {} ways:",
                    dev.len()
                ),
                dev.iter().map(|d| d.to_string()).collect(),
            );
            let issues = check_layout(&cfg, &g);
            let fatal = issues.iter().filter(|i| i.is_fatal()).count();
            print_findings(
                "tensor layout: exactly the published layout",
                format!(
                    "tensor layout: {} differences ({fatal} prevent loading):",
                    issues.len()
                ),
                issues
                    .iter()
                    .map(|i| format!("{}{i}", if i.is_fatal() { "ERROR " } else { "" }))
                    .collect(),
            );
        }
    }
    Ok(())
}

/// `clean` when there are no findings, else `header` and the first 40 of them.
fn print_findings(clean: &str, header: String, findings: Vec<String>) {
    if findings.is_empty() {
        println!("{clean}");
        return;
    }
    println!("{header}");
    for f in findings.iter().take(40) {
        println!("  {f}");
    }
    if findings.len() > 40 {
        println!("  … {} more", findings.len() - 40);
    }
}

/// The MTP GGUF profile: tensor groups with their types and bytes, and (with the main
/// model) the layout check the loader applies.
fn mtp_profile(g: &GgufFile, main: Option<&std::path::Path>) -> Result<()> {
    println!("\n== DeepSeek V4 MTP block (mtp.0.*)");
    let group = |name: &str| -> &'static str {
        let n = name.strip_prefix("mtp.0.").unwrap_or(name);
        if !name.starts_with("mtp.0.") {
            "not MTP"
        } else if n.contains("_exps") {
            "routed experts"
        } else if n.contains("_shexp") {
            "shared expert"
        } else if n.starts_with("ffn_gate_inp") || n.starts_with("exp_probs_b") {
            "router"
        } else if n.starts_with("attn_") {
            "attention"
        } else if n.starts_with("hc_head") || n.starts_with("norm.") {
            "head (hc_head_*, norm)"
        } else if n.starts_with("hc_") {
            "hyper-connections"
        } else if ["e_proj", "h_proj", "enorm", "hnorm"]
            .iter()
            .any(|p| n.starts_with(p))
        {
            "draft input (e/h proj, norms)"
        } else {
            "ffn_norm"
        }
    };
    let mut groups = std::collections::BTreeMap::<&str, (usize, u64, Vec<GgmlType>)>::new();
    for t in g.tensors() {
        let e = groups.entry(group(&t.name)).or_default();
        e.0 += 1;
        e.1 += t.size;
        if !e.2.contains(&t.ty) {
            e.2.push(t.ty);
        }
    }
    for (name, (n, b, tys)) in &groups {
        let tys: Vec<&str> = tys.iter().map(|t| t.name()).collect();
        println!(
            "{name:<32} {n:>4} tensors {b:>14} bytes  {:>8.3} GiB  {}",
            *b as f64 / (1u64 << 30) as f64,
            tys.join(", ")
        );
    }
    match g.tensor_info(MTP_MARKER) {
        Some(e) => println!("n_embd {} (from {MTP_MARKER})", e.dims[0]),
        None => println!("{MTP_MARKER} is missing"),
    }
    let Some(main) = main else {
        println!("pass --main MODEL.gguf to check the block against its main model");
        return Ok(());
    };
    let mg = GgufFile::open(main).with_context(|| format!("cannot open {}", main.display()))?;
    let cfg = Config::from_gguf(&mg)
        .with_context(|| format!("{} is not a DS4 main model", main.display()))?;
    let issues = check_mtp_layout(&cfg, g);
    let fatal = issues.iter().filter(|i| is_fatal_for_mtp(i)).count();
    print_findings(
        &format!("layout: matches {} exactly", main.display()),
        format!(
            "layout against {}: {} differences ({fatal} prevent loading):",
            main.display(),
            issues.len()
        ),
        issues
            .iter()
            .map(|i| format!("{}{i}", if is_fatal_for_mtp(i) { "ERROR " } else { "" }))
            .collect(),
    );
    Ok(())
}
