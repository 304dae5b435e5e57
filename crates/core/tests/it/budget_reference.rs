//! The four budget policies against naive reference models.
//!
//! Each model below is written from docs/budgets.md ("Exactly what each allows") alone, as plainly as possible:
//! the ratio model keeps every deposit and withdrawal in a `Vec` and recounts the window on each
//! query, in exact integer arithmetic. Property tests run random event sequences through a real
//! policy and its model side by side and require the same decision for every `try_retry` and the
//! same balance. Threaded tests hammer one shared policy and check that contention never grants
//! more than the sequential arithmetic allows. Mutated models (an off-by-one window, `≥` for `>`,
//! …) run through the same harness and must be caught, so the harness can fail.
//!
//! Two tests run the ratio policy far from the clock's zero (from slice index 2^31 on, e.g.
//! unix-epoch milliseconds with ttl 5–8 s), where 32-bit slice tags once wrapped and the policy
//! lost deposits and withdrawals and granted unbounded retries.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use proptest::prelude::*;
use stormguard_core::budget::{
    BudgetSpec, ConcurrencyBudget, ConcurrencyConfig, DepositOn, FailureKind, Outcome, QuotaBudget,
    QuotaConfig, RatioBudget, RatioConfig, RetryBudget, RetryPermit, TokenBucket,
    TokenBucketConfig,
};
use stormguard_core::clock::Timestamp;
use stormguard_core::decimal::Fraction;

const MILLION: u64 = 1_000_000;
const NANOS_PER_MS: u64 = 1_000_000;
const THREADS: usize = 8;

// ---------------------------------------------------------------------------------------------
// Reference models
// ---------------------------------------------------------------------------------------------

/// A retry the model granted: what it cost and whether a success already refunded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RefPermit {
    cost: u64,
    refunded: bool,
}

/// The budget protocol, as a model sees it. Times are nanoseconds since the clock's zero.
trait Model: fmt::Debug {
    fn request(&mut self, now: u64);
    fn outcome(&mut self, now: u64, outcome: Outcome);
    fn try_retry(&mut self, now: u64, kind: FailureKind) -> Option<RefPermit>;
    fn succeeded(&mut self, permit: &mut RefPermit);
    fn finished(&mut self, permit: RefPermit);
    fn set_active(&mut self, requests: u64, retries: u64);
    /// The balance as `BudgetSnapshot::balance` reports it.
    fn balance(&self, now: u64) -> f64;
    /// Whether some retry (of any kind) would be allowed now.
    fn allows_any(&self, now: u64) -> bool;
}

/// ratio: `floor(min_per_sec × ttl + percent × deposits − withdrawals)` over the current slice of
/// `ttl / 10` and the 9 before it; a retry is allowed while that is ≥ 1 and withdraws 1.
#[derive(Debug)]
struct RatioModel {
    percent_m: u64,
    min_per_sec_m: u64,
    ttl_ns: u64,
    deposit_on_success: bool,
    /// Slices in the window: 10 per docs/budgets.md; other values only in the mutation tests.
    window_slices: u64,
    /// `(time, true)` for a deposit, `(time, false)` for a withdrawal.
    events: Vec<(u64, bool)>,
}

impl RatioModel {
    fn new(p: &RatioParams) -> RatioModel {
        RatioModel {
            percent_m: p.percent_m,
            min_per_sec_m: p.min_per_sec_m,
            ttl_ns: p.ttl_ms * NANOS_PER_MS,
            deposit_on_success: p.deposit_on_success,
            window_slices: 10,
            events: Vec::new(),
        }
    }

    fn whole_balance(&self, now: u64) -> i64 {
        let slice = self.ttl_ns / 10;
        let current = now / slice;
        let (mut deposits, mut withdrawals) = (0i128, 0i128);
        for &(t, deposit) in &self.events {
            let s = t / slice;
            if s <= current && s + (self.window_slices - 1) >= current {
                if deposit {
                    deposits += 1;
                } else {
                    withdrawals += 1;
                }
            }
        }
        // Everything in units of 10^-15: min_per_sec is in 10^-6 per second and ttl in 10^-9
        // seconds; percent is in 10^-6.
        let unit: i128 = 1_000_000_000_000_000;
        let reserve = i128::from(self.min_per_sec_m) * i128::from(self.ttl_ns);
        let earned = i128::from(self.percent_m) * deposits * 1_000_000_000;
        let total = reserve + earned - withdrawals * unit;
        i64::try_from(total.div_euclid(unit)).expect("balance fits i64")
    }
}

impl Model for RatioModel {
    fn request(&mut self, now: u64) {
        if !self.deposit_on_success {
            self.events.push((now, true));
        }
    }
    fn outcome(&mut self, now: u64, outcome: Outcome) {
        // One deposit per original request whose final response succeeds, retried or not.
        if self.deposit_on_success && matches!(outcome, Outcome::Success { .. }) {
            self.events.push((now, true));
        }
    }
    fn try_retry(&mut self, now: u64, _kind: FailureKind) -> Option<RefPermit> {
        if self.whole_balance(now) >= 1 {
            self.events.push((now, false));
            Some(RefPermit { cost: 1, refunded: false })
        } else {
            None
        }
    }
    fn succeeded(&mut self, _permit: &mut RefPermit) {}
    fn finished(&mut self, _permit: RefPermit) {}
    fn set_active(&mut self, _requests: u64, _retries: u64) {}
    fn balance(&self, now: u64) -> f64 {
        self.whole_balance(now) as f64
    }
    fn allows_any(&self, now: u64) -> bool {
        self.whole_balance(now) >= 1
    }
}

/// concurrency: retries in flight `< max(floor(percent × n), min)` (or `< slots`), where n and
/// the retries in flight both include the retries this budget granted and that have not finished.
#[derive(Debug)]
struct ConcurrencyModel {
    percent_m: u64,
    min: u64,
    slots: Option<u64>,
    requests: u64,
    retries: u64,
    granted: u64,
    /// `<` per docs/budgets.md; `≤` only in the mutation tests.
    inclusive: bool,
}

impl ConcurrencyModel {
    fn new(p: &ConcurrencyParams) -> ConcurrencyModel {
        ConcurrencyModel {
            percent_m: p.percent_m,
            min: p.min,
            slots: p.slots,
            requests: 0,
            retries: 0,
            granted: 0,
            inclusive: false,
        }
    }

