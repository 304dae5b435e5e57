//! What a run keeps: aggregates only, never one record per request, so memory follows the
//! requests in flight and the number of time buckets, not the requests simulated.

use stormguard_core::Denied;
use stormguard_core::histogram::LogHistogram;

/// A latency histogram: core's log-linear one, 64 buckets per power of two (within 1.6 %), the
/// one `stormguard verify` reads the live latencies with.
pub fn latency_histogram() -> LogHistogram {
    LogHistogram::new(6, u64::MAX)
}

/// What kind of attempt was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sent {
    Primary,
    Retry,
    Hedge,
}

/// Counts for one time bucket.
#[derive(Debug, Clone, Default)]
pub(crate) struct Bucket {
    pub primaries: u64,
    pub retries: u64,
    pub hedges: u64,
    /// Attempts in flight at the dependency × nanoseconds.
    pub in_flight_area: u128,
    pub in_flight_max: u32,
    /// An adaptive cap's working cap × nanoseconds.
    pub cap_area: u128,
    /// Actions that started in this bucket, and how they ended.
    pub actions: u64,
    pub actions_ok: u64,
    pub retries_denied: u64,
}

/// Counts for one segment of the timeline.
#[derive(Debug, Clone, Default)]
pub(crate) struct SegmentStats {
    pub primaries: u64,
    pub retries: u64,
    pub hedges: u64,
    pub in_flight_area: u128,
    pub in_flight_max: u32,
    /// Nanoseconds spent at each in-flight count (index) within the segment.
    pub time_at: Vec<u64>,
    /// An adaptive cap's working cap × nanoseconds.
    pub cap_area: u128,
    pub actions: u64,
    pub actions_ok: u64,
    pub actions_fast: u64,
    pub requests: u64,
    /// Latency of the actions that started in the segment, and of those that succeeded (kept
    /// only when the timeline has more than one segment).
    pub latency: Option<LogHistogram>,
    pub latency_ok: Option<LogHistogram>,
}

/// Everything one policy's run measured.
#[derive(Debug, Clone)]
pub(crate) struct RunStats {
    pub bucket_nanos: u64,
    pub horizon: u64,
    pub buckets: Vec<Bucket>,
    pub segments: Vec<SegmentStats>,
    /// Segment boundaries (start of each), for attributing in-flight time.
    seg_starts: Vec<u64>,
    /// Nanoseconds spent at each in-flight count (index), over `[0, horizon)`.
    pub time_at: Vec<u64>,
    pub in_flight_max: u32,
    // Where the integration of in-flight time has reached, and the count since then.
    last: u64,
    count: u32,
    bucket: usize,
    bucket_end: u64,
    seg: usize,
    pub latency: LogHistogram,
    pub actions: u64,
    pub actions_ok: u64,
    pub actions_fast: u64,
    pub requests: u64,
    pub requests_ok: u64,
    pub primaries: u64,
    pub retries: u64,
    pub timeouts: u64,
    pub rejected: u64,
    pub errors: u64,
    /// Attempts the provider's limits counted, and those it answered 429.
    pub rate_accepted: u64,
    pub rate_limited: u64,
    /// Of `rate_accepted`, those before the end of arrivals.
    pub rate_accepted_in_run: u64,
    /// Tokens the provider counted for the attempts it accepted before the end of arrivals
    /// (when it limits tokens).
    pub tokens_in_run: u64,
    pub retries_denied: [u64; Denied::ALL.len()],
    pub primaries_denied: [u64; Denied::ALL.len()],
    /// Hedges sent, those whose answer was the caller's, and those refused by reason.
    pub hedges: u64,
    pub hedges_won: u64,
    /// Retries callers sent on their own (`client.own_retries`), seen or not.
    pub caller_retries: u64,
    pub hedges_denied: [u64; Denied::ALL.len()],
    /// An adaptive cap's working cap (summed over the policy's limiters) now, the least and
    /// the most it was over `[0, horizon)`; `None` for a fixed cap or none.
    pub cap: Option<CapSeen>,
}

/// An adaptive cap's working cap, as the run saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CapSeen {
    /// Now (at the end of arrivals, once the run is over).
    pub now: u64,
    pub min: u64,
    pub max: u64,
}

