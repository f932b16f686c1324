//! Where the weights go when the model does not fit the card (issue 23, architecture.md
//! §4.1): the memory planner. Pure arithmetic over byte counts, so every decision is
//! tested on the CPU; the CUDA upload follows the [`Placement`] it returns.
//!
//! The q2 file is 80.76 GiB and an 80 GB card offers ~79 GiB, so the planner moves, in
//! order of what they cost a decode token:
//! 1. the token embedding (1 GiB F16): a token reads one 8 KiB row of it, so in mapped
//!    host memory it costs nothing measurable;
//! 2. the routed experts of whole layers, from the last layer down: a token reads its 6
//!    selected experts of such a layer across the bus (~42 MB at the Flash shape, ~1 ms
//!    on PCIe 5), and a prefill chunk the whole stack once (1.8 GB).
//!
//! Nothing else is worth moving: every other weight is read in full by every token.
//!
//! Over several GPUs the layers are split into stages, by room ([`split_layers`],
//! `--gpus`) or as `--device-map` says ([`device_map`]), and each stage plans its own
//! offload ([`plan_split`], [`plan_device_map`]).

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

mod device_map;
pub use device_map::{describe_split, parse_device_map, plan_device_map, DeviceMap};

/// `--offload-experts auto|N`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Offload {
    /// As many layers as the card needs (none when the model fits).
    #[default]
    Auto,
    /// Exactly the last N layers' experts (and the embedding when N > 0); 0 never
    /// offloads (and refuses a model that does not fit, as before).
    Layers(usize),
}

impl FromStr for Offload {
    type Err = String;

    fn from_str(s: &str) -> Result<Offload, String> {
        match s.trim() {
            "auto" => Ok(Offload::Auto),
            n => n.parse::<usize>().map(Offload::Layers).map_err(|_| {
                format!("--offload-experts takes `auto` or a number of layers, not `{s}`")
            }),
        }
    }
}

impl fmt::Display for Offload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Offload::Auto => f.write_str("auto"),
            Offload::Layers(n) => write!(f, "{n}"),
        }
    }
}

/// What the engine is asked to keep room for on the device (`EngineOptions::memory`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryOptions {
    pub offload: Offload,
    /// The context the first session will use (its KV and score buffers are reserved);
    /// 0: [`DEFAULT_PLAN_CTX`].
    pub ctx: usize,
    /// `--gpus`: the CUDA devices to split the layers over, in order. Empty: the
    /// backend's device, or every visible GPU when the model does not fit that one.
    pub gpus: Vec<usize>,
    /// `--device-map`: the GPUs and each one's layers, given by hand ([`DeviceMap`];
    /// not with `gpus`).
    pub device_map: Option<DeviceMap>,
}

impl Default for MemoryOptions {
    fn default() -> MemoryOptions {
        MemoryOptions {
            offload: Offload::Auto,
            ctx: 0,
            gpus: Vec::new(),
            device_map: None,
        }
    }
}

impl MemoryOptions {
    /// What can be checked against a model of `n_layer` layers before any device is
    /// opened (on every backend: a map that does not fit the model is a mistake even
    /// where it goes unused): `gpus` and `device_map` are not both given, and the map
    /// covers the layers.
    pub fn check(&self, n_layer: usize) -> Result<(), PlanError> {
        let Some(map) = &self.device_map else {
            return Ok(());
        };
        if !self.gpus.is_empty() {
            return Err(PlanError::DeviceMap(
                "--gpus and --device-map both choose the GPUs: pick one (--gpus splits the \
                 layers over the cards by their free memory, --device-map names each \
                 card's layers)"
                    .to_string(),
            ));
        }
        map.check(n_layer)
    }
}

/// The value of `--gpus` (a comma-separated list, parsed by [`parse_gpus`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuList(pub Vec<usize>);

impl FromStr for GpuList {
    type Err = String;

    fn from_str(s: &str) -> Result<GpuList, String> {
        parse_gpus(s).map(GpuList)
    }
}

/// Parses `--gpus 0,1,2`: distinct device ordinals, at least one.
pub fn parse_gpus(s: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in s.split(',') {
        let d = part
            .trim()
            .parse::<usize>()
            .map_err(|_| format!("--gpus takes device numbers like 0,1 (not `{s}`)"))?;
        if out.contains(&d) {
            return Err(format!("--gpus names device {d} twice"));
        }
        out.push(d);
    }
    Ok(out)
}

