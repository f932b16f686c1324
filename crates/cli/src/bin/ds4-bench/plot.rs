//! The rows of a `ds4-bench` CSV and their SVG chart (`--plot`, `--plot-from`): prefill
//! and decode tokens/s against the context frontier, each on its own axis scale (one
//! decode line per `rows` value: the plain decode, `--rows R`, an MTP run).

/// One CSV row (the columns ds4-bench writes).
#[derive(Clone, Debug, PartialEq)]
pub struct BenchRow {
    pub ctx_tokens: u64,
    pub prefill_tokens: u64,
    pub prefill_tps: f64,
    pub gen_tokens: u64,
    pub gen_tps: f64,
    pub kvcache_bytes: u64,
    /// Token rows per timed step: 1 for the plain decode, R for `--rows R`, 1 + drafts
    /// for an MTP run.
    pub rows: u64,
    pub ms_per_cycle: f64,
    pub tokens_per_cycle: f64,
    /// Emitted tokens per second (`gen_tps` of the same row; kept as its own column so
    /// that the row's meaning does not depend on which kind of run wrote it).
    pub effective_tps: f64,
}

/// The columns of the reference's CSV, which scripts read by position (`cut -d, -f5`).
pub const CSV_HEADER_V1: &str =
    "ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes";

/// Today's columns: the reference's, then the multi-row / MTP ones.
pub const CSV_HEADER: &str = "ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes,rows,ms_per_cycle,tokens_per_cycle,effective_tps";

impl BenchRow {
    pub fn to_csv(&self) -> String {
        format!(
            "{},{},{:.2},{},{:.2},{},{},{:.3},{:.3},{:.2}",
            self.ctx_tokens,
            self.prefill_tokens,
            self.prefill_tps,
            self.gen_tokens,
            self.gen_tps,
            self.kvcache_bytes,
            self.rows,
            self.ms_per_cycle,
            self.tokens_per_cycle,
            self.effective_tps
        )
    }

