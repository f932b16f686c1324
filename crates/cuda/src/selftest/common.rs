//! What every check file shares: the result lines ([`Check`], [`Timing`]) and their
//! printed form, the tolerances, random inputs, and the comparisons (relative error
//! against an f64 reference, bit identity between a kernel and its variant).

use anyhow::Result;
use ds4_gguf::quant::random::{fill_blocks, Rng};
use ds4_gguf::GgmlType;

use crate::{Batch, Launcher, Variant};

/// A matvec against the f64 product of the exactly dequantized weights: f32 sums over
/// up to 16,384 columns in the kernel's order.
pub const BOUND_MATVEC: f64 = 2e-5;
/// Two f32 computations of the same values that differ only in summation order (the
/// batched GEMMs against f64 and against the decode kernels, the f32 attention).
pub const BOUND_F32: f64 = 1e-5;
/// The tensor-core prefill attention: fp16 operands.
pub const BOUND_FP16_MMA: f64 = 2e-3;
/// F16 weights × f32 activations split into fp16 hi + lo (22 bits, as the tf32 split) on
/// fp16 tensor cores: the products are exact, but the tensor cores' f32 accumulation
/// truncates, so the error grows with K (measured 2.8e-6 at K = 1,024, 1.2e-5 at 4,096
/// on an H200; the two-level sum of the tf32 kernels stays under 1e-5).
pub const BOUND_F16_SPLIT: f64 = 3e-5;
/// Width of the name column of `ds4-tool gpu-selftest`'s result lines.
pub const NAME_WIDTH: usize = 44;

/// The model's Q8_0 weight shapes the matvec and GEMM benchmarks time: (name, rows,
/// cols, matrices in the stack).
/// The IQ2_XXS register-activation kernels at 4096 columns (the experts' gate and up):
/// the selftest checks each against the staged kernel bit for bit, `--probe-q8` times
/// them (all but the plain `_rx`) in a gate+up pair launch.
pub const IQ2_RX_KERNELS: [&str; 8] = [
    "matvec_iq2_xxs_q8_rx",
    "matvec_iq2_xxs_q8_rxe",
    "matvec_iq2_xxs_q8_rxp",
    "probe_iq2_rxp4",
    "matvec_iq2_xxs_q8_rxt",
    "matvec_iq2_xxs_q8_rxtp",
    "matvec_iq2_xxs_q8_rxtl",
    "matvec_iq2_xxs_q8_rxtm",
];

pub const Q8_SHAPES: &[(&str, usize, usize, usize)] = &[
    ("attn_q_b 1024->32768", 32768, 1024, 1),
    ("attn_output_a 8x(4096->1024)", 1024, 4096, 8),
    ("attn_output_b 8192->4096", 4096, 8192, 1),
    ("attn_q_a 4096->1024", 1024, 4096, 1),
    ("attn_kv 4096->512", 512, 4096, 1),
    ("shexp gate 4096->2048", 2048, 4096, 1),
    ("shexp down 2048->4096", 4096, 2048, 1),
    ("output 4096->129280", 129_280, 4096, 1),
];

/// One line of the report.
#[derive(Clone, Debug)]
pub struct Check {
    pub name: String,
    /// ‖gpu − cpu‖ / ‖cpu‖ against the f64 reference.
    pub rel_err: f64,
    pub bound: f64,
}

impl Check {
    pub fn passed(&self) -> bool {
        self.rel_err.is_finite() && self.rel_err <= self.bound
    }

    /// The printed result line, the name padded to `width` ([`NAME_WIDTH`] in the full
    /// run): `PASS name rel err 1.23e-6 (bound 2e-5)`.
    pub fn line(&self, width: usize) -> String {
        format!(
            "{} {:<width$} rel err {:.2e} (bound {:.0e})",
            if self.passed() { "PASS" } else { "FAIL" },
            self.name,
            self.rel_err,
            self.bound
        )
    }
}

/// The closing line of a run: `N passed, N failed`.
pub fn summary_line(passed: usize, failed: usize) -> String {
    format!("{passed} passed, {failed} failed")
}

#[derive(Clone, Debug)]
pub struct Timing {
    pub name: String,
    pub bytes: f64,
    pub ms: f64,
}

impl Timing {
    pub fn gbps(&self) -> f64 {
        self.bytes / self.ms / 1e6
    }
}

