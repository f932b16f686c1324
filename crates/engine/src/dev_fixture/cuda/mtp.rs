//! The MTP draft block on the CUDA backend (`Backend::mtp_draft`/`mtp_mark`/`mtp_keep`)
//! against the CPU block ([`Mtp::draft`]) fed the CPU session's own final HC state, on
//! a tiny fixture model and a synthetic MTP file made for it (the caller builds the
//! file: the synthesiser is not an engine dependency).

use std::path::Path;
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use ds4_gguf::GgufFile;

use super::super::{position_deltas, spread, within_tier, Manifest, VARIANTS};
use super::Tally;
use crate::backend::HcSource;
use crate::config::Config;
use crate::dev::{Backend, CpuBackend, LoadOptions, LogitRows, Model};
use crate::dev::{CudaBackend, CudaWeights, Gpu};
use crate::mtp::{Mtp, MtpState};
use crate::{argmax, Numerics};

/// Tokens prefilled before the first cycle.
const PREFIX: usize = 9;
/// Per cycle: drafts made, drafts accepted. Over the cycles the block's ring (16 rows
/// on the fixtures) wraps, and fully accepted cycles leave gaps (rotations): their last
/// draft's token is decoded but never drafted from.
const CYCLES: [(usize, usize); 10] = [
    (3, 0),
    (2, 2),
    (1, 0),
    (3, 3),
    (2, 1),
    (3, 1),
    (1, 1),
    (3, 2),
    (2, 0),
    (3, 3),
];

/// One session on each backend, driven through the same cycles.
struct Pair<'a> {
    gpu: CudaBackend,
    cpu: CpuBackend,
    mtp: &'a Mtp,
    state: MtpState,
    /// The CPU session's final HC state of its last token.
    hc: Vec<f32>,
}

impl Pair<'_> {
    fn forward(&mut self, tokens: &[u32]) -> Result<()> {
        self.gpu.forward(tokens, LogitRows::Last)?;
        let (_, hc) = self.cpu.forward_with_hc(tokens, LogitRows::Last)?;
        self.hc = hc;
        Ok(())
    }

    /// A cycle from `y` at position n (the contract's, S20): `k` drafts (Last, then
    /// chained on the CPU's argmax), both blocks' logits appended to `got`/`want`; `a`
    /// of them accepted: the ring keeps the rows of positions n..=n+a (at most `k`; the
    /// CPU replays them on its saved ring) and the session decodes y, d1..da.
    fn cycle(
        &mut self,
        y: u32,
        k: usize,
        a: usize,
        (got, want): (&mut Vec<f32>, &mut Vec<f32>),
    ) -> Result<()> {
        let n = self.gpu.n_tokens();
        ensure!(n == self.cpu.n_tokens(), "sessions out of step");
        self.gpu.mtp_mark();
        // Both blocks start from the CPU session's state: the comparison is of the
        // block (the sessions' own CPU/GPU differences, ~1e-4 on q4, stay out of it;
        // the keep and spec checks use the GPU session's own state).
        self.gpu.set_last_hc_host(&self.hc)?;
        let saved = self.state.clone();
        let (mut token, mut g) = (y, self.hc.clone());
        let mut drafted = Vec::new();
        for i in 0..k {
            let src = if i == 0 {
                HcSource::Last
            } else {
                HcSource::Chain
            };
            got.extend(self.gpu.mtp_draft(self.mtp, token, src, n + i)?);
            let d = self.mtp.draft(&mut self.state, token, &g, n + i)?;
            drafted.push(token);
            token = argmax(&d.logits);
            want.extend_from_slice(&d.logits);
            g = d.hc;
        }
        let keep = (1 + a).min(k);
        self.gpu.mtp_keep(keep)?;
        // The CPU reference of keep: the saved ring with only the kept drafts.
        self.state = saved;
        let mut g = self.hc.clone();
        for (i, &t) in drafted.iter().take(keep).enumerate() {
            g = self.mtp.draft(&mut self.state, t, &g, n + i)?.hc;
        }
        // The session takes y and the accepted drafts d1..da.
        let mut commit = drafted;
        commit.push(token);
        commit.truncate(1 + a);
        self.forward(&commit)
    }
}

