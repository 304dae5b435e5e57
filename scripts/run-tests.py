#!/usr/bin/env python3
"""Runs the workspace's tests, as scripts/test's test stage: every test binary cargo builds, and
the doc tests, then one summary.

Each crate's integration tests are one binary (tests/it). They run one binary at a time, as
`cargo test` runs them, except the proxy's, the longest by far (most of its time is spent
waiting: open loops paced on the wall clock, timeouts), which runs beside the others, three of
its tests at a time, and the CLI's review test (a minute of a scripted incident), beside them too; its adaptive-cap runs, which judge latency under a load of their own, run
last and alone, as they were calibrated; the doc tests (a compile) after the proxy's binary is done. A binary
is run as cargo runs it (from its package's directory), with libtest's `--report-time` (an
unstable option of the test harness, enabled for the test binaries alone by RUSTC_BOOTSTRAP=1
in their environment; the compiler never sees it), so the end of the run lists the slowest
tests. Each binary's whole output is kept in target/test-logs/.

Usage: scripts/run-tests.py   (from the repository's root; scripts/test calls it after the build)
Exits 0 when every test passed, 1 otherwise. Prints `N passed, N failed` last.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
LOGS = os.path.join(TARGET, "test-logs")
# Test binaries run beside the others rather than after them, by manifest directory and target
# name: with how many test threads (the proxy's tests mostly wait on the wall clock, so three
# at a time take 76 s where libtest's two a core took 118 s, and its CPU stays under the
# machine's), and the tests of theirs (a libtest filter) that run alone, last.
BESIDE = {("crates/proxy", "it"): (3, "adaptive::")}
# Tests (a libtest filter) of a binary that otherwise runs in turn, run beside the others
# instead: they wait on the wall clock for a minute (review's real Prometheus, proxy and Envoy
# through a scripted incident, twice) and would hold the binary's turn for it.
ALONGSIDE = {("crates/cli", "it"): "review::"}
SLOWEST = 10

RESULT = re.compile(r"^test result: \w+\. (\d+) passed; (\d+) failed")
TIMED = re.compile(r"^test (\S+) \.\.\. (\w+) <([0-9.]+)s>", re.M)


def binaries():
    """Every test binary of the workspace: (package, target, kind, executable, package dir), and
    the workspace's binaries by name (what `CARGO_BIN_EXE_<name>` names under cargo)."""
    build = subprocess.run(
        ["cargo", "test", "--workspace", "--locked", "--no-run", "--message-format=json-render-diagnostics"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    if build.returncode != 0:
        return None, None
    out = build.stdout
    found, bins = [], {}
    for line in out.splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") != "compiler-artifact" or not m.get("executable"):
            continue
        if not m["profile"]["test"]:
            if "bin" in m["target"]["kind"]:
                bins[m["target"]["name"]] = m["executable"]
            continue
        name = m["target"]["name"]
        kind = m["target"]["kind"][0]
        found.append((package_name(m), name, kind, m["executable"], os.path.dirname(m["manifest_path"])))
    return found, bins


def package_name(m):
    """The package's name from a cargo message (its manifest's directory names no package)."""
    pid = m["package_id"]
    # `path+file:///.../crates/proxy#stormguard-proxy@0.1.0`, or `... (path+file://...)`.
    if "#" in pid:
        tail = pid.split("#", 1)[1]
        return tail.split("@", 1)[0]
    return pid.split(" ", 1)[0]


def run(label, argv, cwd, env, results, lock):
    """Runs one binary, keeps its output, records its result; an error running it is a failure."""
    try:
        run_one(label, argv, cwd, env, results, lock)
    except Exception as e:  # noqa: BLE001 - any failure to run is a failed binary
        with lock:
            results.append((label, 1, 0, 0, 0.0, [], str(e)))
            print(f"{label}: could not be run: {e}", flush=True)


def run_one(label, argv, cwd, env, results, lock):
    os.makedirs(LOGS, exist_ok=True)
    log_path = os.path.join(LOGS, re.sub(r"[^A-Za-z0-9_.-]", "_", label) + ".log")
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.run(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    took = time.monotonic() - started
    text = open(log_path, errors="replace").read()
    passed = failed = 0
    for line in text.splitlines():
        r = RESULT.match(line)
        if r:
            passed += int(r.group(1))
            failed += int(r.group(2))
    timed = [(float(t), name, status) for name, status, t in TIMED.findall(text)]
    failures = [l for l in text.splitlines() if " FAILED" in l or "panicked" in l]
    with lock:
        results.append((label, proc.returncode, passed, failed, took, timed, log_path))
        print(f"{label}: {passed} passed, {failed} failed in {took:.1f}s (exit {proc.returncode})", flush=True)
        for l in failures[:40]:
            print("    " + l, flush=True)
        if proc.returncode != 0 and not failures:
            print("    the binary failed without a test failing: " + log_path, flush=True)
            for l in text.splitlines()[-20:]:
                print("    | " + l, flush=True)


def main():
    env = dict(os.environ)
    report = ["-Z", "unstable-options", "--report-time"]
    results, lock = [], threading.Lock()
    shutil.rmtree(LOGS, ignore_errors=True)
    found, bins = binaries()
    if found is None:
        print("the tests did not build (see above)")
        print("0 passed, 0 failed")
        return 1
    test_env = dict(env, RUSTC_BOOTSTRAP="1")
    for name, exe in bins.items():
        test_env["CARGO_BIN_EXE_" + name] = exe
    beside, after, last = [], [], []
    for package, name, kind, exe, cwd in found:
        label = f"{package} (unit)" if kind == "lib" else f"{package} {kind} {name}"
        key = (os.path.relpath(cwd, ROOT), name)
        spec = BESIDE.get(key) if kind == "test" else None
        if spec is None:
            apart = ALONGSIDE.get(key) if kind == "test" else None
            if apart:
                beside.append((f"{label} {apart}", [exe, apart] + report, cwd, test_env))
                after.append((label, [exe, "--skip", apart] + report, cwd, test_env))
            else:
                after.append((label, [exe] + report, cwd, test_env))
            continue
        threads, alone = spec
        skip = ["--skip", alone] if alone else []
        beside.append((label, [exe, "--test-threads", str(threads)] + skip + report, cwd, test_env))
        if alone:
            last.append((f"{label} {alone}", [exe, alone] + report, cwd, test_env))
    threads = [threading.Thread(target=run, args=job + (results, lock)) for job in beside]
    for t in threads:
        t.start()
    for job in after:
        run(*job, results, lock)
    for t in threads:
        t.join()
    # The doc tests: cargo builds and runs them (the unstable option is not passed to them).
    doc = ["cargo", "test", "--workspace", "--locked", "--doc", "--no-fail-fast"]
    run("doc tests", doc, ROOT, env, results, lock)
    for job in last:
        run(*job, results, lock)
    passed = sum(r[2] for r in results)
    failed = sum(r[3] for r in results)
    broken = [r for r in results if r[1] != 0]
    timed = sorted((t for r in results for t in r[5]), reverse=True)[:SLOWEST]
    print()
    print(f"the {len(timed)} slowest tests:")
    for t, name, status in timed:
        print(f"  {t:7.2f}s  {name}  ({status})")
    print()
    if broken:
        print("failed: " + ", ".join(f"{r[0]} (exit {r[1]}; {r[6]})" for r in broken))
    print(f"{passed} passed, {failed} failed")
    return 1 if broken or failed else 0


if __name__ == "__main__":
    sys.exit(main())
