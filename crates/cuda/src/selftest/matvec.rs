//! Every decode matvec kernel against its CPU twin on fresh random inputs: plain and
//! expert-selected products of each weight format, the int8-activation kernels and
//! their register / early-load variants (bit for bit against the staged kernels), the
//! activation quantisers (bit for bit against the CPU's), the hyper-connection mix.

use anyhow::Result;
use ds4_gguf::quant::dequantize_to_vec;
use ds4_gguf::quant::random::Rng;
use ds4_gguf::GgmlType;

use super::common::{
    bit_identical, random_matrix, random_vec, rel_err, same_bits, BitDiff, Check, BOUND_MATVEC,
    IQ2_RX_KERNELS,
};
use crate::{DeviceMatrix, Launcher, MatSel, Variant};
use rayon::prelude::*;

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

/// Correctness checks of every matvec kernel (plain and expert-selected), one random
/// stream through all of them.
pub fn check_matvecs(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
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
                bound: BOUND_MATVEC,
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
                bound: BOUND_MATVEC,
            });
            if matches!(ty, GgmlType::IQ2_XXS | GgmlType::Q2_K | GgmlType::Q4_K) {
                checks.push(check_q8act(gpu, &m, &w, &ids, &x, false)?);
                // The models' expert inputs (Q8_K rule: the IQ2_XXS / Q2_K kernels'
                // integer form, see iq2_xxs_dot_sel and q2k_lane_add_int).
                checks.push(check_q8act(gpu, &m, &w, &ids, &x, true)?);
                checks.push(check_q8act_pair(gpu, &mut rng, &m, &ids)?);
            }
            if matches!(ty, GgmlType::IQ2_XXS | GgmlType::Q2_K | GgmlType::Q4_K) {
                checks.extend(check_kernel_variants(gpu, &mut rng, &m, &ids, false)?);
                checks.extend(check_kernel_variants(gpu, &mut rng, &m, &ids, true)?);
            }
        }
    }
    checks.push(check_quantize(gpu, &mut rng)?);
    checks.push(check_quantize_k(gpu, &mut rng)?);
    for &(rows, cols) in &[(37usize, 512usize), (256, 4096)] {
        let w = random_matrix(GgmlType::Q8_0, rows, cols, 5, &mut rng);
        let m = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &w, rows, cols, 5)?;
        let x = random_vec(4 * cols, &mut rng);
        checks.push(check_q8act(gpu, &m, &w, &[3, 1, 4, 1], &x, false)?);
        checks.extend(check_kernel_variants(
            gpu,
            &mut rng,
            &m,
            &[3, 1, 4, 1],
            false,
        )?);
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
    checks.push(check_q8act(gpu, &m, &w, &[1, 0, 1, 0], &x, false)?);
    checks.extend(check_kernel_variants(
        gpu,
        &mut rng,
        &m,
        &[1, 0, 1, 0],
        false,
    )?);
    for ty in [GgmlType::F16, GgmlType::F32] {
        for n_tok in [1usize, 7, 130] {
            checks.push(check_hc_mix(gpu, &mut rng, ty, n_tok)?);
        }
    }
    Ok(checks)
}

/// The hyper-connection mix `mix[t][k] = (fn_k · h_t) / rms(h_t)` (the batched GEMM +
/// scale path for n_tok > 1, the fused kernel for one token) against f64.
fn check_hc_mix(gpu: &Launcher, rng: &mut Rng, ty: GgmlType, n_tok: usize) -> Result<Check> {
    let (y, want) = hc_mix_run(&[gpu], rng, ty, 24, n_tok)?;
    Ok(Check {
        name: format!("hc_mix {ty} 24x16384 n{n_tok}"),
        rel_err: rel_err(&y[0], &want),
        bound: BOUND_MATVEC,
    })
}

