//! Each change of a fleet's mode is one log line, and a renewal that changes nothing logs
//! nothing: joining, Redis killed until the lease expires (fallback, `warn`), Redis back empty
//! (the data-loss line, which says it goes quiet), and the quiet period over. The worker is
//! ticked by hand, so the order is chosen, not raced; a test layer records every event.
//!
//! A test binary of its own (the crate's other tests are one binary, `tests/it`): it installs
//! `tracing` dispatchers, and `tracing`'s callsite interest is process-wide, so tests running
//! beside it in one process could leave a callsite it records disabled.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use stormguard_core::clock::MonotonicClock;
use stormguard_core::limiter::{Limiter, LimiterConfig};
use stormguard_redis::resp::Connection;
use stormguard_redis::server::RedisProcess;
use stormguard_redis::{Fleet, FleetConfig, FleetMode};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};

/// (level, message, mode) of every event.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<(Level, String, String)>>>);

struct Fields {
    message: String,
    mode: String,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "mode" {
            self.mode = value.to_string();
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        }
    }
}

impl<S: Subscriber> tracing_subscriber::Layer<S> for Lines {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let mut f = Fields { message: String::new(), mode: String::new() };
        event.record(&mut f);
        self.0.lock().unwrap().push((*event.metadata().level(), f.message, f.mode));
    }
}

impl Lines {
    /// The lines since the last call.
    fn take(&self) -> Vec<(Level, String, String)> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

#[tokio::test]
async fn each_fleet_mode_change_is_one_line() {
    let lines = Lines::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(lines.clone()));
    let mut redis = RedisProcess::start();
    let mut c = Connection::connect(&redis.target()).await.unwrap();
    // An established fleet: the epoch exists, so joining is not quiet.
    c.command(&[b"SET".as_slice(), b"stormguard:{dep}:epoch", b"0"]).await.unwrap();
    let ttl = Duration::from_millis(300);
    let config = FleetConfig::new("dep", "a", redis.target(), 20, 4)
        .with_timing(ttl, Duration::from_millis(100));
    let fleet = Fleet::try_new(config).unwrap();
    let limiter = Limiter::try_new(
        LimiterConfig {
            cap: 20,
            queue_len: 10,
            queue_timeout: Duration::from_secs(1),
            adaptive: None,
        },
        Arc::new(MonotonicClock::new()),
    )
    .unwrap();
    let mut worker = fleet.worker(limiter);

    worker.tick().await;
    assert_eq!(fleet.mode(), FleetMode::Fleet);
    let joined = lines.take();
    assert_eq!(joined.len(), 1, "{joined:?}");
    assert_eq!((joined[0].0, joined[0].2.as_str()), (Level::INFO, "fleet"));
    assert!(joined[0].1.starts_with("joined the fleet"), "{joined:?}");
    // A renewal that changes nothing says nothing.
    worker.tick().await;
    assert_eq!(lines.take(), []);

    redis.kill();
    // While the lease holds, a failed renewal changes no mode.
    worker.tick().await;
    assert_eq!(fleet.mode(), FleetMode::Fleet);
    assert_eq!(lines.take(), []);
    // Past the lease: fallback, one warn, and only one however many renewals fail.
    tokio::time::sleep(ttl).await;
    for _ in 0..3 {
        worker.tick().await;
    }
    assert_eq!(fleet.mode(), FleetMode::Fallback);
    let fell_back = lines.take();
    assert_eq!(fell_back.len(), 1, "{fell_back:?}");
    assert_eq!((fell_back[0].0, fell_back[0].2.as_str()), (Level::WARN, "fallback"));

    // Redis comes back empty: one line, the data loss (it says the fleet goes quiet).
    redis.restart();
    worker.tick().await;
    assert_eq!(fleet.mode(), FleetMode::Quiet);
    let quiet = lines.take();
    assert_eq!(quiet.len(), 1, "{quiet:?}");
    assert_eq!(quiet[0].0, Level::WARN);
    assert!(quiet[0].1.contains("lost its data"), "{quiet:?}");

    // After the quiet ttl: back to fleet, one line.
    let mut seen = Vec::new();
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        worker.tick().await;
        seen.extend(lines.take());
        if fleet.mode() == FleetMode::Fleet {
            break;
        }
    }
    assert_eq!(fleet.mode(), FleetMode::Fleet, "{seen:?}");
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!((seen[0].0, seen[0].2.as_str()), (Level::INFO, "fleet"));
}
