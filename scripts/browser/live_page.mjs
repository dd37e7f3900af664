// Drives the live cluster page in Debian's Chromium (playwright-core, no downloaded browser) for
// tests/live_page.rs. Usage: node live_page.mjs URL SCREENSHOT.png
//
// Protocol with the Rust test, one JSON object per stdout line:
//   {"stage":"two-workers","pids":[...]}  the page lists two training workers; the test kills one
//                                         and answers "killed" on stdin
//   {"stage":"recovered",...}             the page shows the loss, the lost member and a recovery
//                                         generation; the screenshot is saved
//   {"stage":"error","message":...}       something did not appear in time (exit code 1)
import { chromium } from "playwright-core";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";

const [url, screenshot] = process.argv.slice(2);
const executablePath = process.env.RTX_CHROMIUM || "/usr/bin/chromium";
const WAIT_MS = 90_000;
const say = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");

if (!url || !screenshot) {
  say({ stage: "error", message: "usage: node live_page.mjs URL SCREENSHOT.png" });
  process.exit(2);
}

const lines = createInterface({ input: process.stdin });
const nextLine = () => new Promise((resolve, reject) => {
  lines.once("line", resolve);
  lines.once("close", () => reject(new Error("stdin closed before the test answered")));
});

const profile = mkdtempSync(join(tmpdir(), "rtx-chromium-"));
let context;
try {
  // A fresh profile, nothing that phones home; headless on the software rasterizer.
  context = await chromium.launchPersistentContext(profile, {
    executablePath,
    headless: true,
    viewport: { width: 1280, height: 900 },
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
  const page = context.pages()[0] ?? await context.newPage();
  page.setDefaultTimeout(WAIT_MS);
  await page.goto(url);
  // Two workers training, as the page itself shows them (not the API).
  await page.waitForFunction(() => document.querySelectorAll('#members tr[data-state="training"]').length === 2);
  await page.waitForFunction(() => document.getElementById("conn").classList.contains("live"));
  const pids = await page.$$eval('#members tr[data-state="training"]', (rows) => rows.map((r) => Number(r.dataset.pid)));
  say({ stage: "two-workers", pids });
  const answer = await nextLine();
  if (answer.trim() !== "killed") throw new Error(`unexpected answer ${JSON.stringify(answer)}`);
  // The recovery: the victim listed as lost, a timeline entry, a recovery generation, and
  // steps committed by the new generation.
  await page.waitForSelector("#timeline li.recovery");
  await page.waitForSelector('#members tr[data-state="lost"]');
  await page.waitForSelector('#generations tr[data-recovery="true"]');
  const resumedAt = Number(await page.$eval('#generations tr[data-recovery="true"] td:nth-child(4)', (td) => td.textContent));
  await page.waitForFunction((from) => {
    const done = Number(document.getElementById("s-step").textContent.split("/")[0]);
    return done >= from + 200 || document.getElementById("phase").textContent === "finished";
  }, resumedAt);
  const lostPids = await page.$$eval('#members tr[data-state="lost"]', (rows) => rows.map((r) => Number(r.dataset.pid)));
  const recovery = await page.$eval("#timeline li.recovery", (li) => li.textContent);
  const curve = await page.$eval("#loss polyline.curve", (p) => p.getAttribute("points").split(" ").length);
  await page.screenshot({ path: screenshot, fullPage: true });
  say({ stage: "recovered", lost_pids: lostPids, resumed_at: resumedAt, recovery, loss_points: curve });
} catch (err) {
  say({ stage: "error", message: String(err && err.stack || err) });
  process.exitCode = 1;
  try {
    const page = context?.pages()[0];
    if (page) await page.screenshot({ path: screenshot.replace(/\.png$/, "") + ".failed.png", fullPage: true });
  } catch { /* the error above is the one to report */ }
} finally {
  await context?.close().catch(() => {});
  rmSync(profile, { recursive: true, force: true });
  lines.close();
}
