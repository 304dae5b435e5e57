"""Real retrying callers through `stormguard proxy`, counted at the upstream.

Five callers, each with its own retry loop: python-requests over urllib3's `Retry`, a plain
hand-written loop (`http.client`, 3 retries on 503, 10 ms apart), Node's `got` with its default
retries (tests/callers/got-caller.mjs), the `openai` SDK (`max_retries=3`) and grpcio with a
retry policy in its service config. Each makes N calls against an upstream that fails 40 % of
them — `stormguard chaos` for HTTP, a grpcio server of this file for gRPC — three times:
straight at the upstream, through the proxy with its caller retries enforced (the default),
and through it with `--caller-retries off`.

What is counted is what reached the upstream, exactly (chaos's `/stats`, or this process's
counter for gRPC): retries_seen = requests at the upstream - N, the attempts beyond one a call,
the proxy's own retries and the callers' together. A first try the proxy refused never arrives
(then retries_seen is the retries less those first tries, and negative when they outnumber the
retries); the proxy's own count of what it refused is printed beside it (its /metrics).

The bound is the ratio budget's own (crates/core/src/budget/ratio.rs, docs/budgets.md), for
`ratio:percent=0.25,min_per_sec=3,ttl=1s` and a fresh proxy per run. Within any window of its
ttl (ten slices of ttl / 10) the retries granted are at most
floor(min_per_sec x ttl + percent x first tries in it): the reserve min_per_sec x ttl is a burst
a window may spend at once. A run that touches S slices holds k = ceil(S / 10) disjoint windows
that cover every retry (the last retry's window, then the last retry before it, and so on), each
first try in at most one of them, so over the run
    retries <= floor(min_per_sec x ttl x k + percent x N) = floor(3 k + 0.25 N),
with S = ceil(seconds / 0.1) + 1: about 0.25 N + 3 (seconds + 1). The ttl is 1 s, not the
default 10 s, so that the reserve is 3 a second rather than a burst of 30 at the start, and a
budget refusal's Retry-After, when it gives one (the time until a retry fits again), is at most
1 s: urllib3 and got sleep whatever it says, with no cap, before trying again.

- without the proxy, every caller's own loop multiplies the load: retries_seen > bound;
- through the proxy, caller retries enforced: retries_seen <= bound, and retries_seen >= 0:
  every call's first try reached the upstream (no first try taken for a retry and refused;
  at most 100 at once, the cap of 20 and the queue of 100 shed none);
- through the proxy, caller retries off (every request a first try, as before
  `--caller-retries`): retries_seen > bound.

Before that, one call per caller against a recorder that fails its first request: the headers
of the first try and of the retry, and whether the retry came on the same connection, printed
for whoever teaches the proxy to tell a caller's retry from a first try.

Usage: python tests/callers/callers.py PATH/TO/stormguard [--identical]
(--identical: every call of a caller is the same request, as many users' polls of one resource
from one host are; not what the test suite runs.)
Talks only to 127.0.0.1 on ephemeral ports; every process it starts is stopped on exit.
Exit 0 when every assertion holds, 1 naming each one that did not.
"""

import concurrent.futures
import http.client
import http.server
import json
import math
import os
import queue
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import grpc
import openai
import requests
import requests.adapters
import urllib3.util

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
BIN = os.path.abspath(ARGS[0] if ARGS else "target/debug/stormguard")
HERE = os.path.dirname(os.path.abspath(__file__))

ERROR_RATE = 0.4
CAP = 20
PERCENT, MIN_PER_SEC, TTL = 0.25, 3, 1  # the budget (ttl in seconds)
BUDGET = f"ratio:percent={PERCENT},min_per_sec={MIN_PER_SEC},ttl={TTL}s"

# Per caller: N calls, with this many at once. N is large enough that the callers' own loops
# clear the bound with room (the budget's reserve is 3 a second of the run); the concurrency
# keeps a run short when the proxy's refusals carry `Retry-After: 1` (urllib3 and got sleep it,
# up to 3 and 2 times a call) and while got backs off 1 s then 2 s by default.
CALLERS = {
    "urllib3": (300, 100),
    "loop": (300, 10),
    "got": (300, 100),
    "openai": (200, 100),
    "grpcio": (300, 10),
}


def caller_retries_flag_supported():
    out = subprocess.run([BIN, "proxy", "--help"], capture_output=True, text=True, timeout=30)
    return "--caller-retries" in out.stdout


