//! The number formats of the official checkpoint, decoded exactly to f32, and their
//! encoders (for the tiny test checkpoints).
//!
//! * FP8 E4M3FN weights with one UE8M0 (power-of-two) scale per 128×128 block;
//! * FP4 E2M1 routed-expert weights packed two per byte (low nibble first, i.e. the
//!   even column) with one UE8M0 scale per 32 values of a row;
//! * BF16, F16 and F32 tensors as they are.
//!
//! Every FP8/FP4 value times a power of two is exact in f32, so dequantisation is exact.

use anyhow::{bail, Result};
use ds4_gguf::quant::{bf16_to_f32, f16_to_f32};

/// The FP8 block (rows and columns) of the official dense weights.
pub const FP8_BLOCK: usize = 128;
/// Values per FP4 scale.
pub const FP4_BLOCK: usize = 32;

/// UE8M0: `2^(e−127)`. 0xFF is NaN in the OCP format; the official scales never use
/// it. e = 0 is 2^-127, a subnormal f32.
#[inline]
pub fn e8m0_to_f32(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(0x0040_0000),
        255 => f32::NAN,
        _ => f32::from_bits((e as u32) << 23),
    }
}

/// E4M3FN: 4 exponent bits (bias 7), 3 mantissa bits, no infinities; 0x7F/0xFF is NaN.
#[inline]
pub fn e4m3_to_f32(x: u8) -> f32 {
    let a = x & 0x7f;
    let v = if a == 0x7f {
        f32::NAN
    } else {
        let e = (a >> 3) as i32;
        let m = (a & 7) as f32;
        if e == 0 {
            m * (-9f32).exp2()
        } else {
            (1.0 + m / 8.0) * ((e - 7) as f32).exp2()
        }
    };
    if x & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// The 16 E2M1 codes (sign bit 3).
pub const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Rows `rows` of an FP8 weight `[out][inp]` with block scales `[⌈out/128⌉][⌈inp/128⌉]`
/// (`scale(r_block, c_block)`), appended to `dst` row-major.
pub fn dequant_fp8_rows(
    w: &[u8],
    inp: usize,
    rows: std::ops::Range<usize>,
    scale: &dyn Fn(usize, usize) -> f32,
    dst: &mut Vec<f32>,
) {
    for r in rows {
        let row = &w[r * inp..(r + 1) * inp];
        for (cb, chunk) in row.chunks(FP8_BLOCK).enumerate() {
            let s = scale(r / FP8_BLOCK, cb);
            dst.extend(chunk.iter().map(|&q| e4m3_to_f32(q) * s));
        }
    }
}

/// One FP4 expert matrix `[out][inp]`: `packed` is `[out][inp/2]`, `scales` (UE8M0)
/// `[out][inp/32]`.
pub fn dequant_fp4(packed: &[u8], scales: &[u8], out: usize, inp: usize) -> Result<Vec<f32>> {
    if !inp.is_multiple_of(FP4_BLOCK)
        || packed.len() != out * inp / 2
        || scales.len() != out * inp / 32
    {
        bail!(
            "FP4 tensor [{out}, {inp}]: {} packed bytes and {} scales",
            packed.len(),
            scales.len()
        );
    }
    let mut v = Vec::with_capacity(out * inp);
    for (b, (q, &e)) in packed.chunks_exact(16).zip(scales).enumerate() {
        let _ = b;
        let s = e8m0_to_f32(e);
        for &byte in q {
            v.push(FP4_VALUES[(byte & 15) as usize] * s);
            v.push(FP4_VALUES[(byte >> 4) as usize] * s);
        }
    }
    Ok(v)
}

/// A plain float tensor (`F32`, `F16`, `BF16`) to f32.
pub fn plain_to_f32(dtype: &str, bytes: &[u8]) -> Result<Vec<f32>> {
    Ok(match dtype {
        "F32" => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        "F16" => bytes
            .chunks_exact(2)
            .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        "BF16" => bytes
            .chunks_exact(2)
            .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        _ => bail!("cannot read dtype {dtype} as plain floats"),
    })
}

/// The UE8M0 exponent of `2^ceil(log2f(amax/qmax))` with the official amax floors (the
/// scale rule of the official quantiser, architecture.md §3.8; `log2f` as ds4, §8 18).
fn ue8m0_scale(amax: f32, qmax: f32, floor: f32) -> u8 {
    let e = (amax.max(floor) / qmax).log2().ceil() as i32;
    (e + 127).clamp(1, 254) as u8
}

/// Nearest E4M3FN code of `v` (|v| ≤ 448), ties to the even code.
pub fn f32_to_e4m3(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    let a = v.abs().min(448.0);
    let mut best = (0u8, f32::INFINITY);
    for code in 0..0x7f_u8 {
        let d = (e4m3_to_f32(code) - a).abs();
        if d < best.1 || (d == best.1 && code % 2 == 0) {
            best = (code, d);
        }
    }
    best.0 | sign
}

/// Nearest E2M1 code of `v` (|v| ≤ 6), ties to the even code.
pub fn f32_to_e2m1(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 8 } else { 0 };
    let a = v.abs().min(6.0);
    let mut best = (0u8, f32::INFINITY);
    for code in 0..8u8 {
        let d = (FP4_VALUES[code as usize] - a).abs();
        if d < best.1 || (d == best.1 && code % 2 == 0) {
            best = (code, d);
        }
    }
    best.0 | sign
}

