//! The fleet: the lease state every caller reads on the request path, the budget that spends
//! leased reserve tokens, and the worker that renews the lease in the background.

use std::fmt;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use stormguard_core::budget::{
    AnyBudget, BudgetExhausted, BudgetSnapshot, BudgetSpec, FailureKind, Outcome, RatioConfig,
    RetryBudget, RetryPermit, SpecError,
};
use stormguard_core::clock::Timestamp;
use stormguard_core::decimal::Fraction;
use stormguard_core::limiter::Limiter;

use crate::target::RedisTarget;

/// The lease script, run by `EVALSHA` (loaded once per connection).
pub const LEASE_SCRIPT: &str = include_str!("lease.lua");

/// Parameters of a [`Fleet`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetConfig {
    /// The dependency's name: the hash tag of its keys (`stormguard:{NAME}:slots`), so they
    /// live in one slot of a Redis Cluster. No `{` or `}`.
    pub dependency: String,
    /// This instance's id, unique in the fleet (a pod name; see [`default_instance_id`]).
    pub instance: String,
    /// Where Redis is.
    pub redis: RedisTarget,
    /// Attempts in flight at once across every instance, `1..=16777216`.
    pub fleet_cap: u64,
    /// The most instances the fleet runs at its peak (not today's count), `≥ 1`: the fallback
    /// share is `floor(fleet_cap / max_instances)`.
    pub max_instances: u64,
    /// How long a grant is valid, 300 ms to 60 s, at least 3 × `interval`. Default 2 s.
    pub lease_ttl: Duration,
    /// How often the worker renews, 10 ms or more. Default 200 ms.
    pub interval: Duration,
    /// Taken off the lease's validity on the local clock, for clock drift and the script's own
    /// latency; under `lease_ttl / 2`. Default `lease_ttl / 10`.
    pub margin: Duration,
    /// The least slots an instance uses when it falls back, if `floor(fleet_cap /
    /// max_instances)` is less. Default 0: the cap wins (the overcommit is exported).
    pub fallback_min: u64,
    /// The longest one renewal may take (connect included) before it counts as failed.
    /// Default: `interval`.
    pub call_timeout: Duration,
}

impl FleetConfig {
    /// A fleet config with every default.
    pub fn new(
        dependency: impl Into<String>,
        instance: impl Into<String>,
        redis: RedisTarget,
        fleet_cap: u64,
        max_instances: u64,
    ) -> FleetConfig {
        let lease_ttl = Duration::from_secs(2);
        FleetConfig {
            dependency: dependency.into(),
            instance: instance.into(),
            redis,
            fleet_cap,
            max_instances,
            lease_ttl,
            interval: Duration::from_millis(200),
            margin: lease_ttl / 10,
            fallback_min: 0,
            call_timeout: Duration::from_millis(200),
        }
    }

    /// Sets `lease_ttl`, `interval`, and the margin and call timeout that follow from them.
    pub fn with_timing(mut self, lease_ttl: Duration, interval: Duration) -> FleetConfig {
        self.lease_ttl = lease_ttl;
        self.interval = interval;
        self.margin = lease_ttl / 10;
        self.call_timeout = interval;
        self
    }

    /// Checks every rule, returning the first broken one.
    pub fn validate(&self) -> Result<(), FleetError> {
        if self.dependency.is_empty() || self.dependency.contains(['{', '}']) {
            return Err(FleetError::DependencyName { got: self.dependency.clone() });
        }
        if self.instance.is_empty() || self.instance.len() > 200 {
            return Err(FleetError::InstanceId);
        }
        if !(1..=stormguard_core::limiter::MAX_CAP).contains(&self.fleet_cap) {
            return Err(FleetError::OutOfRange {
                key: "fleet_cap",
                min: "1".into(),
                max: "16777216".into(),
                got: self.fleet_cap.to_string(),
            });
        }
        if self.max_instances == 0 || self.max_instances > 1_000_000 {
            return Err(FleetError::OutOfRange {
                key: "max_instances",
                min: "1".into(),
                max: "1000000".into(),
                got: self.max_instances.to_string(),
            });
        }
        if self.lease_ttl < Duration::from_millis(300) || self.lease_ttl > Duration::from_secs(60) {
            return Err(FleetError::OutOfRange {
                key: "lease_ttl",
                min: "300ms".into(),
                max: "60s".into(),
                got: format!("{:?}", self.lease_ttl),
            });
        }
        if self.interval < Duration::from_millis(10) || self.interval * 3 > self.lease_ttl {
            return Err(FleetError::Interval {
                most: format!("{:?}", self.lease_ttl / 3),
                got: format!("{:?}", self.interval),
            });
        }
        if self.margin >= self.lease_ttl / 2 {
            return Err(FleetError::Margin { got: format!("{:?}", self.margin) });
        }
        if self.call_timeout.is_zero() {
            return Err(FleetError::CallTimeout);
        }
        Ok(())
    }

