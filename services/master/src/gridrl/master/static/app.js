// gridrl dashboard: draws the fleet, the runs and the selected run's curves as inline SVG, first
// from the data the page was served with (<meta name="gridrl-initial" content="JSON">), then
// polling /api/state and /api/runs/<id> every second. Every string from the API goes into the
// page through textContent or setAttribute of a fixed attribute, never as HTML.
"use strict";

const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";
const W = 600, H = 200, PAD = { l: 66, r: 14, t: 12, b: 30 };
let fetches = 0;      // requests sent (the first render needs none: the page carries its data)

let selected = null;  // run id shown below the tables
let run = null;       // {id, gen, steps, evals, info, events, nodes}

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "-";
  if (typeof x !== "number") return String(x);
  if (x !== 0 && (Math.abs(x) < 1e-3 || Math.abs(x) >= 1e5)) return x.toExponential(1);
  return x.toFixed(digits === undefined ? 3 : digits);
}

function duration(s) {
  if (s === null || s === undefined) return "-";
  s = Math.round(s);
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
}

function clock(t) {
  return t ? new Date(t * 1000).toLocaleTimeString() : "-";
}

async function getJSON(url) {
  fetches += 1;
  const response = await fetch(url, { credentials: "same-origin", cache: "no-store" });
  if (response.status === 401 || response.status === 403) {
    window.location.assign("/login");
    throw new Error("signed out");
  }
  if (!response.ok) throw new Error(url + ": HTTP " + response.status);
  return response.json();
}

// ------------------------------------------------------------------------------------ fleet

function fleetRow(n) {
  const view = n.trainer_view || {};
  const tr = el("tr", { "data-address": n.address, "data-health": n.health, "data-role": n.role });
  tr.append(el("td", {}, n.node_id || "-"));
  tr.append(el("td", {}, n.address));
  tr.append(el("td", {}, n.role));
  tr.append(el("td", {}, [n.backend, n.adapter_format].filter(Boolean).join(" / ") || "-"));
  const health = el("td", { class: "health-" + n.health }, n.health);
  if (n.last_seen_s > 10) health.append(el("span", { class: "muted" }, " (" + duration(n.last_seen_s) + " ago)"));
  tr.append(health);
  const policy = el("td", {}, n.policy_version === undefined ? "-" : "v" + n.policy_version);
  const shares = Object.entries(n.run_shares || {});
  if (shares.length) {  // each run's share of the node's work (fair share between runs)
    policy.append(el("div", { class: "muted run-shares" }, shares.map(
      ([run, share]) => (run || "base") + " " + Math.round(100 * share) + "%").join(", ")));
  }
  tr.append(policy);
  tr.append(el("td", {}, view.address ? String(view.staleness) : "-"));
  const kl = el("td", { class: "kl-" + (view.kl_level || "none") });
  kl.textContent = view.address ? fmt(view.mismatch_kl) + " (" + fmt(view.mismatch_kl_bound) + ") " + view.kl_level : "-";
  tr.append(kl);
  tr.append(el("td", {}, view.address ? fmt(view.tokens_per_s, 0) : "-"));
  tr.append(el("td", {}, n.queue === undefined ? "-" : n.queue));
  tr.append(el("td", {}, n.uptime_s === undefined ? "-" : duration(n.uptime_s)));
  const why = el("td", { class: "why" });
  if (n.role === "trainer" && n.run) {
    why.textContent = "run " + n.run.run_name + ": " + n.run.state + ", step " + n.run.last_step + "/" + n.run.total_steps;
  } else if (view.address) {
    const parts = [view.in_rotation ? "in rotation" : "out: " + view.out_of_rotation];
    if (view.flagged) parts.push("FLAGGED: " + view.flagged);
    if (view.benched && !view.flagged) parts.push("benched: " + view.benched);
    if (view.readmitted) parts.push("readmitted: " + view.readmitted);
    why.textContent = parts.join("; ") + " (" + view.run_name + ")";
  } else {
    why.textContent = "-";
  }
  tr.append(why);
  return tr;
}

