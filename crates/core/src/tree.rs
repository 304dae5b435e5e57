//! One budget for the whole call tree: a user action's amplification allowance, carried with
//! its requests from hop to hop, and charged at every hop.
//!
//! Three hops that each allow 20 % retries allow `1.2³ ≈ 1.73` attempts at the last one: a
//! storm at the bottom is retried at every layer that has budget left. A [`TreeContext`] travels
//! with each request (in W3C `baggage`, see `stormguard_http::tree`): the **allowance** `A` —
//! attempts per user action that any one dependency below may see, set where the action enters
//! (`1.2`: one extra attempt per five actions, across every hop) — and **spent**, how many
//! retries and hedges lie on the request's path above (0 for a request every hop above sent as
//! its first try).
//!
//! **The arithmetic.** Each hop keeps a [`TreeLedger`] per dependency, a balance over a sliding
//! window of [`WINDOW`]:
//!
//! - a request that arrives with `spent = 0` (a *tree original*) deposits `A − 1`;
//! - a request that arrives with `spent > 0` is an extra attempt a hop above already made: it
//!   withdraws 1, whatever the balance (it is here; the balance may go below zero);
//! - each retry or hedge this hop sends withdraws 1, and is refused ([`Denied::Tree`]) when
//!   that would take the balance below zero; it carries `spent + 1` to the hops below.
//!
//! At any hop, attempts sent = originals + extras above + extras here `≤ A × originals`: the
//! hop below sees at most `A` attempts per user action that reached it, whatever the number of
//! hops, and every hop's share comes from the same allowance. Within one window a hop can be
//! overdrawn by the extras from above that arrive after it spent (it cannot know of them
//! sooner): by at most those in flight at that moment; the balance below zero then holds its
//! own extras back until the deposits catch up. There is no floor: a floor per hop
//! is what lets the per-hop product grow (the dependency's own budget keeps its floor).
//!
//! [`Denied::Tree`]: crate::Denied::Tree
//!
//! ```
//! use stormguard_core::tree::{TreeContext, TreeLedger};
//! use stormguard_core::Timestamp;
//!
//! let ledger = TreeLedger::default();
//! let ctx: TreeContext = "1.2".parse().unwrap();
//! let now = Timestamp::ZERO;
//! for _ in 0..5 {
//!     ledger.arrived(now, &ctx); // five originals: 5 × 0.2 = one extra attempt
//! }
//! let retry = ledger.try_charge(now).expect("one retry");
//! assert!(ledger.try_charge(now).is_none(), "the tree's allowance is spent");
//! assert_eq!(ctx.below(true).spent, 1, "the retry tells the hops below");
//! # drop(retry);
//! ```

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::budget::window::{self, SLICES, Window};
use crate::clock::Timestamp;
use crate::decimal::{Excess, format_scaled, parse_scaled};

/// How long a deposit or a withdrawal counts in a [`TreeLedger`] (as a ratio budget's `ttl`).
pub const WINDOW: Duration = Duration::from_secs(10);
/// Allowances are kept in thousandths.
const MILLI: u64 = 1000;
/// The largest allowance a context may carry: 10 attempts per user action.
pub const MAX_ALLOWANCE_MILLI: u32 = 10_000;

/// What travels with a request down the call tree. Its text form is the value of the
/// `stormguard-tree` baggage member: `1.2` (the allowance), with the properties `spent=N` (when
/// not 0) and `id=HEX` (the user action, 1–16 hex digits): `1.2;spent=1;id=8f3a09c1d2e4b5a6`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeContext {
    /// Attempts per user action any one dependency may see.
    pub allowance: Allowance,
    /// Retries and hedges on the request's path above this hop.
    pub spent: u32,
    /// The user action, so a hop's answers can be told apart as the action's (the sidecar
    /// marks a failing answer of an action a dependency below refused for load).
    pub id: Option<u64>,
}