impl RunStats {
    pub(crate) fn new(horizon: u64, bucket_nanos: u64, seg_starts: Vec<u64>) -> RunStats {
        let n = horizon.div_ceil(bucket_nanos) as usize;
        RunStats {
            bucket_nanos,
            horizon,
            buckets: vec![Bucket::default(); n],
            segments: vec![
                SegmentStats {
                    latency: (seg_starts.len() > 1).then(latency_histogram),
                    latency_ok: (seg_starts.len() > 1).then(latency_histogram),
                    ..SegmentStats::default()
                };
                seg_starts.len()
            ],
            seg_starts,
            time_at: vec![0; 64],
            in_flight_max: 0,
            last: 0,
            count: 0,
            bucket: 0,
            bucket_end: bucket_nanos.min(horizon),
            seg: 0,
            latency: latency_histogram(),
            actions: 0,
            actions_ok: 0,
            actions_fast: 0,
            requests: 0,
            requests_ok: 0,
            primaries: 0,
            retries: 0,
            timeouts: 0,
            rejected: 0,
            errors: 0,
            rate_accepted: 0,
            rate_limited: 0,
            rate_accepted_in_run: 0,
            tokens_in_run: 0,
            retries_denied: [0; Denied::ALL.len()],
            primaries_denied: [0; Denied::ALL.len()],
            hedges: 0,
            hedges_won: 0,
            caller_retries: 0,
            hedges_denied: [0; Denied::ALL.len()],
            cap: None,
        }
    }

    /// Follows an adaptive cap's working cap from `initial` (before the first event).
    pub(crate) fn follow_cap(&mut self, initial: u64) {
        self.cap = Some(CapSeen { now: initial, min: initial, max: initial });
    }

    /// The working cap changed (after [`advance`](Self::advance) to now). Changes after the
    /// end of arrivals are not counted.
    #[inline]
    pub(crate) fn set_cap(&mut self, cap: u64) {
        if self.last >= self.horizon {
            return;
        }
        if let Some(c) = &mut self.cap {
            c.now = cap;
            c.min = c.min.min(cap);
            c.max = c.max.max(cap);
        }
    }

    /// Integrates the in-flight count up to `now` (called before every change of the count
    /// and at every event, so buckets and segments split exactly).
    #[inline]
    pub(crate) fn advance(&mut self, now: u64) {
        if now <= self.last || self.last >= self.horizon {
            self.last = self.last.max(now);
            return;
        }
        let end = now.min(self.horizon);
        let count = self.count as usize;
        if count >= self.time_at.len() {
            self.time_at.resize(count + 1, 0);
        }
        let cap = self.cap.map_or(0, |c| u128::from(c.now));
        let mut t = self.last;
        while t < end {
            let seg_end = self.seg_starts.get(self.seg + 1).copied().unwrap_or(u64::MAX);
            let stop = end.min(self.bucket_end).min(seg_end);
            let dt = stop - t;
            let area = u128::from(dt) * count as u128;
            self.time_at[count] += dt;
            self.buckets[self.bucket].in_flight_area += area;
            let seg = &mut self.segments[self.seg];
            seg.in_flight_area += area;
            if count >= seg.time_at.len() {
                seg.time_at.resize(count + 1, 0);
            }
            seg.time_at[count] += dt;
            self.buckets[self.bucket].cap_area += u128::from(dt) * cap;
            self.segments[self.seg].cap_area += u128::from(dt) * cap;
            t = stop;
            if t == self.bucket_end && t < self.horizon {
                self.bucket += 1;
                self.bucket_end = (self.bucket_end + self.bucket_nanos).min(self.horizon);
                let b = &mut self.buckets[self.bucket];
                b.in_flight_max = b.in_flight_max.max(self.count);
            }
            if t == seg_end {
                self.seg += 1;
                let s = &mut self.segments[self.seg];
                s.in_flight_max = s.in_flight_max.max(self.count);
            }
        }
        self.last = now;
    }

