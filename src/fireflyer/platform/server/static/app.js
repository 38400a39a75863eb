// The Fire-Flyer platform dashboard: plain DOM, no build step, no outside requests.
// Every string that comes from the API is put in the page with textContent (never innerHTML).
"use strict";

const POLL_MS = 2000;
const LOG_TAIL = 200;
const CHART_POINTS = 120;
const TOKEN_KEY = "fireflyer.token";
const SVG_NS = "http://www.w3.org/2000/svg";
const FINISHED = "finished";

const $ = (id) => document.getElementById(id);

const ui = {
  me: null,            // {user, admin}
  selected: null,      // chain id whose detail is open
  timer: null,
  generation: 0,       // bumps on login/logout so a late answer of an old session is dropped
  rendered: {},        // last JSON rendered per part: only changed parts are redrawn
  logAttempt: null,
  painted: false,      // the task table's first rows are marked for fireflyer.bench.paint
};

// ---- DOM helpers -----------------------------------------------------------------------------

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = String(v);
    else if (k === "title") node.title = String(v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(node.dataset, v);
    else node.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function fill(parent, children) {
  parent.replaceChildren(...children);
}

// Redraw a part only when its data changed since the last draw (keeps the page still between polls).
function changed(part, data) {
  const key = JSON.stringify(data);
  if (ui.rendered[part] === key) return false;
  ui.rendered[part] = key;
  return true;
}

const pad = (n) => String(n).padStart(2, "0");

function fmtTime(t) {
  if (t === null || t === undefined) return "-";
  const d = new Date(t * 1000);
  return `${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

function fmtClock(t) {
  const d = new Date(t * 1000);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}`;
}

function fmtDuration(s) {
  s = Math.max(0, Math.round(s));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${pad(s % 60)}s`;
  return `${Math.floor(s / 3600)}h ${pad(Math.floor((s % 3600) / 60))}m`;
}

// ---- API -------------------------------------------------------------------------------------

class HttpError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

function detailText(body, fallback) {
  if (!body || body.detail === undefined) return fallback;
  if (typeof body.detail === "string") return body.detail;
  if (Array.isArray(body.detail)) {  // validation errors: [{loc, msg}, ...]
    return body.detail.map((d) => (d && d.msg ? `${(d.loc || []).slice(1).join(".")}: ${d.msg}` : JSON.stringify(d))).join("; ");
  }
  return JSON.stringify(body.detail);
}

async function api(path, options = {}) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = { Accept: "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  let res;
  try {
    res = await fetch(path, {
      method: options.method || "GET",
      headers,
      body: options.body === undefined ? undefined : JSON.stringify(options.body),
      cache: "no-store",
    });
  } catch (e) {
    throw new HttpError(0, `the server did not answer (${e.message})`);
  }
  let body = null;
  try {
    body = await res.json();
  } catch (e) {
    body = null;
  }
  if (!res.ok) throw new HttpError(res.status, detailText(body, `${res.status} ${res.statusText}`));
  return body;
}

// 401 anywhere: the token is gone or wrong, back to the login form with the server's reason.
function handleAuthError(err) {
  if (err instanceof HttpError && err.status === 401) {
    logout(`Signed out: ${err.message}`);
    return true;
  }
  return false;
}

// ---- login -----------------------------------------------------------------------------------

function showLogin(message) {
  $("app").hidden = true;
  $("whoami").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("token").value = "";
  $("token").focus();
}

async function login(token) {
  sessionStorage.setItem(TOKEN_KEY, token);
  const gen = ++ui.generation;
  try {
    const me = await api("/api/me");
    if (gen !== ui.generation) return;
    ui.me = me;
  } catch (err) {
    if (gen !== ui.generation) return;
    sessionStorage.removeItem(TOKEN_KEY);
    const why = err.status === 401 ? `Sign-in failed: ${err.message}` : `Sign-in failed (${err.status || "network"}): ${err.message}`;
    showLogin(why);
    return;
  }
  $("login").hidden = true;
  $("app").hidden = false;
  $("whoami").hidden = false;
  $("me-name").textContent = ui.me.user;
  $("me-role").textContent = ui.me.admin ? "admin" : "user";
  $("me-role").className = ui.me.admin ? "pill admin" : "pill";
  ui.rendered = {};
  refresh(gen);
}

function logout(message) {
  ui.generation++;
  clearTimeout(ui.timer);
  sessionStorage.removeItem(TOKEN_KEY);
  ui.me = null;
  ui.selected = null;
  ui.rendered = {};
  $("detail").hidden = true;
  fill($("task-rows"), []);
  showLogin(message || "");
}

// ---- polling ---------------------------------------------------------------------------------

async function refresh(gen) {
  if (gen !== ui.generation) return;
  clearTimeout(ui.timer);
  const all = $("show-all").checked ? 1 : 0;
  const jobs = [
    api(`/api/tasks?all=${all}&limit=200`).then(renderTasks),
    api("/api/nodes").then(renderNodes),
    api(`/api/overview?hours=${encodeURIComponent($("hours").value)}&buckets=${CHART_POINTS}`).then(renderOverview),
  ];
  if (ui.selected !== null) jobs.push(loadDetail(ui.selected));
  const results = await Promise.allSettled(jobs);
  if (gen !== ui.generation) return;
  const failed = results.filter((r) => r.status === "rejected").map((r) => r.reason);
  if (failed.some(handleAuthError)) return;
  const banner = $("banner");
  if (failed.length) {
    banner.textContent = `Could not refresh: ${failed[0].message}`;
    banner.hidden = false;
  } else {
    banner.hidden = true;
    $("live").textContent = `updated ${new Date().toLocaleTimeString()}`;
  }
  ui.timer = setTimeout(() => refresh(gen), POLL_MS);
}

function refreshSoon() {
  ui.rendered.tasks = null;
  refresh(ui.generation);
}

// ---- tasks -----------------------------------------------------------------------------------

function stateLabel(t) {
  return t.state === FINISHED ? t.outcome : t.state;
}

function stateBadge(t) {
  const label = stateLabel(t);
  return el("span", { class: `state s-${label}`, text: label, title: t.detail || undefined });
}

// Which controls a task's state allows (the API enforces this anyway and its error is shown).
function allowedActions(t) {
  const acts = [];
  if (t.state === "running") acts.push("suspend");
  if (t.state === "held") acts.push("resume");
  if (t.state !== FINISHED) acts.push("stop");
  return acts;
}

function canControl(t) {
  return ui.me && (ui.me.admin || t.user === ui.me.user);
}

function actionButtons(t, small) {
  if (!canControl(t)) return [];
  return allowedActions(t).map((a) =>
    el("button", {
      type: "button",
      class: `act act-${a}${small ? " small" : ""}`,
      text: a,
      dataset: { action: a, task: t.id },
      title: `${a} task ${t.id}`,
      onclick: (ev) => {
        ev.stopPropagation();
        control(t.id, a, ev.currentTarget);
      },
    }));
}

async function control(id, action, button) {
  if (action === "stop" && !window.confirm(`Stop task ${id} for good?`)) return;
  if (button) button.disabled = true;
  const where = ui.selected === id ? $("detail-error") : $("banner");
  try {
    await api(`/api/tasks/${id}/${action}`, { method: "POST" });
    where.textContent = "";
    if (where === $("banner")) where.hidden = true;
  } catch (err) {
    if (handleAuthError(err)) return;
    where.textContent = `${action} task ${id}: ${err.message}` + (err.status ? ` (${err.status})` : "");
    where.hidden = false;
  } finally {
    if (button) button.disabled = false;
  }
  refreshSoon();
}

function taskTime(t) {
  if (t.state === FINISHED) return fmtTime(t.finished_at);
  if (t.state === "queued" || t.state === "held") return fmtTime(t.submitted_at);
  return fmtTime(t.started_at);
}

function renderTasks(data) {
  const tasks = data.tasks || [];
  $("task-count").textContent = data.total > tasks.length ? `${tasks.length} of ${data.total}` : `${data.total}`;
  $("no-tasks").hidden = tasks.length > 0;
  if (!changed("tasks", [tasks, ui.selected, ui.me])) return;
  const rows = tasks.map((t) =>
    el("tr", {
      dataset: { id: t.id, state: t.state },
      class: t.id === ui.selected ? "selected" : undefined,
      title: (t.command || []).join(" "),
      onclick: () => openDetail(t.id),
    },
    el("td", { class: "num", text: t.id }),
    el("td", { class: "name", text: t.name }),
    el("td", { text: t.user }),
    el("td", { text: t.priority }),
    el("td", { class: "num", text: t.nodes }),
    el("td", {}, stateBadge(t)),
    el("td", { class: "num", text: t.attempt }),
    el("td", { class: "mono", text: (t.assigned || []).join(",") || "-" }),
    el("td", { class: "mono", text: taskTime(t) }),
    el("td", { class: "actions" }, ...actionButtons(t, true))));
  fill($("task-rows"), rows);
  if (rows.length && !ui.painted) {
    ui.painted = true;
    performance.mark("fireflyer:tasks-rendered");
  }
}

// ---- task detail -----------------------------------------------------------------------------

function openDetail(id) {
  if (ui.selected !== id) {
    ui.logAttempt = null;
    $("log").textContent = "";
    $("log-meta").textContent = "";
    $("detail-error").textContent = "";
    ui.rendered.detail = null;
  }
  ui.selected = id;
  $("detail").hidden = false;
  for (const tr of $("task-rows").children) tr.classList.toggle("selected", Number(tr.dataset.id) === id);
  ui.rendered.tasks = null;
  loadDetail(id).then(() => $("detail").scrollIntoView({ behavior: "smooth", block: "nearest" }))
    .catch((err) => {
      if (!handleAuthError(err)) $("detail-error").textContent = `task ${id}: ${err.message}`;
    });
}

function closeDetail() {
  ui.selected = null;
  $("detail").hidden = true;
  for (const tr of $("task-rows").children) tr.classList.remove("selected");
  ui.rendered.tasks = null;
}

async function loadDetail(id) {
  let task;
  try {
    task = await api(`/api/tasks/${id}`);
  } catch (err) {
    if (err.status === 403 || err.status === 404) {
      if (ui.selected === id) $("detail-error").textContent = `task ${id}: ${err.message} (${err.status})`;
      return;
    }
    throw err;
  }
  if (ui.selected !== id) return;
  renderDetail(task);
  try {
    const log = await api(`/api/tasks/${id}/logs?rank=0&tail=${LOG_TAIL}`);
    if (ui.selected === id) renderLog(log);
  } catch (err) {
    if (err.status === 401) throw err;
    if (ui.selected === id) $("log-meta").textContent = `(${err.message})`;
  }
}

function renderDetail(t) {
  if (!changed("detail", [t, ui.me])) return;
  fill($("detail-title"), [`Task ${t.id} `, el("span", { class: "name", text: t.name }), " ", stateBadge(t)]);
  fill($("detail-actions"), actionButtons(t, false));
  // the chain's run time: every attempt's, up to now for one still running
  const now = Date.now() / 1000;
  const spans = (t.attempts && t.attempts.length ? t.attempts : [t]).filter((a) => a.started_at);
  const run = spans.length ? fmtDuration(spans.reduce((s, a) => s + ((a.finished_at || now) - a.started_at), 0)) : "-";
  const info = [
    ["user", t.user], ["group", t.group], ["priority", t.priority],
    ["nodes", `${t.nodes} × ${t.ranks_per_node ?? "?"} rank(s)`],
    ["command", (t.command || []).join(" ")],
    ["submitted", fmtTime(t.submitted_at)], ["run time", run],
    ["whole-life state", t.whole_life_state], ["detail", t.detail || "-"],
  ];
  fill($("detail-info"), info.flatMap(([k, v]) =>
    [el("dt", { text: k }), el("dd", { class: k === "command" ? "command" : undefined, text: v })]));
  fill($("attempts"), (t.attempts || []).map((a) =>
    el("tr", {},
      el("td", { class: "num", text: a.task_id }),
      el("td", { class: "num", text: a.attempt }),
      el("td", {}, el("span", { class: `state s-${a.outcome}`, text: a.outcome })),
      el("td", { class: "mono", text: (a.assigned || []).join(",") || "-" }),
      el("td", { class: "mono", text: fmtTime(a.started_at) }),
      el("td", { class: "mono", text: fmtTime(a.finished_at) }),
      el("td", { text: a.stop ? `${a.stop}${a.detail ? ": " + a.detail : ""}` : (a.detail || "") }))));
  // a fault-tolerant task: each replica's node, state and restarts, and the quorum its Lighthouse formed last
  $("replicas-box").hidden = !t.fault_tolerant;
  const q = t.quorum;
  $("quorum").textContent = !t.fault_tolerant ? "" : q ?
    `quorum ${q.id}: ${(q.replicas || []).join(", ") || "none"} (${(q.replicas || []).length} of ${t.nodes})` :
    "quorum not known (not running)";
  fill($("replicas"), (t.replicas || []).map((r) =>
    el("tr", {},
      el("td", { class: "mono", text: r.name }),
      el("td", { class: "mono", text: r.node }),
      el("td", {}, el("span", { class: `state s-${r.state}`, text: r.state })),
      el("td", { class: "num", text: r.restarts }),
      el("td", { class: "mono", text: fmtTime(r.started_at) }),
      el("td", { text: r.detail || "" }))));
  fill($("events"), (t.events || []).map((e) =>
    el("tr", {},
      el("td", { class: "mono", text: fmtTime(e.at) }),
      el("td", { class: "num", text: e.task_id }),
      el("td", { text: e.kind }),
      el("td", { text: e.detail || "" }))));
}

function renderLog(log) {
  const pre = $("log");
  const atBottom = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 24;
  $("log-meta").textContent = `rank ${log.rank}, attempt ${log.attempt}, last ${LOG_TAIL} lines`;
  if (pre.textContent !== log.text) pre.textContent = log.text || "(empty)";
  if (atBottom || ui.logAttempt !== log.attempt) pre.scrollTop = pre.scrollHeight;
  ui.logAttempt = log.attempt;
}

// ---- nodes -----------------------------------------------------------------------------------

function renderNodes(nodes) {
  if (!changed("nodes", nodes)) return;
  const zones = new Map();
  for (const n of nodes) {
    if (!zones.has(n.zone)) zones.set(n.zone, []);
    zones.get(n.zone).push(n);
  }
  const blocks = [...zones.entries()].sort(([a], [b]) => String(a).localeCompare(String(b))).map(([zone, list]) =>
    el("div", { class: "zone" },
      el("div", { class: "zone-name", text: `zone ${zone}` }),
      el("div", { class: "zone-nodes" }, ...list.map((n) => {
        const hint = [`${n.name}: ${n.state}`];
        if (n.task !== null && n.task !== undefined) hint.push(`task ${n.task}`);
        if (n.reason) hint.push(n.reason);
        return el("div", { class: `node ${n.state}`, title: hint.join(" — "), dataset: { node: n.name, state: n.state } },
          el("span", { class: "node-name", text: n.name }),
          el("span", { class: "node-state", text: n.task !== null && n.task !== undefined ? `task ${n.task}` : n.state }));
      }))));
  fill($("nodes"), blocks.length ? blocks : [el("p", { class: "muted", text: "No nodes." })]);
}

// ---- overview: stats, chart, queue, quotas ---------------------------------------------------

function stat(label, value, cls) {
  return el("div", { class: `stat ${cls || ""}` }, el("div", { class: "stat-value", text: value }),
    el("div", { class: "stat-label", text: label }));
}

function renderOverview(ov) {
  if (!changed("overview", ov)) return;
  const n = ov.nodes || {};
  fill($("stats"), [
    stat("utilisation", `${Math.round((ov.utilisation || 0) * 100)}%`, "accent"),
    stat("nodes", n.total ?? 0), stat("busy", n.busy ?? 0, "busy"), stat("idle", n.idle ?? 0, "idle"),
    stat("drained", n.drained ?? 0, "drained"), stat("unhealthy", n.unhealthy ?? 0, "unhealthy"),
  ]);
  renderChart(ov.history || []);
  const prios = new Set([...Object.keys(ov.queue_by_priority || {}), ...Object.keys(ov.running_by_priority || {})]);
  const active = [...prios].filter((p) => (ov.queue_by_priority || {})[p] || (ov.running_by_priority || {})[p]);
  const rows = active.map((p) => el("tr", {},
    el("td", { text: p }),
    el("td", { class: "num", text: (ov.queue_by_priority || {})[p] || 0 }),
    el("td", { class: "num", text: (ov.running_by_priority || {})[p] || 0 })));
  fill($("queue"), rows.length ? rows : [el("tr", {}, el("td", { colspan: 3, class: "muted", text: "Nothing queued or running." }))]);
  const quota = (ov.quota_use || []).map((q) => {
    const frac = q.quota ? Math.min(1, q.used / q.quota) : 0;
    return el("tr", {},
      el("td", { text: q.user }), el("td", { text: q.group }), el("td", { text: q.priority }),
      el("td", {}, el("div", { class: "quota" },
        el("div", { class: "quota-bar" }, el("div", { class: "quota-fill", style: `width:${(frac * 100).toFixed(1)}%` })),
        el("span", { class: "mono", text: `${q.used} / ${q.quota ?? "∞"}` }))));
  });
  fill($("quota"), quota.length ? quota : [el("tr", {}, el("td", { colspan: 4, class: "muted", text: "No quotas in use." }))]);
}

// Busy nodes over time (filled area) under the usable total (dashed line), drawn as SVG.
function renderChart(history) {
  const box = $("chart");
  if (history.length < 2) {
    fill(box, [el("p", { class: "muted empty", text: "Not enough history yet." })]);
    $("util-span").textContent = "";
    return;
  }
  const W = 640, H = 200, L = 34, R = 10, T = 10, B = 24;
  const t0 = history[0].at, t1 = history[history.length - 1].at;
  const ymax = Math.max(1, ...history.map((h) => Math.max(h.total || 0, h.busy || 0)));
  const x = (t) => L + ((t - t0) / Math.max(1e-9, t1 - t0)) * (W - L - R);
  const y = (v) => T + (1 - v / ymax) * (H - T - B);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart-svg", role: "img", "aria-label": "busy nodes over time" });
  const ticks = ymax <= 8 ? ymax : 4;
  for (let i = 0; i <= ticks; i++) {
    const v = (ymax * i) / ticks;
    root.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid" }));
    root.append(svg("text", { x: L - 6, y: y(v) + 4, class: "axis", "text-anchor": "end" }, Number.isInteger(v) ? v : v.toFixed(1)));
  }
  // time ticks on whole minutes or hours (local time), at most six of them
  const step = [60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400]
    .find((s) => (t1 - t0) / s <= 6) || 86400;
  const offset = new Date(t0 * 1000).getTimezoneOffset() * 60;
  for (let t = Math.ceil((t0 - offset) / step) * step + offset; t <= t1; t += step) {
    root.append(svg("line", { x1: x(t), x2: x(t), y1: y(0), y2: y(0) + 4, class: "grid" }));
    const anchor = x(t) > W - R - 16 ? "end" : x(t) < L + 16 ? "start" : "middle";
    root.append(svg("text", { x: x(t), y: H - 6, class: "axis", "text-anchor": anchor }, fmtClock(t)));
  }
  const pts = history.map((h) => `${x(h.at).toFixed(1)},${y(h.busy || 0).toFixed(1)}`);
  root.append(svg("path", { d: `M${x(t0)},${y(0)} L${pts.join(" L")} L${x(t1)},${y(0)} Z`, class: "area" }));
  root.append(svg("path", { d: `M${pts.join(" L")}`, class: "line" }));
  root.append(svg("path", { d: "M" + history.map((h) => `${x(h.at).toFixed(1)},${y(h.total || 0).toFixed(1)}`).join(" L"), class: "total" }));
  fill(box, [root]);
  $("util-span").textContent = `busy nodes, last ${fmtDuration(t1 - t0)}`;
}

// ---- start -----------------------------------------------------------------------------------

function start() {
  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const token = $("token").value.trim();
    if (token) login(token);
  });
  $("logout").addEventListener("click", () => logout("Signed out."));
  $("detail-close").addEventListener("click", closeDetail);
  $("show-all").addEventListener("change", refreshSoon);
  $("hours").addEventListener("change", refreshSoon);
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) login(token);
  else showLogin("");
}

start();