impl TreeContext {
    /// A new user action's context, with `allowance` (clamped to 1–10).
    pub fn root(allowance: Allowance, id: u64) -> TreeContext {
        TreeContext { allowance: allowance.clamped(), spent: 0, id: Some(id) }
    }

    /// The context a trusted caller sent, with its allowance no more than `most` (a caller
    /// cannot grant itself more than the listener would).
    pub fn clamped(self, most: Allowance) -> TreeContext {
        TreeContext { allowance: self.allowance.min(most.clamped()), ..self }
    }

    /// The context an attempt this hop sends carries: `extra` (a retry or a hedge) adds one
    /// to what was spent above.
    pub fn below(&self, extra: bool) -> TreeContext {
        TreeContext { spent: self.spent.saturating_add(u32::from(extra)), ..*self }
    }

    /// Whether the request is a tree original (no retry or hedge on its path above).
    pub fn is_original(&self) -> bool {
        self.spent == 0
    }
}

/// An allowance as configured (`tree_allowance = 1.2`): attempts per user action any one
/// dependency may see, 1 to 10 with at most three decimals, kept in thousandths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Allowance(pub u32);

impl Allowance {
    /// Within 1–10 (the field is public: a value made in code may say anything).
    pub fn clamped(self) -> Allowance {
        Allowance(self.0.clamp(MILLI as u32, MAX_ALLOWANCE_MILLI))
    }
}

impl Default for Allowance {
    /// 1.2: one extra attempt per five user actions, across every hop.
    fn default() -> Self {
        Allowance(1200)
    }
}

/// An allowance that does not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not an allowance (attempts per user action: 1 to 10, at most three decimals)")]
pub struct BadAllowance(pub String);

impl FromStr for Allowance {
    type Err = BadAllowance;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let milli = parse_scaled(s, 3, Excess::Refuse)
            .ok()
            .filter(|m| (MILLI..=u64::from(MAX_ALLOWANCE_MILLI)).contains(m))
            .ok_or_else(|| BadAllowance(s.chars().take(40).collect()))?;
        Ok(Allowance(milli as u32))
    }
}

impl fmt::Display for Allowance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_scaled(u64::from(self.0), 3))
    }
}

/// A `stormguard-tree` value that does not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a stormguard-tree context (`ALLOWANCE[;spent=N][;id=HEX]`, allowance 1–10)")]
pub struct BadTreeContext(pub String);

impl FromStr for TreeContext {
    type Err = BadTreeContext;

    /// Reads `1.2;spent=1;id=8f3a`: properties in any order, unknown ones ignored (a later
    /// version may add some); an allowance outside 1–10 or with more than three decimals, a
    /// malformed `spent` or `id`, is refused.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadTreeContext(s.chars().take(80).collect());
        let mut parts = s.split(';').map(str::trim);
        let allowance = parts.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
        let mut ctx = TreeContext { allowance, spent: 0, id: None };
        for p in parts {
            let (k, v) = p.split_once('=').map_or((p, ""), |(k, v)| (k.trim(), v.trim()));
            match k {
                "spent" => ctx.spent = v.parse().map_err(|_| bad())?,
                "id" if (1..=16).contains(&v.len()) => {
                    ctx.id = Some(u64::from_str_radix(v, 16).map_err(|_| bad())?)
                }
                "id" => return Err(bad()),
                _ => {}
            }
        }
        Ok(ctx)
    }
}

impl fmt::Display for TreeContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.allowance.fmt(f)?;
        if self.spent > 0 {
            write!(f, ";spent={}", self.spent)?;
        }
        if let Some(id) = self.id {
            write!(f, ";id={id:016x}")?;
        }
        Ok(())
    }
}

