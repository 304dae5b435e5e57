//! The arithmetic of a cap and a budget: what the dependency sees at a given error rate.
//!
//! A service that plans `primary` calls in flight under a cap of `cap` has `cap − primary` slots
//! of headroom. Retrying every failure once adds `primary × e` at error rate `e`; retrying until
//! success adds `primary × e / (1 − e)`. A budget that keeps the sum under the cap allows
//! `(cap − primary) / primary` retries per original request (the ratio form, a share of
//! primaries), which is `(cap − primary) / cap` of everything in flight (Envoy's concurrency
//! form). This module is that arithmetic; `stormguard plan` prints it.
//!
//! ```
//! use stormguard_core::plan::{PlanInput, Verdict};
//!
//! let plan = PlanInput::new(20, 16).error_rates([0.05, 0.2, 0.4]).plan()?;
//! assert_eq!(plan.retry_slots, 4);
//! assert_eq!(plan.max_retry_fraction, 0.25);
//! assert_eq!(plan.concurrency_percent, 0.2);
//! assert_eq!(plan.rows[2].in_flight_retry_once, 22.4);
//! assert_eq!(plan.rows[2].in_flight_budgeted, 20.0);
//! assert_eq!(plan.rows[2].verdict, Verdict::OverCap);
//! # Ok::<(), stormguard_core::plan::PlanError>(())
//! ```

use crate::budget::{BudgetSpec, ConcurrencyConfig, RatioConfig};
use crate::decimal::Fraction;
use crate::defaults;

/// Why a plan cannot be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// The cap is zero.
    #[error("the cap must be at least 1")]
    ZeroCap,
    /// Nothing is planned.
    #[error("the planned primary concurrency must be at least 1")]
    ZeroPrimary,
    /// More primaries are planned than the cap allows.
    #[error(
        "the planned primary concurrency ({primary}) is above the cap ({cap}): there is no \
         headroom for retries, and primaries alone would queue; raise --cap or lower --primary"
    )]
    PrimaryOverCap {
        /// The cap.
        cap: u64,
        /// The planned primaries.
        primary: u64,
    },
    /// An error rate is outside `[0, 1]`.
    #[error("error rate {0} is outside [0, 1]")]
    ErrorRate(f64),
    /// The fan-out quantile is outside `(0, 1]`.
    #[error("quantile {0} is outside (0, 1]")]
    Quantile(f64),
    /// Fan-out of zero calls.
    #[error("fan-out must be at least 1 call")]
    ZeroFanOut,
    /// The pool sizing is impossible.
    #[error("{0}")]
    Pool(String),
}

/// What to plan.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanInput {
    /// The dependency's concurrency cap (attempts in flight).
    pub cap: u64,
    /// Planned primary (first-try) calls in flight.
    pub primary: u64,
    /// Error rates to tabulate, each in `[0, 1]`.
    pub error_rates: Vec<f64>,
    /// The budget's floor in concurrent retries. Default 3 ([`defaults::CONCURRENCY_MIN`]). It
    /// never overrides the cap: the SPECs hold it to the headroom `cap − primary`.
    pub floor: u64,
    /// Parallel calls per user action and the per-call quantile that counts as fast.
    pub fan_out: Option<(u32, f64)>,
    /// Fleet pool sizing: the server's limit, the connections it keeps in reserve, and the peak
    /// number of instances.
    pub pool: Option<(u64, u64, u64)>,
}

impl PlanInput {
    /// The error rates tabulated when none are given: the worked example's.
    pub const DEFAULT_ERROR_RATES: [f64; 3] = [0.05, 0.2, 0.4];

    /// A plan for `primary` calls under `cap`, with the default error rates and floor.
    pub fn new(cap: u64, primary: u64) -> PlanInput {
        PlanInput {
            cap,
            primary,
            error_rates: Self::DEFAULT_ERROR_RATES.to_vec(),
            floor: defaults::CONCURRENCY_MIN,
            fan_out: None,
            pool: None,
        }
    }

    /// Replaces the error rates.
    pub fn error_rates(mut self, rates: impl IntoIterator<Item = f64>) -> PlanInput {
        self.error_rates = rates.into_iter().collect();
        self
    }

