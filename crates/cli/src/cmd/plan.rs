//! `stormguard plan`: the worked example for your numbers.

use std::fmt::Write as _;
use std::io::Write;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde_json::{Value, json};
use stormguard_core::plan::{Plan, PlanInput};
use stormguard_core::{defaults, format};

use super::plan_systems;
use crate::Failure;

/// Flags of `stormguard plan`.
#[derive(Debug, Args)]
#[command(after_help = "\
Example (the worked example: a cap of 20, 16 planned in flight):
  stormguard plan --cap 20 --primary 16 --error-rate 0.05 --error-rate 0.2 --error-rate 0.4

The ratio budget's percent is a share of primaries: (cap - primary) / primary. Envoy's form is a
share of everything in flight: (cap - primary) / cap. Paste a printed SPEC into
`stormguard proxy --budget SPEC` or `stormguard replay --policy SPEC`. The SPECs hold the
concurrency floor to cap - primary and the percent to 50 %, so `stormguard audit` accepts them.

The same plan in another system's config, each number commented with its source; what the
system cannot express is said in the file and on stderr (docs/plan.md):
  stormguard plan --cap 20 --primary 16 --format envoy > envoy.yaml
  stormguard plan --cap 20 --primary 16 --format istio        # DestinationRule + VirtualService
  stormguard plan --cap 20 --primary 16 --format gateway-api  # XBackendTrafficPolicy + HTTPRoute
  stormguard plan --cap 20 --primary 16 --format linkerd      # Linkerd 2.16 retry annotations
  stormguard plan --cap 20 --primary 16 --format grpc         # gRPC service config JSON")]
pub struct PlanArgs {
    /// The dependency's concurrency cap: attempts (first tries and retries) in flight.
    #[arg(long, value_name = "N")]
    pub cap: u64,
    /// Planned primary (first-try) calls in flight at normal load.
    #[arg(long, value_name = "N")]
    pub primary: u64,
    /// An error rate to tabulate, in [0, 1]; repeat for several. Default: 0.05, 0.2, 0.4.
    #[arg(long = "error-rate", value_name = "E")]
    pub error_rates: Vec<f64>,
    /// The budget's floor, in concurrent retries; it never overrides the cap (the SPECs hold it
    /// to cap - primary).
    #[arg(long, value_name = "N", default_value_t = defaults::CONCURRENCY_MIN)]
    pub floor: u64,
    /// Parallel calls per user action (prints the chance that all are fast).
    #[arg(long = "fan-out", value_name = "CALLS")]
    pub fan_out: Option<u32>,
    /// With --fan-out: the per-call quantile that counts as fast.
    #[arg(long, value_name = "Q", default_value_t = 0.99, requires = "fan_out")]
    pub quantile: f64,
    /// The server's own connection or concurrency limit (fleet pool sizing).
    #[arg(long = "server-limit", value_name = "N", requires = "instances")]
    pub server_limit: Option<u64>,
    /// With --server-limit: what the server keeps for other clients.
    #[arg(long, value_name = "N", default_value_t = 0, requires = "server_limit")]
    pub reserve: u64,
    /// With --server-limit: the peak number of instances (not today's count).
    #[arg(long, value_name = "N", requires = "server_limit")]
    pub instances: Option<u64>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// With --format envoy: the dependency's address, HOST:PORT (an IP makes a STATIC cluster,
    /// a name a STRICT_DNS one).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:9000")]
    pub upstream: plan_systems::HostPort,
    /// With --format envoy: where Envoy listens, ADDRESS:PORT.
    #[arg(long, value_name = "ADDRESS:PORT", default_value = "127.0.0.1:8080")]
    pub listen: plan_systems::HostPort,
    /// With --format istio, gateway-api or linkerd: the dependency's Kubernetes Service and
    /// port.
    #[arg(long, value_name = "NAME:PORT", default_value = "dependency:80")]
    pub service: plan_systems::HostPort,
    /// With a system's format: retries after the first try.
    #[arg(long, value_name = "N", default_value_t = defaults::MAX_RETRIES)]
    pub retries: u32,
    /// With a system's format: each try's timeout (whole milliseconds).
    #[arg(long = "per-try-timeout", value_name = "DURATION", default_value = "300ms",
          value_parser = crate::args::duration)]
    pub per_try_timeout: Duration,
    /// With a system's format: the first try and every retry together (whole milliseconds).
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = crate::args::duration)]
    pub timeout: Duration,
}

