//! `--compare-tensor NAME`: the checkpoint tensor behind a GGUF tensor against the GGUF
//! tensor, both as f32, with error statistics (the quantisation error of one tensor).

use anyhow::{ensure, Context, Result};
use ds4_gguf::quant::dequantize_to_vec;
use ds4_gguf::GgufFile;

use crate::hf::Checkpoint;
use crate::names::{self, Source};
use crate::write::{expert_f32, rows_f32};

/// Error statistics of `got` against `want`.
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    pub n: usize,
    pub max_abs: f64,
    pub rms_err: f64,
    pub rms_ref: f64,
    /// Values that differ at all.
    pub differing: usize,
}

impl Stats {
    pub fn of(want: &[f32], got: &[f32]) -> Stats {
        let (mut max_abs, mut se, mut sr, mut differing) = (0.0f64, 0.0f64, 0.0f64, 0);
        for (&w, &g) in want.iter().zip(got) {
            let d = (w as f64 - g as f64).abs();
            max_abs = max_abs.max(d);
            se += d * d;
            sr += (w as f64) * (w as f64);
            differing += (w.to_bits() != g.to_bits()) as usize;
        }
        let n = want.len().max(1) as f64;
        Stats {
            n: want.len(),
            max_abs,
            rms_err: (se / n).sqrt(),
            rms_ref: (sr / n).sqrt(),
            differing,
        }
    }

    pub fn relative(&self) -> f64 {
        if self.rms_ref > 0.0 {
            self.rms_err / self.rms_ref
        } else {
            self.rms_err
        }
    }
}

impl std::fmt::Display for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} values, {} differ: max |Δ| {:.4e}, rms Δ {:.4e}, rms {:.4e}, relative rms Δ {:.4e}",
            self.n,
            self.differing,
            self.max_abs,
            self.rms_err,
            self.rms_ref,
            self.relative()
        )
    }
}

/// Dequantises GGUF tensor `name` of `gguf` and its checkpoint source; returns the
/// statistics (the checkpoint's exact values are the reference).
pub fn compare(ck: &Checkpoint, gguf: &GgufFile, name: &str) -> Result<Stats> {
    let view = gguf
        .tensor(name)
        .with_context(|| format!("the GGUF has no tensor {name}"))?;
    let dims = view.dims().to_vec();
    let n: usize = dims.iter().product::<u64>() as usize;
    let got = dequantize_to_vec(view.ty(), view.data, n)?;
    let cols = dims[0] as usize;
    let want =
        match names::source(name).with_context(|| format!("no checkpoint name for {name}"))? {
            Source::Tensor(hf) => {
                let t = ck.tensor(&hf)?;
                ensure!(
                    t.n_elements() == n,
                    "{hf} has {} values, {name} {n}",
                    t.n_elements()
                );
                if t.dtype == "I64" || t.dtype == "I32" {
                    let b = ck.bytes(t);
                    let w = if t.dtype == "I64" { 8 } else { 4 };
                    b.chunks_exact(w)
                        .map(|c| {
                            let mut a = [0u8; 8];
                            a[..w].copy_from_slice(c);
                            i64::from_le_bytes(a) as f32
                        })
                        .collect()
                } else {
                    rows_f32(ck, &hf, t, cols, 0..n / cols)?
                }
            }
            Source::Experts { layer, part } => {
                let rows = dims[1] as usize;
                let mut v = Vec::with_capacity(n);
                for e in 0..dims[2] as usize {
                    v.extend(expert_f32(
                        ck,
                        &names::expert_name(layer, e, part),
                        rows,
                        cols,
                    )?);
                }
                v
            }
        };
    Ok(Stats::of(&want, &got))
}