/// What the ledger has counted since it was made (for metrics; every count only grows).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeCounts {
    /// Tree originals that arrived (each deposited its allowance less one).
    pub originals: u64,
    /// Requests that arrived as extra attempts of a hop above (each withdrew one).
    pub extras_above: u64,
    /// Retries and hedges this hop charged to the tree.
    pub charged: u64,
    /// Of those, given back: refused after the charge (the cap, the window), never sent.
    pub refunded: u64,
}

#[derive(Debug)]
struct Inner {
    /// Deposits, in thousandths of an attempt.
    deposits: Window,
    /// Withdrawals, whole.
    withdrawals: Window,
    originals: AtomicU64,
    extras_above: AtomicU64,
    charged: AtomicU64,
    refunded: AtomicU64,
}

/// A dependency's share of the call trees that pass through it: see the [module docs](self).
/// Clones share the balance. Its window is the ratio budget's ([`crate::budget`]): 10 slices
/// of [`WINDOW`]` / 10`, in atomics.
#[derive(Debug, Clone)]
pub struct TreeLedger {
    inner: Arc<Inner>,
}

impl Default for TreeLedger {
    fn default() -> Self {
        TreeLedger {
            inner: Arc::new(Inner {
                deposits: Window::new(),
                withdrawals: Window::new(),
                originals: AtomicU64::new(0),
                extras_above: AtomicU64::new(0),
                charged: AtomicU64::new(0),
                refunded: AtomicU64::new(0),
            }),
        }
    }
}

/// The slot and the slice of `now`: [`WINDOW`] in the window's slices.
fn slice(now: Timestamp) -> (usize, u32) {
    window::slice(now, WINDOW.as_nanos() as u64 / SLICES as u64)
}

impl TreeLedger {
    /// The balance in thousandths (below zero when the hops above spent more than their share).
    fn balance_milli(&self, current: u32) -> i128 {
        i128::from(self.inner.deposits.sum(current))
            - i128::from(self.inner.withdrawals.sum(current)) * i128::from(MILLI)
    }

