//! DeepSeek V4 quantisation formats: block layouts, dequantisation, activation
//! quantisation and dot products of weight rows with quantised activation rows.
//!
//! The scalar functions here are the reference: every SIMD path must equal them
//! exactly (integer block sums are exact; the float combination order is fixed).

mod blocks;
mod dequant;
mod dot;
mod iq2_search;
mod iq2xxs_grid;
pub mod qat;
mod quantize;
pub mod random;
#[cfg(target_arch = "aarch64")]
mod simd_neon;
#[cfg(target_arch = "x86_64")]
mod simd_x86;

pub use blocks::*;
pub use dequant::{dequantize, dequantize_row, dequantize_to_vec};
pub use dot::*;
pub use quantize::{
    quantize_iq2_xxs, quantize_iq2_xxs_imatrix, quantize_q2_k, quantize_q2_k_imatrix,
    quantize_q4_k, quantize_q4_k_imatrix, quantize_q8_0_weights, quantize_weights,
    quantize_weights_imatrix,
};

/// The IQ2_XXS lattice grid (256 entries of 8 magnitude bytes), for GPU kernels.
pub fn iq2xxs_grid() -> &'static [u64; 256] {
    &iq2xxs_grid::IQ2XXS_GRID
}

/// f16 bits → f32, exact (subnormals, inf and NaN included).
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// f32 → f16 bits, round to nearest even, subnormals and overflow to inf; every NaN
/// becomes the canonical quiet NaN 0x7e00.
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    if x.is_nan() {
        0x7e00
    } else {
        half::f16::from_f32(x).to_bits()
    }
}

/// f32 → f16 → f32: the rounding ds4 applies to every stored KV row.
#[inline]
pub fn f16_round(x: f32) -> f32 {
    f16_to_f32(f32_to_f16(x))
}

/// bf16 bits → f32 (exact).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 → bf16 bits, round to nearest even, NaN kept quiet.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

#[inline]
pub(crate) fn le_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

#[inline]
pub(crate) fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
