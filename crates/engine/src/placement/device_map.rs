//! `--device-map GPU:LAYERS[,GPU:LAYERS...]` (issue 23): the layer split given by hand,
//! the alternative to `--gpus`' automatic one ([`super::split_layers`]). The syntax is
//! checked when the flag is parsed; the coverage (every layer once, in stage order) only
//! once the model is open and its layer count known ([`DeviceMap::check`]); the memory
//! when planning ([`plan_device_map`]), where each stage offloads its own last layers'
//! experts as [`super::plan_split`]'s stages do, or is refused naming the stage.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use super::{gib, stage_placement, MemoryNeeds, Offload, PlanError, Stage};

/// A parsed `--device-map`: one `(device ordinal, layers)` per stage, in the order
/// given (the order the stages run in). Every range is non-empty and no device
/// appears twice; whether the ranges cover a model is [`DeviceMap::check`]'s question.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMap(Vec<(usize, Range<usize>)>);

/// What a malformed entry is told to look like.
const EXAMPLE: &str = "GPU:LAYERS entries like 0:0-20,1:21-42";

/// Parses `--device-map 0:0-20,1:21-42`: comma-separated `GPU:LAYERS` entries, LAYERS
/// an inclusive range `a-b` or one layer `a`; a GPU at most once.
pub fn parse_device_map(s: &str) -> Result<DeviceMap, String> {
    let bad = |part: &str| match part.trim() {
        "" => format!("--device-map takes {EXAMPLE} (not an empty entry)"),
        p => format!("--device-map takes {EXAMPLE} (`{p}` is not one)"),
    };
    let number = |t: &str, part: &str| t.trim().parse::<usize>().map_err(|_| bad(part));
    let mut out: Vec<(usize, Range<usize>)> = Vec::new();
    for part in s.split(',') {
        let (gpu, layers) = part.split_once(':').ok_or_else(|| bad(part))?;
        let gpu = number(gpu, part)?;
        let (first, last) = match layers.split_once('-') {
            Some((a, b)) => (number(a, part)?, number(b, part)?),
            None => {
                let a = number(layers, part)?;
                (a, a)
            }
        };
        if first > last {
            return Err(format!(
                "--device-map {}: layers {first}-{last} run backwards (write {last}-{first})",
                part.trim()
            ));
        }
        let end = last
            .checked_add(1)
            .ok_or_else(|| format!("--device-map {}: layer {last} is too large", part.trim()))?;
        if out.iter().any(|(d, _)| *d == gpu) {
            return Err(format!(
                "--device-map names GPU {gpu} twice (a GPU holds one range of layers)"
            ));
        }
        out.push((gpu, first..end));
    }
    Ok(DeviceMap(out))
}

impl FromStr for DeviceMap {
    type Err = String;

    fn from_str(s: &str) -> Result<DeviceMap, String> {
        parse_device_map(s)
    }
}

impl fmt::Display for DeviceMap {
    /// The flag's own syntax (it parses back to the same map).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (gpu, r)) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            // Ranges are never empty (the parser and `even` make only non-empty ones).
            if r.len() == 1 {
                write!(f, "{sep}{gpu}:{}", r.start)?;
            } else {
                write!(f, "{sep}{gpu}:{}-{}", r.start, r.end - 1)?;
            }
        }
        Ok(())
    }
}

impl DeviceMap {
    /// The stages: device ordinal and layers, in order.
    pub fn entries(&self) -> &[(usize, Range<usize>)] {
        &self.0
    }

    /// The devices, in stage order.
    pub fn gpus(&self) -> Vec<usize> {
        self.0.iter().map(|(d, _)| *d).collect()
    }

