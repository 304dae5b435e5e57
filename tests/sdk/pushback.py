"""Downstream pushback, judged by real callers: the official OpenAI and Anthropic Python SDKs,
pointed at `stormguard proxy` (their `base_url`) in front of an upstream that answers every
request with 503.

With `downstream_pushback` on (the default), stormguard's refusal carries `x-should-retry:
false` and each SDK call reaches the proxy once; with it off, the SDK's own loop (two retries
by default) sends the same call three times — and the proxy takes the resends for the SDK's
retries: charged to the budget, sent once each, not retried on top (5 attempts at the
upstream, not 9). Counted at the proxy (its `/metrics`,
`stormguard_route_requests`) and at the upstream (exactly, in this process).

And a refusal for the provider's window is a rate limit to the SDK: with `provider = "openai"`
(or `"anthropic"`) and one request a minute, the second call is refused by stormguard as a 429
in the provider's own shape, and the SDK raises its rate-limit error (`RateLimitError`), not a
server error, without retrying it.

Usage: python tests/sdk/pushback.py PATH/TO/stormguard
Talks only to 127.0.0.1 on ephemeral ports; every process it starts is stopped on exit.
"""

import http.server
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import anthropic
import openai

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/debug/stormguard"


class Upstream(http.server.ThreadingHTTPServer):
    """Answers 503 to everything, counting requests exactly."""

    daemon_threads = True

    def __init__(self, ok=False):
        self.count = 0
        self.lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(h):  # noqa: N805
                length = int(h.headers.get("content-length") or 0)
                h.rfile.read(length)
                with self.lock:
                    self.count += 1
                if ok:
                    # An answer both SDKs read: a chat completion and a message, in one object.
                    body = (
                        b'{"id": "x", "object": "chat.completion", "created": 0, "model": "m",'
                        b' "choices": [], "type": "message", "role": "assistant", "content": [],'
                        b' "stop_reason": "end_turn", "usage": {"input_tokens": 1,'
                        b' "output_tokens": 1, "prompt_tokens": 1, "completion_tokens": 1,'
                        b' "total_tokens": 2}}'
                    )
                    h.send_response(200)
                    h.send_header("content-type", "application/json")
                    h.send_header("content-length", str(len(body)))
                    h.end_headers()
                    h.wfile.write(body)
                    return
                body = b'{"error": {"message": "overloaded", "type": "overloaded_error"}}'
                h.send_response(503)
                h.send_header("content-type", "application/json")
                h.send_header("content-length", str(len(body)))
                h.end_headers()
                h.wfile.write(body)

            do_GET = do_POST

            def log_message(h, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def take(self):
        with self.lock:
            n, self.count = self.count, 0
        return n


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    """`stormguard proxy --config` with one listener, its own admin port, every default but
    the route: an LLM API's calls are POSTs the SDKs treat as safe to resend, so the route says
    so (`idempotent = true`) and stormguard retries them within its budget too."""

    def __init__(self, upstream_port, pushback, extra=""):
        self.port, self.admin = free_port(), free_port()
        self.dir = tempfile.mkdtemp(prefix="stormguard-sdk-")
        path = os.path.join(self.dir, "proxy.toml")
        with open(path, "w") as f:
            f.write(
                f'admin = "127.0.0.1:{self.admin}"\n'
                f'[[listener]]\nlisten = "127.0.0.1:{self.port}"\ndependency = "llm"\n'
                f"downstream_pushback = {'true' if pushback else 'false'}\n"
                f'[[dependency]]\nname = "llm"\nupstreams = ["http://127.0.0.1:{upstream_port}"]\n'
                f"{extra}"
                f'[[route]]\npath_prefix = "/"\ndependency = "llm"\nidempotent = true\n'
            )
        self.proc = subprocess.Popen(
            [BIN, "proxy", "--config", path], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/healthz", timeout=1).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the proxy did not start: {self.proc.stderr.read()!r}")
                time.sleep(0.05)

    def requests(self):
        """Requests the proxy received, from its own per-route series."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/metrics", timeout=5).read()
        total = 0.0
        for line in text.decode().splitlines():
            if line.startswith("stormguard_route_requests_total{"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def call_openai(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="test", timeout=20)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def call_anthropic(base):
    client = anthropic.Anthropic(base_url=base, api_key="test", timeout=20)
    client.messages.create(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    )


def main():
    upstream = Upstream()
    failures = []
    for pushback, expected in [(True, 1), (False, 3)]:
        proxy = Proxy(upstream.server_address[1], pushback)
        try:
            for name, call, error in [
                ("openai", call_openai, openai.APIStatusError),
                ("anthropic", call_anthropic, anthropic.APIStatusError),
            ]:
                before = proxy.requests()
                upstream.take()
                started = time.monotonic()
                try:
                    call(f"http://127.0.0.1:{proxy.port}")
                    failures.append(f"{name}: the call succeeded against a 503 upstream")
                    continue
                except error as e:
                    status = e.status_code
                sent = proxy.requests() - before
                attempts = upstream.take()
                took = time.monotonic() - started
                print(
                    f"{name:9} downstream_pushback={str(pushback).lower():5} status={status} "
                    f"calls at the proxy={sent} attempts at the upstream={attempts} ({took:.1f}s)"
                )
                if sent != expected:
                    failures.append(
                        f"{name}, downstream_pushback={pushback}: the SDK sent {sent} "
                        f"request(s) to the proxy, expected {expected}"
                    )
                # stormguard's own retries, within its budget: the first try and max_retries
                # (2) retries; the SDK's own resends are its retries (the same request after a
                # failure), charged to the budget and not retried again by stormguard: once
                # each (docs/proxy.md, "Callers' own retries").
                if attempts != 3 + (sent - 1):
                    failures.append(
                        f"{name}: {attempts} attempts at the upstream for {sent} call(s), "
                        f"expected 3 for the first and 1 for each of the SDK's resends"
                    )
        finally:
            proxy.stop()
    upstream.shutdown()
    failures += rate_limits()
    if failures:
        print("\n".join(failures), file=sys.stderr)
        sys.exit(1)
    print("every SDK call stood down at stormguard's refusal, and retried without it")


def rate_limits():
    """One request a minute under each provider's preset: the second call is stormguard's 429,
    and the SDK raises its rate-limit error without retrying."""
    upstream = Upstream(ok=True)
    failures = []
    for name, call, error in [
        ("openai", call_openai, openai.RateLimitError),
        ("anthropic", call_anthropic, anthropic.RateLimitError),
    ]:
        extra = f'provider = "{name}"\nrequests_per_minute = 1\nqueue_timeout = "50ms"\n'
        proxy = Proxy(upstream.server_address[1], True, extra)
        try:
            base = f"http://127.0.0.1:{proxy.port}"
            call(base)
            before = proxy.requests()
            try:
                call(base)
                failures.append(f"{name}: the second call in the minute succeeded")
                continue
            except error as e:
                sent = proxy.requests() - before
                print(
                    f"{name:9} rate limited: {type(e).__name__} status={e.status_code} "
                    f"calls at the proxy={sent} attempts at the upstream={upstream.take()}"
                )
                if sent != 1:
                    failures.append(f"{name}: the SDK sent the refused call {sent} times")
            except Exception as e:  # noqa: BLE001 - the wrong class is the failure
                failures.append(f"{name}: the SDK raised {type(e).__name__}, not {error.__name__}")
        finally:
            proxy.stop()
    upstream.shutdown()
    return failures


if __name__ == "__main__":
    main()
