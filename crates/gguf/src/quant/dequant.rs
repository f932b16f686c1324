//! Exact dequantisation of every weight type DeepSeek V4 files use.
//!
//! The float operation order follows ggml's reference dequantisers so that results
//! are bit-identical to them (checked against the `gguf` Python package in tests).

use super::iq2xxs_grid::IQ2XXS_GRID;
use super::{bf16_to_f32, f16_to_f32, le_u16, le_u32};
use crate::error::QuantError;
use crate::types::GgmlType;

/// Sign patterns of IQ2 formats: the low 7 bits are the index, bit 7 makes the number
/// of set bits even.
pub(crate) const fn ksigns(i: usize) -> u8 {
    (i as u8) | (((i as u8).count_ones() as u8 & 1) << 7)
}

/// `KSIGN_MASK[i]`: byte j is 0xFF when element j of an IQ2 8-group with sign index `i`
/// is negative.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) static KSIGN_MASK: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut i = 0;
    while i < 128 {
        let s = ksigns(i);
        let mut m = 0u64;
        let mut j = 0;
        while j < 8 {
            if s & (1 << j) != 0 {
                m |= 0xFFu64 << (8 * j);
            }
            j += 1;
        }
        t[i] = m;
        i += 1;
    }
    t
};

/// Dequantises `out.len()` elements of type `ty` from `src` (exactly the bytes of
/// those elements).
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let n = out.len();
    let be = ty.block_elems();
    if n % be != 0 {
        return Err(QuantError::PartialBlock {
            ty,
            elems: n,
            block: be,
        });
    }
    let expected = n / be * ty.block_bytes();
    if src.len() != expected {
        return Err(QuantError::SizeMismatch {
            ty,
            got: src.len(),
            expected,
        });
    }
    let bb = ty.block_bytes();
    match ty {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        GgmlType::BF16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        GgmlType::I32 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32;
            }
        }
        GgmlType::Q8_0 => each_block(src, bb, out, be, dequant_q8_0),
        GgmlType::Q8_K => each_block(src, bb, out, be, dequant_q8_k),
        GgmlType::Q2_K => each_block(src, bb, out, be, dequant_q2_k),
        GgmlType::Q4_K => each_block(src, bb, out, be, dequant_q4_k),
        GgmlType::IQ2_XXS => each_block(src, bb, out, be, dequant_iq2_xxs),
        other => return Err(QuantError::Unsupported(other)),
    }
    Ok(())
}

/// Dequantises one row (`out.len()` elements) — same as [`dequantize`].
pub fn dequantize_row(ty: GgmlType, row: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    dequantize(ty, row, out)
}

/// Dequantises `n` elements into a new vector.
pub fn dequantize_to_vec(ty: GgmlType, src: &[u8], n: usize) -> Result<Vec<f32>, QuantError> {
    let mut v = vec![0.0; n];
    dequantize(ty, src, &mut v)?;
    Ok(v)
}

fn each_block(src: &[u8], bb: usize, out: &mut [f32], be: usize, f: fn(&[u8], &mut [f32])) {
    for (b, o) in src.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        f(b, o);
    }
}

fn dequant_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_to_f32(le_u16(b, 0));
    for (o, &q) in y.iter_mut().zip(&b[2..34]) {
        *o = d * (q as i8) as f32;
    }
}

fn dequant_q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (o, &q) in y.iter_mut().zip(&b[4..260]) {
        *o = d * (q as i8) as f32;
    }
}

fn dequant_q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = f16_to_f32(le_u16(b, 80));
    let dmin = f16_to_f32(le_u16(b, 82));
    let mut is = 0;
    for k in 0..2 {
        let q = &qs[32 * k..32 * k + 32];
        for j in 0..4 {
            let shift = 2 * j;
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0xF) as f32;
                let ml = dmin * (sc >> 4) as f32;
                for l in 0..16 {
                    let idx = 16 * half + l;
                    y[128 * k + 32 * j + idx] = dl * ((q[idx] >> shift) & 3) as f32 - ml;
                }
            }
        }
    }
}

/// Scale and min of sub-block `j` (0..8) of a Q4_K block's 12 packed scale bytes.
#[inline]
pub(crate) fn q4k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

fn dequant_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_to_f32(le_u16(b, 0));
    let dmin = f16_to_f32(le_u16(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for c in 0..4 {
        let (sc1, m1) = q4k_scale_min(2 * c, scales);
        let (sc2, m2) = q4k_scale_min(2 * c + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &qs[32 * c..32 * c + 32];
        for l in 0..32 {
            y[64 * c + l] = d1 * (q[l] & 0xF) as f32 - m1;
            y[64 * c + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

fn dequant_iq2_xxs(b: &[u8], y: &mut [f32]) {
    let d = f16_to_f32(le_u16(b, 0));
    for g in 0..8 {
        let w = &b[2 + 8 * g..10 + 8 * g];
        let a1 = le_u32(w, 4);
        let db = d * (0.5 + (a1 >> 28) as f32) * 0.25;
        for l in 0..4 {
            let grid = IQ2XXS_GRID[w[l] as usize].to_le_bytes();
            let signs = ksigns(((a1 >> (7 * l)) & 127) as usize);
            for j in 0..8 {
                let s = if signs & (1 << j) != 0 { -1.0 } else { 1.0 };
                y[32 * g + 8 * l + j] = db * grid[j] as f32 * s;
            }
        }
    }
}
