//! The call tree at a listener: the trust rule for a caller's context, and an overload passed
//! up through a service that does not relay it.
//!
//! **Trust.** Each listener says what it does with the `stormguard-tree` member of a request's
//! `baggage` (`tree`, docs/rules.md): `off` takes it off (a caller outside the trust boundary
//! cannot grant itself an allowance, nor claim it spent none), `root` starts a new user action
//! with the listener's `tree_allowance` whatever came, `trust` keeps the caller's with its
//! allowance clamped to `tree_allowance` (and starts one when none came, or when it does not
//! read: counted as a malformed header). The dependency's layer then reads the context the
//! request carries on ([`stormguard_core::tree`]).
//!
//! **An overload passed up.** When a hop below refuses a retry for load, its answer says
//! `x-should-retry: false`, and the hop above does not retry it (`pushback`). A service in
//! between answers its own caller with its own failure, without that header: the hop above it
//! would retry. A proxy that is both the service's way out and its way in (a sidecar, with a
//! listener for each) closes the gap: an answer it gives with `x-should-retry: false` for a
//! user action (the context's `id`) is remembered, with the listener that gave it, for
//! [`WINDOW`] (or, when more than half of [`CAPACITY`] stand down within it, for the newest
//! half to whole of it: two generations, no scan), and a failure the service answers for the
//! same action, through another listener of the proxy, goes up with `x-should-retry: false`
//! and `x-stormguard-tree: overloaded`. So only the hop directly above
//! the overloaded one retries, as the SRE book asks, without the service's help.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderName, HeaderValue, Response};
use stormguard_core::random::{RandomSource, SplitMix64};
use stormguard_core::tree::{Allowance, TreeContext};
use stormguard_proxy_config::TreeMode;

use crate::pushback::SHOULD_RETRY;

/// The header an answer stamped as a hop below's overload carries.
pub(crate) static TREE_HEADER: HeaderName = HeaderName::from_static("x-stormguard-tree");

/// How long an action's overload is remembered.
pub(crate) const WINDOW: Duration = stormguard_core::tree::WINDOW;
/// Actions remembered at most, over two generations (about 3 MiB when full).
const CAPACITY: usize = 65_536;

/// Applies a listener's trust rule to a request's headers: the user action's id when the
/// request goes on with a tree context. `malformed` is told of a trusted context that did not
/// read.
pub(crate) fn at_listener(
    mode: TreeMode,
    allowance: Allowance,
    headers: &mut HeaderMap,
    malformed: impl FnOnce(),
) -> Option<u64> {
    let ctx = match mode {
        TreeMode::Off => {
            stormguard_http::tree::remove(headers);
            return None;
        }
        TreeMode::Root => TreeContext::root(allowance, new_id()),
        TreeMode::Trust => match stormguard_http::tree::read(headers) {
            Some(Ok(ctx)) => {
                TreeContext { id: ctx.id.or_else(|| Some(new_id())), ..ctx }.clamped(allowance)
            }
            Some(Err(_)) => {
                malformed();
                TreeContext::root(allowance, new_id())
            }
            None => TreeContext::root(allowance, new_id()),
        },
    };
    stormguard_http::tree::write(headers, &ctx);
    ctx.id
}

/// A fresh user action's id: a counter from a random start, each mixed by SplitMix64.
fn new_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let seed = *SEED.get_or_init(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ (u64::from(std::process::id()) << 32)
    });
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    SplitMix64::new(seed.wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15))).next_u64()
}

/// When a stand-down for an action ends, and which listener answered it.
type Seen = HashMap<u64, (Instant, usize)>;

/// Two generations of actions: the current one fills, and turns into the previous one when it
/// holds half of [`CAPACITY`] or is [`WINDOW`] old; a lookup reads both. So an insert never
/// scans, and an action is kept for the window, or for the last half-capacity stand-downs when
/// more come in a window.
#[derive(Debug, Default)]
struct Generations {
    current: Seen,
    previous: Seen,
    turned: Option<Instant>,
}

/// The user actions a hop below refused for load, recently (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Overloaded {
    seen: Mutex<Generations>,
    /// Answers stamped as a hop below's overload.
    pub(crate) stamped: AtomicU64,
}