/// `gpu-selftest`'s MTP checks on each fixture model and numeric mode; `mtp_image`
/// builds the MTP GGUF image for a main model's config.
pub fn check_mtp(
    gpu: &Arc<Gpu>,
    dir: &Path,
    mtp_image: &dyn Fn(&Config) -> Result<Vec<u8>>,
    line: &mut dyn FnMut(&str),
) -> Result<Tally> {
    let manifest = Manifest::load(dir)?;
    let tokens = manifest.tokens("b");
    let mut tally = Tally::default();
    line("\nMTP draft block: CUDA against the CPU block on the CPU session's HC state");
    let mut image = None;
    for (variant, file, _) in VARIANTS {
        let model = Model::load(dir.join(file), LoadOptions::default())?;
        let weights = Arc::new(CudaWeights::upload(gpu, &model, &|_| {})?);
        let bytes = match &image {
            Some(b) => b,
            None => image.insert(mtp_image(model.config())?),
        };
        let file = Arc::new(GgufFile::from_bytes(bytes.clone()).context("MTP image")?);
        let base = Mtp::from_gguf(&model, file)?;
        for numerics in [Numerics::Exact, Numerics::Fast] {
            let mtp = base.clone().with_numerics(numerics);
            let mode = format!("{numerics:?}");
            let case = (&model, &weights, &mtp, numerics);
            let (got, want, drafts) = drafts_against_cpu(case, &tokens)?;
            let vocab = weights.config.vocab;
            let (max, median, p99) = spread(&position_deltas(&got, &want, vocab));
            let agree = got
                .chunks_exact(vocab)
                .zip(want.chunks_exact(vocab))
                .filter(|(a, b)| argmax(a) == argmax(b))
                .count();
            let ok = got.len() == want.len() && within_tier(numerics, max, median, p99);
            tally.record(line, ok, format_args!(
                "{variant:<6} mtp   {mode:<6} {drafts} drafts vs CPU: |Δ| median {median:.1e} p99 {p99:.1e} max {max:.1e} (fixture tier); argmax {agree}/{drafts}"
            ));
            if !ok {
                // Which drafts drift, in cycle order (the first bad one names the cause).
                let per: Vec<String> = position_deltas(&got, &want, vocab)
                    .iter()
                    .map(|d| format!("{d:.0e}"))
                    .collect();
                line(&format!("       per draft |Δ|: {}", per.join(" ")));
            }
            for (keep, gap) in [(1, false), (0, true)] {
                let (same, differ, forward_differ) = keep_check(case, &tokens, keep, gap)?;
                tally.record(line, same, format_args!(
                    "{variant:<6} mtp   {mode:<6} 3 drafts, keep {keep}{}: next draft {} a session that drafted only those{}",
                    if gap { " after a gap" } else { "" },
                    if same { "bit-identical to".to_string() } else { format!("{differ} logits differ from") },
                    if forward_differ > 0 { format!(" (and {forward_differ} logits of the kept tokens' forward)") } else { String::new() }
                ));
            }
        }
        let prompt = &tokens[..PREFIX];
        let one = [weights.clone()];
        super::spec::spec_identity(&model, &one, &base, prompt, variant, &mut tally, line)?;
        // The same on the model split over two stages (both on this GPU): the step's
        // rows cross between the stages and the drafts run on the last one.
        let n_layer = model.config().n_layer;
        let stage = |r: std::ops::Range<usize>| -> Result<Arc<CudaWeights>> {
            let all = crate::placement::Placement::resident(n_layer);
            let w = CudaWeights::upload_placed(gpu, &model, all, r, false, &|_| {})?;
            Ok(Arc::new(w))
        };
        let split = [stage(0..n_layer / 2)?, stage(n_layer / 2..n_layer)?];
        super::spec::spec_identity(&model, &split, &base, prompt, variant, &mut tally, line)?;
        let mut b = CudaBackend::new(&weights, 4096, Numerics::Exact)?;
        b.forward(&tokens[..4], LogitRows::Last)?;
        b.reset();
        let err = b.mtp_draft(&base, tokens[0], HcSource::Last, 0);
        let chain = CudaBackend::new(&weights, 4096, Numerics::Exact)?
            .mtp_draft(&base, tokens[0], HcSource::Chain, 0)
            .is_err();
        tally.record(
            line,
            err.is_err() && chain,
            format_args!(
                "{variant:<6} mtp   Last after reset and Chain before any draft are refused"
            ),
        );
    }
    Ok(tally)
}

