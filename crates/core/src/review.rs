//! Choosing a budget from history: what the retry ratio was when all was well, when it was not,
//! and what each candidate budget would have done — the arithmetic of `stormguard review`.
//!
//! "Start by measuring the retry ratio under normal load … the budget has to sit above the normal
//! retry ratio with enough margin that ordinary jitter does not exhaust it … Review budgets after
//! each incident." The history is a series of equal steps, each with the original requests and
//! the retries sent in it, the retries a budget shed, and (when known) the most in flight at the
//! dependency; it comes from Prometheus or from a recorded trace (the CLI reads both).
//!
//! **Quiet and incident steps.** A step's retry ratio is its retries over its original requests
//! (steps without originals are neither). A step is part of an incident when its ratio is above
//! both three times the run's median ratio and the median plus five points
//! ([`INCIDENT_FACTOR`], [`INCIDENT_POINTS`]); incident steps no more than one quiet step apart
//! are one incident. The step on each side of an incident straddles its edge (an incident starts
//! where it will, not on a step's boundary) and is neither. The rest are quiet: the **normal
//! ratio** is theirs (retries over originals, summed), with the p50, p95 and max of their
//! per-step ratios.
//!
//! **The sweep.** Each candidate ratio budget (a percent of originals and a floor of retries per
//! second, over the default 10 s window) is replayed over the steps as the ratio budget keeps its
//! balance: in a step, the retries it allows are the fewer of those asked (sent plus shed) and
//! `floor × ttl + percent × originals − retries allowed`, both over the window's steps. Its shed
//! is told apart in quiet steps, incident steps, and the quiet steps within a window after an
//! incident (the budget still spent: the budget working, not jitter). The in flight it would have
//! left at the dependency scales the step's observed in-flight by the attempts it allows over the
//! attempts that were sent (Little's law at the same latency). This is an approximation — steps
//! are not the budget's slices, and a retry refused changes what follows — and said to be one; a
//! recorded trace can be replayed through the policies themselves (`stormguard replay`).
//!
//! **The recommendation.** The smallest candidate (by percent, then floor) whose percent is at
//! least [`ReviewConfig::margin`] times the quiet steps' p95 ratio and which sheds no retry in a
//! quiet step (outside an incident's aftermath), and whose estimated in-flight never passes the cap. If none keeps the in-flight
//! under the cap, the smallest that passes the quiet rule, said so (the cap is then what bounds
//! the dependency, and the budget only what it spends).

use std::time::Duration;

/// The candidates' window (the ratio budget's default `ttl`).
pub const TTL: Duration = crate::defaults::RATIO_TTL;

/// A step is an incident step above this many times the run's median ratio …
pub const INCIDENT_FACTOR: f64 = 3.0;
/// … and above the median plus this (five points).
pub const INCIDENT_POINTS: f64 = 0.05;

/// One step of history.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Step {
    /// Its start, in seconds (Unix time from Prometheus, or since the trace's start).
    pub at: f64,
    /// Original requests in the step.
    pub originals: f64,
    /// Retries sent in the step.
    pub retries: f64,
    /// Retries a budget refused in the step.
    pub shed: f64,
    /// The most in flight at the dependency in the step, when known.
    pub in_flight: Option<f64>,
}

impl Step {
    /// Its retry ratio, or `None` without originals.
    pub fn ratio(&self) -> Option<f64> {
        (self.originals > 0.0).then(|| self.retries / self.originals)
    }
}

/// One dependency's history.
#[derive(Debug, Clone, PartialEq)]
pub struct History {
    /// The steps' length.
    pub step: Duration,
    /// The steps, in time order.
    pub steps: Vec<Step>,
    /// The dependency's cap, when known.
    pub cap: Option<f64>,
}

/// What to sweep, and the margin over normal jitter.
#[derive(Debug, Clone, PartialEq)]
pub struct ReviewConfig {
    /// A candidate's percent must be at least this many times the quiet p95 ratio (default 2).
    pub margin: f64,
    /// Candidate percents, as fractions.
    pub percents: Vec<f64>,
    /// Candidate floors, retries per second.
    pub floors: Vec<f64>,
}