/// The context reserved when the caller does not say (the CLI's default `--ctx`).
pub const DEFAULT_PLAN_CTX: usize = 32_768;

/// The byte counts the planner decides from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryNeeds {
    /// Every tensor of the model file (device bytes equal file bytes: the upload's
    /// repacking keeps bytes per weight).
    pub weights: u64,
    /// The token embedding.
    pub embedding: u64,
    /// Per layer, its routed-expert stacks (gate, up and down of every expert).
    pub experts: Vec<u64>,
    /// Per layer, all its tensors (the experts included).
    pub layers: Vec<u64>,
    /// One session at the requested context with its prefill chunk's buffers.
    pub session: u64,
    /// What the driver, CUDA graphs and allocation granularity take besides.
    pub reserve: u64,
}

/// The planner's answer: what lives in mapped host memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Per layer: its routed experts are in host memory.
    pub experts_on_host: Vec<bool>,
    pub embedding_on_host: bool,
}

impl Placement {
    /// Everything on the device.
    pub fn resident(n_layer: usize) -> Placement {
        Placement {
            experts_on_host: vec![false; n_layer],
            embedding_on_host: false,
        }
    }

    /// Whether anything is offloaded.
    pub fn offloads(&self) -> bool {
        self.embedding_on_host || self.experts_on_host.iter().any(|&h| h)
    }

    /// Offloads no expert stack outside `layers` (a stage's placement: the other
    /// layers run on other GPUs).
    pub fn keep_layers(&mut self, layers: &Range<usize>) {
        for (il, h) in self.experts_on_host.iter_mut().enumerate() {
            *h &= layers.contains(&il);
        }
    }

    /// Layers whose experts are offloaded.
    pub fn offloaded_layers(&self) -> usize {
        self.experts_on_host.iter().filter(|&&h| h).count()
    }

    /// Bytes kept in host memory.
    pub fn host_bytes(&self, needs: &MemoryNeeds) -> u64 {
        let experts: u64 = (needs.experts.iter().zip(&self.experts_on_host))
            .filter(|(_, &h)| h)
            .map(|(b, _)| b)
            .sum();
        experts
            + if self.embedding_on_host {
                needs.embedding
            } else {
                0
            }
    }

    /// Weight bytes on the device.
    pub fn device_bytes(&self, needs: &MemoryNeeds) -> u64 {
        needs.weights.saturating_sub(self.host_bytes(needs))
    }

    /// Decides what goes where on a device with `free` bytes.
    pub fn plan(needs: &MemoryNeeds, free: u64, choice: Offload) -> Result<Placement, PlanError> {
        let n_layer = needs.experts.len();
        // Whether `p` leaves one session and the reserve free (not a saturated room: a
        // card smaller than the session alone fits nothing).
        let fits = |p: &Placement| p.device_bytes(needs) + needs.session + needs.reserve <= free;
        let mut p = Placement::resident(n_layer);
        match choice {
            Offload::Layers(0) => {}
            Offload::Layers(n) => {
                if n > n_layer {
                    return Err(PlanError::TooManyLayers { asked: n, n_layer });
                }
                p.embedding_on_host = true;
                for h in &mut p.experts_on_host[n_layer - n..] {
                    *h = true;
                }
            }
            Offload::Auto => {
                if !fits(&p) {
                    p.embedding_on_host = true;
                    for il in (0..n_layer).rev() {
                        if fits(&p) {
                            break;
                        }
                        p.experts_on_host[il] = true;
                    }
                }
            }
        }
        if !fits(&p) {
            return Err(PlanError::DoesNotFit {
                need: p.device_bytes(needs) + needs.session + needs.reserve,
                free,
                choice,
                all_offloaded: p.offloaded_layers() == n_layer,
            });
        }
        Ok(p)
    }

