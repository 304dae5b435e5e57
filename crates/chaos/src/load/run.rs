//! Driving the load: closed-loop workers and open-loop arrivals.

use super::*;

pub(super) struct Run {
    pub(super) addr: SocketAddr,
    pub(super) template: Template,
    pub(super) timeout: Duration,
    pub(super) live: Arc<LiveRef>,
    pub(super) tallies: Tallies,
}

/// `Live` is borrowed by the caller; the tasks need `'static`, so they count into this and the
/// caller's `Live` is updated from it as they go.
#[derive(Debug, Default)]
pub(super) struct LiveRef {
    pub(super) inner: Live,
    pub(super) idle: Notify,
}

pub(super) async fn closed_loop(
    run: Arc<Run>,
    concurrency: usize,
    requests: Option<u64>,
    deadline: Option<Instant>,
) -> u64 {
    let tickets = Arc::new(AtomicU64::new(0));
    let limit = requests.unwrap_or(u64::MAX);
    let workers: Vec<JoinHandle<()>> = (0..concurrency)
        .map(|w| tokio::spawn(closed_worker(run.clone(), w, tickets.clone(), limit, deadline)))
        .collect();
    for w in workers {
        let _ = w.await;
    }
    run.live.inner.scheduled.load(Ordering::Relaxed)
}

pub(super) async fn open_loop(
    run: Arc<Run>,
    rate: Rate,
    max_outstanding: usize,
    requests: Option<u64>,
    duration: Option<Duration>,
    start: Instant,
) -> u64 {
    let per_s = rate.per_second();
    // The timetable: arrival i at start + i / rate, for every i before the end of the duration.
    let slots_in_duration = duration.map_or(u64::MAX, |d| (d.as_secs_f64() * per_s).ceil() as u64);
    let total = slots_in_duration.min(requests.unwrap_or(u64::MAX));
    let at = |i: u64| start + Duration::from_secs_f64(i as f64 / per_s);
    let pool: Arc<Mutex<Vec<Conn>>> = Arc::new(Mutex::new(Vec::new()));
    let done_scheduling = Arc::new(AtomicBool::new(false));
    let live = &run.live.inner;
    let mut dropped = 0u64;
    let mut i = 0u64;
    while i < total {
        tokio::time::sleep_until(at(i)).await;
        // Every arrival due by now goes out now: a late wake-up sends a burst, never fewer.
        let now = Instant::now();
        while i < total && at(i) <= now {
            let scheduled = at(i);
            live.scheduled.fetch_add(1, Ordering::Relaxed);
            if live.outstanding.load(Ordering::Acquire) >= max_outstanding as u64 {
                dropped += 1;
                live.done.fetch_add(1, Ordering::Relaxed);
            } else {
                live.outstanding.fetch_add(1, Ordering::AcqRel);
                let (run, pool, done_scheduling) =
                    (run.clone(), pool.clone(), done_scheduling.clone());
                let shard = i as usize;
                tokio::spawn(async move {
                    let mut slot = pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
                    let (outcome, sent) =
                        timed_exchange(&mut slot, run.addr, &run.template, run.timeout).await;
                    run.tallies.record(shard, outcome, sent, scheduled.elapsed());
                    if let Some(c) = slot {
                        pool.lock().unwrap_or_else(|e| e.into_inner()).push(c);
                    }
                    let live = &run.live.inner;
                    live.done.fetch_add(1, Ordering::Relaxed);
                    if matches!(outcome, Outcome::Status(200..=299)) {
                        live.succeeded.fetch_add(1, Ordering::Relaxed);
                    }
                    // AcqRel: the last one out sees the scheduler's flag, or the scheduler sees 0.
                    if live.outstanding.fetch_sub(1, Ordering::AcqRel) == 1
                        && done_scheduling.load(Ordering::Acquire)
                    {
                        run.live.idle.notify_one();
                    }
                });
            }
            i += 1;
        }
    }
    done_scheduling.store(true, Ordering::Release);
    // Each request has its own timeout, so this wait is bounded by it.
    while live.outstanding.load(Ordering::Acquire) > 0 {
        let _ = tokio::time::timeout(Duration::from_millis(20), run.live.idle.notified()).await;
    }
    pool.lock().unwrap_or_else(|e| e.into_inner()).clear();
    if dropped > 0 {
        let mut t = run.tallies.shards[0].lock().unwrap_or_else(|e| e.into_inner());
        t.outcomes.dropped += dropped;
    }
    total.min(live.scheduled.load(Ordering::Relaxed))
}
