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

const VOCAB: usize = 129_280;

/// The rows both pick checks take: normal logits, coarse ones (the maximum tied dozens
/// of times), 1,001 values with the maximum in the tail past the last float4, normal
/// logits with a NaN, and all -inf.
struct Rows {
    plain: Vec<f32>,
    ties: Vec<f32>,
    late: Vec<f32>,
    with_nan: Vec<f32>,
    neg: Vec<f32>,
}

fn rows(rng: &mut Rng) -> Rows {
    let plain = normal(rng, VOCAB, 3.0);
    let ties: Vec<f32> = (0..VOCAB).map(|_| (rng.normal() * 4.0).round()).collect();
    let mut late = normal(rng, 1001, 1.0);
    late[1000] = 50.0;
    let mut with_nan = plain.clone();
    with_nan[77_777] = f32::NAN;
    Rows {
        plain,
        ties,
        late,
        with_nan,
        neg: vec![f32::NEG_INFINITY; 4096],
    }
}

pub(super) fn check_pick(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x9c, 0);
    let Rows {
        plain,
        ties,
        late,
        with_nan,
        neg,
    } = rows(&mut rng);
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

/// The host's draft pick: its first maximum (as `argmax`: token 0 when every value is
/// NaN) and top-1 − top-2 (as the engine's `top2_margin`: the maximum of every other
/// index; +inf without one).
fn host_top2(logits: &[f32]) -> (u32, f32) {
    let (pick, _) = host_pick(logits, -1);
    let all_nan = logits.iter().all(|v| v.is_nan());
    let best = logits[pick as usize];
    let sec = (logits.iter().enumerate())
        .filter(|&(i, v)| i != pick as usize && !v.is_nan())
        .map(|(_, &v)| v)
        .fold(f32::NEG_INFINITY, f32::max);
    let margin = if all_nan || sec == f32::NEG_INFINITY {
        f32::INFINITY
    } else {
        best - sec
    };
    (pick, margin)
}

/// `draft_pick` (the pick, the top-2 gap, an override, the chained step and the verify
/// row it writes) and `rows_pick` (each row's first maximum and NaN flag) against the
/// host.
pub(super) fn check_spec_pick(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x9d, 0);
    let Rows {
        plain,
        ties,
        late,
        with_nan,
        neg,
    } = rows(&mut rng);
    let mut runner_up_late = plain.clone();
    let top = host_pick(&plain, -1).0 as usize;
    runner_up_late[VOCAB - 1] = plain[top] - 0.125; // the second value in another block
    let one = vec![2.5f32];
    let nan_all = vec![f32::NAN; 64];
    let cases: [(&str, &[f32], Option<u32>); 9] = [
        ("normal logits", &plain, None),
        ("normal, an override", &plain, Some(4242)),
        ("tied maxima (gap 0)", &ties, None),
        ("1001 values, best in the tail", &late, None),
        ("the runner-up in the last block", &runner_up_late, None),
        ("a NaN", &with_nan, None),
        ("all -inf", &neg, None),
        ("one value", &one, None),
        ("all NaN", &nan_all, None),
    ];
    let ring = gpu.spec_ring()?;
    let mut out = Vec::with_capacity(cases.len() + 2);
    for (i, (what, logits, ovr)) in cases.into_iter().enumerate() {
        // Draft i of a cycle whose verify step starts at position 500.
        let pos = 500 + i % 15;
        let step = gpu.upload(&[pos as i32, 7])?;
        let mut records = vec![0i32; 2 * 16];
        for (r, rec) in records.chunks_mut(2).enumerate() {
            rec[0] = 500 + r as i32;
            rec[1] = -5;
        }
        let vstep = gpu.upload(&records)?;
        let d = gpu.upload(logits)?;
        ring.set_override(pos, ovr);
        gpu.draft_pick(
            gpu.ptr(&d),
            logits.len(),
            gpu.ptr(&step),
            gpu.ptr(&vstep),
            &ring,
        )?;
        gpu.synchronize()?;
        ring.set_override(pos, None);
        let got = ring.draft(pos);
        let stepped: Vec<i32> = gpu.download(&step)?;
        let rows: Vec<i32> = gpu.download(&vstep)?;
        let (pick, margin) = host_top2(logits);
        let want = ovr.unwrap_or(pick);
        let want_nan = logits.iter().any(|v| v.is_nan());
        let r = pos + 1 - 500;
        let mut want_rows = records.clone();
        want_rows[2 * r + 1] = want as i32;
        let same_margin = got.margin == margin || (got.margin.is_nan() && margin.is_nan());
        let same = got.token == want
            && got.nan == want_nan
            && same_margin
            && stepped == [pos as i32 + 1, want as i32]
            && rows == want_rows;
        out.push(Check {
            name: format!("draft_pick: {what}"),
            rel_err: if same { 0.0 } else { 1.0 },
            bound: 0.0,
        });
    }
    // Three rows at once: plain, tied, and one with a NaN.
    for (what, rows) in [
        ("3 rows (normal, ties, NaN)", vec![&plain, &ties, &with_nan]),
        ("1 row", vec![&late]),
    ] {
        let n = rows[0].len();
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        let d = gpu.upload(&flat)?;
        gpu.rows_pick(gpu.ptr(&d), n, rows.len(), &ring)?;
        gpu.synchronize()?;
        let same = rows
            .iter()
            .enumerate()
            .all(|(r, row)| ring.row(r) == host_pick(row, -1));
        out.push(Check {
            name: format!("rows_pick: {what}"),
            rel_err: if same { 0.0 } else { 1.0 },
            bound: 0.0,
        });
    }
    Ok(out)
}
