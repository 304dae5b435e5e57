//! The four signals on a `prometheus-client` registry.
//!
//! Registered explicitly on a registry the caller owns (no global registry), and read from the
//! dependency's snapshot at each scrape: counters and histograms, never quantiles, because
//! percentiles do not add across instances. Every metric is named `stormguard_…` and labelled
//! with `dependency` only (a bounded set: one value per dependency).
//!
//! | signal | metrics |
//! | --- | --- |
//! | retry fraction against the budget | `stormguard_requests_total`, `stormguard_retries_total`, `stormguard_denied_total{reason}`, `stormguard_shadow_denied_total{reason}`, `stormguard_hedges_total`, `stormguard_hedges_won_total`, `stormguard_hedges_denied_total{reason}`, `stormguard_caller_retries_total{outcome="allowed"\|"refused"\|"counted"}`, `stormguard_tree_attempts_total{kind="original"\|"extra_above"\|"extra_here"\|"extra_refunded"}`, `stormguard_budget_percent{policy}` (ratio: of original requests; concurrency: of everything in flight), `stormguard_budget_utilization`, `stormguard_budget_balance` |
//! | in flight at the dependency | `stormguard_in_flight` (histogram, one bucket per integer up to the cap), `stormguard_in_flight_max` (exact high-water mark since the previous scrape), `stormguard_cap` (the cap in force), `stormguard_cap_configured`, `stormguard_queued`, `stormguard_held_slots` |
//! | slot wait | `stormguard_slot_wait_seconds` (histogram; 1 ms and 10 ms are bucket bounds) |
//! | wait versus execution | `stormguard_execution_seconds` (same buckets) |
//! | state | `stormguard_breaker_state{state}`, `stormguard_pushback_hold_seconds`, `stormguard_oldest_permit_seconds`, `stormguard_enforce`, `stormguard_malformed_headers_total{header}` |
//! | adaptive cap (only with one) | `stormguard_cap` is its working cap and `stormguard_cap_configured` its ceiling (as for a fixed cap: the cap in force and the configured one); `stormguard_cap_floor` (its min), `stormguard_cap_adjustments_total{direction="up"\|"down"}` (windows that moved it), `stormguard_cap_latency_seconds{kind="baseline"\|"current"}` (once a window has read them) |
//! | slots that outlive their caller | `stormguard_held_slots` (held now), `stormguard_abandoned_total{outcome="finished"\|"cut"}`, `stormguard_slot_holds_expired_total` (holds that passed before the dependency answered) |
//!
//! With several upstreams each one's series carry an `upstream` label
//! (`stormguard_upstream_in_flight`, `stormguard_upstream_slot_wait_seconds`,
//! `stormguard_upstream_execution_seconds`, `stormguard_upstream_cap`,
//! `stormguard_upstream_effective_cap`, an adaptive cap's `stormguard_upstream_cap_floor`,
//! `stormguard_upstream_cap_adjustments_total` and `stormguard_upstream_cap_latency_seconds`, …),
//! and with a `total_cap` the cap across them has its own (`stormguard_total_in_flight`,
//! `stormguard_total_slot_wait_seconds`, `stormguard_total_execution_seconds`, …). The
//! dependency-level series describe the first upstream. `stormguard_in_flight_max` is this
//! reader's own high-water mark ([`Reader::Metrics`]): `/stats.json` reading does not reset it.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelValue, EncodeMetric, LabelValueEncoder,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use stormguard_core::Denied;
use stormguard_core::histogram::HistogramSnapshot;
use stormguard_http::headers::HeaderKind;

use stormguard_core::adaptive::AdaptiveSnapshot;
use stormguard_core::limiter::{LimiterSnapshot, Reader};
use stormguard_core::signals::{Abandoned, CallerRetryOutcome};

use crate::dependency::{Dependency, DependencySnapshot};

/// Registers `dependency`'s signals on `registry`.
pub fn register(registry: &mut Registry, dependency: &Dependency) {
    registry.register_collector(Box::new(DependencyCollector { dependency: dependency.clone() }));
}

#[derive(Debug)]
struct DependencyCollector {
    dependency: Dependency,
}

/// A label value written escaped (`\\`, `"`, newline): a dependency or upstream name with a
/// quote in it must not break the exposition for every later scrape. Every label set here is
/// made of these, so no value can be written raw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LabelValue<'a>(pub &'a str);