    /// Slots an instance uses when its lease has expired: `floor(fleet_cap / max_instances)`,
    /// or `fallback_min` if that is more.
    pub fn fallback_slots(&self) -> u64 {
        (self.fleet_cap / self.max_instances.max(1)).max(self.fallback_min)
    }

    /// Slots the fleet may hold beyond its cap when every instance falls back at once:
    /// `max(0, fallback_slots × max_instances − fleet_cap)`.
    pub fn fallback_overcommit(&self) -> u64 {
        (self.fallback_slots().saturating_mul(self.max_instances)).saturating_sub(self.fleet_cap)
    }

    /// The three keys: slots, tokens and epoch, sharing one hash tag.
    pub fn keys(&self) -> [String; 3] {
        let d = &self.dependency;
        [
            format!("stormguard:{{{d}}}:slots"),
            format!("stormguard:{{{d}}}:tokens"),
            format!("stormguard:{{{d}}}:epoch"),
        ]
    }
}

/// An instance id for a process that was given none: the host name (from `HOSTNAME`, as
/// Kubernetes sets it), the process id and the start time, so two runs never share one.
pub fn default_instance_id() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "host".into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{host}-{}-{nanos:08x}", std::process::id())
}

/// What the fleet layer is doing now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FleetMode {
    /// Started, no answer from Redis yet: nothing is admitted until the first answer (or the
    /// first failure, then fallback).
    Joining,
    /// Holding a lease granted by Redis.
    Fleet,
    /// Redis lost its data (or is new): the lease re-asserts what it held, nothing new is
    /// granted for one lease TTL.
    Quiet,
    /// No lease: `floor(fleet_cap / max_instances)` slots and the same share of the reserve.
    Fallback,
}

impl FleetMode {
    /// Every mode, for the `stormguard_fleet_mode{mode}` gauge.
    pub const ALL: [FleetMode; 4] =
        [FleetMode::Joining, FleetMode::Fleet, FleetMode::Quiet, FleetMode::Fallback];

    /// The lowercase name used in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            FleetMode::Joining => "joining",
            FleetMode::Fleet => "fleet",
            FleetMode::Quiet => "quiet",
            FleetMode::Fallback => "fallback",
        }
    }

    fn from_u8(v: u8) -> FleetMode {
        match v {
            1 => FleetMode::Fleet,
            2 => FleetMode::Quiet,
            3 => FleetMode::Fallback,
            _ => FleetMode::Joining,
        }
    }
}

/// What the fleet layer shows at one instant.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetSnapshot {
    /// The mode.
    pub mode: FleetMode,
    /// The slots this instance may use now (lease, or fallback share).
    pub slots: u64,
    /// Reserve tokens this instance may spend now.
    pub tokens: u64,
    /// Time since the last renewal Redis answered; `None` before the first.
    pub sync_lag: Option<Duration>,
    /// Slots the fleet may hold beyond its cap while this instance falls back (0 otherwise).
    pub overcommit: u64,
    /// Renewals answered.
    pub syncs_ok: u64,
    /// Renewals that failed or timed out.
    pub syncs_failed: u64,
    /// Script calls sent (`EVALSHA`/`EVAL`): at most one per interval.
    pub script_calls: u64,
    /// Times Redis was found to have lost its data (a new epoch).
    pub data_loss: u64,
    /// Live instances at the last renewal, this one included.
    pub instances: u64,
}

/// The state the request path and the worker share. Atomics only: the request path never
/// takes a lock. Relaxed or Acquire/Release as noted: every value is a bound the worker
/// refreshes each interval, not a synchronisation point, except `tokens` (a compare-exchange).
struct Shared {
    config: FleetConfig,
    /// The reserve in tokens per window, and the window in ms (0: no fleet reserve).
    reserve: AtomicU64,
    window_ms: AtomicU64,
    mode: AtomicU8,
    slots: AtomicU64,
    lease_until: AtomicU64,
    tokens: AtomicU64,
    /// Tokens are spendable before this (nanoseconds on the limiter's clock).
    tokens_until: AtomicU64,
    /// Tokens spent since the worker last took the count.
    spent: AtomicU64,
    last_ok: AtomicU64,
    syncs_ok: AtomicU64,
    syncs_failed: AtomicU64,
    script_calls: AtomicU64,
    data_loss: AtomicU64,
    instances: AtomicU64,
    limiter: OnceLock<Limiter>,
}

const NEVER: u64 = u64::MAX;

/// A fleet-shared cap and reserve for one dependency. Cheap to clone: clones share the lease.
///
/// Build it, take its [`budget`](Fleet::budget) for the dependency, then hand the dependency's
/// limiter to [`worker`](Fleet::worker) and run the worker on your runtime.
#[derive(Clone)]
pub struct Fleet {
    shared: Arc<Shared>,
}

