//! Checks of the tensor-core prefill attention (`attention_prefill_mma`) at the Flash
//! shape (64 heads of 512) against an f64 reference of sink attention over the same
//! rows, next to the f32 `attention` kernel on the same inputs.

use anyhow::Result;
use ds4_gguf::quant::random::Rng;

use super::common::{
    bit_identical, rel_err, rope_freqs, same_bits, upload_rope, Check, BOUND_F32, BOUND_FP16_MMA,
};
use crate::{AttnInput, DeviceBuf, Launcher, Variant};

const HEADS: usize = 64;
const HD: usize = 512;

/// One layer kind: compression ratio, whether an indexer selects the compressed rows,
/// and the token positions of the batch.
struct Case {
    name: &'static str,
    ratio: usize,
    indexed: bool,
    positions: &'static [usize],
}

const WINDOW: usize = 128;
const RAW_CAP: usize = WINDOW + 64;
const TOP_K: usize = 512;

/// One batch's attention inputs on the device (window WINDOW in a ring of RAW_CAP,
/// top-k TOP_K), run through either kernel.
struct DeviceInputs {
    n: usize,
    step: DeviceBuf<i32>,
    q: DeviceBuf<f32>,
    ring: DeviceBuf<f32>,
    /// Compressed rows (ratio > 0) and top-k selections (indexed layers).
    comp: Option<DeviceBuf<f32>>,
    sel: Option<DeviceBuf<i32>>,
    ratio: usize,
    sinks: DeviceBuf<f32>,
    scale: f32,
}

impl DeviceInputs {
    #[allow(clippy::too_many_arguments)]
    fn upload(
        gpu: &Launcher,
        positions: impl Iterator<Item = usize>,
        q: &[f32],
        ring: &[f32],
        comp: Option<&[f32]>,
        ratio: usize,
        sel: Option<&[i32]>,
        sinks: &[f32],
    ) -> Result<DeviceInputs> {
        let steps: Vec<i32> = positions.flat_map(|p| [p as i32, 0]).collect();
        Ok(DeviceInputs {
            n: steps.len() / 2,
            step: gpu.upload(&steps)?,
            q: gpu.upload(q)?,
            ring: gpu.upload(ring)?,
            comp: comp.map(|c| gpu.upload(c)).transpose()?,
            sel: sel.map(|s| gpu.upload(s)).transpose()?,
            ratio,
            sinks: gpu.upload(sinks)?,
            scale: (HD as f64).powf(-0.5) as f32,
        })
    }

    fn input(&self, gpu: &Launcher) -> AttnInput {
        AttnInput {
            n_tok: self.n,
            step: gpu.ptr(&self.step),
            q: gpu.ptr(&self.q),
            ring: gpu.ptr(&self.ring),
            raw_cap: RAW_CAP,
            window: WINDOW,
            comp: self.comp.as_ref().map_or(0, |c| gpu.ptr(c)),
            ratio: self.ratio,
            sel: self.sel.as_ref().map_or(0, |s| gpu.ptr(s)),
            top_k: TOP_K,
            sinks: gpu.ptr(&self.sinks),
            heads: HEADS,
            hd: HD,
            scale: self.scale,
            q_norm: None,
            kvt: 0,
            window_at: 0,
        }
    }

    fn mma(&self, gpu: &Launcher, out: u64) -> Result<(), crate::CudaError> {
        gpu.attention_prefill_mma(&self.input(gpu), out)
    }

    /// `attention` with one chunk of `stride` rows per token (the prefill layout).
    fn f32(&self, gpu: &Launcher, stride: usize, out: u64) -> Result<(), crate::CudaError> {
        gpu.attention(&self.input(gpu), stride, 1, 0, 0, out, None)
    }
}

