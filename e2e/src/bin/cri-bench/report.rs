//! The tables cri-bench prints: p50 per call for every endpoint with its
//! ratio to the baseline, and p50 / p90 / p99 per endpoint (markdown, so a
//! run pastes into docs/performance.md as it is).

use std::fmt::Write as _;
use std::time::Duration;

use cubelet_e2e::{ms, percentile};

use crate::lifecycle::{Lifecycle, CALLS};

/// Churn: full lifecycles at a fixed concurrency, in timed batches.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Churn {
    /// Lifecycles in flight at once.
    pub(crate) concurrency: usize,
    /// Lifecycles that completed.
    pub(crate) ok: usize,
    /// Lifecycles that failed.
    pub(crate) failed: usize,
    /// Sum of the batches' wall times.
    pub(crate) wall: Duration,
    /// Each batch's rate, pods/s.
    pub(crate) batches: Vec<f64>,
}

impl Churn {
    /// Completed lifecycles per second over all batches.
    pub(crate) fn rate(&self) -> f64 {
        self.ok as f64 / self.wall.as_secs_f64().max(1e-9)
    }
}

/// What one endpoint measured.
#[derive(Debug, Clone, Default)]
pub(crate) struct Measured {
    /// The endpoint's label.
    pub(crate) label: String,
    /// Completed lifecycles of the latency phase.
    pub(crate) lifecycles: Vec<Lifecycle>,
    /// Failures of the latency phase.
    pub(crate) failures: Vec<String>,
    /// The churn phase, when run.
    pub(crate) churn: Option<Churn>,
}

/// One row: a name and how to read it off a lifecycle.
struct Row {
    name: &'static str,
    of: fn(&Lifecycle) -> Duration,
}

const ROWS: [Row; 9] = [
    Row {
        name: CALLS[0],
        of: |l| l.calls[0],
    },
    Row {
        name: CALLS[1],
        of: |l| l.calls[1],
    },
    Row {
        name: CALLS[2],
        of: |l| l.calls[2],
    },
    Row {
        name: "pod to running (the three above)",
        of: Lifecycle::pod_to_running,
    },
    Row {
        name: CALLS[3],
        of: |l| l.calls[3],
    },
    Row {
        name: CALLS[4],
        of: |l| l.calls[4],
    },
    Row {
        name: CALLS[5],
        of: |l| l.calls[5],
    },
    Row {
        name: CALLS[6],
        of: |l| l.calls[6],
    },
    Row {
        name: "whole lifecycle",
        of: |l| l.total,
    },
];

/// The sorted values of `row` over `m`'s lifecycles.
fn sorted(m: &Measured, row: &Row) -> Vec<Duration> {
    let mut v: Vec<Duration> = m.lifecycles.iter().map(row.of).collect();
    v.sort();
    v
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 && a > 0.0 {
        format!("{:.2}", a / b)
    } else {
        "–".to_owned()
    }
}

/// The p50 table: a column per endpoint, the baseline first, a ratio
/// column (endpoint ÷ baseline) after every other endpoint; the churn row's
/// ratio is of pods/s, so there higher is better.
pub(crate) fn p50_table(results: &[Measured], baseline: usize) -> String {
    let order = column_order(results.len(), baseline);
    let base = &results[baseline];
    let mut out = String::new();
    let _ = write!(out, "| call (p50 ms) |");
    for &i in &order {
        if i == baseline {
            let _ = write!(out, " {} |", results[i].label);
        } else {
            let _ = write!(out, " {} | × {} |", results[i].label, base.label);
        }
    }
    out.push('\n');
    out.push_str("|---|");
    for &i in &order {
        out.push_str(if i == baseline { "---|" } else { "---|---|" });
    }
    out.push('\n');
    for row in &ROWS {
        let b = percentile(&sorted(base, row), 50.0).as_secs_f64();
        let _ = write!(out, "| {} |", row.name);
        for &i in &order {
            let v = percentile(&sorted(&results[i], row), 50.0);
            if i == baseline {
                let _ = write!(out, " {} |", ms(v));
            } else {
                let _ = write!(out, " {} | {} |", ms(v), ratio(v.as_secs_f64(), b));
            }
        }
        out.push('\n');
    }
    if let Some(c) = results.iter().find_map(|m| m.churn.as_ref()) {
        let _ = write!(out, "| churn at concurrency {} (pods/s) |", c.concurrency);
        let b = base.churn.as_ref().map_or(0.0, Churn::rate);
        for &i in &order {
            let cell = match &results[i].churn {
                Some(c) => churn_cell(c),
                None => "–".to_owned(),
            };
            let r = results[i].churn.as_ref().map_or(0.0, Churn::rate);
            if i == baseline {
                let _ = write!(out, " {cell} |");
            } else {
                let _ = write!(out, " {cell} | {} |", ratio(r, b));
            }
        }
        out.push('\n');
    }
    out
}