impl fmt::Debug for Fleet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fleet")
            .field("dependency", &self.shared.config.dependency)
            .field("instance", &self.shared.config.instance)
            .field("redis", &self.shared.config.redis)
            .field("mode", &self.mode())
            .finish()
    }
}

/// Why a fleet placement was refused. The message is one plain reason, lowercase without a
/// trailing period.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FleetError {
    /// The dependency name cannot be a Redis hash tag.
    #[error("the dependency name is a Redis hash tag: not empty, no braces, got {got:?}")]
    DependencyName {
        /// The name given.
        got: String,
    },
    /// The instance id is empty or longer than 200 bytes.
    #[error("the instance id must be 1 to 200 bytes")]
    InstanceId,
    /// A value outside `[min, max]`.
    #[error("{key} must be between {min} and {max}, got {got}")]
    OutOfRange {
        /// The field.
        key: &'static str,
        /// The smallest allowed value.
        min: String,
        /// The largest allowed value.
        max: String,
        /// The value given.
        got: String,
    },
    /// The renewal interval is under 10ms or above a third of the lease.
    #[error("interval must be at least 10ms and at most lease_ttl / 3 ({most}), got {got}")]
    Interval {
        /// `lease_ttl / 3`.
        most: String,
        /// The interval given.
        got: String,
    },
    /// The safety margin is not under half the lease.
    #[error("margin must be under lease_ttl / 2, got {got}")]
    Margin {
        /// The margin given.
        got: String,
    },
    /// A zero call timeout.
    #[error("call_timeout must be more than 0")]
    CallTimeout,
    /// A lease longer than 0.9 × the ratio budget's ttl.
    #[error(
        "lease_ttl ({lease_ttl}) must be at most 0.9 × the budget's ttl ({ttl}): a leased token must be spent while the fleet still counts it"
    )]
    LeaseAboveBudgetTtl {
        /// The lease given.
        lease_ttl: String,
        /// The budget's ttl.
        ttl: String,
    },
    /// The local budget could not be built.
    #[error(transparent)]
    Budget(#[from] SpecError),
}

impl FleetError {
    /// The name of the field that broke the rule (`dependency`, `instance`, `fleet_cap`,
    /// `max_instances`, `lease_ttl`, `interval`, `margin`, `call_timeout`, `budget`).
    pub fn key(&self) -> &'static str {
        match self {
            FleetError::DependencyName { .. } => "dependency",
            FleetError::InstanceId => "instance",
            FleetError::OutOfRange { key, .. } => key,
            FleetError::Interval { .. } => "interval",
            FleetError::Margin { .. } => "margin",
            FleetError::CallTimeout => "call_timeout",
            FleetError::LeaseAboveBudgetTtl { .. } => "lease_ttl",
            FleetError::Budget(_) => "budget",
        }
    }
}

impl Fleet {
    /// Checks the config. No I/O: the worker connects.
    pub fn try_new(config: FleetConfig) -> Result<Fleet, FleetError> {
        config.validate()?;
        Ok(Fleet {
            shared: Arc::new(Shared {
                config,
                reserve: AtomicU64::new(0),
                window_ms: AtomicU64::new(10_000),
                mode: AtomicU8::new(0),
                slots: AtomicU64::new(0),
                lease_until: AtomicU64::new(0),
                tokens: AtomicU64::new(0),
                tokens_until: AtomicU64::new(0),
                spent: AtomicU64::new(0),
                last_ok: AtomicU64::new(NEVER),
                syncs_ok: AtomicU64::new(0),
                syncs_failed: AtomicU64::new(0),
                script_calls: AtomicU64::new(0),
                data_loss: AtomicU64::new(0),
                instances: AtomicU64::new(0),
                limiter: OnceLock::new(),
            }),
        })
    }

    /// The config it was built with.
    pub fn config(&self) -> &FleetConfig {
        &self.shared.config
    }

    /// The mode now.
    pub fn mode(&self) -> FleetMode {
        FleetMode::from_u8(self.shared.mode.load(Ordering::Acquire))
    }

    /// The dependency's budget, with its reserve shared by the fleet.
    ///
    /// For a `ratio` budget the reserve `min_per_sec × ttl` becomes the fleet's, leased in
    /// tokens; `percent` stays local (it is scale-invariant). Other kinds are returned as they
    /// are: their floors stay per instance (see docs/fleet.md).
    pub fn budget(&self, spec: &BudgetSpec) -> Result<FleetBudget, FleetError> {
        let local = match spec {
            BudgetSpec::Ratio(c) => {
                let ttl_ms = u64::try_from(c.ttl.as_millis()).unwrap_or(u64::MAX);
                if self.shared.config.lease_ttl * 10 > c.ttl * 9 {
                    return Err(FleetError::LeaseAboveBudgetTtl {
                        lease_ttl: format!("{:?}", self.shared.config.lease_ttl),
                        ttl: format!("{:?}", c.ttl),
                    });
                }
                let reserve = u128::from(c.min_per_sec.millionths()) * u128::from(ttl_ms)
                    / 1_000
                    / u128::from(Fraction::ONE_MILLIONTHS);
                self.shared
                    .reserve
                    .store(u64::try_from(reserve).unwrap_or(u64::MAX), Ordering::Release);
                self.shared.window_ms.store(ttl_ms, Ordering::Release);
                BudgetSpec::Ratio(RatioConfig { min_per_sec: Fraction::ZERO, ..*c })
            }
            other => *other,
        };
        Ok(FleetBudget { local: local.build()?, shared: self.shared.clone() })
    }

