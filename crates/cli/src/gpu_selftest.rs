//! `ds4-tool gpu-selftest`: every CUDA kernel against its CPU twin on fresh random
//! inputs, then (with `bench`) achieved bandwidth at the real model's shapes.

use anyhow::Result;
use ds4_cuda::{DeviceMatrix, Launcher, MatSel, Variant};
use ds4_gguf::quant::dequantize_to_vec;
use ds4_gguf::GgmlType;

use crate::rng::Rng;
use crate::synth::fill_blocks;

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
pub(crate) fn random_matrix(
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

pub(crate) fn random_vec(n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n).map(|_| rng.normal()).collect()
}

/// ‖got − want‖ / ‖want‖ (NaN if any output is not finite or the lengths differ).
pub(crate) fn rel_err(got: &[f32], want: &[f64]) -> f64 {
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

/// CPU reference of `y[k] = W[ids[k]]·x[k]` in f64 over exactly dequantized weights.
fn reference(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    ids: &[i32],
    x: &[f32],
    shared: bool,
) -> Vec<f64> {
    let mat_bytes = w.len() / (w.len() / ty.bytes_for((rows * cols) as u64).unwrap() as usize);
    let mut out = Vec::with_capacity(ids.len() * rows);
    for (k, &id) in ids.iter().enumerate() {
        let m = &w[id as usize * mat_bytes..(id as usize + 1) * mat_bytes];
        let dq = dequantize_to_vec(ty, m, rows * cols).unwrap();
        let xk = if shared {
            &x[..cols]
        } else {
            &x[k * cols..(k + 1) * cols]
        };
        for r in 0..rows {
            out.push(
                dq[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(xk)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum(),
            );
        }
    }
    out
}

/// Correctness checks of every matvec kernel (plain and expert-selected).
pub fn check_kernels(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0xc0de, 0);
    let mut checks = Vec::new();
    let types = [
        GgmlType::Q8_0,
        GgmlType::F16,
        GgmlType::F32,
        GgmlType::IQ2_XXS,
        GgmlType::Q2_K,
        GgmlType::Q4_K,
    ];
    for ty in types {
        for &(rows, cols) in &[(37usize, 512usize), (256, 4096), (129, 2048)] {
            let mats = 5;
            let w = random_matrix(ty, rows, cols, mats, &mut rng);
            let m = DeviceMatrix::upload(gpu, ty, &w, rows, cols, mats)?;
            // Plain product with matrix 0.
            let x = random_vec(cols, &mut rng);
            let xd = gpu.upload(&x)?;
            let mut yd = gpu.upload(&vec![f32::NAN; rows])?;
            gpu.matvec_buf(&m, &xd, &mut yd)?;
            let y = gpu.download(&yd)?;
            checks.push(Check {
                name: format!("matvec {ty} {rows}x{cols}"),
                rel_err: rel_err(&y, &reference(ty, &w, rows, cols, &[0], &x, true)),
                bound: 2e-5,
            });
            // Expert selection with per-selection inputs, repeated ids included.
            let ids = [3i32, 1, 4, 1];
            let x = random_vec(ids.len() * cols, &mut rng);
            let xd = gpu.upload(&x)?;
            let idd = gpu.upload(&ids)?;
            let mut yd = gpu.upload(&vec![f32::NAN; ids.len() * rows])?;
            gpu.matvec_selected(&m, &idd, &xd, false, &mut yd)?;
            let y = gpu.download(&yd)?;
            checks.push(Check {
                name: format!("matvec_selected {ty} {rows}x{cols}"),
                rel_err: rel_err(&y, &reference(ty, &w, rows, cols, &ids, &x, false)),
                bound: 2e-5,
            });
            if matches!(ty, GgmlType::IQ2_XXS | GgmlType::Q2_K | GgmlType::Q4_K) {
                checks.push(check_q8act(gpu, &m, &w, &ids, &x)?);
                checks.push(check_q8act_pair(gpu, &mut rng, &m, &ids)?);
            }
            if matches!(ty, GgmlType::IQ2_XXS | GgmlType::Q2_K) {
                checks.extend(check_kernel_variants(gpu, &mut rng, &m, &ids)?);
            }
        }
    }
    checks.push(check_quantize(gpu, &mut rng)?);
    checks.push(check_quantize_k(gpu, &mut rng)?);
    for &(rows, cols) in &[(37usize, 512usize), (256, 4096)] {
        let w = random_matrix(GgmlType::Q8_0, rows, cols, 5, &mut rng);
        let m = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &w, rows, cols, 5)?;
        let x = random_vec(4 * cols, &mut rng);
        checks.push(check_q8act(gpu, &m, &w, &[3, 1, 4, 1], &x)?);
        checks.extend(check_kernel_variants(gpu, &mut rng, &m, &[3, 1, 4, 1])?);
        let w2 = random_matrix(GgmlType::Q8_0, rows, cols, 1, &mut rng);
        let m2 = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &w2, rows, cols, 1)?;
        checks.push(check_q8act_pair(gpu, &mut rng, &m2, &[])?);
    }
    // Eight steps per lane (one warp per row at 4 selections × 1024 rows): the early
    // Q8_0 kernel's preloaded steps and the loop after them.
    let w = random_matrix(GgmlType::Q8_0, 1024, 8192, 2, &mut rng);
    let m = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &w, 1024, 8192, 2)?;
    let x = random_vec(4 * 8192, &mut rng);
    // Also the upload through the pinned staging buffers (parts of 16 MiB and 1 MiB).
    checks.push(check_q8act(gpu, &m, &w, &[1, 0, 1, 0], &x)?);
    checks.extend(check_kernel_variants(gpu, &mut rng, &m, &[1, 0, 1, 0])?);
    for ty in [GgmlType::F16, GgmlType::F32] {
        for n_tok in [1usize, 7, 130] {
            checks.push(check_hc_mix(gpu, &mut rng, ty, n_tok)?);
        }
    }
    checks.extend(crate::gpu_variant_check::check_variants(gpu, seed)?);
    checks.extend(crate::gpu_matmul_check::check_matmul(gpu, seed)?);
    Ok(checks)
}