    fn limit(&self) -> u64 {
        match self.slots {
            Some(slots) => slots,
            None => {
                let n = u128::from(self.requests + self.granted);
                let share = n * u128::from(self.percent_m) / u128::from(MILLION);
                u64::try_from(share).unwrap().max(self.min)
            }
        }
    }

    fn in_flight(&self) -> u64 {
        self.retries + self.granted
    }

    fn allowed(&self) -> bool {
        if self.inclusive {
            self.in_flight() <= self.limit()
        } else {
            self.in_flight() < self.limit()
        }
    }
}

impl Model for ConcurrencyModel {
    fn request(&mut self, _now: u64) {}
    fn outcome(&mut self, _now: u64, _outcome: Outcome) {}
    fn try_retry(&mut self, _now: u64, _kind: FailureKind) -> Option<RefPermit> {
        if self.allowed() {
            self.granted += 1;
            Some(RefPermit { cost: 1, refunded: false })
        } else {
            None
        }
    }
    fn succeeded(&mut self, _permit: &mut RefPermit) {}
    fn finished(&mut self, _permit: RefPermit) {
        self.granted -= 1;
    }
    fn set_active(&mut self, requests: u64, retries: u64) {
        self.requests = requests;
        self.retries = retries;
    }
    fn balance(&self, _now: u64) -> f64 {
        self.limit().saturating_sub(self.in_flight()) as f64
    }
    fn allows_any(&self, _now: u64) -> bool {
        self.allowed()
    }
}

/// token-bucket, in milli-tokens: starts full; a retryable failure or a don't-retry pushback
/// costs 1000 (floor 0); a success adds `token_ratio` (capped at max); a retry is allowed only
/// while `tokens > max / 2` and costs nothing.
#[derive(Debug)]
struct TokenBucketModel {
    max_milli: u64,
    ratio_milli: u64,
    milli: u64,
    /// `>` per docs/budgets.md; `≥` only in the mutation tests.
    inclusive: bool,
}

impl TokenBucketModel {
    fn new(p: &TokenBucketParams) -> TokenBucketModel {
        TokenBucketModel {
            max_milli: p.max_milli,
            ratio_milli: p.ratio_milli,
            milli: p.max_milli,
            inclusive: false,
        }
    }

    fn allowed(&self) -> bool {
        // tokens > max / 2, without halving an odd number of milli-tokens.
        if self.inclusive {
            2 * self.milli >= self.max_milli
        } else {
            2 * self.milli > self.max_milli
        }
    }
}

impl Model for TokenBucketModel {
    fn request(&mut self, _now: u64) {}
    fn outcome(&mut self, _now: u64, outcome: Outcome) {
        match outcome {
            Outcome::RetryableFailure(_) | Outcome::DontRetryPushback => {
                self.milli = self.milli.saturating_sub(1000);
            }
            Outcome::Success { .. } => {
                self.milli = (self.milli + self.ratio_milli).min(self.max_milli);
            }
            Outcome::OtherFailure => {}
        }
    }
    fn try_retry(&mut self, _now: u64, _kind: FailureKind) -> Option<RefPermit> {
        self.allowed().then_some(RefPermit { cost: 0, refunded: false })
    }
    fn succeeded(&mut self, _permit: &mut RefPermit) {}
    fn finished(&mut self, _permit: RefPermit) {}
    fn set_active(&mut self, _requests: u64, _retries: u64) {}
    fn balance(&self, _now: u64) -> f64 {
        self.milli as f64 / 1000.0
    }
    fn allows_any(&self, _now: u64) -> bool {
        self.allowed()
    }
}

/// quota: a bucket of `capacity`, starting full; a grant charges the cost of its failure kind
/// and is refused when the bucket holds less; a first-try success adds the reward; a permit's
/// `succeeded()` refunds its own cost once. Nothing takes the bucket above its capacity.
#[derive(Debug)]
struct QuotaModel {
    capacity: u64,
    retry_cost: u64,
    timeout_cost: u64,
    throttle_cost: u64,
    reward: u64,
    tokens: u64,
    /// `true` per docs/budgets.md; `false` only in the mutation tests.
    cap_reward: bool,
}

impl QuotaModel {
    fn new(p: &QuotaParams) -> QuotaModel {
        QuotaModel {
            capacity: p.capacity,
            retry_cost: p.retry_cost,
            timeout_cost: p.timeout_cost,
            throttle_cost: p.throttle_cost.unwrap_or(p.retry_cost),
            reward: p.reward,
            tokens: p.capacity,
            cap_reward: true,
        }
    }

    fn cost(&self, kind: FailureKind) -> u64 {
        match kind {
            FailureKind::Error => self.retry_cost,
            FailureKind::Timeout => self.timeout_cost,
            FailureKind::Throttle => self.throttle_cost,
        }
    }
}

impl Model for QuotaModel {
    fn request(&mut self, _now: u64) {}
    fn outcome(&mut self, _now: u64, outcome: Outcome) {
        if outcome == (Outcome::Success { retried: false }) {
            self.tokens += self.reward;
            if self.cap_reward {
                self.tokens = self.tokens.min(self.capacity);
            }
        }
    }
    fn try_retry(&mut self, _now: u64, kind: FailureKind) -> Option<RefPermit> {
        let cost = self.cost(kind);
        if self.tokens >= cost {
            self.tokens -= cost;
            Some(RefPermit { cost, refunded: false })
        } else {
            None
        }
    }
    fn succeeded(&mut self, permit: &mut RefPermit) {
        if !permit.refunded {
            permit.refunded = true;
            self.tokens = (self.tokens + permit.cost).min(self.capacity);
        }
    }
    fn finished(&mut self, _permit: RefPermit) {}
    fn set_active(&mut self, _requests: u64, _retries: u64) {}
    fn balance(&self, _now: u64) -> f64 {
        self.tokens as f64
    }
    fn allows_any(&self, _now: u64) -> bool {
        [FailureKind::Error, FailureKind::Timeout, FailureKind::Throttle]
            .into_iter()
            // A free retry is always allowed, even by an empty bucket whose utilization reads 1.0;
            // that degenerate case is not what the utilization check is about.
            .any(|k| self.cost(k) > 0 && self.tokens >= self.cost(k))
    }
}