/// How to print the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A table for people, with ready-made SPECs.
    Table,
    /// One JSON object, for scripts.
    Json,
    /// A stormguard config with the planned cap and budget.
    Toml,
    /// An Envoy bootstrap: circuit breaker and retry budget on the cluster, retry policy on
    /// the route.
    Envoy,
    /// An Istio DestinationRule (cap and budget) and VirtualService (retries).
    Istio,
    /// A Gateway API XBackendTrafficPolicy (budget) and HTTPRoute (retries).
    #[value(name = "gateway-api")]
    GatewayApi,
    /// Linkerd 2.16 retry annotations on a Service (no cap, no budget: said in the file).
    Linkerd,
    /// A gRPC service config: retryPolicy and retryThrottling.
    Grpc,
}

/// Runs `stormguard plan`.
pub fn run(args: &PlanArgs, out: &mut dyn Write) -> Result<(), Failure> {
    let mut input = PlanInput::new(args.cap, args.primary);
    if !args.error_rates.is_empty() {
        input.error_rates = args.error_rates.clone();
    }
    input.floor = args.floor;
    input.fan_out = args.fan_out.map(|calls| (calls, args.quantile));
    input.pool = match (args.server_limit, args.instances) {
        (Some(limit), Some(instances)) => Some((limit, args.reserve, instances)),
        _ => None,
    };
    let plan = input.plan().map_err(|e| Failure::usage(e.to_string()))?;
    let text = match args.format {
        Format::Table => table(&plan),
        Format::Json => {
            serde_json::to_string_pretty(&json_of(&plan)).expect("a Value serializes") + "\n"
        }
        Format::Toml => toml(&plan, args),
        system => {
            let render = match system {
                Format::Envoy => plan_systems::envoy,
                Format::Istio => plan_systems::istio,
                Format::GatewayApi => plan_systems::gateway_api,
                Format::Linkerd => plan_systems::linkerd,
                _ => plan_systems::grpc,
            };
            if !args.per_try_timeout.subsec_nanos().is_multiple_of(1_000_000)
                || !args.timeout.subsec_nanos().is_multiple_of(1_000_000)
            {
                return Err(Failure::usage(
                    "--per-try-timeout and --timeout must be whole milliseconds",
                ));
            }
            let rendered = render(&plan, args);
            // What the system cannot express goes to stderr too: the file may go straight into a
            // pipe that nobody reads.
            for note in &rendered.notes {
                eprintln!("stormguard plan: note: {note}");
            }
            rendered.text
        }
    };
    out.write_all(text.as_bytes())?;
    Ok(())
}

/// The JSON contract: the plan's fields, `ratio_percent` beside `max_retry_fraction`, and the
/// SPECs; `fan_out` and `pool` only when asked for.
pub fn json_of(plan: &Plan) -> Value {
    let mut v = serde_json::to_value(plan).expect("a plan serializes");
    let obj = v.as_object_mut().expect("a plan is an object");
    obj.insert("ratio_percent".into(), json!(plan.max_retry_fraction));
    obj.insert(
        "specs".into(),
        json!({
            "ratio": plan.ratio_spec().to_string(),
            "concurrency": plan.concurrency_spec().to_string(),
            "slots": plan.slots_spec().to_string(),
        }),
    );
    if plan.fan_out.is_none() {
        obj.remove("fan_out");
    }
    if plan.pool.is_none() {
        obj.remove("pool");
    }
    v
}

fn pct(x: f64) -> String {
    format::percent_trimmed(x, 2)
}

fn num(x: f64) -> String {
    format::number(x, 2)
}

