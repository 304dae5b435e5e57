//! A dependency's config is refused with a typed error naming the field.

use std::sync::Arc;

use stormguard_core::ConfigError;
use stormguard_core::clock::ManualClock;
use stormguard_core::limiter::LimiterConfig;
use stormguard_tower::{Dependency, DependencyConfig, DependencyError};

fn build(config: DependencyConfig) -> DependencyError {
    Dependency::with_clock(config, Arc::new(ManualClock::new())).unwrap_err()
}

#[test]
fn a_bad_cap_is_a_config_error_naming_cap() {
    let config = DependencyConfig {
        limiter: LimiterConfig { cap: 0, ..Default::default() },
        ..DependencyConfig::new("payments")
    };
    let err = build(config);
    assert!(matches!(err, DependencyError::Config(ConfigError::OutOfRange { key: "cap", .. })));
    assert_eq!(err.key(), "cap");
    assert_eq!(err.to_string(), "cap must be between 1 and 16777216, got 0");
}

#[test]
fn a_bad_queue_names_queue_len() {
    let config = DependencyConfig {
        limiter: LimiterConfig { queue_len: u64::MAX, ..Default::default() },
        ..DependencyConfig::new("payments")
    };
    assert_eq!(build(config).key(), "queue_len");
}

#[test]
fn a_body_limit_above_64_mib_is_refused() {
    let config =
        DependencyConfig { body_limit: 64 * 1024 * 1024 + 1, ..DependencyConfig::new("payments") };
    let err = build(config);
    assert_eq!(err, DependencyError::BodyLimit { got: 64 * 1024 * 1024 + 1 });
    assert_eq!(err.key(), "body_limit");
    assert_eq!(err.to_string(), "body_limit must be at most 64 MiB, got 67108865");
}

#[test]
fn a_good_config_builds() {
    assert!(
        Dependency::with_clock(DependencyConfig::new("payments"), Arc::new(ManualClock::new()))
            .is_ok()
    );
}