// ---------------------------------------------------------------------------------------------
// Parameters, and building the real policies (from a SPEC or from the config structs)
// ---------------------------------------------------------------------------------------------

/// `units × 10^-scale` as the shortest decimal text (`250000, 6` → `0.25`).
fn decimal_text(units: u64, scale: u32) -> String {
    let one = 10u64.pow(scale);
    let (whole, frac) = (units / one, units % one);
    if frac == 0 {
        return whole.to_string();
    }
    let digits = format!("{frac:0width$}", width = scale as usize);
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

fn from_spec(spec: &str) -> Box<dyn RetryBudget> {
    let parsed = BudgetSpec::parse(spec).unwrap_or_else(|e| panic!("`{spec}` refused: {e}"));
    Box::new(parsed.build().unwrap_or_else(|e| panic!("`{spec}` not built: {e}")))
}

#[derive(Debug, Clone)]
struct RatioParams {
    percent_m: u64,
    min_per_sec_m: u64,
    ttl_ms: u64,
    deposit_on_success: bool,
    via_spec: bool,
}

impl RatioParams {
    fn spec(&self) -> String {
        format!(
            "ratio:percent={},min_per_sec={},ttl={}ms,deposit_on={}",
            decimal_text(self.percent_m, 6),
            decimal_text(self.min_per_sec_m, 6),
            self.ttl_ms,
            if self.deposit_on_success { "success" } else { "admission" }
        )
    }

    fn build(&self) -> Box<dyn RetryBudget> {
        if self.via_spec {
            return from_spec(&self.spec());
        }
        let config = RatioConfig {
            percent: Fraction::from_millionths(self.percent_m),
            min_per_sec: Fraction::from_millionths(self.min_per_sec_m),
            ttl: Duration::from_millis(self.ttl_ms),
            deposit_on: if self.deposit_on_success {
                DepositOn::Success
            } else {
                DepositOn::Admission
            },
        };
        Box::new(RatioBudget::try_new(config).expect("valid ratio config"))
    }
}

#[derive(Debug, Clone)]
struct ConcurrencyParams {
    percent_m: u64,
    min: u64,
    slots: Option<u64>,
    via_spec: bool,
}

impl ConcurrencyParams {
    fn spec(&self) -> String {
        match self.slots {
            Some(slots) => format!("concurrency:slots={slots}"),
            None => {
                format!("concurrency:percent={},min={}", decimal_text(self.percent_m, 6), self.min)
            }
        }
    }

    fn build(&self) -> Box<dyn RetryBudget> {
        if self.via_spec {
            return from_spec(&self.spec());
        }
        let config = ConcurrencyConfig {
            percent: Fraction::from_millionths(self.percent_m),
            min: self.min,
            slots: self.slots,
        };
        Box::new(ConcurrencyBudget::try_new(config).expect("valid concurrency config"))
    }
}

#[derive(Debug, Clone)]
struct TokenBucketParams {
    max_milli: u64,
    ratio_milli: u64,
    via_spec: bool,
}

impl TokenBucketParams {
    fn spec(&self) -> String {
        format!(
            "token-bucket:max_tokens={},token_ratio={}",
            decimal_text(self.max_milli, 3),
            decimal_text(self.ratio_milli, 3)
        )
    }

    fn build(&self) -> Box<dyn RetryBudget> {
        if self.via_spec {
            return from_spec(&self.spec());
        }
        let config = TokenBucketConfig {
            max_milli_tokens: self.max_milli,
            token_ratio_milli: self.ratio_milli,
        };
        Box::new(TokenBucket::try_new(config).expect("valid token bucket config"))
    }
}

#[derive(Debug, Clone)]
struct QuotaParams {
    capacity: u64,
    retry_cost: u64,
    timeout_cost: u64,
    throttle_cost: Option<u64>,
    reward: u64,
    via_spec: bool,
}

impl QuotaParams {
    fn spec(&self) -> String {
        let mut spec = format!(
            "quota:capacity={},retry_cost={},timeout_cost={},success_reward={}",
            self.capacity, self.retry_cost, self.timeout_cost, self.reward
        );
        if let Some(t) = self.throttle_cost {
            spec.push_str(&format!(",throttle_cost={t}"));
        }
        spec
    }

    fn build(&self) -> Box<dyn RetryBudget> {
        if self.via_spec {
            return from_spec(&self.spec());
        }
        let config = QuotaConfig {
            capacity: self.capacity,
            retry_cost: self.retry_cost,
            timeout_cost: self.timeout_cost,
            throttle_cost: self.throttle_cost.unwrap_or(self.retry_cost),
            success_reward: self.reward,
        };
        Box::new(QuotaBudget::try_new(config).expect("valid quota config"))
    }
}

// ---------------------------------------------------------------------------------------------
// Event sequences and the harness that runs one through a policy and its model
// ---------------------------------------------------------------------------------------------

/// What happens to a granted retry right away.
#[derive(Debug, Clone, Copy)]
enum Then {
    /// Keep the permit alive; a later step finishes it.
    Keep,
    /// The retry finished (failed) at once.
    Drop,
    /// The retry succeeded at once.
    SucceedDrop,
}

#[derive(Debug, Clone)]
enum Op {
    /// Time moves forward by this many nanoseconds.
    Advance(u64),
    /// Time moves to `slices` slice boundaries ahead, then `offset` ns (−1, 0 or 1).
    ToBoundary {
        slices: u64,
        offset: i8,
    },
    Request,
    Outcome(Outcome),
    Retry(FailureKind, Then),
    /// The live permit at this index (modulo their count) finishes.
    Finish(usize),
    /// The live permit at this index succeeds (`succeeded()` once or twice), then maybe finishes.
    Succeed {
        index: usize,
        twice: bool,
        finish: bool,
    },
    SetActive(u64, u64),
    Snapshot,
}

fn kinds() -> impl Strategy<Value = FailureKind> {
    prop_oneof![Just(FailureKind::Error), Just(FailureKind::Timeout), Just(FailureKind::Throttle),]
}

fn outcomes() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        3 => any::<bool>().prop_map(|retried| Outcome::Success { retried }),
        3 => kinds().prop_map(Outcome::RetryableFailure),
        1 => Just(Outcome::OtherFailure),
        1 => Just(Outcome::DontRetryPushback),
    ]
}

