//! The proxy's configuration: the model, the file, the rules and the `/config` view are
//! [`stormguard_proxy_config`]'s (re-exported here); what is the proxy's own is the mapping from
//! a [`ProxyDependency`] to tower's [`DependencyConfig`](stormguard_tower::DependencyConfig),
//! what the proxy's stack is built from ([`ToTower`]).

pub use stormguard_proxy_config::*;

/// A dependency's config as the in-process dependency the proxy's stack runs on.
pub trait ToTower {
    /// The tower dependency this describes.
    fn to_tower(&self) -> stormguard_tower::DependencyConfig;
}

impl ToTower for ProxyDependency {
    fn to_tower(&self) -> stormguard_tower::DependencyConfig {
        let mut c = stormguard_tower::DependencyConfig::new(self.name.clone());
        c.limiter = self.limiter_config();
        c.budget = self.budget;
        c.retry.retry_on = self.retry_on.clone();
        c.retry.max_retries = self.max_retries;
        c.retry.backoff = self.backoff;
        c.retry.enforce = self.enforce;
        c.retry.hedge = self.hedge;
        c.breaker = self.breaker;
        c.per_try_timeout = self.per_try_timeout;
        c.deadline = self.deadline;
        c.timeout_slot_hold = self.timeout_slot_hold;
        c.abandon_hold = self.abandon_hold;
        c.body_limit = self.body_limit;
        // The proxy owns its runtime: a timed-out or abandoned attempt runs on to its answer in
        // a task, so its held slot comes back when the upstream really finishes.
        c.background = Some(stormguard_tower::Spawner::tokio());
        if let Ok(h) = stormguard_http::headers::LimitHeaders::try_new(self.limit_headers.clone()) {
            c.limit_headers = h;
        }
        c.remaining_reserve = self.remaining_reserve;
        c.total_cap = self.total_cap;
        c.rate = self.rate;
        if self.upstreams.len() > 1 {
            c.upstreams = self
                .upstreams
                .iter()
                .enumerate()
                .map(|(i, u)| stormguard_tower::UpstreamSpec {
                    name: upstream_label(u),
                    cap: self.upstream_cap(i),
                    adaptive: self.upstream_adaptive(i),
                })
                .collect();
        }
        c
    }
}
