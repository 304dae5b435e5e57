//! 10 000 generated manifests (Istio, Envoy, gRPC, Linkerd, one per file) audited from a temp
//! directory, against a baseline that only reads the same files: the ratio is what parsing and
//! checking cost on top of I/O.
//!
//! `cargo bench -p stormguard-audit --bench audit`

use std::path::{Path, PathBuf};

use criterion::{Criterion, criterion_group, criterion_main};
use stormguard_audit::{AuditOptions, audit_paths};

#[path = "common/manifests.rs"]
mod manifests;
use manifests::{MANIFESTS, generate};

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    v.sort();
    v
}

fn bench(c: &mut Criterion) {
    let tmp = tempfile::tempdir().unwrap();
    generate(tmp.path());
    let dir = tmp.path().to_path_buf();
    let options = AuditOptions::default();
    let report = audit_paths(std::slice::from_ref(&dir), None, &options).unwrap();
    assert_eq!(report.files, MANIFESTS);
    let mut group = c.benchmark_group("audit_10k_manifests");
    group.sample_size(10);
    group.bench_function("baseline_read_only", |b| {
        b.iter(|| {
            files(&dir).iter().map(|f| std::fs::read_to_string(f).unwrap().len()).sum::<usize>()
        })
    });
    group.bench_function("audit", |b| {
        b.iter(|| audit_paths(std::slice::from_ref(&dir), None, &options).unwrap().findings.len())
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
