//! `hc_bridge` (`kernels/layer_hc.cu`) against the three launches it replaces
//! (hc_post_pl, hc_mix_pl, hc_pre_pl) at the Flash shape: the streams bit for bit (the
//! same roundings), the mix, the sublayer input and its norm to f32 rounding (the mix
//! dots are summed in another order), the norm's Q8_0 form to its own rounding, the
//! per-token counts left at zero, and a second launch equal to the first (the counts
//! really were reset: a graph replays the launch every token). A start with no hc_post
//! ([`HcSrc::Streams`]) over the bridge's streams must give its mix, input and norm bit
//! for bit: a model split over GPUs starts its second stage that way, and must match
//! the unsplit model.

use anyhow::Result;

use super::common::{bit_same, normal, rel_err, Check, Timing, BOUND_F32};
use crate::{DeviceMatrix, HcBridgeWork, HcNorm, HcParams, HcPost, HcSrc, Launcher, Variant};
use crate::{WT_F16, WT_F32};
use ds4_gguf::quant::random::Rng;
use ds4_gguf::GgmlType;

const N_HC: usize = 4;
const N_EMBD: usize = 4096;
const N_MIX: usize = (2 + N_HC) * N_HC;

/// Everything one launch (or the plain chain) writes, per token in order: streams,
/// mix, y, norm, Q8_0 values dequantised.
struct Outputs {
    h_out: Vec<f32>,
    mix: Vec<f32>,
    y: Vec<f32>,
    norm: Vec<f32>,
    q8: Vec<f32>,
}

pub(super) fn check_hc_bridge(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x4b, 0);
    let mut checks = Vec::new();
    let n = N_HC * N_EMBD;
    let fn16: Vec<u16> = normal(&mut rng, N_MIX * n, 0.02)
        .iter()
        .map(|&v| ds4_gguf::quant::f32_to_f16(v))
        .collect();
    let fn_bytes: Vec<u8> = fn16.iter().flat_map(|v| v.to_le_bytes()).collect();
    let fn_ = DeviceMatrix::upload(gpu, GgmlType::F16, &fn_bytes, N_MIX, n, 1)?;
    let scale = gpu.upload(&normal(&mut rng, 3, 0.5))?;
    let base = gpu.upload(&normal(&mut rng, N_MIX, 0.5))?;
    let norm_w = gpu.upload(&normal(&mut rng, N_EMBD, 1.0))?;
    for (n_tok, n_parts) in [(1usize, 0usize), (1, 7), (3, 7)] {
        let h = gpu.upload(&normal(&mut rng, n_tok * n, 1.0))?;
        let out = gpu.upload(&normal(&mut rng, n_tok * N_EMBD, 1.0))?;
        let parts = gpu.upload(&normal(&mut rng, (n_tok * n_parts * N_EMBD).max(1), 1.0))?;
        let hcp = gpu.upload(&normal(&mut rng, n_tok * (N_HC + N_HC * N_HC), 0.5))?;
        let hp = HcParams {
            scale: gpu.ptr(&scale),
            base: gpu.ptr(&base),
            n_hc: N_HC,
            n_embd: N_EMBD,
            eps: 1e-6,
            iters: 0,
        };
        let shares = gpu.zeros::<f32>(HcBridgeWork::floats(n_tok, N_EMBD))?;
        let counts = gpu.zeros::<u32>(n_tok)?;
        // One run: the plain chain (`bridge` None), hc_bridge after hc_post (Some(None)),
        // or hc_bridge over the streams `src` (Some(Some(src))).
        let run = |bridge: Option<Option<&crate::DeviceBuf<f32>>>| -> Result<Outputs> {
            let nan = |len: usize| gpu.upload(&vec![f32::NAN; len]);
            let (h_out, mix, y, norm) = (
                nan(n_tok * n)?,
                nan(n_tok * N_MIX)?,
                nan(n_tok * N_EMBD)?,
                nan(n_tok * N_EMBD)?,
            );
            let q = gpu.zeros::<i8>(n_tok * N_EMBD)?;
            let d = nan(n_tok * N_EMBD / 32)?;
            let post = HcPost {
                h: gpu.ptr(&h),
                out: gpu.ptr(&out),
                parts: if n_parts > 0 { gpu.ptr(&parts) } else { 0 },
                n_parts,
                hcp: gpu.ptr(&hcp),
                h_out: gpu.ptr(&h_out),
            };
            let nm = HcNorm {
                w: gpu.ptr(&norm_w),
                w_type: WT_F32,
                eps: 1e-6,
                out: gpu.ptr(&norm),
                q: gpu.ptr(&q),
                d: gpu.ptr(&d),
            };
            if let Some(start) = bridge {
                let g = gpu.with(Variant::HcBridge, true);
                let work = HcBridgeWork {
                    shares: g.ptr(&shares),
                    counts: g.ptr(&counts),
                };
                let mx = (&fn_, 1e-6, g.ptr(&mix));
                let src = match start {
                    Some(streams) => HcSrc::Streams(g.ptr(streams)),
                    None => HcSrc::Post(post),
                };
                g.hc_bridge(n_tok, src, mx, &hp, g.ptr(&y), nm, work)?;
                if let Some(streams) = start {
                    // A start writes no streams: its input stands in for them.
                    return outputs(gpu, streams, (&mix, &y, &norm), (&q, &d));
                }
            } else {
                let g = gpu.with(Variant::HcPreload, true);
                g.hc_post(
                    n_tok, post.h, post.out, post.parts, n_parts, post.hcp, N_HC, N_EMBD,
                    post.h_out,
                )?;
                g.hc_mix(
                    n_tok,
                    post.h_out,
                    n,
                    fn_.part_ptr(&g, 0),
                    WT_F16,
                    1e-6,
                    g.ptr(&mix),
                    N_MIX,
                )?;
                g.hc_pre(n_tok, (post.h_out, g.ptr(&mix)), &hp, g.ptr(&y), Some(nm))?;
            }
            outputs(gpu, &h_out, (&mix, &y, &norm), (&q, &d))
        };
        let plain = run(None)?;
        let first = run(Some(None))?;
        let left: Vec<f32> = gpu.download(&counts)?.iter().map(|&c| c as f32).collect();
        let again = run(Some(None))?;
        let streams = gpu.upload(&first.h_out)?;
        let start = run(Some(Some(&streams)))?;
        let tag = format!("hc_bridge {n_tok} token(s), {n_parts} parts");
        let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        checks.push(bit_same(
            format!("{tag}: streams = hc_post_pl"),
            &plain.h_out,
            &first.h_out,
        ));
        for (what, a, b) in [
            ("mix ~ hc_mix_pl", &first.mix, &plain.mix),
            ("y ~ hc_pre_pl", &first.y, &plain.y),
            ("norm ~ hc_pre_pl", &first.norm, &plain.norm),
        ] {
            checks.push(Check {
                name: format!("{tag}: {what}"),
                rel_err: rel_err(a, &f64s(b)),
                bound: BOUND_F32,
            });
        }
        // Q8_0 of nearly equal values: a value one step off now and then.
        checks.push(Check {
            name: format!("{tag}: Q8_0 ~ hc_pre_pl"),
            rel_err: rel_err(&first.q8, &f64s(&plain.q8)),
            bound: 1e-3,
        });
        checks.push(bit_same(
            format!("{tag}: counts left zero"),
            &left,
            &vec![0.0; n_tok],
        ));
        let mut a = first.h_out.clone();
        a.extend([first.mix, first.y, first.norm, first.q8].concat());
        let mut b = again.h_out.clone();
        b.extend([again.mix, again.y, again.norm, again.q8].concat());
        checks.push(bit_same(format!("{tag}: second launch = first"), &a, &b));
        let mut c = start.h_out.clone();
        c.extend([start.mix, start.y, start.norm, start.q8].concat());
        checks.push(bit_same(
            format!("{tag}: start over its streams = bridge"),
            &a,
            &c,
        ));
    }
    Ok(checks)
}

