//! A dependency: everything its callers share — the limiter (the cap), the retry budget, the
//! breaker, the pushback hold, the counters — built once and cloned into every layer.

use crate::extensions::RateCost;
pub use crate::extensions::UpstreamTarget;
use std::fmt;
use std::sync::Arc;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};
use stormguard_core::tree::{TreeContext, TreeCounts, TreeLedger};

use http::HeaderName;
use stormguard_core::ConfigError;
use stormguard_core::breaker::{BreakerConfig, BreakerState};
use stormguard_core::budget::{BudgetSnapshot, BudgetSpec, RetryBudget, SpecError};
use stormguard_core::clock::{Clock, Timestamp};
use stormguard_core::decision::{RetryConfig, RetryPolicy, Upstream};
use stormguard_core::limiter::{Limiter, LimiterConfig, LimiterSnapshot, Reader};
use stormguard_core::random::SplitMix64;
use stormguard_core::signals::CountersSnapshot;
use stormguard_http::body::DEFAULT_LIMIT;
use stormguard_http::classify::IDEMPOTENCY_KEY;
use stormguard_http::headers::{
    HeaderStats, HeaderStatsSnapshot, LimitHeaders, LimitInfo, PushbackHeaders,
};
use stormguard_http::stacked::StackedHeaders;

use crate::clock::TokioClock;
use crate::record::{Recorder, TraceEvent, TraceOp};

/// Everything that describes a dependency. Build it, then [`Dependency::try_new`].
#[derive(Debug, Clone)]
pub struct DependencyConfig {
    /// The dependency's name: the `dependency` label of every metric.
    pub name: String,
    /// The cap and the primaries' queue. Default cap 20, queue 100, queue timeout 1 s.
    pub limiter: LimiterConfig,
    /// The retry budget. Default `ratio:percent=0.2,min_per_sec=10,ttl=10s`.
    pub budget: BudgetSpec,
    /// The retry rules: `retry_on`, `max_retries`, backoff, pushback, shadow mode.
    pub retry: RetryConfig,
    /// The circuit breaker, if any. Default none.
    pub breaker: Option<BreakerConfig>,
    /// Each attempt's limit up to response headers (connect time included). Default none.
    pub per_try_timeout: Option<Duration>,
    /// The whole request's limit, queue wait and backoffs included; a request extension
    /// [`Deadline`](crate::Deadline) can shorten it. Default none.
    pub deadline: Option<Duration>,
    /// How long an attempt stormguard timed out (its per-try timeout, or the request's
    /// deadline) keeps its slot, since the dependency is still working on it: with a
    /// [`background`](Self::background) spawner the call runs on and the slot comes back when
    /// the dependency answers, or at this bound, when the call is cut; without one the slot is
    /// held for the whole bound, since nothing can tell when the dependency finished. Never
    /// shortened to what was left of the deadline. Default 30 s
    /// ([`stormguard_core::defaults::TIMEOUT_SLOT_HOLD`]).
    pub timeout_slot_hold: Duration,
    /// How long an attempt whose caller went away (the response future was dropped while the
    /// attempt was at the dependency, or its response body was dropped before its end) keeps its
    /// slot: with a [`background`](Self::background) spawner the call runs on to its answer,
    /// which is read and discarded, and the slot comes back then, or at this bound, when the call
    /// is cut (`stormguard_abandoned_total{outcome}` counts both). Without a spawner a dropped
    /// attempt frees its slot at once: the dependency may then see more than the cap while it
    /// finishes work nobody waits for. Default 30 s
    /// ([`stormguard_core::defaults::ABANDON_HOLD`]).
    pub abandon_hold: Duration,
    /// Request bodies are copied while sent, up to this many bytes, so a retry can resend them;
    /// a failed response's body is kept up to this size until its retry is sent. Default 64 KiB.
    pub body_limit: usize,
    /// A request carrying this header is idempotent. Default `idempotency-key`.
    pub idempotency_key: HeaderName,
    /// The headers that mark a request as already retried by another layer.
    pub stacked: StackedHeaders,
    /// The pushback headers read from responses.
    pub pushback_headers: PushbackHeaders,
    /// The limit headers read from responses.
    pub limit_headers: LimitHeaders,
    /// How long the dependency's stated concurrency limit holds. Default 10 s.
    pub limit_ttl: Duration,
    /// A stated `Remaining` at or below this holds retries until its reset. Default 0.
    pub remaining_reserve: u64,
    /// The seed of the jitter's random source (per request, derived from this and a counter).
    pub seed: u64,
    /// Where a timed-out or abandoned attempt's call runs on to its end, so its held slot comes
    /// back when the dependency really answers (or when `timeout_slot_hold` / `abandon_hold`
    /// passes, whichever is first). The library spawns nothing itself; pass your runtime's
    /// spawner, e.g. [`Spawner::tokio`]. Without one, a timed-out call is dropped and its slot
    /// is held for the whole `timeout_slot_hold`, and an abandoned one frees its slot at once.
    /// With one, each attempt's call is boxed (one allocation) so it can be moved. Default none.
    pub background: Option<Spawner>,
    /// Where the dependency's traffic is reported as `replay` events (record mode). Default
    /// none: nothing is recorded and nothing is paid for it.
    pub recorder: Option<Recorder>,
    /// Several upstreams (providers) behind the dependency, in order of preference. Each has
    /// its own cap (with the dependency's queue and queue timeout), its own breaker (with the
    /// dependency's breaker parameters) and its own pushback hold and stated limits; the
    /// budget, the scopes and the counters are the dependency's. A primary goes to the first
    /// upstream whose breaker is not open; a retry goes to the next one (a failover: it spends
    /// the budget and takes a slot on its target at once, like any retry). Each attempt's
    /// target is in its request's [`UpstreamTarget`] extension. Empty (the default): one
    /// upstream with `limiter` and `breaker`.
    pub upstreams: Vec<UpstreamSpec>,
    /// With several upstreams: attempts in flight across all of them, at most (with the
    /// dependency's queue and queue timeout). Every attempt then holds a slot under this cap
    /// and one under its upstream's. Default none: the sum of the upstreams' caps.
    pub total_cap: Option<u64>,
    /// A model provider's requests and tokens per minute, metered before each attempt is sent
    /// (see [`RateAdmission`]). Default: off.
    pub rate: RateAdmission,
}