    /// The number of stages.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the map has no stage (the parser never returns one).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `n_layer` layers cut into equal runs over `gpus` (the first ones take one more
    /// when they do not divide evenly; at most one GPU per layer): the map the errors
    /// suggest. Layer counts alone, since the free memory is not known when the
    /// coverage is checked.
    pub fn even(gpus: &[usize], n_layer: usize) -> DeviceMap {
        let k = gpus.len().min(n_layer);
        let mut out = Vec::with_capacity(k);
        let mut start = 0;
        for (i, &gpu) in gpus[..k].iter().enumerate() {
            let len = n_layer / k + usize::from(i < n_layer % k);
            out.push((gpu, start..start + len));
            start += len;
        }
        DeviceMap(out)
    }

    /// Whether the stages cover layers `0..n_layer` once each, in order: the first
    /// starts at 0, each starts where the one before ended, the last ends at the last
    /// layer. The error names what is wrong (stages out of layer order, layers on no
    /// GPU or on two, layers past the model) and a map over the same GPUs that is
    /// right for this model.
    pub fn check(&self, n_layer: usize) -> Result<(), PlanError> {
        let mut problems = Vec::new();
        let mut sorted = self.0.clone();
        sorted.sort_by_key(|(_, r)| r.start);
        if sorted != self.0 {
            problems.push(format!(
                "the stages run in the order given, so list them in layer order (as in \
                 {})",
                DeviceMap(sorted.clone())
            ));
        }
        // The coverage, whatever the order: gaps and overlaps in layer order.
        let (mut covered, mut owner) = (0usize, None::<usize>);
        for (gpu, r) in &sorted {
            if r.start > covered {
                let gap = covered..r.start;
                problems.push(format!("{} {} on no GPU", span(&gap), is_are(&gap)));
            } else if r.start < covered {
                let both = r.start..r.end.min(covered);
                let other = owner.map_or(String::new(), |o| format!("GPU {o} and "));
                problems.push(format!(
                    "{} {} on both {other}GPU {gpu}",
                    span(&both),
                    is_are(&both)
                ));
            }
            if r.end > n_layer {
                problems.push(format!(
                    "GPU {gpu}'s {} go past the model's last layer ({})",
                    span(r),
                    n_layer.saturating_sub(1)
                ));
            }
            if r.end > covered {
                (covered, owner) = (r.end, Some(*gpu));
            }
        }
        if covered < n_layer {
            let gap = covered..n_layer;
            problems.push(format!("{} {} on no GPU", span(&gap), is_are(&gap)));
        }
        if n_layer == 0 {
            problems.push("the model has no layers".to_string());
        }
        if problems.is_empty() {
            return Ok(());
        }
        let mut why = format!(
            "--device-map {self} does not cover this model's {n_layer} layers (0–{}) once \
             each, in order: {}",
            n_layer.saturating_sub(1),
            problems.join("; ")
        );
        if n_layer > 0 && !self.is_empty() {
            why += &format!(
                ". A map over the same GPUs that does: --device-map {}",
                DeviceMap::even(&self.gpus(), n_layer)
            );
        }
        Err(PlanError::DeviceMap(why))
    }
}

/// "layer 4" or "layers 4–9" (a non-empty range).
fn span(r: &Range<usize>) -> String {
    if r.len() == 1 {
        format!("layer {}", r.start)
    } else {
        format!("layers {}–{}", r.start, r.end.saturating_sub(1))
    }
}

/// The verb that goes with [`span`].
fn is_are(r: &Range<usize>) -> &'static str {
    if r.len() == 1 {
        "is"
    } else {
        "are"
    }
}