    /// A row of today's CSV (10 columns) or of an earlier one (the reference's 6: a
    /// plain decode, one token per cycle).
    pub fn parse(line: &str) -> Option<BenchRow> {
        let f: Vec<&str> = line.trim().split(',').collect();
        if f.len() != 6 && f.len() != 10 {
            return None;
        }
        let gen_tps: f64 = f[4].parse().ok()?;
        let mut row = BenchRow {
            ctx_tokens: f[0].parse().ok()?,
            prefill_tokens: f[1].parse().ok()?,
            prefill_tps: f[2].parse().ok()?,
            gen_tokens: f[3].parse().ok()?,
            gen_tps,
            kvcache_bytes: f[5].parse().ok()?,
            rows: 1,
            ms_per_cycle: if gen_tps > 0.0 { 1e3 / gen_tps } else { 0.0 },
            tokens_per_cycle: 1.0,
            effective_tps: gen_tps,
        };
        if f.len() == 10 {
            row.rows = f[6].parse().ok()?;
            row.ms_per_cycle = f[7].parse().ok()?;
            row.tokens_per_cycle = f[8].parse().ok()?;
            row.effective_tps = f[9].parse().ok()?;
        }
        Some(row)
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Renders the chart (800×420) with a title.
pub fn svg(rows: &[BenchRow], title: &str) -> String {
    let (w, h, l, r, t, b) = (800.0, 420.0, 70.0, 70.0, 40.0, 50.0);
    let pw = w - l - r;
    let ph = h - t - b;
    let xmax = rows.iter().map(|r| r.ctx_tokens).max().unwrap_or(1).max(1) as f64;
    let pmax = rows
        .iter()
        .map(|r| r.prefill_tps)
        .fold(0.0, f64::max)
        .max(1e-9)
        * 1.1;
    let gmax = rows
        .iter()
        .map(|r| r.effective_tps)
        .fold(0.0, f64::max)
        .max(1e-9)
        * 1.1;
    // One decode line per `rows` value; prefill is the same for all of them, drawn once
    // from the first series.
    let mut series: Vec<u64> = rows.iter().map(|r| r.rows).collect();
    series.sort_unstable();
    series.dedup();
    let x = |v: f64| l + pw * v / xmax;
    let y = |v: f64, m: f64| t + ph * (1.0 - v / m);
    let line = |f: &dyn Fn(&BenchRow) -> f64, m: f64, of: u64| {
        rows.iter()
            .filter(|row| row.rows == of)
            .map(|row| format!("{:.1},{:.1}", x(row.ctx_tokens as f64), y(f(row), m)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut s = String::new();
    s.push_str(&format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
        w / 2.0,
        esc(title)
    ));
    s.push_str(&format!(
        "<line x1=\"{l}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<line x1=\"{l}\" y1=\"{t}\" x2=\"{l}\" y2=\"{}\" stroke=\"#1f77b4\"/>\n<line x1=\"{}\" y1=\"{t}\" x2=\"{}\" y2=\"{}\" stroke=\"#d62728\"/>\n",
        t + ph,
        l + pw,
        t + ph,
        t + ph,
        l + pw,
        l + pw,
        t + ph
    ));
    for i in 0..=4 {
        let f = i as f64 / 4.0;
        s.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"#1f77b4\">{:.0}</text>\n<text x=\"{:.1}\" y=\"{:.1}\" fill=\"#d62728\">{:.1}</text>\n<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{:.0}</text>\n",
            l - 6.0,
            y(pmax * f, pmax) + 4.0,
            pmax * f,
            l + pw + 6.0,
            y(gmax * f, gmax) + 4.0,
            gmax * f,
            x(xmax * f),
            t + ph + 18.0,
            xmax * f
        ));
    }
    s.push_str(&format!(
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">context frontier (tokens)</text>\n\
         <text x=\"16\" y=\"{:.1}\" fill=\"#1f77b4\" transform=\"rotate(-90 16 {:.1})\" text-anchor=\"middle\">prefill tok/s</text>\n\
         <text x=\"{:.1}\" y=\"{:.1}\" fill=\"#d62728\" transform=\"rotate(90 {:.1} {:.1})\" text-anchor=\"middle\">decode tok/s</text>\n",
        l + pw / 2.0,
        h - 10.0,
        t + ph / 2.0,
        t + ph / 2.0,
        w - 16.0,
        t + ph / 2.0,
        w - 16.0,
        t + ph / 2.0
    ));
    s.push_str(&format!(
        "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\" points=\"{}\"/>\n",
        line(
            &|r| r.prefill_tps,
            pmax,
            series.first().copied().unwrap_or(1)
        ),
    ));
    const DECODE: [&str; 6] = [
        "#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#2ca02c",
    ];
    for (i, &of) in series.iter().enumerate() {
        let color = DECODE[i % DECODE.len()];
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n",
            line(&|r| r.effective_tps, gmax, of)
        ));
        if series.len() > 1 {
            s.push_str(&format!(
                "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"{color}\">decode, {of} row{}</text>\n",
                l + 10.0,
                t + 16.0 + 14.0 * i as f64,
                if of == 1 { "" } else { "s" }
            ));
        }
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_round_trips_and_the_chart_is_well_formed() {
        let rows = vec![
            BenchRow {
                ctx_tokens: 2048,
                prefill_tokens: 2048,
                prefill_tps: 1367.0,
                gen_tokens: 128,
                gen_tps: 33.7,
                kvcache_bytes: 1 << 20,
                rows: 1,
                ms_per_cycle: 29.674,
                tokens_per_cycle: 1.0,
                effective_tps: 33.7,
            },
            BenchRow {
                ctx_tokens: 4096,
                prefill_tokens: 2048,
                prefill_tps: 1300.5,
                gen_tokens: 128,
                gen_tps: 32.4,
                kvcache_bytes: 2 << 20,
                rows: 1,
                ms_per_cycle: 30.864,
                tokens_per_cycle: 1.0,
                effective_tps: 32.4,
            },
        ];
        for r in &rows {
            assert_eq!(BenchRow::parse(&r.to_csv()).as_ref(), Some(r));
        }
        assert_eq!(BenchRow::parse("a,b"), None);
        let svg = svg(&rows, "H200 <q2>");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("H200 &lt;q2&gt;"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(!svg.contains("decode, 1 row"), "one series needs no legend");

        // A reference CSV row: one token per cycle.
        let old = BenchRow::parse("2048,2048,1367.00,128,32.00,1048576").unwrap();
        assert_eq!((old.rows, old.tokens_per_cycle), (1, 1.0));
        assert_eq!((old.ms_per_cycle, old.effective_tps), (31.25, 32.0));

        // A --rows 4 run beside the plain one: two decode lines with a legend.
        let mut both = rows.clone();
        both.extend(rows.iter().map(|r| BenchRow {
            rows: 4,
            tokens_per_cycle: 4.0,
            effective_tps: r.gen_tps * 3.0,
            ..r.clone()
        }));
        let svg = super::svg(&both, "t");
        assert_eq!(svg.matches("<polyline").count(), 3);
        assert!(svg.contains("decode, 4 rows") && svg.contains("decode, 1 row<"));
    }
}
