//! The IQ2_XXS grid search: the grid point `g` (8 magnitudes, each 8, 25 or 43) that
//! minimises `Σ w_j (m·g_j − t_j)²` for 8 targets `t` at multiplier `m`.
//!
//! Searching all 256 points for every 8 values is too slow for a full model (hundreds
//! of millions of blocks, each searched ~50 times), so, as llama.cpp's `iq2xxs` init
//! does, each target is first rounded to its nearest magnitude: when that 8-tuple is a
//! grid point it is the exact optimum (the error is separable and the weights positive);
//! otherwise only the grid points nearest to the tuple (those at its `NEAREST + 1`
//! smallest distinct distances, 33 on average instead of 256) are evaluated exactly.
//! On random targets and weights that finds the exhaustive optimum 99% of the time and
//! loses 0.1% of the error overall (the test below).

use std::sync::OnceLock;

use super::iq2xxs_grid::IQ2XXS_GRID;

/// The 3 magnitudes and the rounding thresholds between them.
const LEVELS: [f32; 3] = [8.0, 25.0, 43.0];
/// Off-grid tuples keep the grid points at their `NEAREST + 1` smallest distances.
const NEAREST: usize = 8;

/// For each of the 3^8 rounded tuples, the candidate grid indices (`start..end` into
/// `cands`).
struct Table {
    ranges: Vec<(u32, u32)>,
    cands: Vec<u8>,
}

fn table() -> &'static Table {
    static T: OnceLock<Table> = OnceLock::new();
    T.get_or_init(|| {
        let grid: Vec<[u8; 8]> = IQ2XXS_GRID.iter().map(|g| g.to_le_bytes()).collect();
        let mut ranges = Vec::with_capacity(6561);
        let mut cands = Vec::new();
        for code in 0..6561u32 {
            let mut c = code;
            let mut v = [0u8; 8];
            for vj in &mut v {
                *vj = LEVELS[(c % 3) as usize] as u8;
                c /= 3;
            }
            let start = cands.len() as u32;
            if let Some(i) = grid.iter().position(|g| *g == v) {
                cands.push(i as u8);
            } else {
                let d: Vec<u32> = grid
                    .iter()
                    .map(|g| {
                        (0..8)
                            .map(|j| (g[j] as i32 - v[j] as i32).pow(2) as u32)
                            .sum()
                    })
                    .collect();
                let mut ds: Vec<u32> = d.clone();
                ds.sort_unstable();
                ds.dedup();
                let limit = ds[NEAREST.min(ds.len() - 1)];
                cands.extend((0..256).filter(|&i| d[i] <= limit).map(|i| i as u8));
            }
            ranges.push((start, cands.len() as u32));
        }
        Table { ranges, cands }
    })
}

#[inline]
fn level(u: f32) -> u32 {
    if u < 16.5 {
        0
    } else if u < 34.0 {
        1
    } else {
        2
    }
}

#[inline]
fn err(m: f32, g: u64, t: &[f32; 8], w: &[f32; 8]) -> f32 {
    let gb = g.to_le_bytes();
    let mut e = 0.0f32;
    for j in 0..8 {
        let d = m * gb[j] as f32 - t[j];
        e += w[j] * d * d;
    }
    e
}

/// The best grid point for `t` at `m > 0` and its weighted squared error.
pub(super) fn best_grid(m: f32, t: &[f32; 8], w: &[f32; 8]) -> (u8, f32) {
    let tab = table();
    let inv = 1.0 / m;
    let mut code = 0u32;
    for j in (0..8).rev() {
        code = code * 3 + level(t[j] * inv);
    }
    let (a, b) = tab.ranges[code as usize];
    let mut best = (0u8, f32::INFINITY);
    for &i in &tab.cands[a as usize..b as usize] {
        let e = err(m, IQ2XXS_GRID[i as usize], t, w);
        if e < best.1 {
            best = (i, e);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exhaustive(m: f32, t: &[f32; 8], w: &[f32; 8]) -> (u8, f32) {
        let mut best = (0u8, f32::INFINITY);
        for (i, &g) in IQ2XXS_GRID.iter().enumerate() {
            let e = err(m, g, t, w);
            if e < best.1 {
                best = (i as u8, e);
            }
        }
        best
    }

    #[test]
    fn grid_points_are_found_exactly() {
        let w = [1.0; 8];
        for (i, g) in IQ2XXS_GRID.iter().enumerate() {
            let t: [f32; 8] = g.to_le_bytes().map(|b| b as f32 * 0.01);
            assert_eq!(best_grid(0.01, &t, &w).0 as usize, i);
        }
    }

    #[test]
    fn close_to_the_exhaustive_search() {
        // A simple LCG: no dependency, fixed sequence.
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut r = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32
        };
        let (mut fast, mut full, mut exact) = (0.0f64, 0.0f64, 0usize);
        let n = 20_000;
        for _ in 0..n {
            let t: [f32; 8] = std::array::from_fn(|_| r() * 0.5);
            let w: [f32; 8] = std::array::from_fn(|_| 0.1 + r());
            let m = 0.004 + 0.01 * r();
            let (a, b) = (best_grid(m, &t, &w), exhaustive(m, &t, &w));
            assert!(a.1 >= b.1);
            exact += (a.1 == b.1) as usize;
            fast += a.1 as f64;
            full += b.1 as f64;
        }
        // The pruned search finds the optimum almost always and loses little otherwise.
        println!("{exact}/{n} optimal, error {:.4} of the exhaustive search, {:.1} candidates on average", fast / full, table().cands.len() as f64 / 6561.0);
        assert!(exact as f64 > 0.97 * n as f64, "{exact}/{n}");
        assert!(fast < 1.005 * full, "{fast} vs {full}");
    }
}
