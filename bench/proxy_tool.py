#!/usr/bin/env python3
"""Helpers of bench/proxy.sh (standard library only).

  proxy_tool.py client URL RATE SECONDS TIMEOUT   open-loop load that reads response headers
  proxy_tool.py report RESULTS.jsonl [SCENARIO...]  the markdown tables from the rounds' results
                                                   (of every scenario there, or of those named)

The client exists because the storm's question is what the caller sees: which 5xx came from the
upstream (they carry chaos's `x-chaos-phase`) and which the proxy made itself, and whether the
proxy said so (`x-stormguard-denied`; Envoy's `x-envoy-overloaded`). `stormguard load` counts
statuses, not headers. Arrivals follow a fixed timetable (arrival i at start + i/RATE) and do not
wait for answers; latency is measured from each arrival's scheduled time, so a queue in the proxy
shows in the tail instead of slowing the callers. Idle keep-alive connections are reused, a new
one is opened when none is idle; a request is never resent.
"""

import asyncio
import json
import statistics
import sys
import time

MARK_HEADERS = ("x-stormguard-denied", "x-envoy-overloaded")


async def one(host, port, pool, timeout):
    """One GET; returns (status, headers) or raises."""
    reader = writer = None
    while pool:
        r, w = pool.pop()
        if not w.is_closing() and not r.at_eof():
            reader, writer = r, w
            break
        w.close()
    if writer is None:
        reader, writer = await asyncio.open_connection(host, port)

    async def exchange():
        writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: proxy-bench\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        keep = headers.get("connection", "").lower() != "close"
        if "content-length" in headers:
            await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                await reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            await reader.read()
            keep = False
        return status, headers, keep

    try:
        status, headers, keep = await asyncio.wait_for(exchange(), timeout)
    except BaseException:
        writer.close()
        raise
    if keep:
        pool.append((reader, writer))
    else:
        writer.close()
    return status, headers


async def client(url, rate, seconds, timeout):
    hostport = url.split("//", 1)[1].split("/", 1)[0]
    host, port = hostport.rsplit(":", 1)
    port = int(port)
    pool = []
    out = {
        "scheduled": 0, "statuses": {}, "timeouts": 0, "errors": 0, "latencies": [],
        "upstream_5xx": 0, "upstream_5xx_marked": 0, "local_5xx": 0, "local_5xx_marked": 0,
        "marks": {},
    }
    tasks = []

    async def run(scheduled):
        try:
            status, headers = await one(host, port, pool, timeout)
        except asyncio.TimeoutError:
            out["timeouts"] += 1
            return
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            out["errors"] += 1
            return
        out["latencies"].append((time.monotonic() - scheduled) * 1e3)
        out["statuses"][str(status)] = out["statuses"].get(str(status), 0) + 1
        mark = next((f"{h}: {headers[h]}" for h in MARK_HEADERS if h in headers), None)
        if mark:
            out["marks"][mark] = out["marks"].get(mark, 0) + 1
        if status >= 500:
            side = "upstream_5xx" if "x-chaos-phase" in headers else "local_5xx"
            out[side] += 1
            if mark:
                out[side + "_marked"] += 1

    n = int(rate * seconds)
    start = time.monotonic()
    for i in range(n):
        due = start + i / rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        out["scheduled"] += 1
        tasks.append(asyncio.ensure_future(run(due)))
    await asyncio.gather(*tasks)
    for _, w in pool:
        w.close()
    lat = sorted(out.pop("latencies"))
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None  # noqa: E731
    ok = sum(v for k, v in out["statuses"].items() if k.startswith("2"))
    out.update(
        elapsed_s=time.monotonic() - start,
        success_rate=ok / out["scheduled"] if out["scheduled"] else 0.0,
        p50_ms=q(0.50), p99_ms=q(0.99), max_ms=lat[-1] if lat else None,
    )
    return out


# ---------------------------------------------------------------------------------------------
# report

PROXIES = ["stormguard", "envoy", "haproxy", "hyper-floor"]


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, digits=1):
    if x is None:
        return "–"
    if isinstance(x, int) or float(x).is_integer() and abs(x) >= 10:
        return f"{x:.0f}"
    return f"{x:.{digits}f}"


def cell(xs, digits=1, pct=False):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    k = 100 if pct else 1
    m, lo, hi = med(xs) * k, min(xs) * k, max(xs) * k
    unit = " %" if pct else ""
    if lo == hi:
        return f"{fmt(m, digits)}{unit}"
    return f"{fmt(m, digits)}{unit} ({fmt(lo, digits)}–{fmt(hi, digits)})"


def ratio(a, b):
    if a is None or b is None or b == 0:
        return "–"
    return f"{a / b:.2f}"


SCENARIOS = ["cost", "storm", "slow", "abandon"]


