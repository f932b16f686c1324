//! `ds4-tool splice`: a mixed file, the routed experts of chosen layers taken from a
//! donor file (usually the q4 one) and everything else from a base file (usually q2),
//! like the reference's `gguf-tools/mixed`. Both files must be the same model (same
//! tensor names and dims); the engine dispatches on each tensor's own type.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use ds4_gguf::{GgufFile, GgufWriter, Value};

use crate::names;

/// Parses `0-3,40-42,7` into sorted layer numbers.
pub fn parse_layers(s: &str) -> Result<Vec<usize>> {
    let mut v = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let a: usize = a.parse().with_context(|| format!("bad layer {a:?}"))?;
        let b: usize = b.parse().with_context(|| format!("bad layer {b:?}"))?;
        ensure!(a <= b, "bad layer range {part:?}");
        v.extend(a..=b);
    }
    ensure!(!v.is_empty(), "no layers given");
    v.sort_unstable();
    v.dedup();
    Ok(v)
}

fn is_routed_expert(name: &str, layers: &[usize]) -> bool {
    match names::split_layer(name) {
        Some((l, rest)) => {
            layers.contains(&l)
                && matches!(
                    rest,
                    "ffn_gate_exps.weight" | "ffn_up_exps.weight" | "ffn_down_exps.weight"
                )
        }
        None => false,
    }
}

/// Writes `out` (through `out.partial`): base's metadata and tensors, with the routed
/// experts of `layers` from `donor`. Returns how many tensors came from the donor.
pub fn splice(base: &Path, donor: &Path, layers: &[usize], out: &Path) -> Result<usize> {
    let b = GgufFile::open(base).with_context(|| format!("opening {}", base.display()))?;
    let d = GgufFile::open(donor).with_context(|| format!("opening {}", donor.display()))?;
    let n_layer = match b.get("deepseek4.block_count") {
        Some(v) => v.as_i64().unwrap_or(0) as usize,
        None => bail!("{} has no deepseek4.block_count", base.display()),
    };
    if let Some(&l) = layers.iter().find(|&&l| l >= n_layer) {
        bail!("layer {l} does not exist ({n_layer} layers)");
    }
    let mut w = GgufWriter::new();
    for (k, v) in b.metadata() {
        let v = if k == "general.description" {
            Value::String(format!(
                "{} + routed experts of layers {layers:?} from {}",
                v.as_str().unwrap_or(""),
                donor.file_name().unwrap_or_default().to_string_lossy()
            ))
        } else {
            v.clone()
        };
        w.add(k.clone(), v)?;
    }
    let mut from_donor = Vec::new();
    for t in b.tensors() {
        if is_routed_expert(&t.name, layers) {
            let dt = d
                .tensor_info(&t.name)
                .with_context(|| format!("{} has no {}", donor.display(), t.name))?;
            ensure!(
                dt.dims == t.dims,
                "{}: dims {:?} in the donor, {:?} in the base",
                t.name,
                dt.dims,
                t.dims
            );
            w.add_tensor(&t.name, &t.dims, dt.ty)?;
            from_donor.push(true);
        } else {
            w.add_tensor(&t.name, &t.dims, t.ty)?;
            from_donor.push(false);
        }
    }
    // The gate and up experts of a layer must share a type (the engine checks it);
    // splicing whole layers keeps that.
    let (partial, _) = crate::write::partial_paths(out);
    let f =
        File::create(&partial).with_context(|| format!("cannot create {}", partial.display()))?;
    let mut bw = BufWriter::with_capacity(8 << 20, f);
    let tensors = b.tensors();
    w.write_to(&mut bw, |i, buf| {
        let src = if from_donor[i] { &d } else { &b };
        let info = src.tensor_info(&tensors[i].name).expect("checked above");
        buf.extend_from_slice(src.view(info).data);
        Ok(())
    })?;
    bw.flush()?;
    bw.get_ref().sync_all()?;
    drop(bw);
    std::fs::rename(&partial, out)
        .with_context(|| format!("cannot rename {} to {}", partial.display(), out.display()))?;
    Ok(from_donor.iter().filter(|&&x| x).count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_lists() {
        assert_eq!(
            parse_layers("0-3,40-42").unwrap(),
            vec![0, 1, 2, 3, 40, 41, 42]
        );
        assert_eq!(parse_layers("5, 2,5").unwrap(), vec![2, 5]);
        assert!(parse_layers("3-1").is_err());
        assert!(parse_layers("x").is_err());
        assert!(parse_layers("").is_err());
        assert!(is_routed_expert("blk.2.ffn_up_exps.weight", &[2]));
        assert!(!is_routed_expert("blk.2.ffn_up_shexp.weight", &[2]));
        assert!(!is_routed_expert("blk.3.ffn_up_exps.weight", &[2]));
    }
}