/// The rows token `pos` attends (ring slots, then compressed row indices), as the
/// kernels list them.
fn rows_of(pos: usize, ratio: usize, sel: Option<&[i32]>) -> (Vec<usize>, Vec<usize>) {
    let n_raw = (pos + 1).min(WINDOW);
    let raw = (0..n_raw)
        .map(|r| (pos + 1 - n_raw + r) % RAW_CAP)
        .collect();
    let n_all = (pos + 1).checked_div(ratio).unwrap_or(0);
    let comp = match sel {
        Some(s) if n_all > TOP_K => s.iter().map(|&i| i as usize).collect(),
        _ => (0..n_all).collect(),
    };
    (raw, comp)
}

#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f32],
    ring: &[f32],
    comp: &[f32],
    sinks: &[f32],
    positions: &[usize],
    ratio: usize,
    sel: Option<&[i32]>,
    scale: f64,
) -> Vec<f64> {
    let mut out = vec![0f64; positions.len() * HEADS * HD];
    for (t, &pos) in positions.iter().enumerate() {
        let (raw, cmp) = rows_of(pos, ratio, sel.map(|s| &s[t * TOP_K..(t + 1) * TOP_K]));
        let rows: Vec<&[f32]> = raw
            .iter()
            .map(|&slot| &ring[slot * HD..(slot + 1) * HD])
            .chain(cmp.iter().map(|&i| &comp[i * HD..(i + 1) * HD]))
            .collect();
        for h in 0..HEADS {
            let qh = &q[(t * HEADS + h) * HD..(t * HEADS + h + 1) * HD];
            let scores: Vec<f64> = rows
                .iter()
                .map(|r| {
                    scale
                        * qh.iter()
                            .zip(*r)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                })
                .collect();
            let sink = sinks[h] as f64;
            let m = scores.iter().copied().fold(sink, f64::max);
            let den: f64 = scores.iter().map(|s| (s - m).exp()).sum::<f64>() + (sink - m).exp();
            let o = &mut out[(t * HEADS + h) * HD..(t * HEADS + h + 1) * HD];
            for (s, r) in scores.iter().zip(&rows) {
                let p = (s - m).exp() / den;
                for (od, &v) in o.iter_mut().zip(*r) {
                    *od += p * v as f64;
                }
            }
        }
    }
    out
}

