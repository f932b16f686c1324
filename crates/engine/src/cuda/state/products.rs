//! The projections the layer launches share: the GEMM switch for batches
//! (`DS4_CUDA_GEMM`), and one helper per product shape — a dense f32-activation
//! product, the compressor's kv and gate inputs, a projection with its Q8_0 input in
//! the fast numerics — each a tiled GEMM for a batch and a matvec for a token or a
//! small batch. Also the launch parameters of a hyper-connection.

use ds4_cuda::{ActRule, Batch, CudaError, DeviceMatrix, Launcher, MatSel, QuantAct};
use ds4_gguf::GgmlType;

use crate::config::Config;
use crate::cuda::weights::{CompressorDev, HcDev};

/// Which products a batch of more than one token runs as tensor-core / tiled GEMMs
/// instead of per-token matvecs: `DS4_CUDA_GEMM` = `0` (none, for comparison) or a comma
/// list of `q8` (Q8_0 × int8), `f32` (f32 activations), `group` (the grouped output
/// projection), `experts`, `attn` (tensor-core attention, fast numerics); all by
/// default.
#[derive(Clone, Copy)]
pub(super) enum Gemm {
    Q8,
    F32,
    Group,
    Experts,
    Attn,
}

pub(super) fn gemm(kind: Gemm) -> bool {
    static ON: std::sync::OnceLock<[bool; 5]> = std::sync::OnceLock::new();
    ON.get_or_init(|| match std::env::var("DS4_CUDA_GEMM") {
        Err(_) => [true; 5],
        Ok(v) if v == "0" => [false; 5],
        Ok(v) => {
            let on = |k: &str| v.split(',').any(|p| p.trim() == k);
            [on("q8"), on("f32"), on("group"), on("experts"), on("attn")]
        }
    })[kind as usize]
}

/// Batches of at most this many tokens (a multi-row decode step, the tail of a prompt)
/// run the matvec kernels, which read the weights once for up to this many tokens
/// ([`ds4_cuda::Q8_TOKENS_MAX`]); larger ones the tiled GEMMs, whose 64-row tiles cost
/// 5-6× a decode token's time for two tokens (NOTES.md, session 13).
pub(super) const SMALL_BATCH: usize = ds4_cuda::Q8_TOKENS_MAX;

/// Whether `matmul_f32` takes this weight format.
pub(super) fn f32_gemm_format(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0
    )
}

/// f32 activations × `m` for `n` tokens laid out by `b`: a GEMM for batches, the
/// matvec otherwise.
pub(super) fn dense_f32(
    g: &Launcher,
    m: &DeviceMatrix,
    x: u64,
    y: u64,
    b: Batch,
) -> Result<(), CudaError> {
    if b.n_tok > SMALL_BATCH && gemm(Gemm::F32) && f32_gemm_format(m.ty) && b.n_groups == 1 {
        g.matmul_f32(m, x, y, b)
    } else {
        let sel = MatSel {
            ids: 0,
            x_stride: b.x_tok as i64,
            y_stride: b.y_tok as i64,
        };
        g.matvec(m, x, y, b.n_tok, sel)
    }
}

/// The compressor's kv and gate projections of `n` tokens: token t's kv at
/// out + t·2w, its gate scores right after.
pub(super) fn compressor_inputs(
    g: &Launcher,
    cw: &CompressorDev,
    x: u64,
    out: u64,
    n: usize,
) -> Result<(), CudaError> {
    let width = cw.lanes * cw.dim;
    let b = Batch {
        y_tok: 2 * width,
        ..Batch::plain(n, cw.kv.cols, 0)
    };
    dense_f32(g, &cw.kv, x, out, b)?;
    dense_f32(g, &cw.gate, x, out + 4 * width as u64, b)
}

/// The launch parameters of the hyper-connection `hc` of a model of config `c`.
pub(super) fn hc_params(g: &Launcher, c: &Config, hc: &HcDev) -> ds4_cuda::HcParams {
    ds4_cuda::HcParams {
        scale: g.ptr(&hc.scale),
        base: g.ptr(&hc.base),
        n_hc: c.n_hc,
        n_embd: c.n_embd,
        eps: c.hc_eps,
        iters: c.sinkhorn_iters,
    }
}

/// `n` packed input rows of `m` to `n` packed output rows.
pub(super) fn plain(m: &DeviceMatrix, n: usize) -> Batch {
    Batch::plain(n, m.cols, m.rows)
}

/// A plain matrix applied to `n` consecutive input rows.
pub(super) fn rows(m: &DeviceMatrix) -> MatSel {
    MatSel {
        ids: 0,
        x_stride: m.cols as i64,
        y_stride: m.rows as i64,
    }
}

/// One projection of `n` input rows: in the fast numerics a Q8_0 weight gets its input
/// quantised to Q8_0 first (into `xq`, which `quantized` says already holds `x`), as on
/// the CPU.
#[allow(clippy::too_many_arguments)]
pub(super) fn mv(
    g: &Launcher,
    m: &DeviceMatrix,
    x: u64,
    xq: &mut QuantAct,
    quantized: bool,
    y: u64,
    n: usize,
    fast: bool,
) -> Result<(), CudaError> {
    if fast && m.ty == GgmlType::Q8_0 {
        if !quantized {
            g.quantize_rows(x, xq, n, ActRule::Q8_0)?;
        }
        if n > SMALL_BATCH && gemm(Gemm::Q8) {
            g.matmul_q8act(m, xq, y, Batch::plain(n, xq.cols, m.rows))
        } else {
            g.matvec_q8act(m, xq, y, n, rows(m))
        }
    } else {
        dense_f32(g, m, x, y, plain(m, n))
    }
}
