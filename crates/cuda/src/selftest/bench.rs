//! Achieved bandwidth of the decode matvecs at DeepSeek V4 Flash shapes
//! (`gpu-selftest --bench`) and the probes of `gpu-selftest --probe-q8`: the read
//! ceiling, the Q8_0 matvec at every split, the IQ2_XXS expert kernels with parts of
//! their work taken out.

use anyhow::Result;
use ds4_gguf::quant::random::Rng;
use ds4_gguf::GgmlType;

use super::common::{random_matrix, random_vec, Timing, IQ2_RX_KERNELS, Q8_SHAPES};
use crate::{Batch, DeviceBuf, DeviceMatrix, Launcher, MatSel, QuantAct, Variant};

/// Eight rotating selections of `used` distinct-looking experts out of `mats`.
fn expert_id_sets(gpu: &Launcher, used: usize, mats: usize) -> Result<Vec<DeviceBuf<i32>>> {
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
    x: &DeviceBuf<f32>,
    used: usize,
    shared: bool,
    probe: Option<&'static str>,
) -> Result<f64> {
    let mut qa = gpu.alloc_quant_act(if shared { 1 } else { used }, m.cols)?;
    // The Q8_K rule, as the engine quantises the routed experts' inputs.
    gpu.quantize_act_k(gpu.ptr(x), &mut qa)?;
    let x_stride = if shared { 0 } else { m.cols as i64 };
    time_experts_qa(gpu, m, &qa, (used, x_stride), probe)
}

/// time_experts_q8act on activations already quantised (`qa`, rows `x_stride` apart:
/// 0 for one shared row).
fn time_experts_qa(
    gpu: &Launcher,
    m: &DeviceMatrix,
    qa: &QuantAct,
    (used, x_stride): (usize, i64),
    probe: Option<&'static str>,
) -> Result<f64> {
    let y = gpu.zeros::<f32>(used * m.rows)?;
    let id_sets = expert_id_sets(gpu, used, m.n_mats)?;
    let yp = gpu.ptr(&y);
    Ok(gpu.time_ms(3, 50, |i| {
        let sel = MatSel {
            ids: gpu.ptr(&id_sets[i % id_sets.len()]),
            x_stride,
            y_stride: m.rows as i64,
        };
        match probe {
            Some(kernel) => gpu.matvec_q8act_kernel(m, qa, yp, (used, sel), kernel),
            None => gpu.matvec_q8act(m, qa, yp, used, sel),
        }
    })?)
}

/// The routed experts' kernels as the engine picks them (the IQ2_XXS gate+up pair launch,
/// the Q2_K down) over 1 to 96 pairs, an input each (a decode token has 6 pairs, a
/// 2-row step 12, 16 sessions 96), and a least-squares line through the times: its
/// intercept is the part of a launch that does not grow with the pairs (the tables, the
/// start's load chain, the tail), its slope the cost of one more pair.
fn expert_pairs_sweep(gpu: &Launcher, rng: &mut Rng) -> Result<Vec<Timing>> {
    const PAIRS: [usize; 8] = [1, 2, 4, 6, 12, 24, 48, 96];
    let max = PAIRS[PAIRS.len() - 1];
    let mats = 256usize;
    let mut out = Vec::new();
    for (ty, rows, cols) in [
        (GgmlType::IQ2_XXS, 2048usize, 4096usize),
        (GgmlType::Q2_K, 4096, 2048),
    ] {
        let mut stack = || {
            let w = random_matrix(ty, rows, cols, mats, rng);
            DeviceMatrix::upload(gpu, ty, &w, rows, cols, mats)
        };
        let gate = stack()?;
        let up = if ty == GgmlType::IQ2_XXS {
            Some(stack()?)
        } else {
            None
        };
        let x = gpu.upload(&random_vec(max * cols, rng))?;
        let mut qa = gpu.alloc_quant_act(max, cols)?;
        gpu.quantize_act_k(gpu.ptr(&x), &mut qa)?;
        let what = match up {
            Some(_) => "gate+up IQ2_XXS",
            None => "down Q2_K",
        };
        let mut points = Vec::new();
        for used in PAIRS {
            let (ms, bytes) = match &up {
                Some(up) => (
                    time_pair_q8act(gpu, (&gate, up), &qa, (used, cols as i64), None)?,
                    2 * gate.bytes_per_matrix() * used,
                ),
                None => (
                    time_experts_qa(gpu, &gate, &qa, (used, cols as i64), None)?,
                    gate.bytes_per_matrix() * used,
                ),
            };
            points.push((used as f64, ms));
            out.push(Timing {
                name: format!("{used} pairs {what} (an input each, engine's kernel)"),
                bytes: bytes as f64,
                ms,
            });
        }
        let (fixed, per_pair) = line_fit(&points);
        out.push(Timing {
            name: format!(
                "{what} fit: {:.1} µs a launch + {:.2} µs a pair",
                fixed * 1e3,
                per_pair * 1e3
            ),
            bytes: 0.0,
            ms: fixed,
        });
    }
    Ok(out)
}