function renderFleet(rows) {
  document.querySelector("#fleet tbody").replaceChildren(...rows.map(fleetRow));
}

function renderRuns(runs) {
  const body = document.querySelector("#runs tbody");
  body.replaceChildren(...runs.map((r) => {
    const tr = el("tr", { "data-run-id": r.run_id, class: r.run_id === selected ? "selected" : "" });
    tr.append(el("td", {}, r.run_name || r.run_id));
    tr.append(el("td", { class: "state-" + r.state }, r.state + (r.error ? ": " + r.error : "")));
    tr.append(el("td", {}, r.last_step + "/" + r.total_steps));
    tr.append(el("td", {}, r.model_id + " / " + r.task));
    tr.append(el("td", {}, r.trainer_address || "-"));
    tr.append(el("td", {}, duration(r.report_age_s) + " ago"));
    tr.addEventListener("click", () => { selected = r.run_id; run = null; poll(); });
    return tr;
  }));
  if ((!selected || !runs.some((r) => r.run_id === selected)) && runs.length) {
    selected = runs[0].run_id;
    run = null;
  }
}

// ------------------------------------------------------------------------------------ charts

function scale(d0, d1, r0, r1) {
  if (d1 === d0) { d0 -= 1; d1 += 1; }
  return (x) => r0 + (x - d0) * (r1 - r0) / (d1 - d0);
}

function finite(values) {
  return values.filter((x) => x !== null && x !== undefined && Number.isFinite(x));
}

function extent(values) {
  const v = finite(values);
  if (!v.length) return [0, 1];
  let lo = Math.min(...v), hi = Math.max(...v);
  if (lo === hi) { lo -= Math.abs(lo) * 0.1 || 0.5; hi += Math.abs(hi) * 0.1 || 0.5; }
  return [lo, hi];
}