fn table(plan: &Plan) -> String {
    let mut s = String::new();
    let (cap, primary, slots) = (plan.cap, plan.primary, plan.retry_slots);
    let _ = writeln!(s, "stormguard plan: a cap of {cap}, {primary} primaries planned in flight\n");
    let _ = writeln!(s, "  retry slots (cap - primary):                {slots}");
    let _ = writeln!(
        s,
        "  ratio budget, share of primaries:           {}   ({slots} / {primary}; max_retry_fraction)",
        pct(plan.max_retry_fraction)
    );
    let _ = writeln!(
        s,
        "  concurrency budget, share of all in flight: {}   ({slots} / {cap}; Envoy's form)",
        pct(plan.concurrency_percent)
    );
    let _ = writeln!(
        s,
        "  floor:                                      {} concurrent retries, never above the cap",
        plan.floor
    );
    let _ = writeln!(
        s,
        "  separate pools ({cap} primaries + {slots} retries):  the dependency sees {}\n",
        plan.separate_pools_in_flight
    );
    let header =
        ["error rate", "retry once", "retry until success", "with budget", "shed", "verdict"];
    let rows: Vec<[String; 6]> = plan
        .rows
        .iter()
        .map(|r| {
            [
                pct(r.error_rate),
                num(r.in_flight_retry_once),
                r.in_flight_unbounded.map_or_else(|| "unbounded".to_string(), num),
                num(r.in_flight_budgeted),
                num(r.retries_shed),
                r.verdict.as_str().to_string(),
            ]
        })
        .collect();
    let mut all = vec![header.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
    all.extend(rows.iter().map(|r| r.to_vec()));
    let lines = stormguard_core::format::table(&all, |_| stormguard_core::format::Align::Right);
    s.push_str("  in flight at the dependency (cap ");
    let _ = writeln!(s, "{cap}):");
    for l in lines {
        let _ = writeln!(s, "  {l}");
    }
    s.push_str(
        "\n  retry once: every failure retried at once; with budget: retries shed past the cap\n  \
         and surfaced as errors; verdict of retry once: fits, at-edge (under one slot left), over-cap\n",
    );
    if let Some(f) = &plan.fan_out {
        let _ = writeln!(
            s,
            "\n  fan-out: {} parallel calls, each fast {} of the time: all fast {} of the time",
            f.calls,
            pct(f.quantile),
            pct(f.p_all_fast)
        );
    }
    if let Some(p) = &plan.pool {
        let _ = writeln!(
            s,
            "\n  fleet: ({} - {}) / {} instances = a cap of {} per instance (for a database: each \
             instance's pool size, stormguard_postgres::pool_size); a cap of {cap} on each \
             would demand {}{}",
            p.server_limit,
            p.reserve,
            p.instances,
            p.per_instance,
            p.demanded,
            if p.demanded > p.server_limit - p.reserve {
                " (more than the server allows)"
            } else {
                ""
            }
        );
    }
    let _ = writeln!(s, "\nready-made budget SPECs (stormguard proxy --budget SPEC):");
    let specs = [
        (plan.ratio_spec().to_string(), "ratio form: retries per original request"),
        (plan.concurrency_spec().to_string(), "Envoy's form: a share of all in flight"),
        (plan.slots_spec().to_string(), "fixed: cap - primary concurrent retries"),
    ];
    let w = specs.iter().map(|(spec, _)| spec.len()).max().unwrap_or(0);
    for (spec, what) in &specs {
        let _ = writeln!(s, "  {spec:<w$}   # {what}");
    }
    if plan.percent_held() {
        let _ = writeln!(
            s,
            "  (percent held at {}: the cap leaves room for more, but past it a failing dependency\n   \
             sees more than half again its load in retries; `stormguard audit` flags it)",
            pct(defaults::MAX_SUGGESTED_PERCENT.as_f64())
        );
    }
    if plan.spec_floor() < plan.floor {
        let _ = writeln!(
            s,
            "  (floor held at {}: the headroom cap - primary; a larger floor would let retries push\n   \
             the primaries past the cap)",
            plan.spec_floor()
        );
    }
    s
}

fn toml(plan: &Plan, args: &PlanArgs) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# stormguard config planned by `stormguard plan --cap {} --primary {}`.\n\
         # Check it with `stormguard check-config FILE`; replace the upstream with the dependency's address.\n",
        args.cap, args.primary
    );
    let _ = writeln!(s, "[[listener]]\nlisten = \"127.0.0.1:8080\"\ndependency = \"dependency\"\n");
    let _ = writeln!(
        s,
        "[[dependency]]\nname = \"dependency\"\nupstreams = [\"http://127.0.0.1:9000\"]"
    );
    let _ = writeln!(s, "# every attempt, first tries and retries, takes a slot under this cap");
    let _ = writeln!(s, "cap = {}", plan.cap);
    let _ = writeln!(s, "# what the cap was planned for (read by `stormguard audit`)");
    let _ = writeln!(s, "planned_primary = {}", plan.primary);
    if plan.percent_held() {
        let _ = writeln!(
            s,
            "# {} retries per original request would fit under the cap; held at {}, past which a\n\
             # failing dependency sees more than half again its load in retries",
            pct(plan.max_retry_fraction),
            pct(defaults::MAX_SUGGESTED_PERCENT.as_f64())
        );
    } else {
        let _ = writeln!(
            s,
            "# {} retries per original request keep {} primaries plus retries under the cap",
            pct(plan.max_retry_fraction),
            plan.primary
        );
    }
    let _ = writeln!(s, "budget = \"{}\"", plan.ratio_spec());
    let _ = writeln!(
        s,
        "# the same headroom in Envoy's form: budget = \"{}\"",
        plan.concurrency_spec()
    );
    s
}
