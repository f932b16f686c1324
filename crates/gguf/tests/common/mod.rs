//! Helpers shared by the integration tests.

use ds4_gguf::GgmlType;
use rand::rngs::StdRng;
use rand::RngCore;

/// `n_blocks` blocks of `ty` with uniformly random bytes, except each f16 scale (d,
/// dmin), which `scale` draws so that it stays finite.
pub fn random_blocks(
    rng: &mut StdRng,
    ty: GgmlType,
    n_blocks: usize,
    scale: fn(&mut StdRng) -> u16,
) -> Vec<u8> {
    let bb = ty.block_bytes();
    let mut v = vec![0u8; n_blocks * bb];
    rng.fill_bytes(&mut v);
    let scale_at: &[usize] = match ty {
        GgmlType::Q8_0 | GgmlType::IQ2_XXS => &[0],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q4_K => &[0, 2],
        _ => &[],
    };
    for b in v.chunks_exact_mut(bb) {
        for &at in scale_at {
            b[at..at + 2].copy_from_slice(&scale(rng).to_le_bytes());
        }
    }
    v
}
