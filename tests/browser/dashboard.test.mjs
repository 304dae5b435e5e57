// The proxy's /dashboard in headless Chromium, under load: the page loads, the charts draw,
// and the numbers move between two readings; without JavaScript it still shows the numbers.
// Then a proxy with an adaptive cap: its panel, and its chart of the working cap and the floor
// against the ceiling, beside the in-flight chart.
//
// It starts `stormguard demo` itself (chaos upstreams, the proxy and the load, all on
// 127.0.0.1 with ephemeral ports), reads the dashboard URL it prints, and stops it at the end;
// then `stormguard proxy --adaptive-cap 4..40` (no traffic: the working cap stays at --cap's 20).
// Usage: node dashboard.test.mjs [--screenshot PATH]
// Environment: STORMGUARD_BIN (default ../../target/debug/stormguard), CHROMIUM
// (default /usr/bin/chromium). Every wait is bounded; the whole test gives up after 90 s.

import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import path from "node:path";
import { chromium } from "playwright-core";

const here = path.dirname(fileURLToPath(import.meta.url));
const bin = process.env.STORMGUARD_BIN || path.join(here, "../../target/debug/stormguard");
const executablePath = process.env.CHROMIUM || "/usr/bin/chromium";
const shotAt = process.argv.indexOf("--screenshot");
const screenshot = shotAt > 0 ? process.argv[shotAt + 1] : null;

const failures = [];
function check(ok, what) {
  console.log(`${ok ? "ok  " : "FAIL"}  ${what}`);
  if (!ok) failures.push(what);
}

const guard = setTimeout(() => {
  console.error("the browser test did not finish within 90 s");
  process.exit(1);
}, 90_000);

// The demo: its stderr carries the dashboard URL. It runs longer than this test may (the 90 s
// guard), and is stopped at the end: a slow browser start must not outlast the dashboard.
const demo = spawn(bin, ["demo", "--duration", "120s", "--report", "off"], { stdio: ["ignore", "ignore", "pipe"] });
let demoErr = "";
const url = await new Promise((resolve, reject) => {
  const t = setTimeout(() => reject(new Error(`no dashboard URL within 20 s:\n${demoErr}`)), 20_000);
  demo.stderr.on("data", (b) => {
    demoErr += b;
    const m = demoErr.match(/http:\/\/127\.0\.0\.1:\d+\/dashboard/);
    if (m) { clearTimeout(t); resolve(m[0]); }
  });
  demo.on("exit", (code) => reject(new Error(`stormguard demo exited (${code}):\n${demoErr}`)));
  demo.on("error", reject);
});
console.log(`dashboard at ${url}`);
const origin = new URL(url).origin;
// The demo must still be running, and its dashboard answering, before the browser is pointed
// at it; if the demo stops, say why (its stderr) instead of a bare connection refused.
let exited = null;
demo.on("exit", (code, signal) => { exited = `exited (${code ?? signal})`; });
for (const until = Date.now() + 10_000; ;) {
  if (exited) {
    console.error(`stormguard demo ${exited} after printing its dashboard:\n${demoErr}`);
    process.exit(1);
  }
  try {
    if ((await fetch(url)).ok) break;
  } catch {}
  if (Date.now() > until) {
    console.error(`the dashboard did not answer within 10 s:\n${demoErr}`);
    process.exit(1);
  }
  await new Promise((r) => setTimeout(r, 100));
}

