//! Token sampling: greedy, temperature, top-k, top-p, min-p, with a seeded
//! reproducible generator (xoshiro256**, seeded through SplitMix64).

use crate::error::Result;
use crate::session::Session;

pub mod fixed;
pub use fixed::PickParams;

/// xoshiro256** — small, fast, and fixed: the same seed gives the same stream on
/// every platform and version.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in [0, 1) with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// ≤ 0: greedy.
    pub temperature: f32,
    /// 0: off.
    pub top_k: usize,
    /// ≥ 1: off.
    pub top_p: f32,
    /// Drops tokens below `min_p·p_max`; 0: off.
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.05,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    pub fn greedy() -> SamplerConfig {
        SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        }
    }
}

/// Index of the first maximum; NaN entries are never chosen unless all are NaN.
pub fn argmax(logits: &[f32]) -> u32 {
    // Every greedy token scans the vocabulary (129k values) on the host while the GPU
    // waits for the next token, so this is part of every token's time (three rows an
    // MTP cycle). A branchy scalar loop took ~0.1–0.2 ms a row; two passes (the max,
    // then the first index equal to it) still ~95 µs (x86-64 baseline, release), the
    // index pass a scalar early-exit loop over up to the whole row. Now one
    // vectorised max a chunk, keeping the first chunk that holds the row's maximum
    // (strict >), then the index scan of that chunk only: ~5 µs.
    const CHUNK: usize = 2048;
    let mut best_v = f32::NEG_INFINITY;
    let mut best_chunk = 0;
    for (i, c) in logits.chunks(CHUNK).enumerate() {
        let m = max_ignoring_nan(c);
        if m > best_v {
            best_v = m;
            best_chunk = i;
        }
    }
    if best_v == f32::NEG_INFINITY {
        // Nothing above -inf: the first value that is not NaN (0 when all are).
        return logits.iter().position(|v| !v.is_nan()).unwrap_or(0) as u32;
    }
    let start = best_chunk * CHUNK;
    let within = logits[start..].iter().position(|&v| v == best_v);
    (start + within.unwrap_or(0)) as u32
}

/// [`argmax`] with the token `skip` left out (`None`: [`argmax`]): the first maximum of
/// the rest (a benchmark's greedy continuation that never ends at EOS). The device's
/// pick (`greedy_pick`) chooses the same token.
pub fn argmax_skip(logits: &[f32], skip: Option<u32>) -> u32 {
    let best = argmax(logits);
    let Some(e) = skip.map(|s| s as usize) else {
        return best;
    };
    if best as usize != e || e >= logits.len() || logits.len() < 2 {
        return best;
    }
    let (before, after) = (&logits[..e], &logits[e + 1..]);
    let a = (!before.is_empty()).then(|| argmax(before) as usize);
    let b = (!after.is_empty()).then(|| e + 1 + argmax(after) as usize);
    let pick = match (a, b) {
        // The later maximum only when larger (or the earlier is NaN: all NaN before).
        (Some(a), Some(b)) if logits[b] > logits[a] || logits[a].is_nan() => b,
        (Some(a), _) => a,
        (None, Some(b)) => b,
        (None, None) => best as usize,
    };
    pick as u32
}

/// The largest value of `x` that is not NaN (-inf when there is none).
pub(crate) fn max_ignoring_nan(x: &[f32]) -> f32 {
    // Independent lanes so the compiler keeps the maxima in vector registers; 32 make
    // 8 independent SSE max chains (16 measured ~2× slower: the chains' latency);
    // `c > m` is false for NaN, so NaN never enters.
    const LANES: usize = 32;
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (mj, &cj) in m.iter_mut().zip(c) {
            *mj = if cj > *mj { cj } else { *mj };
        }
    }
    let mut best = f32::NEG_INFINITY;
    for &v in m.iter().chain(chunks.remainder()) {
        if v > best {
            best = v;
        }
    }
    best
}

#[derive(Clone, Debug)]
pub struct Sampler {
    pub config: SamplerConfig,
    rng: Rng,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Sampler {
        let rng = Rng::new(config.seed);
        Sampler { config, rng }
    }

    /// The filters' settings as the sampled pick takes them ([`fixed::PickParams`]).
    pub fn params(&self) -> PickParams {
        PickParams::new(&self.config)
    }