/// What a run wrote, downloaded (the Q8_0 values dequantised).
fn outputs(
    gpu: &Launcher,
    h_out: &crate::DeviceBuf<f32>,
    (mix, y, norm): (
        &crate::DeviceBuf<f32>,
        &crate::DeviceBuf<f32>,
        &crate::DeviceBuf<f32>,
    ),
    (q, d): (&crate::DeviceBuf<i8>, &crate::DeviceBuf<f32>),
) -> Result<Outputs> {
    let (qv, dv) = (gpu.download(q)?, gpu.download(d)?);
    let q8 = qv
        .iter()
        .enumerate()
        .map(|(i, &v)| v as f32 * dv[i / 32])
        .collect();
    Ok(Outputs {
        h_out: gpu.download(h_out)?,
        mix: gpu.download(mix)?,
        y: gpu.download(y)?,
        norm: gpu.download(norm)?,
        q8,
    })
}

/// `gpu-selftest --probe-q8`: one token's sublayer boundary (an FFN end, 7 parts) as
/// hc_bridge, as its start-only form, and as the three launches it replaces, each
/// launched alone on the stream (launch gaps included alike).
pub fn time_hc_bridge(gpu: &Launcher, seed: u64) -> Result<Vec<Timing>> {
    let mut rng = Rng::stream(seed, 0x4b, 1);
    let n = N_HC * N_EMBD;
    let fn16: Vec<u16> = normal(&mut rng, N_MIX * n, 0.02)
        .iter()
        .map(|&v| ds4_gguf::quant::f32_to_f16(v))
        .collect();
    let fn_bytes: Vec<u8> = fn16.iter().flat_map(|v| v.to_le_bytes()).collect();
    let fn_ = DeviceMatrix::upload(gpu, GgmlType::F16, &fn_bytes, N_MIX, n, 1)?;
    let up = |len: usize, s: f32, rng: &mut Rng| gpu.upload(&normal(rng, len, s));
    let (scale, base, norm_w) = (
        up(3, 0.5, &mut rng)?,
        up(N_MIX, 0.5, &mut rng)?,
        up(N_EMBD, 1.0, &mut rng)?,
    );
    let (h, out, parts) = (
        up(n, 1.0, &mut rng)?,
        up(N_EMBD, 1.0, &mut rng)?,
        up(7 * N_EMBD, 1.0, &mut rng)?,
    );
    let hcp = up(N_HC + N_HC * N_HC, 0.5, &mut rng)?;
    let (h_out, mix, y, norm) = (
        up(n, 0.0, &mut rng)?,
        up(N_MIX, 0.0, &mut rng)?,
        up(N_EMBD, 0.0, &mut rng)?,
        up(N_EMBD, 0.0, &mut rng)?,
    );
    let q = gpu.zeros::<i8>(N_EMBD)?;
    let d = up(N_EMBD / 32, 0.0, &mut rng)?;
    let shares = gpu.zeros::<f32>(HcBridgeWork::floats(1, N_EMBD))?;
    let counts = gpu.zeros::<u32>(1)?;
    let hp = HcParams {
        scale: gpu.ptr(&scale),
        base: gpu.ptr(&base),
        n_hc: N_HC,
        n_embd: N_EMBD,
        eps: 1e-6,
        iters: 0,
    };
    let post = HcPost {
        h: gpu.ptr(&h),
        out: gpu.ptr(&out),
        parts: gpu.ptr(&parts),
        n_parts: 7,
        hcp: gpu.ptr(&hcp),
        h_out: gpu.ptr(&h_out),
    };
    let nm = HcNorm {
        w: gpu.ptr(&norm_w),
        w_type: WT_F32,
        eps: 1e-6,
        out: gpu.ptr(&norm),
        q: gpu.ptr(&q),
        d: gpu.ptr(&d),
    };
    let work = HcBridgeWork {
        shares: gpu.ptr(&shares),
        counts: gpu.ptr(&counts),
    };
    let g = gpu
        .with(Variant::HcBridge, true)
        .with(Variant::HcPreload, true);
    let mx = (&fn_, 1e-6, g.ptr(&mix));
    let mut out_t = Vec::new();
    for (name, src) in [
        ("hc_bridge after hc_post (7 parts)", HcSrc::Post(post)),
        ("hc_bridge start only", HcSrc::Streams(post.h)),
    ] {
        let ms = g.time_ms(5, 200, |_| {
            g.hc_bridge(1, src, mx, &hp, g.ptr(&y), nm, work)
        })?;
        out_t.push(Timing {
            name: name.into(),
            bytes: 0.0,
            ms,
        });
    }
    for probe in [1, 2, 4, 7] {
        let ms = g.time_ms(5, 200, |_| {
            g.hc_bridge_probe(1, HcSrc::Post(post), mx, &hp, g.ptr(&y), nm, work, probe)
        })?;
        let name = format!("hc_bridge probe {probe} (1 no weights, 2 no tail, 4 no shares)");
        out_t.push(Timing {
            name,
            bytes: 0.0,
            ms,
        });
    }
    let ms = g.time_ms(5, 200, |_| {
        g.hc_post(
            1, post.h, post.out, post.parts, 7, post.hcp, N_HC, N_EMBD, post.h_out,
        )?;
        g.hc_mix(
            1,
            post.h_out,
            n,
            fn_.part_ptr(&g, 0),
            WT_F16,
            1e-6,
            g.ptr(&mix),
            N_MIX,
        )?;
        g.hc_pre(1, (post.h_out, g.ptr(&mix)), &hp, g.ptr(&y), Some(nm))
    })?;
    out_t.push(Timing {
        name: "hc_post_pl + hc_mix_pl + hc_pre_pl".into(),
        bytes: 0.0,
        ms,
    });
    for (name, which) in [
        ("hc_post_pl alone", 0),
        ("hc_mix_pl alone", 1),
        ("hc_pre_pl alone", 2),
    ] {
        let ms = g.time_ms(5, 200, |_| match which {
            0 => g.hc_post(
                1, post.h, post.out, post.parts, 7, post.hcp, N_HC, N_EMBD, post.h_out,
            ),
            1 => g.hc_mix(
                1,
                post.h_out,
                n,
                fn_.part_ptr(&g, 0),
                WT_F16,
                1e-6,
                g.ptr(&mix),
                N_MIX,
            ),
            _ => g.hc_pre(1, (post.h_out, g.ptr(&mix)), &hp, g.ptr(&y), Some(nm)),
        })?;
        out_t.push(Timing {
            name: name.into(),
            bytes: 0.0,
            ms,
        });
    }
    Ok(out_t)
}
