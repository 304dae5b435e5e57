// One of the real callers of tests/callers/callers.py: N GETs with got's own retry loop, its
// defaults untouched (GET retried on 408, 413, 429, 500, 502, 503, 504, 521, 522, 524 and on
// connection errors, 2 retries, 1 s then 2 s of backoff, Retry-After honoured). A status error
// is thrown (throwHttpErrors is left on) and counted as a failed call.
//
// Usage: node tests/callers/got-caller.mjs URL N CONCURRENCY [--identical]
// Call i asks for URL?call=i (with --identical, every call asks for URL?call=same).
// Prints one JSON line: {"calls", "succeeded", "failed", "retries", "failures", "seconds"}, where
// retries is what got says it made (response.retryCount, or the error's request.retryCount) and
// failures counts how failed calls ended: the status, with stormguard's x-stormguard-denied
// reason when it refused ("503 denied=budget"), or the error's code when nothing was answered.
import got from 'got';

const [url, nArg, concurrencyArg, mode] = process.argv.slice(2);
const n = Number(nArg);
const concurrency = Number(concurrencyArg);
if (!url || !Number.isInteger(n) || n < 0 || !Number.isInteger(concurrency) || concurrency < 1) {
  console.error('usage: node got-caller.mjs URL N CONCURRENCY [--identical]');
  process.exit(2);
}

const result = { calls: 0, succeeded: 0, failed: 0, retries: 0, failures: {}, seconds: 0 };

let next = 0;
async function worker() {
  while (next < n) {
    const i = next;
    next += 1;
    result.calls += 1;
    const target = new URL(url);
    target.searchParams.set('call', mode === '--identical' ? 'same' : String(i));
    try {
      const response = await got(target);
      result.succeeded += 1;
      result.retries += response.retryCount;
    } catch (error) {
      result.failed += 1;
      result.retries += error.request?.retryCount ?? 0;
      const response = error.response;
      const denied = response?.headers['x-stormguard-denied'];
      const how = response
        ? `${response.statusCode}${denied ? ` denied=${denied}` : ''}`
        : (error.code ?? error.name);
      result.failures[how] = (result.failures[how] ?? 0) + 1;
    }
  }
}

const started = performance.now();
await Promise.all(Array.from({ length: Math.min(concurrency, Math.max(n, 1)) }, worker));
result.seconds = (performance.now() - started) / 1000;
console.log(JSON.stringify(result));