def report(path, only=None):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    by = {}
    for r in rows:
        by.setdefault((r["scenario"], r["proxy"]), []).append(r)
    rounds = max((r["round"] for r in rows), default=0)
    present = [p for p in PROXIES if any(r["proxy"] == p for r in rows)]
    ran = [s for s in SCENARIOS if any(r["scenario"] == s for r in rows)]
    show = [s for s in ran if only is None or s in only]
    out = []
    w = out.append
    if "cost" in show:
        cost_table(by, rounds, present, w)
    storm = storm_table(by, present, w) if "storm" in show else {}
    slow = slow_table(by, present, w) if "slow" in show else {}
    # The storm-and-slow ratios go under the slow dependency's table, or under the storm's when
    # the slow dependency was not measured.
    if ("slow" in show or ("storm" in show and "slow" not in ran)) and "storm" in ran:
        if not storm:
            storm = storm_table(by, present, lambda _: None)
        if not slow and "slow" in ran:
            slow = slow_table(by, present, lambda _: None)
        storm_slow_ratios(storm, slow, w)
    if "abandon" in show:
        abandon_table(by, rounds, present, w)
    print("\n".join(out))


def cost_table(by, rounds, present, w):
    direct = by.get(("cost", "direct"), [])
    d50 = med([r["p50_ms"] for r in direct])
    d99 = med([r["p99_ms"] for r in direct])
    w(f"**Cost** ({rounds} round{'s' if rounds != 1 else ''}; median, min–max in brackets; added latency is over the direct "
      f"run's median, p50 {fmt(d50, 2)} ms, p99 {fmt(d99, 2)} ms, {fmt(med([r['rps'] for r in direct]), 0)} req/s):")
    w("")
    w("| proxy | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | CPU s per 100k req | of which user | peak RSS MiB |")
    w("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    w(f"| direct (nginx) | {cell([r['rps'] for r in direct], 0)} | {cell([r['p50_ms'] for r in direct], 2)} "
      f"| {cell([r['p99_ms'] for r in direct], 2)} | – | – | – | – | – |")
    cost = {}
    for p in present:
        rs = by.get(("cost", p), [])
        if not rs:
            continue
        add50 = [r["p50_ms"] - d50 for r in rs] if d50 is not None else []
        add99 = [r["p99_ms"] - d99 for r in rs] if d99 is not None else []
        cpu = [r["cpu_s_per_100k"] for r in rs]
        rss = [r["rss_mib"] for r in rs]
        cost[p] = dict(cpu=med(cpu), rss=med(rss), add99=med(add99), rps=med([r["rps"] for r in rs]))
        w(f"| {p} | {cell([r['rps'] for r in rs], 0)} | {cell([r['p50_ms'] for r in rs], 2)} "
          f"| {cell([r['p99_ms'] for r in rs], 2)} | {cell(add50, 2)} | {cell(add99, 2)} "
          f"| {cell(cpu, 2)} | {cell([r.get('user_s_per_100k') for r in rs], 2)} | {cell(rss, 1)} |")
    w("")
    if "stormguard" in cost:
        s = cost["stormguard"]
        w("| stormguard ÷ | throughput | CPU per request | peak RSS | added p99 |")
        w("| --- | --- | --- | --- | --- |")
        for p in ("envoy", "haproxy", "hyper-floor"):
            if p in cost:
                c = cost[p]
                w(f"| {p} | {ratio(s['rps'], c['rps'])} | {ratio(s['cpu'], c['cpu'])} "
                  f"| {ratio(s['rss'], c['rss'])} | {ratio(s['add99'], c['add99'])} |")
        w("")
    if "hyper-floor" in cost and "haproxy" in cost:
        f, h = cost["hyper-floor"], cost["haproxy"]
        w(f"The floor (a bare hyper forwarder, nothing of stormguard's) ÷ haproxy: CPU per request "
          f"{ratio(f['cpu'], h['cpu'])}, added p99 {ratio(f['add99'], h['add99'])}.")
        w("")


