// The operator page: polls /v1/admin/dashboard and draws the queue first, then what drains it.
"use strict";

const LEVELS = ["normal", "light model", "shorter output", "cached answers", "reject batch", "tight promise", "shed"];
const REFRESH_MS = 2000;
const USAGE_REFRESH_MS = 60000;  // the month's usage moves slowly: once a minute

function adminKey() {
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("key");
  if (fromHash) {
    sessionStorage.setItem("sluice-admin-key", fromHash);
    history.replaceState(null, "", location.pathname);  // keep the key out of the address bar
  }
  return sessionStorage.getItem("sluice-admin-key");
}

function table(el, header, rows) {
  el.textContent = "";
  const head = el.insertRow();
  for (const h of header) { const th = document.createElement("th"); th.textContent = h; head.appendChild(th); }
  if (!rows.length) { el.insertRow().insertCell().textContent = "none"; return; }
  for (const row of rows) { const tr = el.insertRow(); for (const c of row) tr.insertCell().textContent = c; }
}

function start(key) {
  document.getElementById("board").hidden = false;
  const box = document.getElementById("charts");
  const charts = {
    requests: new LineChart(box, {title: "Queued requests, per class"}),
    tokens: new LineChart(box, {title: "Queued tokens, per class (rising alone: long requests piling up)"}),
    timing: new LineChart(box, {title: "Queue wait vs inference, median of the last minute", unit: " s"}),
    engines: new LineChart(box, {title: "Engine batch (running sequences) and waiting, per worker"}),
    kv: new LineChart(box, {title: "KV cache in use, per worker", unit: "%"}),
    level: new LineChart(box, {title: "Degradation level (0 normal … 6 shed)"}),
  };
  async function refresh() {
    let data;
    try {
      const answer = await fetch("/v1/admin/dashboard", {headers: {Authorization: `Bearer ${key}`}});
      if (answer.status === 401) { sessionStorage.removeItem("sluice-admin-key"); location.reload(); return; }
      data = await answer.json();
      document.getElementById("error").textContent = "";
    } catch (err) {
      document.getElementById("error").textContent = `no answer: ${err}`;
      return;
    }
    const t = Date.now() / 1000;
    const level = document.getElementById("level");
    level.textContent = data.level === null ? "unknown (no monitor)" : `${data.level} (${LEVELS[data.level]})`;
    level.className = data.level >= 6 ? "shedding" : data.level > 0 ? "degraded" : "";
    document.getElementById("steps").textContent = data.steps.join(", ") || "none";
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    const perClass = (field) => Object.fromEntries(data.classes.map(c => [`${c.priority} ${c.model}`, c[field]]));
    charts.requests.push(t, perClass("queued_requests"));
    charts.tokens.push(t, perClass("queued_tokens"));
    const timing = {};
    for (const row of data.timings) {
      timing[`${row.priority} queue wait`] = row.queue_wait_p50_s;
      timing[`${row.priority} inference`] = row.inference_p50_s;
    }
    charts.timing.push(t, timing);
    const engines = {}, kv = {};
    for (const w of data.workers) {
      const name = `${w.model}@${w.device}`;
      engines[`${name} running`] = w.running;
      engines[`${name} waiting`] = w.waiting;
      kv[name] = w.kv_capacity_tokens ? 100 * w.kv_used_tokens / w.kv_capacity_tokens : 0;
    }
    charts.engines.push(t, engines);
    charts.kv.push(t, kv);
    if (data.level !== null) {
      // Beside the platform's level, each realtime class's fair level: what a tenant that did not
      // queue past its turn is judged at (docs/fairness.md).
      const levels = {level: data.level};
      for (const c of data.classes) if (c.priority === "realtime") levels[`${c.model} fair`] = c.fair_level;
      charts.level.push(t, levels);
    }
    table(document.getElementById("workers"), ["model", "device", "role", "running", "waiting", "largest batch",
                                               "in-engine limit", "batch", "threads", "KV used"],
          data.workers.map(w => [w.model, w.device, w.role || "all", w.running, w.waiting, w.max_batch_seen,
                                 w.engine_limit ?? "-", w.batch_open === false ? "yields" : "open",
                                 w.threads, `${w.kv_used_tokens} / ${w.kv_capacity_tokens}`]));
    table(document.getElementById("jobs"), ["job", "items by status"],
          data.jobs.map(j => [j.id, Object.entries(j.items).map(([s, n]) => `${s} ${n}`).join(", ")]));
    table(document.getElementById("lines"), ["queue", "tenant", "queued", "engine s", "share", "reserved",
                                             "wait s"],
          (data.lines || []).flatMap(l => l.tenants.map(r => [l.queue, r.name || r.tenant, r.requests,
                                                              r.seconds.toFixed(1), r.share.toFixed(2),
                                                              r.reserved_share ?? "-", r.wait_s.toFixed(1)])));
    table(document.getElementById("reservations"), ["from", "until", "state", "role"],
          data.reservations.map(r => [r.from, r.until, r.state, r.role || "all"]));
    table(document.getElementById("rejections"), ["gate: reason", "count"],
          Object.entries(data.rejections).map(([k, n]) => [k, n]));
  }
  async function refreshUsage() {
    let usage;
    try {
      const answer = await fetch("/v1/admin/dashboard/usage", {headers: {Authorization: `Bearer ${key}`}});
      if (!answer.ok) return;  // the main refresh reports a lost key or an unreachable server
      usage = await answer.json();
    } catch (err) {
      return;
    }
    const count = (n) => n.toLocaleString();
    document.getElementById("usage-since").textContent = `since ${usage.start.slice(0, 10)} (UTC)`;
    table(document.getElementById("usage-tenants"), ["tenant", "requests", "input tokens", "output tokens", "cost"],
          usage.tenants.map(t => [t.tenant_name || t.tenant_id, count(t.requests), count(t.input_tokens),
                                  count(t.output_tokens), dollars(t.cost)]));
    table(document.getElementById("usage-models"), ["model", "requests", "input tokens", "output tokens", "cost"],
          usage.models.map(m => [m.model, count(m.requests), count(m.input_tokens), count(m.output_tokens),
                                 dollars(m.cost)]));
  }
  refresh();
  setInterval(refresh, REFRESH_MS);
  refreshUsage();
  setInterval(refreshUsage, USAGE_REFRESH_MS);
}

function dollars(value) {
  return "$" + value.toLocaleString("en-US", {minimumFractionDigits: 2, maximumFractionDigits: 4});
}

const key = adminKey();
if (key) {
  start(key);
} else {
  const form = document.getElementById("auth");
  form.hidden = false;
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem("sluice-admin-key", document.getElementById("key").value);
    location.reload();
  });
}