/// The hyper-connection mix `mix[t][k] = (fn_k · h_t) / rms(h_t)` (the batched GEMM +
/// scale path for n_tok > 1, the fused kernel for one token) against f64.
fn check_hc_mix(gpu: &Launcher, rng: &mut Rng, ty: GgmlType, n_tok: usize) -> Result<Check> {
    let (rows, cols, eps) = (24usize, 16384usize, 1e-6f32);
    let w = random_matrix(ty, rows, cols, 1, rng);
    let m = DeviceMatrix::upload(gpu, ty, &w, rows, cols, 1)?;
    let h: Vec<f32> = random_vec(n_tok * cols, rng)
        .into_iter()
        .map(|v| 3.0 * v)
        .collect();
    let hd = gpu.upload(&h)?;
    let yd = gpu.upload(&vec![f32::NAN; n_tok * rows])?;
    gpu.hc_mix_mat(n_tok, gpu.ptr(&hd), &m, eps, gpu.ptr(&yd))?;
    let y = gpu.download(&yd)?;
    let dq = dequantize_to_vec(ty, &w, rows * cols)?;
    let mut want = Vec::with_capacity(n_tok * rows);
    for t in 0..n_tok {
        let ht = &h[t * cols..(t + 1) * cols];
        let ss: f64 = ht.iter().map(|&v| v as f64 * v as f64).sum();
        let f = 1.0 / (ss / cols as f64 + eps as f64).sqrt();
        for r in 0..rows {
            let dot: f64 = dq[r * cols..(r + 1) * cols]
                .iter()
                .zip(ht)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            want.push(dot * f);
        }
    }
    Ok(Check {
        name: format!("hc_mix {ty} {rows}x{cols} n{n_tok}"),
        rel_err: rel_err(&y, &want),
        bound: 2e-5,
    })
}

