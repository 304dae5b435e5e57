//! Writes the benchmark's 10 000 manifests into a directory, for timing the CLI:
//! `cargo run --release -p stormguard-audit --example gen_manifests -- /tmp/manifests`.

#[path = "../benches/common/manifests.rs"]
mod manifests;

fn main() {
    let dir = std::env::args_os().nth(1).expect("usage: gen_manifests DIR");
    manifests::generate(std::path::Path::new(&dir));
    println!("{} manifests in {}", manifests::MANIFESTS, std::path::Path::new(&dir).display());
}