fn thens() -> impl Strategy<Value = Then> {
    prop_oneof![Just(Then::Keep), Just(Then::Drop), Just(Then::SucceedDrop)]
}

/// Gaps from nothing to several 60 s windows.
fn gaps() -> impl Strategy<Value = u64> {
    prop_oneof![
        2 => Just(0u64),
        1 => 1u64..1_000,
        4 => (1u64..1_000).prop_map(|ms| ms * NANOS_PER_MS),
        3 => (1_000u64..30_000).prop_map(|ms| ms * NANOS_PER_MS),
        1 => (30_000u64..200_000).prop_map(|ms| ms * NANOS_PER_MS),
    ]
}

/// Weights: time, requests, outcomes, retries, permit ends, set_active, snapshots.
fn ops(weights: [u32; 7], max_len: usize) -> impl Strategy<Value = Vec<Op>> {
    let [time, request, outcome, retry, finish, active, snapshot] = weights;
    let op = prop_oneof![
        time => gaps().prop_map(Op::Advance),
        (time / 3).max(1) => (1u64..=25, -1i8..=1)
            .prop_map(|(slices, offset)| Op::ToBoundary { slices, offset }),
        request => Just(Op::Request),
        outcome => outcomes().prop_map(Op::Outcome),
        retry => (kinds(), thens()).prop_map(|(k, t)| Op::Retry(k, t)),
        finish => any::<usize>().prop_map(Op::Finish),
        finish => (any::<usize>(), any::<bool>(), any::<bool>())
            .prop_map(|(index, twice, finish)| Op::Succeed { index, twice, finish }),
        active => (0u64..=40, 0u64..=8).prop_map(|(r, q)| Op::SetActive(r, q)),
        snapshot => Just(Op::Snapshot),
    ];
    prop::collection::vec(op, 0..max_len)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9
}

/// Runs `ops` through `real` and `model` from the clock's zero; the first disagreement is the
/// error. `slice_ns` places `ToBoundary` steps. Balances are compared after every step when
/// `every_step`, otherwise only at `Snapshot` steps and at the end (so a policy is not only ever
/// seen right after a query). `percent`, when given, is what the snapshot must report.
fn run(
    real: &dyn RetryBudget,
    model: &mut dyn Model,
    ops: &[Op],
    slice_ns: u64,
    every_step: bool,
    percent: Option<f64>,
) -> Result<(), String> {
    run_from(0, real, model, ops, slice_ns, every_step, percent)
}

/// [`run`], with the first event at `start` ns instead of the clock's zero.
fn run_from(
    start: u64,
    real: &dyn RetryBudget,
    model: &mut dyn Model,
    ops: &[Op],
    slice_ns: u64,
    every_step: bool,
    percent: Option<f64>,
) -> Result<(), String> {
    let mut now = start;
    let mut live: Vec<(RetryPermit, RefPermit)> = Vec::new();
    let check = |step: usize, now: u64, model: &dyn Model| -> Result<(), String> {
        let snap = real.snapshot(Timestamp::from_nanos(now));
        let want = model.balance(now);
        if !close(snap.balance, want) {
            return Err(format!(
                "step {step} at {now} ns: snapshot balance {} but the reference holds {want}",
                snap.balance
            ));
        }
        if !(0.0..=1.0).contains(&snap.utilization) {
            return Err(format!("step {step}: utilization {} is outside 0..=1", snap.utilization));
        }
        if snap.utilization == 1.0 && model.allows_any(now) {
            return Err(format!(
                "step {step}: utilization is 1.0 (no retry allowed) but the reference allows one \
                 (balance {want})"
            ));
        }
        if let Some(p) = percent
            && snap.percent.is_none_or(|got| !close(got, p))
        {
            return Err(format!(
                "step {step}: snapshot percent {:?}, configured {p}",
                snap.percent
            ));
        }
        Ok(())
    };
    for (step, op) in ops.iter().enumerate() {
        match *op {
            Op::Advance(gap) => now += gap,
            Op::ToBoundary { slices, offset } => {
                let boundary = (now / slice_ns + slices) * slice_ns;
                now = now.max(boundary.saturating_add_signed(i64::from(offset)));
            }
            Op::Request => {
                real.record_request(Timestamp::from_nanos(now));
                model.request(now);
            }
            Op::Outcome(outcome) => {
                real.record_outcome(Timestamp::from_nanos(now), outcome);
                model.outcome(now, outcome);
            }
            Op::Retry(kind, then) => {
                let got = real.try_retry(Timestamp::from_nanos(now), kind);
                let want = model.try_retry(now, kind);
                match (got, want) {
                    (Ok(mut permit), Some(mut reference)) => match then {
                        Then::Keep => live.push((permit, reference)),
                        Then::Drop => {
                            drop(permit);
                            model.finished(reference);
                        }
                        Then::SucceedDrop => {
                            permit.succeeded();
                            model.succeeded(&mut reference);
                            drop(permit);
                            model.finished(reference);
                        }
                    },
                    (Err(_), None) => {}
                    (got, want) => {
                        return Err(format!(
                            "step {step} at {now} ns: try_retry({kind:?}) {} but the reference {} \
                             (reference balance before: {})",
                            if got.is_ok() { "granted" } else { "denied" },
                            if want.is_some() { "grants" } else { "denies" },
                            // The model has already withdrawn when it granted.
                            model.balance(now) + if want.is_some() { 1.0 } else { 0.0 },
                        ));
                    }
                }
            }
            Op::Finish(index) => {
                if !live.is_empty() {
                    let (permit, reference) = live.remove(index % live.len());
                    drop(permit);
                    model.finished(reference);
                }
            }
            Op::Succeed { index, twice, finish } => {
                if !live.is_empty() {
                    let i = index % live.len();
                    let (permit, reference) = &mut live[i];
                    for _ in 0..if twice { 2 } else { 1 } {
                        permit.succeeded();
                        model.succeeded(reference);
                    }
                    if finish {
                        let (permit, reference) = live.remove(i);
                        drop(permit);
                        model.finished(reference);
                    }
                }
            }
            Op::SetActive(requests, retries) => {
                real.set_active(requests, retries);
                model.set_active(requests, retries);
            }
            Op::Snapshot => {}
        }
        if every_step || matches!(op, Op::Snapshot) {
            check(step, now, model)?;
        }
    }
    // Every permit ends; the balances must still agree afterwards.
    while let Some((permit, reference)) = live.pop() {
        drop(permit);
        model.finished(reference);
    }
    check(ops.len(), now, model)
}