/// The GPU activation quantiser must reproduce `quantize_q8_0` bit for bit.
fn check_quantize(gpu: &Launcher, rng: &mut Rng) -> Result<Check> {
    let rows = 3;
    let cols = 4096;
    let mut x = random_vec(rows * cols, rng);
    x[5] = 0.0;
    x[32..64].fill(0.0); // an all-zero block
    x[64] = 1e-30;
    let xd = gpu.upload(&x)?;
    let mut qa = gpu.alloc_quant_act(rows, cols)?;
    gpu.quantize_act(gpu.ptr(&xd), &mut qa)?;
    let (q, d) = (gpu.download(&qa.q)?, gpu.download(&qa.d)?);
    let want = ds4_gguf::quant::quantize_q8_0_vec(&x);
    let mut mismatches = 0usize;
    for (b, wb) in want.iter().enumerate() {
        mismatches += usize::from(d[b].to_bits() != wb.d.to_bits());
        mismatches += (0..32).filter(|&i| q[b * 32 + i] != wb.qs[i]).count();
    }
    Ok(Check {
        name: "quantize_q8_32 == CPU quantize_q8_0 (bits)".into(),
        rel_err: mismatches as f64,
        bound: 0.0,
    })
}

/// The GPU Q8_K quantiser must reproduce `quantize_q8_k` bit for bit (its scale is
/// stored once per 32 values).
fn check_quantize_k(gpu: &Launcher, rng: &mut Rng) -> Result<Check> {
    let (rows, cols) = (2, 2048);
    let mut x = random_vec(rows * cols, rng);
    x[256..512].fill(0.0); // an all-zero block
    x[600] = -9.0; // the signed maximum is negative
    x[601] = 9.0; // a later tie must not win
    let xd = gpu.upload(&x)?;
    let mut qa = gpu.alloc_quant_act(rows, cols)?;
    gpu.quantize_act_k(gpu.ptr(&xd), &mut qa)?;
    let (q, d) = (gpu.download(&qa.q)?, gpu.download(&qa.d)?);
    let want = ds4_gguf::quant::quantize_q8_k_vec(&x);
    let mut mismatches = 0usize;
    for (b, wb) in want.iter().enumerate() {
        mismatches += (0..8)
            .filter(|&j| d[b * 8 + j].to_bits() != wb.d.to_bits())
            .count();
        mismatches += (0..256).filter(|&i| q[b * 256 + i] != wb.qs[i]).count();
    }
    Ok(Check {
        name: "quantize_q8_k32 == CPU quantize_q8_k (bits)".into(),
        rel_err: mismatches as f64,
        bound: 0.0,
    })
}

/// Expert products with int8 activations against an f64 product of the exactly
/// dequantized weights with the CPU-quantised activations.
fn check_q8act(
    gpu: &Launcher,
    m: &DeviceMatrix,
    w: &[u8],
    ids: &[i32],
    x: &[f32],
) -> Result<Check> {
    let (rows, cols, ty) = (m.rows, m.cols, m.ty);
    let blocks = ds4_gguf::quant::quantize_q8_0_vec(x);
    let xq: Vec<f32> = blocks
        .iter()
        .flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d))
        .collect();
    let xd = gpu.upload(x)?;
    let mut qa = gpu.alloc_quant_act(ids.len(), cols)?;
    gpu.quantize_act(gpu.ptr(&xd), &mut qa)?;
    let idd = gpu.upload(ids)?;
    let yd = gpu.upload(&vec![f32::NAN; ids.len() * rows])?;
    let sel = MatSel {
        ids: gpu.ptr(&idd),
        x_stride: cols as i64,
        y_stride: rows as i64,
    };
    gpu.matvec_q8act(m, &qa, gpu.ptr(&yd), ids.len(), sel)?;
    let y = gpu.download(&yd)?;
    Ok(Check {
        name: format!("matvec_q8act {ty} {rows}x{cols}"),
        rel_err: rel_err(&y, &reference(ty, w, rows, cols, ids, &xq, false)),
        bound: 2e-5,
    })
}