/// FP8 encoding of `[out][inp]` as the official checkpoints store it: codes and
/// UE8M0 scales `[⌈out/128⌉][⌈inp/128⌉]`.
pub fn encode_fp8(x: &[f32], out: usize, inp: usize) -> (Vec<u8>, Vec<u8>) {
    let (rb, cb) = (out.div_ceil(FP8_BLOCK), inp.div_ceil(FP8_BLOCK));
    let mut scales = vec![0u8; rb * cb];
    for b in 0..rb {
        for c in 0..cb {
            let mut amax = 0.0f32;
            for r in b * FP8_BLOCK..((b + 1) * FP8_BLOCK).min(out) {
                for k in c * FP8_BLOCK..((c + 1) * FP8_BLOCK).min(inp) {
                    amax = amax.max(x[r * inp + k].abs());
                }
            }
            scales[b * cb + c] = ue8m0_scale(amax, 448.0, 1e-4);
        }
    }
    let codes = (0..out * inp)
        .map(|i| {
            let s = e8m0_to_f32(scales[(i / inp / FP8_BLOCK) * cb + (i % inp) / FP8_BLOCK]);
            f32_to_e4m3(x[i] / s)
        })
        .collect();
    (codes, scales)
}

/// FP4 encoding of `[out][inp]`: packed codes `[out][inp/2]` and scales `[out][inp/32]`.
pub fn encode_fp4(x: &[f32]) -> (Vec<u8>, Vec<u8>) {
    let mut packed = Vec::with_capacity(x.len() / 2);
    let mut scales = Vec::with_capacity(x.len() / FP4_BLOCK);
    for blk in x.chunks_exact(FP4_BLOCK) {
        let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let e = ue8m0_scale(amax, 6.0, 7.052_966e-38);
        scales.push(e);
        let s = e8m0_to_f32(e);
        for pair in blk.chunks_exact(2) {
            packed.push(f32_to_e2m1(pair[0] / s) | (f32_to_e2m1(pair[1] / s) << 4));
        }
    }
    (packed, scales)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_table_matches_the_format() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6)); // smallest normal
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        assert!(e4m3_to_f32(0x7f).is_nan());
        // Every code round-trips through the encoder.
        for c in (0..=0xffu8).filter(|c| c & 0x7f != 0x7f && *c != 0x80) {
            assert_eq!(f32_to_e4m3(e4m3_to_f32(c)), c, "{c:#x}");
        }
    }

    #[test]
    fn e8m0_and_e2m1() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(130), 8.0);
        assert_eq!(e8m0_to_f32(1), 2f32.powi(-126));
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        for c in 0..16u8 {
            let back = f32_to_e2m1(FP4_VALUES[c as usize]);
            assert_eq!(FP4_VALUES[back as usize], FP4_VALUES[c as usize]);
        }
        // Ties go to the even code: 2.5 lies between 2 (code 4) and 3 (code 5).
        assert_eq!(f32_to_e2m1(2.5), 4);
        assert_eq!(f32_to_e2m1(5.0), 6);
    }

    #[test]
    fn fp4_dequant_is_low_nibble_first() {
        // One row of 32: byte 0 = codes (1.0 low, -6.0 high), scale 2^1.
        let mut packed = vec![0u8; 16];
        packed[0] = 0x2 | (0xF << 4);
        let v = dequant_fp4(&packed, &[128], 1, 32).unwrap();
        assert_eq!((v[0], v[1], v[2]), (2.0, -12.0, 0.0));
        assert!(dequant_fp4(&packed, &[128, 1], 1, 32).is_err());
    }

    #[test]
    fn encoders_round_trip_representable_values() {
        // Values already on the FP8 grid of their block come back exactly.
        let (out, inp) = (130, 136); // partial blocks on both axes
        let x: Vec<f32> = (0..out * inp)
            .map(|i| e4m3_to_f32((i % 126) as u8) * if i % 3 == 0 { -0.25 } else { 0.25 })
            .collect();
        let (codes, scales) = encode_fp8(&x, out, inp);
        let cb = inp.div_ceil(FP8_BLOCK);
        let mut back = Vec::new();
        dequant_fp8_rows(
            &codes,
            inp,
            0..out,
            &|r, c| e8m0_to_f32(scales[r * cb + c]),
            &mut back,
        );
        assert_eq!(back, x);
        let y: Vec<f32> = (0..64).map(|i| FP4_VALUES[i % 16] * 0.125).collect();
        let (p, s) = encode_fp4(&y);
        assert_eq!(dequant_fp4(&p, &s, 2, 32).unwrap(), y);
    }
}