pub use crate::rate::{RateAdmission, Rates};

/// One upstream of a dependency with several (see [`DependencyConfig::upstreams`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamSpec {
    /// Its name: the `upstream` label of its series.
    pub name: String,
    /// Its cap: the provider's concurrency limit.
    pub cap: u64,
    /// Its own adaptive cap; `None`: the dependency's (`limiter.adaptive`).
    pub adaptive: Option<stormguard_core::adaptive::AdaptiveConfig>,
}

/// Work handed to a [`Spawner`]: a timed-out call running on to its end.
pub type BackgroundTask = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A caller-supplied way to run a future to its end in the background (see
/// [`DependencyConfig::background`]).
#[derive(Clone)]
pub struct Spawner(Arc<dyn Fn(BackgroundTask) + Send + Sync>);

impl Spawner {
    /// A spawner from a function that runs the future it is given (e.g. `tokio::spawn`).
    pub fn new(f: impl Fn(BackgroundTask) + Send + Sync + 'static) -> Spawner {
        Spawner(Arc::new(f))
    }

    /// Spawns on the current tokio runtime (`tokio::spawn`). Outside one (a future dropped
    /// after its runtime has gone) the work is dropped instead of panicking: the held slot then
    /// comes back when its hold passes.
    pub fn tokio() -> Spawner {
        Spawner::new(|f| {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(f);
            }
        })
    }

    /// Runs `fut` in the background.
    pub fn spawn(&self, fut: BackgroundTask) {
        (self.0)(fut)
    }
}

impl fmt::Debug for Spawner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Spawner")
    }
}

impl DependencyConfig {
    /// A dependency named `name` with every default.
    pub fn new(name: impl Into<String>) -> DependencyConfig {
        DependencyConfig {
            name: name.into(),
            limiter: LimiterConfig::default(),
            budget: BudgetSpec::default(),
            retry: RetryConfig::default(),
            breaker: None,
            per_try_timeout: None,
            deadline: None,
            timeout_slot_hold: stormguard_core::defaults::TIMEOUT_SLOT_HOLD,
            abandon_hold: stormguard_core::defaults::ABANDON_HOLD,
            body_limit: DEFAULT_LIMIT,
            idempotency_key: IDEMPOTENCY_KEY.clone(),
            stacked: StackedHeaders::default(),
            pushback_headers: PushbackHeaders::default(),
            limit_headers: LimitHeaders::default(),
            limit_ttl: stormguard_core::defaults::LIMIT_TTL,
            remaining_reserve: 0,
            seed: 0x5eed_5707_3a6d,
            background: None,
            recorder: None,
            upstreams: Vec::new(),
            total_cap: None,
            rate: RateAdmission::default(),
        }
    }
}

