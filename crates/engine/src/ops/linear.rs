//! Matrix × activations for every weight type, in two numeric modes.
//!
//! * [`Numerics::Exact`]: the official math in f32 — each weight row is dequantised
//!   exactly and dotted with the f32 activations.
//! * [`Numerics::Fast`]: ds4's numerics — activations quantised to Q8_0 in front of
//!   Q8_0 weights and to Q8_K in front of K-quant/IQ2 weights (integer block dots);
//!   F16/BF16/F32 weights use the dense f32 dot as in exact mode.
//!
//! Work is split over output rows only: each output value is one dot computed by one
//! thread, so results do not depend on thread count or on how tokens are batched.

use ds4_gguf::quant::{
    dot_iq2_xxs_q8_k, dot_q2_k_q8_k, dot_q4_k_q8_k, dot_q8_0_q8_0, quantize_q8_0, quantize_q8_k,
    BlockQ8K, BlockQ8_0, QK8_0, QK_K,
};
use ds4_gguf::GgmlType;
use rayon::prelude::*;

use super::dot::dot;
use crate::weights::MatRef;

/// The numeric mode of a model or session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Numerics {
    /// f32 activations against exactly dequantised weights, f32 KV rows (the
    /// reference's float32 math; matches the official implementation to ~1e-5).
    #[default]
    Exact,
    /// ds4's numerics: Q8_0/Q8_K activation quantisation, f16-rounded KV rows.
    Fast,
}

/// How activations must be prepared for a weight type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActKind {
    F32,
    Q8_0,
    Q8K,
}

pub fn act_kind(ty: GgmlType, numerics: Numerics) -> ActKind {
    match (numerics, ty) {
        (Numerics::Fast, GgmlType::Q8_0) => ActKind::Q8_0,
        (Numerics::Fast, GgmlType::Q2_K | GgmlType::Q4_K | GgmlType::IQ2_XXS) => ActKind::Q8K,
        _ => ActKind::F32,
    }
}

/// Activations of `n_rows` vectors of `n_in` values, in the form a kernel consumes.
pub struct Prepared<'x> {
    pub kind: ActKind,
    pub n_in: usize,
    f32: &'x [f32],
    q8_0: Vec<BlockQ8_0>,
    q8k: Vec<BlockQ8K>,
}

impl<'x> Prepared<'x> {
    pub fn new(x: &'x [f32], n_in: usize, kind: ActKind) -> Prepared<'x> {
        let mut p = Prepared {
            kind,
            n_in,
            f32: x,
            q8_0: Vec::new(),
            q8k: Vec::new(),
        };
        match kind {
            ActKind::F32 => {}
            ActKind::Q8_0 => {
                p.q8_0 = vec![BlockQ8_0::default(); x.len() / QK8_0];
                quantize_q8_0(x, &mut p.q8_0);
            }
            ActKind::Q8K => {
                p.q8k = vec![BlockQ8K::default(); x.len() / QK_K];
                quantize_q8_k(x, &mut p.q8k);
            }
        }
        p
    }

    pub fn for_mat(x: &'x [f32], w: &MatRef<'_>, numerics: Numerics) -> Prepared<'x> {
        Prepared::new(x, w.n_in, act_kind(w.ty, numerics))
    }

    pub fn n_rows(&self) -> usize {
        self.f32.len() / self.n_in
    }
}

/// Below this many multiply-adds a product runs on the calling thread.
const PAR_MIN_WORK: usize = 1 << 16;

