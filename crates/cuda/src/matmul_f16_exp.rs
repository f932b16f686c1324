//! A prefill chunk's routed-expert GEMMs on fp16 warpgroup MMA
//! (`kernels/matmul_f16_exp.cu`, `Variant::ExpF16`): IQ2_XXS and Q2_K stacks over a
//! [`RoutePlan`], sm_90a only.
//!
//! The int8 expert GEMM (`mm_exp_*`) spends ~15.6 instructions an `mma.m16n8k32`, four
//! of them the IMADs of the integer sub-block scale that an int8 fragment cannot hold.
//! Here each weight is decoded once a block to fp16 with all its scales folded in,
//! straight into the A registers of `wgmma.m64n64k16`, and the tensor cores sum the
//! whole k with no epilogue but the token scale. The activations become fp16 first
//! (`q8act_to_f16_perm`: `q8act_to_f16`'s values and power-of-two token scale, each
//! 32-span in the order the decoded registers hold their k) in the lane's [`F16Slot`].

use cudarc::driver::{LaunchConfig, PushKernelArg};
use ds4_gguf::GgmlType;

use crate::error::CudaError;
use crate::matmul::{invalid, max_items, RoutePlan};
use crate::matmul_f16::{per_token, F16Slot};
use crate::ops::QuantAct;
use crate::plan::{Launcher, Variant};
use crate::weights::DeviceMatrix;

/// Stages of 128 k (`XF_STAGES`), the B tile of a stage (64 pairs × 128 fp16), the
/// IQ2_XXS grid table's interleaved copies (`XF_COPIES` × 2 KB).
const STAGES: usize = 4;
const B_BYTES: usize = 64 * 128 * 2;
const GRID_BYTES: usize = 8 * 2048;

/// Dynamic shared memory of `mm_exp_f16_<ty>`: the stages (B tile + `xf_abytes`), the
/// grid table, 1 KB to align the stages by hand.
fn smem(ty: GgmlType) -> usize {
    let (a, table) = if ty == GgmlType::IQ2_XXS {
        (5120, GRID_BYTES)
    } else {
        (6144, 0)
    };
    STAGES * (B_BYTES + a) + table + 1024
}

/// Why `slot` cannot take `m` over activations `xq` of `in_rows` rows, if it cannot.
fn unfit(m: &DeviceMatrix, xq: &QuantAct, in_rows: usize, slot: &F16Slot) -> Option<String> {
    if !matches!(m.ty, GgmlType::IQ2_XXS | GgmlType::Q2_K) {
        return Some(format!("{} has no fp16 expert GEMM", m.ty));
    }
    if !m.rows.is_multiple_of(128) || !m.cols.is_multiple_of(256) {
        return Some(format!(
            "{}×{} is not whole 128 × 256 tiles",
            m.rows, m.cols
        ));
    }
    if xq.cols < m.cols || xq.rows < in_rows {
        return Some(format!(
            "activations {}×{} for {in_rows}×{}",
            xq.rows, xq.cols, m.cols
        ));
    }
    let (x, cx, ct) = (in_rows * xq.cols, slot.x.len(), slot.scale.len());
    if x > cx || in_rows > ct {
        return Some(format!(
            "{x} activations / {in_rows} rows exceed the slot ({cx} / {ct})"
        ));
    }
    None
}