impl EncodeLabelValue for LabelValue<'_> {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        use std::fmt::Write;
        encoder.write_str(&stormguard_core::text::label_value(self.0))
    }
}

/// A series' labels: names and escaped values.
pub type Labels<'a> = Vec<(&'static str, LabelValue<'a>)>;

fn counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(Labels<'_>, u64)],
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in series {
        ConstCounter::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

/// Writes one gauge family: its descriptor and each series. For collectors of other stormguard
/// crates (stormguard-postgres's leak check), so every family is written one way.
pub fn gauge(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(Labels<'_>, f64)],
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in series {
        ConstGauge::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

fn histogram_series(
    m: &mut prometheus_client::encoding::MetricEncoder<'_>,
    labels: &Labels<'_>,
    h: &HistogramSnapshot,
    scale: f64,
) -> std::fmt::Result {
    let buckets: Vec<(f64, u64)> = h
        .bounds
        .iter()
        .map(|b| *b as f64 * scale)
        .chain([f64::MAX])
        .zip(h.counts.iter().copied())
        .collect();
    m.encode_family(labels)?.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
        h.sum as f64 * scale,
        h.count,
        &buckets,
        None,
    )
}

/// Writes one dependency's snapshot.
pub fn encode_snapshot(s: &DependencySnapshot, mut enc: DescriptorEncoder) -> std::fmt::Result {
    let dep = LabelValue(&s.name);
    let base: Labels<'_> = vec![("dependency", dep)];
    let c = &s.counters;
    counter(
        &mut enc,
        "stormguard_requests",
        "Original requests admitted to a slot.",
        &[(base.clone(), c.primaries)],
    )?;
    counter(&mut enc, "stormguard_retries", "Retries sent.", &[(base.clone(), c.retries)])?;
    counter(
        &mut enc,
        "stormguard_not_retryable",
        "Failed attempts whose condition is not in retry_on.",
        &[(base.clone(), c.not_retryable)],
    )?;
    let by_reason = |v: &[u64; Denied::ALL.len()]| -> Vec<(Labels<'_>, u64)> {
        Denied::ALL
            .iter()
            .map(|d| (vec![("dependency", dep), ("reason", LabelValue(d.as_str()))], v[d.index()]))
            .collect()
    };
    counter(&mut enc, "stormguard_denied", "Attempts refused, by reason.", &by_reason(&c.denied))?;
    counter(
        &mut enc,
        "stormguard_shadow_denied",
        "Attempts shadow mode would have refused, by reason.",
        &by_reason(&c.shadow_denied),
    )?;
    counter(
        &mut enc,
        "stormguard_hedges",
        "Hedges sent (a second attempt beside one not answered after hedge_after).",
        &[(base.clone(), c.hedges)],
    )?;
    counter(
        &mut enc,
        "stormguard_hedges_won",
        "Hedges whose answer was the one the caller got.",
        &[(base.clone(), c.hedges_won)],
    )?;
    counter(
        &mut enc,
        "stormguard_hedges_denied",
        "Hedges refused, by reason (the retry rules' reasons).",
        &by_reason(&c.hedge_denied),
    )?;
    let caller: Vec<_> = CallerRetryOutcome::ALL
        .iter()
        .map(|o| {
            (
                vec![("dependency", dep), ("outcome", LabelValue(o.as_str()))],
                c.caller_retries[o.index()],
            )
        })
        .collect();
    counter(
        &mut enc,
        "stormguard_caller_retries",
        "Retries callers sent themselves, seen through the proxy, by what became of them: allowed (charged to the budget, also in stormguard_retries_total), refused (also in stormguard_denied_total), counted (caller_retries = \"count\": sent as first tries).",
        &caller,
    )?;
    let t = &s.tree;
    let tree: Vec<_> = [
        ("original", t.originals),
        ("extra_above", t.extras_above),
        ("extra_here", t.charged),
        ("extra_refunded", t.refunded),
    ]
    .into_iter()
    .map(|(kind, n)| (vec![("dependency", dep), ("kind", LabelValue(kind))], n))
    .collect();
    counter(
        &mut enc,
        "stormguard_tree_attempts",
        "Requests of call trees (a stormguard-tree context) at this dependency, by kind: original (no retry or hedge above; deposits the allowance less one), extra_above (a retry or hedge a hop above sent), extra_here (this hop's retries and hedges charged to the tree), extra_refunded (of those, given back: refused after the charge, never sent). Tree refusals are stormguard_denied_total{reason=\"tree\"}.",
        &tree,
    )?;
    let b = &s.budget;
    if let Some(p) = b.percent {
        // `policy` says what the fraction is a share of: original requests (ratio) or everything
        // in flight (concurrency); the alert rules compare each with its own retry fraction.
        gauge(
            &mut enc,
            "stormguard_budget_percent",
            "The budget's configured fraction: of original requests (policy ratio), or of \
             everything in flight (policy concurrency).",
            &[(vec![("dependency", dep), ("policy", LabelValue(b.policy))], p)],
        )?;
    }
    gauge(
        &mut enc,
        "stormguard_budget_utilization",
        "How much of the retry budget is in use, 0 to 1.",
        &[(base.clone(), b.utilization)],
    )?;
    gauge(
        &mut enc,
        "stormguard_budget_balance",
        "What the budget holds now, in its own unit.",
        &[(base.clone(), b.balance)],
    )?;
    let l = &s.limiter;
    gauge(
        &mut enc,
        "stormguard_cap",
        "The cap in force: the configured cap, or an adaptive cap's working cap, lowered by the \
         dependency's limit header or a fleet lease.",
        &[(base.clone(), l.effective_cap as f64)],
    )?;
    gauge(
        &mut enc,
        "stormguard_cap_configured",
        "The configured cap (an adaptive cap's ceiling).",
        &[(base.clone(), l.cap as f64)],
    )?;
    if let Some(a) = &l.adaptive {
        adaptive(&mut enc, "stormguard", &[(base.clone(), a)])?;
    }
    gauge(
        &mut enc,
        "stormguard_in_flight_now",
        "Attempts in flight now.",
        &[(base.clone(), l.in_flight as f64)],
    )?;
    gauge(
        &mut enc,
        "stormguard_in_flight_max",
        "The most attempts in flight at once since the previous scrape.",
        &[(base.clone(), l.high_water as f64)],
    )?;
    gauge(
        &mut enc,
        "stormguard_queued",
        "Primaries waiting for a slot.",
        &[(base.clone(), l.queued as f64)],
    )?;
    gauge(
        &mut enc,
        "stormguard_held_slots",
        "Slots held for timed-out or abandoned attempts the dependency may still be working on.",
        &[(base.clone(), l.held as f64)],
    )?;
    counter(
        &mut enc,
        "stormguard_slot_holds_expired",
        "Held slots (of timed-out or abandoned attempts) given back because the hold passed before the dependency answered.",
        &[(base.clone(), l.holds_expired)],
    )?;
    let abandoned: Vec<_> = Abandoned::ALL
        .iter()
        .map(|o| (vec![("dependency", dep), ("outcome", LabelValue(o.as_str()))], c.abandoned(*o)))
        .collect();
    counter(
        &mut enc,
        "stormguard_abandoned",
        "Attempts whose caller went away while the dependency worked on them, by how they ended: finished (answered within abandon_hold) or cut.",
        &abandoned,
    )?;
    gauge(
        &mut enc,
        "stormguard_oldest_permit_seconds",
        "Age of the oldest slot in use; one that climbs and never drops is a leak.",
        &[(base.clone(), l.oldest_permit_age.map_or(0.0, |d| d.as_secs_f64()))],
    )?;
    counter(
        &mut enc,
        "stormguard_cap_refused",
        "Retries refused for want of a slot.",
        &[(base.clone(), l.refused_cap)],
    )?;
    signal_histograms(&mut enc, "stormguard", &[(base.clone(), l)])?;
    if let Some(state) = s.breaker {
        let series: Vec<_> = ["closed", "open", "half-open"]
            .iter()
            .map(|n| {
                (
                    vec![("dependency", dep), ("state", LabelValue(n))],
                    f64::from(u8::from(state.as_str() == *n)),
                )
            })
            .collect();
        gauge(
            &mut enc,
            "stormguard_breaker_state",
            "The breaker's state (1 for the current one).",
            &series,
        )?;
    }
    let hold = s.hold_until.map_or(0.0, |u| u.saturating_since(s.at).as_secs_f64());
    gauge(
        &mut enc,
        "stormguard_pushback_hold_seconds",
        "Time left of the dependency's pushback hold on retries.",
        &[(base.clone(), hold)],
    )?;
    gauge(
        &mut enc,
        "stormguard_enforce",
        "1 when enforced, 0 in shadow mode.",
        &[(base.clone(), f64::from(u8::from(s.enforce)))],
    )?;
    let kinds: Vec<_> = HeaderKind::ALL
        .iter()
        .map(|k| {
            (
                vec![("dependency", dep), ("header", LabelValue(k.as_str()))],
                s.malformed_headers.get(*k),
            )
        })
        .collect();
    counter(
        &mut enc,
        "stormguard_malformed_headers",
        "Malformed dependency headers ignored.",
        &kinds,
    )?;
    if !s.others.is_empty() {
        upstreams(s, &mut enc)?;
    }
    rates(s, &mut enc)?;
    Ok(())
}

/// The three histograms of signals 2 to 4 (in flight, slot wait, execution) of one limiter per
/// label set, under `{prefix}_in_flight`, `{prefix}_slot_wait_seconds` and
/// `{prefix}_execution_seconds`.
fn signal_histograms(
    enc: &mut DescriptorEncoder,
    prefix: &str,
    series: &[(Labels<'_>, &LimiterSnapshot)],
) -> std::fmt::Result {
    type Pick = fn(&LimiterSnapshot) -> &HistogramSnapshot;
    let kinds: [(&str, &str, Pick, f64); 3] = [
        (
            "in_flight",
            "Attempts in flight as seen by each admitted attempt.",
            |l| &l.in_flight_histogram,
            1.0,
        ),
        (
            "slot_wait_seconds",
            "Time from asking for a slot to getting it.",
            |l| &l.wait_histogram,
            1e-9,
        ),
        (
            "execution_seconds",
            "Time from admission to release of a slot.",
            |l| &l.execution_histogram,
            1e-9,
        ),
    ];
    for (name, help, pick, scale) in kinds {
        let full = format!("{prefix}_{name}");
        let mut m = enc.encode_descriptor(&full, help, None, MetricType::Histogram)?;
        for (labels, l) in series {
            histogram_series(&mut m, labels, pick(l), scale)?;
        }
    }
    Ok(())
}

/// An adaptive cap's series, one label set per limiter, under `{prefix}_cap_floor`,
/// `{prefix}_cap_adjustments_total{direction}` and `{prefix}_cap_latency_seconds{kind}` (the
/// latencies only once a window has read them). Its working cap is the cap in force
/// (`stormguard_cap`) and its ceiling the configured cap (`stormguard_cap_configured`).
fn adaptive<'a>(
    enc: &mut DescriptorEncoder,
    prefix: &str,
    series: &[(Labels<'a>, &AdaptiveSnapshot)],
) -> std::fmt::Result {
    fn with<'a>(labels: &Labels<'a>, key: &'static str, value: &'static str) -> Labels<'a> {
        let mut l = labels.clone();
        l.push((key, LabelValue(value)));
        l
    }
    gauge(
        enc,
        &format!("{prefix}_cap_floor"),
        "An adaptive cap's floor: the least its working cap falls to.",
        &series.iter().map(|(l, a)| (l.clone(), a.min as f64)).collect::<Vec<_>>(),
    )?;
    let moves: Vec<_> = series
        .iter()
        .flat_map(|(l, a)| {
            [(with(l, "direction", "up"), a.raised), (with(l, "direction", "down"), a.lowered)]
        })
        .collect();
    counter(
        enc,
        &format!("{prefix}_cap_adjustments"),
        "Windows at whose end an adaptive cap's working cap moved, by direction (up, down).",
        &moves,
    )?;
    let latencies: Vec<_> = series
        .iter()
        .flat_map(|(l, a)| {
            [("baseline", a.baseline), ("current", a.current)]
                .into_iter()
                .filter_map(|(kind, d)| Some((with(l, "kind", kind), d?.as_secs_f64())))
        })
        .collect();
    if !latencies.is_empty() {
        gauge(
            enc,
            &format!("{prefix}_cap_latency_seconds"),
            "An adaptive cap's latency readings: the baseline it compares with (Gradient2) and \
             the last window's mean (current).",
            &latencies,
        )?;
    }
    Ok(())
}

/// Rate admission: each upstream's limits per minute (configured or learned from the
/// provider's headers), what is available and reserved now, and any hold, labelled `upstream`
/// (its name, or its index with one unnamed upstream) and `quantity` (`requests`, `tokens`,
/// `input_tokens`, `output_tokens`; a limit not known yet has no series).
fn rates(s: &DependencySnapshot, enc: &mut DescriptorEncoder) -> std::fmt::Result {
    if s.rates.is_empty() {
        return Ok(());
    }
    let dep = LabelValue(&s.name);
    let mut limit = Vec::new();
    let mut available = Vec::new();
    let mut reserved = Vec::new();
    let mut held = Vec::new();
    let mut cooling = Vec::new();
    let mut waits = Vec::new();
    for (name, r) in s.rates_by_upstream() {
        let upstream = LabelValue(name);
        let mut hold = 0.0f64;
        for (quantity, q) in r.quantities() {
            let Some(l) = q.limit else { continue };
            let labels = vec![
                ("dependency", dep),
                ("upstream", upstream),
                ("quantity", LabelValue(quantity)),
            ];
            limit.push((labels.clone(), l as f64));
            available.push((labels.clone(), q.available as f64));
            reserved.push((labels, q.outstanding as f64));
            if let Some(t) = q.held_until {
                hold = hold.max(t.saturating_since(s.at).as_secs_f64());
            }
        }
        held.push((vec![("dependency", dep), ("upstream", upstream)], hold));
        cooling.push((
            vec![("dependency", dep), ("upstream", upstream)],
            f64::from(u8::from(r.cooling)),
        ));
        waits.push((vec![("dependency", dep), ("upstream", upstream)], r.waits, r.waited));
    }
    gauge(
        enc,
        "stormguard_rate_limit_per_minute",
        "Each upstream's rate limit per minute in force: configured, or learned from the provider's headers.",
        &limit,
    )?;
    gauge(
        enc,
        "stormguard_rate_available",
        "Units of each rate limit available now (the provider's remaining, or less).",
        &available,
    )?;
    gauge(
        enc,
        "stormguard_rate_reserved",
        "Units booked by attempts whose answer has not ended.",
        &reserved,
    )?;
    gauge(
        enc,
        "stormguard_rate_held_seconds",
        "Time left of a hold on first tries to each upstream (a 429's reset, a spent quota).",
        &held,
    )?;
    gauge(
        enc,
        "stormguard_rate_cooling",
        "1 while an upstream cools down after an overloaded answer.",
        &cooling,
    )?;
    let counts: Vec<_> = waits.iter().map(|(l, n, _)| (l.clone(), *n)).collect();
    counter(
        enc,
        "stormguard_rate_waits",
        "First tries that waited for their turn in a provider's window.",
        &counts,
    )?;
    let mut m = enc.encode_descriptor(
        "stormguard_rate_wait_seconds",
        "The waits first tries booked in a provider's window, in all.",
        None,
        MetricType::Counter,
    )?;
    for (labels, _, waited) in &waits {
        ConstCounter::new(waited.as_secs_f64()).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

/// With several upstreams: each one's cap, in flight and state, labelled `upstream`. (The
/// dependency-level series above describe the first upstream.)
fn upstreams(s: &DependencySnapshot, enc: &mut DescriptorEncoder) -> std::fmt::Result {
    let dep = LabelValue(&s.name);
    let first = crate::dependency::UpstreamSnapshot {
        name: s.upstream_name.clone().unwrap_or_default(),
        limiter: s.limiter.clone(),
        breaker: s.breaker,
        hold_until: s.hold_until,
    };
    let all: Vec<_> = std::iter::once(&first).chain(&s.others).collect();
    let series =
        |f: &dyn Fn(&crate::dependency::UpstreamSnapshot) -> f64| -> Vec<(Labels<'_>, f64)> {
            all.iter()
                .map(|u| (vec![("dependency", dep), ("upstream", LabelValue(&u.name))], f(u)))
                .collect()
        };
    gauge(
        enc,
        "stormguard_upstream_cap",
        "Each upstream's cap (an adaptive cap's ceiling).",
        &series(&|u| u.limiter.cap as f64),
    )?;
    gauge(
        enc,
        "stormguard_upstream_effective_cap",
        "Each upstream's cap in force (an adaptive cap's working cap; lowered by its stated \
         limit).",
        &series(&|u| u.limiter.effective_cap as f64),
    )?;
    let adaptive_caps: Vec<(Labels<'_>, &AdaptiveSnapshot)> = all
        .iter()
        .filter_map(|u| {
            let labels = vec![("dependency", dep), ("upstream", LabelValue(&u.name))];
            Some((labels, u.limiter.adaptive.as_ref()?))
        })
        .collect();
    if !adaptive_caps.is_empty() {
        adaptive(enc, "stormguard_upstream", &adaptive_caps)?;
    }
    gauge(
        enc,
        "stormguard_upstream_in_flight_now",
        "Attempts in flight at each upstream now.",
        &series(&|u| u.limiter.in_flight as f64),
    )?;
    gauge(
        enc,
        "stormguard_upstream_in_flight_max",
        "The most attempts in flight at each upstream since the previous scrape.",
        &series(&|u| u.limiter.high_water as f64),
    )?;
    counter(
        enc,
        "stormguard_upstream_slot_holds_expired",
        "Held slots at each upstream given back because the hold passed before it answered.",
        &all.iter()
            .map(|u| {
                (
                    vec![("dependency", dep), ("upstream", LabelValue(&u.name))],
                    u.limiter.holds_expired,
                )
            })
            .collect::<Vec<_>>(),
    )?;
    let histograms: Vec<(Labels<'_>, &LimiterSnapshot)> = all
        .iter()
        .map(|u| (vec![("dependency", dep), ("upstream", LabelValue(&u.name))], &u.limiter))
        .collect();
    signal_histograms(enc, "stormguard_upstream", &histograms)?;
    gauge(
        enc,
        "stormguard_upstream_breaker_open",
        "1 while an upstream's breaker is open.",
        &series(&|u| f64::from(u8::from(u.breaker.is_some_and(|b| b.as_str() == "open")))),
    )?;
    gauge(
        enc,
        "stormguard_upstream_pushback_hold_seconds",
        "Time left of each upstream's pushback hold on retries.",
        &series(&|u| u.hold_until.map_or(0.0, |t| t.saturating_since(s.at).as_secs_f64())),
    )?;
    if let Some(t) = &s.total {
        let base: Labels<'_> = vec![("dependency", dep)];
        gauge(
            enc,
            "stormguard_total_cap",
            "The cap across the dependency's upstreams.",
            &[(base.clone(), t.cap as f64)],
        )?;
        gauge(
            enc,
            "stormguard_total_in_flight_now",
            "Attempts in flight across the dependency's upstreams now.",
            &[(base.clone(), t.in_flight as f64)],
        )?;
        gauge(
            enc,
            "stormguard_total_in_flight_max",
            "The most attempts in flight across the upstreams since the previous scrape.",
            &[(base.clone(), t.high_water as f64)],
        )?;
        signal_histograms(enc, "stormguard_total", &[(base, t)])?;
    }
    Ok(())
}

impl Collector for DependencyCollector {
    fn encode(&self, encoder: DescriptorEncoder) -> std::fmt::Result {
        encode_snapshot(&self.dependency.snapshot_for(Reader::Metrics), encoder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dependency::DependencyConfig;

    /// A learned limit is exported once the provider states it, with what is available and
    /// booked; before that the limit has no series.
    #[tokio::test]
    async fn exports_rate_limits_as_the_provider_states_them() {
        let mut c = DependencyConfig::new("llm");
        c.rate.requests_per_minute = Some(600);
        c.rate.learn = true;
        let dep = Dependency::try_new(c).unwrap();
        let encode = |dep: &Dependency| {
            let mut registry = Registry::default();
            register(&mut registry, dep);
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
            text
        };
        let text = encode(&dep);
        let requests = "dependency=\"llm\",upstream=\"0\",quantity=\"requests\"";
        assert!(
            text.contains(&format!("stormguard_rate_limit_per_minute{{{requests}}} 600")),
            "{text}"
        );
        assert!(!text.contains("quantity=\"tokens\""), "no token limit known yet");
        let mut h = http::HeaderMap::new();
        h.insert("x-ratelimit-limit-tokens", "40000".parse().unwrap());
        h.insert("x-ratelimit-remaining-tokens", "39000".parse().unwrap());
        dep.rates()
            .unwrap()
            .observe(dep.now(), &stormguard_http::provider::read_limits(&h).stated());
        let text = encode(&dep);
        let tokens = "dependency=\"llm\",upstream=\"0\",quantity=\"tokens\"";
        assert!(
            text.contains(&format!("stormguard_rate_limit_per_minute{{{tokens}}} 40000")),
            "{text}"
        );
        assert!(text.contains(&format!("stormguard_rate_available{{{tokens}}} 39000")), "{text}");
        assert!(text.contains("stormguard_rate_held_seconds{dependency=\"llm\",upstream=\"0\"} 0"));
    }

    #[tokio::test]
    async fn exports_every_signal_with_bounded_labels() {
        let dep = Dependency::try_new(DependencyConfig::new("payments")).unwrap();
        let _p = dep.upstream().limiter.try_acquire(stormguard_core::AttemptKind::Primary).unwrap();
        let mut registry = Registry::default();
        register(&mut registry, &dep);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for name in [
            "stormguard_requests_total{dependency=\"payments\"}",
            "stormguard_denied_total{dependency=\"payments\",reason=\"budget\"} 0",
            "stormguard_budget_percent{dependency=\"payments\",policy=\"ratio\"} 0.2",
            "stormguard_in_flight_bucket{le=\"1.0\",dependency=\"payments\"} 1",
            "stormguard_slot_wait_seconds_bucket{le=\"0.001\",dependency=\"payments\"} 1",
            "stormguard_slot_wait_seconds_bucket{le=\"0.01\",dependency=\"payments\"} 1",
            "stormguard_in_flight_max{dependency=\"payments\"} 1",
            "stormguard_cap{dependency=\"payments\"} 20",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
        assert!(!text.contains("quantile"));
        assert!(text.lines().filter(|l| !l.starts_with('#')).all(|l| l.starts_with("stormguard_")));
    }

    /// The value of the series `name{labels}` (labels as written, in order) in `text`.
    fn value(text: &str, name: &str, labels: &str) -> Option<f64> {
        let prefix = format!("{name}{{{labels}}} ");
        text.lines().find_map(|l| l.strip_prefix(&prefix)).map(|v| v.parse().unwrap())
    }

    fn scrape(dep: &Dependency) -> String {
        let mut registry = Registry::default();
        register(&mut registry, dep);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    /// An adaptive cap on a manual clock: its floor, the moves of its working cap (the cap in
    /// force) under its ceiling (the configured cap), and its latencies once a window read them.
    /// A fixed cap has none of the adaptive series.
    #[tokio::test]
    async fn exports_an_adaptive_caps_working_cap_moves_and_latencies() {
        use std::sync::Arc;
        use std::time::Duration;
        use stormguard_core::AttemptKind;
        use stormguard_core::adaptive::AdaptiveConfig;
        use stormguard_core::clock::ManualClock;

        let clock = ManualClock::new();
        let mut config = DependencyConfig::new("llm");
        config.limiter.cap = 20;
        config.limiter.adaptive = Some(AdaptiveConfig::new(4, 40));
        let dep = Dependency::with_clock(config, Arc::new(clock.clone())).unwrap();
        let dep_label = "dependency=\"llm\"";
        let down = "dependency=\"llm\",direction=\"down\"";
        let up = "dependency=\"llm\",direction=\"up\"";
        let baseline = "dependency=\"llm\",kind=\"baseline\"";
        let current = "dependency=\"llm\",kind=\"current\"";

        // Before any window: the working cap starts at the cap, nothing moved, no latency.
        let text = scrape(&dep);
        assert_eq!(value(&text, "stormguard_cap", dep_label), Some(20.0), "{text}");
        assert_eq!(value(&text, "stormguard_cap_configured", dep_label), Some(40.0), "{text}");
        assert_eq!(value(&text, "stormguard_cap_floor", dep_label), Some(4.0), "{text}");
        assert_eq!(value(&text, "stormguard_cap_adjustments_total", up), Some(0.0), "{text}");
        assert_eq!(value(&text, "stormguard_cap_adjustments_total", down), Some(0.0), "{text}");
        assert!(!text.contains("stormguard_cap_latency_seconds"), "{text}");

        // One window: ten attempts admitted at once, each refused for overload (a 429) a
        // second later, past the window. A drop window lowers the cap by 10 %: 20 to 18; it
        // read no latency.
        let limiter = &dep.upstream().limiter;
        let window = |answer_after: Duration, overload: bool| {
            let permits: Vec<_> =
                (0..10).map(|_| limiter.try_acquire(AttemptKind::Primary).unwrap()).collect();
            clock.advance(answer_after);
            for mut p in permits {
                p.answered(overload);
            }
        };
        window(Duration::from_secs(1), true);
        let text = scrape(&dep);
        assert_eq!(value(&text, "stormguard_cap", dep_label), Some(18.0), "{text}");
        assert_eq!(value(&text, "stormguard_cap_adjustments_total", down), Some(1.0), "{text}");
        assert_eq!(value(&text, "stormguard_cap_adjustments_total", up), Some(0.0), "{text}");
        assert!(!text.contains("stormguard_cap_latency_seconds"), "{text}");

        // Ten windows answered in 1 s: the baseline, learned while the cap holds still.
        for _ in 0..10 {
            window(Duration::from_secs(1), false);
        }
        let text = scrape(&dep);
        assert_eq!(value(&text, "stormguard_cap", dep_label), Some(18.0), "{text}");
        assert_eq!(value(&text, "stormguard_cap_latency_seconds", baseline), Some(1.0), "{text}");
        assert_eq!(value(&text, "stormguard_cap_latency_seconds", current), Some(1.0), "{text}");

        // A window twice as slow as the baseline: Gradient2 moves a fifth of the way to
        // 0.5 × 18 + 4 = 13, to 17, and the baseline barely moves.
        window(Duration::from_secs(2), false);
        let text = scrape(&dep);
        assert_eq!(value(&text, "stormguard_cap", dep_label), Some(17.0), "{text}");
        assert_eq!(value(&text, "stormguard_cap_configured", dep_label), Some(40.0), "{text}");
        assert_eq!(value(&text, "stormguard_cap_adjustments_total", down), Some(2.0), "{text}");
        assert_eq!(value(&text, "stormguard_cap_latency_seconds", current), Some(2.0), "{text}");
        let b = value(&text, "stormguard_cap_latency_seconds", baseline).unwrap();
        assert!((1.0..1.01).contains(&b), "{b}");

        // A fixed cap: the cap in force and the configured cap, and nothing adaptive.
        let fixed = Dependency::try_new(DependencyConfig::new("fixed")).unwrap();
        let text = scrape(&fixed);
        assert_eq!(value(&text, "stormguard_cap", "dependency=\"fixed\""), Some(20.0));
        assert_eq!(value(&text, "stormguard_cap_configured", "dependency=\"fixed\""), Some(20.0));
        for name in ["stormguard_cap_floor", "stormguard_cap_adjustments", "stormguard_cap_latency"]
        {
            assert!(!text.contains(name), "{name} for a fixed cap:\n{text}");
        }
    }

    /// With several upstreams, each one's adaptive cap under the `upstream` label.
    #[tokio::test]
    async fn exports_each_upstreams_adaptive_cap() {
        use stormguard_core::adaptive::AdaptiveConfig;

        let mut config = DependencyConfig::new("models");
        config.upstreams = [("a", 8), ("b", 50)]
            .map(|(name, cap)| crate::UpstreamSpec { name: name.into(), cap, adaptive: None })
            .to_vec();
        config.limiter.adaptive = Some(AdaptiveConfig::new(4, 40));
        let dep = Dependency::try_new(config).unwrap();
        let text = scrape(&dep);
        for (u, cap) in [("a", 8.0), ("b", 40.0)] {
            let labels = format!("dependency=\"models\",upstream=\"{u}\"");
            let l = labels.as_str();
            // Each working cap starts at its own cap, within [4, 40].
            assert_eq!(value(&text, "stormguard_upstream_effective_cap", l), Some(cap), "{text}");
            assert_eq!(value(&text, "stormguard_upstream_cap", l), Some(40.0), "{text}");
            assert_eq!(value(&text, "stormguard_upstream_cap_floor", l), Some(4.0), "{text}");
            let down = format!("{labels},direction=\"down\"");
            let n = value(&text, "stormguard_upstream_cap_adjustments_total", &down);
            assert_eq!(n, Some(0.0), "{text}");
        }
    }

    /// The percent's `policy` label says what it is a share of; the policies without a percent
    /// (and the fixed `slots` form of concurrency) export none.
    #[tokio::test]
    async fn budget_percent_is_labelled_with_its_policy() {
        let scrape = |spec: &str| {
            let mut config = DependencyConfig::new("payments");
            config.budget = spec.parse().unwrap();
            let dep = Dependency::try_new(config).unwrap();
            let mut registry = Registry::default();
            register(&mut registry, &dep);
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
            text.lines()
                .filter(|l| l.starts_with("stormguard_budget_percent"))
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            scrape("ratio:percent=0.25,min_per_sec=3"),
            ["stormguard_budget_percent{dependency=\"payments\",policy=\"ratio\"} 0.25"]
        );
        assert_eq!(
            scrape("concurrency:percent=0.2,min=3"),
            ["stormguard_budget_percent{dependency=\"payments\",policy=\"concurrency\"} 0.2"]
        );
        for spec in ["concurrency:slots=4", "token-bucket", "quota"] {
            assert_eq!(scrape(spec), Vec::<String>::new(), "{spec}");
        }
    }
}