    /// Checks the input and computes the plan.
    pub fn plan(&self) -> Result<Plan, PlanError> {
        let (cap, primary) = (self.cap, self.primary);
        if cap == 0 {
            return Err(PlanError::ZeroCap);
        }
        if primary == 0 {
            return Err(PlanError::ZeroPrimary);
        }
        if primary > cap {
            return Err(PlanError::PrimaryOverCap { cap, primary });
        }
        let retry_slots = cap - primary;
        let (capf, pf) = (cap as f64, primary as f64);
        let rows = self
            .error_rates
            .iter()
            .map(|&e| {
                if !(0.0..=1.0).contains(&e) {
                    return Err(PlanError::ErrorRate(e));
                }
                let retry_once = pf * (1.0 + e);
                let unbounded = (e < 1.0).then(|| pf / (1.0 - e));
                let wanted = pf * e;
                let allowed = (retry_slots.max(self.floor) as f64).min((cap - primary) as f64);
                let budgeted = pf + wanted.min(allowed);
                Ok(PlanRow {
                    error_rate: e,
                    in_flight_retry_once: round(retry_once),
                    in_flight_unbounded: unbounded.map(round),
                    in_flight_budgeted: round(budgeted),
                    // + 0.0 turns a rounded -0 into 0.
                    retries_shed: round((wanted - allowed).max(0.0)) + 0.0,
                    verdict: if retry_once > capf {
                        Verdict::OverCap
                    } else if retry_once > capf - 1.0 {
                        Verdict::AtEdge
                    } else {
                        Verdict::Fits
                    },
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let fan_out = match self.fan_out {
            None => None,
            Some((0, _)) => return Err(PlanError::ZeroFanOut),
            Some((_, q)) if !(q > 0.0 && q <= 1.0) => return Err(PlanError::Quantile(q)),
            Some((calls, quantile)) => {
                Some(FanOut { calls, quantile, p_all_fast: round(quantile.powi(calls as i32)) })
            }
        };
        let pool = match self.pool {
            None => None,
            Some((server_limit, reserve, instances)) => Some(Pool {
                server_limit,
                reserve,
                instances,
                per_instance: per_instance(server_limit, reserve, instances)?,
                demanded: cap.saturating_mul(instances),
            }),
        };
        Ok(Plan {
            cap,
            primary,
            retry_slots,
            max_retry_fraction: round(retry_slots as f64 / pf),
            concurrency_percent: round(retry_slots as f64 / capf),
            floor: self.floor,
            separate_pools_in_flight: cap + retry_slots,
            rows,
            fan_out,
            pool,
        })
    }
}

/// Rounds to 9 decimal places, so `16 × 1.05` reads 16.8 rather than 16.800000000000001.
fn round(x: f64) -> f64 {
    (x * 1e9).round() / 1e9
}

/// Whether retrying each failure once fits under the cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum Verdict {
    /// At least one slot of headroom is left.
    Fits,
    /// Within one slot of the cap: no headroom left.
    AtEdge,
    /// Over the cap: queueing, timeouts, more retries.
    OverCap,
}

impl Verdict {
    /// `fits`, `at-edge` or `over-cap`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Fits => "fits",
            Verdict::AtEdge => "at-edge",
            Verdict::OverCap => "over-cap",
        }
    }
}

/// One error rate's row.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PlanRow {
    /// The error rate `e`.
    pub error_rate: f64,
    /// `primary × (1 + e)`: each failure retried once, at once.
    pub in_flight_retry_once: f64,
    /// `primary / (1 − e)`: retried until success; `None` at `e = 1` (unbounded).
    pub in_flight_unbounded: Option<f64>,
    /// `primary + min(primary × e, max(retry_slots, floor), cap − primary)`.
    pub in_flight_budgeted: f64,
    /// Retries the budget refuses per round, surfaced as errors.
    pub retries_shed: f64,
    /// From `in_flight_retry_once`: over the cap, within one of it, or fits.
    pub verdict: Verdict,
}

/// The fan-out tail.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct FanOut {
    /// Parallel calls per user action.
    pub calls: u32,
    /// Each call is fast with this probability.
    pub quantile: f64,
    /// `quantile ^ calls`: all calls fast.
    pub p_all_fast: f64,
}

