//! Scopes: retries budgeted per user action or per route, on top of the dependency's budget.
//!
//! A user action that fans out to five calls, each allowed one retry, can send ten attempts
//! when the dependency struggles; a tail that fans out multiplies. A [`FanOutScope`] holds a few
//! whole retries (`scope_retries`, default 1) shared by every call the action makes: budget the
//! fan-out, not each hop. A route can have its own retry budget the same way ([`Scope::Route`]),
//! so a checkout path can be kept tighter than an analytics path. A scope is charged after the
//! dependency's other checks and before its budget, and refunded if the cap then refuses the
//! retry.
//!
//! ```
//! use stormguard_core::scope::FanOutScope;
//!
//! let action = FanOutScope::new(1); // one retry for the whole fan-out
//! let first = action.try_charge().expect("the first failing call may retry");
//! assert!(action.try_charge().is_none(), "the second may not");
//! first.refund(); // the retry was never sent
//! assert_eq!(action.remaining(), 1);
//! ```

use std::fmt;
use std::sync::Arc;

use crate::budget::{FailureKind, RetryBudget, RetryPermit};
use crate::clock::Timestamp;
use crate::denied::Denied;
use crate::sync::{AtomicU64, Ordering};
use crate::tree::{TreeCharge, TreeLedger};

/// Whole retries shared by every call of one user action. Clones share the count; put one in
/// each call's request extensions (not a task-local, which spawned child tasks lose).
#[derive(Debug, Clone)]
pub struct FanOutScope {
    left: std::sync::Arc<AtomicU64>,
}

impl FanOutScope {
    /// A scope that allows `retries` retries in all (default in configs: 1).
    pub fn new(retries: u64) -> FanOutScope {
        FanOutScope { left: std::sync::Arc::new(AtomicU64::new(retries)) }
    }

    /// Retries left.
    pub fn remaining(&self) -> u64 {
        self.left.load(Ordering::Acquire)
    }

    /// Takes one retry, if any is left.
    pub fn try_charge(&self) -> Option<FanOutCharge> {
        // AcqRel on the read-modify-write: only one caller can take the last retry.
        self.left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .ok()
            .map(|_| FanOutCharge { scope: self.clone() })
    }
}

/// One retry taken from a [`FanOutScope`]. Dropping it keeps the charge (the retry was sent);
/// [`refund`](Self::refund) gives it back.
#[derive(Debug)]
#[must_use = "dropping the charge keeps it spent"]
pub struct FanOutCharge {
    scope: FanOutScope,
}

impl FanOutCharge {
    /// The retry was never sent: give it back.
    pub fn refund(self) {
        self.scope.left.fetch_add(1, Ordering::AcqRel);
    }
}

/// A scope a retry is charged to, besides the dependency's budget.
#[derive(Clone)]
pub enum Scope {
    /// A user action's fan-out.
    FanOut(FanOutScope),
    /// A route's own retry budget.
    Route(Arc<dyn RetryBudget>),
    /// The call tree's allowance, as the dependency's ledger keeps it ([`crate::tree`]).
    Tree(TreeLedger),
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scope::FanOut(s) => f.debug_tuple("FanOut").field(&s.remaining()).finish(),
            Scope::Route(b) => f.debug_tuple("Route").field(b).finish(),
            Scope::Tree(_) => f.write_str("Tree"),
        }
    }
}

impl Scope {
    /// Charges one retry after a failure of `kind`, or `None` when the scope is spent.
    pub fn try_charge(&self, now: Timestamp, kind: FailureKind) -> Option<ScopeCharge> {
        match self {
            Scope::FanOut(s) => s.try_charge().map(ScopeCharge::FanOut),
            Scope::Route(b) => {
                b.try_retry(now, kind).ok().map(|p| ScopeCharge::Route(b.clone(), p))
            }
            Scope::Tree(t) => t.try_charge(now).map(ScopeCharge::Tree),
        }
    }

    /// Whether this is the call tree's allowance.
    pub fn is_tree(&self) -> bool {
        matches!(self, Scope::Tree(_))
    }

    /// The reason a retry this scope refused is given: [`Denied::Tree`] for the call tree's
    /// allowance, [`Denied::Scope`] for a fan-out or a route.
    pub fn denied(&self) -> Denied {
        match self {
            Scope::Tree(_) => Denied::Tree,
            Scope::FanOut(_) | Scope::Route(_) => Denied::Scope,
        }
    }
}

/// A charge on a [`Scope`]; hold it while the retry is pending or in flight.
#[must_use = "dropping the charge keeps it spent"]
pub enum ScopeCharge {
    /// One retry of a fan-out.
    FanOut(FanOutCharge),
    /// A route budget's permit.
    Route(Arc<dyn RetryBudget>, RetryPermit),
    /// One extra attempt of the call tree's allowance.
    Tree(TreeCharge),
}

impl fmt::Debug for ScopeCharge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScopeCharge::FanOut(c) => c.fmt(f),
            ScopeCharge::Route(_, p) => f.debug_tuple("Route").field(p).finish(),
            ScopeCharge::Tree(c) => c.fmt(f),
        }
    }
}

impl ScopeCharge {
    /// The retry was never sent: undo the charge.
    pub fn refund(self, now: Timestamp) {
        match self {
            ScopeCharge::FanOut(c) => c.refund(),
            ScopeCharge::Route(b, p) => b.refund(now, p),
            ScopeCharge::Tree(c) => c.refund(),
        }
    }

    /// The retry succeeded (a quota route budget refunds its cost).
    pub fn succeeded(&mut self) {
        if let ScopeCharge::Route(_, p) = self {
            p.succeeded();
        }
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;
    use crate::budget::BudgetSpec;

    #[test]
    fn fan_out_is_shared_by_clones() {
        let a = FanOutScope::new(2);
        let b = a.clone();
        let _x = a.try_charge().unwrap();
        let _y = b.try_charge().unwrap();
        assert!(a.try_charge().is_none());
        assert!(b.try_charge().is_none());
    }

    #[test]
    fn route_scope_charges_and_refunds_its_budget() {
        let budget: Arc<dyn RetryBudget> =
            Arc::new(BudgetSpec::parse("ratio:percent=1,min_per_sec=0").unwrap().build().unwrap());
        budget.record_request(Timestamp::ZERO);
        let scope = Scope::Route(budget.clone());
        let c = scope.try_charge(Timestamp::ZERO, FailureKind::Error).unwrap();
        assert!(scope.try_charge(Timestamp::ZERO, FailureKind::Error).is_none());
        c.refund(Timestamp::ZERO);
        assert!(scope.try_charge(Timestamp::ZERO, FailureKind::Error).is_some());
    }

    #[test]
    fn concurrent_charges_never_exceed_the_scope() {
        let scope = FanOutScope::new(3);
        let taken = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (s, t) = (scope.clone(), taken.clone());
                std::thread::spawn(move || {
                    for _ in 0..100 {
                        if let Some(c) = s.try_charge() {
                            t.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            std::mem::forget(c);
                        }
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 3);
    }
}