    /// The startup line: what went where.
    pub fn describe(&self, needs: &MemoryNeeds, free: u64) -> String {
        if !self.offloads() {
            return format!(
                "all weights on the GPU ({:.2} GiB of {:.2} GiB free)",
                gib(needs.weights),
                gib(free)
            );
        }
        let mut what = Vec::new();
        if self.offloaded_layers() > 0 {
            what.push(format!(
                "the routed experts of {} layer{} ({})",
                self.offloaded_layers(),
                if self.offloaded_layers() == 1 {
                    ""
                } else {
                    "s"
                },
                layer_ranges(&self.experts_on_host)
            ));
        }
        if self.embedding_on_host {
            what.push("the token embedding".to_string());
        }
        format!(
            "{} in pinned host memory ({:.2} GiB, read over the bus); {:.2} GiB on the \
             GPU, {:.2} GiB left there for sessions",
            what.join(" and "),
            gib(self.host_bytes(needs)),
            gib(self.device_bytes(needs)),
            gib(free.saturating_sub(self.device_bytes(needs)))
        )
    }
}

/// How the layers are split over several GPUs (`--gpus`; architecture.md §4.1): one
/// contiguous range per device with `free` bytes, in device order, sized to each
/// device's room so that every one keeps the same share of free memory. Each device
/// holds the tensors outside the layers too (embedding and head, ~1.6 GiB at the Flash
/// shape: reading them locally beats moving activations twice) and one session's
/// buffers (its batch scratch is per device; the KV of a layer lives with the layer).
pub fn split_layers(needs: &MemoryNeeds, free: &[u64]) -> Result<Vec<Range<usize>>, PlanError> {
    let (ranges, room) = split_ranges(needs, free)?;
    let layer_total: u64 = needs.layers.iter().sum();
    let room_total: u64 = room.iter().sum();
    if room_total < layer_total {
        let fixed = stage_fixed(needs);
        return Err(PlanError::Split(format!(
            "the model needs {:.2} GiB on {} GPUs ({:.2} GiB of layers plus {:.2} GiB on \
             each for the embedding, the head and a session) but {:.2} GiB are free: use \
             more GPUs, a smaller --ctx, or --offload-experts",
            gib(layer_total + fixed * free.len() as u64),
            free.len(),
            gib(layer_total),
            gib(fixed),
            gib(free.iter().sum())
        )));
    }
    let fixed = stage_fixed(needs);
    for (d, ((r, room), f)) in ranges.iter().zip(&room).zip(free).enumerate() {
        let bytes: u64 = needs.layers[r.clone()].iter().sum();
        if bytes + fixed > *f {
            return Err(PlanError::Split(format!(
                "layers {}–{} ({:.2} GiB) do not fit GPU {d} ({:.2} GiB free beside \
                 the embedding, the head and a session)",
                r.start,
                r.end - 1,
                gib(bytes),
                gib(*room)
            )));
        }
    }
    Ok(ranges)
}

/// What every stage holds besides its layers: the tensors outside the layers, one
/// session and the reserve.
fn stage_fixed(needs: &MemoryNeeds) -> u64 {
    let outside = needs.weights.saturating_sub(needs.layers.iter().sum());
    outside + needs.session + needs.reserve
}

/// The ranges of [`split_layers`] without the fit check (each device at least one
/// layer), and each device's room for layers.
fn split_ranges(
    needs: &MemoryNeeds,
    free: &[u64],
) -> Result<(Vec<Range<usize>>, Vec<u64>), PlanError> {
    let n_layer = needs.layers.len();
    if free.is_empty() || free.len() > n_layer {
        return Err(PlanError::Split(format!(
            "{} GPUs for a model of {n_layer} layers",
            free.len()
        )));
    }
    let layer_total: u64 = needs.layers.iter().sum();
    let fixed = stage_fixed(needs);
    let room: Vec<u64> = free.iter().map(|f| f.saturating_sub(fixed)).collect();
    let room_total = room.iter().sum::<u64>().max(1);
    // Device d ends where the cumulative layer bytes pass its cumulative share of the
    // room (midpoint rounding; each device at least one layer).
    let mut ranges = Vec::with_capacity(free.len());
    let (mut start, mut acc, mut share) = (0usize, 0u64, 0u128);
    for (d, r) in room.iter().enumerate() {
        share += *r as u128;
        let left = free.len() - d - 1;
        let mut end = start;
        if left == 0 {
            end = n_layer;
        } else {
            let target = (layer_total as u128 * share / room_total as u128) as u64;
            while end < n_layer - left && (end == start || acc + needs.layers[end] / 2 <= target) {
                acc += needs.layers[end];
                end += 1;
            }
        }
        ranges.push(start..end);
        start = end;
    }
    Ok((ranges, room))
}