/// The split `map` asks for, on devices with `free` bytes (one per stage, in map
/// order): each stage takes its layers and, with `Offload::Auto`, offloads the
/// embedding and its own last layers' experts as its card needs; `Layers(N)` offloads
/// the model's last N layers' experts wherever they run (and every stage's embedding
/// when N > 0) and `Layers(0)` never. A stage that does not fit is refused with
/// [`PlanError::StageDoesNotFit`], naming it, its GPU and what is missing.
pub fn plan_device_map(
    needs: &MemoryNeeds,
    map: &DeviceMap,
    free: &[u64],
    offload: Offload,
) -> Result<Vec<Stage>, PlanError> {
    let n_layer = needs.layers.len();
    map.check(n_layer)?;
    if free.len() != map.len() {
        return Err(PlanError::Split(format!(
            "--device-map has {} stages but {} GPUs were measured",
            map.len(),
            free.len()
        )));
    }
    if let Offload::Layers(n) = offload {
        if n > n_layer {
            return Err(PlanError::TooManyLayers { asked: n, n_layer });
        }
    }
    let mut stages = Vec::with_capacity(map.len());
    for (i, ((gpu, r), f)) in map.0.iter().zip(free).enumerate() {
        let placement = stage_placement(needs, r, *f, offload).map_err(|e| match e {
            PlanError::DoesNotFit {
                need,
                free,
                choice,
                all_offloaded,
            } => PlanError::StageDoesNotFit {
                stage: i,
                gpu: *gpu,
                layers: r.clone(),
                need,
                free,
                choice,
                all_offloaded,
            },
            other => other,
        })?;
        stages.push(Stage {
            layers: r.clone(),
            placement,
        });
    }
    Ok(stages)
}

/// `layers a–b`, or `layer a` for a stage of one layer.
fn layer_span(r: &std::ops::Range<usize>) -> String {
    match r.len() {
        1 => format!("layer {}", r.start),
        _ => format!("layers {}–{}", r.start, r.end.saturating_sub(1)),
    }
}

/// The startup line of a split: per stage its layers, its GPU (`gpus`: ordinal and
/// name, in stage order) and, where it offloads, what went to host memory
/// ([`super::Placement::describe`] on the stage's share of `free`); led by the map when
/// the split came from `--device-map`.
pub fn describe_split(
    needs: &MemoryNeeds,
    stages: &[Stage],
    gpus: &[(usize, String)],
    free: &[u64],
    map: Option<&DeviceMap>,
) -> String {
    let parts: Vec<String> = (stages.iter().zip(gpus).zip(free))
        .map(|((s, (d, name)), f)| {
            let r = &s.layers;
            let mut part = format!("{} on GPU {d} ({name})", layer_span(r));
            if s.placement.offloads() {
                part += &format!(" with {}", s.placement.describe(&needs.stage(r), *f));
            }
            part
        })
        .collect();
    match map {
        Some(m) => format!("--device-map {m}: {}", parts.join(", ")),
        None => parts.join(", "),
    }
}

impl fmt::Display for StageShort<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let StageShort {
            stage,
            gpu,
            layers,
            need,
            free,
            choice,
            all_offloaded,
        } = *self;
        write!(
            f,
            "--device-map stage {} (layers {}–{} on GPU {gpu}) needs {:.2} GiB there but \
             {:.2} GiB are free ({:.2} GiB short)",
            stage + 1,
            layers.start,
            layers.end.saturating_sub(1),
            gib(need),
            gib(free),
            gib(need.saturating_sub(free))
        )?;
        let fewer = format!("give GPU {gpu} fewer layers");
        match (choice, all_offloaded) {
            (_, true) => write!(
                f,
                " even with the embedding and all its layers' experts in host memory: \
                 {fewer}, or use a smaller --ctx"
            ),
            (Offload::Layers(0), false) => write!(
                f,
                " with --offload-experts 0: let it keep its last layers' experts in host \
                 memory (--offload-experts auto), {fewer}, or use a smaller --ctx"
            ),
            (Offload::Layers(n), false) => write!(
                f,
                " with --offload-experts {n}: offload more layers (--offload-experts auto \
                 picks them per stage), {fewer}, or use a smaller --ctx"
            ),
            (Offload::Auto, false) => write!(f, ": {fewer}, or use a smaller --ctx"),
        }
    }
}

/// The fields of [`PlanError::StageDoesNotFit`], borrowed for its message.
pub(super) struct StageShort<'a> {
    pub stage: usize,
    pub gpu: usize,
    pub layers: &'a Range<usize>,
    pub need: u64,
    pub free: u64,
    pub choice: Offload,
    pub all_offloaded: bool,
}

#[cfg(test)]
#[path = "device_map_tests.rs"]
mod tests;
