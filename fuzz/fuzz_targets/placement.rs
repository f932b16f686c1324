//! #23: the memory planner (`ds4_engine::Placement::plan`, `plan_split`,
//! `plan_device_map`) and the `--offload-experts` / `--gpus` / `--device-map` parsers on
//! arbitrary inputs: never a panic or an overflow, every placement it returns fits the
//! memory it was given, and a device map is accepted exactly when it covers the layers
//! once each, in order.
#![no_main]

use std::ops::Range;

use ds4_engine::{
    describe_split, parse_device_map, parse_gpus, plan_device_map, plan_split, DeviceMap,
    MemoryNeeds, Offload, Placement, PlanError, Stage,
};
use libfuzzer_sys::fuzz_target;

/// Little-endian u64s from the input, bounded to `max` (byte counts of real files and
/// cards stay far below 2^44).
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn u64(&mut self, max: u64) -> u64 {
        let mut b = [0u8; 8];
        let n = self.0.len().min(8);
        b[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        u64::from_le_bytes(b) % (max + 1)
    }
}

/// Whether `map` covers `0..n_layer` once each, in order, decided on its own (the
/// oracle for `DeviceMap::check`).
fn covers(map: &DeviceMap, n_layer: usize) -> bool {
    let mut next = 0;
    for (_, r) in map.entries() {
        if r.start != next {
            return false;
        }
        next = r.end;
    }
    next == n_layer && n_layer > 0
}

/// `DeviceMap::check` agrees with [`covers`], and a refusal's suggested map fits.
fn check_map(map: &DeviceMap, n_layer: usize) {
    match map.check(n_layer) {
        Ok(()) => assert!(covers(map, n_layer), "{map} accepted for {n_layer} layers"),
        Err(PlanError::DeviceMap(why)) => {
            assert!(!covers(map, n_layer), "{map} refused for {n_layer}: {why}");
            let even = DeviceMap::even(&map.gpus(), n_layer);
            assert_eq!(even.check(n_layer), Ok(()), "{even} for {n_layer}");
            assert!(why.ends_with(&format!("--device-map {even}")), "{why}");
        }
        Err(e) => panic!("{map}: {e:?}"),
    }
}

/// The stages of a successful `plan_device_map`: the map's ranges, each fitting its
/// card; its startup line names the map.
fn check_stages(needs: &MemoryNeeds, map: &DeviceMap, free: &[u64], stages: &[Stage]) {
    assert_eq!(stages.len(), map.len());
    for ((s, (_, r)), f) in stages.iter().zip(map.entries()).zip(free) {
        assert_eq!(&s.layers, r);
        let part = needs.stage(&s.layers);
        assert!(
            s.placement.device_bytes(&part) + part.session + part.reserve <= *f,
            "{s:?} does not fit {f}"
        );
        // Nothing of another stage's layers is flagged.
        let on = s.placement.experts_on_host.iter().enumerate();
        assert!(on.filter(|(_, &h)| h).all(|(il, _)| r.contains(&il)));
    }
    let names: Vec<(usize, String)> = map.gpus().into_iter().map(|d| (d, "GPU".into())).collect();
    let line = describe_split(needs, stages, &names, free, Some(map));
    assert!(line.starts_with(&format!("--device-map {map}: ")), "{line}");
}

/// `plan_device_map` on `map`: its answer, checked.
fn plan_map(needs: &MemoryNeeds, map: &DeviceMap, free: &[u64], offload: Offload) {
    let n_layer = needs.layers.len();
    match plan_device_map(needs, map, free, offload) {
        Ok(stages) => check_stages(needs, map, free, &stages),
        Err(PlanError::DeviceMap(_)) => assert!(!covers(map, n_layer)),
        Err(PlanError::StageDoesNotFit {
            stage,
            gpu,
            layers,
            need,
            free: f,
            ..
        }) => {
            assert_eq!(map.entries()[stage], (gpu, layers));
            assert_eq!(f, free[stage]);
            assert!(need > f);
        }
        Err(PlanError::TooManyLayers { asked, .. }) => {
            assert_eq!(offload, Offload::Layers(asked));
            assert!(asked > n_layer);
        }
        Err(PlanError::Split(_)) => assert_ne!(free.len(), map.len()),
        Err(e) => panic!("{map}: {e:?}"),
    }
}

