//! The effective config as the admin `/config` endpoint shows it: every value in force, secrets
//! never (upstream credentials redacted, tokens and Redis URLs named by where they come from).

use std::time::Duration;

use http::HeaderName;

use super::model::redact;
use super::{AdminToken, Overrides, ProxyConfig, RedisSource};

impl ProxyConfig {
    /// The effective config as JSON, for the admin `/config` endpoint. Credentials in upstream
    /// URLs are redacted.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        let dur = |d: Option<Duration>| d.map(|d| format!("{}ms", d.as_millis()));
        json!({
            "listeners": self.listeners.iter().map(|l| json!({
                "listen": l.listen.to_string(), "dependency": l.dependency,
                "downstream_pushback": l.downstream_pushback,
                "tree": l.tree.as_str(), "tree_allowance": l.tree_allowance.to_string(),
            })).collect::<Vec<_>>(),
            "dependencies": self.dependencies.iter().map(|d| json!({
                "name": d.name,
                "upstreams": d.upstreams.iter().map(redact).collect::<Vec<_>>(),
                "upstream_caps": (0..d.upstreams.len()).map(|i| d.upstream_cap(i)).collect::<Vec<_>>(),
                "remaining_reserve": d.remaining_reserve,
                "total_cap": d.total_cap,
                "limit_headers": {
                    "limit": d.limit_headers.limit,
                    "remaining": d.limit_headers.remaining,
                    "reset": d.limit_headers.resets.iter().map(|r| r.name.clone()).collect::<Vec<_>>(),
                },
                "cap": d.cap,
                "queue": d.queue,
                "queue_timeout": dur(Some(d.queue_timeout)),
                "budget": d.budget.to_string(),
                "retry_on": d.retry_on.to_string(),
                "max_retries": d.max_retries,
                "per_try_timeout": dur(d.per_try_timeout),
                "deadline": dur(d.deadline),
                "backoff": format!("{}ms..{}ms", d.backoff.base.as_millis(), d.backoff.max.as_millis()),
                "enforce": d.enforce,
                "breaker": d.breaker.map(|b| json!({
                    "failure_ratio": b.failure_ratio.to_string(),
                    "min_requests": b.min_requests,
                    "window": dur(Some(b.window)),
                    "consecutive_failures": b.consecutive_failures,
                    "break_duration": dur(Some(b.break_duration)),
                    "half_open_probes": b.half_open_probes,
                })),
                "scope_retries": d.scope_retries,
                "scope_header": d.scope_header.as_str(),
                "timeout_slot_hold": dur(Some(d.timeout_slot_hold)),
                "abandon_hold": dur(Some(d.abandon_hold)),
                "body_limit": d.body_limit,
                "planned_primary": d.planned_primary,
                "placement": if d.fleet.is_some() { "fleet" } else { "local" },
                // The Redis URL and its password are never shown: only where they come from.
                "fleet": d.fleet.as_ref().map(|f| json!({
                    "redis": match &f.redis {
                        RedisSource::Env(name) => format!("env:{name}"),
                        RedisSource::Target(t) => t.to_string(),
                    },
                    "fleet_cap": f.fleet_cap.unwrap_or(d.cap),
                    "max_instances": f.max_instances,
                    "lease_ttl": dur(Some(f.lease_ttl)),
                    "interval": dur(Some(f.interval)),
                    "fallback_min": f.fallback_min.unwrap_or(0),
                    "instance": f.instance,
                })),
                "http2": d.http2.prior_knowledge,
                "max_concurrent_streams": d.http2.max_concurrent_streams,
                "requests_per_minute": d.rate.requests_per_minute,
                "tokens_per_minute": d.rate.tokens_per_minute,
                "input_tokens_per_minute": d.rate.input_tokens_per_minute,
                "output_tokens_per_minute": d.rate.output_tokens_per_minute,
                "learn_rate_limits": d.rate.learn,
                "provider": d.rate.provider.map(|p| p.as_str()),
                "quota_hold": dur(Some(d.rate.quota_hold)),
                "overload_cool_down": dur(Some(d.rate.overload_cool_down)),
                "max_hold": dur(Some(d.rate.max_hold)),
                "usage_max_factor": d.rate.usage_max_factor,
                "bytes_per_token": d.bytes_per_token,
                "caller_retries": d.caller_retries.as_str(),
                "client_retry_window": dur(Some(d.client_retry_window)),
                "hedge_after": d.hedge.map(|h| h.after.to_string()),
                "max_hedges": d.hedge.map(|h| h.max_hedges),
                "upstream_adaptive": (0..d.upstreams.len())
                    .map(|i| d.upstream_adaptive(i).map(|a| format!("{}..{} {}", a.min, a.max, a.algorithm)))
                    .collect::<Vec<_>>(),
                "adaptive": d.adaptive.map(|a| json!({
                    "min": a.min,
                    "max": a.max,
                    "algorithm": a.algorithm.to_string(),
                    "window": dur(Some(a.window)),
                    "tolerance": a.tolerance,
                })),
                "tls": d.tls.is_set().then(|| json!({
                    "ca_file": d.tls.ca_file.as_ref().map(|p| p.display().to_string()),
                    "client_cert": d.tls.client_cert.as_ref().map(|p| p.display().to_string()),
                    "client_key": d.tls.client_key.as_ref().map(|p| p.display().to_string()),
                })),
            })).collect::<Vec<_>>(),
            "routes": self.routes.iter().map(|r| json!({
                "host": r.host, "path_prefix": r.path_prefix, "dependency": r.dependency,
                "budget": r.budget.as_ref().map(ToString::to_string), "idempotent": r.idempotent,
            })).collect::<Vec<_>>(),
            "admin": self.admin.map(|a| a.to_string()),
            "record": self.record.as_ref().map(|p| p.display().to_string()),
            "scope_max": self.scope_max,
            "client_header": self.client_header.as_ref().map(HeaderName::as_str),
            "client_max": self.client_max,
            "drain_timeout": dur(Some(self.drain_timeout)),
            "body_idle_timeout": dur(Some(self.body_idle_timeout)),
            "body_timeout": dur(Some(self.body_timeout)),
            "response_buffer": self.response_buffer,
            "response_idle_timeout": dur(Some(self.response_idle_timeout)),
            "header_read_timeout": dur(Some(self.connections.header_read_timeout)),
            "idle_timeout": dur(Some(self.connections.idle_timeout)),
            "max_connections": self.connections.max_connections,
            "admin_max_connections": self.connections.admin_max_connections,
            "max_header_bytes": self.connections.max_header_bytes,
            "http2_max_concurrent_streams": self.connections.http2_max_concurrent_streams,
            "http2_keepalive_interval": dur(Some(self.connections.http2_keepalive_interval)),
            "admin_allow_remote": self.admin_access.allow_remote,
            // Where the token comes from, never the token.
            "admin_token": self.admin_access.token.as_ref().map(AdminToken::shown),
            // Set by flags beside --config, over the file (and again at each reload).
            "overrides": self.overrides.to_json(),
        })
    }
}