CALLER_RETRIES_FLAG_SUPPORTED = caller_retries_flag_supported()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def budget_bound(n, seconds):
    """The most retries the budget grants to n first tries over a run of `seconds`."""
    slices = math.ceil(seconds * 10 / TTL) + 1  # slices of ttl / 10 the run can touch
    windows = math.ceil(slices / 10)
    return math.floor(MIN_PER_SEC * TTL * windows + PERCENT * n)


# ---------------------------------------------------------------------------------------------
# Processes


class Process:
    """A child process whose stderr is drained by a thread (kept for a failure's message)."""

    started = []

    def __init__(self, args, cwd=None):
        self.args = args
        self.lines = queue.Queue()
        self.stderr = []
        self.proc = subprocess.Popen(
            args, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        Process.started.append(self)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stderr:
            if len(self.stderr) < 200:
                self.stderr.append(line)
            self.lines.put(line)

    def wait_line(self, pattern, timeout=20):
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit(f"{self.args[:2]} printed no {pattern!r}: {self.tail()}")
            m = re.search(pattern, line)
            if m:
                return m

    def tail(self):
        return "".join(self.stderr[-20:]) or "(nothing on stderr)"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self in Process.started:
            Process.started.remove(self)

    @classmethod
    def stop_all(cls):
        for p in list(cls.started):
            p.stop()


class Chaos:
    def __init__(self, *extra):
        self.p = Process(
            [BIN, "chaos", "--listen", "127.0.0.1:0", "--error-rate", str(ERROR_RATE),
             "--status", "503", "--seed", "1", *extra]
        )
        self.port = int(self.p.wait_line(r"listening on http://127\.0\.0\.1:(\d+)").group(1))

    def requests(self):
        """Every request that reached it, exactly."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/stats", timeout=5) as r:
            s = json.load(r)
        s = s.get("total", s)  # the counts are at the top of /stats
        return s["requests"]


def wait_healthz(proc, admin):
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{admin}/healthz", timeout=1).read()
            return
        except OSError:
            if proc.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the proxy did not start ({proc.args}): {proc.tail()}")
            time.sleep(0.02)


def proxy_counts(admin):
    """What the proxy says it did, from its /metrics: its caller-retry decisions
    (stormguard_caller_retries_total) and its refusals by reason (stormguard_denied_total)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5).read()
    except OSError as e:
        return f"(no /metrics: {e})"
    out = {}
    series = re.compile(
        r'stormguard_(caller_retries|denied)_total\{.*(?:outcome|reason)="([^"]+)".*\} (\S+)'
    )
    for line in text.decode().splitlines():
        m = series.match(line)
        if m and float(m.group(3)):
            key = ("caller " if m.group(1) == "caller_retries" else "denied ") + m.group(2)
            out[key] = out.get(key, 0) + int(float(m.group(3)))
    return ", ".join(f"{k}={v}" for k, v in sorted(out.items())) or "nothing"


def proxy_args(mode):
    """The flags saying how the proxy treats its callers' retries: none for the default
    (enforce), `--caller-retries off` for off when the binary has the flag (a binary from
    before it has no such flag, and every request is a first try to it: off)."""
    if mode == "off" and CALLER_RETRIES_FLAG_SUPPORTED:
        return ["--caller-retries", "off"]
    return []


class Proxy:
    """`stormguard proxy` from flags, in front of an HTTP upstream."""

    def __init__(self, upstream_port, mode):
        self.port, self.admin = free_port(), free_port()
        admin = self.admin
        self.p = Process(
            [BIN, "proxy", "--listen", f"127.0.0.1:{self.port}",
             "--upstream", f"http://127.0.0.1:{upstream_port}", "--cap", str(CAP),
             "--budget", BUDGET, "--admin", f"127.0.0.1:{admin}", *proxy_args(mode)]
        )
        wait_healthz(self.p, admin)

    def stop(self):
        self.p.stop()