/// The tensor-core kernel (bound 2e-3: fp16 operands) and the f32 kernel (bound 1e-5)
/// against the f64 reference, for a compressed + indexed layer (top-k selections past
/// 512 rows), a ratio-128 layer and a window-only layer.
pub(super) fn check_attention_mma(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0xa77e, 0);
    let cases = [
        Case {
            name: "indexed ratio 4",
            ratio: 4,
            indexed: true,
            positions: &[0, 1, 31, 127, 128, 200, 640, 2047, 2052, 3001, 5199],
        },
        Case {
            name: "ratio 128",
            ratio: 128,
            indexed: false,
            positions: &[3, 130, 1000, 4095, 5000],
        },
        Case {
            name: "window only",
            ratio: 0,
            indexed: false,
            positions: &[0, 5, 127, 128, 4000],
        },
    ];
    let n_comp_rows = 1300;
    let scale = (HD as f64).powf(-0.5);
    let mut checks = Vec::new();
    for case in &cases {
        let n = case.positions.len();
        let normal = |rng: &mut Rng, len: usize, s: f32| -> Vec<f32> {
            (0..len).map(|_| rng.normal() * s).collect()
        };
        let q = normal(&mut rng, n * HEADS * HD, 2.0);
        let ring = normal(&mut rng, RAW_CAP * HD, 1.0);
        let comp = normal(&mut rng, n_comp_rows * HD, 1.0);
        let sinks = normal(&mut rng, HEADS, 1.0);
        let sel: Option<Vec<i32>> = case.indexed.then(|| {
            let mut s = Vec::with_capacity(n * TOP_K);
            for &pos in case.positions {
                let n_all = ((pos + 1) / case.ratio).min(n_comp_rows);
                // Distinct indices below n_all (a partial shuffle), any when unmasked.
                let mut pool: Vec<i32> = (0..n_all.max(TOP_K) as i32).collect();
                for i in 0..TOP_K {
                    let j = i + rng.below((pool.len() - i) as u64) as usize;
                    pool.swap(i, j);
                }
                s.extend(pool[..TOP_K].iter().map(|&v| v % n_all.max(1) as i32));
            }
            s
        });
        let want = reference(
            &q,
            &ring,
            &comp,
            &sinks,
            case.positions,
            case.ratio,
            sel.as_deref(),
            scale,
        );
        let inputs = DeviceInputs::upload(
            gpu,
            case.positions.iter().copied(),
            &q,
            &ring,
            (case.ratio > 0).then_some(&comp[..]),
            case.ratio,
            sel.as_deref(),
            &sinks,
        )?;
        let out = gpu.upload(&vec![f32::NAN; n * HEADS * HD])?;
        inputs.mma(gpu, gpu.ptr(&out))?;
        let got = gpu.download(&out)?;
        checks.push(Check {
            name: format!("attention mma {}", case.name),
            rel_err: rel_err(&got, &want),
            bound: BOUND_FP16_MMA,
        });
        // att_half: the rows' fp16 copies (rows_f16) read by attention_prefill_mma_h.
        let ring16 = gpu.zeros::<u16>(RAW_CAP * HD)?;
        let comp16 = gpu.zeros::<u16>(n_comp_rows * HD)?;
        let a = inputs.input(gpu);
        gpu.rows_f16(a.ring, gpu.ptr(&ring16), RAW_CAP * HD)?;
        if a.comp != 0 {
            gpu.rows_f16(a.comp, gpu.ptr(&comp16), n_comp_rows * HD)?;
        }
        let half = gpu.upload(&vec![f32::NAN; n * HEADS * HD])?;
        gpu.attention_prefill_mma_h(&a, gpu.ptr(&ring16), gpu.ptr(&comp16), gpu.ptr(&half))?;
        checks.push(bit_identical(
            format!("attention mma fp16 rows = f32 rows {}", case.name),
            same_bits(&gpu.download(&half)?, &got),
        ));
        let stride = WINDOW + TOP_K.max(n_comp_rows);
        let split = gpu.upload(&vec![f32::NAN; n * HEADS * HD])?;
        inputs.f32(gpu, stride, gpu.ptr(&split))?;
        checks.push(Check {
            name: format!("attention f32 {}", case.name),
            rel_err: rel_err(&gpu.download(&split)?, &want),
            bound: BOUND_F32,
        });
        // The multi-row step's split tensor-core kernel: every token in one launch, 32
        // chunks, then the combine (no tail).
        let acc = gpu.zeros::<f32>(n * HEADS * 32 * HD)?;
        let ml = gpu.zeros::<f32>(2 * n * HEADS * 32)?;
        let split_mma = gpu.upload(&vec![f32::NAN; n * HEADS * HD])?;
        let a = inputs.input(gpu);
        let (pa, pm) = (gpu.ptr(&acc), gpu.ptr(&ml));
        gpu.attention_split_mma(&a, 32, pa, pm, gpu.ptr(&split_mma), None)?;
        checks.push(Check {
            name: format!("attention split mma (32 chunks) {}", case.name),
            rel_err: rel_err(&gpu.download(&split_mma)?, &want),
            bound: BOUND_FP16_MMA,
        });
        checks.push(check_q_norm(gpu, &inputs, &mut rng, stride, case.name)?);
        checks.extend(check_decode_split(gpu, &inputs, &want, case.name)?);
    }
    Ok(checks)
}