/// Random weights of `mats` matrices of rows × cols in the block format `ty` (values
/// ~ N(0, 1/cols) before quantisation).
pub fn random_matrix(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    mats: usize,
    rng: &mut Rng,
) -> Vec<u8> {
    let n = rows * cols * mats;
    if ty == GgmlType::BF16 {
        let x: Vec<f32> = (0..n)
            .map(|_| rng.normal() / (cols as f32).sqrt())
            .collect();
        return ds4_gguf::quant::quantize_weights(ty, &x).expect("bf16");
    }
    let mut buf = vec![0u8; ty.bytes_for(n as u64).expect("whole blocks") as usize];
    fill_blocks(ty, 1.0 / (cols as f32).sqrt(), &mut buf, rng);
    buf
}

pub fn random_vec(n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n).map(|_| rng.normal()).collect()
}

/// ‖got − want‖ / ‖want‖ (NaN if any output is not finite or the lengths differ).
pub fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    if got.iter().any(|g| !g.is_finite()) || got.len() != want.len() {
        return f64::NAN;
    }
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den.max(1e-300)).sqrt()
}

/// Int8 values with one scale per 32 (a Q8_0 / Q8_K activation) as floats.
pub fn dequant_q8(q: &[i8], d: &[f32]) -> Vec<f32> {
    q.iter()
        .enumerate()
        .map(|(i, &v)| v as f32 * d[i / 32])
        .collect()
}

/// `n` values ~ N(0, s²).
pub fn normal(rng: &mut Rng, n: usize, s: f32) -> Vec<f32> {
    (0..n).map(|_| rng.normal() * s).collect()
}

/// Runs `f` with variant `v` off, then on; both results.
pub fn both<T>(gpu: &Launcher, v: Variant, f: impl Fn(&Launcher) -> Result<T>) -> Result<(T, T)> {
    let plain = f(&gpu.with(v, false))?;
    let variant = f(&gpu.with(v, true))?;
    Ok((plain, variant))
}

/// `bit_identical` of two outputs.
pub fn bit_same(name: String, a: &[f32], b: &[f32]) -> Check {
    bit_identical(name, same_bits(a, b))
}

/// A variant check: `f` with `v` off and on must give bit-identical values.
pub fn same_both(
    gpu: &Launcher,
    v: Variant,
    name: String,
    f: impl Fn(&Launcher) -> Result<Vec<f32>>,
) -> Result<Check> {
    let (plain, variant) = both(gpu, v, f)?;
    Ok(bit_same(name, &plain, &variant))
}

/// The RoPE table of `rope_dim` dims (base 10,000) the attention and indexer checks use.
pub fn rope_freqs(rope_dim: usize) -> Vec<f32> {
    (0..rope_dim / 2)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / rope_dim as f32))
        .collect()
}

/// `freqs` on the device and the kernels' RoPE parameters over them (the buffer must
/// outlive every launch that takes the parameters).
pub fn upload_rope(gpu: &Launcher, freqs: &[f32]) -> Result<(crate::DeviceBuf<f32>, crate::RopeP)> {
    let buf = gpu.upload(freqs)?;
    let rope = crate::RopeP {
        freqs: gpu.ptr(&buf),
        rope_dim: 2 * freqs.len() as i32,
        pad: 0,
    };
    Ok((buf, rope))
}

/// How far two outputs that should agree bit for bit are apart: a failed bit-identity
/// check then says whether it is a rounding (a few values, ~1e-7) or a wrong kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BitDiff {
    /// Values whose bits differ (or, for outputs of different lengths, the longer length).
    pub differ: usize,
    pub total: usize,
    /// The largest |a − b| / max(|a|, |b|) over the differing values; ∞ where one side is
    /// NaN or the lengths differ.
    pub max_rel: f64,
}

impl BitDiff {
    pub fn same(&self) -> bool {
        self.differ == 0
    }

    /// Both comparisons together (a check over several runs).
    pub fn merge(self, o: BitDiff) -> BitDiff {
        BitDiff {
            differ: self.differ + o.differ,
            total: self.total + o.total,
            max_rel: self.max_rel.max(o.max_rel),
        }
    }
}

