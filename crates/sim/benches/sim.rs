//! How fast the simulator runs the worked example, against its own floor, in one run.
//!
//! - `worked_example`: the built-in `worked-example` scenario, all four policies (no retries,
//!   retry once, retry until success, the 25 % ratio budget under the shared cap), one after
//!   another on one thread: the figure BENCHMARKS.md reports, in simulated requests per second;
//! - `engine_floor`: the same arrivals with the `no-retries` policy alone: the event loop, the
//!   dependency and the statistics, with no policy code at all;
//! - `budget_under_cap`: the `ratio-budget` policy alone: the engine plus stormguard-core's
//!   limiter, `RetryPolicy::on_admitted`, `decide` and `admit` on every request and failure.
//!
//! Throughput is in elements = original requests simulated (each policy simulates its own
//! 19 200). Timing never decides a test: `cargo bench -p stormguard-sim --bench sim`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use stormguard_sim::{Scenario, builtin, simulate};

fn only(s: &Scenario, name: &str) -> Scenario {
    let mut one = s.clone();
    one.policies.retain(|p| p.name == name);
    assert_eq!(one.policies.len(), 1, "{name}");
    one
}

fn requests(s: &Scenario) -> u64 {
    simulate(s).expect("runs").policies.iter().map(|p| p.requests).sum()
}

fn bench(c: &mut Criterion) {
    let all = builtin::scenario("worked-example").expect("built in");
    let mut group = c.benchmark_group("simulate");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for (name, scenario) in [
        ("worked_example", all.clone()),
        ("engine_floor", only(&all, "no-retries")),
        ("budget_under_cap", only(&all, "ratio-budget")),
    ] {
        group.throughput(Throughput::Elements(requests(&scenario)));
        group.bench_function(name, |b| {
            b.iter(|| black_box(simulate(black_box(&scenario)).expect("runs")))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