/// Two stacks in one launch against one launch each, bit for bit: selected matrices
/// (`ids`), or with `ids` empty a plain pair (the Q8_0 shared expert's gate and up).
fn check_q8act_pair(gpu: &Launcher, rng: &mut Rng, m: &DeviceMatrix, ids: &[i32]) -> Result<Check> {
    let (rows, cols, ty) = (m.rows, m.cols, m.ty);
    let w2 = random_matrix(ty, rows, cols, m.n_mats, rng);
    let m2 = DeviceMatrix::upload(gpu, ty, &w2, rows, cols, m.n_mats)?;
    let xd = gpu.upload(&random_vec(cols, rng))?;
    let mut qa = gpu.alloc_quant_act(1, cols)?;
    gpu.quantize_act(gpu.ptr(&xd), &mut qa)?;
    let idd = gpu.upload(if ids.is_empty() { &[0i32][..] } else { ids })?;
    let (n_sel, sel) = if ids.is_empty() {
        (1, MatSel::default())
    } else {
        let sel = MatSel {
            ids: gpu.ptr(&idd),
            x_stride: 0,
            y_stride: rows as i64,
        };
        (ids.len(), sel)
    };
    let n = n_sel * rows;
    let bufs: Vec<_> = (0..4)
        .map(|_| gpu.upload(&vec![f32::NAN; n]))
        .collect::<Result<_, _>>()?;
    let p = |i: usize| gpu.ptr(&bufs[i]);
    gpu.matvec_q8act_pair(m, &m2, &qa, p(0), p(1), n_sel, sel)?;
    gpu.matvec_q8act(m, &qa, p(2), n_sel, sel)?;
    gpu.matvec_q8act(&m2, &qa, p(3), n_sel, sel)?;
    let mut got = gpu.download(&bufs[0])?;
    got.extend(gpu.download(&bufs[1])?);
    let mut want = gpu.download(&bufs[2])?;
    want.extend(gpu.download(&bufs[3])?);
    Ok(bit_identical(
        format!("matvec_q8act_pair {ty} {rows}x{cols}"),
        same_bits(&got, &want),
    ))
}

/// The RoPE table of `rope_dim` dims (base 10,000) the attention and indexer checks use.
pub(crate) fn rope_freqs(rope_dim: usize) -> Vec<f32> {
    (0..rope_dim / 2)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / rope_dim as f32))
        .collect()
}

/// `freqs` on the device and the kernels' RoPE parameters over them (the buffer must
/// outlive every launch that takes the parameters).
pub(crate) fn upload_rope(
    gpu: &Launcher,
    freqs: &[f32],
) -> Result<(ds4_cuda::DeviceBuf<f32>, ds4_cuda::RopeP)> {
    let buf = gpu.upload(freqs)?;
    let rope = ds4_cuda::RopeP {
        freqs: gpu.ptr(&buf),
        rope_dim: 2 * freqs.len() as i32,
        pad: 0,
    };
    Ok((buf, rope))
}