impl Default for ReviewConfig {
    fn default() -> Self {
        ReviewConfig {
            margin: 2.0,
            percents: vec![0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5],
            floors: vec![0.0, 1.0, 3.0, 10.0],
        }
    }
}

/// The ratio when all was well.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Normal {
    /// Retries over originals, summed over the quiet steps.
    pub ratio: f64,
    /// The quiet steps' per-step ratios: median, 95th percentile, most.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// Most.
    pub max: f64,
    /// How many quiet steps.
    pub steps: usize,
    /// The ratio above which a step was an incident's.
    pub threshold: f64,
}

/// An incident: consecutive steps above the threshold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Incident {
    /// Its first step's start.
    pub start: f64,
    /// Its last step's end.
    pub end: f64,
    /// The highest step ratio in it.
    pub peak_ratio: f64,
    /// When that step began.
    pub peak_at: f64,
    /// Retries over originals across it.
    pub ratio: f64,
}

/// The in-flight steps at the dependency.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InFlight {
    /// 95th percentile of the steps' most in flight.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Most.
    pub max: f64,
}

/// What the configured budget did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Exhausted {
    /// The first step in which it shed a retry.
    pub first_at: f64,
    /// Retries it shed in all.
    pub shed: f64,
    /// Of those, in quiet steps.
    pub shed_quiet: f64,
}

/// One candidate budget, replayed.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Candidate {
    /// Its percent of originals, as a fraction.
    pub percent: f64,
    /// Its floor, retries per second.
    pub floor: f64,
    /// Retries per second it would have allowed in the step with the most asked.
    pub allowed_at_peak: f64,
    /// The most in flight it would have left at the dependency (estimated), when in-flight is
    /// known.
    pub in_flight: Option<f64>,
    /// Retries it would have shed in quiet steps.
    pub shed_quiet: f64,
    /// Retries it would have shed in incident steps.
    pub shed_incident: f64,
    /// Retries it would have shed in the quiet steps right after an incident, while its window
    /// still held the incident's retries (not counted against it: that is the budget working).
    pub shed_after: f64,
    /// Its percent clears the margin over the quiet p95, and it sheds nothing quiet.
    pub above_jitter: bool,
    /// Its estimated in-flight stays within the cap (true when either is unknown).
    pub under_cap: bool,
}

impl Candidate {
    /// Its SPEC, `ratio:percent=…,min_per_sec=…`.
    pub fn spec(&self) -> String {
        format!(
            "ratio:percent={},min_per_sec={}",
            crate::format::number(self.percent, 4),
            crate::format::number(self.floor, 3)
        )
    }
}

/// What the history says.
#[derive(Debug, Clone, PartialEq)]
pub struct Review {
    /// The ratio when all was well.
    pub normal: Normal,
    /// The incidents, in time order.
    pub incidents: Vec<Incident>,
    /// In flight at the dependency, when known.
    pub in_flight: Option<InFlight>,
    /// The cap, when known.
    pub cap: Option<f64>,
    /// What the configured budget shed, if it shed anything.
    pub exhausted: Option<Exhausted>,
    /// Every candidate, by percent then floor.
    pub candidates: Vec<Candidate>,
    /// The recommended candidate's index, and whether it also keeps in flight under the cap.
    pub recommended: Option<(usize, bool)>,
    /// The candidates were run through their policies over the recorded events
    /// ([`review_with`]), not by the arithmetic.
    pub replayed: bool,
}

/// The `q` quantile of `values` (nearest rank; 0 for none).
fn quantile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// Reads `history` (see the [module docs](self)), each candidate by the budget's arithmetic over
/// the steps.
pub fn review(history: &History, config: &ReviewConfig) -> Review {
    review_with(history, config, None)
}

/// The retries a candidate `(percent, floor)` allows in each step, found by running its policy
/// itself over the events the history was made of (`stormguard replay`'s machinery over a
/// trace), one figure per step of the history.
pub type Replayed<'a> = &'a dyn Fn(f64, f64) -> Vec<f64>;