/// The cap each instance of a fleet gets of a server's limit — the mission's pool sizing: the
/// server's limit less what it keeps for admin, migrations and monitoring, divided by the peak
/// (autoscaled) instance count, `floor((server_limit − reserve) / instances)`. A database's
/// `max_connections` is the usual limit, and the result the pool size of each instance.
pub fn per_instance(server_limit: u64, reserve: u64, instances: u64) -> Result<u64, PlanError> {
    if instances == 0 {
        return Err(PlanError::Pool("instances must be at least 1".into()));
    }
    if reserve >= server_limit {
        return Err(PlanError::Pool(format!(
            "the reserve ({reserve}) leaves nothing of the server limit ({server_limit})"
        )));
    }
    Ok((server_limit - reserve) / instances)
}

/// Fleet pool sizing.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Pool {
    /// The server's connection or concurrency limit.
    pub server_limit: u64,
    /// What the server keeps for others (admin, other clients).
    pub reserve: u64,
    /// Peak instance count.
    pub instances: u64,
    /// `floor((server_limit − reserve) / instances)`: the cap to give each instance.
    pub per_instance: u64,
    /// `cap × instances`: what the fleet would demand at the planned cap.
    pub demanded: u64,
}

/// The computed plan.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Plan {
    /// The cap.
    pub cap: u64,
    /// Planned primaries.
    pub primary: u64,
    /// `cap − primary`: concurrent retries that fit.
    pub retry_slots: u64,
    /// `(cap − primary) / primary`: the ratio budget's percent, a share of primaries.
    pub max_retry_fraction: f64,
    /// `(cap − primary) / cap`: the concurrency budget's percent, a share of all in flight.
    pub concurrency_percent: f64,
    /// The floor in concurrent retries (never overrides the cap).
    pub floor: u64,
    /// What the dependency sees if primaries get a pool of `cap` and retries a separate pool of
    /// `retry_slots`: the two add.
    pub separate_pools_in_flight: u64,
    /// One row per error rate.
    pub rows: Vec<PlanRow>,
    /// The fan-out tail, when asked.
    pub fan_out: Option<FanOut>,
    /// Fleet pool sizing, when asked.
    pub pool: Option<Pool>,
}

impl Plan {
    /// `retry_slots / primary` rounded down to millionths (never more generous than the cap).
    pub fn ratio_fraction(&self) -> Fraction {
        Fraction::from_millionths(self.retry_slots * Fraction::ONE_MILLIONTHS / self.primary)
    }

    /// `retry_slots / cap` rounded down to millionths.
    pub fn concurrency_fraction(&self) -> Fraction {
        Fraction::from_millionths(self.retry_slots * Fraction::ONE_MILLIONTHS / self.cap)
    }

    /// Whether the headroom allows more than [`defaults::MAX_SUGGESTED_PERCENT`] in either form,
    /// so the SPECs suggest that instead (a budget past it is a `budget-too-high` finding of
    /// `stormguard audit`: the cap would hold, but a failing dependency would see more than half
    /// again its load in retries).
    pub fn percent_held(&self) -> bool {
        self.ratio_fraction() > defaults::MAX_SUGGESTED_PERCENT
            || self.concurrency_fraction() > defaults::MAX_SUGGESTED_PERCENT
    }

    /// The floor the SPECs use: the floor, at most the headroom `cap − primary` (a floor above
    /// it would let retries push primaries past the cap; `stormguard audit` flags it).
    pub fn spec_floor(&self) -> u64 {
        self.floor.min(self.retry_slots)
    }

    /// The ratio-form budget that keeps primaries plus retries under the cap (its percent at
    /// most [`defaults::MAX_SUGGESTED_PERCENT`]), with the floor as its reserve rate.
    pub fn ratio_spec(&self) -> BudgetSpec {
        BudgetSpec::Ratio(RatioConfig {
            percent: self.ratio_fraction().min(defaults::MAX_SUGGESTED_PERCENT),
            min_per_sec: Fraction::from_millionths(
                self.floor.saturating_mul(Fraction::ONE_MILLIONTHS),
            ),
            ..RatioConfig::default()
        })
    }

    /// Envoy's form of the same headroom (its percent at most
    /// [`defaults::MAX_SUGGESTED_PERCENT`]), with the floor as its minimum concurrency, held to
    /// the headroom ([`Plan::spec_floor`]).
    pub fn concurrency_spec(&self) -> BudgetSpec {
        BudgetSpec::Concurrency(ConcurrencyConfig {
            percent: self.concurrency_fraction().min(defaults::MAX_SUGGESTED_PERCENT),
            min: self.spec_floor(),
            slots: None,
        })
    }