def storm_table(by, present, w):
    storm = {}
    w("**Storm** (40 % 503s at 50 ms, open loop; cap 20):")
    w("")
    w("| proxy | upstream max in flight | upstream p99 in flight | amplification (upstream attempts ÷ client requests) "
      "| client success | client p50 ms | client p99 ms | upstream's 5xx passed on | of them marked "
      "| proxy-made 5xx | of them marked | no answer (timeout, error) |")
    w("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in present:
        rs = by.get(("storm", p), [])
        if not rs:
            continue
        amp = [r["upstream_requests"] / r["scheduled"] for r in rs if r["scheduled"]]
        storm[p] = dict(max=med([r["max_in_flight"] for r in rs]), amp=med(amp),
                        succ=med([r["success_rate"] for r in rs]), p99=med([r["p99_ms"] for r in rs]))
        up = f"{cell([r['upstream_5xx'] for r in rs], 0)} | {cell([r['upstream_5xx_marked'] for r in rs], 0)}"
        loc = f"{cell([r['local_5xx'] for r in rs], 0)} | {cell([r['local_5xx_marked'] for r in rs], 0)}"
        none = f"{cell([r['timeouts'] for r in rs], 0)}, {cell([r['errors'] for r in rs], 0)}"
        w(f"| {p} | {cell([r['max_in_flight'] for r in rs], 0)} | {cell([r['p99_in_flight'] for r in rs], 0)} "
          f"| {cell(amp, 2)} | {cell([r['success_rate'] for r in rs], 1, pct=True)} "
          f"| {cell([r['p50_ms'] for r in rs], 0)} | {cell([r['p99_ms'] for r in rs], 0)} | {up} | {loc} | {none} |")
    w("")
    marks = {}
    for p in present:
        for r in by.get(("storm", p), []):
            for k, v in r.get("marks", {}).items():
                marks.setdefault(p, {}).setdefault(k, []).append(v)
    if marks:
        w("Marks the client saw (median per round): " + "; ".join(
            f"{p}: " + ", ".join(f"`{k}` {fmt(med(v), 0)}" for k, v in sorted(ms.items()))
            for p, ms in marks.items()) + ".")
        w("")
    return storm


def slow_table(by, present, w):
    slow = {}
    w("**Slow dependency** (latency 50 → 400 ms in 8 steps, per-try timeout 300 ms; cap 20):")
    w("")
    w("| proxy | upstream max in flight | upstream p99 in flight | amplification | client success | client p50 ms | client p99 ms |")
    w("| --- | --- | --- | --- | --- | --- | --- |")
    for p in present:
        rs = by.get(("slow", p), [])
        if not rs:
            continue
        amp = [r["upstream_requests"] / r["scheduled"] for r in rs if r["scheduled"]]
        slow[p] = dict(max=med([r["max_in_flight"] for r in rs]))
        w(f"| {p} | {cell([r['max_in_flight'] for r in rs], 0)} | {cell([r['p99_in_flight'] for r in rs], 0)} "
          f"| {cell(amp, 2)} | {cell([r['success_rate'] for r in rs], 1, pct=True)} "
          f"| {cell([r['p50_ms'] for r in rs], 0)} | {cell([r['p99_ms'] for r in rs], 0)} |")
    w("")
    return slow


def storm_slow_ratios(storm, slow, w):
    if "stormguard" in storm:
        w("| stormguard ÷ | storm upstream max in flight | storm amplification | storm client p99 | slow upstream max in flight |")
        w("| --- | --- | --- | --- | --- |")
        for p in ("envoy", "haproxy"):
            if p in storm:
                s, c = storm["stormguard"], storm[p]
                w(f"| {p} | {ratio(s['max'], c['max'])} | {ratio(s['amp'], c['amp'])} | {ratio(s['p99'], c['p99'])} "
                  f"| {ratio(slow.get('stormguard', {}).get('max'), slow.get(p, {}).get('max'))} |")
        w("")


def abandon_table(by, rounds, present, w):
    w("**Callers that give up before the dependency answers** (chaos answers every request in 700 ms "
      "and works on after its client leaves; callers arrive open loop and give up at 500 ms, dropping "
      "the connection; per-try timeout 1 s, so only the caller ends an attempt early; cap 20; "
      f"{rounds} round{'s' if rounds != 1 else ''}, median, min–max in brackets):")
    w("")
    w("| proxy | upstream max in flight (cap 20) | per round | upstream p99 in flight | upstream requests "
      "| of them left by the proxy before the answer | callers | callers answered (any status) "
      "| callers that gave up at 500 ms | other (reset, connect error, dropped) |")
    w("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in present:
        rs = sorted(by.get(("abandon", p), []), key=lambda r: r["round"])
        if not rs:
            continue
        per_round = ", ".join(fmt(r["max_in_flight"], 0) for r in rs)
        other = [None if r["resets"] is None else r["resets"] + r["connect_errors"] + r["dropped"] + r["body_errors"]
                 for r in rs]
        w(f"| {p} | {cell([r['max_in_flight'] for r in rs], 0)} | {per_round} "
          f"| {cell([r['p99_in_flight'] for r in rs], 0)} | {cell([r['upstream_requests'] for r in rs], 0)} "
          f"| {cell([r['upstream_left'] for r in rs], 0)} | {cell([r['scheduled'] for r in rs], 0)} "
          f"| {cell([r['answered'] for r in rs], 0)} | {cell([r['timeouts'] for r in rs], 0)} | {cell(other, 0)} |")
    w("")
    answers = {}
    for p in present:
        for r in by.get(("abandon", p), []):
            for k, v in (r.get("statuses") or {}).items():
                answers.setdefault(p, {}).setdefault(k, []).append(v)
    if answers:
        w("Answers the callers got (median per round): " + "; ".join(
            f"{p}: " + ", ".join(f"{k} {fmt(med(v), 0)}" for k, v in sorted(st.items()))
            for p, st in answers.items()) + ".")
        w("")


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "client" and len(sys.argv) == 6:
        url, rate, seconds, timeout = sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
        print(json.dumps(asyncio.run(client(url, rate, seconds, timeout))))
    elif len(sys.argv) >= 3 and sys.argv[1] == "report":
        report(sys.argv[2], sys.argv[3:] or None)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
