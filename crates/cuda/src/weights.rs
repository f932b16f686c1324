//! Weight upload: GGUF blocks are repacked so that every quant load in a kernel is
//! 16-byte aligned (the 34-, 66- and 84-byte blocks are not), with scales split into
//! arrays of their own. Bytes per weight are unchanged.

use ds4_gguf::GgmlType;

use crate::device::Gpu;
use crate::error::CudaError;
use crate::hostmem::Part;

/// Per repacked part, the (offset, length) of its bytes inside each GGUF block.
type PartSpans = &'static [(usize, usize)];

/// Where the repacked parts of a weight type come from: each GGUF block of `block`
/// bytes gives part k the `len` bytes at `off` (one part of the whole block for types
/// that keep the GGUF layout).
fn part_layout(ty: GgmlType) -> Result<(usize, PartSpans), CudaError> {
    Ok(match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Q4_K => (1, &[(0, 1)]),
        // quants, then the f16 scale
        GgmlType::Q8_0 => (34, &[(2, 32), (0, 2)]),
        GgmlType::IQ2_XXS => (66, &[(2, 64), (0, 2)]),
        // quants, the 16 packed scales, then d and dmin
        GgmlType::Q2_K => (84, &[(16, 64), (0, 16), (80, 4)]),
        other => {
            return Err(CudaError::Invalid(format!(
                "no CUDA kernel for {other} weights"
            )))
        }
    })
}

/// Checks that `src` holds `n_mats` matrices of `rows × cols` elements of type `ty`.
fn check_size(
    ty: GgmlType,
    src: &[u8],
    rows: usize,
    cols: usize,
    n_mats: usize,
) -> Result<(), CudaError> {
    let n = rows * cols * n_mats;
    let want = ty
        .bytes_for(n as u64)
        .ok_or_else(|| CudaError::Invalid(format!("{ty}: {cols} columns are not whole blocks")))?;
    if src.len() as u64 != want {
        return Err(CudaError::Invalid(format!(
            "{ty}: {} bytes, expected {want}",
            src.len()
        )));
    }
    Ok(())
}

/// A weight matrix (or a stack of expert matrices) for the GPU's kernels: resident on
/// the GPU, or (offloaded experts) in mapped host memory the kernels read over the bus.
pub struct DeviceMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub n_mats: usize,
    pub(crate) parts: Vec<Part>,
}

impl DeviceMatrix {
    /// Uploads `n_mats` matrices of `rows × cols` (GGUF layout `[cols, rows, n_mats]`),
    /// repacked on the way (up to three parts, see [`part_layout`] and each kernel)
    /// through the pinned staging buffers.
    pub fn upload(
        gpu: &Gpu,
        ty: GgmlType,
        src: &[u8],
        rows: usize,
        cols: usize,
        n_mats: usize,
    ) -> Result<DeviceMatrix, CudaError> {
        Self::repack(ty, src, (rows, cols, n_mats), |block, off, len| {
            gpu.upload_gather(src, block, off, len).map(Part::Device)
        })
    }

    /// [`DeviceMatrix::upload`]'s twin that keeps the repacked parts in mapped host
    /// memory (expert offload): the same layout, so the same kernels read it.
    pub fn upload_host(
        gpu: &Gpu,
        ty: GgmlType,
        src: &[u8],
        rows: usize,
        cols: usize,
        n_mats: usize,
    ) -> Result<DeviceMatrix, CudaError> {
        Self::repack(ty, src, (rows, cols, n_mats), |block, off, len| {
            gpu.host_gather(src, block, off, len).map(Part::Host)
        })
    }

    /// The stack of `src` with each repacked part (see [`part_layout`]) made by
    /// `gather(block, off, len)`: on the device or in mapped host memory.
    fn repack(
        ty: GgmlType,
        src: &[u8],
        (rows, cols, n_mats): (usize, usize, usize),
        gather: impl Fn(usize, usize, usize) -> Result<Part, CudaError>,
    ) -> Result<DeviceMatrix, CudaError> {
        check_size(ty, src, rows, cols, n_mats)?;
        let (block, layout) = part_layout(ty)?;
        let parts = (layout.iter())
            .map(|&(off, len)| gather(block, off, len))
            .collect::<Result<_, _>>()?;
        Ok(DeviceMatrix {
            ty,
            rows,
            cols,
            n_mats,
            parts,
        })
    }

    /// The address kernels read part `k` at.
    pub fn part_ptr(&self, gpu: &Gpu, k: usize) -> u64 {
        self.parts[k].ptr(gpu)
    }