/// [`review`], each candidate's allowed retries per step from `replayed` when given: the
/// candidates are then the policy's own decisions, not the arithmetic's.
pub fn review_with(
    history: &History,
    config: &ReviewConfig,
    replayed: Option<Replayed<'_>>,
) -> Review {
    let steps = &history.steps;
    let ratios: Vec<f64> = steps.iter().filter_map(Step::ratio).collect();
    let median = quantile(&ratios, 0.5);
    let threshold = (median * INCIDENT_FACTOR).max(median + INCIDENT_POINTS);
    let incident: Vec<bool> =
        steps.iter().map(|s| s.ratio().is_some_and(|r| r > threshold)).collect();
    // Incident steps one quiet step apart are one incident; that step is the incident's too.
    let mut marked = incident.clone();
    for i in 1..steps.len().saturating_sub(1) {
        if !incident[i] && incident[i - 1] && incident[i + 1] {
            marked[i] = true;
        }
    }
    let secs = history.step.as_secs_f64();
    let mut incidents: Vec<Incident> = Vec::new();
    let mut open: Option<(usize, usize)> = None;
    for i in 0..=steps.len() {
        match (open, marked.get(i).copied().unwrap_or(false)) {
            (None, true) => open = Some((i, i)),
            (Some((a, _)), true) => open = Some((a, i)),
            (Some((a, b)), false) => {
                let span = &steps[a..=b];
                let (o, r) =
                    span.iter().fold((0.0, 0.0), |(o, r), s| (o + s.originals, r + s.retries));
                let peak = span
                    .iter()
                    .filter_map(|s| s.ratio().map(|r| (r, s.at)))
                    .max_by(|x, y| x.0.total_cmp(&y.0))
                    .unwrap_or((0.0, span[0].at));
                incidents.push(Incident {
                    start: span[0].at,
                    end: span[span.len() - 1].at + secs,
                    peak_ratio: peak.0,
                    peak_at: peak.1,
                    ratio: if o > 0.0 { r / o } else { 0.0 },
                });
                open = None;
            }
            (None, false) => {}
        }
    }
    // The steps next to an incident straddle its edges (an incident starts and ends where it
    // will, not on a step's boundary): neither quiet nor the incident's. For the candidates'
    // shed they count with the incident.
    let edge: Vec<bool> = (0..steps.len())
        .map(|i| {
            !marked[i] && ((i > 0 && marked[i - 1]) || marked.get(i + 1).copied().unwrap_or(false))
        })
        .collect();
    let quiet: Vec<&Step> = steps
        .iter()
        .enumerate()
        .filter(|(i, s)| !marked[*i] && !edge[*i] && s.originals > 0.0)
        .map(|(_, s)| s)
        .collect();
    let loud: Vec<bool> = marked.iter().zip(&edge).map(|(m, e)| *m || *e).collect();
    let quiet_ratios: Vec<f64> = quiet.iter().filter_map(|s| s.ratio()).collect();
    let (qo, qr) = quiet.iter().fold((0.0, 0.0), |(o, r), s| (o + s.originals, r + s.retries));
    let normal = Normal {
        ratio: if qo > 0.0 { qr / qo } else { 0.0 },
        p50: quantile(&quiet_ratios, 0.5),
        p95: quantile(&quiet_ratios, 0.95),
        max: quiet_ratios.iter().copied().fold(0.0, f64::max),
        steps: quiet.len(),
        threshold,
    };
    let flights: Vec<f64> = steps.iter().filter_map(|s| s.in_flight).collect();
    let in_flight = (!flights.is_empty()).then(|| InFlight {
        p95: quantile(&flights, 0.95),
        p99: quantile(&flights, 0.99),
        max: flights.iter().copied().fold(0.0, f64::max),
    });
    let exhausted = steps.iter().position(|s| s.shed > 0.0).map(|first| Exhausted {
        first_at: steps[first].at,
        shed: steps.iter().map(|s| s.shed).sum(),
        shed_quiet: steps.iter().zip(&loud).filter(|(_, m)| !**m).map(|(s, _)| s.shed).sum(),
    });
    let mut candidates = Vec::new();
    for &percent in &config.percents {
        for &floor in &config.floors {
            let allowed = replayed.map(|r| r(percent, floor));
            let rule = (&normal, config.margin);
            candidates.push(candidate(history, &loud, (percent, floor), rule, allowed.as_deref()));
        }
    }
    let pick = |c: &Candidate, cap: bool| c.above_jitter && (!cap || c.under_cap);
    let recommended = candidates
        .iter()
        .position(|c| pick(c, true))
        .map(|i| (i, true))
        .or_else(|| candidates.iter().position(|c| pick(c, false)).map(|i| (i, false)))
        .or_else(|| candidates.len().checked_sub(1).map(|i| (i, candidates[i].under_cap)));
    Review {
        normal,
        incidents,
        in_flight,
        cap: history.cap,
        exhausted,
        candidates,
        recommended,
        replayed: replayed.is_some(),
    }
}

