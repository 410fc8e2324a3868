// Elastron dashboard: polls the job API and draws its own charts. No framework, no build step.
"use strict";

const API = "/api/v1";
const TERMINAL = new Set(["SUCCEEDED", "FAILED", "STOPPED"]);
const $ = (id) => document.getElementById(id);

const view = {
  jobId: null,        // selected job
  metrics: [],        // [{step, loss, tokens_per_s, ...}] of the selected job, by step
  events: [],         // the selected job's events, in order
  job: null,          // its last status
  clockSkew: 0,       // server time - browser time (s), for drain countdowns
  nodes: [],
};

// -- HTTP ---------------------------------------------------------------------------------------------
function headers() {
  const h = { "Content-Type": "application/json" };
  const token = $("token").value.trim();
  if (token) h["Authorization"] = "Bearer " + token;
  return h;
}

async function api(path, opts = {}) {
  const r = await fetch(API + path, { headers: headers(), ...opts });
  let body = null;
  try { body = await r.json(); } catch (e) { body = null; }
  if (!r.ok) {
    const d = body && body.detail;
    const msg = Array.isArray(d) ? d.map((e) => `${(e.loc || []).slice(1).join(".")}: ${e.msg}`).join("; ")
                                 : (d || r.statusText);
    throw new Error(`${r.status}: ${msg}`);
  }
  return body;
}

// -- formatting ---------------------------------------------------------------------------------------
const fmt = (v, digits = 4) => (v === null || v === undefined ? "–" : (typeof v === "number" ? +v.toFixed(digits) : v));
const pct = (v) => (typeof v === "number" ? `${(100 * v).toFixed(1)}%` : "–");
function layoutText(lay, ws) {
  if (!lay) return "–";
  const dp = (lay.dp_replicate || 1) * (lay.dp_shard || 1);
  return `dp=${dp} tp=${lay.tp} pp=${lay.pp} · ${ws ?? dp * lay.tp * lay.pp} workers`;
}
function shortLayout(lay) {
  if (!lay) return "";
  return `${(lay.dp_replicate || 1) * (lay.dp_shard || 1)}×${lay.tp}×${lay.pp}`;
}
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

// -- job list -----------------------------------------------------------------------------------------
async function refreshJobs() {
  const jobs = await api("/jobs");
  const tbody = $("jobs").querySelector("tbody");
  tbody.replaceChildren(...jobs.map((j) => {
    const tr = el("tr");
    tr.dataset.id = j.id;
    if (j.id === view.jobId) tr.classList.add("selected");
    const state = el("td", j.queue_position ? `${j.state} #${j.queue_position}` : j.state, `badge s-${j.state}`);
    state.title = j.reason || "";
    const held = el("td", j.world_size);
    held.title = Object.entries(j.held || {}).map(([n, k]) => `${n.slice(0, 8)}: ${k}`).join(", ");
    tr.append(el("td", j.id), el("td", j.name), state, el("td", j.priority ?? 0),
              el("td", `${j.step ?? 0}/${j.total_steps ?? "?"}`), el("td", fmt(j.loss)), held);
    tr.addEventListener("click", () => select(j.id));
    return tr;
  }));
  $("no-jobs").hidden = jobs.length > 0;
  // The scheduler's queue, in order, each with why it waits.
  const queued = jobs.filter((j) => j.queue_position).sort((a, b) => a.queue_position - b.queue_position);
  $("queue").replaceChildren(...queued.map((j) => el("li", `${j.name} (${j.id}, priority ${j.priority ?? 0}): ${j.reason || "waiting"}`)));
  $("queue").hidden = queued.length === 0;
  if (!view.jobId && jobs.length) select((location.hash.match(/job=(\w+)/) || [])[1] || jobs[jobs.length - 1].id);
}

