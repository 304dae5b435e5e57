//! The shipped examples work, and the text points only at files that exist.
//!
//! Every file in `deploy/examples/` is run through the command that reads it (`check-config`,
//! `chaos --check`, `simulate`, `audit`, `replay`), with what its comments claim checked. Then
//! README.md, BENCHMARKS.md, deploy/README.md, docs/*.md, the examples' own comments and every
//! subcommand's `--help` are scanned for file names: each must be a file of the repository (a
//! bare name, one in `deploy/examples/`), or one the text itself tells the reader to write.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Output;

use assert_cmd::Command;
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// Runs `stormguard ARGS` from the repository root, as the help and docs show the commands.
fn stormguard(args: &[&str]) -> Output {
    Command::cargo_bin("stormguard")
        .unwrap()
        .current_dir(root())
        .env_remove("STORMGUARD_REDIS_URL")
        .args(args)
        .output()
        .unwrap()
}

fn ok(args: &[&str]) -> String {
    let out = stormguard(args);
    assert!(
        out.status.success(),
        "stormguard {} exited {:?}:\n{}{}",
        args.join(" "),
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Each example and the command that checks it; the files not listed here fail
/// `every_example_is_checked`, so a new example cannot ship unchecked.
const PROXY_CONFIGS: [&str; 5] = [
    "deploy/examples/stormguard.toml",
    "deploy/examples/grpc.toml",
    "deploy/examples/fleet.toml",
    "deploy/examples/payments-https.toml",
    "deploy/examples/model-providers.toml",
];
const OTHERS: [&str; 5] = [
    "deploy/examples/phases.toml", // chaos_script_passes_its_check
    "deploy/examples/storm.toml",  // simulator_scenario_runs_and_does_what_it_says
    "deploy/examples/envoy.yaml",  // envoy_config_is_read_by_the_audit
    "deploy/examples/graph.toml",  // the_graph_gives_the_amplification_it_states
    "deploy/examples/trace.jsonl", // trace_replays_to_the_hand_worked_answer
];

#[test]
fn every_example_is_checked() {
    let shipped: BTreeSet<String> = std::fs::read_dir(root().join("deploy/examples"))
        .unwrap()
        .map(|e| format!("deploy/examples/{}", e.unwrap().file_name().to_string_lossy()))
        .collect();
    let checked: BTreeSet<String> =
        PROXY_CONFIGS.iter().chain(&OTHERS).map(|s| s.to_string()).collect();
    assert_eq!(shipped, checked, "every file in deploy/examples needs a test here");
}

#[test]
fn proxy_configs_pass_check_config_and_the_audit() {
    for file in PROXY_CONFIGS {
        let out = ok(&["check-config", file]);
        assert!(out.starts_with(&format!("{file}: ok (")), "{out}");
        // The audit reads each as a stormguard config (one retry layer per dependency) and
        // finds nothing to warn of: an example passes the project's own linter.
        let report: Value =
            serde_json::from_str(&ok(&["audit", file, "--json", "--fail-on", "warning"])).unwrap();
        assert_eq!(report["summary"]["errors"], 0, "{file}: {report}");
        assert_eq!(report["summary"]["warnings"], 0, "{file}: {report}");
        assert!(report["summary"]["layers"].as_u64().unwrap() >= 1, "{file}: {report}");
    }
}

/// `fleet.toml` says its fallback share is 250 / 50 = 5: a share of 0 would leave an instance
/// without Redis no slot at all.
#[test]
fn fleet_example_has_a_fallback_share() {
    let text = std::fs::read_to_string(root().join("deploy/examples/fleet.toml")).unwrap();
    let key = |k: &str| -> u64 {
        let line = text.lines().find(|l| l.starts_with(&format!("{k} ="))).unwrap();
        line[k.len() + 2..].split('#').next().unwrap().trim().parse().unwrap()
    };
    assert_eq!(key("fleet_cap") / key("max_instances"), 5);
}

#[test]
fn chaos_script_passes_its_check() {
    let out = ok(&["chaos", "--script", "deploy/examples/phases.toml", "--check"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "deploy/examples/phases.toml: ok (4 phases, seed 7, on_disconnect finish)",
            "  phase[0] healthy: 10s, no injected errors",
            "  phase[1] storm: 30s, error_rate 0.3 (503)",
            "  phase[2] slow: 30s, no injected errors",
            "  phase[3] recovery: until advanced, no injected errors",
        ]
    );
    // --check fails as serving would: file, line, column and key, exit 2.
    let dir = std::env::temp_dir().join(format!("stormguard-examples-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("phases.toml");
    std::fs::write(&bad, "[[phase]]\nerror_rate = 1.5\n").unwrap();
    let out = stormguard(&["chaos", "--script", bad.to_str().unwrap(), "--check"]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("phases.toml:2:14: phase[0].error_rate: must be a fraction"), "{err}");
    assert!(out.stdout.is_empty());
}

/// The help's command on the example, and its comment's claim: retrying once takes the
/// dependency over the cap of 20, the budget under the cap holds it.
#[test]
fn simulator_scenario_runs_and_does_what_it_says() {
    let out = ok(&[
        "simulate",
        "deploy/examples/storm.toml",
        "--policy",
        "retry-once",
        "--policy",
        "ratio-budget",
        "--json",
        "--no-progress",
    ]);
    let v: Value = serde_json::from_str(&out).unwrap();
    let max = |name: &str| {
        let p = v["policies"].as_array().unwrap().iter().find(|p| p["name"] == name).unwrap();
        p["in_flight"]["max"].as_f64().unwrap()
    };
    assert!(max("retry-once") > 20.0, "{v}");
    assert!(max("ratio-budget") <= 20.0, "{v}");
    assert_eq!(v["policies"].as_array().unwrap().len(), 2);
}

/// docs/simulator.md's second example names policies of the scenario it prints.
#[test]
fn simulator_docs_example_names_the_scenarios_policies() {
    let doc = std::fs::read_to_string(root().join("docs/simulator.md")).unwrap();
    let line = doc
        .lines()
        .find(|l| l.starts_with("stormguard simulate my.toml"))
        .expect("docs/simulator.md runs my.toml");
    let builtin = doc
        .lines()
        .find(|l| l.contains("--print-scenario > my.toml"))
        .and_then(|l| l.split("--builtin ").nth(1))
        .and_then(|l| l.split_whitespace().next())
        .expect("docs/simulator.md prints a built-in to my.toml");
    let scenario = ok(&["simulate", "--builtin", builtin, "--print-scenario"]);
    let dir = std::env::temp_dir().join(format!("stormguard-my-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let my = dir.join("my.toml");
    std::fs::write(&my, scenario).unwrap();
    let words: Vec<&str> = line.split('#').next().unwrap().split_whitespace().collect();
    let policies: Vec<&str> =
        words.windows(2).filter(|w| w[0] == "--policy").map(|w| w[1]).collect();
    assert_eq!(policies.len(), 2, "{line}");
    let mut args = vec!["simulate", my.to_str().unwrap(), "--json", "--no-progress"];
    for p in &policies {
        args.extend(["--policy", p]);
    }
    let out = stormguard(&args);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(out.status.success(), "{line}: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> =
        v["policies"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, policies);
}

#[test]
fn envoy_config_is_read_by_the_audit() {
    let v: Value =
        serde_json::from_str(&ok(&["audit", "deploy/examples/envoy.yaml", "--json"])).unwrap();
    // One route that retries, under a retry budget: no finding at all.
    assert_eq!(v["summary"]["layers"], 1, "{v}");
    assert_eq!(v["summary"]["retrying_layers"], 1, "{v}");
    assert_eq!(v["findings"].as_array().unwrap().len(), 0, "{v}");
}

/// Envoy itself accepts the example (the audit reads retry settings and ignores the rest, so
/// it would not notice a misspelt field). Needs `envoy` on the PATH; without it the test says
/// so and checks nothing (scripts/test does not install Envoy).
#[test]
fn envoy_accepts_the_example_when_installed() {
    let Ok(out) = std::process::Command::new("envoy")
        .args(["--mode", "validate", "-c", "deploy/examples/envoy.yaml"])
        .current_dir(root())
        .output()
    else {
        eprintln!("skipped: no envoy on the PATH to validate deploy/examples/envoy.yaml");
        return;
    };
    assert!(
        out.status.success(),
        "envoy refuses deploy/examples/envoy.yaml:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The command in the audit's help, on the examples: what graph.toml's comment says.
#[test]
fn the_graph_gives_the_amplification_it_states() {
    let v: Value = serde_json::from_str(&ok(&[
        "audit",
        "deploy/examples",
        "--graph",
        "deploy/examples/graph.toml",
        "--max-amplification",
        "3",
        "--json",
    ]))
    .unwrap();
    let paths = v["paths"].as_array().unwrap();
    assert_eq!(paths.len(), 1, "{v}");
    assert_eq!(paths[0]["services"], serde_json::json!(["web", "checkout", "payments"]));
    assert_eq!(paths[0]["amplification_fraction"], serde_json::json!([5, 2]));
    let rules: Vec<&str> =
        v["findings"].as_array().unwrap().iter().map(|f| f["rule"].as_str().unwrap()).collect();
    assert!(rules.contains(&"stacked-retries"), "{rules:?}");
    assert_eq!(v["summary"]["errors"], 0, "{v}");
    // The scenario, the chaos script and the graph itself are skipped, not misread.
    assert_eq!(v["summary"]["skipped_kinds"]["toml"], 3, "{v}");
}

/// The help's command on the trace. Worked out by hand (docs/budgets.md, ratio): 20 % of the
/// requests so far, no reserve. At 340 ms, 4 requests: 0.8, refused. At 540 ms, 6: 1.2,
/// granted (0.2 left). At 1 000 ms, 8: 1.6 − 1 = 0.6, refused; the balance is floor(0.6) = 0.
#[test]
fn trace_replays_to_the_hand_worked_answer() {
    let out = ok(&[
        "replay",
        "--policy",
        "ratio:percent=0.2,min_per_sec=0,ttl=10s",
        "deploy/examples/trace.jsonl",
    ]);
    assert_eq!(
        out,
        "{\"t_ms\":340,\"op\":\"retry\",\"allowed\":false}\n\
         {\"t_ms\":540,\"op\":\"retry\",\"allowed\":true}\n\
         {\"t_ms\":1000,\"op\":\"retry\",\"allowed\":false}\n\
         {\"t_ms\":1000,\"op\":\"balance\",\"value\":0}\n"
    );
}

// ---- file names in the text -------------------------------------------------------------------

/// Names the text tells the reader to create (an output), with the sentence that does.
const WRITTEN_BY_THE_READER: [(&str, &str); 2] = [
    ("incident.jsonl", "`--record incident.jsonl` writes the proxy's traffic as a trace"),
    ("my.toml", "`simulate --builtin fleet --print-scenario > my.toml`"),
];

const EXTENSIONS: [&str; 6] = [".toml", ".yaml", ".yml", ".json", ".jsonl", ".md"];

/// The file-like names in `text`: runs of path characters ending in one of [`EXTENSIONS`].
/// Words holding a URL are skipped, and so are absolute paths (`/etc/…`, the admin's
/// `/stats.json`, `127.0.0.1:9901/stats.json`): they are not the repository's.
fn file_names(text: &str) -> Vec<String> {
    let path_char = |c: char| c.is_ascii_alphanumeric() || "_-./".contains(c);
    let mut out = Vec::new();
    for word in text.split_whitespace().filter(|w| !w.contains("://")) {
        for run in word.split(|c: char| !path_char(c)) {
            let run = run.trim_end_matches('.');
            if run.starts_with('/') || !EXTENSIONS.iter().any(|e| run.ends_with(e)) {
                continue;
            }
            // `127.0.0.1:9901/stats.json`: a port and the path of an address, not a file.
            let digits = run.chars().take_while(char::is_ascii_digit).count();
            if digits > 0 && run[digits..].starts_with('/') {
                continue;
            }
            // `.md` alone, or an extension mentioned as such (`.yaml`), is not a file.
            if EXTENSIONS.iter().any(|e| run == *e || run == &e[1..]) {
                continue;
            }
            out.push(run.to_string());
        }
    }
    out
}

/// Where `name`, read in a file of `dir`, can be: beside it, from the root, or for a bare name
/// in deploy/examples.
fn resolves(name: &str, dir: &Path) -> bool {
    let root = root();
    dir.join(name).is_file()
        || root.join(name).is_file()
        || (!name.contains('/') && root.join("deploy/examples").join(name).is_file())
}

fn check_text(origin: &str, dir: &Path, text: &str, bad: &mut Vec<String>) -> usize {
    let names = file_names(text);
    for name in &names {
        if WRITTEN_BY_THE_READER.iter().any(|(n, _)| n == name) || resolves(name, dir) {
            continue;
        }
        bad.push(format!("{origin}: {name}"));
    }
    names.len()
}

/// Every subcommand, as the top-level help lists them.
fn subcommands() -> Vec<String> {
    let help = ok(&["--help"]);
    let commands = help.split("Commands:").nth(1).expect("a Commands section");
    commands
        .lines()
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

#[test]
fn the_text_names_only_files_that_exist() {
    let root = root();
    let mut docs: Vec<PathBuf> =
        ["README.md", "BENCHMARKS.md", "deploy/README.md"].iter().map(|p| root.join(p)).collect();
    for dir in ["docs", "deploy/examples"] {
        for e in std::fs::read_dir(root.join(dir)).unwrap() {
            let p = e.unwrap().path();
            if EXTENSIONS.iter().any(|x| p.to_string_lossy().ends_with(x)) {
                docs.push(p);
            }
        }
    }
    docs.sort();
    let mut bad = Vec::new();
    let mut seen = 0;
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        let origin = doc.strip_prefix(&root).unwrap().display().to_string();
        seen += check_text(&origin, doc.parent().unwrap(), &text, &mut bad);
    }
    let commands = subcommands();
    assert!(commands.len() >= 9, "{commands:?}");
    for c in &commands {
        let help = ok(&[c, "--help"]);
        seen += check_text(&format!("stormguard {c} --help"), &root, &help, &mut bad);
    }
    assert!(seen > 50, "only {seen} file names found: is the scan reading anything?");
    assert!(
        bad.is_empty(),
        "names of files that are not in the repository:\n  {}",
        bad.join("\n  ")
    );
}

/// The scan finds what it must: names in code spans, links and commands; not URLs, absolute
/// paths or a bare extension; and a file that is missing is missing.
#[test]
fn the_scan_reads_names_as_written() {
    let note = concat!("DESIGN", ".md");
    let names = file_names(&format!(
        "Run `stormguard proxy --config deploy/examples/stormguard.toml` ([proxy](proxy.md#start)).\n\
         See https://example.com/envoy.yaml, GET /stats.json, curl 127.0.0.1:9901/stats.json; walked for .yaml and .toml files.\n\
         envoy -c envoy.yaml & # and {note}."
    ));
    assert_eq!(names, ["deploy/examples/stormguard.toml", "proxy.md", "envoy.yaml", note]);
    let root = root();
    assert!(resolves("envoy.yaml", &root.join("docs")));
    assert!(resolves("proxy.md", &root.join("docs")));
    assert!(!resolves("proxy.md", &root));
    assert!(!resolves(note, &root));
    assert!(!resolves("deploy/examples/missing.toml", &root));
}

/// The team's private design note is not part of the repository: nothing shipped (code
/// comments, docs, scenarios, scripts) may send a reader to it.
#[test]
fn nothing_points_at_the_private_design_note() {
    let needle = concat!("DESIGN", ".md");
    let root = root();
    let mut stack = vec![root.clone()];
    let mut hits = Vec::new();
    let mut files = 0;
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().to_string();
            let path = e.path();
            if e.file_type().unwrap().is_dir() {
                let skipped = name.starts_with('.') && name != ".ci"
                    || ["target", "node_modules"].contains(&name.as_str());
                if !skipped {
                    stack.push(path);
                }
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&path) else { continue };
            files += 1;
            if text.contains(needle) {
                hits.push(path.strip_prefix(&root).unwrap().display().to_string());
            }
        }
    }
    assert!(files > 100, "only {files} files read");
    assert!(hits.is_empty(), "{needle} is not in the repository, yet named in: {hits:?}");
}