impl Launcher<'_> {
    /// The slot of this lane that takes the expert GEMM of `m` over `in_rows` activation
    /// rows (`exp_f16` on, wgmma available, the shapes and capacities fit), if any.
    pub(crate) fn exp_f16_slot(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        in_rows: usize,
    ) -> Option<&F16Slot> {
        if !self.on(Variant::ExpF16) || !self.has_wgmma() {
            return None;
        }
        self.f16_work()
            .and_then(|w| w.slots().get(self.current_lane()))
            .filter(|s| unfit(m, xq, in_rows, s).is_none())
    }

    /// [`Launcher::matmul_experts_q8act`] on fp16 warpgroup MMA through `slot` (for the
    /// checks; the launcher takes it by itself where it applies).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_experts_f16(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        plan: &RoutePlan,
        k: usize,
        shared_input: bool,
        y: u64,
        slot: &F16Slot,
    ) -> Result<(), CudaError> {
        if plan.n_pairs() == 0 {
            return Ok(());
        }
        let k_div = self.exp_f16_inputs(&[m], xq, plan, k, shared_input, slot)?;
        self.launch_exp_f16(m, plan, k_div, xq.cols, y, slot)
    }

    /// Gate and up ([`Launcher::matmul_experts_f16`] with a shared input row per token)
    /// over one conversion of the activations.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_experts_f16_pair(
        &self,
        (gate, y_gate): (&DeviceMatrix, u64),
        (up, y_up): (&DeviceMatrix, u64),
        xq: &QuantAct,
        plan: &RoutePlan,
        k: usize,
        slot: &F16Slot,
    ) -> Result<(), CudaError> {
        if plan.n_pairs() == 0 {
            return Ok(());
        }
        let k_div = self.exp_f16_inputs(&[gate, up], xq, plan, k, true, slot)?;
        self.launch_exp_f16(gate, plan, k_div, xq.cols, y_gate, slot)?;
        self.launch_exp_f16(up, plan, k_div, xq.cols, y_up, slot)
    }

    /// Checks the stacks `ms` against `xq`, `plan` and `slot`, then writes the fp16
    /// activations and their token scales into `slot`; the input row divisor k_div.
    fn exp_f16_inputs(
        &self,
        ms: &[&DeviceMatrix],
        xq: &QuantAct,
        plan: &RoutePlan,
        k: usize,
        shared_input: bool,
        slot: &F16Slot,
    ) -> Result<i32, CudaError> {
        if !self.has_wgmma() {
            return Err(invalid(
                "matmul_experts_f16: needs sm_90a machine code on a 9.0 GPU".into(),
            ));
        }
        if shared_input && k == 0 {
            return Err(invalid("matmul_experts_f16: k = 0".into()));
        }
        let n = plan.n_pairs();
        let in_rows = if shared_input { n.div_ceil(k) } else { n };
        for m in ms {
            if let Some(why) = unfit(m, xq, in_rows, slot) {
                return Err(invalid(format!("matmul_experts_f16: {why}")));
            }
            if plan.n_expert > m.n_mats {
                return Err(invalid(format!(
                    "matmul_experts_f16: {} experts of a stack of {}",
                    plan.n_expert, m.n_mats
                )));
            }
        }
        let (x16, ts) = (self.ptr(&slot.x), self.ptr(&slot.scale));
        let (xqp, xdp, xcols) = (self.ptr(&xq.q), self.ptr(&xq.d), xq.cols as i32);
        launch!(self, "q8act_to_f16_perm", per_token(in_rows); xqp, xdp, x16, ts, xcols)?;
        Ok(if shared_input { k as i32 } else { 1 })
    }

    /// `mm_exp_f16_<ty>` of `m` over the plan's items and the fp16 activations in `slot`
    /// (rows `x_tok` halves apart), checked by [`Launcher::exp_f16_inputs`].
    fn launch_exp_f16(
        &self,
        m: &DeviceMatrix,
        plan: &RoutePlan,
        k_div: i32,
        x_tok: usize,
        y: u64,
        slot: &F16Slot,
    ) -> Result<(), CudaError> {
        let name = match (m.ty == GgmlType::IQ2_XXS, self.on(Variant::ExpF16Qs)) {
            (true, true) => "mm_exp_f16_iq2_xxs_qs",
            (true, false) => "mm_exp_f16_iq2_xxs",
            (false, true) => "mm_exp_f16_q2_k_qs",
            (false, false) => "mm_exp_f16_q2_k",
        };
        let smem = smem(m.ty);
        self.allow_smem(name, smem)?;
        let (w, mats) = self.exp_parts(m);
        let grid_tab = self.ptr(&self.iq2_grid);
        let (items, n_items, pairs) = (
            self.ptr(&plan.items),
            self.ptr(&plan.n_items),
            self.ptr(&plan.pairs),
        );
        let (x16, ts) = (self.ptr(&slot.x), self.ptr(&slot.scale));
        let cfg = LaunchConfig {
            grid_dim: (
                (m.rows / 128) as u32,
                max_items(plan.n_pairs(), plan.n_expert, plan.tile) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (rows, cols) = (m.rows as i32, m.cols as i32);
        let (x_tok, y_tok) = (x_tok as i64, m.rows as i64);
        let [w0, w1, w2] = w;
        let [m0, m1, m2] = mats;
        // The plan's items index pairs < n_pairs whose rows are < in_rows (checked).
        launch!(self, name, cfg;
            w0, w1, w2, m0, m1, m2, grid_tab, x16, ts, y, rows, cols, items, n_items, pairs,
            k_div, x_tok, y_tok
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_blocks_fit_an_sm() {
        // 228 KB an SM, 1 KB reserved a block, 1,280 bytes of static shared memory.
        for ty in [GgmlType::IQ2_XXS, GgmlType::Q2_K] {
            assert!(2 * (smem(ty) + 1024 + 1280) <= 228 * 1024, "{ty}");
        }
    }
}