    /// The fixed form: exactly `retry_slots` concurrent retries.
    pub fn slots_spec(&self) -> BudgetSpec {
        BudgetSpec::Concurrency(ConcurrencyConfig {
            slots: Some(self.retry_slots),
            ..Default::default()
        })
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;

    #[test]
    fn worked_example() {
        let p = PlanInput::new(20, 16).plan().unwrap();
        let r: Vec<_> = p
            .rows
            .iter()
            .map(|r| (r.in_flight_retry_once, r.in_flight_unbounded, r.in_flight_budgeted))
            .collect();
        assert_eq!(r[0], (16.8, Some(16.842105263), 16.8));
        assert_eq!(r[1], (19.2, Some(20.0), 19.2));
        assert_eq!(r[2], (22.4, Some(26.666666667), 20.0));
        assert_eq!(p.rows[2].retries_shed, 2.4);
        assert_eq!(
            p.rows.iter().map(|r| r.verdict).collect::<Vec<_>>(),
            [Verdict::Fits, Verdict::AtEdge, Verdict::OverCap]
        );
        assert_eq!(p.separate_pools_in_flight, 24);
        assert_eq!(p.ratio_spec().to_string(), "ratio:percent=0.25,min_per_sec=3,ttl=10s");
        assert_eq!(p.concurrency_spec().to_string(), "concurrency:percent=0.2,min=3");
    }

    #[test]
    fn floor_never_overrides_the_cap() {
        let mut input = PlanInput::new(20, 19).error_rates([0.5]);
        input.floor = 5;
        let p = input.plan().unwrap();
        assert_eq!(p.rows[0].in_flight_budgeted, 20.0);
        assert_eq!(p.rows[0].retries_shed, 8.5);
    }

    #[test]
    fn specs_fit_the_headroom() {
        // Headroom of 1: the floor of 3 would let 3 retries beside 19 primaries.
        let p = PlanInput::new(20, 19).plan().unwrap();
        assert_eq!(p.spec_floor(), 1);
        assert_eq!(p.concurrency_spec().to_string(), "concurrency:percent=0.05,min=1");
        assert!(!p.percent_held());
        // No headroom: no concurrent retries at all.
        let p = PlanInput::new(20, 20).plan().unwrap();
        assert_eq!(p.concurrency_spec().to_string(), "concurrency:percent=0,min=0");
        assert_eq!(p.slots_spec().to_string(), "concurrency:slots=0");
        // Ample headroom: 300 % of primaries fits the cap, 50 % is suggested.
        let p = PlanInput::new(40, 10).plan().unwrap();
        assert_eq!(p.max_retry_fraction, 3.0);
        assert!(p.percent_held());
        assert_eq!(p.ratio_spec().to_string(), "ratio:percent=0.5,min_per_sec=3,ttl=10s");
        assert_eq!(p.concurrency_spec().to_string(), "concurrency:percent=0.5,min=3");
    }

    #[test]
    fn total_failure_is_unbounded() {
        let p = PlanInput::new(20, 16).error_rates([1.0]).plan().unwrap();
        assert_eq!(p.rows[0].in_flight_unbounded, None);
    }

    #[test]
    fn fan_out_and_pool() {
        let mut input = PlanInput::new(20, 16);
        input.fan_out = Some((5, 0.99));
        input.pool = Some((400, 10, 20));
        let p = input.plan().unwrap();
        assert_eq!(p.fan_out.unwrap().p_all_fast, 0.950990050);
        let pool = p.pool.unwrap();
        assert_eq!((pool.per_instance, pool.demanded), (19, 400));
    }

    #[test]
    fn refusals() {
        assert!(matches!(PlanInput::new(20, 21).plan(), Err(PlanError::PrimaryOverCap { .. })));
        assert!(matches!(PlanInput::new(0, 0).plan(), Err(PlanError::ZeroCap)));
        assert!(matches!(
            PlanInput::new(20, 16).error_rates([1.5]).plan(),
            Err(PlanError::ErrorRate(_))
        ));
        let mut input = PlanInput::new(20, 16);
        input.pool = Some((10, 10, 2));
        assert!(matches!(input.plan(), Err(PlanError::Pool(_))));
    }
}