    /// The candidates that survive the filters, with renormalised probabilities, in
    /// the candidates' order (descending logit, ties: lower id first); the definition
    /// is [`fixed`]'s, in integer weights. Order of filters: temperature softmax,
    /// top-k, top-p, min-p.
    ///
    /// Every sampled token runs this over the whole vocabulary (129k logits; three rows
    /// an MTP cycle). Sorting all of them took ~4.5 ms a row on the host, nearly a
    /// decode token's GPU time, and the default settings (temperature 1, min-p 0.05)
    /// keep only tokens within `T·ln(1/min_p)` of the maximum, so only the tokens that
    /// can survive are weighed and sorted.
    pub fn candidates(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        let s = fixed::kept(&self.params(), logits);
        let z: u64 = s.iter().map(|e| e.1).sum();
        s.into_iter()
            .map(|(i, w)| (i, w as f64 / z as f64))
            .collect()
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        assert!(!logits.is_empty(), "sample: empty logits");
        if self.config.temperature <= 0.0 {
            return argmax(logits);
        }
        let u = self.rng.next_f64();
        // Nothing kept only when every logit is NaN or min-p is above 1.
        fixed::pick(&self.params(), logits, u).unwrap_or_else(|| argmax(logits))
    }

    /// Whether sampling is greedy (temperature ≤ 0).
    pub fn is_greedy(&self) -> bool {
        self.config.temperature <= 0.0
    }

    /// A uniform draw in [0, 1) from the sampler's stream: speculative acceptance, and
    /// the device's sampled picks, which take the draw [`Sampler::sample`] would take
    /// for the same token ([`fixed::pick`] on the device).
    pub fn uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }

    /// Draws one token of `cands` (probabilities that sum to 1, as
    /// [`Sampler::candidates`] gives them) from the sampler's stream; `None` when empty.
    pub(crate) fn pick(&mut self, cands: &[(u32, f64)]) -> Option<u32> {
        let u = self.rng.next_f64();
        let mut cum = 0.0;
        for &(id, p) in cands {
            cum += p;
            if u < cum {
                return Some(id);
            }
        }
        // Rounding may leave u ≥ cum.
        cands.last().map(|c| c.0)
    }
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Eos,
    Limit,
}

