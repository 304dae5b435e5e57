//! What was ignored: malformed dependency headers, counted by kind.

use super::*;

/// The kinds of header [`HeaderStats`] counts malformed values of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeaderKind {
    /// `Retry-After` (or a configured equivalent).
    RetryAfter,
    /// `retry-after-ms` (or a configured equivalent).
    RetryAfterMs,
    /// A rate-limit reset header.
    Reset,
    /// `grpc-retry-pushback-ms` that could not be read (and so meant "do not retry").
    GrpcPushback,
    /// A concurrency limit header.
    Limit,
    /// A remaining-quota header.
    Remaining,
    /// `x-should-retry` that is neither `true` nor `false` (ignored).
    ShouldRetry,
    /// A token count in an answer body's `usage` that is negative or not an integer (ignored),
    /// or implausibly far above the request's estimate (clamped).
    Usage,
    /// A request's `stormguard-tree` baggage member that does not read (the request goes
    /// without a call tree's context).
    Tree,
}

impl HeaderKind {
    /// Every kind, in declaration order.
    pub const ALL: [HeaderKind; 9] = [
        HeaderKind::RetryAfter,
        HeaderKind::RetryAfterMs,
        HeaderKind::Reset,
        HeaderKind::GrpcPushback,
        HeaderKind::Limit,
        HeaderKind::Remaining,
        HeaderKind::ShouldRetry,
        HeaderKind::Usage,
        HeaderKind::Tree,
    ];

    /// A label for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            HeaderKind::RetryAfter => "retry-after",
            HeaderKind::RetryAfterMs => "retry-after-ms",
            HeaderKind::Reset => "reset",
            HeaderKind::GrpcPushback => "grpc-retry-pushback-ms",
            HeaderKind::Limit => "limit",
            HeaderKind::Remaining => "remaining",
            HeaderKind::ShouldRetry => "x-should-retry",
            HeaderKind::Usage => "usage",
            HeaderKind::Tree => "stormguard-tree",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for HeaderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Counts of header values that were ignored because they were malformed or implausible, per
/// [`HeaderKind`]. Share one per dependency (behind an `Arc`) and export its
/// [`snapshot`](HeaderStats::snapshot) as a counter.
#[derive(Debug, Default)]
pub struct HeaderStats {
    malformed: [AtomicU64; HeaderKind::ALL.len()],
}

impl HeaderStats {
    /// All counts zero.
    pub fn new() -> HeaderStats {
        HeaderStats::default()
    }

    /// Counts one ignored value of `kind`.
    pub fn record(&self, kind: HeaderKind) {
        // Relaxed: a counter read only for metrics; nothing else is published through it.
        self.malformed[kind.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// The ignored values of `kind` so far.
    pub fn get(&self, kind: HeaderKind) -> u64 {
        self.malformed[kind.index()].load(Ordering::Relaxed)
    }

    /// Every count now (each read on its own: not one atomic instant across kinds).
    pub fn snapshot(&self) -> HeaderStatsSnapshot {
        HeaderStatsSnapshot { malformed: HeaderKind::ALL.map(|k| self.get(k)) }
    }
}

/// A copy of [`HeaderStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeaderStatsSnapshot {
    malformed: [u64; HeaderKind::ALL.len()],
}

impl HeaderStatsSnapshot {
    /// The ignored values of `kind`.
    pub fn get(&self, kind: HeaderKind) -> u64 {
        self.malformed[kind.index()]
    }

    /// The ignored values of every kind.
    pub fn total(&self) -> u64 {
        self.malformed.iter().fold(0, |sum, n| sum.saturating_add(*n))
    }
}