/// Least-squares line y = a + b·x through `points`: (a, b).
fn line_fit(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    let (sx, sy) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), &(x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let (sxy, sxx) = points.iter().fold((0.0, 0.0), |(a, b), &(x, y)| {
        (a + (x - mx) * (y - my), b + (x - mx) * (x - mx))
    });
    let b = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (my - b * mx, b)
}

/// Milliseconds per call of a gate+up pair launch over `used` selections of the stacks
/// `m`, `m2` with the activations `qa` (`x_stride`: 0 for one shared row, else a row per
/// selection): the default kernel, or the named IQ2_XXS one.
fn time_pair_q8act(
    gpu: &Launcher,
    (m, m2): (&DeviceMatrix, &DeviceMatrix),
    qa: &QuantAct,
    (used, x_stride): (usize, i64),
    kernel: Option<&'static str>,
) -> Result<f64> {
    let rows = m.rows;
    let (y, y2) = (
        gpu.zeros::<f32>(used * rows)?,
        gpu.zeros::<f32>(used * rows)?,
    );
    let id_sets = expert_id_sets(gpu, used, m.n_mats)?;
    Ok(gpu.time_ms(3, 50, |i| {
        let sel = MatSel {
            ids: gpu.ptr(&id_sets[i % id_sets.len()]),
            x_stride,
            y_stride: rows as i64,
        };
        let (a, b) = ((m, gpu.ptr(&y)), (m2, gpu.ptr(&y2)));
        match kernel {
            Some(k) => gpu.matvec_q8act_pair_kernel(a, b, qa, (used, sel), k),
            None => gpu.matvec_q8act_pair(a, b, qa, used, sel),
        }
    })?)
}