    /// The dependency's in-flight count changed (after [`advance`](Self::advance) to now).
    #[inline]
    pub(crate) fn set_in_flight(&mut self, count: u32) {
        self.count = count;
        if self.last < self.horizon {
            if count > self.in_flight_max {
                self.in_flight_max = count;
            }
            let b = &mut self.buckets[self.bucket];
            b.in_flight_max = b.in_flight_max.max(count);
            let s = &mut self.segments[self.seg];
            s.in_flight_max = s.in_flight_max.max(count);
        }
    }

    /// The bucket and segment of `t` (clamped to the last), for counts by time.
    #[inline]
    fn current(&self) -> Option<(usize, usize)> {
        (self.last < self.horizon).then_some((self.bucket, self.seg))
    }

    #[inline]
    pub(crate) fn sent(&mut self, kind: Sent) {
        match kind {
            Sent::Primary => self.primaries += 1,
            Sent::Retry => self.retries += 1,
            Sent::Hedge => self.hedges += 1,
        }
        if let Some((b, s)) = self.current() {
            let (b, s) = (&mut self.buckets[b], &mut self.segments[s]);
            match kind {
                Sent::Primary => (b.primaries, s.primaries) = (b.primaries + 1, s.primaries + 1),
                Sent::Retry => (b.retries, s.retries) = (b.retries + 1, s.retries + 1),
                Sent::Hedge => (b.hedges, s.hedges) = (b.hedges + 1, s.hedges + 1),
            }
        }
    }

    pub(crate) fn hedge_denied(&mut self, reason: Denied) {
        self.hedges_denied[reason.index()] += 1;
    }

    /// An attempt reached the provider's limits: counted (`true`) or answered 429. Returns
    /// whether it arrived before the end of arrivals.
    #[inline]
    pub(crate) fn at_provider(&mut self, counted: bool) -> bool {
        let in_run = self.current().is_some();
        if counted {
            self.rate_accepted += 1;
            self.rate_accepted_in_run += u64::from(in_run);
        } else {
            self.rate_limited += 1;
        }
        in_run
    }

    /// The provider counted `used` tokens for an attempt it served (accepted before the end of
    /// arrivals when `in_run`).
    #[inline]
    pub(crate) fn tokens_counted(&mut self, used: u64, in_run: bool) {
        if in_run {
            self.tokens_in_run = self.tokens_in_run.saturating_add(used);
        }
    }

    pub(crate) fn retry_denied(&mut self, reason: Denied) {
        self.retries_denied[reason.index()] += 1;
        if let Some((b, _)) = self.current() {
            self.buckets[b].retries_denied += 1;
        }
    }

    /// Where an action that starts now (the time of the last [`advance`](Self::advance)) is
    /// counted: its bucket and segment.
    #[inline]
    pub(crate) fn place(&self) -> (u32, u32) {
        (self.bucket as u32, self.seg as u32)
    }

    #[inline]
    pub(crate) fn action_done(
        &mut self,
        place: (u32, u32),
        ok: bool,
        fast: bool,
        calls: u32,
        latency: u64,
    ) {
        self.actions += 1;
        self.actions_ok += u64::from(ok);
        self.actions_fast += u64::from(fast);
        self.latency.record(latency);
        let b = &mut self.buckets[place.0 as usize];
        b.actions += 1;
        b.actions_ok += u64::from(ok);
        let s = &mut self.segments[place.1 as usize];
        s.actions += 1;
        s.actions_ok += u64::from(ok);
        s.actions_fast += u64::from(fast);
        s.requests += u64::from(calls);
        if let Some(h) = &mut s.latency {
            h.record(latency);
        }
        if ok && let Some(h) = &mut s.latency_ok {
            h.record(latency);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_time_splits_across_buckets_and_segments() {
        let mut s = RunStats::new(10, 4, vec![0, 6]);
        s.advance(1);
        s.set_in_flight(2);
        s.advance(9);
        s.set_in_flight(0);
        s.advance(20);
        assert_eq!(s.buckets.iter().map(|b| b.in_flight_area).collect::<Vec<_>>(), [6, 8, 2]);
        assert_eq!(s.segments.iter().map(|b| b.in_flight_area).collect::<Vec<_>>(), [10, 6]);
        assert_eq!(s.time_at[..3], [2, 0, 8]);
        assert_eq!(s.in_flight_max, 2);
    }
}