/// The mix of random F16/F32 weights (`rows` × 16,384) and `n_tok` random H rows
/// through each launcher of `gpus` (`hc_mix_mat`), and its f64 value.
fn hc_mix_run(
    gpus: &[&Launcher],
    rng: &mut Rng,
    ty: GgmlType,
    rows: usize,
    n_tok: usize,
) -> Result<(Vec<Vec<f32>>, Vec<f64>)> {
    let (cols, eps) = (16384usize, 1e-6f32);
    let gpu = gpus[0];
    let w = random_matrix(ty, rows, cols, 1, rng);
    let m = DeviceMatrix::upload(gpu, ty, &w, rows, cols, 1)?;
    let h: Vec<f32> = random_vec(n_tok * cols, rng)
        .into_iter()
        .map(|v| 3.0 * v)
        .collect();
    let hd = gpu.upload(&h)?;
    let mut ys = Vec::new();
    for g in gpus {
        let yd = g.upload(&vec![f32::NAN; n_tok * rows])?;
        g.hc_mix_mat(n_tok, g.ptr(&hd), &m, eps, g.ptr(&yd))?;
        ys.push(g.download(&yd)?);
    }
    let dq = dequantize_to_vec(ty, &w, rows * cols)?;
    let want: Vec<f64> = (0..n_tok)
        .into_par_iter()
        .flat_map_iter(|t| {
            let ht = &h[t * cols..(t + 1) * cols];
            let ss: f64 = ht.iter().map(|&v| v as f64 * v as f64).sum();
            let f = 1.0 / (ss / cols as f64 + eps as f64).sqrt();
            let dq = &dq;
            (0..rows).map(move |r| {
                let dot: f64 = dq[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(ht)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum();
                dot * f
            })
        })
        .collect();
    Ok((ys, want))
}

/// `hc_mix_tc` (a chunk's mix in one pass over H) against f64 and against the GEMM +
/// scale path it replaces, at token counts that do and do not fill its 16-token
/// blocks, the model's 24 rows and the output head's 4.
pub(super) fn check_hc_mix_tc(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x4c3, 0);
    let (on, off) = (
        gpu.with(Variant::HcMixTc, true),
        gpu.with(Variant::HcMixTc, false),
    );
    let mut out = Vec::new();
    for &(rows, n_tok) in &[(24usize, 17usize), (24, 130), (24, 2055), (4, 48)] {
        let (y, want) = hc_mix_run(&[&on, &off], &mut rng, GgmlType::F16, rows, n_tok)?;
        let name = format!("hc_mix_tc {rows}x16384 n{n_tok}");
        out.push(Check {
            name: name.clone(),
            rel_err: rel_err(&y[0], &want),
            bound: BOUND_MATVEC,
        });
        let gemm: Vec<f64> = y[1].iter().map(|&v| v as f64).collect();
        out.push(Check {
            name: format!("{name} = GEMM + scale"),
            rel_err: rel_err(&y[0], &gemm),
            bound: BOUND_MATVEC,
        });
    }
    Ok(out)
}

/// `rows × cols` floats quantised on the GPU (Q8_K rule with `k_rule`, else Q8_0):
/// the int8 values and the scales (one per 32 values).
fn gpu_quantize(
    gpu: &Launcher,
    x: &[f32],
    rows: usize,
    cols: usize,
    k_rule: bool,
) -> Result<(Vec<i8>, Vec<f32>)> {
    let xd = gpu.upload(x)?;
    let mut qa = gpu.alloc_quant_act(rows, cols)?;
    if k_rule {
        gpu.quantize_act_k(gpu.ptr(&xd), &mut qa)?;
    } else {
        gpu.quantize_act(gpu.ptr(&xd), &mut qa)?;
    }
    Ok((gpu.download(&qa.q)?, gpu.download(&qa.d)?))
}