// ---------------------------------------------------------------------------------------------
// Property tests: the real policies agree with the models at every step
// ---------------------------------------------------------------------------------------------

fn ratio_params() -> impl Strategy<Value = RatioParams> {
    let percent = prop_oneof![
        1 => Just(0u64),
        3 => (0u64..=60).prop_map(|k| k * 50_000), // 0 to 3 in steps of 0.05
        3 => 0u64..=3 * MILLION,                   // any 6-decimal value
    ];
    let min_per_sec = prop_oneof![
        3 => Just(0u64),
        2 => 0u64..=500_000,
        1 => (0u64..=20).prop_map(|k| k * MILLION),
        1 => 0u64..=20 * MILLION,
    ];
    let ttl_ms = prop_oneof![(1u64..=60).prop_map(|s| s * 1000), 1_000u64..=60_000,];
    (percent, min_per_sec, ttl_ms, any::<bool>(), any::<bool>()).prop_map(
        |(percent_m, min_per_sec_m, ttl_ms, deposit_on_success, via_spec)| RatioParams {
            percent_m,
            min_per_sec_m,
            ttl_ms,
            deposit_on_success,
            via_spec,
        },
    )
}

fn concurrency_params() -> impl Strategy<Value = ConcurrencyParams> {
    let percent = prop_oneof![(0u64..=20).prop_map(|k| k * 50_000), 0u64..=MILLION,];
    let slots = prop_oneof![3 => Just(None), 1 => (0u64..=6).prop_map(Some)];
    (percent, 0u64..=5, slots, any::<bool>()).prop_map(|(percent_m, min, slots, via_spec)| {
        ConcurrencyParams { percent_m, min, slots, via_spec }
    })
}

fn token_bucket_params() -> impl Strategy<Value = TokenBucketParams> {
    let max = prop_oneof![
        3 => (1u64..=20).prop_map(|t| t * 1000),
        3 => 1u64..=20_000,
        1 => 1u64..=1_000_000,
    ];
    let ratio = prop_oneof![(1u64..=30).prop_map(|k| k * 100), 1u64..=3000,];
    (max, ratio, any::<bool>()).prop_map(|(max_milli, ratio_milli, via_spec)| TokenBucketParams {
        max_milli,
        ratio_milli,
        via_spec,
    })
}

fn quota_params() -> impl Strategy<Value = QuotaParams> {
    (0u64..=60, 0u64..=12, 0u64..=15, prop::option::of(0u64..=12), 0u64..=3, any::<bool>())
        .prop_map(|(capacity, retry_cost, timeout_cost, throttle_cost, reward, via_spec)| {
            QuotaParams { capacity, retry_cost, timeout_cost, throttle_cost, reward, via_spec }
        })
}

/// 160 cases keep each property under ~2 s in a debug build; `PROPTEST_CASES` searches harder.
fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(160);
    // No regression file: this test is one file; a failure prints its minimal input instead.
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn ratio_matches_reference(
        params in ratio_params(),
        ops in ops([8, 8, 4, 8, 2, 1, 2], 200),
        every_step in any::<bool>(),
    ) {
        let real = params.build();
        let mut model = RatioModel::new(&params);
        let slice_ns = params.ttl_ms * NANOS_PER_MS / 10;
        let percent = Some(params.percent_m as f64 / MILLION as f64);
        let result = run(&*real, &mut model, &ops, slice_ns, every_step, percent);
        prop_assert!(result.is_ok(), "{} disagrees with docs/budgets.md: {}", params.spec(), result.unwrap_err());
    }

    /// The same, with the first event anywhere in the first half of the `Timestamp` range or at
    /// a unix-epoch millisecond (what a recorded trace's `t_ms` may well be). docs/budgets.md aligns the
    /// window to the clock's zero and bounds neither.
    #[test]
    fn ratio_matches_reference_far_from_zero(
        params in ratio_params(),
        start in prop_oneof![
            0u64..=u64::MAX / 2,
            (1_500_000_000_000u64..2_500_000_000_000).prop_map(|ms| ms * NANOS_PER_MS),
        ],
        ops in ops([8, 8, 4, 8, 2, 1, 2], 200),
        every_step in any::<bool>(),
    ) {
        let real = params.build();
        let mut model = RatioModel::new(&params);
        let slice_ns = params.ttl_ms * NANOS_PER_MS / 10;
        let percent = Some(params.percent_m as f64 / MILLION as f64);
        let result = run_from(start, &*real, &mut model, &ops, slice_ns, every_step, percent);
        prop_assert!(
            result.is_ok(),
            "far from zero: {} starting at {start} ns (slice {} of \
             the clock) disagrees with docs/budgets.md: {}",
            params.spec(),
            start / slice_ns,
            result.unwrap_err()
        );
    }

    #[test]
    fn concurrency_matches_reference(
        params in concurrency_params(),
        ops in ops([1, 1, 1, 8, 5, 3, 2], 120),
        every_step in any::<bool>(),
    ) {
        let real = params.build();
        let mut model = ConcurrencyModel::new(&params);
        let percent = params.slots.is_none().then_some(params.percent_m as f64 / MILLION as f64);
        let result = run(&*real, &mut model, &ops, 1, every_step, percent);
        prop_assert!(result.is_ok(), "{} disagrees with docs/budgets.md: {}", params.spec(), result.unwrap_err());
    }

    #[test]
    fn token_bucket_matches_reference(
        params in token_bucket_params(),
        ops in ops([1, 1, 10, 5, 2, 1, 2], 150),
        every_step in any::<bool>(),
    ) {
        let real = params.build();
        let mut model = TokenBucketModel::new(&params);
        let result = run(&*real, &mut model, &ops, 1, every_step, None);
        prop_assert!(result.is_ok(), "{} disagrees with docs/budgets.md: {}", params.spec(), result.unwrap_err());
    }

    #[test]
    fn quota_matches_reference(
        params in quota_params(),
        ops in ops([1, 1, 6, 8, 4, 1, 2], 150),
        every_step in any::<bool>(),
    ) {
        let real = params.build();
        let mut model = QuotaModel::new(&params);
        let result = run(&*real, &mut model, &ops, 1, every_step, None);
        prop_assert!(result.is_ok(), "{} disagrees with docs/budgets.md: {}", params.spec(), result.unwrap_err());
    }
}

