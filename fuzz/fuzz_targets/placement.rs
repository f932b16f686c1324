//! #23: the memory planner (`ds4_engine::Placement::plan`, `plan_split`) and the
//! `--offload-experts` / `--gpus` parsers on arbitrary inputs: never a panic or an
//! overflow, and every placement it returns fits the memory it was given.
#![no_main]

use ds4_engine::{parse_gpus, plan_split, MemoryNeeds, Offload, Placement};
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

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = s.parse::<Offload>();
        if let Ok(g) = parse_gpus(s) {
            assert!(!g.is_empty());
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
});