// "nice" tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten, about n of them
function ticks(lo, hi, n, integer) {
  const span = hi - lo;
  if (!(span > 0)) return [lo];
  let step = Math.pow(10, Math.floor(Math.log10(span / n)));
  for (const m of [1, 2, 5, 10]) { if (span / (step * m) <= n) { step *= m; break; } }
  if (integer) step = Math.max(1, Math.round(step));
  const out = [];
  for (let v = Math.ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  return out;
}

function tickText(v, step) {
  if (v === 0) return "0";
  if (Math.abs(v) < 1e-3 || Math.abs(v) >= 1e5) return v.toExponential(1);
  const digits = Math.max(0, Math.min(4, -Math.floor(Math.log10(step) + 1e-9)));
  return v.toFixed(digits);
}

// the axes with their ticks and grid lines; xs: the step range, pad: half a step either side
// (bars) so no bar crosses the y-axis
function frame(svg, xs, yLo, yHi, pad) {
  svg.setAttribute("viewBox", "0 0 " + W + " " + H);
  svg.replaceChildren();
  svg.removeAttribute("data-empty");
  const p = pad ? 0.5 : 0;
  const x = scale(xs[0] - p, xs[1] + p, PAD.l, W - PAD.r);
  const y = scale(yLo, yHi, H - PAD.b, PAD.t);
  const yt = ticks(yLo, yHi, 5, false);
  const yStep = yt.length > 1 ? yt[1] - yt[0] : Math.abs(yHi - yLo) || 1;
  for (const v of yt) {
    svg.append(svgEl("line", { class: "grid", x1: PAD.l, x2: W - PAD.r, y1: y(v).toFixed(1), y2: y(v).toFixed(1) }));
    svg.append(svgEl("text", { class: "tick ytick", x: PAD.l - 5, y: (y(v) + 5).toFixed(1), "text-anchor": "end", "data-value": v }, tickText(v, yStep)));
  }
  for (const v of ticks(xs[0], xs[1], 6, true)) {
    svg.append(svgEl("line", { class: "axis", x1: x(v).toFixed(1), x2: x(v).toFixed(1), y1: H - PAD.b, y2: H - PAD.b + 4 }));
    svg.append(svgEl("text", { class: "tick xtick", x: x(v).toFixed(1), y: H - PAD.b + 20, "text-anchor": "middle", "data-value": v }, String(v)));
  }
  svg.append(svgEl("line", { class: "axis", x1: PAD.l, y1: H - PAD.b, x2: W - PAD.r, y2: H - PAD.b }));
  svg.append(svgEl("line", { class: "axis", x1: PAD.l, y1: PAD.t, x2: PAD.l, y2: H - PAD.b }));
  return { x, y };
}

// a chart with nothing to show: its frame and "none", no axis of made-up numbers
function empty(svg, why) {
  svg.setAttribute("viewBox", "0 0 " + W + " " + H);
  svg.replaceChildren();
  svg.setAttribute("data-empty", "true");
  svg.append(svgEl("line", { class: "axis", x1: PAD.l, y1: H - PAD.b, x2: W - PAD.r, y2: H - PAD.b }));
  svg.append(svgEl("line", { class: "axis", x1: PAD.l, y1: PAD.t, x2: PAD.l, y2: H - PAD.b }));
  svg.append(svgEl("text", { class: "none", x: (PAD.l + W - PAD.r) / 2, y: (PAD.t + H - PAD.b) / 2, "text-anchor": "middle" }, why || "none"));
}

function stepRange(points) {
  return points.length ? [points[0].first_step, points[points.length - 1].step] : [0, 1];
}

function path(points, x, y, key) {
  let d = "", n = 0;
  for (const p of points) {
    if (p[key] === null || p[key] === undefined) continue;
    d += (d ? "L" : "M") + x(p.step).toFixed(1) + "," + y(p[key]).toFixed(1);
    n += 1;
  }
  return n === 1 ? d + "h0.01" : d;  // one point: a dot (round line caps)
}

function lineChart(svg, points, series, extra) {
  const values = [];
  for (const s of series) for (const p of points) values.push(p[s.key]);
  if (!finite(values).length) return empty(svg, "none");
  for (const v of extra || []) values.push(v);
  const [lo, hi] = extent(values);
  const { x, y } = frame(svg, stepRange(points), lo, hi);
  for (const s of series) {
    svg.append(svgEl("path", { class: "line " + s.cls, d: path(points, x, y, s.key), fill: "none" }));
  }
  return { x, y };
}

// mean ± std, the band clipped to the step's reward range (no reward outside [min, max])
function band(p) {
  const std = p.reward_std || 0;
  const lo = p.reward_min === null || p.reward_min === undefined ? -Infinity : p.reward_min;
  const hi = p.reward_max === null || p.reward_max === undefined ? Infinity : p.reward_max;
  return [Math.max(p.reward_mean - std, lo), Math.min(p.reward_mean + std, hi)];
}

function rewardChart(svg, points) {
  const ok = points.filter((p) => p.reward_mean !== null && p.reward_mean !== undefined);
  if (!ok.length) return empty(svg, "none");
  const bands = ok.map(band);
  const [lo, hi] = extent(bands.flat().concat(ok.map((p) => p.reward_mean)));
  const { x, y } = frame(svg, stepRange(points), lo, hi);
  const upper = ok.map((p, i) => x(p.step).toFixed(1) + "," + y(bands[i][1]).toFixed(1));
  const lower = ok.map((p, i) => x(p.step).toFixed(1) + "," + y(bands[i][0]).toFixed(1)).reverse();
  svg.append(svgEl("path", { class: "band rollout", d: "M" + upper.join("L") + "L" + lower.join("L") + "Z", "data-lo": Math.min(...bands.map((b) => b[0])), "data-hi": Math.max(...bands.map((b) => b[1])) }));
  svg.append(svgEl("path", { class: "line rollout", d: path(points, x, y, "reward_mean") }));
}

function evalChart(svg, evals, steps, info) {
  const values = [];
  for (const p of evals) if (p.score !== null) values.push(p.score - (p.stderr || 0), p.score + (p.stderr || 0));
  const hasBaseline = info.baseline_eval !== null && info.baseline_eval !== undefined;
  if (hasBaseline) values.push(info.baseline_eval);
  if (!finite(values).length) return empty(svg, "none yet");
  const [lo, hi] = extent(values.concat([0]));
  const range = steps.length ? stepRange(steps) : stepRange(evals);
  const { x, y } = frame(svg, [Math.min(range[0], evals.length ? evals[0].first_step : range[0]), Math.max(range[1], evals.length ? evals[evals.length - 1].step : range[1])], Math.max(0, lo), Math.min(1, Math.max(hi, lo + 0.05)));
  if (hasBaseline) {
    svg.append(svgEl("line", { class: "baseline", x1: PAD.l, x2: W - PAD.r, y1: y(info.baseline_eval), y2: y(info.baseline_eval) }));
    svg.append(svgEl("text", { x: W - PAD.r, y: y(info.baseline_eval) - 3, "text-anchor": "end" }, "baseline " + fmt(info.baseline_eval)));
  }
  svg.append(svgEl("path", { class: "line eval", d: path(evals, x, y, "score") }));
  if (evals.some((p) => p.exact !== null && p.exact !== undefined)) {  // full marks, beside the score
    svg.append(svgEl("path", { class: "line exact", d: path(evals.filter((p) => p.exact !== null && p.exact !== undefined), x, y, "exact") }));
  }
  for (const p of evals) {
    if (p.score === null) continue;
    const cx = x(p.step);
    if (p.stderr !== null && p.stderr !== undefined) {
      svg.append(svgEl("line", { class: "errbar", x1: cx, x2: cx, y1: y(p.score - p.stderr), y2: y(p.score + p.stderr) }));
      svg.append(svgEl("line", { class: "errbar", x1: cx - 3, x2: cx + 3, y1: y(p.score - p.stderr), y2: y(p.score - p.stderr) }));
      svg.append(svgEl("line", { class: "errbar", x1: cx - 3, x2: cx + 3, y1: y(p.score + p.stderr), y2: y(p.score + p.stderr) }));
    }
    const dot = svgEl("circle", { class: "eval eval-point", cx, cy: y(p.score), r: 3, "data-step": p.step, "data-score": p.score, "data-stderr": p.stderr === null ? "" : p.stderr });
    dot.append(svgEl("title", {}, "step " + p.step + ": " + fmt(p.score) + " ± " + fmt(p.stderr) + exactText(p.exact) + " (v" + p.policy_version + ")"));
    svg.append(dot);
  }
}

function exactText(exact) {  // the share of eval replies with full marks, as the trainer prints it
  return exact === null || exact === undefined ? "" : ", exact " + (100 * exact).toFixed(1) + "%";
}

function stackedBars(svg, points, parts) {  // parts: [[key, css class], ...]
  const totals = points.map((p) => parts.reduce((a, [k]) => a + (p[k] || 0), 0));
  const top = Math.max(0, ...totals);
  if (!(top > 0)) return empty(svg, "none");
  const range = stepRange(points);
  const { x, y } = frame(svg, range, 0, top, true);
  const slot = (W - PAD.l - PAD.r) / Math.max(1, range[1] - range[0] + 1);
  for (const p of points) {
    // a merged point stands for steps first_step..step: its bar spans them
    const left = x(p.first_step - 0.5) + slot * 0.1, right = x(p.step + 0.5) - slot * 0.1;
    const x0 = Math.max(PAD.l + 0.5, left), width = Math.max(1, right - x0);
    let base = 0;
    for (const [k, cls] of parts) {
      const v = p[k] || 0;
      if (v > 0) {
        svg.append(svgEl("rect", { class: cls, x: x0.toFixed(1), width: width.toFixed(1), y: y(base + v).toFixed(1), height: Math.max(0.5, y(base) - y(base + v)).toFixed(1) }));
      }
      base += v;
    }
  }
}

function renderCharts() {
  const steps = run.steps, info = run.info;
  rewardChart(document.getElementById("chart-reward"), steps);
  evalChart(document.getElementById("chart-eval"), run.evals, steps, info);
  stackedBars(document.getElementById("chart-time"), steps,
    [["rollout_s", "rollout"], ["update_s", "update"], ["sync_s", "sync"], ["eval_s", "eval"]]);
  stackedBars(document.getElementById("chart-samples"), steps, [["dropped", "dropped"], ["excluded", "excluded"]]);
  lineChart(document.getElementById("chart-lr"), steps, [{ key: "lr", cls: "rollout" }]);
  const isOn = info.importance_weighting || steps.some((p) => p.is_mean !== null && p.is_mean !== undefined);
  document.getElementById("fig-is").hidden = !isOn;
  if (isOn) lineChart(document.getElementById("chart-is"), steps, [{ key: "is_mean", cls: "rollout" }, { key: "is_max", cls: "update" }]);
}

// ------------------------------------------------------------------------------ run detail

function renderRun() {
  const section = document.getElementById("run");
  if (!run) { section.hidden = true; return; }
  section.hidden = false;
  const info = run.info;
  document.getElementById("run-title").textContent = "Run " + (info.run_name || info.run_id) + " — " + info.state;
  document.getElementById("run-info").textContent = info.model_id + " on " + info.task + ", step " + info.last_step + "/" + info.total_steps + (info.baseline_eval !== null && info.baseline_eval !== undefined ? ", baseline eval " + fmt(info.baseline_eval) + (info.baseline_eval_stderr !== null && info.baseline_eval_stderr !== undefined ? " ± " + fmt(info.baseline_eval_stderr) : "") + exactText(info.baseline_eval_exact) : "") + (info.eval_scorer ? ", eval scored by " + info.eval_scorer : "") + ", trainer " + (info.trainer_address || "-") + ", last report " + duration(info.report_age_s) + " ago" + (info.error ? " — " + info.error : "");
  document.getElementById("steps-shown").textContent = String(run.steps.reduce((a, p) => a + p.steps, 0));
  document.getElementById("evals-shown").textContent = String(run.evals.length);
  renderCharts();
  const recent = run.steps.slice(-15).reverse();
  const evalAt = new Map(run.evals.map((e) => [e.step, e]));
  document.querySelector("#steps tbody").replaceChildren(...recent.map((p) => {
    const tr = el("tr", { "data-step": p.step });
    const e = evalAt.get(p.step);
    const cells = [p.steps > 1 ? p.first_step + "-" + p.step : p.step, "v" + p.policy_version,
      fmt(p.reward_mean) + " ± " + fmt(p.reward_std, 2), e ? fmt(e.score) + " ± " + fmt(e.stderr) + exactText(e.exact) : "",
      fmt(p.rollout_s, 2), fmt(p.update_s, 2), fmt(p.sync_s, 2), fmt(p.eval_s, 2), p.dropped, p.excluded,
      fmt(p.lr), Object.entries(p.nodes || {}).map(([a, n]) => a + " ×" + n).join(", ")];
    for (const c of cells) tr.append(el("td", {}, c));
    return tr;
  }));
  renderExamples(run.examples);
  const events = run.events.slice().reverse();
  document.getElementById("events").replaceChildren(...events.map((e) => {
    const li = el("li", { class: e.ok ? "" : "bad", "data-kind": e.kind });
    li.textContent = clock(e.time) + "  " + (e.step ? "step " + e.step + "  " : "") + e.kind + (e.node ? " " + e.node : "") + ": " + e.message + (e.duration_s ? " (" + fmt(e.duration_s, 2) + " s)" : "");
    return li;
  }));
}

function renderExamples(shown) {  // the latest eval's first episodes, every turn, roles marked
  const caption = document.getElementById("examples-caption");
  const box = document.getElementById("examples");
  if (!shown || !shown.examples || !shown.examples.length) {
    caption.textContent = "none yet (the first held-out eval shows its first episodes here, every turn)";
    box.replaceChildren();
    return;
  }
  caption.textContent = "the held-out eval at step " + shown.step + " (policy v" + shown.policy_version + "), its first " + shown.examples.length + " episodes";
  box.replaceChildren(...shown.examples.map((ex, i) => {
    const details = el("details", { class: "example", "data-index": i, "data-turns": ex.turns, "data-score": ex.score });
    if (i === 0) details.setAttribute("open", "");
    const head = "score " + fmt(ex.score, 2) + " · " + ex.turns + (ex.turns === 1 ? " model turn" : " model turns") + (ex.dropped ? " · dropped (" + ex.dropped + "): " + ex.error : "") + " · " + ex.prompt;
    details.append(el("summary", {}, head));
    const list = el("ol", { class: "transcript" });
    list.append(message({ role: "prompt", content: ex.prompt }));
    for (const m of ex.transcript) list.append(message(m));
    details.append(list);
    return details;
  }));
}

function message(m) {
  const who = m.role === "assistant" ? "model" : m.role === "prompt" ? "prompt" : "environment";
  const li = el("li", { class: "msg " + who, "data-role": m.role });
  li.append(el("span", { class: "role" }, m.role === "assistant" ? "model (assistant)" : m.role === "prompt" ? "prompt" : "environment (" + m.role + ")"));
  li.append(el("pre", {}, m.content));
  return li;
}

async function pollRun() {
  if (!selected) { run = null; return; }
  const since = run && run.id === selected ? run.steps.length ? run.steps[run.steps.length - 1].step : 0 : 0;
  const gen = run && run.id === selected ? run.gen : -1;
  const d = await getJSON("/api/runs/" + encodeURIComponent(selected) + "?since=" + since + "&gen=" + gen);
  if (!run || run.id !== selected || d.full) {
    run = { id: selected, steps: d.steps, evals: d.evals };
  } else {
    run.steps = run.steps.concat(d.steps);
    run.evals = run.evals.concat(d.evals);
  }
  run.gen = d.generation;
  run.info = d.info;
  run.events = d.events;
  run.nodes = d.nodes;
  run.examples = d.eval_examples;
}

// the first render: from the data the page was served with (no request to wait for)
function renderInitial() {
  const holder = document.getElementById("initial");
  let initial = null;
  try { initial = holder ? JSON.parse(holder.getAttribute("content")) : null; } catch (e) { initial = null; }
  if (!initial || !initial.state) return false;
  document.getElementById("logout").hidden = !initial.state.protected;
  renderFleet(initial.state.fleet);
  renderRuns(initial.state.runs);
  const d = initial.run;
  if (d && selected === d.info.run_id) {
    run = { id: selected, steps: d.steps, evals: d.evals, gen: d.generation, info: d.info, events: d.events, nodes: d.nodes, examples: d.eval_examples };
  }
  renderRun();
  document.body.dataset.firstRender = "inline";
  document.body.dataset.fetchesBeforeFirstRender = String(fetches);
  document.getElementById("status").textContent = "as of " + clock(initial.state.time);
  return true;
}

let timer = null;
async function poll() {
  clearTimeout(timer);
  const status = document.getElementById("status");
  try {
    const state = await getJSON("/api/state");
    document.getElementById("logout").hidden = !state.protected;
    renderFleet(state.fleet);
    renderRuns(state.runs);
    await pollRun();
    renderRun();
    status.textContent = "updated " + clock(state.time);
    status.className = "muted";
  } catch (e) {
    status.textContent = "no answer from the master: " + e.message;
    status.className = "error";
  }
  timer = setTimeout(poll, POLL_MS);
}

function start() {
  if (renderInitial()) timer = setTimeout(poll, POLL_MS);
  else poll();
}

if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
else start();