impl Overrides {
    /// As `/config` shows them: only what was set, in the flags' terms.
    pub fn to_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        if let Some(a) = self.admin {
            m.insert("admin".into(), a.map_or_else(|| "off".into(), |a| a.to_string()).into());
        }
        if let Some(r) = &self.record {
            m.insert("record".into(), r.display().to_string().into());
        }
        if let Some(d) = self.drain_timeout {
            m.insert("drain_timeout".into(), format!("{}ms", d.as_millis()).into());
        }
        if self.shadow {
            m.insert("shadow".into(), true.into());
        }
        for (key, t) in [
            ("header_read_timeout", self.header_read_timeout),
            ("idle_timeout", self.idle_timeout),
            ("body_timeout", self.body_timeout),
            ("response_idle_timeout", self.response_idle_timeout),
        ] {
            if let Some(t) = t {
                m.insert(key.into(), format!("{}ms", t.as_millis()).into());
            }
        }
        if let Some(n) = self.max_connections {
            m.insert("max_connections".into(), n.into());
        }
        if self.admin_allow_remote {
            m.insert("admin_allow_remote".into(), true.into());
        }
        if let Some(t) = &self.admin_token {
            m.insert("admin_token".into(), t.shown().into());
        }
        serde_json::Value::Object(m)
    }
}