/// The shared state of one dependency. Cheap to clone: clones share everything.
#[derive(Clone)]
pub struct Dependency {
    inner: Arc<Inner>,
}

struct Inner {
    config: DependencyConfig,
    clock: Arc<dyn Clock>,
    tokio_clock: Option<TokioClock>,
    /// The first upstream; with several, `more` holds the rest, in order.
    upstream: Upstream,
    more: Vec<Upstream>,
    /// The total cap across the upstreams, if configured.
    total: Option<Limiter>,
    policy: RetryPolicy,
    header_stats: HeaderStats,
    /// Whether a malformed header was logged already (it is logged once, counted always).
    malformed_logged: std::sync::atomic::AtomicBool,
    requests: AtomicU64,
    /// Request numbers in the recorded trace.
    trace_ids: AtomicU64,
    /// Rate admission, per upstream, when on (else empty).
    rates: Vec<Rates>,
    /// The call trees' allowance as this dependency sees it ([`stormguard_core::tree`]).
    tree: TreeLedger,
}

impl fmt::Debug for Dependency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dependency")
            .field("name", &self.inner.config.name)
            .field("limiter", &self.inner.upstream.limiter)
            .finish_non_exhaustive()
    }
}

/// Everything a dependency shows at one instant, for metrics and dashboards.
#[derive(Debug, Clone)]
pub struct DependencySnapshot {
    /// The dependency's name.
    pub name: String,
    /// The limiter: cap, in flight, queue, histograms.
    pub limiter: LimiterSnapshot,
    /// The retry budget.
    pub budget: BudgetSnapshot,
    /// The decision counters.
    pub counters: CountersSnapshot,
    /// The breaker's state, if there is one.
    pub breaker: Option<BreakerState>,
    /// Until when retries are held by the dependency's pushback, if they are.
    pub hold_until: Option<Timestamp>,
    /// Malformed headers ignored, by kind.
    pub malformed_headers: HeaderStatsSnapshot,
    /// Whether the policy is enforced (false: shadow mode).
    pub enforce: bool,
    /// With several upstreams: the first one's name.
    pub upstream_name: Option<String>,
    /// The total cap's limiter, when configured.
    pub total: Option<LimiterSnapshot>,
    /// With several upstreams: the second and later ones (the fields above describe the
    /// first). Empty with one upstream.
    pub others: Vec<UpstreamSnapshot>,
    /// Rate admission's limits, per upstream in order (empty when it is off).
    pub rates: Vec<crate::rate::RatesSnapshot>,
    /// What the call trees' ledger counted: originals, extras from above, extras charged here.
    pub tree: TreeCounts,
    /// The time of the snapshot on the dependency's clock.
    pub at: Timestamp,
}

impl DependencySnapshot {
    /// Rate admission's limits with each upstream's label: its name, or `0` with one unnamed
    /// upstream (the `upstream` label of the rate metrics). Empty when rate admission is off.
    pub fn rates_by_upstream(&self) -> impl Iterator<Item = (&str, &crate::rate::RatesSnapshot)> {
        std::iter::once(self.upstream_name.as_deref().unwrap_or("0"))
            .chain(self.others.iter().map(|u| u.name.as_str()))
            .zip(&self.rates)
    }
}

/// One upstream of a dependency with several, at one instant.
#[derive(Debug, Clone)]
pub struct UpstreamSnapshot {
    /// Its name.
    pub name: String,
    /// Its limiter.
    pub limiter: LimiterSnapshot,
    /// Its breaker's state, if there is one.
    pub breaker: Option<BreakerState>,
    /// Until when its pushback holds retries, if it does.
    pub hold_until: Option<Timestamp>,
}

/// Why a [`Dependency`] could not be built from its config. The message is one plain reason,
/// lowercase without a trailing period.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DependencyError {
    /// A rule of the limiter, retry policy, backoff, pushback or breaker; the field is
    /// [`ConfigError::key`].
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The budget SPEC could not be built.
    #[error(transparent)]
    Budget(#[from] SpecError),
    /// The total cap's limiter (with several upstreams) broke a rule.
    #[error("total_cap: {0}")]
    TotalCap(#[source] ConfigError),
    /// Hedging with no [`DependencyConfig::background`] spawner: a hedge's loser must run on,
    /// holding its slot, after the winner is returned.
    #[error(
        "hedging (hedge_after) needs a background spawner: the losing attempt runs on holding its slot"
    )]
    HedgeWithoutBackground,
    /// `body_limit` above 64 MiB.
    #[error("body_limit must be at most 64 MiB, got {got}")]
    BodyLimit {
        /// The limit given, in bytes.
        got: usize,
    },
}