    /// Bytes of the matrix stack, wherever they live.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.len()).sum()
    }

    /// Bytes of the stack in device memory (0 when offloaded to the host).
    pub fn device_bytes(&self) -> usize {
        self.parts
            .iter()
            .filter(|p| !p.on_host())
            .map(|p| p.len())
            .sum()
    }

    /// Whether the stack lives in mapped host memory.
    pub fn on_host(&self) -> bool {
        self.parts.iter().any(|p| p.on_host())
    }

    /// Bytes read by one product with one matrix of the stack.
    pub fn bytes_per_matrix(&self) -> usize {
        self.bytes() / self.n_mats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_gguf::quant::dequantize_to_vec;

    /// The parts of a repacked matrix stack, built on the host.
    struct Repacked {
        parts: Vec<Vec<u8>>,
    }

    /// The host twin of the gather [`DeviceMatrix::upload`] does on the way to the device
    /// (`Gpu::upload_gather` with each span of [`part_layout`]).
    fn repack(
        ty: GgmlType,
        src: &[u8],
        (rows, cols, mats): (usize, usize, usize),
    ) -> Result<Repacked, CudaError> {
        check_size(ty, src, rows, cols, mats)?;
        let (block, layout) = part_layout(ty)?;
        let gather = |&(off, len): &(usize, usize)| -> Vec<u8> {
            if len == block {
                return src.to_vec();
            }
            let blocks = src.chunks_exact(block);
            blocks.flat_map(|b| &b[off..off + len]).copied().collect()
        };
        Ok(Repacked {
            parts: layout.iter().map(gather).collect(),
        })
    }

    /// Decodes the repacked layouts with the kernels' indexing, on the CPU.
    fn decode_repacked(ty: GgmlType, r: &Repacked, n: usize) -> Vec<f32> {
        let h = |b: &[u8], i: usize| {
            ds4_gguf::quant::f16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))
        };
        let mut out = vec![0.0; n];
        match ty {
            GgmlType::Q8_0 => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = h(&r.parts[1], i / 32) * r.parts[0][i] as i8 as f32;
                }
            }
            GgmlType::IQ2_XXS | GgmlType::Q2_K => {
                // Reassemble GGUF blocks from the parts and use the reference decoder.
                let nb = n / 256;
                let mut blocks = Vec::new();
                for b in 0..nb {
                    if ty == GgmlType::IQ2_XXS {
                        blocks.extend_from_slice(&r.parts[1][2 * b..2 * b + 2]);
                        blocks.extend_from_slice(&r.parts[0][64 * b..64 * b + 64]);
                    } else {
                        blocks.extend_from_slice(&r.parts[1][16 * b..16 * b + 16]);
                        blocks.extend_from_slice(&r.parts[0][64 * b..64 * b + 64]);
                        blocks.extend_from_slice(&r.parts[2][4 * b..4 * b + 4]);
                    }
                }
                out = dequantize_to_vec(ty, &blocks, n).unwrap();
            }
            _ => out = dequantize_to_vec(ty, &r.parts[0], n).unwrap(),
        }
        out
    }

    #[test]
    fn repacking_preserves_every_value() {
        let mut seed = 1u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u8
        };
        for ty in [
            GgmlType::Q8_0,
            GgmlType::IQ2_XXS,
            GgmlType::Q2_K,
            GgmlType::Q4_K,
            GgmlType::F16,
        ] {
            let (rows, cols, mats) = (3, 512, 2);
            let n = rows * cols * mats;
            let mut src: Vec<u8> = (0..ty.bytes_for(n as u64).unwrap())
                .map(|_| next())
                .collect();
            // Keep f16 scales finite.
            if ty == GgmlType::F16 {
                for c in src.chunks_exact_mut(2) {
                    c[1] &= 0x3b;
                }
            } else {
                let (bb, offs): (usize, &[usize]) = match ty {
                    GgmlType::Q8_0 => (34, &[0]),
                    GgmlType::IQ2_XXS => (66, &[0]),
                    GgmlType::Q2_K => (84, &[80, 82]),
                    _ => (144, &[0, 2]),
                };
                for b in src.chunks_exact_mut(bb) {
                    for &o in offs {
                        b[o + 1] &= 0x3b;
                    }
                }
            }
            let r = repack(ty, &src, (rows, cols, mats)).unwrap();
            assert_eq!(
                r.parts.iter().map(Vec::len).sum::<usize>(),
                src.len(),
                "{ty}: bytes kept"
            );
            assert_eq!(
                decode_repacked(ty, &r, n),
                dequantize_to_vec(ty, &src, n).unwrap(),
                "{ty}"
            );
        }
    }

    #[test]
    fn wrong_sizes_are_errors() {
        assert!(repack(GgmlType::Q8_0, &[0; 33], (1, 32, 1)).is_err());
        assert!(repack(GgmlType::Q8_0, &[0; 34], (1, 31, 1)).is_err());
        assert!(repack(GgmlType::Q5_K, &[0; 176], (1, 256, 1)).is_err());
    }
}