/// Bandwidth of the decode matvecs at DeepSeek V4 Flash shapes. Several copies of
/// each weight rotate so that the L2 cache cannot hold them.
pub fn bench_matvecs(gpu: &Launcher, seed: u64) -> Result<Vec<Timing>> {
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
    // At the decode matrices' sizes, rotating copies so the L2 cannot serve them: 16-byte
    // loads (the matvecs' form) against bulk copies into shared memory.
    for mb in [4.456f64, 8.913, 35.65] {
        let bytes = ((mb * 1e6) as usize) / 16384 * 16384;
        let copies = (4 * l2).div_ceil(bytes).max(2);
        let bufs = (0..copies)
            .map(|_| gpu.upload(&vec![0x5au8; bytes]))
            .collect::<Result<Vec<_>, _>>()?;
        let ms = gpu.time_ms(copies, 50, |i| {
            gpu.probe_stream_read(&bufs[i % copies], &sink)
        })?;
        out.push(Timing {
            name: format!("read probe {mb:.1} MB, 16-byte loads"),
            bytes: bytes as f64,
            ms,
        });
        for (chunk, stages, per_sm) in [
            (8192, 4, 1),
            (16384, 4, 1),
            (16384, 8, 1),
            (8192, 8, 2),
            (4096, 8, 2),
            (16384, 4, 2),
        ] {
            let ms = gpu.time_ms(copies, 50, |i| {
                gpu.probe_bulk_read(&bufs[i % copies], &sink, (chunk, stages, per_sm))
            })?;
            out.push(Timing {
                name: format!(
                    "read probe {mb:.1} MB, bulk copies {chunk} B x {stages} stages, {per_sm} blocks/SM"
                ),
                bytes: bytes as f64,
                ms,
            });
        }
    }
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
        // The MTP block's (and the q4 GGUF's) experts.
        (
            "6 experts gate Q4_K 4096->2048",
            GgmlType::Q4_K,
            2048,
            4096,
            true,
        ),
        (
            "6 experts down Q4_K 2048->4096",
            GgmlType::Q4_K,
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
        if ty == GgmlType::Q4_K {
            out.push(Timing {
                name: format!("{name} staged kernel"),
                bytes: (m.bytes_per_matrix() * used) as f64,
                ms: time_experts_q8act(gpu, &m, &x, used, shared, Some("matvec_q4_k_q8"))?,
            });
            if cols == 4096 {
                // Gate and up in one launch, as the MTP block runs them.
                let m2 = DeviceMatrix::upload(
                    gpu,
                    ty,
                    &random_matrix(ty, rows, cols, mats, &mut rng),
                    rows,
                    cols,
                    mats,
                )?;
                let mut qa = gpu.alloc_quant_act(1, cols)?;
                gpu.quantize_act_k(gpu.ptr(&x), &mut qa)?;
                out.push(Timing {
                    name: "6 experts gate+up Q4_K 4096->2048 (one launch)".into(),
                    bytes: (2 * m.bytes_per_matrix() * used) as f64,
                    ms: time_pair_q8act(gpu, (&m, &m2), &qa, (used, 0), None)?,
                });
            }
        }
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
    // The gate and up pair in one launch, as decode runs it (6 pairs, one input) and as
    // a 2-row step does (12 pairs, an input each), through each IQ2_XXS
    // register-activation kernel and the probes of its structure.
    for (used, per_pair) in [(6usize, false), (12, true)] {
        let (mats, rows, cols) = (256usize, 2048usize, 4096usize);
        let ty = GgmlType::IQ2_XXS;
        let mut stack = || {
            let w = random_matrix(ty, rows, cols, mats, &mut rng);
            DeviceMatrix::upload(gpu, ty, &w, rows, cols, mats)
        };
        let (gate, up) = (stack()?, stack()?);
        let n_x = if per_pair { used } else { 1 };
        let x = gpu.upload(&random_vec(n_x * cols, &mut rng))?;
        let mut qa = gpu.alloc_quant_act(n_x, cols)?;
        gpu.quantize_act_k(gpu.ptr(&x), &mut qa)?;
        let kernels: Vec<&'static str> = if per_pair {
            vec![
                "matvec_iq2_xxs_q8_rxtp",
                "matvec_iq2_xxs_q8_rxtl",
                "matvec_iq2_xxs_q8_rxtm",
            ]
        } else {
            let probes = [
                "probe_iq2_rx_nolut",
                "probe_iq2_rx_loads",
                "probe_iq2_rxp_nolut",
                "probe_iq2_rxp_loads",
            ];
            IQ2_RX_KERNELS[1..].iter().chain(&probes).copied().collect()
        };
        let x_stride = if per_pair { cols as i64 } else { 0 };
        for kernel in kernels.into_iter().filter(|k| gpu.fits_smem(k)) {
            let ms = time_pair_q8act(gpu, (&gate, &up), &qa, (used, x_stride), Some(kernel))?;
            out.push(Timing {
                name: format!(
                    "{used} experts gate+up IQ2_XXS{} {kernel}",
                    if per_pair { " (an input each)" } else { "" }
                ),
                bytes: (2 * gate.bytes_per_matrix() * used) as f64,
                ms,
            });
        }
    }
    out.extend(expert_pairs_sweep(gpu, &mut rng)?);
    for &(name, rows, cols, n_sel) in Q8_SHAPES {
        let w = random_matrix(GgmlType::Q8_0, rows, cols, n_sel, &mut rng);
        let mats = q8_copies(gpu, &w, (rows, cols, n_sel))?;
        let copies = mats.len();
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
                gpu.matvec_q8act_split(&mats[i % copies], &qa, yp, (n_sel, sel), ks)
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
        // Then the plain kernel (weights loaded after the PDL wait, fewer registers).
        for (off, what) in [
            (rows_fusion, "one row a warp"),
            (Variant::Q8Early, "plain kernel"),
        ] {
            let (ms, got) = run(&gpu.with(off, false), None)?;
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            out.push(Timing {
                name: format!(
                    "{name} -{off} ({what}{})",
                    if same { "" } else { ", differs" }
                ),
                bytes,
                ms,
            });
        }
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

/// Token counts timed by [`bench_tokens`]: decode's one token, then the verify rows of
/// MTP drafts 1, 2 and 3.
const BENCH_TOKENS: [usize; 4] = [1, 2, 3, 4];

/// The plain and grouped Q8_0 products of a multi-row step at the Flash shapes
/// (`gpu-selftest --bench-tokens`): each shape at 1 token (decode's own launch) and at
/// 2–4 tokens (the multi-token kernels a step of that many rows launches), so the cost
/// of a verify row per matrix reads off one table. Rotating copies keep the weights out
/// of the L2; GB/s counts the weights once per launch.
pub fn bench_tokens(gpu: &Launcher, seed: u64) -> Result<Vec<Timing>> {
    let mut rng = Rng::stream(seed, 0xbe70, 0);
    let mut out = Vec::new();
    for &(name, rows, cols, groups) in Q8_SHAPES {
        let w = random_matrix(GgmlType::Q8_0, rows, cols, groups, &mut rng);
        let mats = q8_copies(gpu, &w, (rows, cols, groups))?;
        let copies = mats.len();
        let n_max = BENCH_TOKENS[BENCH_TOKENS.len() - 1];
        let x = gpu.upload(&random_vec(n_max * groups * cols, &mut rng))?;
        let mut qa = gpu.alloc_quant_act(n_max * groups, cols)?;
        gpu.quantize_act(gpu.ptr(&x), &mut qa)?;
        let y = gpu.zeros::<f32>(n_max * groups * rows)?;
        let ids = gpu.upload(&(0..groups as i32).collect::<Vec<_>>())?;
        let yp = gpu.ptr(&y);
        for n in BENCH_TOKENS {
            let ms = gpu.time_ms(copies, 50, |i| {
                let m = &mats[i % copies];
                if groups > 1 && n > 1 {
                    return gpu.matvec_q8act_groups(
                        m,
                        &qa,
                        yp,
                        Batch::grouped(n, groups, cols, rows),
                    );
                }
                // A plain matrix's n tokens, or decode's launch of the grouped stack
                // through its selections.
                let (n_sel, ids) = if groups == 1 {
                    (n, 0)
                } else {
                    (groups, gpu.ptr(&ids))
                };
                let x_stride = cols as i64;
                let sel = MatSel {
                    ids,
                    x_stride,
                    y_stride: rows as i64,
                };
                gpu.matvec_q8act(m, &qa, yp, n_sel, sel)
            })?;
            out.push(Timing {
                name: format!("{name} Q8_0, {n} token{}", if n == 1 { "" } else { "s" }),
                bytes: mats[0].bytes() as f64,
                ms,
            });
            // The plain matrices at 2 tokens through each rows-a-warp kernel at one
            // warp a row, and one row a warp at two.
            if groups == 1 && n == 2 {
                for (r, ks) in [(1u32, 1u32), (2, 1), (4, 1), (1, 2)] {
                    let b = Batch::plain(n, cols, rows);
                    let ms = gpu.time_ms(copies, 50, |i| {
                        gpu.matvec_q8_tokens_forced(&mats[i % copies], &qa, yp, b, (r, ks))
                    })?;
                    out.push(Timing {
                        name: format!("{name} Q8_0, 2 tokens, t2r{r} at ks {ks}"),
                        bytes: mats[0].bytes() as f64,
                        ms,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// Enough copies of the Q8_0 stack `w` (`mats` matrices of rows × cols) that timed
/// calls rotating over them miss the L2 (1 to 16).
fn q8_copies(
    gpu: &Launcher,
    w: &[u8],
    (rows, cols, mats): (usize, usize, usize),
) -> Result<Vec<DeviceMatrix>> {
    let upload = || DeviceMatrix::upload(gpu, GgmlType::Q8_0, w, rows, cols, mats);
    let first = upload()?;
    let l2 = gpu.info().l2_bytes.max(1) as usize;
    let copies = (4 * l2 / first.bytes()).clamp(1, 16);
    let mut out = vec![first];
    for _ in 1..copies {
        out.push(upload()?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::line_fit;

    #[test]
    fn line_fit_recovers_a_line() {
        let pts: Vec<(f64, f64)> = [1.0, 2.0, 6.0, 96.0]
            .iter()
            .map(|&x| (x, 6.5 + 0.75 * x))
            .collect();
        let (a, b) = line_fit(&pts);
        assert!(
            (a - 6.5).abs() < 1e-12 && (b - 0.75).abs() < 1e-12,
            "{a} {b}"
        );
        assert_eq!(line_fit(&[(3.0, 2.0), (3.0, 4.0)]), (3.0, 0.0));
    }
}