/// One stage of a split: its layers and what of them lives in host memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stage {
    pub layers: Range<usize>,
    pub placement: Placement,
}

/// The split over devices with `free` bytes, with expert offload where the cards are
/// too small together: `Offload::Auto` splits without offload when that fits, else
/// splits by room and lets each stage offload the embedding and its last layers'
/// experts as its card needs ([`Placement::plan`] on the stage's share); `Layers(N)`
/// offloads the model's last N layers' experts (and every stage's embedding when
/// N > 0) and `Layers(0)` never.
pub fn plan_split(
    needs: &MemoryNeeds,
    free: &[u64],
    offload: Offload,
) -> Result<Vec<Stage>, PlanError> {
    let n_layer = needs.layers.len();
    let resident = |r: Range<usize>| Stage {
        layers: r,
        placement: Placement::resident(n_layer),
    };
    match offload {
        Offload::Layers(0) => Ok(split_layers(needs, free)?
            .into_iter()
            .map(resident)
            .collect()),
        Offload::Auto => {
            if let Ok(ranges) = split_layers(needs, free) {
                return Ok(ranges.into_iter().map(resident).collect());
            }
            let (ranges, _) = split_ranges(needs, free)?;
            place_stages(needs, ranges, free, offload)
        }
        Offload::Layers(n) => {
            if n > n_layer {
                return Err(PlanError::TooManyLayers { asked: n, n_layer });
            }
            let (ranges, _) = split_ranges(needs, free)?;
            place_stages(needs, ranges, free, offload)
        }
    }
}

/// Each of `ranges` with [`stage_placement`] on the matching `free`.
fn place_stages(
    needs: &MemoryNeeds,
    ranges: Vec<Range<usize>>,
    free: &[u64],
    offload: Offload,
) -> Result<Vec<Stage>, PlanError> {
    (ranges.into_iter().zip(free))
        .map(|(r, f)| {
            let placement = stage_placement(needs, &r, *f, offload)?;
            Ok(Stage {
                layers: r,
                placement,
            })
        })
        .collect()
}

/// What of the stage holding `layers` (of the whole model's `needs`) lives in host
/// memory on a device with `free` bytes: `Auto` plans the stage's share alone (its
/// embedding copy, then its own last layers' experts, as few as fit); `Layers(N)` the
/// model's last N layers' experts that are in the stage, and its embedding copy when
/// N > 0 (N ≤ the layer count: the callers check). `DoesNotFit` when the result does
/// not leave the stage's session and reserve free.
fn stage_placement(
    needs: &MemoryNeeds,
    layers: &Range<usize>,
    free: u64,
    offload: Offload,
) -> Result<Placement, PlanError> {
    let n_layer = needs.layers.len();
    let part = needs.stage(layers);
    let mut placement = match offload {
        Offload::Auto => Placement::plan(&part, free, Offload::Auto)?,
        Offload::Layers(n) => {
            let mut p = Placement::resident(n_layer);
            p.embedding_on_host = n > 0;
            for h in &mut p.experts_on_host[n_layer.saturating_sub(n)..] {
                *h = true;
            }
            p
        }
    };
    placement.keep_layers(layers);
    let need = placement.device_bytes(&part) + part.session + part.reserve;
    if need > free {
        return Err(PlanError::DoesNotFit {
            need,
            free,
            choice: offload,
            all_offloaded: layers.clone().all(|il| placement.experts_on_host[il]),
        });
    }
    Ok(placement)
}

impl MemoryNeeds {
    /// What one stage holding `layers` needs: the tensors outside the layers, those
    /// layers, one session (the other layers count nothing).
    pub fn stage(&self, layers: &Range<usize>) -> MemoryNeeds {
        let keep = |v: &[u64]| -> Vec<u64> {
            v.iter()
                .enumerate()
                .map(|(il, b)| if layers.contains(&il) { *b } else { 0 })
                .collect()
        };
        let outside = self.weights.saturating_sub(self.layers.iter().sum());
        let layers_kept = keep(&self.layers);
        MemoryNeeds {
            weights: outside + layers_kept.iter().sum::<u64>(),
            embedding: self.embedding,
            experts: keep(&self.experts),
            layers: layers_kept,
            session: self.session,
            reserve: self.reserve,
        }
    }
}