// ---------------------------------------------------------------------------------------------
// Fixed cases from the text of docs/budgets.md
// ---------------------------------------------------------------------------------------------

#[test]
fn ratio_grants_exactly_floor_n_times_percent_without_reserve() {
    // tower#857 truncates 1/percent; docs/budgets.md requires exactly floor(n × percent).
    for (percent, n) in [("0.3", 10u64), ("0.333333", 999), ("0.07", 100), ("2.5", 3)] {
        let budget = from_spec(&format!("ratio:percent={percent},min_per_sec=0,ttl=10s"));
        let t = Timestamp::from_millis(500);
        for _ in 0..n {
            budget.record_request(t);
        }
        let m: u64 = percent.parse::<Fraction>().unwrap().millionths();
        let want = n * m / MILLION;
        let mut granted = 0;
        let mut permits = Vec::new();
        while let Ok(p) = budget.try_retry(t, FailureKind::Error) {
            permits.push(p);
            granted += 1;
            assert!(granted <= want, "percent {percent} over {n}: more than {want}");
        }
        assert_eq!(granted, want, "percent {percent} over {n} deposits");
    }
}

#[test]
fn ratio_entry_counts_for_the_current_slice_and_the_nine_before() {
    // ttl 10 s: slices of 1 s. A deposit at 0.999 s (slice 0) counts until 9.999… s and is gone
    // at 10 s, when slice 10 is current: it counted for 9.001 s, within 0.9–1.0 × ttl.
    let budget = from_spec("ratio:percent=1,min_per_sec=0,ttl=10s");
    budget.record_request(Timestamp::from_millis(999));
    let just_before = Timestamp::from_nanos(10_000_000_000 - 1);
    assert_eq!(budget.snapshot(just_before).balance, 1.0);
    assert_eq!(budget.snapshot(Timestamp::from_millis(10_000)).balance, 0.0);
}

#[test]
fn ratio_withdrawals_age_out_and_balance_goes_negative() {
    // Deposits in slice 0, withdrawals in slice 5: between 10 s and 15 s the deposits are gone
    // but the withdrawals still count, so the balance is negative; at 15 s all is gone.
    let budget = from_spec("ratio:percent=1,min_per_sec=0,ttl=10s");
    for _ in 0..3 {
        budget.record_request(Timestamp::ZERO);
    }
    let mut permits = Vec::new();
    for _ in 0..3 {
        permits.push(
            budget
                .try_retry(Timestamp::from_millis(5_000), FailureKind::Error)
                .expect("three deposits"),
        );
    }
    assert_eq!(budget.snapshot(Timestamp::from_millis(10_000)).balance, -3.0);
    assert_eq!(budget.snapshot(Timestamp::from_millis(15_000)).balance, 0.0);
}

#[test]
fn ratio_holds_far_from_the_clock_zero() {
    // 2025-06-15 in unix-epoch milliseconds, e.g. a recorded trace's `t_ms`. With ttl 5 s the
    // slice index is 3.5e9, past 2^31.
    let t = Timestamp::from_millis(1_750_000_000_000);
    let empty = from_spec("ratio:percent=0,min_per_sec=0,ttl=5s");
    let granted = (0..5).filter(|_| empty.try_retry(t, FailureKind::Error).is_ok()).count();
    assert_eq!(
        granted, 0,
        "far from zero: ratio:percent=0,min_per_sec=0,ttl=5s granted \
         {granted} of 5 retries at t = 1 750 000 000 000 ms; docs/budgets.md: percent 0 with min 0 never \
         allows a retry"
    );
    let one = from_spec("ratio:percent=1,min_per_sec=0,ttl=5s");
    one.record_request(t);
    assert_eq!(
        one.snapshot(t).balance,
        1.0,
        "far from zero: a deposit at t = 1 750 000 000 000 ms \
         (ttl 5 s) is not counted"
    );
    // The same at the first slice index past 2^31 for ttl 1 s (about 6.8 years after zero).
    let t = Timestamp::from_nanos((1u64 << 31) * 100_000_000);
    let empty = from_spec("ratio:percent=0,min_per_sec=0,ttl=1s");
    assert!(
        empty.try_retry(t, FailureKind::Error).is_err(),
        "far from zero: ratio:percent=0,min_per_sec=0,ttl=1s grants \
         a retry at slice 2^31"
    );
}

#[test]
fn zero_percent_and_zero_reserve_never_allow_a_retry() {
    let budget = from_spec("ratio:percent=0,min_per_sec=0,ttl=1s");
    for i in 0..100 {
        budget.record_request(Timestamp::from_millis(i));
        assert!(budget.try_retry(Timestamp::from_millis(i), FailureKind::Error).is_err());
    }
}

// ---------------------------------------------------------------------------------------------
// The harness can fail: mutated models are caught on sequences that tell them apart
// ---------------------------------------------------------------------------------------------

