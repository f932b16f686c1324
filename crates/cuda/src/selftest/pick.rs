//! The device's greedy pick (`greedy_pick`, `kernels/pick.cu`) against a host scan: the
//! first index of the largest logit with one index left out, the NaN flag, the step
//! buffer advanced to `{pos + 1, pick}` and the pick in ring slot `pos % 4`. Rows with
//! dozens of exact ties, a tail that is not a multiple of 4, all -inf, a NaN.

use anyhow::Result;
use ds4_gguf::quant::random::Rng;

use super::common::{normal, Check};
use crate::Launcher;

/// The host's pick: the first index of the largest non-NaN value, `skip` left out
/// (token 0 when nothing is left), and whether any value is NaN.
fn host_pick(logits: &[f32], skip: i32) -> (u32, bool) {
    let nan = logits.iter().any(|v| v.is_nan());
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() || i as i32 == skip {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    (best.map_or(0, |(i, _)| i as u32), nan)
}

pub(super) fn check_pick(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x9c, 0);
    const VOCAB: usize = 129_280;
    let plain = normal(&mut rng, VOCAB, 3.0);
    // Coarse values: the maximum is tied dozens of times.
    let ties: Vec<f32> = (0..VOCAB).map(|_| (rng.normal() * 4.0).round()).collect();
    let mut late = normal(&mut rng, 1001, 1.0);
    late[1000] = 50.0; // the maximum in the tail past the last float4
    let mut with_nan = plain.clone();
    with_nan[77_777] = f32::NAN;
    let neg = vec![f32::NEG_INFINITY; 4096];
    let first = host_pick(&plain, -1).0 as i32;
    let first_tie = host_pick(&ties, -1).0 as i32;
    let cases: [(&str, &[f32], i32); 8] = [
        ("normal logits", &plain, -1),
        ("normal, the best left out", &plain, first),
        ("tied maxima", &ties, -1),
        ("tied maxima, the first left out", &ties, first_tie),
        ("1001 values, best in the tail", &late, -1),
        ("a NaN", &with_nan, -1),
        ("all -inf", &neg, -1),
        ("all -inf, token 0 left out", &neg, 0),
    ];
    let ring = gpu.pick_ring()?;
    let mut out = Vec::with_capacity(cases.len());
    for (i, (what, logits, skip)) in cases.into_iter().enumerate() {
        let pos = 1000 + i as i32;
        let step = gpu.upload(&[pos, 7])?;
        let d = gpu.upload(logits)?;
        gpu.greedy_pick(gpu.ptr(&step), gpu.ptr(&d), logits.len(), skip, &ring)?;
        gpu.synchronize()?;
        let (token, nan) = ring.read(pos as usize);
        let stepped: Vec<i32> = gpu.download(&step)?;
        let (want, want_nan) = host_pick(logits, skip);
        // A NaN row's pick is refused by the host: only the flag counts.
        let same =
            nan == want_nan && (want_nan || (token == want && stepped == [pos + 1, want as i32]));
        out.push(Check {
            name: format!("greedy_pick: {what}"),
            rel_err: if same { 0.0 } else { 1.0 },
            bound: 0.0,
        });
    }
    Ok(out)
}