/// How far two outputs that should agree bit for bit are apart: a failed bit-identity
/// check then says whether it is a rounding (a few values, ~1e-7) or a wrong kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct BitDiff {
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
pub(crate) fn same_bits(a: &[f32], b: &[f32]) -> BitDiff {
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
pub(crate) fn bit_identical(name: String, diff: BitDiff) -> Check {
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

/// The expert matvecs with their activations in registers against the staged kernels,
/// bit for bit, with per-selection inputs and one shared input: IQ2_XXS at 4096 columns
/// (`matvec_iq2_xxs_q8_rx`, `_rxe` building its tables
/// before the PDL wait, `_rxp` and `probe_iq2_rxp4` loading the next row unit while
/// computing one, `_rxt` / `_rxtp` with iq2_xxs_dot_tab's lookups), Q2_K
/// at 2048 (`matvec_q2_k_q8_rx`), Q8_0 with its first weight loads before the PDL wait
/// (`matvec_q8_0_q8_early`). Other shapes have only the staged kernel.
fn check_kernel_variants(
    gpu: &Launcher,
    rng: &mut Rng,
    m: &DeviceMatrix,
    ids: &[i32],
) -> Result<Option<Check>> {
    let (rows, cols) = (m.rows, m.cols);
    let (staged, variants): (&'static str, &[&'static str]) = match (m.ty, cols) {
        (GgmlType::IQ2_XXS, 4096) => (
            "matvec_iq2_xxs_q8",
            &[
                "matvec_iq2_xxs_q8_rx",
                "matvec_iq2_xxs_q8_rxe",
                "matvec_iq2_xxs_q8_rxp",
                "probe_iq2_rxp4",
                "matvec_iq2_xxs_q8_rxt",
                "matvec_iq2_xxs_q8_rxtp",
            ],
        ),
        (GgmlType::Q2_K, 2048) => ("matvec_q2_k_q8", &["matvec_q2_k_q8_rx"]),
        (GgmlType::Q8_0, _) => ("matvec_q8_0_q8", &["matvec_q8_0_q8_early"]),
        _ => return Ok(None),
    };
    let xd = gpu.upload(&random_vec(ids.len() * cols, rng))?;
    let mut qa = gpu.alloc_quant_act(ids.len(), cols)?;
    gpu.quantize_act(gpu.ptr(&xd), &mut qa)?;
    let idd = gpu.upload(ids)?;
    let mut same = BitDiff::default();
    for x_stride in [cols as i64, 0] {
        let sel = MatSel {
            ids: gpu.ptr(&idd),
            x_stride,
            y_stride: rows as i64,
        };
        let run = |kernel: &'static str| -> Result<Vec<f32>> {
            let y = gpu.upload(&vec![f32::NAN; ids.len() * rows])?;
            gpu.matvec_q8act_kernel(m, &qa, gpu.ptr(&y), ids.len(), sel, kernel)?;
            Ok(gpu.download(&y)?)
        };
        let want = run(staged)?;
        for &kernel in variants {
            same = same.merge(same_bits(&run(kernel)?, &want));
        }
    }
    Ok(Some(bit_identical(
        format!("{} = {staged} {rows}x{cols}", variants.join(", ")),
        same,
    )))
}

/// Eight rotating selections of `used` distinct-looking experts out of `mats`.
fn expert_id_sets(
    gpu: &Launcher,
    used: usize,
    mats: usize,
) -> Result<Vec<ds4_cuda::DeviceBuf<i32>>> {
    (0..8)
        .map(|s| {
            let ids: Vec<i32> = (0..used as i32)
                .map(|k| (k * 41 + s * 29) % mats as i32)
                .collect();
            Ok(gpu.upload(&ids)?)
        })
        .collect()
}

/// Milliseconds per call of the int8-activation expert matvec over `used` selections
/// of the stack `m` (input `x`: one shared row, or one row per selection), or of the
/// IQ2_XXS probe kernel `probe` in its place.
fn time_experts_q8act(
    gpu: &Launcher,
    m: &DeviceMatrix,
    x: &ds4_cuda::DeviceBuf<f32>,
    used: usize,
    shared: bool,
    probe: Option<&'static str>,
) -> Result<f64> {
    let (rows, cols) = (m.rows, m.cols);
    let y = gpu.zeros::<f32>(used * rows)?;
    let mut qa = gpu.alloc_quant_act(if shared { 1 } else { used }, cols)?;
    gpu.quantize_act(gpu.ptr(x), &mut qa)?;
    let id_sets = expert_id_sets(gpu, used, m.n_mats)?;
    let yp = gpu.ptr(&y);
    Ok(gpu.time_ms(3, 50, |i| {
        let sel = MatSel {
            ids: gpu.ptr(&id_sets[i % id_sets.len()]),
            x_stride: if shared { 0 } else { cols as i64 },
            y_stride: rows as i64,
        };
        match probe {
            Some(kernel) => gpu.matvec_q8act_kernel(m, &qa, yp, used, sel, kernel),
            None => gpu.matvec_q8act(m, &qa, yp, used, sel),
        }
    })?)
}

