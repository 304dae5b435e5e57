//! The side-by-side table printed at the end.

use super::*;

pub(super) fn by_reason(m: &BTreeMap<&'static str, u64>) -> String {
    if m.is_empty() {
        return "0".to_string();
    }
    m.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
}

/// Seconds with a decimal only when they need one.
pub(super) fn secs(x: f64) -> String {
    if (x - x.round()).abs() < 0.05 { format!("{x:.0}") } else { format!("{x:.1}") }
}

pub(super) fn pct(x: f64) -> String {
    stormguard_core::format::percent(x, 1)
}

/// The side-by-side table.
pub fn table(s: &Summary) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "stormguard demo: {} requests/s for {:.0} s on each path; cap {} ({} planned in flight), budget {} of first tries",
        s.rate_per_s,
        s.duration_s,
        s.cap,
        s.planned_primary,
        stormguard_core::format::percent_trimmed(s.budget_percent, 2)
    );
    for p in &s.phases {
        let span = format!("{}–{} s", secs(p.plan.start_s), secs(p.plan.end_s));
        let _ = writeln!(t, "  {span:>12}  {:<14} {}", p.plan.name, p.plan.conditions);
    }
    let _ = writeln!(t);
    let (n, g) = (&s.naive, &s.stormguard);
    let rows: Vec<(&str, String, String, String)> = vec![
        (
            "upstream in flight, mean",
            format!("{:.1}", n.in_flight.mean),
            format!("{:.1}", g.in_flight.mean),
            format!("cap {}", s.cap),
        ),
        (
            "upstream in flight, p99",
            n.in_flight.p99.to_string(),
            g.in_flight.p99.to_string(),
            format!("cap {}", s.cap),
        ),
        (
            "upstream in flight, max",
            n.in_flight.max.to_string(),
            g.in_flight.max.to_string(),
            format!("cap {}", s.cap),
        ),
        (
            "load amplification",
            format!("{:.3}", n.amplification),
            format!("{:.3}", g.amplification),
            format!("budget {:.2}", 1.0 + s.budget_percent),
        ),
        ("requests sent", n.sent.to_string(), g.sent.to_string(), String::new()),
        (
            "attempts at the upstream",
            n.upstream_requests.to_string(),
            g.upstream_requests.to_string(),
            String::new(),
        ),
        (
            "  of which retries",
            n.upstream_retries.to_string(),
            g.upstream_retries.to_string(),
            String::new(),
        ),
        ("success rate", pct(n.success_rate), pct(g.success_rate), String::new()),
        (
            "latency p50 / p99 ms",
            format!("{:.0} / {:.0}", n.latency_p50_ms, n.latency_p99_ms),
            format!("{:.0} / {:.0}", g.latency_p50_ms, g.latency_p99_ms),
            String::new(),
        ),
        ("retries denied", "–".to_string(), by_reason(&g.retries_denied), String::new()),
        ("first tries shed", "–".to_string(), by_reason(&g.primaries_shed), String::new()),
    ];
    let _ = writeln!(t, "{:<26} {:>18} {:>26}", "", "naive retry-once", "stormguard");
    for (label, a, b, note) in rows {
        let _ = writeln!(t, "{label:<26} {a:>18} {b:>26}   {note}");
    }
    let _ = writeln!(t);
    let _ = writeln!(t, "by phase: upstream in flight mean / max, amplification, success");
    let _ = writeln!(t, "{:<15} {:>34} {:>34}", "", "naive retry-once", "stormguard");
    let cell = |p: &PhasePath| {
        format!(
            "{:5.1} / {:<4} {:5.2}  {:>8}",
            p.in_flight_mean,
            p.in_flight_max,
            p.amplification,
            p.success_rate.map_or("–".to_string(), pct)
        )
    };
    for p in &s.phases {
        let _ =
            writeln!(t, "{:<15} {:>34} {:>34}", p.plan.name, cell(&p.naive), cell(&p.stormguard));
    }
    let _ = writeln!(
        t,
        "\nEach upstream works on {WORKERS} requests at full speed and slows down for every caller past\n\
         that, as a real dependency does. The naive path's retries push it there; the slowdown\n\
         turns into more timeouts and more retries, and the storm outlives its cause. The cap and\n\
         the budget keep what the dependency sees to what was planned, and shed the rest at once."
    );
    if let Some(r) = &s.report {
        let _ = writeln!(t, "\nreport: {r}");
    }
    t
}