let adaptive = null;
const browser = await chromium.launch({
  executablePath,
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync"],
});
try {
  const context = await browser.newContext({ viewport: { width: 1366, height: 860 } });
  const page = await context.newPage();
  const errors = [];
  const elsewhere = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
  page.on("request", (r) => { if (!r.url().startsWith(origin)) elsewhere.push(r.url()); });

  const response = await page.goto(url, { waitUntil: "load", timeout: 15_000 });
  check(response && response.status() === 200, `GET /dashboard answers 200 (got ${response && response.status()})`);
  check(await page.locator("section.dep h2").first().textContent() === "demo", "the dependency's section is there");

  // The charts draw: every chart of the section has at least one line of two points or more.
  const drawn = await page.waitForFunction(() => {
    const svgs = Array.from(document.querySelectorAll("section.dep .chart svg"));
    return svgs.length >= 6 && svgs.every((s) =>
      Array.from(s.querySelectorAll("polyline")).some((p) => (p.getAttribute("points") || "").trim().split(/\s+/).length >= 2));
  }, null, { timeout: 15_000, polling: 250 }).then(() => true, () => false);
  check(drawn, "all six charts have drawn lines");
  const status = await page.locator("#status").textContent();
  check(status.startsWith("Live"), `the page polls /stats.json (status: ${status})`);

  const reading = () => page.evaluate(() => {
    const cells = {};
    for (const td of document.querySelectorAll("section.dep td[data-f]")) cells[td.dataset.f] = td.textContent;
    const lines = Array.from(document.querySelectorAll("section.dep polyline")).map((p) => p.getAttribute("points")).join("|");
    return { cells, lines };
  });
  const first = await reading();
  await page.waitForTimeout(2_500);
  const second = await reading();
  console.log(`reading 1: ${JSON.stringify(first.cells)}`);
  console.log(`reading 2: ${JSON.stringify(second.cells)}`);
  const requests = [first, second].map((r) => Number(r.cells.requests));
  check(requests.every(Number.isFinite) && requests[1] > requests[0], `first tries counted move: ${requests[0]} → ${requests[1]}`);
  check(first.lines !== second.lines, "the charts change between the readings");
  check(/%$/.test(second.cells.retry_fraction) && /%$/.test(second.cells.success), "retry fraction and success rate are shown");
  check(second.cells.cap === "20", `the cap is shown (${second.cells.cap})`);
  check(errors.length === 0, `no script errors (${errors.join("; ")})`);
  check(elsewhere.length === 0, `nothing is fetched from elsewhere (${elsewhere.join(", ")})`);
  if (screenshot) {
    await page.screenshot({ path: screenshot, fullPage: false });
    console.log(`screenshot: ${screenshot}`);
  }

  // Without JavaScript: the numbers are in the page itself, and there are no charts.
  const plain = await browser.newContext({ javaScriptEnabled: false });
  const p2 = await plain.newPage();
  await p2.goto(url, { waitUntil: "load", timeout: 15_000 });
  const n = Number(await p2.locator('td[data-f="requests"]').textContent());
  check(Number.isFinite(n) && n > 0, `without JavaScript the numbers are shown (first tries ${n})`);
  check(await p2.locator("polyline").count() === 0, "without JavaScript no chart is drawn");
  // The demo's page would go on polling it: closed first.
  await page.close();
  demo.kill("SIGTERM");

  // An adaptive cap: `stormguard proxy` prints its admin address on stderr.
  adaptive = spawn(bin, ["proxy", "--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0",
    "--adaptive-cap", "4..40", "--duration", "60s"], { stdio: ["ignore", "ignore", "pipe"] });
  let proxyErr = "";
  const admin = await new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`no admin address within 20 s:\n${proxyErr}`)), 20_000);
    adaptive.stderr.on("data", (b) => {
      proxyErr += b;
      const m = proxyErr.match(/admin on (http:\/\/127\.0\.0\.1:\d+)/);
      if (m) { clearTimeout(t); resolve(m[1]); }
    });
    adaptive.on("exit", (code) => reject(new Error(`stormguard proxy exited (${code}):\n${proxyErr}`)));
    adaptive.on("error", reject);
  });
  const p3 = await context.newPage();
  const errors3 = [];
  p3.on("pageerror", (e) => errors3.push(String(e)));
  p3.on("console", (m) => { if (m.type() === "error") errors3.push(m.text()); });
  p3.on("request", (r) => { if (!r.url().startsWith(admin)) elsewhere.push(r.url()); });
  const r3 = await p3.goto(admin + "/dashboard", { waitUntil: "load", timeout: 15_000 });
  check(r3 && r3.status() === 200, `the adaptive proxy's /dashboard answers 200 (got ${r3 && r3.status()})`);
  check(await p3.locator("section.dep div.adaptive h3").textContent() === "adaptive cap", "the adaptive cap's panel is there");
  // Its chart comes third, beside the in-flight chart, and draws the working cap, the floor and
  // the ceiling once two readings are in.
  const title = "Adaptive cap: working cap vs. ceiling";
  const adaptiveDrawn = await p3.waitForFunction((title) => {
    const svgs = Array.from(document.querySelectorAll("section.dep .chart svg"));
    const svg = svgs[2];
    if (!svg || svg.getAttribute("aria-label") !== title) return false;
    const lines = Array.from(svg.querySelectorAll("polyline")).map((p) => (p.getAttribute("points") || "").trim().split(/\s+/).length);
    return lines.length === 3 && lines.every((n) => n >= 2);
  }, title, { timeout: 15_000, polling: 250 }).then(() => true, () => false);
  check(adaptiveDrawn, "the adaptive chart, third, draws the working cap, the floor and the ceiling");
  const shown = await p3.evaluate(() => {
    const legend = document.querySelectorAll("section.dep .chart .legend")[2];
    const row = Array.from(document.querySelectorAll("section.dep table.adaptive tbody td")).map((td) => td.textContent);
    return { legend: legend ? legend.textContent : "", row, cap: document.querySelector('section.dep td[data-f="cap"]').textContent };
  });
  console.log(`adaptive: ${JSON.stringify(shown)}`);
  check(["working cap 20", "floor 4", "ceiling 40"].every((s) => shown.legend.includes(s)), `its legend: working cap 20, floor 4, ceiling 40 (${shown.legend})`);
  check(shown.row[1] === "20 / 40" && shown.row[2] === "4", `its panel: working cap 20 of the ceiling 40, floor 4 (${shown.row.join(" | ")})`);
  check(shown.cap === "20 of 40", `the cap in force of the ceiling (${shown.cap})`);
  check(errors3.length === 0, `no script errors on the adaptive proxy's page (${errors3.join("; ")})`);
  check(elsewhere.length === 0, `nothing is fetched from elsewhere by either page (${elsewhere.join(", ")})`);
} finally {
  await browser.close();
  demo.kill("SIGTERM");
  if (adaptive) adaptive.kill("SIGTERM");
  clearTimeout(guard);
}
if (failures.length) {
  console.error(`${failures.length} check(s) failed`);
  process.exit(1);
}
console.log("dashboard: all checks passed");
