//! The generated manifests shared by the bench and `examples/gen_manifests.rs`: Istio
//! VirtualService + Deployment, Envoy route config + cluster, gRPC service config and Linkerd
//! ServiceProfile in turn, one file each.

use std::path::Path;

pub const MANIFESTS: usize = 10_000;

fn manifest(i: usize) -> (String, String) {
    match i % 4 {
        0 => (
            format!("vs-{i}.yaml"),
            format!(
                "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata:\n  name: svc-{i}\n  namespace: ns-{}\nspec:\n  hosts: [svc-{i}]\n  http:\n  - name: main\n    match:\n    - uri: {{prefix: /api}}\n    timeout: 3s\n    retries:\n      attempts: {}\n      perTryTimeout: 1s\n      retryOn: connect-failure,refused-stream,5xx\n    route:\n    - destination:\n        host: svc-{i}\n  - route:\n    - destination:\n        host: svc-{i}\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: svc-{i}\nspec:\n  replicas: 3\n  template:\n    spec:\n      containers:\n      - name: app\n        image: example/app:{i}\n",
                i % 17,
                i % 4
            ),
        ),
        1 => (
            format!("envoy-{i}.yaml"),
            format!(
                "name: rc-{i}\nvirtual_hosts:\n- name: vh-{i}\n  domains: [\"*\"]\n  routes:\n  - name: r-{i}\n    match: {{prefix: /}}\n    route:\n      cluster: c-{i}\n      timeout: 2s\n      retry_policy:\n        retry_on: 5xx,connect-failure\n        num_retries: {}\n        per_try_timeout: 0.5s\n---\nname: c-{i}\nconnect_timeout: 1s\ncircuit_breakers:\n  thresholds:\n  - retry_budget:\n      budget_percent: {{value: 20.0}}\n      min_retry_concurrency: 3\n",
                i % 5
            ),
        ),
        2 => (
            format!("grpc-{i}.json"),
            format!(
                "{{\n  \"methodConfig\": [{{\n    \"name\": [{{\"service\": \"pkg.Svc{i}\"}}],\n    \"timeout\": \"1s\",\n    \"retryPolicy\": {{\"maxAttempts\": {}, \"initialBackoff\": \"0.1s\", \"maxBackoff\": \"1s\", \"backoffMultiplier\": 2, \"retryableStatusCodes\": [\"UNAVAILABLE\"]}}\n  }}],\n  \"retryThrottling\": {{\"maxTokens\": 10, \"tokenRatio\": 0.1}}\n}}\n",
                2 + i % 6
            ),
        ),
        _ => (
            format!("sp-{i}.yaml"),
            format!(
                "apiVersion: linkerd.io/v1alpha2\nkind: ServiceProfile\nmetadata:\n  name: svc-{i}.ns.svc.cluster.local\nspec:\n  retryBudget:\n    retryRatio: 0.2\n    minRetriesPerSecond: 10\n    ttl: 10s\n  routes:\n  - name: GET /items\n    condition: {{method: GET, pathRegex: /items}}\n    isRetryable: true\n    timeout: 2s\n  - name: POST /items\n    condition: {{method: POST, pathRegex: /items}}\n"
            ),
        ),
    }
}

/// Writes the manifests into `dir` (used by the bench and by BENCHMARKS.md's CLI timing).
pub fn generate(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for i in 0..MANIFESTS {
        let (name, text) = manifest(i);
        std::fs::write(dir.join(name), text).unwrap();
    }
}