/// Bandwidth of the decode matvecs at DeepSeek V4 Flash shapes. Several copies of
/// each weight rotate so that the L2 cache cannot hold them.
pub fn bench_kernels(gpu: &Launcher, seed: u64) -> Result<Vec<Timing>> {
    let mut rng = Rng::stream(seed, 0xbe4c, 0);
    let mut out = Vec::new();
    let l2 = gpu.info().l2_bytes.max(1) as usize;
    // (name, type, rows, cols, matrices in the stack, matrices used per call, shared input)
    let shapes: &[(&str, GgmlType, usize, usize, usize, usize, bool)] = &[
        (
            "attn_q_b Q8_0 1024->32768",
            GgmlType::Q8_0,
            32768,
            1024,
            1,
            1,
            true,
        ),
        (
            "attn_output_b Q8_0 8192->4096",
            GgmlType::Q8_0,
            4096,
            8192,
            1,
            1,
            true,
        ),
        (
            "attn_q_a Q8_0 4096->1024",
            GgmlType::Q8_0,
            1024,
            4096,
            1,
            1,
            true,
        ),
        (
            "output Q8_0 4096->129280",
            GgmlType::Q8_0,
            129_280,
            4096,
            1,
            1,
            true,
        ),
        (
            "compressor_kv F16 4096->1024",
            GgmlType::F16,
            1024,
            4096,
            1,
            1,
            true,
        ),
        (
            "indexer q_b F16 1024->8192",
            GgmlType::F16,
            8192,
            1024,
            1,
            1,
            true,
        ),
        (
            "ffn_gate_inp F16 4096->256",
            GgmlType::F16,
            256,
            4096,
            1,
            1,
            true,
        ),
        ("hc_fn F16 16384->24", GgmlType::F16, 24, 16384, 1, 1, true),
        (
            "6 experts gate IQ2_XXS 4096->2048",
            GgmlType::IQ2_XXS,
            2048,
            4096,
            256,
            6,
            true,
        ),
        (
            "6 experts down Q2_K 2048->4096",
            GgmlType::Q2_K,
            4096,
            2048,
            256,
            6,
            false,
        ),
        (
            "6 experts gate Q4_K 4096->2048",
            GgmlType::Q4_K,
            2048,
            4096,
            256,
            6,
            true,
        ),
        (
            "6 experts down Q4_K 2048->4096",
            GgmlType::Q4_K,
            4096,
            2048,
            256,
            6,
            false,
        ),
    ];
    for &(name, ty, rows, cols, mats, used, shared) in shapes {
        let w = random_matrix(ty, rows, cols, mats, &mut rng);
        let m = DeviceMatrix::upload(gpu, ty, &w, rows, cols, mats)?;
        let per_call = m.bytes_per_matrix() * used;
        // Enough copies (or distinct experts) that consecutive calls miss the L2.
        let copies = if mats > 1 {
            1
        } else {
            (4 * l2 / m.bytes()).clamp(1, 16)
        };
        let mut extra = Vec::new();
        for _ in 1..copies {
            extra.push(DeviceMatrix::upload(gpu, ty, &w, rows, cols, mats)?);
        }
        let x = gpu.upload(&random_vec(used * cols, &mut rng))?;
        let mut y = gpu.zeros::<f32>(used * rows)?;
        let id_sets = expert_id_sets(gpu, used, mats)?;
        let ms = gpu.time_ms(3, 50, |i| {
            let mm = if i % copies == 0 {
                &m
            } else {
                &extra[i % copies - 1]
            };
            if mats > 1 {
                gpu.matvec_selected(mm, &id_sets[i % id_sets.len()], &x, shared, &mut y)
            } else {
                gpu.matvec_buf(mm, &x, &mut y)
            }
        })?;
        out.push(Timing {
            name: name.to_string(),
            bytes: per_call as f64,
            ms,
        });
        if mats > 1 {
            out.push(Timing {
                name: format!("{name} [int8 act]"),
                bytes: per_call as f64,
                ms: time_experts_q8act(gpu, &m, &x, used, shared, None)?,
            });
        }
    }
    out.extend(crate::gpu_matmul_check::bench_matmul(gpu, seed)?);
    Ok(out)
}

