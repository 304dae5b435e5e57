//! `x-request-id` values for the requests chaos makes (the load client's, and a `--forward`
//! service's calls): this run's random prefix and a number, `{run:016x}-{n}`, unique across
//! runs without coordination.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use http::{HeaderName, HeaderValue};

/// The header the ids go in.
pub(crate) static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// A run's request ids.
#[derive(Debug)]
pub(crate) struct RequestIds {
    run: u64,
    next: AtomicU64,
}

impl RequestIds {
    /// A new run: a random prefix, numbers from 1.
    pub(crate) fn new() -> RequestIds {
        let run = std::hash::RandomState::new().hash_one(std::time::SystemTime::now());
        RequestIds { run, next: AtomicU64::new(1) }
    }

    /// The next id.
    pub(crate) fn next(&self) -> HeaderValue {
        // Relaxed: a unique number is all it must be.
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        HeaderValue::try_from(format!("{:016x}-{n}", self.run))
            .expect("hex digits, a dash and digits are a valid header value")
    }
}