class GrpcProxy:
    """`stormguard proxy --grpc` in front of the gRPC upstream: h2c by prior knowledge, gRPC's
    UNAVAILABLE in `retry_on`. No method is named idempotent, so stormguard resends none that
    may have run, and every retry is the client's own (with `--idempotent /test.Echo/` the
    proxy's own retries would spend the budget and their refusals' pushback stop the client's
    policy, with or without caller retries: example_grpc shows the idempotent route)."""

    def __init__(self, upstream_port, mode):
        self.port, self.admin = free_port(), free_port()
        admin = self.admin
        self.p = Process(
            [BIN, "proxy", "--listen", f"127.0.0.1:{self.port}",
             "--upstream", f"http://127.0.0.1:{upstream_port}", "--grpc",
             "--cap", str(CAP), "--budget", BUDGET,
             "--admin", f"127.0.0.1:{admin}", *proxy_args(mode)]
        )
        wait_healthz(self.p, admin)

    def stop(self):
        self.p.stop()


# ---------------------------------------------------------------------------------------------
# Upstreams of this process: the gRPC one, and the recorder of a retry's headers


class GrpcUpstream:
    """Every unary method (`/test.Echo/Call`, `/shop.Catalog/Get`, ...) echoing its bytes; fails
    `error_rate` of the calls with UNAVAILABLE (a seeded draw), or only the first call with
    `fail_first`, or each named method's first call with `first_fails`. Counts every call, and
    each method's."""

    def __init__(self, error_rate=ERROR_RATE, seed=1, fail_first=False, first_fails=()):
        self.rng = random.Random(seed)
        self.error_rate, self.fail_first = error_rate, fail_first
        self.lock = threading.Lock()
        self.count = 0
        self.by_method = {}
        self.seen = []  # (metadata, peer) of each call, with fail_first
        upstream = self

        def call(request, context, method):
            with self.lock:
                self.count += 1
                self.by_method[method] = self.by_method.get(method, 0) + 1
                if first_fails:
                    fail = method in first_fails and self.by_method[method] == 1
                elif self.fail_first:
                    fail = self.count == 1
                    self.seen.append((list(context.invocation_metadata()), context.peer()))
                else:
                    fail = self.rng.random() < self.error_rate
            if fail:
                context.abort(grpc.StatusCode.UNAVAILABLE, "injected error")
            return request

        class AnyMethod(grpc.GenericRpcHandler):
            def service(self, details):
                return grpc.unary_unary_rpc_method_handler(
                    lambda request, context: call(request, context, details.method))

        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=32)
        self.server = grpc.server(self.pool)
        self.server.add_generic_rpc_handlers((AnyMethod(),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def requests(self):
        with self.lock:
            return self.count

    def calls_of(self, method):
        with self.lock:
            return self.by_method.get(method, 0)

    def stop(self):
        self.server.stop(grace=None).wait(5)
        self.pool.shutdown(wait=False)


OPENAI_BODY = (
    b'{"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [{"index": 0,'
    b' "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],'
    b' "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}'
)


class Recorder(http.server.ThreadingHTTPServer):
    """Answers its first request 503, every later one 200, keeping each request's headers and
    the caller's port (the same port: the same connection)."""

    daemon_threads = True

    def __init__(self):
        self.seen = []
        self.lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(h):  # noqa: N805
                h.rfile.read(int(h.headers.get("content-length") or 0))
                with self.lock:
                    self.seen.append((list(h.headers.items()), h.client_address[1]))
                    first = len(self.seen) == 1
                body = b'{"error": {"message": "injected error"}}' if first else OPENAI_BODY
                h.send_response(503 if first else 200)
                h.send_header("content-type", "application/json")
                h.send_header("content-length", str(len(body)))
                h.end_headers()
                h.wfile.write(body)

            do_POST = do_GET

            def log_message(h, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def stop(self):
        self.shutdown()
        self.server_close()


# ---------------------------------------------------------------------------------------------
# The callers. Each makes n calls, `threads` at once, and returns how many succeeded and how
# each failure ended ("503", "503 denied=budget" when stormguard refused it, an exception's
# name). Call i asks for `?call=i` (a gRPC or OpenAI call: "call i" in its body), so that two
# calls are two different requests and only a call's own retries repeat it; with --identical,
# every call is the same request.

IDENTICAL = "--identical" in sys.argv[1:]


def tag(i):
    return "same" if IDENTICAL else str(i)


def failure(status, headers):
    denied = headers.get("x-stormguard-denied")
    return f"{status} denied={denied}" if denied else str(status)


def run_threads(n, threads, make, call):
    """n calls over `threads` workers, each with its own state from make(); call(state, i)
    returns None for a success, else how it failed."""
    lock = threading.Lock()
    left = [n]
    tally = {"succeeded": 0, "failed": 0, "errors": {}}

    def worker():
        state = make()
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
                i = n - left[0] - 1
            try:
                err = call(state, i)
            except Exception as e:  # noqa: BLE001 - every way a call fails is a failed call
                err = type(e).__name__
            with lock:
                tally["failed" if err else "succeeded"] += 1
                if err:
                    tally["errors"][err] = tally["errors"].get(err, 0) + 1

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(worker) for _ in range(min(threads, n))]:
            f.result()
    return tally


def urllib3_caller(base, n, threads):
    def make():
        s = requests.Session()
        # raise_on_status=False: when the retries run out, the last answer is returned rather
        # than raised (what is retried, and when, is the same).
        retry = urllib3.util.Retry(
            total=3, status_forcelist=[503], backoff_factor=0.01, allowed_methods=None,
            raise_on_status=False,
        )
        s.mount("http://", requests.adapters.HTTPAdapter(max_retries=retry))
        return s

    def call(s, i):
        r = s.get(f"{base}/urllib3?call={tag(i)}", timeout=20)
        return None if r.status_code == 200 else failure(r.status_code, r.headers)

    return run_threads(n, threads, make, call)


def loop_caller(base, n, threads):
    host, port = base.removeprefix("http://").split(":")

    def make():
        return [http.client.HTTPConnection(host, int(port), timeout=20)]

    def call(conn, i):
        err = None
        for attempt in range(4):  # the first try and up to 3 retries
            if attempt:
                time.sleep(0.01)
            try:
                conn[0].request("GET", f"/loop?call={tag(i)}")
                r = conn[0].getresponse()
                r.read()
            except (OSError, http.client.HTTPException) as e:
                conn[0].close()
                conn[0] = http.client.HTTPConnection(host, int(port), timeout=20)
                err = type(e).__name__
                continue
            if r.status != 503:
                return None if r.status == 200 else failure(r.status, r.headers)
            err = failure(r.status, r.headers)
        return err

    return run_threads(n, threads, make, call)


def got_caller(base, n, threads):
    out = subprocess.run(
        ["node", os.path.join(HERE, "got-caller.mjs"), f"{base}/got", str(n), str(threads),
         *(["--identical"] if IDENTICAL else [])],
        capture_output=True, text=True, timeout=90,
    )
    if out.returncode != 0:
        raise SystemExit(f"got-caller.mjs failed ({out.returncode}): {out.stderr.strip()}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if r["calls"] != n:
        raise SystemExit(f"got-caller.mjs made {r['calls']} calls, not {n}")
    return {"succeeded": r["succeeded"], "failed": r["failed"], "errors": r["failures"]}


def openai_caller(base, n, threads):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="test", max_retries=3, timeout=20)

    def call(_, i):
        try:
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"call {tag(i)}"}]
            )
            return None
        except openai.APIStatusError as e:
            return failure(e.status_code, e.response.headers)
        except openai.APIConnectionError as e:
            return type(e).__name__

    try:
        return run_threads(n, threads, lambda: None, call)
    finally:
        client.close()