/// The GPU's read-bandwidth ceiling, then the Q8_0 decode matvec at the Flash shapes
/// with its default and with every forced split (warps per row). Each forced split's
/// name carries its largest difference from the default's output, relative to the
/// output's largest magnitude.
pub fn probe_q8_splits(gpu: &Launcher, seed: u64) -> Result<Vec<Timing>> {
    let mut rng = Rng::stream(seed, 0xbe4e, 0);
    let mut out = Vec::new();
    let l2 = gpu.info().l2_bytes.max(1) as usize;
    let probe_bytes = 1usize << 30;
    let buf = gpu.upload(&vec![0x5au8; probe_bytes])?;
    let sink = gpu.zeros::<u32>(1)?;
    let ms = gpu.time_ms(3, 20, |_| gpu.probe_stream_read(&buf, &sink))?;
    out.push(Timing {
        name: "read probe 1 GiB".into(),
        bytes: probe_bytes as f64,
        ms,
    });
    drop(buf);
    for blocks in [1u32, 132, 1024] {
        let us = gpu.probe_graph_node_us(1000, blocks, 20)?;
        out.push(Timing {
            name: format!("graph node, empty kernel x {blocks} blocks"),
            bytes: 0.0,
            ms: us / 1e3,
        });
    }
    // The routed experts' int8 matvecs (6 of 256 experts, as in decode).
    for (name, ty, rows, cols, shared) in [
        (
            "6 experts gate IQ2_XXS 4096->2048",
            GgmlType::IQ2_XXS,
            2048,
            4096,
            true,
        ),
        (
            "6 experts down Q2_K 2048->4096",
            GgmlType::Q2_K,
            4096,
            2048,
            false,
        ),
    ] {
        let (mats, used) = (256usize, 6usize);
        let w = random_matrix(ty, rows, cols, mats, &mut rng);
        let m = DeviceMatrix::upload(gpu, ty, &w, rows, cols, mats)?;
        let x = gpu.upload(&random_vec(used * cols, &mut rng))?;
        out.push(Timing {
            name: name.into(),
            bytes: (m.bytes_per_matrix() * used) as f64,
            ms: time_experts_q8act(gpu, &m, &x, used, shared, None)?,
        });
        if ty == GgmlType::IQ2_XXS {
            // The same launch with parts of the work taken out: what bounds it.
            for (what, kernel) in [
                ("without table lookups", "probe_iq2_nolut"),
                ("without activation reads", "probe_iq2_nox"),
                ("weight loads only", "probe_iq2_loads"),
            ] {
                out.push(Timing {
                    name: format!("{name} {what}"),
                    bytes: (m.bytes_per_matrix() * used) as f64,
                    ms: time_experts_q8act(gpu, &m, &x, used, shared, Some(kernel))?,
                });
            }
        }
    }
    // The gate and up pair in one launch, as decode runs it, through each IQ2_XXS
    // register-activation kernel and the probes of its structure.
    {
        let (mats, used, rows, cols) = (256usize, 6usize, 2048usize, 4096usize);
        let ty = GgmlType::IQ2_XXS;
        let mut stack = || {
            let w = random_matrix(ty, rows, cols, mats, &mut rng);
            DeviceMatrix::upload(gpu, ty, &w, rows, cols, mats)
        };
        let (gate, up) = (stack()?, stack()?);
        let x = gpu.upload(&random_vec(cols, &mut rng))?;
        let mut qa = gpu.alloc_quant_act(1, cols)?;
        gpu.quantize_act(gpu.ptr(&x), &mut qa)?;
        let (y, y2) = (
            gpu.zeros::<f32>(used * rows)?,
            gpu.zeros::<f32>(used * rows)?,
        );
        let id_sets = expert_id_sets(gpu, used, mats)?;
        for kernel in [
            "matvec_iq2_xxs_q8_rxe",
            "matvec_iq2_xxs_q8_rxp",
            "probe_iq2_rxp4",
            "matvec_iq2_xxs_q8_rxt",
            "matvec_iq2_xxs_q8_rxtp",
            "probe_iq2_rx_nolut",
            "probe_iq2_rx_loads",
            "probe_iq2_rxp_nolut",
            "probe_iq2_rxp_loads",
        ] {
            let ms = gpu.time_ms(3, 50, |i| {
                let sel = MatSel {
                    ids: gpu.ptr(&id_sets[i % id_sets.len()]),
                    x_stride: 0,
                    y_stride: rows as i64,
                };
                gpu.matvec_q8act_pair_kernel(
                    &gate,
                    &up,
                    &qa,
                    gpu.ptr(&y),
                    gpu.ptr(&y2),
                    used,
                    sel,
                    kernel,
                )
            })?;
            out.push(Timing {
                name: format!("6 experts gate+up IQ2_XXS {kernel}"),
                bytes: (2 * gate.bytes_per_matrix() * used) as f64,
                ms,
            });
        }
    }
    // (name, rows, cols, selections sharing one matrix stack row count)
    let shapes: &[(&str, usize, usize, usize)] = &[
        ("attn_q_b 1024->32768", 32768, 1024, 1),
        ("attn_output_a 8x(4096->1024)", 1024, 4096, 8),
        ("attn_output_b 8192->4096", 4096, 8192, 1),
        ("attn_q_a 4096->1024", 1024, 4096, 1),
        ("attn_kv 4096->512", 512, 4096, 1),
        ("shexp gate 4096->2048", 2048, 4096, 1),
        ("shexp down 2048->4096", 4096, 2048, 1),
        ("output 4096->129280", 129_280, 4096, 1),
    ];
    for &(name, rows, cols, n_sel) in shapes {
        let w = random_matrix(GgmlType::Q8_0, rows, cols, n_sel, &mut rng);
        let upload = || DeviceMatrix::upload(gpu, GgmlType::Q8_0, &w, rows, cols, n_sel);
        let first = upload()?;
        let copies = (4 * l2 / first.bytes()).clamp(1, 16);
        let mut mats = vec![first];
        for _ in 1..copies {
            mats.push(upload()?);
        }
        let x = gpu.upload(&random_vec(cols * n_sel, &mut rng))?;
        let mut qa = gpu.alloc_quant_act(n_sel, cols)?;
        gpu.quantize_act(gpu.ptr(&x), &mut qa)?;
        let y = gpu.zeros::<f32>(rows * n_sel)?;
        let yp = gpu.ptr(&y);
        let ids = gpu.upload(&(0..n_sel as i32).collect::<Vec<_>>())?;
        let sel = MatSel {
            ids: if n_sel > 1 { gpu.ptr(&ids) } else { 0 },
            x_stride: if n_sel > 1 { cols as i64 } else { 0 },
            y_stride: rows as i64,
        };
        let bytes = mats[0].bytes() as f64;
        let run = |gpu: &Launcher, ks: Option<u32>| -> Result<(f64, Vec<f32>)> {
            let ms = gpu.time_ms(3, 50, |i| {
                gpu.matvec_q8act_split(&mats[i % copies], &qa, yp, n_sel, sel, ks)
            })?;
            Ok((ms, gpu.download(&y)?))
        };
        let (ms, want) = run(gpu, None)?;
        out.push(Timing {
            name: format!("{name} default"),
            bytes,
            ms,
        });
        // The default packs 4 (≤ 1,024 columns) or 2 one-warp rows a warp (q8_rows,
        // q8_rows2); the same launch with one row a warp.
        let rows_fusion = if cols <= 1024 {
            Variant::Q8Rows
        } else {
            Variant::Q8Rows2
        };
        let (ms, got) = run(&gpu.with(rows_fusion, false), None)?;
        let same = got
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        out.push(Timing {
            name: format!(
                "{name} -{rows_fusion} (one row a warp{})",
                if same { "" } else { ", differs" }
            ),
            bytes,
            ms,
        });
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-30);
        for ks in [1u32, 2, 4, 8] {
            let (ms, got) = run(gpu, Some(ks))?;
            let diff = got
                .iter()
                .zip(&want)
                .fold(0f32, |a, (g, w)| a.max((g - w).abs()))
                / scale;
            out.push(Timing {
                name: format!("{name} ks{ks} (Δ {diff:.0e})"),
                bytes,
                ms,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{bit_identical, same_bits};

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