    /// A request of `ctx` arrived at the dependency (admitted, as the budget's deposit is): a
    /// tree original deposits its allowance less one, an extra from above withdraws one.
    pub fn arrived(&self, now: Timestamp, ctx: &TreeContext) {
        let (idx, tag) = slice(now);
        if ctx.is_original() {
            // A context made in code may say anything: clamped as one read from the wire is.
            let extra = ctx.allowance.clamped().0 - MILLI as u32;
            self.inner.deposits.add(idx, tag, extra);
            self.inner.originals.fetch_add(1, Ordering::Relaxed);
        } else {
            self.inner.withdrawals.add(idx, tag, 1);
            self.inner.extras_above.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// One retry or hedge of this hop, if the tree's allowance has room for it. Withdraws
    /// first and checks the balance with the withdrawal in it (as the ratio budget does): two
    /// racing extras cannot both spend one attempt.
    pub fn try_charge(&self, now: Timestamp) -> Option<TreeCharge> {
        let (idx, tag) = slice(now);
        let written = self.inner.withdrawals.add(idx, tag, 1);
        if self.balance_milli(tag) < 0 {
            self.inner.withdrawals.undo(idx, written);
            return None;
        }
        self.inner.charged.fetch_add(1, Ordering::Relaxed);
        Some(TreeCharge { ledger: self.clone(), idx, tag: written })
    }

    /// The balance now, in attempts (rounded down; negative when overdrawn from above).
    pub fn balance(&self, now: Timestamp) -> i64 {
        let (_, current) = slice(now);
        self.balance_milli(current).div_euclid(i128::from(MILLI)) as i64
    }

    /// What the ledger has counted.
    pub fn counts(&self) -> TreeCounts {
        let i = &self.inner;
        TreeCounts {
            originals: i.originals.load(Ordering::Relaxed),
            extras_above: i.extras_above.load(Ordering::Relaxed),
            charged: i.charged.load(Ordering::Relaxed),
            refunded: i.refunded.load(Ordering::Relaxed),
        }
    }
}

/// One retry or hedge charged to a [`TreeLedger`]. Dropping it keeps the charge;
/// [`refund`](Self::refund) gives it back (the attempt was never sent).
#[derive(Debug)]
#[must_use = "dropping the charge keeps it spent"]
pub struct TreeCharge {
    ledger: TreeLedger,
    idx: usize,
    tag: u32,
}

impl TreeCharge {
    /// The attempt was never sent: the withdrawal goes back (if its slice is still kept).
    pub fn refund(self) {
        self.ledger.inner.withdrawals.undo(self.idx, self.tag);
        self.ledger.inner.refunded.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;

    fn ctx(s: &str) -> TreeContext {
        s.parse().unwrap()
    }

    #[test]
    fn the_text_form_round_trips_and_bad_values_are_refused() {
        let c = ctx("1.2;spent=2;id=00000000000000ff");
        assert_eq!(c, TreeContext { allowance: Allowance(1200), spent: 2, id: Some(255) });
        assert_eq!(c.to_string(), "1.2;spent=2;id=00000000000000ff");
        assert_eq!(ctx("2").to_string(), "2");
        assert_eq!(ctx(" 1.25 ; future=x ; spent = 0").allowance, Allowance(1250));
        for bad in ["", "0.9", "11", "1.2345", "x", "1.2;spent=-1", "1.2;id=xyz", "1.2;id="] {
            assert!(bad.parse::<TreeContext>().is_err(), "{bad}");
        }
        let most = Allowance(1500);
        assert_eq!(ctx("5").clamped(most).allowance, most, "a caller cannot grant more");
        assert_eq!(ctx("1.1").clamped(most).allowance, Allowance(1100));
    }

    /// Three hops, each sending what it may: attempts at the last stay within the allowance.
    #[test]
    fn extras_across_hops_stay_within_the_allowance() {
        let now = Timestamp::ZERO;
        let root = ctx("1.2");
        let hops: Vec<TreeLedger> = (0..3).map(|_| TreeLedger::default()).collect();
        // 100 actions reach the first hop; every hop retries whatever the tree allows.
        let mut arriving = vec![root; 100];
        for hop in &hops {
            let mut sent = Vec::new();
            for c in &arriving {
                hop.arrived(now, c);
                sent.push(c.below(false));
                if let Some(charge) = hop.try_charge(now) {
                    std::mem::forget(charge);
                    sent.push(c.below(true));
                }
            }
            arriving = sent;
        }
        // Each hop below spent one before the extra from above reached it (the first hop's
        // retry of the fifth action arrives after its original): overdrawn by one, and no more.
        assert_eq!(arriving.len(), 122, "1.2 × 100 (and one a hop) at the last, not 1.2³ × 100");
        assert_eq!(hops[0].counts().charged, 20);
        assert_eq!((hops[1].counts().charged, hops[2].counts().charged), (1, 1));
        assert_eq!((hops[1].balance(now), hops[2].balance(now)), (-1, -2));
    }

    #[test]
    fn an_extra_from_above_overdraws_and_a_refund_gives_back() {
        let now = Timestamp::ZERO;
        let l = TreeLedger::default();
        l.arrived(now, &ctx("2"));
        let c = l.try_charge(now).unwrap();
        assert!(l.try_charge(now).is_none());
        c.refund();
        assert_eq!(l.balance(now), 1);
        l.arrived(now, &ctx("2;spent=1"));
        l.arrived(now, &ctx("2;spent=3"));
        assert_eq!(l.balance(now), -1, "extras from above are counted whatever the balance");
        assert!(l.try_charge(now).is_none());
        // The window forgets.
        let later = now.saturating_add(WINDOW);
        assert_eq!(l.balance(later), 0);
        assert_eq!(
            l.counts(),
            TreeCounts { originals: 1, extras_above: 2, charged: 1, refunded: 1 }
        );
    }
}
