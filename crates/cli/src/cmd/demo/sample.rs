//! Sampling both paths once a second while the demo runs: the marks and the series they make.

use super::*;

/// Cumulative counts of one path at the end of a bucket.
#[derive(Debug, Clone, Default)]
pub(super) struct PathMark {
    pub(super) in_flight_sum: u64,
    pub(super) in_flight_samples: u64,
    pub(super) in_flight_max: u64,
    pub(super) requests: u64,
    pub(super) retries: u64,
    pub(super) done: u64,
    pub(super) succeeded: u64,
}

#[derive(Debug, Clone, Default)]
pub(super) struct Mark {
    pub(super) t_s: f64,
    pub(super) naive: PathMark,
    pub(super) guarded: PathMark,
    pub(super) denied: [u64; Denied::ALL.len()],
}

pub(super) struct Sources<'a> {
    pub(super) naive: (&'a ChaosServer, &'a Live),
    pub(super) guarded: (&'a ChaosServer, &'a Live),
    pub(super) dep: &'a stormguard_tower::Dependency,
}

/// Samples both upstreams' in-flight count every 5 ms, and closes a bucket of cumulative counts
/// every `duration / 60` (100 ms to 1 s), until the run's end.
pub(super) async fn sample(
    src: &Sources<'_>,
    plan: &[PhasePlan],
    duration: Duration,
    began: Instant,
    finished: &AtomicBool,
    progress: &Progress,
) -> Vec<Mark> {
    let bucket = (duration / 60).clamp(Duration::from_millis(100), Duration::from_secs(1));
    let mut marks = vec![Mark::default()];
    let mut current = Mark::default();
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut next_close = bucket;
    let mut phase_shown = usize::MAX;
    loop {
        tick.tick().await;
        let elapsed = began.elapsed();
        if elapsed > duration {
            break;
        }
        for (m, up) in [(&mut current.naive, src.naive.0), (&mut current.guarded, src.guarded.0)] {
            let n = up.in_flight();
            m.in_flight_sum += n;
            m.in_flight_samples += 1;
            m.in_flight_max = m.in_flight_max.max(n);
        }
        if elapsed >= next_close {
            next_close += bucket;
            current.t_s = elapsed.as_secs_f64();
            for (m, (up, live)) in
                [(&mut current.naive, src.naive), (&mut current.guarded, src.guarded)]
            {
                let s = up.stats();
                m.requests = s.total.requests;
                m.retries = s.total.retries;
                m.done = live.done.load(Ordering::Relaxed);
                m.succeeded = live.succeeded.load(Ordering::Relaxed);
            }
            current.denied = src.dep.policy().counters().snapshot().denied;
            let phase = plan.iter().rposition(|p| p.start_s <= current.t_s).unwrap_or(0);
            let mean = |m: &PathMark| m.in_flight_sum as f64 / m.in_flight_samples.max(1) as f64;
            let status = format!(
                "{:5.1} s  {:<14} upstream in flight: naive {:5.1}, stormguard {:5.1} (cap {CAP})",
                current.t_s,
                plan[phase].name,
                mean(&current.naive),
                mean(&current.guarded),
            );
            if phase != phase_shown {
                phase_shown = phase;
                progress.line(&format!(
                    "{:5.1} s  phase {}/{}: {} ({})",
                    current.t_s,
                    phase + 1,
                    plan.len(),
                    plan[phase].name,
                    plan[phase].conditions
                ));
            }
            progress.status(&status);
            marks.push(current.clone());
            // The sums and maxima are per bucket; the counts stay cumulative.
            for m in [&mut current.naive, &mut current.guarded] {
                m.in_flight_sum = 0;
                m.in_flight_samples = 0;
                m.in_flight_max = 0;
            }
        }
    }
    while !finished.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    progress.status("");
    marks
}

pub(super) fn delta(a: u64, b: u64) -> f64 {
    b.saturating_sub(a) as f64
}

pub(super) fn series(marks: &[Mark]) -> Series {
    let mut s = Series::default();
    let mut denied: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    for w in marks.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        let dt = (b.t_s - a.t_s).max(1e-9);
        s.t_s.push(b.t_s);
        for (path, pa, pb) in
            [(&mut s.naive, &a.naive, &b.naive), (&mut s.stormguard, &a.guarded, &b.guarded)]
        {
            path.in_flight_mean.push(pb.in_flight_sum as f64 / pb.in_flight_samples.max(1) as f64);
            path.in_flight_max.push(pb.in_flight_max);
            path.attempts_per_s.push(delta(pa.requests, pb.requests) / dt);
            let retries = delta(pa.retries, pb.retries);
            let firsts = delta(pa.requests, pb.requests) - retries;
            path.retry_fraction.push(if firsts > 0.0 { retries / firsts } else { 0.0 });
            let done = delta(pa.done, pb.done);
            path.success_rate.push((done > 0.0).then(|| delta(pa.succeeded, pb.succeeded) / done));
        }
        for d in Denied::ALL {
            let n = delta(a.denied[d.index()], b.denied[d.index()]) / dt;
            denied.entry(d.as_str()).or_default().push(n);
        }
    }
    denied.retain(|_, v| v.iter().any(|x| *x > 0.0));
    s.denied_per_s = denied;
    s
}