    /// The fleet layer's state now.
    pub fn snapshot(&self) -> FleetSnapshot {
        let s = &self.shared;
        let mode = self.mode();
        let now = s.limiter.get().map(Limiter::now);
        let last = s.last_ok.load(Ordering::Acquire);
        let until = s.tokens_until.load(Ordering::Acquire);
        let tokens = match now {
            Some(now) if now.as_nanos() < until => s.tokens.load(Ordering::Acquire),
            _ => 0,
        };
        let slots = match (mode, now) {
            (FleetMode::Fallback, _) => s.config.fallback_slots(),
            (_, Some(now)) if now.as_nanos() < s.lease_until.load(Ordering::Acquire) => {
                s.slots.load(Ordering::Acquire)
            }
            (FleetMode::Joining, _) => 0,
            _ => s.config.fallback_slots(),
        };
        FleetSnapshot {
            mode,
            slots,
            tokens,
            sync_lag: now
                .filter(|_| last != NEVER)
                .map(|n| n.saturating_since(Timestamp::from_nanos(last))),
            overcommit: if mode == FleetMode::Fallback {
                s.config.fallback_overcommit()
            } else {
                0
            },
            syncs_ok: s.syncs_ok.load(Ordering::Relaxed),
            syncs_failed: s.syncs_failed.load(Ordering::Relaxed),
            script_calls: s.script_calls.load(Ordering::Relaxed),
            data_loss: s.data_loss.load(Ordering::Relaxed),
            instances: s.instances.load(Ordering::Relaxed),
        }
    }
}

/// A retry budget whose reserve is the fleet's: `percent` of this instance's own originals,
/// and beyond that one leased reserve token per retry. See [`Fleet::budget`].
pub struct FleetBudget {
    local: AnyBudget,
    shared: Arc<Shared>,
}

impl fmt::Debug for FleetBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FleetBudget").field("local", &self.local).finish_non_exhaustive()
    }
}

impl FleetBudget {
    /// Takes one leased reserve token, if one is left and still valid at `now`.
    #[inline]
    fn try_token(&self, now: Timestamp) -> bool {
        let s = &self.shared;
        // Acquire pairs with the worker's Release: a token count is read with its expiry.
        if now.as_nanos() >= s.tokens_until.load(Ordering::Acquire) {
            return false;
        }
        let mut cur = s.tokens.load(Ordering::Acquire);
        loop {
            if cur == 0 {
                return false;
            }
            // AcqRel: racing retries each take a distinct token; the worker's refresh is a
            // compare-exchange on the same word, so no spend is lost.
            match s.tokens.compare_exchange_weak(cur, cur - 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    s.spent.fetch_add(1, Ordering::Relaxed);
                    return true;
                }
                Err(actual) => cur = actual,
            }
        }
    }
}

impl RetryBudget for FleetBudget {
    #[inline]
    fn record_request(&self, now: Timestamp) {
        self.local.record_request(now)
    }
    #[inline]
    fn record_outcome(&self, now: Timestamp, outcome: Outcome) {
        self.local.record_outcome(now, outcome)
    }
    #[inline]
    fn try_retry(&self, now: Timestamp, kind: FailureKind) -> Result<RetryPermit, BudgetExhausted> {
        match self.local.try_retry(now, kind) {
            Ok(p) => Ok(p),
            // A reserve token, spent: a refund of it is not given back (conservative).
            Err(e) => {
                if self.try_token(now) {
                    Ok(RetryPermit::unbudgeted())
                } else {
                    Err(e)
                }
            }
        }
    }
    fn set_active(&self, requests: u64, retries: u64) {
        self.local.set_active(requests, retries)
    }
    fn snapshot(&self, now: Timestamp) -> BudgetSnapshot {
        let mut s = self.local.snapshot(now);
        let tokens = if now.as_nanos() < self.shared.tokens_until.load(Ordering::Acquire) {
            self.shared.tokens.load(Ordering::Acquire)
        } else {
            0
        };
        s.balance = s.balance.max(0.0) + tokens as f64;
        if tokens > 0 {
            s.utilization = s.utilization.min(0.99);
        }
        s
    }
    fn counts_successes(&self) -> bool {
        self.local.counts_successes()
    }
    fn refund(&self, now: Timestamp, permit: RetryPermit) {
        self.local.refund(now, permit)
    }
    /// The local budget's time; the fleet's tokens come at the next lease, which is not known.
    fn retry_after(&self, now: Timestamp) -> Option<std::time::Duration> {
        self.local.retry_after(now)
    }
}