/// Compares two outputs bit for bit.
pub fn same_bits(a: &[f32], b: &[f32]) -> BitDiff {
    if a.len() != b.len() {
        return BitDiff {
            differ: a.len().max(b.len()),
            total: a.len().max(b.len()),
            max_rel: f64::INFINITY,
        };
    }
    let mut d = BitDiff {
        total: a.len(),
        ..BitDiff::default()
    };
    for (&x, &y) in a.iter().zip(b) {
        if x.to_bits() == y.to_bits() {
            continue;
        }
        d.differ += 1;
        let (x, y) = (x as f64, y as f64);
        let rel = if x.is_nan() || y.is_nan() {
            f64::INFINITY
        } else {
            (x - y).abs() / x.abs().max(y.abs()).max(f64::MIN_POSITIVE)
        };
        d.max_rel = d.max_rel.max(rel);
    }
    d
}

/// A check that passes only when two kernels' outputs were identical; a failure reports
/// how many values differ and by how much.
pub fn bit_identical(name: String, diff: BitDiff) -> Check {
    if diff.same() {
        return Check {
            name: format!("{name} (bit-identical)"),
            rel_err: 0.0,
            bound: 0.0,
        };
    }
    Check {
        name: format!(
            "{name} (bit-identical; {} of {} values differ)",
            diff.differ, diff.total
        ),
        // Differing bits never pass, even where the values compare equal (±0).
        rel_err: diff.max_rel.max(f64::MIN_POSITIVE),
        bound: 0.0,
    }
}

/// [`rel_err`] of a [`gather`]ed batch output, or NaN (a failure) where the kernel also
/// wrote outside its addressed slots (`canaries` false).
pub fn gathered_err(got: &[f32], want: &[f64], canaries: bool) -> f64 {
    if canaries {
        rel_err(got, want)
    } else {
        f64::NAN
    }
}

/// Addressed outputs of a batch, in (token, group, row) order, and whether every other
/// slot of the buffer kept its NaN canary.
pub fn gather(y: &[f32], b: &Batch, rows: usize) -> (Vec<f32>, bool) {
    let mut out = Vec::with_capacity(b.n_tok * b.n_groups * rows);
    let mut touched = vec![false; y.len()];
    for t in 0..b.n_tok {
        for g in 0..b.n_groups {
            for r in 0..rows {
                let i = t * b.y_tok + g * b.y_grp + r;
                out.push(y[i]);
                touched[i] = true;
            }
        }
    }
    let canaries = y.iter().zip(&touched).all(|(v, &t)| t || v.is_nan());
    (out, canaries)
}

#[cfg(test)]
mod tests {
    use super::{bit_identical, same_bits, summary_line, Check, NAME_WIDTH};

    /// The result lines keep `gpu-selftest`'s format (scripts compare runs by them).
    #[test]
    fn result_lines_keep_their_format() {
        let c = Check {
            name: "matvec Q8_0 37x512".into(),
            rel_err: 1.234e-6,
            bound: 2e-5,
        };
        assert_eq!(
            c.line(NAME_WIDTH),
            format!("PASS {:<44} rel err 1.23e-6 (bound 2e-5)", c.name)
        );
        let bad = Check {
            rel_err: f64::NAN,
            ..c
        };
        assert!(bad.line(60).starts_with("FAIL matvec Q8_0 37x512 "));
        assert_eq!(bad.line(60).find(" rel err"), Some(5 + 60));
        assert_eq!(summary_line(383, 1), "383 passed, 1 failed");
    }

    #[test]
    fn bit_identity_reports_how_far_apart() {
        let a = [1.0f32, -2.0, 3.0, 0.0];
        let d = same_bits(&a, &a);
        assert!(d.same() && bit_identical("x".into(), d).passed());

        // One rounding apart: fails, and says by how much.
        let mut b = a;
        b[2] = f32::from_bits(3.0f32.to_bits() + 1);
        let c = bit_identical("x".into(), same_bits(&a, &b));
        assert!(!c.passed());
        assert!(c.name.contains("1 of 4 values differ"), "{}", c.name);
        assert!(c.rel_err > 1e-8 && c.rel_err < 1e-6, "{}", c.rel_err);

        // Equal values with different bits (±0) still fail.
        b = a;
        b[3] = -0.0;
        assert!(!bit_identical("x".into(), same_bits(&a, &b)).passed());

        // NaN against a number, and different lengths: infinitely far.
        b = a;
        b[0] = f32::NAN;
        assert!(same_bits(&a, &b).max_rel.is_infinite());
        assert!(same_bits(&a, &a[..3]).max_rel.is_infinite());
        assert_eq!(same_bits(&a, &b).merge(same_bits(&a, &a)).differ, 1);
    }
}