/// The decode layout (one token per launch, its rows split evenly over 32 chunks, then
/// the combine) against the f64 reference, the staged kernel (`att_stage`:
/// `attention_split_staged`, rows copied to shared memory) against the plain one bit
/// for bit, the staged kernel issuing its first copies before the query's chain
/// (`att_early`) against the staged one with the decode's own query norm + RoPE, and the
/// combine with every chunk in flight (`combine_pl`) against the plain combine, both
/// with the decode tail (inverse RoPE and the Q8_0 output), and a window given as a
/// device value (`AttnInput::window_at`, the MTP block's growing ring) against the same
/// window given as the launch's argument.
fn check_decode_split(
    gpu: &Launcher,
    inputs: &DeviceInputs,
    want: &[f64],
    case: &str,
) -> Result<[Check; 5]> {
    let n = inputs.n;
    let chunks = 32;
    let acc = gpu.zeros::<f32>(HEADS * chunks * HD)?;
    let ml = gpu.zeros::<f32>(2 * HEADS * chunks)?;
    let (_freqs, rope) = upload_rope(gpu, &rope_freqs(64))?;
    // The outputs, then (with the tail) its Q8_0 values and scales.
    #[derive(Clone, Copy, Default)]
    struct Mode {
        staged: bool,
        early: bool,
        combine_pl: bool,
        tail: bool,
        q_norm: bool,
        /// The window: SHORT_WINDOW as the argument (`Some(false)`) or as the device
        /// value under the argument WINDOW (`Some(true)`); None: WINDOW.
        short: Option<bool>,
    }
    const SHORT_WINDOW: usize = 37;
    let short_at = gpu.upload(&[SHORT_WINDOW as i32])?;
    let run = |m: Mode| -> Result<Vec<f32>> {
        let out = gpu.upload(&vec![f32::NAN; n * HEADS * HD])?;
        let q8 = gpu.zeros::<i8>(n * HEADS * HD)?;
        let d8 = gpu.upload(&vec![f32::NAN; n * HEADS * HD / 32])?;
        for t in 0..n {
            // Token t alone: its step entry (two i32), queries, top-k row and output.
            let mut a = inputs.input(gpu);
            a.n_tok = 1;
            a.step += (t * 2 * 4) as u64;
            a.q += (t * HEADS * HD * 4) as u64;
            if a.sel != 0 {
                a.sel += (t * TOP_K * 4) as u64;
            }
            let o = gpu.ptr(&out) + (t * HEADS * HD * 4) as u64;
            if m.q_norm {
                a.q_norm = Some(crate::QNorm { eps: 1e-6, rope });
            }
            match m.short {
                Some(true) => a.window_at = gpu.ptr(&short_at),
                Some(false) => a.window = SHORT_WINDOW,
                None => {}
            }
            let at = crate::AttnTail {
                rope,
                q: gpu.ptr(&q8) + (t * HEADS * HD) as u64,
                d: gpu.ptr(&d8) + (t * HEADS * HD / 32 * 4) as u64,
            };
            let g = gpu
                .with(Variant::AttStage, m.staged)
                .with(Variant::AttEarly, m.early)
                .with(Variant::CombinePl, m.combine_pl);
            let (acc, ml) = (gpu.ptr(&acc), gpu.ptr(&ml));
            g.attention(&a, 0, chunks, acc, ml, o, m.tail.then_some(&at))?;
        }
        let mut all = gpu.download(&out)?;
        if m.tail {
            all.extend(gpu.download(&q8)?.iter().map(|&v| v as f32));
            all.extend(gpu.download(&d8)?);
        }
        Ok(all)
    };
    let base = Mode::default();
    let plain = run(base)?;
    let staged = run(Mode {
        staged: true,
        ..base
    })?;
    let combine = run(Mode { tail: true, ..base })?;
    let combine_pl = run(Mode {
        tail: true,
        combine_pl: true,
        ..base
    })?;
    let normed = Mode {
        staged: true,
        q_norm: true,
        ..base
    };
    let staged_qn = run(normed)?;
    let early_qn = run(Mode {
        early: true,
        ..normed
    })?;
    let short_arg = run(Mode {
        early: true,
        short: Some(false),
        ..normed
    })?;
    let short_at = run(Mode {
        early: true,
        short: Some(true),
        ..normed
    })?;
    Ok([
        Check {
            name: format!("attention decode split {case}"),
            rel_err: rel_err(&plain, want),
            bound: BOUND_F32,
        },
        bit_identical(
            format!("attention_split_staged = attention_split, {case}"),
            same_bits(&staged, &plain),
        ),
        bit_identical(
            format!("attention_combine_pl = attention_combine (RoPE, Q8_0), {case}"),
            same_bits(&combine_pl, &combine),
        ),
        bit_identical(
            format!("attention_split_early = attention_split_staged (q_norm), {case}"),
            same_bits(&early_qn, &staged_qn),
        ),
        bit_identical(
            format!("attention window {SHORT_WINDOW} as a device value = as an argument, {case}"),
            same_bits(&short_at, &short_arg),
        ),
    ])
}