/// Samples up to `max_tokens` tokens from the session's current logits, feeding each
/// back; stops after a token in `stop` (included in the output) or at the limit.
pub fn generate(
    session: &mut Session,
    sampler: &mut Sampler,
    max_tokens: usize,
    stop: &[u32],
) -> Result<(Vec<u32>, StopReason)> {
    let mut out = Vec::new();
    while out.len() < max_tokens {
        let tok = sampler.sample(session.logits());
        out.push(tok);
        if stop.contains(&tok) {
            return Ok((out, StopReason::Eos));
        }
        if out.len() < max_tokens {
            session.decode(tok)?;
        }
    }
    Ok((out, StopReason::Limit))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_reproducible_and_uniformish() {
        let mut a = Rng::new(42);
        let mut b = Rng::new(42);
        let xs: Vec<u64> = (0..10).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..10).map(|_| b.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(Rng::new(43).next_u64(), xs[0]);
        let mean: f64 = (0..10000).map(|_| a.next_f64()).sum::<f64>() / 10000.0;
        assert!((mean - 0.5).abs() < 0.02);
    }

    // #18 item 11: NaN logits used to panic in `sample` (min-p emptied the candidates).
    #[test]
    fn nan_logits_never_panic_and_are_never_chosen() {
        let logits = [f32::NAN, 1.0, f32::NAN, 0.5];
        assert_eq!(argmax(&logits), 1);
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            min_p: 0.05,
            top_p: 0.9,
            ..SamplerConfig::default()
        });
        for _ in 0..50 {
            assert!(matches!(s.sample(&logits), 1 | 3));
        }
        assert_eq!(s.sample(&[f32::NAN; 4]), 0);
        assert!(s.candidates(&[f32::NAN; 4]).is_empty());
    }

    #[test]
    fn argmax_skip_is_the_first_maximum_of_the_rest() {
        let ninf = f32::NEG_INFINITY;
        assert_eq!(argmax_skip(&[1.0, 3.0, 3.0, 2.0], None), 1);
        assert_eq!(argmax_skip(&[1.0, 3.0, 3.0, 2.0], Some(1)), 2);
        assert_eq!(argmax_skip(&[1.0, 3.0, 3.0, 2.0], Some(2)), 1);
        assert_eq!(argmax_skip(&[4.0, 3.0, 3.0, 2.0], Some(0)), 1);
        assert_eq!(argmax_skip(&[1.0, 3.0, 2.0, 9.0], Some(3)), 1);
        assert_eq!(argmax_skip(&[ninf, ninf], Some(0)), 1);
        assert_eq!(argmax_skip(&[5.0], Some(0)), 0);
        assert_eq!(argmax_skip(&[f32::NAN, 2.0, 1.0], Some(1)), 2);
        // Against a plain scan on coarse rows with many ties.
        let mut rng = Rng::new(7);
        for _ in 0..200 {
            let row: Vec<f32> = (0..300)
                .map(|_| (rng.next_f64() * 6.0).floor() as f32)
                .collect();
            let skip = (rng.next_u64() % 300) as u32;
            let want = (0..row.len())
                .filter(|&i| i as u32 != skip)
                .fold(None, |b: Option<usize>, i| match b {
                    Some(j) if row[j] >= row[i] => Some(j),
                    _ => Some(i),
                })
                .unwrap() as u32;
            assert_eq!(argmax_skip(&row, Some(skip)), want);
        }
    }

    #[test]
    fn greedy_takes_first_max() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        let ninf = f32::NEG_INFINITY;
        assert_eq!(argmax(&[f32::NAN, ninf, ninf]), 1);
        assert_eq!(argmax(&[ninf, ninf]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NAN, -1.0, 5.0, f32::NAN, 5.0]), 3);
        // Long rows (the lane passes and their remainder) agree with a plain scan.
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for len in [
            1usize, 15, 16, 17, 31, 32, 33, 100, 2047, 2048, 2049, 4099, 129_280,
        ] {
            let mut v: Vec<f32> = (0..len)
                .map(|_| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    (rng % 1000) as f32 / 7.0
                })
                .collect();
            v[len / 2] = f32::NAN;
            let want = v
                .iter()
                .enumerate()
                .filter(|(_, x)| !x.is_nan())
                .fold((0usize, f32::NEG_INFINITY), |b, (i, &x)| {
                    if x > b.1 {
                        (i, x)
                    } else {
                        b
                    }
                })
                .0;
            assert_eq!(
                argmax(&v) as usize,
                if len == 1 { 0 } else { want },
                "len {len}"
            );
        }
        let mut s = Sampler::new(SamplerConfig::greedy());
        assert_eq!(s.sample(&[0.0, 5.0, 5.0]), 1);
    }

    #[test]
    fn argmax_across_chunks_takes_the_first_maximum() {
        let ninf = f32::NEG_INFINITY;
        // A tie between chunks: the earlier one wins, wherever it sits in its chunk.
        let mut v = vec![0.0f32; 129_280];
        for &(a, b) in &[
            (5usize, 100_000usize),
            (2047, 2048),
            (2048, 4095),
            (0, 129_279),
        ] {
            v.iter_mut().for_each(|x| *x = 0.0);
            v[a] = 1.0;
            v[b] = 1.0;
            assert_eq!(argmax(&v) as usize, a, "tie {a}/{b}");
        }
        // A larger value in a later chunk beats an earlier chunk's maximum.
        v.iter_mut().for_each(|x| *x = 0.0);
        v[10] = 1.0;
        v[70_000] = 2.0;
        assert_eq!(argmax(&v), 70_000);
        // Everything -inf or NaN: the first value that is not NaN.
        let mut w = vec![f32::NAN; 5_000];
        w[4_500] = ninf;
        w[4_900] = ninf;
        assert_eq!(argmax(&w), 4_500);
        assert_eq!(argmax(&vec![f32::NAN; 3_000]), 0);
        // NaN never wins, even as the only entry of the chunk holding the real max.
        let mut x = vec![-1.0f32; 6_000];
        x[2_500] = f32::NAN;
        x[4_100] = 3.0;
        assert_eq!(argmax(&x), 4_100);
    }

    #[test]
    fn filters_restrict_candidates() {
        let logits = [0.0f32, 1.0, 2.0, 3.0, -10.0];
        let s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            min_p: 0.0,
            seed: 1,
        });
        let c = s.candidates(&logits);
        assert_eq!(c.iter().map(|p| p.0).collect::<Vec<_>>(), vec![3, 2]);
        assert!((c[0].1 - 1.0 / (1.0 + (-1f64).exp())).abs() < 1e-12);

        let s = Sampler::new(SamplerConfig {
            top_p: 0.5,
            min_p: 0.0,
            ..Default::default()
        });
        // p(3) ≈ 0.64 ≥ 0.5: only the top token.
        assert_eq!(s.candidates(&logits).len(), 1);

        let s = Sampler::new(SamplerConfig::default());
        // min-p 0.05 drops the -10 logit (and nothing else: e^-3 ≈ 0.0498 < 0.05 drops 0).
        let ids: Vec<u32> = s.candidates(&logits).iter().map(|p| p.0).collect();
        assert_eq!(ids, vec![3, 2, 1]);
    }

    /// [`fixed::kept`] (only the tokens that can count are weighed and sorted) against
    /// its definition spelled out (every token weighed, all sorted, the filters in
    /// turn), over rows with ties, NaN, ±inf, and settings from greedy-like to flat.
    #[test]
    fn kept_is_its_definition() {
        fn definition(p: &PickParams, row: &[f32]) -> Vec<(u32, u64)> {
            let mx = max_ignoring_nan(row);
            let mut all: Vec<(u32, u64)> = (0..row.len() as u32)
                .map(|i| (i, fixed::weight(row[i as usize], mx, p.t)))
                .filter(|e| e.1 > 0)
                .collect();
            all.sort_by(|a, b| {
                let (la, lb) = (row[a.0 as usize], row[b.0 as usize]);
                lb.total_cmp(&la).then(a.0.cmp(&b.0))
            });
            if p.top_k > 0 {
                all.truncate(p.top_k as usize);
            }
            if p.top_p < 1.0 {
                let z: u64 = all.iter().map(|e| e.1).sum();
                let need = ((p.top_p * z as f64).ceil() as u64).max(1);
                let mut cum = 0;
                let mut n = all.len();
                for (i, e) in all.iter().enumerate() {
                    cum += e.1;
                    if cum >= need {
                        n = i + 1;
                        break;
                    }
                }
                all.truncate(n);
            }
            all.retain(|e| e.1 >= p.w_min);
            all
        }
        let mut rng = Rng::new(11);
        for case in 0..3000 {
            let n = [1usize, 2, 5, 64, 1000, 5000][case % 6];
            let spread = [0.5, 4.0, 30.0, 200.0][(case / 6) % 4];
            let coarse = case % 5 == 0; // Many ties.
            let mut row: Vec<f32> = (0..n)
                .map(|_| {
                    let v = (rng.next_f64() * spread) as f32;
                    if coarse {
                        v.floor()
                    } else {
                        v
                    }
                })
                .collect();
            match case % 7 {
                1 => row[n / 2] = f32::NAN,
                2 => row[n - 1] = f32::NEG_INFINITY,
                3 if n > 3 => {
                    row[0] = f32::NAN;
                    row[n - 1] = f32::NEG_INFINITY;
                }
                4 if n > 3 => row[1] = f32::INFINITY,
                5 => row[0] = -0.0,
                _ => {}
            }
            fn pick(rng: &mut Rng, xs: &[f32]) -> f32 {
                xs[(rng.next_u64() % xs.len() as u64) as usize]
            }
            let cfg = SamplerConfig {
                temperature: pick(&mut rng, &[0.01, 0.3, 0.6, 1.0, 1.5, 7.0, 100.0]),
                top_k: [0usize, 0, 1, 3, 40, 2000][(rng.next_u64() % 6) as usize],
                top_p: pick(&mut rng, &[1.0, 1.0, 0.95, 0.9, 0.5, 0.01, 0.0]),
                min_p: pick(&mut rng, &[0.0, 0.05, 0.05, 0.1, 0.9, 1.0, 1.5]),
                seed: 0,
            };
            let p = PickParams::new(&cfg);
            let got = fixed::kept(&p, &row);
            assert_eq!(got, definition(&p, &row), "case {case} {cfg:?}");
            // The draw's pick is among them, weighted: u = 0 takes the first.
            match got.first() {
                Some(first) => assert_eq!(fixed::pick(&p, &row, 0.0), Some(first.0)),
                None => assert_eq!(fixed::pick(&p, &row, 0.5), None),
            }
        }
        // The vocabulary at the default settings: the few near the top, not 129k.
        let mut rng = Rng::new(3);
        let row: Vec<f32> = (0..129_280)
            .map(|_| (rng.next_f64() * 20.0) as f32)
            .collect();
        let p = PickParams::new(&SamplerConfig::default());
        let want = definition(&p, &row);
        assert!(
            want.len() > 1000 && want.len() < 129_280 / 2,
            "{}",
            want.len()
        );
        assert_eq!(fixed::kept(&p, &row), want, "129k row");
    }

    #[test]
    fn sampling_is_seeded_and_follows_probabilities() {
        let logits = [0.0f32, (3f32).ln()]; // p = 1/4, 3/4
        let cfg = SamplerConfig {
            min_p: 0.0,
            seed: 7,
            ..Default::default()
        };
        let mut a = Sampler::new(cfg.clone());
        let mut b = Sampler::new(cfg);
        let xs: Vec<u32> = (0..2000).map(|_| a.sample(&logits)).collect();
        let ys: Vec<u32> = (0..2000).map(|_| b.sample(&logits)).collect();
        assert_eq!(xs, ys);
        let ones = xs.iter().filter(|&&x| x == 1).count() as f64 / 2000.0;
        assert!((ones - 0.75).abs() < 0.04, "{ones}");
        // Low temperature approaches greedy.
        let mut c = Sampler::new(SamplerConfig {
            temperature: 0.01,
            min_p: 0.0,
            ..Default::default()
        });
        assert!((0..100).all(|_| c.sample(&logits) == 1));
    }
}