/// The GPU activation quantiser must reproduce `quantize_q8_0` bit for bit.
fn check_quantize(gpu: &Launcher, rng: &mut Rng) -> Result<Check> {
    let rows = 3;
    let cols = 4096;
    let mut x = random_vec(rows * cols, rng);
    x[5] = 0.0;
    x[32..64].fill(0.0); // an all-zero block
    x[64] = 1e-30;
    let (q, d) = gpu_quantize(gpu, &x, rows, cols, false)?;
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
    let (q, d) = gpu_quantize(gpu, &x, rows, cols, true)?;
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
/// dequantized weights with the CPU-quantised activations: Q8_0 (a scale per 32), or
/// with `k_rule` the Q8_K rule the engine uses for the routed experts' inputs (a scale
/// per 256).
fn check_q8act(
    gpu: &Launcher,
    m: &DeviceMatrix,
    w: &[u8],
    ids: &[i32],
    x: &[f32],
    k_rule: bool,
) -> Result<Check> {
    let (rows, cols, ty) = (m.rows, m.cols, m.ty);
    let xq: Vec<f32> = if k_rule {
        ds4_gguf::quant::quantize_q8_k_vec(x)
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d))
            .collect()
    } else {
        ds4_gguf::quant::quantize_q8_0_vec(x)
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d))
            .collect()
    };
    let xd = gpu.upload(x)?;
    let mut qa = gpu.alloc_quant_act(ids.len(), cols)?;
    if k_rule {
        gpu.quantize_act_k(gpu.ptr(&xd), &mut qa)?;
    } else {
        gpu.quantize_act(gpu.ptr(&xd), &mut qa)?;
    }
    let idd = gpu.upload(ids)?;
    let yd = gpu.upload(&vec![f32::NAN; ids.len() * rows])?;
    let sel = MatSel {
        ids: gpu.ptr(&idd),
        x_stride: cols as i64,
        y_stride: rows as i64,
    };
    gpu.matvec_q8act(m, &qa, gpu.ptr(&yd), ids.len(), sel)?;
    let y = gpu.download(&yd)?;
    let rule = if k_rule { " (Q8_K input)" } else { "" };
    Ok(Check {
        name: format!("matvec_q8act {ty} {rows}x{cols}{rule}"),
        rel_err: rel_err(&y, &reference(ty, w, rows, cols, ids, &xq, false)),
        bound: BOUND_MATVEC,
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
    gpu.matvec_q8act_pair((m, p(0)), (&m2, p(1)), &qa, n_sel, sel)?;
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

/// The expert matvecs with their activations in registers against the staged kernels,
/// bit for bit, with per-selection inputs and one shared input: IQ2_XXS at 4096 columns
/// (`matvec_iq2_xxs_q8_rx`, `_rxe` building its tables
/// before the PDL wait, `_rxp` and `probe_iq2_rxp4` loading the next row unit while
/// computing one, `_rxt` / `_rxtp` with iq2_xxs_dot_tab's lookups, `_rxtl` with the
/// 32-copy tables), Q2_K
/// at 2048 (`matvec_q2_k_q8_rx`), Q4_K at 4096 and 2048 (`matvec_q4_k_q8_rx4` / `_rx2`), Q8_0 with its first weight loads before the PDL wait
/// (`matvec_q8_0_q8_early`). Other shapes have only the staged kernel. `k_rule`: the
/// activations in the Q8_K rule (the IQ2_XXS / Q2_K kernels' integer form), else Q8_0.
fn check_kernel_variants(
    gpu: &Launcher,
    rng: &mut Rng,
    m: &DeviceMatrix,
    ids: &[i32],
    k_rule: bool,
) -> Result<Option<Check>> {
    let (rows, cols) = (m.rows, m.cols);
    let (staged, variants): (&'static str, &[&'static str]) = match (m.ty, cols) {
        (GgmlType::IQ2_XXS, 4096) => ("matvec_iq2_xxs_q8", &IQ2_RX_KERNELS),
        (GgmlType::Q2_K, 2048) => ("matvec_q2_k_q8", &["matvec_q2_k_q8_rx"]),
        (GgmlType::Q4_K, 4096) => ("matvec_q4_k_q8", &["matvec_q4_k_q8_rx4"]),
        (GgmlType::Q4_K, 2048) => ("matvec_q4_k_q8", &["matvec_q4_k_q8_rx2"]),
        (GgmlType::Q8_0, _) => ("matvec_q8_0_q8", &["matvec_q8_0_q8_early"]),
        _ => return Ok(None),
    };
    let xd = gpu.upload(&random_vec(ids.len() * cols, rng))?;
    let mut qa = gpu.alloc_quant_act(ids.len(), cols)?;
    if k_rule {
        gpu.quantize_act_k(gpu.ptr(&xd), &mut qa)?;
    } else {
        gpu.quantize_act(gpu.ptr(&xd), &mut qa)?;
    }
    let idd = gpu.upload(ids)?;
    // Kernels whose shared memory this GPU does not give are not run, and named so.
    let (ran, not_run): (Vec<&str>, Vec<&str>) = variants.iter().partition(|k| gpu.fits_smem(k));
    let mut same = BitDiff::default();
    for x_stride in [cols as i64, 0] {
        let sel = MatSel {
            ids: gpu.ptr(&idd),
            x_stride,
            y_stride: rows as i64,
        };
        let run = |kernel: &'static str| -> Result<Vec<f32>> {
            let y = gpu.upload(&vec![f32::NAN; ids.len() * rows])?;
            gpu.matvec_q8act_kernel(m, &qa, gpu.ptr(&y), (ids.len(), sel), kernel)?;
            Ok(gpu.download(&y)?)
        };
        let want = run(staged)?;
        for &kernel in &ran {
            same = same.merge(same_bits(&run(kernel)?, &want));
        }
    }
    let rule = if k_rule { " (Q8_K input)" } else { "" };
    let not_run = if not_run.is_empty() {
        String::new()
    } else {
        format!(
            " (not run, too little shared memory: {})",
            not_run.join(", ")
        )
    };
    Ok(Some(bit_identical(
        format!("{} = {staged} {rows}x{cols}{rule}{not_run}", ran.join(", ")),
        same,
    )))
}
