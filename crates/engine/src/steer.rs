//! Directional steering (docs/architecture.md §8 item 17, the reference's
//! `dir-steering/`): a flat little-endian f32 file of one `n_embd`-wide direction per
//! layer (`[n_layer][n_embd]`, 43 × 4096 for DeepSeek V4 Flash). After a layer's
//! attention output (the output projection's result, before the hyper-connection post)
//! and/or its FFN output (routed experts' weighted sum plus the shared expert, before
//! the post), every token row `y` becomes
//!
//! ```text
//! y ← y − scale · d · (d · y)
//! ```
//!
//! with `d` the layer's direction: a positive scale removes the direction, a negative
//! one amplifies it. The directions are used as stored, like the reference (which
//! expects normalized ones and does not normalize on load); `ds4-tool steer build`
//! writes normalized directions. A scale of 0 skips the work entirely, so the output is
//! bit-identical to no steering.

use std::path::{Path, PathBuf};

use crate::error::{EngineError, Result};

/// The activation a direction edits (and `ds4-tool steer build` records).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Component {
    /// The attention sublayer's output projection, before hc_post.
    AttnOut,
    /// The FFN sublayer's routed + shared output, before hc_post.
    FfnOut,
}

impl Component {
    /// `attn_out` or `ffn_out` (the reference's dump names).
    pub fn name(self) -> &'static str {
        match self {
            Component::AttnOut => "attn_out",
            Component::FfnOut => "ffn_out",
        }
    }
}

impl std::str::FromStr for Component {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Component, String> {
        match s {
            "attn_out" => Ok(Component::AttnOut),
            "ffn_out" => Ok(Component::FfnOut),
            _ => Err(format!(
                "unknown component `{s}` (valid: ffn_out, attn_out)"
            )),
        }
    }
}

/// Steering directions and their scales.
#[derive(Clone, Debug, PartialEq)]
pub struct Steering {
    /// `[n_layer][n_embd]` directions.
    pub dirs: Vec<f32>,
    pub n_layer: usize,
    pub n_embd: usize,
    /// Scale after each FFN output (the reference's default with a file: 1).
    pub ffn: f32,
    /// Scale after each attention output (default 0: off).
    pub attn: f32,
    /// The file the directions came from, for messages.
    pub source: Option<PathBuf>,
}

impl Steering {
    /// The reference's defaults with a file: FFN 1, attention 0.
    pub const DEFAULT_FFN: f32 = 1.0;
    pub const DEFAULT_ATTN: f32 = 0.0;

    /// Directions `dirs` (`[n_layer][n_embd]`) with the given scales; refuses a wrong
    /// length, non-finite values or non-finite scales.
    pub fn new(
        dirs: Vec<f32>,
        n_layer: usize,
        n_embd: usize,
        ffn: f32,
        attn: f32,
    ) -> Result<Steering> {
        let want = n_layer * n_embd;
        if dirs.len() != want {
            return Err(EngineError::Invalid(format!(
                "steering directions: {} values, expected {n_layer} × {n_embd} = {want}",
                dirs.len()
            )));
        }
        if let Some(i) = dirs.iter().position(|v| !v.is_finite()) {
            return Err(EngineError::Invalid(format!(
                "steering directions: value {i} (layer {}, dim {}) is {}",
                i / n_embd.max(1),
                i % n_embd.max(1),
                dirs[i]
            )));
        }
        for (name, s) in [("ffn", ffn), ("attn", attn)] {
            if !s.is_finite() {
                return Err(EngineError::Invalid(format!(
                    "steering {name} scale must be finite, got {s}"
                )));
            }
        }
        Ok(Steering {
            dirs,
            n_layer,
            n_embd,
            ffn,
            attn,
            source: None,
        })
    }