GRPC_SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": "test.Echo"}],
        "retryPolicy": {
            "maxAttempts": 4,
            "initialBackoff": "0.01s",
            "maxBackoff": "0.1s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }]
})


def grpc_caller(base, n, threads):
    channel = grpc.insecure_channel(
        base.removeprefix("http://"),
        options=[("grpc.enable_retries", 1), ("grpc.service_config", GRPC_SERVICE_CONFIG)],
    )
    method = channel.unary_unary("/test.Echo/Call")

    def call(_, i):
        payload = f"call {tag(i)}".encode()
        try:
            return None if method(payload, timeout=20) == payload else "wrong answer"
        except grpc.RpcError as e:
            metadata = dict(e.initial_metadata() or ()) | dict(e.trailing_metadata() or ())
            return failure(e.code().name, metadata)

    try:
        return run_threads(n, threads, lambda: None, call)
    finally:
        channel.close()


RUN = {
    "urllib3": urllib3_caller,
    "loop": loop_caller,
    "got": got_caller,
    "openai": openai_caller,
    "grpcio": grpc_caller,
}


# ---------------------------------------------------------------------------------------------
# What each caller sends on a retry


def retry_headers():
    """One call per caller, in parallel, against a recorder failing its first request."""
    recorders = {name: Recorder() for name in ("urllib3", "loop", "got", "openai")}
    grpc_up = GrpcUpstream(fail_first=True)
    try:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(RUN[name], f"http://127.0.0.1:{r.port}", 1, 1)
                       for name, r in recorders.items()]
            futures.append(pool.submit(grpc_caller, f"http://127.0.0.1:{grpc_up.port}", 1, 1))
            for f in futures:
                f.result()
        seen = {name: r.seen for name, r in recorders.items()}
        seen["grpcio"] = [(md, peer) for md, peer in grpc_up.seen]
    finally:
        for r in recorders.values():
            r.stop()
        grpc_up.stop()

    print("what each caller sends on a retry (one call against an upstream failing the first):")
    for name, requests_seen in seen.items():
        if len(requests_seen) < 2:
            print(f"  {name:8} made {len(requests_seen)} request(s): no retry to show")
            continue
        (first, conn1), (retry, conn2) = requests_seen[0], requests_seen[1]
        first_d = {k.lower(): v for k, v in first}
        changed = [f"{k}: {first_d.get(k.lower(), '(absent)')} -> {v}"
                   for k, v in retry if first_d.get(k.lower()) != v]
        same = "same connection" if conn1 == conn2 else f"new connection ({conn1} -> {conn2})"
        print(f"  {name:8} {same}; on the retry: "
              + "; ".join(f"{k}: {v}" for k, v in retry))
        print(f"  {'':8} changed from the first try: {', '.join(changed) or 'nothing'}")


