//! The fleet layer's series on a `prometheus-client` registry the caller owns.
//!
//! | metric | what |
//! | --- | --- |
//! | `stormguard_fleet_mode{dependency,mode}` | 1 for the current mode (`joining`, `fleet`, `quiet`, `fallback`), 0 for the others |
//! | `stormguard_fleet_lease_slots{dependency}` | slots this instance may use now (lease or fallback share) |
//! | `stormguard_fleet_lease_tokens{dependency}` | reserve tokens this instance may spend now |
//! | `stormguard_fleet_sync_lag_seconds{dependency}` | time since Redis last answered a renewal |
//! | `stormguard_fleet_overcommit_slots{dependency}` | slots the fleet may hold beyond its cap while this instance falls back |
//! | `stormguard_fleet_syncs_total{dependency,result}` | renewals, `ok` or `error` |
//! | `stormguard_fleet_script_calls_total{dependency}` | script calls sent: at most one per interval, whatever the traffic |
//! | `stormguard_fleet_data_loss_total{dependency}` | times Redis was found without its data (a new epoch) |

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::fleet::{Fleet, FleetMode};

/// Registers `fleet`'s series on `registry`, labelled `dependency`.
pub fn register(registry: &mut Registry, fleet: &Fleet) {
    registry.register_collector(Box::new(FleetCollector { fleet: fleet.clone() }));
}

#[derive(Debug)]
struct FleetCollector {
    fleet: Fleet,
}

impl Collector for FleetCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = self.fleet.snapshot();
        // Written escaped: a quote in a dependency's name must not break the exposition.
        let dep = stormguard_core::text::label_value(&self.fleet.config().dependency);
        let dep: &str = &dep;
        let mut m = enc.encode_descriptor(
            "stormguard_fleet_mode",
            "1 for the fleet layer's current mode: joining, fleet, quiet (Redis lost its data), fallback (Redis does not answer)",
            None,
            MetricType::Gauge,
        )?;
        for mode in FleetMode::ALL {
            ConstGauge::new(i64::from(s.mode == mode))
                .encode(m.encode_family(&[("dependency", dep), ("mode", mode.as_str())])?)?;
        }
        let gauges: [(&str, &str, f64); 4] = [
            ("stormguard_fleet_lease_slots", "slots this instance may use now", s.slots as f64),
            (
                "stormguard_fleet_lease_tokens",
                "reserve tokens this instance may spend now",
                s.tokens as f64,
            ),
            (
                "stormguard_fleet_sync_lag_seconds",
                "seconds since Redis last answered a renewal (since start, before the first)",
                s.sync_lag.map_or(f64::INFINITY, |d| d.as_secs_f64()),
            ),
            (
                "stormguard_fleet_overcommit_slots",
                "slots the fleet may hold beyond its cap while this instance falls back",
                s.overcommit as f64,
            ),
        ];
        for (name, help, v) in gauges {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(v).encode(m.encode_family(&[("dependency", dep)])?)?;
        }
        let mut m = enc.encode_descriptor(
            "stormguard_fleet_syncs",
            "lease renewals, by result",
            None,
            MetricType::Counter,
        )?;
        for (result, n) in [("ok", s.syncs_ok), ("error", s.syncs_failed)] {
            ConstCounter::new(n)
                .encode(m.encode_family(&[("dependency", dep), ("result", result)])?)?;
        }
        for (name, help, n) in [
            ("stormguard_fleet_script_calls", "lease script calls sent to Redis", s.script_calls),
            (
                "stormguard_fleet_data_loss",
                "times Redis was found without its data (a new epoch)",
                s.data_loss,
            ),
        ] {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(n).encode(m.encode_family(&[("dependency", dep)])?)?;
        }
        Ok(())
    }
}