/// A map over `k` stages of `n_layer` layers from the input: mostly right, sometimes
/// with a bound moved by one (a gap, an overlap, a layer past the end), written out as
/// the flag's text and parsed back.
fn map_from(r: &mut Reader, n_layer: usize) -> Option<DeviceMap> {
    let k = 1 + (r.u64(7) as usize).min(n_layer - 1);
    // k − 1 distinct cuts in 1..n_layer, ascending.
    let mut cuts: Vec<usize> = Vec::with_capacity(k + 1);
    cuts.push(0);
    for i in 1..k {
        let lo = cuts[i - 1] + 1;
        let hi = n_layer - (k - i);
        cuts.push(lo + r.u64((hi - lo) as u64) as usize);
    }
    cuts.push(n_layer);
    let mut ranges: Vec<Range<usize>> = cuts.windows(2).map(|w| w[0]..w[1]).collect();
    if r.u64(3) == 0 {
        let i = r.u64(k as u64 - 1) as usize;
        let s = &mut ranges[i];
        match r.u64(3) {
            0 => s.start += 1,
            1 => s.start = s.start.saturating_sub(1),
            2 => s.end += 1,
            _ => s.end -= 1,
        }
    }
    let text: Vec<String> = (ranges.iter().enumerate())
        .filter(|(_, r)| !r.is_empty())
        .map(|(g, r)| format!("{g}:{}-{}", r.start, r.end - 1))
        .collect();
    let map = parse_device_map(&text.join(",")).ok()?;
    assert_eq!(map.len(), text.len());
    Some(map)
}

fuzz_target!(|data: &[u8]| {
    let mut text_map = None;
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = s.parse::<Offload>();
        if let Ok(g) = parse_gpus(s) {
            assert!(!g.is_empty());
        }
        if let Ok(m) = parse_device_map(s) {
            assert!(!m.is_empty());
            assert!(m.entries().iter().all(|(_, r)| !r.is_empty()));
            let mut gpus = m.gpus();
            gpus.sort_unstable();
            gpus.dedup();
            assert_eq!(gpus.len(), m.len(), "{m}: a GPU twice");
            // The map prints as the flag's syntax and parses back to itself.
            assert_eq!(parse_device_map(&m.to_string()), Ok(m.clone()));
            let last = m.entries().last().map_or(0, |(_, r)| r.end);
            for n_layer in [1, 43, last.clamp(1, 1 << 20)] {
                check_map(&m, n_layer);
            }
            text_map = Some(m);
        }
    }
    let mut r = Reader(data);
    const MAX: u64 = 1 << 44;
    let n_layer = 1 + r.u64(63) as usize;
    let layers: Vec<u64> = (0..n_layer).map(|_| r.u64(MAX)).collect();
    let experts: Vec<u64> = layers.iter().map(|&l| r.u64(MAX) % (l + 1)).collect();
    let outside = r.u64(MAX);
    let embedding = r.u64(MAX) % (outside + 1);
    let needs = MemoryNeeds {
        weights: outside + layers.iter().sum::<u64>(),
        embedding,
        experts,
        layers,
        session: r.u64(MAX),
        reserve: r.u64(MAX),
    };
    let offload = match r.u64(3) {
        0 => Offload::Auto,
        _ => Offload::Layers(r.u64(n_layer as u64 + 1) as usize),
    };
    let fits = |p: &Placement, n: &MemoryNeeds, free: u64| {
        p.device_bytes(n) + n.session + n.reserve <= free
    };
    let free = r.u64(MAX);
    if let Ok(p) = Placement::plan(&needs, free, offload) {
        assert_eq!(p.experts_on_host.len(), n_layer);
        assert!(fits(&p, &needs, free), "{p:?} does not fit {free}");
        let _ = p.describe(&needs, free);
    }
    let gpus = 1 + r.u64(7) as usize;
    let frees: Vec<u64> = (0..gpus).map(|_| r.u64(MAX)).collect();
    if let Ok(stages) = plan_split(&needs, &frees, offload) {
        assert_eq!(stages.len(), gpus);
        let mut next = 0;
        for (s, f) in stages.iter().zip(&frees) {
            assert_eq!(s.layers.start, next);
            assert!(!s.layers.is_empty());
            next = s.layers.end;
            let part = needs.stage(&s.layers);
            assert!(fits(&s.placement, &part, *f), "{s:?} does not fit {f}");
        }
        assert_eq!(next, n_layer);
    }
    // `--device-map`: the text input's map (when it has a card per stage here) and one
    // built from the bytes, planned on these sizes.
    if let Some(m) = text_map.filter(|m| m.len() <= frees.len()) {
        plan_map(&needs, &m, &frees[..m.len()], offload);
    }
    if let Some(m) = map_from(&mut r, n_layer) {
        check_map(&m, n_layer);
        let free: Vec<u64> = (0..m.len()).map(|_| r.u64(MAX)).collect();
        plan_map(&needs, &m, &free, offload);
        // One card short: refused, never planned over the cards there are.
        if m.len() > 1 {
            plan_map(&needs, &m, &free[1..], offload);
        }
    }
});