/// The lease worker: the Redis client's half (the default feature `client`).
#[cfg(feature = "client")]
mod worker {
    use super::*;
    use crate::resp::{Connection, RedisError, Value};

    /// The most cluster redirects (`MOVED`, `ASK`) one lease call follows.
    const MAX_REDIRECTS: u32 = 3;

    /// Where a Redis Cluster node sent a command.
    #[derive(Debug, PartialEq, Eq)]
    enum Redirect {
        /// `MOVED slot host:port`: the slot lives there now.
        Moved(String, u16),
        /// `ASK slot host:port`: the slot is migrating; this command goes there after `ASKING`.
        Ask(String, u16),
    }

    /// A cluster redirect in an error reply, if it is one.
    fn redirect(message: &str) -> Option<Redirect> {
        let mut words = message.split_ascii_whitespace();
        let kind = words.next()?;
        let _slot: u16 = words.next()?.parse().ok()?;
        let (host, port) = words.next()?.rsplit_once(':')?;
        let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
        let port = port.parse().ok()?;
        match kind {
            "MOVED" => Some(Redirect::Moved(host, port)),
            "ASK" => Some(Redirect::Ask(host, port)),
            _ => None,
        }
    }

    impl Fleet {
        /// The background worker that renews the lease, applying it to `limiter` (the
        /// dependency's). Run it on your runtime (`tokio::spawn(worker.run())`): the library spawns
        /// nothing. Until its first answer the limiter admits nothing new (at most one call
        /// timeout).
        ///
        /// # Panics
        /// When called twice: one fleet has one worker.
        pub fn worker(&self, limiter: Limiter) -> FleetWorker {
            limiter.set_lease(0, Timestamp::ZERO, 0);
            assert!(self.shared.limiter.set(limiter.clone()).is_ok(), "one worker per fleet");
            let now = limiter.now();
            FleetWorker {
                shared: self.shared.clone(),
                limiter,
                conn: None,
                sha: None,
                epoch: None,
                unreported: 0,
                spent_last: 0,
                refill_at: now,
                node: None,
                rate_shares: Vec::new(),
            }
        }
    }

    /// What one script call answered.
    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Grant {
        epoch: String,
        quiet: bool,
        ceiling: u64,
        tokens: u64,
        instances: u64,
    }

    fn parse_grant(v: Value) -> Result<Grant, RedisError> {
        let Value::Array(items) = v else {
            return Err(RedisError::Protocol("the script did not return an array"));
        };
        let int = |i: usize| match items.get(i) {
            Some(Value::Int(n)) => Ok(u64::try_from(*n).unwrap_or(0)),
            _ => Err(RedisError::Protocol("the script returned a non-integer")),
        };
        let epoch = match items.first() {
            Some(Value::Bulk(b)) => String::from_utf8_lossy(b).into_owned(),
            _ => return Err(RedisError::Protocol("the script returned no epoch")),
        };
        Ok(Grant {
            epoch,
            quiet: int(1)? == 1,
            ceiling: int(2)?,
            tokens: int(4)?,
            instances: int(6)?,
        })
    }

    /// Renews the lease every interval. Owned by the caller, who runs it (see [`Fleet::worker`]).
    pub struct FleetWorker {
        shared: Arc<Shared>,
        limiter: Limiter,
        conn: Option<Connection>,
        sha: Option<String>,
        epoch: Option<String>,
        /// Tokens spent and not yet counted by Redis (a failed call keeps them for the next).
        unreported: u64,
        spent_last: u64,
        /// When the fallback reserve share refills next.
        refill_at: Timestamp,
        /// On a Redis Cluster: the node a `MOVED` said holds the fleet's slot.
        node: Option<(String, u16)>,
        /// Where the count of instances sharing a provider's rate limits goes (see
        /// [`FleetWorker::share_rates`]).
        rate_shares: Vec<Arc<AtomicU64>>,
    }