# ---------------------------------------------------------------------------------------------


def measure(name, n, threads, upstream_port, count, proxy_cls, mode):
    """One run: n calls, straight at the upstream (mode None) or through a fresh proxy."""
    proxy = proxy_cls(upstream_port, mode) if mode else None
    try:
        port = proxy.port if proxy else upstream_port
        before = count()
        started = time.monotonic()
        tally = RUN[name](f"http://127.0.0.1:{port}", n, threads)
        seconds = time.monotonic() - started
        at_proxy = proxy_counts(proxy.admin) if proxy else None
    finally:
        if proxy:
            proxy.stop()  # drained: every attempt it started has reached the upstream
    requests_seen = count() - before
    retries = requests_seen - n
    where = f"through ({mode})" if mode else "without"
    print(f"  {name:8} {where:18} calls={n} ok={tally['succeeded']} failed={tally['failed']} "
          f"upstream requests={requests_seen} retries_seen={retries} "
          f"({requests_seen / n:.2f} attempts/call) {seconds:.1f}s"
          + (f" errors={tally['errors']}" if tally["errors"] else ""))
    if at_proxy:
        print(f"  {'':8} {'':18} at the proxy: {at_proxy}")
    return {"retries": retries, "attempts": requests_seen / n, "seconds": seconds,
            "failed": tally["failed"],
            "bound": budget_bound(n, seconds)}


def example_grpc():
    """deploy/examples/grpc.toml, its addresses moved to free ports, in front of a gRPC upstream
    that fails each method's first call with UNAVAILABLE, driven by grpcio with its own retries
    off: a call to an idempotent route (`/shop.Catalog/`) is retried by the proxy and succeeds
    (two calls at the upstream); `/shop.Orders/PlaceOrder` is not (one call, UNAVAILABLE, the
    refusal named `non-idempotent`). Returns the failures."""
    failures = []
    read, order = "/shop.Catalog/Get", "/shop.Orders/PlaceOrder"
    upstream = GrpcUpstream(first_fails={read, order})
    port, admin = free_port(), free_port()
    example = os.path.join(os.path.dirname(os.path.dirname(HERE)), "deploy/examples/grpc.toml")
    with open(example) as f:
        text = f.read()
    text = text.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
    text = text.replace("127.0.0.1:50051", f"127.0.0.1:{upstream.port}")
    d = tempfile.mkdtemp(prefix="stormguard-callers-")
    path = os.path.join(d, "grpc.toml")
    with open(path, "w") as f:
        f.write(f'admin = "127.0.0.1:{admin}"\n' + text)
    p = Process([BIN, "proxy", "--config", path])
    try:
        wait_healthz(p, admin)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.enable_retries", 0)])

        def outcome(method):
            try:
                channel.unary_unary(method)(b"x", timeout=10)
                return "OK", {}
            except grpc.RpcError as e:
                return e.code().name, dict(e.trailing_metadata() or ())

        (got_read, _), (got_order, meta) = outcome(read), outcome(order)
        reads, orders = upstream.calls_of(read), upstream.calls_of(order)
        refusal = meta.get("x-stormguard-denied", "no refusal named")
        print(f"deploy/examples/grpc.toml: {read} {got_read} after {reads} call(s) at the "
              f"upstream; {order} {got_order} after {orders} ({refusal})")
        if (got_read, reads) != ("OK", 2):
            failures.append(f"grpc.toml: an idempotent method failing once should be retried "
                            f"and answer OK; got {got_read} after {reads} call(s)")
        if (got_order, orders, refusal) != ("UNAVAILABLE", 1, "non-idempotent"):
            failures.append(f"grpc.toml: {order} should be sent once, fail UNAVAILABLE and name "
                            f"non-idempotent; got {got_order} after {orders} call(s), {refusal}")
    finally:
        p.stop()
        upstream.stop()
        shutil.rmtree(d, ignore_errors=True)
    return failures