impl DependencyError {
    /// The name of the config field that broke a rule: `body_limit`, `total_cap`, or the field
    /// core names ([`ConfigError::key`]); `budget` for the SPEC.
    pub fn key(&self) -> &'static str {
        match self {
            DependencyError::Config(e) => e.key(),
            DependencyError::Budget(_) => "budget",
            DependencyError::TotalCap(_) => "total_cap",
            DependencyError::BodyLimit { .. } => "body_limit",
            DependencyError::HedgeWithoutBackground => "hedge_after",
        }
    }
}

/// Rate admission's limits for each upstream, fresh from `config` (none when it is off).
fn fresh_rates(config: &DependencyConfig) -> Vec<Rates> {
    match config.rate.is_on() {
        true => (0..config.upstreams.len().max(1))
            .map(|_| Rates::new(config.rate.per_minute()))
            .collect(),
        false => Vec::new(),
    }
}

fn check_body_limit(config: &DependencyConfig) -> Result<(), DependencyError> {
    if config.body_limit > 64 * 1024 * 1024 {
        return Err(DependencyError::BodyLimit { got: config.body_limit });
    }
    if config.retry.hedge.is_some() && config.background.is_none() {
        return Err(DependencyError::HedgeWithoutBackground);
    }
    Ok(())
}

/// The total cap's limiter settings, with several upstreams and `total_cap` set.
fn total_config(config: &DependencyConfig) -> Option<LimiterConfig> {
    match (config.upstreams.len() > 1, config.total_cap) {
        // The total is a fixed bound over the upstreams' working caps: it does not adapt.
        (true, Some(cap)) => Some(LimiterConfig { cap, adaptive: None, ..config.limiter }),
        _ => None,
    }
}

fn total_limiter(
    config: &DependencyConfig,
    clock: &Arc<dyn Clock>,
) -> Result<Option<Limiter>, DependencyError> {
    total_config(config)
        .map(|c| Limiter::try_new(c, clock.clone()).map_err(DependencyError::TotalCap))
        .transpose()
}

/// The limiter of upstream `i`: its own cap (with several upstreams), the dependency's queue.
fn upstream_limiter(config: &DependencyConfig, i: usize) -> LimiterConfig {
    match config.upstreams.get(i) {
        Some(u) => LimiterConfig {
            cap: u.cap,
            adaptive: u.adaptive.or(config.limiter.adaptive),
            ..config.limiter
        },
        None => config.limiter,
    }
}

impl Dependency {
    /// Builds a dependency on tokio's clock ([`TokioClock::new`]: paused time moves it too when
    /// time is paused as it is built). Must be called inside a tokio runtime only if time is
    /// paused; otherwise anywhere. A test that pauses time after building its dependency builds
    /// it with [`with_clock`](Self::with_clock) on [`TokioClock::reading_tokio`].
    pub fn try_new(config: DependencyConfig) -> Result<Dependency, DependencyError> {
        let clock = TokioClock::new();
        Dependency::build(config, Arc::new(clock), Some(clock), None)
    }

    /// Like [`try_new`](Self::try_new), with a budget built elsewhere instead of
    /// `config.budget`: e.g. stormguard-redis's fleet budget, whose reserve is shared by every
    /// instance of a service.
    pub fn try_new_with_budget(
        config: DependencyConfig,
        budget: Arc<dyn RetryBudget>,
    ) -> Result<Dependency, DependencyError> {
        let clock = TokioClock::new();
        Dependency::build(config, Arc::new(clock), Some(clock), Some(budget))
    }