/// "40–42" style ranges of the set entries.
fn layer_ranges(set: &[bool]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < set.len() {
        if !set[i] {
            i += 1;
            continue;
        }
        let j = (i..set.len()).take_while(|&k| set[k]).last().unwrap_or(i);
        out.push(if i == j {
            format!("layer {i}")
        } else {
            format!("layers {i}–{j}")
        });
        i = j + 1;
    }
    out.join(", ")
}

pub(crate) fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// Why no placement works.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlanError {
    TooManyLayers {
        asked: usize,
        n_layer: usize,
    },
    DoesNotFit {
        need: u64,
        free: u64,
        choice: Offload,
        all_offloaded: bool,
    },
    /// No split of the layers over the GPUs fits (the message says why).
    Split(String),
    /// `--device-map` does not cover the model's layers, or comes with `--gpus` (the
    /// message says what is wrong and what a right map looks like).
    DeviceMap(String),
    /// Stage `stage` (from 0) of `--device-map`, `layers` on GPU `gpu`, needs `need`
    /// bytes there but `free` are (with `choice`; `all_offloaded`: even with every one
    /// of its layers' experts in host memory).
    StageDoesNotFit {
        stage: usize,
        gpu: usize,
        layers: Range<usize>,
        need: u64,
        free: u64,
        choice: Offload,
        all_offloaded: bool,
    },
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanError::Split(why) | PlanError::DeviceMap(why) => f.write_str(why),
            PlanError::StageDoesNotFit {
                stage,
                gpu,
                layers,
                need,
                free,
                choice,
                all_offloaded,
            } => fmt::Display::fmt(
                &device_map::StageShort {
                    stage: *stage,
                    gpu: *gpu,
                    layers,
                    need: *need,
                    free: *free,
                    choice: *choice,
                    all_offloaded: *all_offloaded,
                },
                f,
            ),
            PlanError::TooManyLayers { asked, n_layer } => write!(
                f,
                "--offload-experts {asked}: the model has {n_layer} layers"
            ),
            PlanError::DoesNotFit {
                need,
                free,
                choice,
                all_offloaded,
            } => {
                write!(
                    f,
                    "the model needs {:.2} GiB on the GPU with --offload-experts {choice} \
                     but {:.2} GiB are free",
                    gib(*need),
                    gib(*free)
                )?;
                match (choice, all_offloaded) {
                    (_, true) => f.write_str(
                        " even with every layer's experts in host memory: use a smaller \
                         --ctx or a larger GPU",
                    ),
                    (Offload::Layers(_), false) => f.write_str(
                        ": offload more layers (--offload-experts auto picks the number) \
                         or use a smaller --ctx",
                    ),
                    (Offload::Auto, false) => f.write_str(": use a smaller --ctx"),
                }
            }
        }
    }
}