def main():
    failures = []
    print(f"caller retries flag (--caller-retries) in this binary: "
          f"{'yes' if CALLER_RETRIES_FLAG_SUPPORTED else 'no (the off run passes no flag)'}")
    if not os.path.exists(os.path.join(HERE, "node_modules", "got", "package.json")):
        raise SystemExit("got is not installed: run `npm ci` in tests/callers")
    all_started = time.monotonic()
    retry_headers()
    print(f"  ({time.monotonic() - all_started:.1f}s)")
    failures += example_grpc()

    chaos = Chaos()
    chaos_openai = Chaos("--provider", "openai")
    grpc_up = GrpcUpstream()
    rows = []
    try:
        for name, (n, threads) in CALLERS.items():
            started = time.monotonic()
            if name == "grpcio":
                upstream, count, proxy_cls = grpc_up.port, grpc_up.requests, GrpcProxy
            else:
                c = chaos_openai if name == "openai" else chaos
                upstream, count, proxy_cls = c.port, c.requests, Proxy
            print(f"{name}: {n} calls, {threads} at once")
            runs = {mode: measure(name, n, threads, upstream, count, proxy_cls, mode)
                    for mode in (None, "enforce", "off")}
            print(f"  {name:8} took {time.monotonic() - started:.1f}s")
            rows.append((name, n, runs))
            without, enforce, off = runs[None], runs["enforce"], runs["off"]
            if not without["retries"] > without["bound"]:
                failures.append(
                    f"{name}: without the proxy only {without['retries']} retries for {n} calls, "
                    f"not above the bound {without['bound']}: the caller's loop shows no storm"
                )
            if not enforce["retries"] <= enforce["bound"]:
                failures.append(
                    f"{name}: through the proxy (caller retries enforced) {enforce['retries']} "
                    f"retries reached the upstream for {n} calls in {enforce['seconds']:.1f}s, "
                    f"above the budget's bound {enforce['bound']}"
                )
            if enforce["retries"] < 0:
                failures.append(
                    f"{name}: through the proxy (caller retries enforced) only "
                    f"{n + enforce['retries']} requests reached the upstream for {n} calls: at "
                    f"least {-enforce['retries']} first tries were refused as if retries "
                    f"({enforce['failed']} calls failed)"
                )
            if not off["retries"] > off["bound"]:
                failures.append(
                    f"{name}: through the proxy with caller retries off, {off['retries']} retries "
                    f"for {n} calls, not above the bound {off['bound']}: the caller's retries "
                    f"should pass as first tries"
                )
    finally:
        chaos.p.stop()
        chaos_openai.p.stop()
        grpc_up.stop()

    print()
    print("attempts per call at the upstream (retries_seen, seconds); the bound is on retries_seen")
    print(f"{'caller':8} | {'without':23} | {'through (enforce)':23} | {'through (off)':23} | "
          f"bound (enforce)")
    for name, n, runs in rows:
        cells = [f"{r['attempts']:.2f} ({r['retries']}, {r['seconds']:.1f}s)"
                 for r in (runs[None], runs["enforce"], runs["off"])]
        print(f"{name:8} | {cells[0]:23} | {cells[1]:23} | {cells[2]:23} | "
              f"{runs['enforce']['bound']} (N={n})")
    print(f"all callers: {time.monotonic() - all_started:.1f}s")
    if failures:
        print("\n".join(failures), file=sys.stderr)
        sys.exit(1)
    print("every caller's own loop stormed without the proxy and with caller retries off, "
          "and stayed within the budget through it")


if __name__ == "__main__":
    try:
        main()
    finally:
        Process.stop_all()