    /// Reads the flat little-endian f32 file at `path`, which must hold exactly
    /// `n_layer × n_embd` finite values.
    pub fn load(
        path: &Path,
        n_layer: usize,
        n_embd: usize,
        ffn: f32,
        attn: f32,
    ) -> Result<Steering> {
        let bytes = std::fs::read(path).map_err(|e| {
            EngineError::Invalid(format!("cannot read steering file {}: {e}", path.display()))
        })?;
        let want = (n_layer * n_embd * 4) as u64;
        if bytes.len() as u64 != want {
            return Err(EngineError::Invalid(format!(
                "steering file {}: {} bytes, expected {want} ({n_layer} layers × {n_embd} f32)",
                path.display(),
                bytes.len()
            )));
        }
        let dirs: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let mut s = Steering::new(dirs, n_layer, n_embd, ffn, attn)
            .map_err(|e| EngineError::Invalid(format!("steering file {}: {e}", path.display())))?;
        s.source = Some(path.to_path_buf());
        Ok(s)
    }

    /// Checks the shape against the model's.
    pub fn check_shape(&self, n_layer: usize, n_embd: usize) -> Result<()> {
        if (self.n_layer, self.n_embd) != (n_layer, n_embd) {
            let from = match &self.source {
                Some(p) => format!(" ({})", p.display()),
                None => String::new(),
            };
            return Err(EngineError::Invalid(format!(
                "steering directions{from} are {} × {}, the model needs {n_layer} × {n_embd}",
                self.n_layer, self.n_embd
            )));
        }
        Ok(())
    }

    /// Whether any scale is nonzero (otherwise steering is skipped entirely).
    pub fn active(&self) -> bool {
        self.ffn != 0.0 || self.attn != 0.0
    }

    /// Layer `il`'s direction.
    pub fn dir(&self, il: usize) -> &[f32] {
        &self.dirs[il * self.n_embd..(il + 1) * self.n_embd]
    }

    /// The scale of `c`.
    pub fn scale(&self, c: Component) -> f32 {
        match c {
            Component::AttnOut => self.attn,
            Component::FfnOut => self.ffn,
        }
    }

    /// Applies the `c` edit of layer `il` to the token rows `x` (`[n][n_embd]`); a
    /// no-op at scale 0 and for layers beyond the file (the MTP block).
    pub fn apply(&self, c: Component, il: usize, x: &mut [f32]) {
        let scale = self.scale(c);
        if scale == 0.0 || il >= self.n_layer {
            return;
        }
        project_rows(x, self.dir(il), scale);
    }
}

/// `y ← y − scale·d·(d·y)` for every row `y` of `x` (rows of `d.len()`), with the
/// reference's arithmetic: an f32 dot summed in order, then `y[i] −= (scale·dot)·d[i]`.
pub fn project_rows(x: &mut [f32], d: &[f32], scale: f32) {
    for row in x.chunks_exact_mut(d.len()) {
        let dot = row.iter().zip(d).fold(0.0f32, |acc, (a, b)| acc + a * b);
        let coeff = scale * dot;
        for (v, di) in row.iter_mut().zip(d) {
            *v -= coeff * di;
        }
    }
}

/// Forms directions from paired prompt activations as the reference's
/// `dir-steering/tools/build_direction.py` does: per layer, the mean of the "good"
/// rows minus the mean of the "bad" rows (f64 sums), normalized; by default then made
/// orthogonal to the normalized bad mean and normalized again (so steering does not
/// scale the common activation). Each prompt contributes one row per layer (the
/// reference takes its last token).
#[derive(Clone, Debug)]
pub struct DirectionBuilder {
    n_layer: usize,
    n_embd: usize,
    sums: [Vec<f64>; 2],
    counts: [usize; 2],
}

/// Per layer, what [`DirectionBuilder::finish`] found (for the JSON sidecar).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerStat {
    /// |mean good − mean bad| before normalization.
    pub diff_norm: f64,
    /// |mean good| and |mean bad|.
    pub good_norm: f64,
    pub bad_norm: f64,
    /// Cosine of the raw difference with the bad mean (what orthogonalization removes).
    pub cos_bad: f64,
}