/// `out[i][o] = W[o]·x[rows[i]]` for the listed activation rows (`None`: all rows).
/// `out` is `[n][w.n_out]`.
pub fn matmul_rows(w: MatRef<'_>, x: &Prepared<'_>, rows: Option<&[usize]>, out: &mut [f32]) {
    assert_eq!(w.n_in, x.n_in, "matmul: input width mismatch");
    let all: Vec<usize>;
    let rows = match rows {
        Some(r) => r,
        None => {
            all = (0..x.n_rows()).collect();
            &all
        }
    };
    let n = rows.len();
    assert_eq!(out.len(), n * w.n_out, "matmul: output size mismatch");
    if n == 0 {
        return;
    }
    let work = w.n_out * w.n_in * n;
    let threads = rayon::current_num_threads();
    let n_tasks = if work < PAR_MIN_WORK || threads == 1 {
        1
    } else {
        (threads * 4).min(w.n_out)
    };
    let per = w.n_out.div_ceil(n_tasks);
    let compute = |o0: usize| -> Vec<f32> {
        let o1 = (o0 + per).min(w.n_out);
        let mut buf = vec![0.0f32; (o1 - o0) * n];
        rows_block(&w, x, rows, o0, o1, &mut buf);
        buf
    };
    let blocks: Vec<Vec<f32>> = if n_tasks == 1 {
        vec![compute(0)]
    } else {
        (0..w.n_out)
            .step_by(per)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(compute)
            .collect()
    };
    for (bi, buf) in blocks.iter().enumerate() {
        let o0 = bi * per;
        let nr = buf.len() / n;
        for r in 0..nr {
            for i in 0..n {
                out[i * w.n_out + o0 + r] = buf[r * n + i];
            }
        }
    }
}

/// All activation rows.
pub fn matmul(w: MatRef<'_>, x: &Prepared<'_>, out: &mut [f32]) {
    matmul_rows(w, x, None, out)
}

/// Convenience: prepare `x` (`[n][w.n_in]`) and multiply.
pub fn matmul_f32(w: MatRef<'_>, x: &[f32], numerics: Numerics, out: &mut [f32]) {
    let p = Prepared::for_mat(x, &w, numerics);
    matmul(w, &p, out)
}

/// Activation rows per tile: a tile's activations stay in cache while a task's weight
/// rows stream past (a 2048-token chunk of 4096-wide rows would not).
const TOKEN_TILE: usize = 32;

/// Output rows `o0..o1` for every listed activation row, into `buf[(o−o0)·n + i]`.
fn rows_block(
    w: &MatRef<'_>,
    x: &Prepared<'_>,
    rows: &[usize],
    o0: usize,
    o1: usize,
    buf: &mut [f32],
) {
    let n = rows.len();
    let n_in = w.n_in;
    let mut wrow = Vec::new();
    for (tile_i, tile) in rows.chunks(TOKEN_TILE).enumerate() {
        let i0 = tile_i * TOKEN_TILE;
        match x.kind {
            ActKind::F32 => {
                wrow.resize(n_in, 0.0);
                for o in o0..o1 {
                    w.dequant_row(o, &mut wrow);
                    for (i, &r) in tile.iter().enumerate() {
                        buf[(o - o0) * n + i0 + i] = dot(&wrow, &x.f32[r * n_in..(r + 1) * n_in]);
                    }
                }
            }
            ActKind::Q8_0 => {
                let nb = n_in / QK8_0;
                for o in o0..o1 {
                    let wr = w.row(o);
                    for (i, &r) in tile.iter().enumerate() {
                        buf[(o - o0) * n + i0 + i] =
                            dot_q8_0_q8_0(wr, &x.q8_0[r * nb..(r + 1) * nb]);
                    }
                }
            }
            ActKind::Q8K => {
                let nb = n_in / QK_K;
                let f = match w.ty {
                    GgmlType::Q2_K => dot_q2_k_q8_k,
                    GgmlType::Q4_K => dot_q4_k_q8_k,
                    GgmlType::IQ2_XXS => dot_iq2_xxs_q8_k,
                    other => unreachable!("no Q8_K kernel for {other:?}"),
                };
                for o in o0..o1 {
                    let wr = w.row(o);
                    for (i, &r) in tile.iter().enumerate() {
                        buf[(o - o0) * n + i0 + i] = f(wr, &x.q8k[r * nb..(r + 1) * nb]);
                    }
                }
            }
        }
    }
}
