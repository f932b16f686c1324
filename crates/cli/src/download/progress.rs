//! The download progress bar: rate and ETA over this attempt's bytes only.

use std::fmt;
use std::time::Duration;

use indicatif::{HumanBytes, HumanDuration, ProgressBar, ProgressState, ProgressStyle};

pub(super) fn progress_bar(enabled: bool, total: Option<u64>, start: u64) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    // Rate and ETA are averaged over this attempt's bytes only: indicatif's own estimator
    // would count the resumed bytes already on disk as if they had just arrived.
    let rate = move |s: &ProgressState| {
        let secs = s.elapsed().as_secs_f64();
        (secs > 0.5).then(|| s.pos().saturating_sub(start) as f64 / secs)
    };
    let style = |template: &str| {
        ProgressStyle::with_template(template)
            .expect("valid template")
            .progress_chars("=> ")
            .with_key("rate", move |s: &ProgressState, w: &mut dyn fmt::Write| {
                let _ = match rate(s) {
                    Some(r) => write!(w, "{}/s", HumanBytes(r as u64)),
                    None => write!(w, "-"),
                };
            })
            .with_key("eta", move |s: &ProgressState, w: &mut dyn fmt::Write| {
                let left = s.len().map(|l| l.saturating_sub(s.pos()));
                let _ = match (rate(s), left) {
                    (Some(r), Some(left)) if r > 0.0 => write!(
                        w,
                        "{}",
                        HumanDuration(Duration::from_secs_f64(left as f64 / r))
                    ),
                    _ => write!(w, "-"),
                };
            })
    };
    let bar = match total {
        Some(t) => ProgressBar::new(t).with_style(style(
            "{bytes:>10}/{total_bytes:<10} [{wide_bar}] {percent:>3}% {rate:>12} ETA {eta}",
        )),
        None => ProgressBar::no_length().with_style(style("{bytes:>10} {rate:>12} {elapsed}")),
    };
    bar.set_position(start);
    bar.reset_elapsed();
    bar
}