/// One candidate over the steps (`marked`: the incident steps and their edges), as the ratio
/// budget keeps its
/// balance: `floor × ttl + percent × originals − retries`, each counted for [`TTL`] (the last
/// `ttl / step` steps, this one included).
fn candidate(
    history: &History,
    marked: &[bool],
    (percent, floor): (f64, f64),
    (normal, margin): (&Normal, f64),
    replayed: Option<&[f64]>,
) -> Candidate {
    let secs = history.step.as_secs_f64();
    let window = if secs > 0.0 { ((TTL.as_secs_f64() / secs).round() as usize).max(1) } else { 1 };
    let (mut shed_quiet, mut shed_incident, mut shed_after) = (0.0, 0.0, 0.0);
    let (mut peak_asked, mut allowed_at_peak) = (-1.0, 0.0);
    let mut in_flight: Option<f64> = None;
    let mut allowed_steps: Vec<f64> = Vec::with_capacity(history.steps.len());
    // Steps since the last incident step ended (`None`: none yet).
    let mut since_incident: Option<usize> = None;
    for (i, (s, incident)) in history.steps.iter().zip(marked).enumerate() {
        let from = (i + 1).saturating_sub(window);
        let deposits: f64 = history.steps[from..=i].iter().map(|s| s.originals).sum();
        let withdrawn: f64 = allowed_steps[from..i].iter().sum();
        // The reserve over the window the steps stand for (`floor × ttl` when the step divides
        // the ttl).
        let reserve = floor * window as f64 * secs;
        let balance = (reserve + percent * deposits - withdrawn).max(0.0);
        let asked = s.retries + s.shed;
        let allowed = match replayed {
            Some(r) => r.get(i).copied().unwrap_or(0.0).min(asked),
            None => asked.min(balance.floor()),
        };
        allowed_steps.push(allowed);
        let shed = asked - allowed;
        since_incident = if *incident { Some(0) } else { since_incident.map(|n| n + 1) };
        match (*incident, since_incident) {
            (true, _) => shed_incident += shed,
            // Its window still holds the incident's retries.
            (false, Some(n)) if n < window => shed_after += shed,
            (false, _) => shed_quiet += shed,
        }
        if asked > peak_asked {
            peak_asked = asked;
            allowed_at_peak = if secs > 0.0 { allowed / secs } else { allowed };
        }
        if let Some(f) = s.in_flight {
            let sent = s.originals + s.retries;
            let estimate = if sent > 0.0 { f * (s.originals + allowed) / sent } else { f };
            in_flight = Some(in_flight.map_or(estimate, |m| m.max(estimate)));
        }
    }
    let above_jitter = percent >= margin * normal.p95 && shed_quiet < 0.5;
    let under_cap = match (in_flight, history.cap) {
        (Some(f), Some(cap)) => f <= cap,
        _ => true,
    };
    Candidate {
        percent,
        floor,
        allowed_at_peak,
        in_flight,
        shed_quiet,
        shed_incident,
        shed_after,
        above_jitter,
        under_cap,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(at: f64, originals: f64, retries: f64, in_flight: f64) -> Step {
        Step { at, originals, retries, shed: 0.0, in_flight: Some(in_flight) }
    }

    /// 60 quiet steps at 2 % (100 originals, 2 retries), 10 at 40 %, 30 quiet again.
    fn history() -> History {
        let mut steps = Vec::new();
        for i in 0..100 {
            let (r, f) = if (60..70).contains(&i) { (40.0, 14.0) } else { (2.0, 10.0) };
            steps.push(step(i as f64, 100.0, r, f));
        }
        History { step: Duration::from_secs(1), steps, cap: Some(12.0) }
    }

    #[test]
    fn the_incident_is_found_and_the_normal_ratio_is_the_quiet_steps() {
        let r = review(&history(), &ReviewConfig::default());
        assert_eq!(r.incidents.len(), 1);
        let i = r.incidents[0];
        assert_eq!((i.start, i.end), (60.0, 70.0));
        assert!((i.peak_ratio - 0.4).abs() < 1e-9);
        assert!((r.normal.ratio - 0.02).abs() < 1e-9, "{:?}", r.normal);
        // 100 steps less the incident's 10 and the one on each side of it.
        assert_eq!(r.normal.steps, 88);
        assert_eq!(r.in_flight.unwrap().max, 14.0);
    }

    #[test]
    fn the_recommendation_clears_jitter_and_keeps_in_flight_under_the_cap() {
        let mut h = history();
        h.cap = Some(14.0);
        let r = review(&h, &ReviewConfig::default());
        let (i, under) = r.recommended.unwrap();
        let c = r.candidates[i];
        // 2 × the quiet p95 (2 %) is 4 %: 5 % clears it. The window holds 1 000 originals and
        // 18 retries when the incident begins: 32 of the 40 asked are allowed in its first step
        // (in flight 14 × 132 / 140 = 13.2, under the cap of 14), then what 5 % of the
        // window's deposits leaves.
        assert_eq!((c.percent, c.floor), (0.05, 0.0));
        assert!(under && c.under_cap);
        assert!((c.in_flight.unwrap() - 13.2).abs() < 1e-9, "{c:?}");
        assert_eq!(c.shed_quiet, 0.0);
        assert_eq!(c.shed_incident, 350.0, "{c:?}");
        assert_eq!(c.spec(), "ratio:percent=0.05,min_per_sec=0");
        // A cap no candidate keeps: the recommendation says so.
        h.cap = Some(12.0);
        let r = review(&h, &ReviewConfig::default());
        let (i, under) = r.recommended.unwrap();
        assert!(
            !under,
            "no candidate keeps 13.2 in flight under a cap of 12: {:?}",
            r.candidates[i]
        );
        assert!(r.candidates[i].above_jitter);
    }

    #[test]
    fn a_budget_under_the_quiet_jitter_is_not_recommended() {
        let mut h = history();
        // Quiet steps jitter up to 6 %.
        for (i, s) in h.steps.iter_mut().enumerate() {
            if i < 60 && i % 10 == 0 {
                s.retries = 6.0;
            }
        }
        let r = review(&h, &ReviewConfig::default());
        let c = r.candidates[r.recommended.unwrap().0];
        assert!(c.percent >= 2.0 * r.normal.p95, "{c:?} {:?}", r.normal);
        assert!(
            r.candidates.iter().any(|c| c.percent == 0.05 && c.floor == 0.0 && !c.above_jitter)
        );
    }

    #[test]
    fn what_the_configured_budget_shed_is_reported() {
        let mut h = history();
        h.steps[62].shed = 7.0;
        h.steps[5].shed = 1.0;
        let e = review(&h, &ReviewConfig::default()).exhausted.unwrap();
        assert_eq!((e.first_at, e.shed, e.shed_quiet), (5.0, 8.0, 1.0));
    }
}