    /// Builds a dependency on another clock (a manual clock in a simulation, or
    /// [`TokioClock::reading_tokio`]). Sleeps still use tokio's timer.
    pub fn with_clock(
        config: DependencyConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Dependency, DependencyError> {
        Dependency::build(config, clock, None, None)
    }

    fn build(
        config: DependencyConfig,
        clock: Arc<dyn Clock>,
        tokio_clock: Option<TokioClock>,
        budget: Option<Arc<dyn RetryBudget>>,
    ) -> Result<Dependency, DependencyError> {
        check_body_limit(&config)?;
        let policy = match budget {
            Some(budget) => RetryPolicy::try_new(config.retry.clone(), budget)?,
            None => RetryPolicy::with_budget(config.retry.clone(), config.budget.build()?)?,
        };
        let upstreams = (0..config.upstreams.len().max(1))
            .map(|i| Upstream::new(upstream_limiter(&config, i), config.breaker, clock.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        let total = total_limiter(&config, &clock)?;
        let rates = fresh_rates(&config);
        Ok(Dependency::assemble(config, (clock, tokio_clock), upstreams, total, policy, 0, rates))
    }

    /// The dependency made of these parts (`upstreams` holds at least one); its recorded
    /// trace's request numbers start after `trace_ids`.
    fn assemble(
        config: DependencyConfig,
        (clock, tokio_clock): (Arc<dyn Clock>, Option<TokioClock>),
        mut upstreams: Vec<Upstream>,
        total: Option<Limiter>,
        policy: RetryPolicy,
        trace_ids: u64,
        rates: Vec<Rates>,
    ) -> Dependency {
        let upstream = upstreams.remove(0);
        Dependency {
            inner: Arc::new(Inner {
                config,
                clock,
                tokio_clock,
                upstream,
                more: upstreams,
                total,
                policy,
                header_stats: HeaderStats::new(),
                malformed_logged: std::sync::atomic::AtomicBool::new(false),
                tree: TreeLedger::default(),
                requests: AtomicU64::new(0),
                trace_ids: AtomicU64::new(trace_ids),
                rates,
            }),
        }
    }

    /// A dependency built from `config` that keeps this one's state wherever the new config
    /// allows — for a reload. The limiter (in flight, queue, held slots) and the pushback hold
    /// are kept when the cap, queue and queue timeout are unchanged; the breaker when its
    /// parameters are; the budget (and its balance) when its SPEC is; the kill switch always,
    /// and shadow mode when `enforce` is unchanged. Anything changed starts fresh. The decision
    /// counters start from zero. Clocks are shared.
    pub fn successor(&self, config: DependencyConfig) -> Result<Dependency, DependencyError> {
        let old = &self.inner;
        check_body_limit(&config)?;
        let budget: Arc<dyn stormguard_core::budget::RetryBudget> =
            if config.budget == old.config.budget {
                old.policy.budget().clone()
            } else {
                Arc::new(config.budget.build()?)
            };
        let policy = RetryPolicy::try_new(config.retry.clone(), budget)?;
        policy.set_retries_enabled(old.policy.retries_enabled());
        if config.retry.enforce == old.config.retry.enforce {
            policy.set_enforce(old.policy.enforce());
        }
        // Each upstream by name (the only one when unnamed): kept where its limiter and
        // breaker settings are unchanged.
        let old_name = |i: usize| old.config.upstreams.get(i).map(|u| u.name.as_str());
        let mut upstreams = Vec::new();
        for i in 0..config.upstreams.len().max(1) {
            let name = config.upstreams.get(i).map(|u| u.name.as_str());
            let limiter_config = upstream_limiter(&config, i);
            let previous = (0..old.config.upstreams.len().max(1))
                .find(|&j| old_name(j) == name)
                .map(|j| (j, self.upstream_at(j)));
            let limiter = match previous {
                Some((j, u)) if upstream_limiter(&old.config, j) == limiter_config => {
                    u.limiter.clone()
                }
                _ => stormguard_core::limiter::Limiter::try_new(limiter_config, old.clock.clone())?,
            };
            let breaker = match previous {
                Some((_, u)) if config.breaker == old.config.breaker => u.breaker.clone(),
                _ => config.breaker.map(stormguard_core::breaker::Breaker::try_new).transpose()?,
            };
            let hold = previous.map_or_else(
                || Arc::new(stormguard_core::backoff::PushbackHold::new()),
                |(_, u)| u.hold.clone(),
            );
            upstreams.push(Upstream { limiter, breaker, hold });
        }
        let total = match &old.total {
            Some(t) if total_config(&config) == Some(*t.config()) => Some(t.clone()),
            _ => total_limiter(&config, &old.clock)?,
        };
        // The recorded trace's request numbers go on from the old ones.
        let trace_ids = old.trace_ids.load(Ordering::Relaxed);
        // Each upstream's rates (what was learned, what is booked) by name, while rate
        // admission's configuration is unchanged.
        let rates = if config.rate == old.config.rate && config.rate.is_on() {
            (0..config.upstreams.len().max(1))
                .map(|i| {
                    let name = config.upstreams.get(i).map(|u| u.name.as_str());
                    (0..old.config.upstreams.len().max(1))
                        .find(|&j| old_name(j) == name)
                        .and_then(|j| old.rates.get(j).cloned())
                        .unwrap_or_else(|| Rates::new(config.rate.per_minute()))
                })
                .collect()
        } else {
            fresh_rates(&config)
        };
        let clocks = (old.clock.clone(), old.tokio_clock);
        Ok(Dependency::assemble(config, clocks, upstreams, total, policy, trace_ids, rates))
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &DependencyConfig {
        &self.inner.config
    }

    /// The dependency's name.
    pub fn name(&self) -> &str {
        &self.inner.config.name
    }

    /// The time on the dependency's clock.
    #[inline]
    pub fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }

    /// The limiter, breaker and pushback hold (of the first upstream, with several).
    pub fn upstream(&self) -> &Upstream {
        &self.inner.upstream
    }

    /// Upstream `i` (see [`DependencyConfig::upstreams`]); the first when out of range.
    pub fn upstream_at(&self, i: usize) -> &Upstream {
        match i {
            0 => &self.inner.upstream,
            i => self.inner.more.get(i - 1).unwrap_or(&self.inner.upstream),
        }
    }

    /// How long until upstream `i` takes retries again, when that is known: its breaker's
    /// break ends, the dependency's pushback hold (a `Retry-After` it sent) lifts, under rate
    /// admission the provider's window has room for one more request, and, for a refusal for
    /// the budget (`reason`), the budget allows a retry again with no new traffic
    /// ([`RetryBudget::retry_after`]),
    /// whichever is latest. `None` when none of these holds. What a refusal can tell its
    /// caller as `Retry-After`.
    pub fn retry_after(
        &self,
        i: usize,
        reason: stormguard_core::Denied,
    ) -> Option<std::time::Duration> {
        let now = self.now();
        let budget = match reason {
            stormguard_core::Denied::Budget => {
                self.policy().budget().retry_after(now).filter(|w| !w.is_zero())
            }
            _ => None,
        };
        let u = self.upstream_at(i);
        let open = u.breaker.as_ref().and_then(|b| match b.state(now) {
            BreakerState::Open { until } => Some(until),
            _ => None,
        });
        let until = open.into_iter().chain(u.hold.is_held(now)).max();
        let held = until.map(|t| t.saturating_since(now));
        let turn = self
            .rates_at(i)
            .map(|r| r.wait_for(now, crate::extensions::RateCost::default()))
            .filter(|w| !w.is_zero());
        held.into_iter().chain(turn).chain(budget).max()
    }

    /// Rate admission's limits on the first upstream, when it is on.
    pub fn rates(&self) -> Option<&Rates> {
        self.inner.rates.first()
    }

    /// Rate admission's limits on upstream `i`, when it is on.
    #[inline]
    pub fn rates_at(&self, i: usize) -> Option<&Rates> {
        self.inner.rates.get(i)
    }

    /// The total cap across the upstreams, when there are several and `total_cap` is set.
    #[inline]
    pub fn total(&self) -> Option<&Limiter> {
        self.inner.total.as_ref()
    }

    /// How many upstreams the dependency has (at least 1).
    pub fn upstream_count(&self) -> usize {
        1 + self.inner.more.len()
    }

    /// Where a primary costing `cost` goes: the first upstream whose breaker is not open and,
    /// under rate admission, whose window has room for it now (not held by a 429's reset or a
    /// spent quota) and that is not cooling down after an overloaded answer; else the first whose breaker is not open (it waits
    /// there for its turn); else the first (its breaker refuses it).
    pub fn primary_target(&self, now: Timestamp, cost: RateCost) -> usize {
        let n = self.upstream_count();
        (0..n)
            .find(|&i| self.allows(i, now) && self.has_room(i, now, cost))
            .or_else(|| (0..n).find(|&i| self.allows(i, now)))
            .unwrap_or(0)
    }

    /// Where a retry of an attempt that failed on `failed` goes: the next upstream, in order
    /// and wrapping around, whose breaker is not open and whose window has room (a retry never
    /// waits for one); else the next whose breaker is not open; else `failed` itself.
    pub fn failover_target(&self, failed: usize, now: Timestamp, cost: RateCost) -> usize {
        let n = self.upstream_count();
        let next = || (1..n).map(move |k| (failed + k) % n);
        next()
            .find(|&i| self.allows(i, now) && self.has_room(i, now, cost))
            .or_else(|| next().find(|&i| self.allows(i, now)))
            .unwrap_or(failed)
    }

    /// Whether upstream `i`'s rate window takes `cost` now and it is not cooling down
    /// (always, without rate admission).
    fn has_room(&self, i: usize, now: Timestamp, cost: RateCost) -> bool {
        self.rates_at(i).is_none_or(|r| !r.cooling(now) && r.wait_for(now, cost).is_zero())
    }

    fn allows(&self, i: usize, now: Timestamp) -> bool {
        self.upstream_at(i)
            .breaker
            .as_ref()
            .is_none_or(|b| !matches!(b.state(now), BreakerState::Open { .. }))
    }

    /// The retry rules and budget.
    pub fn policy(&self) -> &RetryPolicy {
        &self.inner.policy
    }

    /// What a request's [`Life`](stormguard_core::life::Life) reads of this dependency, for a
    /// request costing `cost` in the provider's window: its policy, upstreams, failover, total
    /// cap and rate admission.
    pub fn gates(&self, cost: RateCost) -> DependencyGates<'_> {
        DependencyGates { dep: self, cost }
    }

    /// Malformed header counters.
    pub fn header_stats(&self) -> &HeaderStats {
        &self.inner.header_stats
    }

    /// The call trees' ledger: every request with a tree context is entered on it, and every
    /// retry and hedge of one charged to it ([`stormguard_core::tree`]).
    pub fn tree(&self) -> &TreeLedger {
        &self.inner.tree
    }

    /// The call tree's context a request carries (its `stormguard-tree` baggage member), if
    /// any: one that does not read is ignored and counted
    /// (`stormguard_malformed_headers_total{header="stormguard-tree"}`).
    pub fn tree_context(&self, headers: &http::HeaderMap) -> Option<TreeContext> {
        match stormguard_http::tree::read(headers)? {
            Ok(ctx) => Some(ctx),
            Err(e) => {
                self.inner.header_stats.record(stormguard_http::headers::HeaderKind::Tree);
                tracing::debug!(dependency = self.name(), error = %e, "a call tree's context was ignored");
                None
            }
        }
    }

    /// A random source for one request's jitter: seeded from the dependency's seed and a
    /// per-request counter, so a run with the same seed and order draws the same waits.
    pub fn request_rng(&self) -> SplitMix64 {
        let n = self.inner.requests.fetch_add(1, Ordering::Relaxed);
        SplitMix64::new(self.inner.config.seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    /// A new request's number in the recorded trace, when recording (see
    /// [`DependencyConfig::recorder`]).
    pub(crate) fn trace_id(&self) -> Option<u64> {
        self.inner
            .config
            .recorder
            .as_ref()
            .map(|_| self.inner.trace_ids.fetch_add(1, Ordering::Relaxed) + 1)
    }

    /// Reports one event of request `id` to the recorder (nothing when `id` is `None`).
    pub(crate) fn record(&self, id: Option<u64>, at: Timestamp, op: TraceOp) {
        if let (Some(id), Some(r)) = (id, &self.inner.config.recorder) {
            if let TraceOp::Retry(_, refused) = op {
                let (mut primaries, mut retries) = (0, 0);
                for i in 0..self.upstream_count() {
                    let l = &self.upstream_at(i).limiter;
                    primaries += l.primaries_active();
                    retries += l.retries_in_flight();
                }
                // A snapshot of the moment before the ask: a retry that was sent already holds
                // its slot.
                if refused.is_none() {
                    retries = retries.saturating_sub(1);
                }
                let active = TraceOp::Active { n: primaries + retries, retries };
                r.record(self.name(), TraceEvent { at, id, op: active });
            }
            r.record(self.name(), TraceEvent { at, id, op });
        }
    }

    /// The tokio instant of a timestamp, for sleeping until it (`None` on a non-tokio clock).
    pub fn instant_of(&self, t: Timestamp) -> Option<tokio::time::Instant> {
        self.inner.tokio_clock.map(|c| c.instant_of(t))
    }

    /// Applies what a response said about the dependency's limits: a stated concurrency limit
    /// lowers the cap for `limit_ttl`; a stated remaining at or below the reserve holds retries
    /// until its reset.
    pub fn apply_limits(&self, headers: &http::HeaderMap) -> LimitInfo {
        self.apply_limits_at(0, headers)
    }

    /// [`apply_limits`](Self::apply_limits) for upstream `i`: each upstream's stated limits are
    /// its own.
    pub fn apply_limits_at(&self, i: usize, headers: &http::HeaderMap) -> LimitInfo {
        // Most responses state no limit: skip the wall clock and the reset headers then.
        if !self.inner.config.limit_headers.mentions_limits(headers) {
            return LimitInfo::default();
        }
        let info = self.inner.config.limit_headers.read_limits(
            headers,
            SystemTime::now(),
            &self.inner.header_stats,
        );
        self.log_malformed_once();
        let upstream = self.upstream_at(i);
        if let Some(limit) = info.limit {
            upstream.limiter.set_limit_hint(limit, self.inner.config.limit_ttl);
        }
        if let (Some(remaining), Some(reset)) = (info.remaining, info.reset)
            && remaining <= self.inner.config.remaining_reserve
        {
            upstream.hold.hold_until(self.now().saturating_add(reset));
        }
        info
    }

    /// Logs the first malformed header the dependency sent (every one is counted in
    /// `stormguard_malformed_headers_total`); later ones are only counted.
    pub fn log_malformed_once(&self) {
        if self.inner.malformed_logged.load(Ordering::Relaxed) {
            return;
        }
        let seen = self.inner.header_stats.snapshot();
        if seen.total() > 0 && !self.inner.malformed_logged.swap(true, Ordering::Relaxed) {
            let header = stormguard_http::headers::HeaderKind::ALL
                .into_iter()
                .find(|k| seen.get(*k) > 0)
                .map(|k| k.as_str());
            tracing::warn!(
                dependency = %self.inner.config.name,
                header,
                "the dependency sent a malformed header; it was ignored (logged once, counted always)"
            );
        }
    }

    /// A snapshot of every signal, as [`Reader::Local`] reads it: reading it resets that
    /// reader's high-water marks (see [`snapshot_for`](Self::snapshot_for)).
    pub fn snapshot(&self) -> DependencySnapshot {
        self.snapshot_for(Reader::Local)
    }

    /// A snapshot of every signal. Each [`Reader`] has its own high-water marks: the most
    /// attempts in flight since *its* previous reading, so `/stats.json` polling does not reset
    /// a Prometheus scrape's.
    pub fn snapshot_for(&self, reader: Reader) -> DependencySnapshot {
        let now = self.now();
        DependencySnapshot {
            name: self.inner.config.name.clone(),
            limiter: self.inner.upstream.limiter.snapshot_for(reader),
            budget: self.inner.policy.budget().snapshot(now),
            counters: self.inner.policy.counters().snapshot(),
            breaker: self.inner.upstream.breaker.as_ref().map(|b| b.state(now)),
            hold_until: self.inner.upstream.hold.is_held(now),
            malformed_headers: self.inner.header_stats.snapshot(),
            enforce: self.inner.policy.enforce(),
            upstream_name: self.inner.config.upstreams.first().map(|u| u.name.clone()),
            total: self.inner.total.as_ref().map(|t| t.snapshot_for(reader)),
            others: self
                .inner
                .more
                .iter()
                .zip(self.inner.config.upstreams.iter().skip(1))
                .map(|(u, spec)| UpstreamSnapshot {
                    name: spec.name.clone(),
                    limiter: u.limiter.snapshot_for(reader),
                    breaker: u.breaker.as_ref().map(|b| b.state(now)),
                    hold_until: u.hold.is_held(now),
                })
                .collect(),
            rates: self.inner.rates.iter().map(|r| r.snapshot(now)).collect(),
            tree: self.inner.tree.counts(),
            at: now,
        }
    }
}

/// A dependency as a request's life reads it ([`Dependency::gates`]): a retry or hedge fails
/// over to the next upstream whose breaker is closed and whose window has room, and books its
/// turn now or never ([`book_retry`](crate::rate::book_retry)).
#[derive(Debug, Clone, Copy)]
pub struct DependencyGates<'a> {
    dep: &'a Dependency,
    cost: RateCost,
}

impl stormguard_core::life::Gates for DependencyGates<'_> {
    type Booking = crate::rate::RateReservation;

    fn policy(&self) -> &RetryPolicy {
        self.dep.policy()
    }

    fn upstream(&self, target: usize) -> &Upstream {
        self.dep.upstream_at(target)
    }

    fn failover(&self, failed: usize, now: Timestamp) -> usize {
        match self.dep.upstream_count() {
            1 => 0,
            _ => self.dep.failover_target(failed, now, self.cost),
        }
    }

    fn total(&self) -> Option<&Limiter> {
        self.dep.total()
    }

    fn book_now(
        &self,
        target: usize,
        now: Timestamp,
    ) -> Result<Option<crate::rate::RateReservation>, stormguard_core::Denied> {
        crate::rate::book_retry(self.dep, target, self.cost, now)
    }

    fn refund(&self, booking: crate::rate::RateReservation, now: Timestamp) {
        booking.refund(now);
    }
}