type RingDebug = Option<(Vec<f32>, usize, Option<usize>)>;

type McCase<'a> = (&'a Model, &'a Arc<CudaWeights>, &'a Mtp, Numerics);

/// Every draft of the [`CYCLES`] on both backends: (GPU logits, CPU logits, drafts).
fn drafts_against_cpu(
    (model, weights, mtp, numerics): McCase,
    tokens: &[u32],
) -> Result<(Vec<f32>, Vec<f32>, usize)> {
    let mut p = Pair {
        gpu: CudaBackend::new(weights, 4096, numerics)?,
        cpu: CpuBackend::new(model, 4096, numerics),
        mtp,
        state: mtp.new_state(),
        hc: Vec::new(),
    };
    p.forward(&tokens[..PREFIX])?;
    let (mut got, mut want) = (Vec::new(), Vec::new());
    // Each cycle's y: the sequence's next token.
    for (next, (k, a)) in (PREFIX..).zip(CYCLES) {
        p.cycle(tokens[next % tokens.len()], k, a, (&mut got, &mut want))?;
    }
    let drafts = CYCLES.iter().map(|c| c.0).sum();
    Ok((got, want, drafts))
}

/// Session A drafts 3 (Last, 2 chained) and keeps `keep`; session B drafts only the
/// `keep` kept ones. Both then decode y and the kept drafts and draft from Last: the
/// logits must be bit-identical (same device, same rows). With `gap`, a fully
/// accepted cycle first leaves a gap in the ring (a rotation before the drafts).
/// Returns (identical, draft logits differing, forward logits differing).
fn keep_check(
    (_, weights, mtp, numerics): McCase,
    tokens: &[u32],
    keep: usize,
    gap: bool,
) -> Result<(bool, usize, usize)> {
    let run = |drafts: usize| -> Result<(Vec<f32>, Vec<f32>, RingDebug)> {
        let mut b = CudaBackend::new(weights, 4096, numerics)?;
        b.forward(&tokens[..PREFIX], LogitRows::Last)?;
        let mut n = PREFIX;
        if gap {
            // One accepted draft, then the session moves two positions.
            b.mtp_draft(mtp, tokens[n], HcSource::Last, n)?;
            b.forward(&tokens[n..n + 2], LogitRows::Last)?;
            n += 2;
        }
        b.mtp_mark();
        let mut t = tokens[n];
        let mut kept = vec![t];
        for i in 0..drafts {
            let src = if i == 0 {
                HcSource::Last
            } else {
                HcSource::Chain
            };
            let l = b.mtp_draft(mtp, t, src, n + i)?;
            t = argmax(&l);
            if i + 1 < keep {
                kept.push(t);
            }
        }
        b.mtp_keep(keep)?;
        let ring = b.mtp_ring_debug();
        kept.truncate(keep.max(1));
        // The kept drafts' tokens are those B drafted too: y, then its argmaxes.
        let fwd = b.forward(&kept, LogitRows::Last)?;
        let pos = n + kept.len();
        let draft = b.mtp_draft(mtp, tokens[pos % tokens.len()], HcSource::Last, pos)?;
        Ok((fwd, draft, ring))
    };
    let (fa, a, ra) = run(3)?;
    let (fb, b, rb) = run(keep)?;
    if let (Some((ra, ca, la)), Some((rb, cb, lb))) = (&ra, &rb) {
        // Which ring rows differ after the keep (diagnosis of a failing check).
        let hd = weights.config.head_dim;
        let rows: Vec<usize> = ra
            .chunks_exact(hd)
            .zip(rb.chunks_exact(hd))
            .enumerate()
            .filter(|(_, (x, y))| x.iter().zip(*y).any(|(p, q)| p.to_bits() != q.to_bits()))
            .map(|(i, _)| i)
            .collect();
        if !rows.is_empty() || ca != cb || la != lb {
            eprintln!(
                "mtp keep {keep}: ring rows differing after keep {rows:?}; count {ca} vs {cb}, last {la:?} vs {lb:?}"
            );
        }
    }
    let bits_differ = |x: &[f32], y: &[f32]| {
        x.iter()
            .zip(y)
            .filter(|(p, q)| p.to_bits() != q.to_bits())
            .count()
    };
    let differ = bits_differ(&a, &b);
    Ok((
        a.len() == b.len() && differ == 0,
        differ,
        bits_differ(&fa, &fb),
    ))
}