#[test]
fn harness_catches_mutated_models() {
    // Ratio with an 11-slice window: a deposit in slice 0 would still count in slice 10.
    let params = RatioParams {
        percent_m: MILLION,
        min_per_sec_m: 0,
        ttl_ms: 10_000,
        deposit_on_success: false,
        via_spec: true,
    };
    let ratio_ops = [
        Op::Request,
        Op::Advance(10_000 * NANOS_PER_MS),
        Op::Retry(FailureKind::Error, Then::Keep),
    ];
    let mut good = RatioModel::new(&params);
    assert_eq!(run(&*params.build(), &mut good, &ratio_ops, 1_000_000_000, true, None), Ok(()));
    let mut mutant = RatioModel::new(&params);
    mutant.window_slices = 11;
    assert!(run(&*params.build(), &mut mutant, &ratio_ops, 1_000_000_000, true, None).is_err());

    // Concurrency with `≤`: min 1, one retry held, a second one is allowed by the mutant only.
    let params = ConcurrencyParams { percent_m: 0, min: 1, slots: None, via_spec: false };
    let ops =
        [Op::Retry(FailureKind::Error, Then::Keep), Op::Retry(FailureKind::Error, Then::Keep)];
    let mut good = ConcurrencyModel::new(&params);
    assert_eq!(run(&*params.build(), &mut good, &ops, 1, true, None), Ok(()));
    let mut mutant = ConcurrencyModel::new(&params);
    mutant.inclusive = true;
    assert!(run(&*params.build(), &mut mutant, &ops, 1, true, None).is_err());

    // Token bucket with `≥`: max 2, one failure leaves exactly max / 2.
    let params = TokenBucketParams { max_milli: 2000, ratio_milli: 100, via_spec: true };
    let ops = [
        Op::Outcome(Outcome::RetryableFailure(FailureKind::Error)),
        Op::Retry(FailureKind::Error, Then::Drop),
    ];
    let mut good = TokenBucketModel::new(&params);
    assert_eq!(run(&*params.build(), &mut good, &ops, 1, true, None), Ok(()));
    let mut mutant = TokenBucketModel::new(&params);
    mutant.inclusive = true;
    assert!(run(&*params.build(), &mut mutant, &ops, 1, true, None).is_err());

    // Quota without the cap on the reward: a success on a full bucket overfills it.
    let params = QuotaParams {
        capacity: 10,
        retry_cost: 5,
        timeout_cost: 10,
        throttle_cost: None,
        reward: 1,
        via_spec: true,
    };
    let ops = [Op::Outcome(Outcome::Success { retried: false })];
    let mut good = QuotaModel::new(&params);
    assert_eq!(run(&*params.build(), &mut good, &ops, 1, true, None), Ok(()));
    let mut mutant = QuotaModel::new(&params);
    mutant.cap_reward = false;
    assert!(run(&*params.build(), &mut mutant, &ops, 1, true, None).is_err());
}

// ---------------------------------------------------------------------------------------------
// Contention: one shared policy, many threads, never more than the sequential arithmetic allows
// ---------------------------------------------------------------------------------------------