impl std::error::Error for PlanError {}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const GIB: u64 = 1 << 30;

    /// The published q2 file's sizes (docs: 80.76 GiB; embedding F16 129,280 × 4,096;
    /// each layer's 256 experts ~1.69 GiB), a 2k session and a 1 GiB reserve.
    pub(super) fn q2() -> MemoryNeeds {
        MemoryNeeds {
            weights: 86_714_775_900,
            embedding: 1_059_061_760,
            experts: vec![1_811_939_328; 43],
            // (86.71 GB − the 1.06 GB embedding − the 0.56 GB head) / 43.
            layers: vec![1_979_000_000; 43],
            session: 2 * GIB,
            reserve: GIB,
        }
    }

    #[test]
    fn a_model_that_fits_stays_on_the_device() {
        let p = Placement::plan(&q2(), 139 * GIB, Offload::Auto).unwrap();
        assert!(!p.offloads());
        assert_eq!(p.device_bytes(&q2()), q2().weights);
        assert!(p
            .describe(&q2(), 139 * GIB)
            .starts_with("all weights on the GPU"));
    }

    #[test]
    fn q2_on_an_80_gb_card_offloads_the_embedding_and_the_last_layers() {
        let needs = q2();
        let free = 79 * GIB;
        let p = Placement::plan(&needs, free, Offload::Auto).unwrap();
        assert!(p.embedding_on_host);
        // 80.76 − 0.99 GiB of weights + 3 GiB room into 79: three layers (1.69 each).
        assert_eq!(p.offloaded_layers(), 3);
        assert_eq!(&p.experts_on_host[40..], &[true; 3]);
        assert!(p.experts_on_host[..40].iter().all(|&h| !h));
        assert!(p.device_bytes(&needs) + needs.session + needs.reserve <= free);
        // The fewest layers: one layer less does not fit.
        let mut fewer = p.clone();
        fewer.experts_on_host[40] = false;
        assert!(fewer.device_bytes(&needs) + needs.session + needs.reserve > free);
        let line = p.describe(&needs, free);
        assert!(line.contains("3 layers (layers 40–42)"), "{line}");
        assert!(line.contains("token embedding"), "{line}");
    }

    #[test]
    fn a_longer_context_offloads_more() {
        let mut needs = q2();
        let short = Placement::plan(&needs, 79 * GIB, Offload::Auto).unwrap();
        needs.session = 8 * GIB;
        let long = Placement::plan(&needs, 79 * GIB, Offload::Auto).unwrap();
        assert!(long.offloaded_layers() > short.offloaded_layers());
        assert_eq!(long.offloaded_layers(), 6);
    }

    #[test]
    fn an_explicit_count_is_taken_as_asked() {
        let needs = q2();
        let p = Placement::plan(&needs, 139 * GIB, Offload::Layers(2)).unwrap();
        assert_eq!(p.offloaded_layers(), 2);
        assert!(p.embedding_on_host && p.experts_on_host[41] && p.experts_on_host[42]);
        let none = Placement::plan(&needs, 139 * GIB, Offload::Layers(0)).unwrap();
        assert!(!none.offloads());
        // Too few for the card: refused with what to do.
        let e = Placement::plan(&needs, 79 * GIB, Offload::Layers(1)).unwrap_err();
        assert!(e.to_string().contains("offload more layers"), "{e}");
        let e = Placement::plan(&needs, 79 * GIB, Offload::Layers(0)).unwrap_err();
        assert!(matches!(e, PlanError::DoesNotFit { .. }));
        assert_eq!(
            Placement::plan(&needs, 79 * GIB, Offload::Layers(44)).unwrap_err(),
            PlanError::TooManyLayers {
                asked: 44,
                n_layer: 43
            }
        );
    }

    #[test]
    fn a_card_too_small_for_anything_is_refused() {
        let e = Placement::plan(&q2(), 8 * GIB, Offload::Auto).unwrap_err();
        assert!(
            matches!(
                e,
                PlanError::DoesNotFit {
                    all_offloaded: true,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("even with every layer's experts"));
    }

    #[test]
    fn q2_splits_evenly_over_two_80_gb_cards() {
        let needs = q2();
        let r = split_layers(&needs, &[79 * GIB, 79 * GIB]).unwrap();
        assert_eq!(r, vec![0..22, 22..43]);
        // A card with less room takes fewer layers; the ranges cover every layer once.
        let r = split_layers(&needs, &[60 * GIB, 79 * GIB]).unwrap();
        assert_eq!(r[0].start, 0);
        assert_eq!(r[0].end, r[1].start);
        assert_eq!(r[1].end, 43);
        assert!(r[0].len() < r[1].len(), "{r:?}");
        // Four cards: 10 or 11 layers each.
        let r = split_layers(&needs, &[79 * GIB; 4]).unwrap();
        assert!(r.iter().all(|r| (10..=11).contains(&r.len())), "{r:?}");
        assert_eq!(r.iter().map(|r| r.len()).sum::<usize>(), 43);
        // One card: every layer (the planner's offload decides the rest).
        assert_eq!(split_layers(&needs, &[200 * GIB]).unwrap(), vec![0..43]);
    }

    #[test]
    fn a_split_that_cannot_fit_says_so() {
        let e = split_layers(&q2(), &[30 * GIB, 30 * GIB]).unwrap_err();
        assert!(e.to_string().contains("use more GPUs"), "{e}");
        // Enough in total but one card too small for even its one layer.
        let e = split_layers(&q2(), &[GIB, 200 * GIB]).unwrap_err();
        assert!(matches!(e, PlanError::Split(_)), "{e:?}");
        assert!(split_layers(&q2(), &[]).is_err());
    }

    /// The q4 file: 164.6 GB, experts Q4_K (3.62 GB a layer).
    pub(super) fn q4() -> MemoryNeeds {
        MemoryNeeds {
            weights: 164_628_167_004,
            embedding: 1_059_061_760,
            experts: vec![3_623_878_656; 43],
            layers: vec![3_791_000_000; 43],
            session: 2 * GIB,
            reserve: GIB,
        }
    }

    #[test]
    fn q4_over_two_80_gb_cards_offloads_on_each() {
        let needs = q4();
        let free = [79 * GIB, 79 * GIB];
        assert!(split_layers(&needs, &free).is_err());
        let stages = plan_split(&needs, &free, Offload::Auto).unwrap();
        assert_eq!(stages.len(), 2);
        assert_eq!(stages[0].layers.start, 0);
        assert_eq!(stages[0].layers.end, stages[1].layers.start);
        assert_eq!(stages[1].layers.end, 43);
        // 22 + 21 layers: the first card offloads, the second just fits.
        assert!(stages[0].placement.offloaded_layers() > 0, "{stages:?}");
        for (s, f) in stages.iter().zip(free) {
            let part = needs.stage(&s.layers);
            let p = &s.placement;
            // Only the stage's own layers, its last ones, and it fits its card.
            let on: Vec<usize> = (0..43).filter(|&il| p.experts_on_host[il]).collect();
            assert!(on.iter().all(|il| s.layers.contains(il)), "{on:?}");
            if let Some(&last) = on.last() {
                assert!(p.embedding_on_host);
                assert_eq!(last, s.layers.end - 1);
                assert_eq!(on.len(), last + 1 - on[0]);
            }
            assert!(p.device_bytes(&part) + part.session + part.reserve <= f);
        }
        // Enough room: no offload at all.
        let big = plan_split(&needs, &[139 * GIB, 139 * GIB], Offload::Auto).unwrap();
        assert!(big.iter().all(|s| !s.placement.offloads()));
        // Never: refused with the split's message.
        assert!(matches!(
            plan_split(&needs, &free, Offload::Layers(0)),
            Err(PlanError::Split(_))
        ));
    }

    #[test]
    fn a_stage_counts_only_its_own_layers() {
        let needs = q4();
        let all_host = Placement {
            experts_on_host: vec![true; 43],
            embedding_on_host: true,
        };
        let stage = needs.stage(&(22..43));
        let outside = needs.weights - needs.layers.iter().sum::<u64>();
        assert_eq!(stage.weights, outside + 21 * needs.layers[0]);
        // Flags of other layers move nothing of this stage.
        let host = 21 * needs.experts[0] + needs.embedding;
        assert_eq!(all_host.host_bytes(&stage), host);
        assert_eq!(all_host.device_bytes(&stage), stage.weights - host);
    }

    #[test]
    fn an_explicit_offload_of_a_split_takes_the_models_last_layers() {
        let needs = q4();
        let stages = plan_split(&needs, &[139 * GIB, 139 * GIB], Offload::Layers(3)).unwrap();
        assert!(!stages[0].placement.experts_on_host.iter().any(|&h| h));
        let last = &stages[1].placement;
        assert_eq!(last.offloaded_layers(), 3);
        assert!(last.experts_on_host[40..].iter().all(|&h| h));
        assert!(stages.iter().all(|s| s.placement.embedding_on_host));
        // Too few for two small cards: refused.
        assert!(plan_split(&needs, &[79 * GIB, 79 * GIB], Offload::Layers(1)).is_err());
    }

    #[test]
    fn gpu_lists_parse() {
        assert_eq!(parse_gpus("0,1"), Ok(vec![0, 1]));
        assert_eq!(parse_gpus(" 3 "), Ok(vec![3]));
        assert!(parse_gpus("0,0").unwrap_err().contains("twice"));
        assert!(parse_gpus("0,x").is_err());
        assert!(parse_gpus("").is_err());
    }

    #[test]
    fn offload_flag_values_parse() {
        assert_eq!("auto".parse::<Offload>(), Ok(Offload::Auto));
        assert_eq!(" 3".parse::<Offload>(), Ok(Offload::Layers(3)));
        assert!("three".parse::<Offload>().unwrap_err().contains("auto"));
        assert_eq!(Offload::Layers(5).to_string(), "5");
    }

    #[test]
    fn ranges_name_runs_of_layers() {
        let set = [true, false, true, true, true, false, true];
        assert_eq!(layer_ranges(&set), "layer 0, layers 2–4, layer 6");
    }
}