impl DirectionBuilder {
    pub fn new(n_layer: usize, n_embd: usize) -> DirectionBuilder {
        let z = vec![0.0f64; n_layer * n_embd];
        DirectionBuilder {
            n_layer,
            n_embd,
            sums: [z.clone(), z],
            counts: [0, 0],
        }
    }

    /// Adds one prompt's rows (`[n_layer][n_embd]`) to the good or the bad set.
    pub fn add(&mut self, good: bool, rows: &[f32]) {
        assert_eq!(rows.len(), self.n_layer * self.n_embd, "one row per layer");
        let i = usize::from(!good);
        for (s, &v) in self.sums[i].iter_mut().zip(rows) {
            *s += v as f64;
        }
        self.counts[i] += 1;
    }

    /// Prompts added to the (good, bad) sets.
    pub fn counts(&self) -> (usize, usize) {
        (self.counts[0], self.counts[1])
    }

    /// The normalized directions (`[n_layer][n_embd]`) and per-layer statistics; an
    /// error when a set is empty.
    pub fn finish(&self, orthogonalize: bool) -> Result<(Vec<f32>, Vec<LayerStat>)> {
        if self.counts.contains(&0) {
            return Err(EngineError::Invalid(format!(
                "a direction needs good and bad prompts ({} good, {} bad)",
                self.counts[0], self.counts[1]
            )));
        }
        let e = self.n_embd;
        let mut dirs = Vec::with_capacity(self.n_layer * e);
        let mut stats = Vec::with_capacity(self.n_layer);
        for il in 0..self.n_layer {
            let mean = |i: usize| -> Vec<f64> {
                let n = self.counts[i] as f64;
                self.sums[i][il * e..(il + 1) * e]
                    .iter()
                    .map(|v| v / n)
                    .collect()
            };
            let (good, bad) = (mean(0), mean(1));
            let diff: Vec<f64> = good.iter().zip(&bad).map(|(g, b)| g - b).collect();
            let base = normalize(&bad);
            let diff_norm = norm(&diff);
            let mut d = normalize(&diff);
            let cos_bad = dot(&d, &base);
            if orthogonalize {
                let p = dot(&d, &base);
                d = normalize(
                    &d.iter()
                        .zip(&base)
                        .map(|(x, b)| x - p * b)
                        .collect::<Vec<_>>(),
                );
            }
            dirs.extend(d.iter().map(|&v| v as f32));
            stats.push(LayerStat {
                diff_norm,
                good_norm: norm(&good),
                bad_norm: norm(&bad),
                cos_bad,
            });
        }
        Ok((dirs, stats))
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn norm(a: &[f64]) -> f64 {
    dot(a, a).sqrt()
}

/// `a / |a|`; a zero vector stays zero (as the reference's `normalize`).
fn normalize(a: &[f64]) -> Vec<f64> {
    let n = norm(a);
    if n > 0.0 {
        a.iter().map(|v| v / n).collect()
    } else {
        a.to_vec()
    }
}

/// Writes directions as the flat little-endian f32 file [`Steering::load`] reads.
pub fn write_dirs(path: &Path, dirs: &[f32]) -> std::io::Result<()> {
    let bytes: Vec<u8> = dirs.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(n: usize, i: usize) -> Vec<f32> {
        let mut v = vec![0.0; n];
        v[i] = 1.0;
        v
    }

    #[test]
    fn projection_removes_or_amplifies_the_direction() {
        let d = {
            let mut d = vec![3.0f32, 4.0, 0.0, 0.0];
            let n = 5.0;
            d.iter_mut().for_each(|v| *v /= n);
            d
        };
        let y = vec![1.0f32, 2.0, 3.0, -1.0];
        let dot = |a: &[f32]| a.iter().zip(&d).map(|(x, y)| x * y).sum::<f32>();
        let mut removed = y.clone();
        project_rows(&mut removed, &d, 1.0);
        assert!(dot(&removed).abs() < 1e-6, "{removed:?}");
        // The orthogonal part is untouched.
        assert_eq!(&removed[2..], &y[2..]);
        let mut doubled = y.clone();
        project_rows(&mut doubled, &d, -1.0);
        assert!((dot(&doubled) - 2.0 * dot(&y)).abs() < 1e-5);
        let mut same = y.clone();
        Steering::new(d.repeat(2), 2, 4, 0.0, 0.0)
            .unwrap()
            .apply(Component::FfnOut, 0, &mut same);
        assert_eq!(same, y);
    }

    #[test]
    fn a_file_of_the_wrong_size_or_with_nan_is_refused() {
        let dir = std::env::temp_dir().join(format!("ds4-steer-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.f32");
        let dirs: Vec<f32> = [unit(4, 0), unit(4, 1), unit(4, 2)].concat();
        write_dirs(&good, &dirs).unwrap();
        let s = Steering::load(&good, 3, 4, 1.0, 0.0).unwrap();
        assert_eq!(s.dir(1), &unit(4, 1)[..]);
        let e = Steering::load(&good, 4, 4, 1.0, 0.0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("good.f32") && e.contains("48 bytes") && e.contains("64"),
            "{e}"
        );
        let nan = dir.join("nan.f32");
        let mut bad = dirs.clone();
        bad[5] = f32::NAN;
        write_dirs(&nan, &bad).unwrap();
        let e = Steering::load(&nan, 3, 4, 1.0, 0.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("nan.f32") && e.contains("layer 1"), "{e}");
        assert!(Steering::new(dirs.clone(), 3, 4, f32::INFINITY, 0.0).is_err());
        assert!(s.check_shape(3, 4).is_ok());
        assert!(s
            .check_shape(43, 4096)
            .unwrap_err()
            .to_string()
            .contains("good.f32"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn built_directions_are_unit_mean_differences_orthogonal_to_the_bad_mean() {
        let mut b = DirectionBuilder::new(2, 3);
        // Layer 0: good (2,1,0) and (4,1,0), bad (0,1,0): diff (3,0,0), bad mean ⟂ it.
        // Layer 1: good (1,1,0), bad (1,0,0): diff (0,1,0).
        b.add(true, &[2.0, 1.0, 0.0, 1.0, 1.0, 0.0]);
        b.add(true, &[4.0, 1.0, 0.0, 1.0, 1.0, 0.0]);
        b.add(false, &[0.0, 1.0, 0.0, 1.0, 0.0, 0.0]);
        assert_eq!(b.counts(), (2, 1));
        let (d, st) = b.finish(true).unwrap();
        assert_eq!(d, vec![1.0, 0.0, 0.0, 0.0, 1.0, 0.0]);
        assert!((st[0].diff_norm - 3.0).abs() < 1e-12);
        assert!(st[0].cos_bad.abs() < 1e-12);
        // Not orthogonal to the bad mean: the projection is removed only when asked.
        let mut b = DirectionBuilder::new(1, 2);
        b.add(true, &[2.0, 1.0]);
        b.add(false, &[1.0, 0.0]);
        let (raw, st) = b.finish(false).unwrap();
        let s = 0.5f32.sqrt();
        assert!(
            (raw[0] - s).abs() < 1e-6 && (raw[1] - s).abs() < 1e-6,
            "{raw:?}"
        );
        assert!((st[0].cos_bad - 0.5f64.sqrt()).abs() < 1e-12);
        let (orth, _) = b.finish(true).unwrap();
        assert_eq!(orth, vec![0.0, 1.0]);
        assert!(DirectionBuilder::new(1, 2).finish(true).is_err());
    }

    #[test]
    fn components_parse() {
        assert_eq!("ffn_out".parse(), Ok(Component::FfnOut));
        assert_eq!("attn_out".parse(), Ok(Component::AttnOut));
        assert!("ffn".parse::<Component>().is_err());
    }
}