    impl fmt::Debug for FleetWorker {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("FleetWorker")
                .field("dependency", &self.shared.config.dependency)
                .field("connected", &self.conn.is_some())
                .finish_non_exhaustive()
        }
    }

    impl FleetWorker {
        /// Renews forever, one script call per interval.
        pub async fn run(self) {
            self.run_until(std::future::pending()).await
        }

        /// Renews until `stop` resolves. The lease is not handed back: it expires within the TTL,
        /// as a crashed instance's does.
        pub async fn run_until(mut self, stop: impl Future<Output = ()>) {
            let mut stop = std::pin::pin!(stop);
            loop {
                let started = tokio::time::Instant::now();
                tokio::select! {
                    _ = &mut stop => return,
                    _ = self.tick() => {}
                }
                tokio::select! {
                    _ = &mut stop => return,
                    _ = tokio::time::sleep_until(started + self.shared.config.interval) => {}
                }
            }
        }

        /// One renewal: a script call, applied on success; on failure the lease runs out and the
        /// fallback share takes over.
        pub async fn tick(&mut self) {
            let timeout = self.shared.config.call_timeout;
            let sent = self.limiter.now();
            let s = self.shared.clone();
            let mode = FleetMode::from_u8(s.mode.load(Ordering::Acquire));
            let lease_valid = matches!(mode, FleetMode::Fleet | FleetMode::Quiet)
                && sent.as_nanos() < s.lease_until.load(Ordering::Acquire);
            let in_flight = self.limiter.in_flight();
            let held = if lease_valid { s.slots.load(Ordering::Acquire) } else { 0 };
            let committed = in_flight.max(held);
            // An adaptive cap asks for what its working cap would admit: it adapts within its lease,
            // and slots it could not use stay with the fleet.
            let cap = self
                .limiter
                .working_cap()
                .unwrap_or(self.limiter.config().cap)
                .min(s.config.fleet_cap);
            let want = (in_flight + self.limiter.queued() + 1).min(cap);
            let spent_now = s.spent.swap(0, Ordering::AcqRel);
            self.unreported += spent_now;
            self.spent_last = spent_now;
            let tokens_before = if lease_valid { s.tokens.load(Ordering::Acquire) } else { 0 };
            let reserve = s.reserve.load(Ordering::Acquire);
            let window = s.window_ms.load(Ordering::Acquire);
            let fair = reserve.div_ceil(s.config.max_instances.max(1));
            let token_want = fair.max(2 * self.spent_last + 1).min(reserve);
            let args = [
                committed,
                want,
                s.config.fleet_cap,
                u64::try_from(s.config.lease_ttl.as_millis()).unwrap_or(u64::MAX),
                self.unreported,
                tokens_before,
                token_want,
                reserve,
                window,
            ];
            let result = tokio::time::timeout(timeout, self.call(&args)).await;
            match result {
                Ok(Ok(grant)) => self.apply(sent, tokens_before, grant),
                Ok(Err(e)) => self.failed(&e.to_string()),
                Err(_) => self.failed(&RedisError::Timeout(timeout).to_string()),
            }
        }

        /// One lease call. On a Redis Cluster, a node that does not hold the fleet's slot answers
        /// `MOVED slot host:port`: the worker connects there (and keeps going there), or, while the
        /// slot migrates, `ASK slot host:port`: this one call goes there after `ASKING`. At most
        /// [`MAX_REDIRECTS`] redirects a call.
        async fn call(&mut self, args: &[u64; 9]) -> Result<Grant, RedisError> {
            let mut redirects = 0;
            loop {
                match self.call_once(args, None).await {
                    Err(RedisError::Server(m)) if redirects < MAX_REDIRECTS => {
                        redirects += 1;
                        match redirect(&m) {
                            Some(Redirect::Moved(host, port)) => {
                                tracing::debug!(
                                    dependency = %self.shared.config.dependency,
                                    node = %format!("{host}:{port}"),
                                    "the fleet's slot is on another cluster node: moving there"
                                );
                                self.node = Some((host, port));
                                self.conn = None;
                            }
                            Some(Redirect::Ask(host, port)) => {
                                return self.call_once(args, Some((host, port))).await;
                            }
                            None => return Err(RedisError::Server(m)),
                        }
                    }
                    other => return other,
                }
            }
        }

        /// The target with the cluster node the fleet's slot was last found on.
        fn node_target(&self, node: Option<&(String, u16)>) -> RedisTarget {
            let mut t = self.shared.config.redis.clone();
            if let Some((host, port)) = node.or(self.node.as_ref()) {
                t.host.clone_from(host);
                t.port = *port;
            }
            t
        }

        /// One lease call on the worker's connection, or (`ask`) on a connection of its own to the
        /// node an `ASK` named.
        async fn call_once(
            &mut self,
            args: &[u64; 9],
            ask: Option<(String, u16)>,
        ) -> Result<Grant, RedisError> {
            let mut asked = None;
            let conn = match &ask {
                Some(node) => {
                    let mut c = Connection::connect(&self.node_target(Some(node))).await?;
                    c.command(&[b"ASKING"]).await?;
                    asked.insert(c)
                }
                None => {
                    if self.conn.is_none() {
                        self.conn = Some(Connection::connect(&self.node_target(None)).await?);
                        self.sha = None;
                    }
                    self.conn.as_mut().expect("connected above")
                }
            };
            // The script by its hash where it is loaded; a one-off ASK connection sends it whole.
            if ask.is_none() && self.sha.is_none() {
                let v = conn.command(&[b"SCRIPT", b"LOAD", LEASE_SCRIPT.as_bytes()]).await?;
                let Value::Bulk(sha) = v else {
                    return Err(RedisError::Protocol("SCRIPT LOAD returned no sha"));
                };
                self.sha = Some(String::from_utf8_lossy(&sha).into_owned());
            }
            let keys = self.shared.config.keys();
            let nums: Vec<String> = args.iter().map(u64::to_string).collect();
            let sha = self.sha.clone().unwrap_or_default();
            let mut cmd: Vec<&[u8]> = match ask {
                Some(_) => vec![b"EVAL", LEASE_SCRIPT.as_bytes(), b"3"],
                None => vec![b"EVALSHA", sha.as_bytes(), b"3"],
            };
            cmd.extend(keys.iter().map(|k| k.as_bytes()));
            cmd.push(self.shared.config.instance.as_bytes());
            cmd.extend(nums.iter().map(|n| n.as_bytes()));
            self.shared.script_calls.fetch_add(1, Ordering::Relaxed);
            let reply = match conn.command(&cmd).await {
                // The script cache was flushed (a restart, SCRIPT FLUSH): send it whole, once.
                Err(RedisError::Server(m)) if m.starts_with("NOSCRIPT") => {
                    self.sha = None;
                    cmd[0] = b"EVAL";
                    cmd[1] = LEASE_SCRIPT.as_bytes();
                    self.shared.script_calls.fetch_add(1, Ordering::Relaxed);
                    conn.command(&cmd).await?
                }
                other => other?,
            };
            parse_grant(reply)
        }

        /// A provider's requests and tokens per minute are per key, so the fleet's: each instance
        /// meters `limit / n`, where the worker stores `n` in each of `shares` — the live instances
        /// at each renewal, `max_instances` until the first one and while Redis does not answer.
        /// (The shares are even, not by demand as the slots are; an instance that joins is counted
        /// by the others at their next renewal, so for at most one interval the fleet may meter a
        /// little more than the limit — the provider's `remaining`, which every instance follows,
        /// bounds that.)
        pub fn share_rates(&mut self, shares: Vec<Arc<AtomicU64>>) {
            let n = self.shared.config.max_instances.max(1);
            for s in &shares {
                s.store(n, Ordering::Relaxed);
            }
            self.rate_shares = shares;
        }

        fn set_rate_shares(&self, n: u64) {
            for s in &self.rate_shares {
                s.store(n.max(1), Ordering::Relaxed);
            }
        }

        fn apply(&mut self, sent: Timestamp, tokens_before: u64, grant: Grant) {
            let s = &self.shared;
            let c = &s.config;
            self.unreported = 0;
            let data_lost = self.epoch.as_ref().is_some_and(|old| *old != grant.epoch);
            if data_lost {
                s.data_loss.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    dependency = %c.dependency,
                    redis = %c.redis,
                    "the fleet's Redis lost its data (a new epoch): re-asserting this instance's lease; nothing new is granted for one lease ttl"
                );
            }
            self.epoch = Some(grant.epoch);
            let until = sent.saturating_add(c.lease_ttl.saturating_sub(c.margin));
            let fallback = c.fallback_slots();
            // Record first, then the limiter: a snapshot never shows slots the limiter lacks.
            s.slots.store(grant.ceiling, Ordering::Release);
            s.lease_until.store(until.as_nanos(), Ordering::Release);
            self.limiter.set_lease(grant.ceiling, until, fallback);
            // Tokens spent while the call was out came from the old allowance; Redis's new record
            // (at least the old unspent count) covers them, so take them off the new allowance.
            let mut cur = s.tokens.load(Ordering::Acquire);
            loop {
                let in_rtt = tokens_before.saturating_sub(cur);
                let next = grant.tokens.saturating_sub(in_rtt);
                match s.tokens.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => break,
                    Err(actual) => cur = actual,
                }
            }
            s.tokens_until.store(until.as_nanos(), Ordering::Release);
            s.instances.store(grant.instances, Ordering::Relaxed);
            self.set_rate_shares(grant.instances);
            s.last_ok.store(self.limiter.now().as_nanos(), Ordering::Release);
            s.syncs_ok.fetch_add(1, Ordering::Relaxed);
            let mode = if grant.quiet { FleetMode::Quiet } else { FleetMode::Fleet };
            let was = FleetMode::from_u8(s.mode.swap(mode as u8, Ordering::AcqRel));
            // One line per change of mode (the data-loss line above already said why it went quiet).
            let line = match (was, mode) {
                (a, b) if a == b => None,
                (_, FleetMode::Quiet) if data_lost => None,
                (FleetMode::Fallback, _) => {
                    Some("the fleet's Redis answers again: back on fleet leases")
                }
                (FleetMode::Joining, FleetMode::Fleet) => Some("joined the fleet: holding a lease"),
                (_, FleetMode::Quiet) => {
                    Some("the fleet is quiet: Redis grants nothing new for one lease ttl")
                }
                (FleetMode::Quiet, FleetMode::Fleet) => {
                    Some("the fleet's quiet period is over: leases are granted again")
                }
                _ => None,
            };
            if let Some(line) = line {
                tracing::info!(
                    dependency = %c.dependency,
                    redis = %c.redis,
                    mode = mode.as_str(),
                    was = was.as_str(),
                    slots = grant.ceiling,
                    "{line}"
                );
            }
        }

        fn failed(&mut self, error: &str) {
            let s = &self.shared;
            let c = &s.config;
            // A reply may still come on this connection: never read it as the next one's.
            self.conn = None;
            s.syncs_failed.fetch_add(1, Ordering::Relaxed);
            let now = self.limiter.now();
            let mode = FleetMode::from_u8(s.mode.load(Ordering::Acquire));
            let expired = now.as_nanos() >= s.lease_until.load(Ordering::Acquire);
            if mode != FleetMode::Fallback && (mode == FleetMode::Joining || expired) {
                s.mode.store(FleetMode::Fallback as u8, Ordering::Release);
                let fallback = c.fallback_slots();
                // The limiter already fell back on its own when the lease expired; a joining
                // instance had no lease yet.
                self.limiter.set_lease(fallback, Timestamp::ZERO, fallback);
                self.set_rate_shares(c.max_instances);
                self.refill_at = now;
                tracing::warn!(
                    dependency = %c.dependency,
                    redis = %c.redis,
                    mode = FleetMode::Fallback.as_str(),
                    was = mode.as_str(),
                    error,
                    fallback_slots = fallback,
                    overcommit = c.fallback_overcommit(),
                    "the fleet's Redis does not answer: using the fallback share until it does (logged once per outage)"
                );
            }
            if FleetMode::from_u8(s.mode.load(Ordering::Acquire)) == FleetMode::Fallback
                && now >= self.refill_at
            {
                // The fallback reserve: this instance's share of it per window, spent locally.
                let window = Duration::from_millis(s.window_ms.load(Ordering::Acquire).max(1));
                let share = s.reserve.load(Ordering::Acquire) / c.max_instances.max(1);
                s.tokens.store(share, Ordering::Release);
                s.tokens_until.store(NEVER, Ordering::Release);
                self.refill_at = now.saturating_add(window);
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn config() -> FleetConfig {
            let redis = RedisTarget::plain("127.0.0.1", 6379);
            FleetConfig::new("payments", "pod-a", redis, 20, 50)
        }

        #[test]
        fn cluster_redirects_are_read_and_nothing_else_is() {
            assert_eq!(
                redirect("MOVED 3999 127.0.0.1:6381"),
                Some(Redirect::Moved("127.0.0.1".into(), 6381))
            );
            assert_eq!(redirect("ASK 3999 [::1]:7000"), Some(Redirect::Ask("::1".into(), 7000)));
            for other in ["ERR unknown", "MOVED x 1.2.3.4:1", "MOVED 1 nohostport", "NOSCRIPT x"] {
                assert_eq!(redirect(other), None, "{other}");
            }
        }

        #[test]
        fn refusals_name_the_field() {
            assert_eq!(config().validate(), Ok(()));
            let err = FleetConfig { fleet_cap: 0, ..config() }.validate().unwrap_err();
            assert!(matches!(err, FleetError::OutOfRange { key: "fleet_cap", .. }), "{err}");
            assert_eq!(err.to_string(), "fleet_cap must be between 1 and 16777216, got 0");
            let err = FleetConfig { dependency: "a{b}".into(), ..config() }.validate().unwrap_err();
            assert_eq!(err.key(), "dependency");
            let err = FleetConfig { instance: String::new(), ..config() }.validate().unwrap_err();
            assert_eq!(err, FleetError::InstanceId);
            let err =
                FleetConfig { call_timeout: Duration::ZERO, ..config() }.validate().unwrap_err();
            assert_eq!(err.key(), "call_timeout");
        }

        #[test]
        fn a_lease_longer_than_the_budget_window_is_refused() {
            let fleet =
                Fleet::try_new(FleetConfig { lease_ttl: Duration::from_secs(10), ..config() })
                    .unwrap();
            let spec: BudgetSpec = "ratio:ttl=10s".parse().unwrap();
            let err = fleet.budget(&spec).unwrap_err();
            assert!(matches!(err, FleetError::LeaseAboveBudgetTtl { .. }), "{err}");
            assert_eq!(err.key(), "lease_ttl");
        }
    }
}
#[cfg(feature = "client")]
pub use worker::FleetWorker;