/// The decode attention's own query norm + RoPE (`AttnInput::q_norm`) against
/// head_norm_rope followed by the plain kernel, on the same raw queries (bound 1e-5:
/// only the norm's summation order differs).
fn check_q_norm(
    gpu: &Launcher,
    inputs: &DeviceInputs,
    rng: &mut Rng,
    stride: usize,
    case: &str,
) -> Result<Check> {
    let n = inputs.n;
    let freqs: Vec<f32> = rope_freqs(64)
        .into_iter()
        .map(|f| f * (0.5 + rng.uniform()))
        .collect();
    let (_freqs, rope) = upload_rope(gpu, &freqs)?;
    let eps = 1e-6;
    let q_raw = gpu.download(&inputs.q)?;
    let normed = gpu.upload(&q_raw)?;
    gpu.head_norm_rope(
        n,
        gpu.ptr(&inputs.step),
        gpu.ptr(&normed),
        HD,
        HEADS,
        eps,
        rope,
    )?;
    let mut a = inputs.input(gpu);
    a.q = gpu.ptr(&normed);
    let want = gpu.upload(&vec![f32::NAN; n * HEADS * HD])?;
    gpu.attention(&a, stride, 1, 0, 0, gpu.ptr(&want), None)?;
    let mut b = inputs.input(gpu);
    b.q_norm = Some(crate::QNorm { eps, rope });
    let got = gpu.upload(&vec![f32::NAN; n * HEADS * HD])?;
    gpu.attention(&b, stride, 1, 0, 0, gpu.ptr(&got), None)?;
    let want: Vec<f64> = gpu.download(&want)?.iter().map(|&v| v as f64).collect();
    Ok(Check {
        name: format!("attention q_norm {case}"),
        rel_err: rel_err(&gpu.download(&got)?, &want),
        bound: BOUND_F32,
    })
}

/// Milliseconds of the tensor-core and f32 prefill attention for 512 tokens of an
/// indexed layer at 640 rows each (window 128 + top-k 512).
pub fn bench_attention(gpu: &Launcher, seed: u64) -> Result<Vec<(String, f64)>> {
    let mut rng = Rng::stream(seed, 0xa77f, 0);
    let n = 512;
    let n_comp_rows = 4096;
    let q: Vec<f32> = (0..n * HEADS * HD).map(|_| rng.normal()).collect();
    let ring: Vec<f32> = (0..RAW_CAP * HD).map(|_| rng.normal()).collect();
    let comp: Vec<f32> = (0..n_comp_rows * HD).map(|_| rng.normal()).collect();
    let sel: Vec<i32> = (0..n * TOP_K)
        .map(|_| rng.below(n_comp_rows as u64) as i32)
        .collect();
    let inputs = DeviceInputs::upload(
        gpu,
        (0..n).map(|t| 8192 + t),
        &q,
        &ring,
        Some(&comp),
        4,
        Some(&sel),
        &[0.5f32; HEADS],
    )?;
    let out = gpu.zeros::<f32>(n * HEADS * HD)?;
    let mma = gpu.time_ms(2, 10, |_| inputs.mma(gpu, gpu.ptr(&out)))?;
    let split = gpu.time_ms(2, 10, |_| inputs.f32(gpu, WINDOW + TOP_K, gpu.ptr(&out)))?;
    Ok(vec![
        ("attention mma 512 tok x 640 rows".into(), mma),
        ("attention f32 512 tok x 640 rows".into(), split),
    ])
}