impl Overloaded {
    /// What an answer to action `id` says, as it leaves `listener`: a stand-down is
    /// remembered; a failure of an action another listener stood down for is stamped as one.
    pub(crate) fn answered<B>(
        &self,
        id: u64,
        listener: usize,
        resp: &mut Response<B>,
        now: Instant,
    ) {
        let failing = resp.status().is_server_error() || resp.status().as_u16() == 429;
        if !failing {
            return;
        }
        let stood_down = resp
            .headers()
            .get(&SHOULD_RETRY)
            .is_some_and(|v| v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"false"));
        let mut g = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if stood_down {
            let old = g.turned.is_none_or(|t| now.saturating_duration_since(t) >= WINDOW);
            if g.current.len() >= CAPACITY / 2 || old {
                g.previous = std::mem::take(&mut g.current);
                g.turned = Some(now);
            }
            g.current.insert(id, (now + WINDOW, listener));
            return;
        }
        let other =
            |seen: &Seen| seen.get(&id).is_some_and(|&(until, by)| until > now && by != listener);
        if other(&g.current) || other(&g.previous) {
            drop(g);
            let h = resp.headers_mut();
            h.insert(SHOULD_RETRY.clone(), HeaderValue::from_static("false"));
            h.insert(TREE_HEADER.clone(), HeaderValue::from_static("overloaded"));
            self.stamped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, stand_down: bool) -> Response<()> {
        let mut r = Response::builder().status(status);
        if stand_down {
            r = r.header("x-should-retry", "false");
        }
        r.body(()).unwrap()
    }

    #[test]
    fn a_stand_down_marks_the_actions_later_failures_only() {
        let o = Overloaded::default();
        let now = Instant::now();
        // Listener 0 (the way out) stood down for action 7.
        o.answered(7, 0, &mut answer(503, true), now);
        let mut same = answer(500, false);
        o.answered(7, 1, &mut same, now);
        assert_eq!(same.headers()["x-should-retry"], "false");
        assert_eq!(same.headers()["x-stormguard-tree"], "overloaded");
        let mut own = answer(500, false);
        o.answered(7, 0, &mut own, now);
        assert!(own.headers().get("x-should-retry").is_none(), "the same listener's own failure");
        let mut other = answer(500, false);
        o.answered(8, 1, &mut other, now);
        assert!(other.headers().get("x-should-retry").is_none(), "another action");
        let mut ok = answer(200, false);
        o.answered(7, 1, &mut ok, now);
        assert!(ok.headers().get("x-should-retry").is_none(), "a success passes untouched");
        let mut late = answer(500, false);
        o.answered(7, 1, &mut late, now + WINDOW);
        assert!(late.headers().get("x-should-retry").is_none(), "forgotten after the window");
        assert_eq!(o.stamped.load(Ordering::Relaxed), 1);
    }

    /// A flood of stand-downs: the table stays bounded and never scans; the newest are kept.
    #[test]
    fn a_flood_of_stand_downs_is_bounded() {
        let o = Overloaded::default();
        let now = Instant::now();
        for id in 0..(3 * CAPACITY as u64) {
            o.answered(id, 0, &mut answer(503, true), now);
        }
        let g = o.seen.lock().unwrap();
        assert!(g.current.len() + g.previous.len() <= CAPACITY);
        assert!(g.current.contains_key(&(3 * CAPACITY as u64 - 1)));
    }

    #[test]
    fn the_trust_rule() {
        let allowance: Allowance = "1.5".parse().unwrap();
        let mut h = HeaderMap::new();
        h.insert("baggage", "a=1,stormguard-tree=9;spent=0;id=ff".parse().unwrap());
        let mut off = h.clone();
        assert_eq!(at_listener(TreeMode::Off, allowance, &mut off, || panic!()), None);
        assert_eq!(off["baggage"], "a=1", "an untrusted caller's context is taken off");
        let mut trust = h.clone();
        assert_eq!(at_listener(TreeMode::Trust, allowance, &mut trust, || panic!()), Some(255));
        assert_eq!(trust["baggage"], "a=1,stormguard-tree=1.5;id=00000000000000ff", "clamped");
        let mut root = h.clone();
        let id = at_listener(TreeMode::Root, allowance, &mut root, || panic!()).unwrap();
        assert_ne!(id, 255);
        let ctx = stormguard_http::tree::read(&root).unwrap().unwrap();
        assert_eq!((ctx.allowance.0, ctx.spent, ctx.id), (1500, 0, Some(id)));
        let mut bad = HeaderMap::new();
        bad.insert("baggage", "stormguard-tree=lots".parse().unwrap());
        let mut counted = false;
        assert!(at_listener(TreeMode::Trust, allowance, &mut bad, || counted = true).is_some());
        assert!(counted);
    }
}
