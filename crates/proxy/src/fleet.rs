//! `placement = "fleet"`: a dependency whose cap and retry reserve are shared by every
//! instance through Redis (stormguard-redis). The proxy owns the lease worker and runs it
//! until shutdown; the request path only reads the lease.

use std::sync::Arc;

use stormguard_redis::{Fleet, FleetWorker, RedisTarget};
use stormguard_tower::Dependency;

use crate::StartError;
use crate::config::validate::fleet_error;
use crate::config::{Invalid, KeyPath, ProxyDependency, RuleError};

/// The dependency, with its fleet and the worker to run when the placement is `fleet`.
pub(crate) fn build(
    d: &ProxyDependency,
    here: &KeyPath,
    tower: stormguard_tower::DependencyConfig,
) -> Result<(Dependency, Option<(Fleet, FleetWorker)>), StartError> {
    let invalid = |e: Invalid<RuleError>| StartError::Invalid(Box::new(e.under(here)));
    let tower_error = |e: stormguard_tower::DependencyError| {
        invalid(Invalid::new(KeyPath::root().key(e.key()), RuleError::Dependency(Box::new(e))))
    };
    let Some(placement) = &d.fleet else {
        let dependency = Dependency::try_new(tower).map_err(tower_error)?;
        return Ok((dependency, None));
    };
    // The parse error never repeats the URL: it may hold the password.
    let target: RedisTarget = placement
        .redis
        .target()
        .map_err(|e| invalid(Invalid::new(KeyPath::root().key("redis"), e.into())))?;
    let config = placement.to_fleet(d, target);
    tracing::info!(
        dependency = %d.name,
        redis = %config.redis,
        instance = %config.instance,
        fleet_cap = config.fleet_cap,
        max_instances = config.max_instances,
        fallback_slots = config.fallback_slots(),
        "fleet placement: the cap and the reserve are shared through Redis"
    );
    let fleet = Fleet::try_new(config).map_err(|e| invalid(fleet_error(e)))?;
    let budget = fleet.budget(&d.budget).map_err(|e| invalid(fleet_error(e)))?;
    let dependency =
        Dependency::try_new_with_budget(tower, Arc::new(budget)).map_err(tower_error)?;
    let mut worker = fleet.worker(dependency.upstream().limiter.clone());
    // A provider's rate limits are per key: the fleet's, divided among its live instances.
    worker.share_rates(
        (0..dependency.upstream_count())
            .filter_map(|i| dependency.rates_at(i))
            .map(|r| r.share())
            .collect(),
    );
    Ok((dependency, Some((fleet, worker))))
}