function select(id) {
  if (id === view.jobId) return;
  view.jobId = id;
  view.metrics = [];
  view.events = [];
  view.job = null;
  history.replaceState(null, "", "#job=" + id);
  document.querySelectorAll("#jobs tbody tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.id === id));
  $("job-panel").hidden = false;
  $("message").textContent = "";
  refreshJob().catch(() => {});
}

// -- the selected job ---------------------------------------------------------------------------------
// One refresh at a time: the timer and a button press may both ask, and two overlapping fetches of
// "events since n" would append the same events twice and skip later ones.
let inFlight = null;
function refreshJob() {
  if (!inFlight) inFlight = loadJob().finally(() => { inFlight = null; });
  return inFlight;
}

async function loadJob() {
  const id = view.jobId;
  if (!id) return;
  const since = view.metrics.length ? view.metrics[view.metrics.length - 1].step : 0;
  const evSince = view.events.length;
  const [job, rows, evs] = await Promise.all([
    api(`/jobs/${id}`), api(`/jobs/${id}/metrics?since=${since}`), api(`/jobs/${id}/events?since=${evSince}`),
  ]);
  if (id !== view.jobId) return;  // switched meanwhile
  view.job = job;
  for (const r of rows) {
    if (!view.metrics.length || r.step > view.metrics[view.metrics.length - 1].step) view.metrics.push(r);
  }
  if (evSince === view.events.length) view.events.push(...evs);
  showJob(job);
  drawChart($("loss-chart"), view.metrics.filter((m) => m.loss != null).map((m) => [m.step, m.loss]), "#3366cc",
            [[view.metrics.filter((m) => m.val_loss != null).map((m) => [m.step, m.val_loss]), "#e07b00"]]);
  drawChart($("tps-chart"), view.metrics.filter((m) => m.tokens_per_s != null).map((m) => [m.step, m.tokens_per_s]), "#2a9d5c");
  drawTimeline($("timeline"), view.events, job);
  showEvents(view.events);
}

function showJob(j) {
  $("job-id").textContent = j.id;
  $("job-name").textContent = j.name;
  const st = $("state");
  st.textContent = j.state;
  st.className = `badge s-${j.state}`;
  $("layout").textContent = j.world_size ? layoutText(j.layout, j.world_size) : (j.layout ? `last ${layoutText(j.layout)}` : "–");
  $("step").textContent = `${j.step ?? 0} / ${j.total_steps ?? "?"}`;
  $("loss").textContent = fmt(j.loss);
  $("tps").textContent = fmt(j.tokens_per_s, 0);
  $("mfu").textContent = pct(j.mfu);
  $("committed").textContent = j.committed_step ? `step ${j.committed_step}` : "none yet";
  const showReason = !["RUNNING", "SUCCEEDED"].includes(j.state) || j.error;
  $("reason").textContent = showReason ? (j.error || j.reason || "") : "";
  const done = TERMINAL.has(j.state);
  $("resize").disabled = done;
  $("pause").disabled = done || j.state === "PAUSED";
  $("resume").disabled = j.state !== "PAUSED";
  $("stop").disabled = done;
}

function showEvents(events) {
  const rows = events.slice(-25).reverse().map((e) => {
    const tr = el("tr");
    const state = e.kind === "transition" ? `${e.from_state} → ${e.to_state}` : e.to_state;
    tr.append(el("td", e.step ?? ""), el("td", e.kind + (e.cause ? ` (${e.cause})` : "")), el("td", state),
              el("td", e.reason, "reason"));
    return tr;
  });
  $("events").querySelector("tbody").replaceChildren(...rows);
}

// -- charts -------------------------------------------------------------------------------------------
function niceTicks(lo, hi, n) {
  const span = hi - lo || Math.abs(hi) || 1;
  const step0 = span / n;
  const mag = Math.pow(10, Math.floor(Math.log10(step0)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= step0);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}

// A line chart of points [[x, y], ...] on a canvas; the point count goes into data-points.
// `more`: further [pts, color] series on the same axes (the loss chart's validation loss, in orange).
function drawChart(canvas, pts, color, more = []) {
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, L = 56, R = 12, T = 10, B = 26;
  ctx.clearRect(0, 0, W, H);
  canvas.dataset.points = String(pts.length);
  canvas.dataset.morePoints = more.map(([p]) => p.length).join(",");
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#778";
  if (!pts.length) { ctx.fillText("no data yet", W / 2 - 30, H / 2); return; }
  let x0 = pts[0][0], x1 = pts[pts.length - 1][0];
  const ys = [pts, ...more.map(([p]) => p)].flat().map((p) => p[1]);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  ctx.strokeStyle = "#e4e6ea";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  for (const v of niceTicks(y0, y1, 4)) {
    ctx.beginPath(); ctx.moveTo(L, sy(v)); ctx.lineTo(W - R, sy(v)); ctx.stroke();
    ctx.fillText(String(v), L - 4, sy(v) + 4);
  }
  ctx.textAlign = "center";
  for (const v of niceTicks(x0, x1, 6)) ctx.fillText(String(v), sx(v), H - 8);
  for (const [ps, c] of [[pts, color], ...more]) {
    ctx.strokeStyle = c;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    ps.forEach(([x, y], i) => (i ? ctx.lineTo(sx(x), sy(y)) : ctx.moveTo(sx(x), sy(y))));
    ctx.stroke();
    ctx.fillStyle = c;
    if (ps.length === 1 || c !== color) ps.forEach(([x, y]) => ctx.fillRect(sx(x) - 2, sy(y) - 2, 4, 4));
  }
}

// Layout segments from the "resize" events (each re-formation of the worker group), with marks for
// preemption notices, failures, user resizes and pauses/waits.
function timelineModel(events, job) {
  const segs = [], marks = [];
  for (const e of events) {
    if (e.kind === "resize") {
      const d = e.details || {};
      segs.push({ from: e.step ?? 0, layout: d.new_layout || e.new_layout, ws: d.world_size, cause: e.cause });
      if (e.cause && e.cause !== "planned") marks.push({ step: e.step ?? 0, kind: e.cause === "failure" ? "failure" : "resize", text: e.reason });
    } else if (e.kind === "preemption" || e.kind === "failure") {
      marks.push({ step: e.step ?? 0, kind: e.kind, text: e.reason });
    } else if (e.kind === "transition" && ["PAUSED", "WAITING_FOR_CAPACITY"].includes(e.to_state)) {
      marks.push({ step: e.step ?? 0, kind: "pause", text: `${e.to_state}: ${e.reason}` });
    }
  }
  const end = Math.max(job.step || 0, ...segs.map((s) => s.from), ...marks.map((m) => m.step), 1);
  segs.forEach((s, i) => (s.to = i + 1 < segs.length ? segs[i + 1].from : end));
  return { segs, marks, end };
}

const SEG_COLORS = ["#9bbcf0", "#a8dfb6", "#f3c98b", "#d2b4f0", "#f0a8a8", "#a8e0e0"];

function drawTimeline(svg, events, job) {
  const NS = "http://www.w3.org/2000/svg";
  const W = svg.clientWidth || 1000, L = 10, R = 10;
  svg.setAttribute("viewBox", `0 0 ${W} 70`);
  const { segs, marks, end } = timelineModel(events, job);
  const sx = (s) => L + (s / end) * (W - L - R);
  const colorOf = {};
  const kids = [];
  const mk = (tag, attrs, text) => {
    const n = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    return n;
  };
  for (const s of segs) {
    const key = shortLayout(s.layout);
    colorOf[key] = colorOf[key] || SEG_COLORS[Object.keys(colorOf).length % SEG_COLORS.length];
    const w = Math.max(2, sx(s.to) - sx(s.from));
    const g = mk("g", { class: "segment", "data-layout": key });
    g.append(mk("rect", { x: sx(s.from), y: 8, width: w, height: 30, fill: colorOf[key] }),
             mk("title", {}, `steps ${s.from}–${s.to}: ${layoutText(s.layout, s.ws)} (${s.cause || ""})`));
    if (w > 60) g.append(mk("text", { x: sx(s.from) + 4, y: 28, "font-size": 12 }, `${key} (${s.ws ?? "?"})`));
    kids.push(g);
  }
  const colors = { resize: "#3366cc", preemption: "#e69500", failure: "#cc2222", pause: "#888" };
  for (const m of marks) {
    const g = mk("g", { class: `mark mark-${m.kind}` });
    g.append(mk("line", { x1: sx(m.step), x2: sx(m.step), y1: 2, y2: 44, stroke: colors[m.kind], "stroke-width": 2 }),
             mk("title", {}, `step ${m.step}: ${m.text}`));
    kids.push(g);
  }
  kids.push(mk("text", { x: L, y: 60, "font-size": 11, fill: "#778" }, "step 0"),
            mk("text", { x: W - R, y: 60, "font-size": 11, fill: "#778", "text-anchor": "end" }, `step ${end}`));
  svg.replaceChildren(...kids);
  svg.dataset.segments = String(segs.length);
}

// -- cluster ------------------------------------------------------------------------------------------
async function refreshCluster() {
  const c = await api("/cluster");
  view.clockSkew = c.time - Date.now() / 1000;
  view.nodes = c.nodes;
  $("cluster-summary").textContent = `${c.nodes.filter((n) => n.alive).length} of ${c.nodes.length} nodes alive, ` +
                                     `room for ${c.usable_workers} workers`;
  showNodes();
}

function showNodes() {
  const now = Date.now() / 1000 + view.clockSkew;
  const rows = view.nodes.map((n) => {
    const tr = el("tr");
    let status, cls;
    if (!n.alive) { status = `dead${n.death_reason ? " (" + n.death_reason + ")" : ""}`; cls = "node-dead"; }
    else if (n.draining) {
      status = n.drain_deadline ? `draining, ${Math.max(0, Math.round(n.drain_deadline - now))} s left` : "draining";
      cls = "node-draining";
    } else { status = "alive"; cls = "node-alive"; }
    tr.append(el("td", n.node_id.slice(0, 12) + (n.is_head ? " (head)" : "")), el("td", n.cpus), el("td", n.gpus),
              el("td", status, cls));
    return tr;
  });
  $("nodes").querySelector("tbody").replaceChildren(...rows);
}

// -- controls -----------------------------------------------------------------------------------------
async function command(action, body) {
  const msg = $("message");
  msg.className = "";
  msg.textContent = `${action}…`;
  try {
    await api(`/jobs/${view.jobId}/${action}`, { method: "POST", body: body ? JSON.stringify(body) : undefined });
    msg.className = "ok";
    msg.textContent = `${action} accepted`;
  } catch (e) {
    msg.className = "error";
    msg.textContent = `${action} failed: ${e.message}`;
  }
  refreshJob().catch(() => {});
}

$("resize").addEventListener("click", () => command("resize", { workers: parseInt($("resize-n").value, 10) }));
$("pause").addEventListener("click", () => command("pause"));
$("resume").addEventListener("click", () => command("resume"));
$("stop").addEventListener("click", () => { if (confirm(`Stop job ${view.jobId}? A stopped job cannot be resumed.`)) command("stop"); });
$("token").value = localStorage.getItem("elastron-token") || "";
$("token").addEventListener("change", () => localStorage.setItem("elastron-token", $("token").value.trim()));

// -- polling ------------------------------------------------------------------------------------------
function every(ms, fn) {
  let busy = false;
  const tick = async () => {
    if (busy) return;
    busy = true;
    try { await fn(); $("conn").textContent = "connected"; $("conn").className = ""; }
    catch (e) { $("conn").textContent = `server: ${e.message}`; $("conn").className = "error"; }
    finally { busy = false; }
  };
  tick();
  return setInterval(tick, ms);
}

every(2000, refreshJobs);
every(1000, refreshJob);
every(3000, refreshCluster);
setInterval(showNodes, 1000);