/// Runs `work(thread index)` on `THREADS` threads released together; returns their results.
fn on_threads<T: Send + 'static>(work: impl Fn(usize) -> T + Send + Sync + 'static) -> Vec<T> {
    let work = Arc::new(work);
    let start = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let (work, start) = (Arc::clone(&work), Arc::clone(&start));
            thread::spawn(move || {
                start.wait();
                work(i)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn ratio_never_over_grants_under_contention() {
    // (spec, deposits): reserve + percent × deposits, floored, is the most that may be granted.
    let cases = [
        ("ratio:percent=0.37,min_per_sec=1.5,ttl=4s", 1000u64),
        ("ratio:percent=0.333333,min_per_sec=0,ttl=10s", 999),
        ("ratio:percent=2.5,min_per_sec=0.25,ttl=7s", 101),
        ("ratio:percent=0,min_per_sec=3,ttl=60s", 0),
    ];
    for round in 0..10 {
        for (spec, deposits) in cases {
            let BudgetSpec::Ratio(config) = BudgetSpec::parse(spec).unwrap() else {
                unreachable!()
            };
            let params = RatioParams {
                percent_m: config.percent.millionths(),
                min_per_sec_m: config.min_per_sec.millionths(),
                ttl_ms: config.ttl.as_millis() as u64,
                deposit_on_success: false,
                via_spec: round % 2 == 0,
            };
            let budget: Arc<dyn RetryBudget> = Arc::from(params.build());
            let mut model = RatioModel::new(&params);
            let now = Timestamp::from_millis(12_345);
            for _ in 0..deposits {
                budget.record_request(now);
                model.request(now.as_nanos());
            }
            let allowed = model.whole_balance(now.as_nanos()).max(0) as u64;

            let shared = Arc::clone(&budget);
            let per_thread = on_threads(move |_| {
                let mut granted = 0u64;
                for _ in 0..(allowed as usize / THREADS + 60) {
                    if let Ok(permit) = shared.try_retry(now, FailureKind::Error) {
                        granted += 1;
                        drop(permit);
                    }
                }
                granted
            });
            let granted: u64 = per_thread.iter().sum();
            assert!(
                granted <= allowed,
                "{spec} after {deposits} deposits: {granted} granted under contention, at most \
                 {allowed} allowed"
            );
            let mut rest = 0;
            while budget.try_retry(now, FailureKind::Error).is_ok() {
                rest += 1;
            }
            assert_eq!(
                granted + rest,
                allowed,
                "{spec} after {deposits} deposits: grants lost or invented under contention"
            );
            assert_eq!(budget.snapshot(now).balance, 0.0, "{spec}: all spent");
        }
    }
}

#[test]
fn concurrency_never_over_grants_under_contention() {
    for (spec, requests, retries) in [
        ("concurrency:percent=0.25,min=2", 40u64, 3u64),
        ("concurrency:percent=0.2,min=3", 0, 0),
        ("concurrency:percent=0.5,min=0", 10, 1),
        ("concurrency:slots=4", 100, 0),
    ] {
        let BudgetSpec::Concurrency(config) = BudgetSpec::parse(spec).unwrap() else {
            unreachable!()
        };
        let params = ConcurrencyParams {
            percent_m: config.percent.millionths(),
            min: config.min,
            slots: config.slots,
            via_spec: true,
        };
        // What the model grants when every permit is held.
        let mut model = ConcurrencyModel::new(&params);
        model.set_active(requests, retries);
        let mut held = Vec::new();
        while let Some(p) = model.try_retry(0, FailureKind::Error) {
            held.push(p);
        }
        let allowed = held.len();

        for _ in 0..20 {
            let budget: Arc<dyn RetryBudget> = Arc::from(params.build());
            budget.set_active(requests, retries);
            let now = Timestamp::from_millis(1);

            // Phase 1: every thread grabs what it can and holds it.
            let shared = Arc::clone(&budget);
            let permits: Vec<Vec<RetryPermit>> = on_threads(move |_| {
                (0..allowed + 20)
                    .filter_map(|_| shared.try_retry(now, FailureKind::Error).ok())
                    .collect()
            });
            let granted: usize = permits.iter().map(Vec::len).sum();
            assert!(
                granted <= allowed,
                "{spec} with {requests} requests and {retries} retries: {granted} retries held \
                 at once, at most {allowed} allowed"
            );
            assert_eq!(granted, allowed, "{spec}: a held-permits grab lost grants");
            drop(permits);

            // Phase 2: churn; the observed in-flight count never passes the limit.
            let in_flight = Arc::new(AtomicU64::new(0));
            let high_water = Arc::new(AtomicU64::new(0));
            let (shared, flight, high) =
                (Arc::clone(&budget), Arc::clone(&in_flight), Arc::clone(&high_water));
            on_threads(move |i| {
                let mut mine = Vec::new();
                for step in 0..400usize {
                    if let Ok(permit) = shared.try_retry(now, FailureKind::Error) {
                        let n = flight.fetch_add(1, Ordering::SeqCst) + 1;
                        high.fetch_max(n, Ordering::SeqCst);
                        mine.push(permit);
                    }
                    if (step + i) % 3 == 0 && !mine.is_empty() {
                        flight.fetch_sub(1, Ordering::SeqCst);
                        mine.pop();
                    }
                }
                flight.fetch_sub(mine.len() as u64, Ordering::SeqCst);
            });
            let high = high_water.load(Ordering::SeqCst);
            assert!(
                high <= allowed as u64,
                "{spec}: {high} retries in flight at once, at most {allowed} allowed"
            );
            let mut idle = ConcurrencyModel::new(&params);
            idle.set_active(requests, retries);
            assert_eq!(
                budget.snapshot(now).balance,
                idle.balance(0),
                "{spec}: every permit returned"
            );
        }
    }
}

#[test]
fn token_bucket_concurrent_updates_match_sequential_arithmetic() {
    let spec = "token-bucket:max_tokens=1000,token_ratio=0.013";
    for _ in 0..3 {
        let budget: Arc<dyn RetryBudget> = Arc::from(from_spec(spec));
        let now = Timestamp::ZERO;
        let tokens = |b: &Arc<dyn RetryBudget>| b.snapshot(now).balance;

        // Grants cost nothing, from any number of threads.
        let shared = Arc::clone(&budget);
        let granted: usize = on_threads(move |_| {
            (0..200).filter(|_| shared.try_retry(now, FailureKind::Error).is_ok()).count()
        })
        .into_iter()
        .sum();
        assert_eq!(granted, 200 * THREADS, "{spec}: a full bucket denied a retry");
        assert!(close(tokens(&budget), 1000.0), "{spec}: grants cost tokens");

        // Only failures: 800 × 1 token.
        let shared = Arc::clone(&budget);
        on_threads(move |i| {
            for j in 0..100 {
                let outcome = if (i + j) % 2 == 0 {
                    Outcome::RetryableFailure(FailureKind::Timeout)
                } else {
                    Outcome::DontRetryPushback
                };
                shared.record_outcome(now, outcome);
            }
        });
        assert!(
            close(tokens(&budget), 200.0),
            "{spec}: 800 concurrent failures left {} tokens, not 200",
            tokens(&budget)
        );

        // More failures than tokens: the floor is 0, not a wrap.
        let shared = Arc::clone(&budget);
        on_threads(move |_| {
            for _ in 0..100 {
                shared.record_outcome(now, Outcome::RetryableFailure(FailureKind::Error));
            }
        });
        assert!(close(tokens(&budget), 0.0), "{spec}: {} tokens after draining", tokens(&budget));

        // Only successes: 8 × 500 × 0.013 = 52 tokens.
        let shared = Arc::clone(&budget);
        on_threads(move |i| {
            for _ in 0..500 {
                shared.record_outcome(now, Outcome::Success { retried: i % 2 == 0 });
            }
        });
        assert!(
            close(tokens(&budget), 52.0),
            "{spec}: 4000 concurrent successes gave {} tokens, not 52",
            tokens(&budget)
        );

        // Enough successes to pass the cap: exactly max, never above.
        let shared = Arc::clone(&budget);
        on_threads(move |_| {
            for _ in 0..10_000 {
                shared.record_outcome(now, Outcome::Success { retried: false });
            }
        });
        assert!(
            close(tokens(&budget), 1000.0),
            "{spec}: {} tokens after overfilling, not the max 1000",
            tokens(&budget)
        );
    }
}

#[test]
fn quota_never_over_grants_under_contention() {
    for round in 0..20 {
        let spec = "quota:capacity=500,retry_cost=7,timeout_cost=10,success_reward=1";
        let budget: Arc<dyn RetryBudget> = Arc::from(from_spec(spec));
        let now = Timestamp::ZERO;
        let allowed = 500 / 7;

        let shared = Arc::clone(&budget);
        let permits: Vec<Vec<RetryPermit>> = on_threads(move |_| {
            (0..30).filter_map(|_| shared.try_retry(now, FailureKind::Error).ok()).collect()
        });
        let granted: usize = permits.iter().map(Vec::len).sum();
        assert!(
            granted <= allowed,
            "{spec}: {granted} retries granted under contention, floor(500 / 7) = {allowed} allowed"
        );
        assert_eq!(granted, allowed, "{spec}: grants lost under contention");
        assert_eq!(budget.snapshot(now).balance, (500 - 7 * allowed) as f64);

        // Every permit succeeds twice from its own thread: each refunds once, capped at 500.
        let succeed = |mut permits: Vec<RetryPermit>| {
            for p in &mut permits {
                p.succeeded();
                p.succeeded();
            }
        };
        if round % 2 == 0 {
            let handles: Vec<_> =
                permits.into_iter().map(|batch| thread::spawn(move || succeed(batch))).collect();
            for h in handles {
                h.join().unwrap();
            }
            assert_eq!(budget.snapshot(now).balance, 500.0, "{spec}: refunds");
        } else {
            // Rewards race the refunds; the cap holds either way.
            let shared = Arc::clone(&budget);
            let handles: Vec<_> = permits
                .into_iter()
                .map(|batch| thread::spawn(move || succeed(batch)))
                .chain((0..4).map(|_| {
                    let shared = Arc::clone(&shared);
                    thread::spawn(move || {
                        for _ in 0..200 {
                            shared.record_outcome(now, Outcome::Success { retried: false });
                        }
                    })
                }))
                .collect();
            for h in handles {
                h.join().unwrap();
            }
            assert_eq!(
                budget.snapshot(now).balance,
                500.0,
                "{spec}: the bucket went past its capacity or lost tokens"
            );
        }
    }
}