/// `7.8 (7.1–8.4)`: the overall rate and the batches' range.
fn churn_cell(c: &Churn) -> String {
    let lo = c.batches.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = c.batches.iter().copied().fold(0.0, f64::max);
    if c.batches.len() > 1 {
        format!("{:.1} ({lo:.1}–{hi:.1})", c.rate())
    } else {
        format!("{:.1}", c.rate())
    }
}

/// p50 / p90 / p99 per call, a column per endpoint (baseline first).
pub(crate) fn spread_table(results: &[Measured], baseline: usize) -> String {
    let order = column_order(results.len(), baseline);
    let mut out = String::from("| call (ms) |");
    for &i in &order {
        let _ = write!(out, " {} p50 / p90 / p99 |", results[i].label);
    }
    out.push_str("\n|---|");
    for _ in &order {
        out.push_str("---|");
    }
    out.push('\n');
    for row in &ROWS {
        let _ = write!(out, "| {} |", row.name);
        for &i in &order {
            let v = sorted(&results[i], row);
            let _ = write!(
                out,
                " {} / {} / {} |",
                ms(percentile(&v, 50.0)),
                ms(percentile(&v, 90.0)),
                ms(percentile(&v, 99.0))
            );
        }
        out.push('\n');
    }
    out
}

/// Endpoint indices, the baseline first, then the others in given order.
fn column_order(n: usize, baseline: usize) -> Vec<usize> {
    std::iter::once(baseline)
        .chain((0..n).filter(|&i| i != baseline))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lc(ms_each: u64) -> Lifecycle {
        let d = Duration::from_millis(ms_each);
        Lifecycle {
            calls: [d; CALLS.len()],
            total: d * CALLS.len() as u32,
        }
    }

    fn measured(label: &str, ms_each: &[u64], churn: Option<Churn>) -> Measured {
        Measured {
            label: label.to_owned(),
            lifecycles: ms_each.iter().map(|&m| lc(m)).collect(),
            failures: Vec::new(),
            churn,
        }
    }

    #[test]
    fn p50_table_puts_the_baseline_first_with_ratios_after_the_others() {
        let churn = |ok, secs, batches: Vec<f64>| Churn {
            concurrency: 4,
            ok,
            failed: 0,
            wall: Duration::from_secs(secs),
            batches,
        };
        let results = vec![
            measured("cubelet", &[5, 5, 5], Some(churn(20, 2, vec![9.0, 11.0]))),
            measured("containerd", &[10, 10, 10], Some(churn(20, 4, vec![5.0]))),
        ];
        let t = p50_table(&results, 1);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "| call (p50 ms) | containerd | cubelet | × containerd |"
        );
        assert_eq!(lines[1], "|---|---|---|---|");
        assert_eq!(lines[2], "| RunPodSandbox | 10.0 | 5.0 | 0.50 |");
        assert!(
            lines.contains(&"| pod to running (the three above) | 30.0 | 15.0 | 0.50 |"),
            "{t}"
        );
        assert!(
            lines.contains(&"| whole lifecycle | 70.0 | 35.0 | 0.50 |"),
            "{t}"
        );
        assert_eq!(
            lines.last().copied(),
            Some("| churn at concurrency 4 (pods/s) | 5.0 | 10.0 (9.0–11.0) | 2.00 |")
        );
    }

    #[test]
    fn spread_table_has_a_column_per_endpoint() {
        let results = vec![
            measured("a", &[1, 2, 3, 4, 100], None),
            measured("b", &[2], None),
        ];
        let t = spread_table(&results, 0);
        assert!(
            t.starts_with("| call (ms) | a p50 / p90 / p99 | b p50 / p90 / p99 |\n|---|---|---|\n"),
            "{t}"
        );
        assert!(
            t.contains("| RunPodSandbox | 3.0 / 100.0 / 100.0 | 2.0 / 2.0 / 2.0 |"),
            "{t}"
        );
    }

    #[test]
    fn an_endpoint_without_data_gets_no_ratio() {
        let results = vec![measured("a", &[1], None), measured("b", &[], None)];
        let t = p50_table(&results, 0);
        assert!(t.contains("| RunPodSandbox | 1.0 | 0.0 | – |"), "{t}");
        assert!(!t.contains("churn"), "{t}");
    }
}
