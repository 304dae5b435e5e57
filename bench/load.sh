#!/usr/bin/env bash
# `stormguard load` against wrk, on the same `stormguard chaos` target (zero latency, no faults),
# in one run: alternating rounds of wrk and stormguard load with the same connection count and
# duration, and what chaos itself counted during each round (is it sustaining the rate?).
#
# Usage: bench/load.sh            (from anywhere in the repository)
# Knobs (environment): CONNECTIONS=64 DURATION=10 ROUNDS=3 THREADS=2 PORT=9477
# Prints a markdown table; timing never decides a test, so nothing here fails on a number.
set -euo pipefail
cd "$(dirname "$0")/.."

CONNECTIONS=${CONNECTIONS:-64}
DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-2}
PORT=${PORT:-9477}
URL="http://127.0.0.1:${PORT}/"

need=()
command -v wrk >/dev/null 2>&1 || need+=(wrk)
command -v curl >/dev/null 2>&1 || need+=(curl)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]}" >&2
  apt-get update >/dev/null && apt-get install -y "${need[@]}" >/dev/null
fi

cargo build --release --locked -p stormguard >&2
BIN=target/release/stormguard

"$BIN" chaos --listen "127.0.0.1:${PORT}" >/dev/null 2>target/bench-chaos.log &
CHAOS=$!
trap 'kill "$CHAOS" 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:${PORT}/stats" >/dev/null && break; sleep 0.05; done

# What chaos counted since the last reset: requests per second of its own clock.
chaos_rate() {
  curl -sf "http://127.0.0.1:${PORT}/stats" |
    python3 -c 'import json,sys; s=json.load(sys.stdin); print("%.0f" % (s["requests"]/s["seconds"]))'
}
reset() { curl -sf -X POST "http://127.0.0.1:${PORT}/stats/reset" >/dev/null; }

# Warm-up: connections, page cache, CPU frequency.
wrk -t"$THREADS" -c"$CONNECTIONS" -d2s "$URL" >/dev/null

rows=()
wrk_all=()
sg_all=()
for round in $(seq 1 "$ROUNDS"); do
  reset
  wrk_rps=$(wrk -t"$THREADS" -c"$CONNECTIONS" -d"${DURATION}s" "$URL" | awk '/^Requests\/sec:/ {printf "%.0f", $2}')
  wrk_chaos=$(chaos_rate)
  reset
  sg_json=$("$BIN" load --target "$URL" --concurrency "$CONNECTIONS" --duration "${DURATION}s" --json)
  sg_rps=$(printf '%s' "$sg_json" | python3 -c 'import json,sys; print("%.0f" % json.load(sys.stdin)["throughput_per_s"])')
  sg_p99=$(printf '%s' "$sg_json" | python3 -c 'import json,sys; print("%.2f" % json.load(sys.stdin)["latency_ms"]["p99"])')
  sg_chaos=$(chaos_rate)
  ratio=$(python3 -c "print('%.2f' % ($sg_rps / $wrk_rps))")
  rows+=("| $round | $wrk_rps | $wrk_chaos | $sg_rps | $sg_chaos | $sg_p99 | $ratio |")
  wrk_all+=("$wrk_rps")
  sg_all+=("$sg_rps")
done

median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
wrk_med=$(median "${wrk_all[@]}")
sg_med=$(median "${sg_all[@]}")

echo
echo "wrk -t${THREADS} -c${CONNECTIONS} -d${DURATION}s ${URL}"
echo "stormguard load --target ${URL} --concurrency ${CONNECTIONS} --duration ${DURATION}s --json"
echo
echo "| round | wrk req/s | chaos counted (wrk) | stormguard load req/s | chaos counted (load) | load p99 ms | load / wrk |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${rows[@]}"
echo "| median | $wrk_med | | $sg_med | | | $(python3 -c "print('%.2f' % ($sg_med / $wrk_med))") |"
