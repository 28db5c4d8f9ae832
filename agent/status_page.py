"""The status page: one HTML document with its CSS and JavaScript inline, served at ``/`` by
agent/metrics_http.py. It loads nothing from anywhere else (no fonts, scripts or images);
it polls the JSON endpoints (agent/status.py) every ``POLL_MS`` and redraws in place.

Rules:
- Everything a peer sent (names, tags, addresses, event messages) is attacker-controlled:
  the script writes it with ``textContent`` and DOM nodes only, never as markup
  (``innerHTML`` is not used anywhere).
- ``CONTENT_SECURITY_POLICY`` (sent with the page) allows only this script and this style,
  by their SHA-256 hashes, and connections to the page's own origin: even a markup bug
  could run no injected script and load nothing from outside.
- Read-only: the page only GETs.
"""

from __future__ import annotations

import base64
import hashlib

__all__ = ["CONTENT_SECURITY_POLICY", "PAGE", "POLL_MS"]

POLL_MS = 1000
"""How often the page polls: a member's death shows within a second of this agent's
verdict; four small GETs per second per open page. A poll that takes longer (a large
cluster, a busy agent) waits twice its own duration before the next."""

_STYLE = """
:root { --ok:#1a7f37; --warn:#9a6700; --bad:#cf222e; --dim:#6e7781; --line:#d0d7de; }
* { box-sizing: border-box; }
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #1f2328; background: #f6f8fa; }
header { display: flex; gap: 1em; align-items: baseline; padding: .6em 1em;
  background: #24292f; color: #fff; }
header h1 { font-size: 1.2em; margin: 0; }
header a { color: #9ecbff; margin-left: auto; }
main { padding: .5em 1em 2em; }
section { background: #fff; border: 1px solid var(--line); border-radius: 6px;
  margin: .8em 0; padding: .5em .8em; }
h2 { font-size: 1.05em; margin: .2em 0 .5em; }
.pill { border-radius: 1em; padding: 0 .6em; font-size: .85em; background: var(--dim); }
.pill.ok { background: var(--ok); } .pill.bad { background: var(--bad); }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(210px, 1fr));
  gap: .6em; }
.card { border: 1px solid var(--line); border-radius: 6px; padding: .4em .6em; }
.card h3 { font-size: .8em; text-transform: uppercase; color: var(--dim); margin: 0 0 .3em; }
.card dl { display: grid; grid-template-columns: auto auto; margin: 0; gap: 0 .8em; }
.card dd { margin: 0; text-align: right; font-variant-numeric: tabular-nums; }
.controls { display: flex; gap: .6em; margin-bottom: .5em; }
.controls input { flex: 1; max-width: 24em; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .2em .5em; border-bottom: 1px solid var(--line);
  vertical-align: top; overflow-wrap: anywhere; }
th { background: #f6f8fa; position: sticky; top: 0; }
th[data-key] { cursor: pointer; user-select: none; }
th[aria-sort=ascending]::after { content: " \\25B2"; }
th[aria-sort=descending]::after { content: " \\25BC"; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.st-alive .status, .ok-text { color: var(--ok); }
.st-suspect .status, .warn-text { color: var(--warn); font-weight: 600; }
.st-dead .status, .bad-text { color: var(--bad); font-weight: 600; }
.st-left .status, .dim { color: var(--dim); }
.st-dead, .st-suspect { background: #fff8f0; }
.scroll { max-height: 28em; overflow: auto; }
.node { display: inline-block; margin: 0 .6em .1em 0; }
footer { color: var(--dim); padding: 0 1em 1em; }
"""

_SCRIPT = """
"use strict";
const POLL_MS = @POLL_MS@;
const STATUS_RANK = {dead: 0, suspect: 1, left: 2, alive: 3};
const state = {members: [], sortKey: "name", sortDir: 1, lastCpu: null, updates: 0};
const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function fill(parent, children) { parent.replaceChildren(...children); }
function tagsText(tags) {
  return Object.keys(tags || {}).sort().map((k) => k + "=" + tags[k]).join(", ");
}
function duration(ms) {
  if (ms === null || ms === undefined) return "-";
  const s = Math.floor(ms / 1000);
  if (s < 120) return s + " s";
  if (s < 7200) return Math.floor(s / 60) + " min";
  if (s < 172800) return Math.floor(s / 3600) + " h";
  return Math.floor(s / 86400) + " d";
}
function clock(ms) { return ms ? new Date(ms).toLocaleTimeString() : "-"; }
function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}
async function getJSON(path) {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), 4000);
  try {
    const r = await fetch(path, {cache: "no-store", signal: ctl.signal});
    if (!r.ok) throw new Error(path + ": HTTP " + r.status);
    return await r.json();
  } finally { clearTimeout(timer); }
}

const COLUMNS = {
  name: (m) => m.name,
  address: (m) => m.addr + ":" + m.port,
  status: (m) => STATUS_RANK[m.status],
  incarnation: (m) => m.incarnation,
  phi: (m) => m.phi,
  rtt_ms: (m) => m.rtt_ms,
  since_ms: (m) => m.since_ms,
  tags: (m) => tagsText(m.tags),
};
function compare(a, b) {
  const get = COLUMNS[state.sortKey];
  const x = get(a), y = get(b);
  if (x === y) return a.name < b.name ? -1 : a.name > b.name ? 1 : 0;
  if (x === null || x === undefined) return 1;
  if (y === null || y === undefined) return -1;
  return (x < y ? -1 : 1) * state.sortDir;
}
function renderMembers() {
  const text = $("filter").value.toLowerCase();
  const status = $("status-filter").value;
  const rows = state.members.filter((m) => {
    if (status && m.status !== status) return false;
    if (!text) return true;
    const hay = [m.name, m.addr + ":" + m.port, m.status, tagsText(m.tags)].join(" ");
    return hay.toLowerCase().includes(text);
  }).sort(compare);
  const trs = rows.map((m) => {
    const tr = el("tr", null, "st-" + m.status);
    tr.dataset.name = m.name;
    tr.dataset.status = m.status;
    tr.append(
      el("td", m.name, "name"), el("td", m.addr + ":" + m.port),
      el("td", m.status, "status"), el("td", m.incarnation, "num"),
      el("td", m.phi === null ? "-" : m.phi.toFixed(2), "num"),
      el("td", m.rtt_ms === null ? "-" : m.rtt_ms + " ms", "num"),
      el("td", duration(m.since_ms), "num"), el("td", tagsText(m.tags), "tags"));
    return tr;
  });
  fill($("members").tBodies[0], trs);
  $("member-count").textContent = rows.length + " of " + state.members.length;
  for (const th of document.querySelectorAll("#members th[data-key]")) {
    if (th.dataset.key === state.sortKey) {
      th.setAttribute("aria-sort", state.sortDir > 0 ? "ascending" : "descending");
    } else th.removeAttribute("aria-sort");
  }
}

function card(title, pairs) {
  const c = el("div", null, "card");
  const dl = el("dl");
  for (const [k, v, cls] of pairs) dl.append(el("dt", k), el("dd", v, cls));
  c.append(el("h3", title), dl);
  return c;
}
function renderInfo(info) {
  const s = info.stats || {}, m = info.members || {}, p = info.process || {};
  let cpu = "-";
  if (state.lastCpu && p.wall_s > state.lastCpu.wall_s) {
    cpu = (100 * (p.cpu_s - state.lastCpu.cpu_s) / (p.wall_s - state.lastCpu.wall_s))
      .toFixed(1) + " %";
  }
  state.lastCpu = {cpu_s: p.cpu_s, wall_s: p.wall_s};
  $("node").textContent = info.node;
  document.title = "swim: " + info.node;
  const hs = info.health_score;
  fill($("health"), [
    card("This agent", [["address", info.addr + ":" + info.port],
      ["incarnation", info.incarnation], ["profile", info.profile],
      ["encrypted", info.encrypted ? "yes" : "no"], ["uptime", duration(info.uptime_ms)],
      ["version", info.version]]),
    card("Lifeguard", [["health score", hs, hs > 0 ? "warn-text" : "ok-text"],
      ["stalls", s.stalls], ["refutations", s.refutations],
      ["broadcast queue", s.broadcast_queue]]),
    card("Members", [["alive", m.alive, "ok-text"], ["suspect", m.suspect, "warn-text"],
      ["dead", m.dead, "bad-text"], ["left", m.left, "dim"]]),
    card("Probes", [["sent", s.probes_sent], ["failed", s.probes_failed],
      ["indirect", s.indirect_probes_sent], ["nacks", s.nacks_received],
      ["TCP fallback", s.tcp_fallback_probes], ["TCP rescues", s.tcp_fallback_rescues]]),
    card("Verdicts", [["suspicions raised", s.suspicions_raised],
      ["verifications", s.suspicion_verifications], ["deaths declared", s.deaths_declared],
      ["cross-checks", s.cross_check_probes]]),
    card("Gossip", [["packets in", s.packets_in], ["packets out", s.packets_out],
      ["bytes in", bytes(s.bytes_in)], ["bytes out", bytes(s.bytes_out)]]),
    card("Process", [["pid", p.pid], ["CPU", cpu], ["RSS", bytes(p.rss_bytes)],
      ["peak RSS", bytes(p.max_rss_bytes)]]),
  ]);
}

function rankHealth(local) {
  // hung ranks, then ranks in a declared pause (spared from hang scoring) with the reason
  if (!local) return "-";
  const parts = local.hung_ranks.map(String).concat((local.paused || []).map((p) =>
    p.local_rank + " paused (" + p.reason + ")"), Object.keys(local.slow || {}).map((n) =>
    "node " + n + " slow (" + local.slow[n].toFixed(2) + "\u00d7)"));
  return parts.join(", ") || "-";
}

function renderJobs(data) {
  const trs = data.jobs.map((j) => {
    const nodes = el("td");
    for (const n of j.nodes) {
      // a hot spare is in the view but does not train: marked, in the neutral colour
      const spare = n.role === "spare";
      const label = n.name + (n.ranks > 1 ? " \\u00d7" + n.ranks : "") +
        (spare ? " [spare]" : "") +
        (n.in_view ? "" : " (" + (n.health === "hung" ? "hung" : n.status) + ")");
      nodes.append(el("span", label,
        "node " + (!n.in_view ? "bad-text" : spare ? "dim" : "ok-text")));
    }
    const local = j.local;
    // training nodes, and the target where this node's trainers reported one: "2/3"
    const target = local && local.target ? "/" + local.target : "";
    const steps = local ? Object.keys(local.steps).map((r) => r + ":" + local.steps[r])
      .join(" ") : "-";
    const tr = el("tr");
    tr.dataset.job = j.job;
    tr.append(el("td", j.job), el("td", j.training + target, "num"),
      el("td", j.spares, "num"), el("td", j.ranks, "num"), el("td", j.formations, "num"),
      el("td", clock(j.formed_ms)), el("td", j.hung_nodes.join(", ") || "-", "bad-text"),
      el("td", local ? local.registered.length + "/" + local.local_world_size : "-"),
      el("td", steps), el("td", rankHealth(local), "bad-text"), nodes);
    return tr;
  });
  if (!trs.length) {
    const tr = el("tr"), td = el("td", "no job registered on any member", "dim");
    td.colSpan = 11; tr.append(td); trs.push(tr);
  }
  fill($("jobs").tBodies[0], trs);
  $("jobs-omitted").textContent = data.omitted ? data.omitted + " more not shown" : "";
}

function renderEvents(data) {
  const trs = data.events.slice().reverse().map((e) => {
    const tr = el("tr", null, "st-" + (e.status || ""));
    const what = e.type === "user_event" ? (e.name + " (" + e.payload_bytes + " B)")
      : (e.message || "");
    tr.append(el("td", clock(e.time_ms)), el("td", e.type), el("td", e.node || ""),
      el("td", e.status || "", "status"),
      el("td", e.incarnation === undefined ? "" : e.incarnation, "num"), el("td", what));
    return tr;
  });
  fill($("events").tBodies[0], trs);
  $("events-missed").textContent = data.missed ?
    "(events were lost " + data.missed + " time(s): the reader fell behind)" : "";
}

async function poll() {
  const started = performance.now();
  try {
    const [info, members, jobs, events] = await Promise.all([getJSON("/v1/info"),
      getJSON("/v1/members"), getJSON("/v1/jobs"), getJSON("/v1/events")]);
    renderInfo(info);
    state.members = members.members;
    renderMembers();
    renderJobs(jobs);
    renderEvents(events);
    state.updates++;
    document.body.dataset.updates = String(state.updates);
    $("conn").textContent = "live";
    $("conn").className = "pill ok";
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (err) {
    $("conn").textContent = "agent unreachable";
    $("conn").className = "pill bad";
    $("updated").textContent = String(err && err.message || err);
  } finally {
    // a large cluster or a busy agent slows the page down instead of the agent
    setTimeout(poll, Math.max(POLL_MS, 2 * (performance.now() - started)));
  }
}

for (const th of document.querySelectorAll("#members th[data-key]")) {
  th.addEventListener("click", () => {
    const key = th.dataset.key;
    state.sortDir = state.sortKey === key ? -state.sortDir : 1;
    state.sortKey = key;
    renderMembers();
  });
}
$("filter").addEventListener("input", renderMembers);
$("status-filter").addEventListener("change", renderMembers);
poll();
""".replace("@POLL_MS@", str(POLL_MS))

_BODY = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>swim agent</title><link rel="icon" href="data:,">
<style>@STYLE@</style></head>
<body data-updates="0">
<header><h1>swim agent <span id="node"></span></h1><span id="conn" class="pill">connecting</span>
<span id="updated"></span><a href="/metrics">Metrics</a></header>
<main>
<section><h2>Health</h2><div id="health" class="cards"></div></section>
<section><h2>Members <span id="member-count" class="dim"></span></h2>
<div class="controls"><input id="filter" type="search" placeholder="filter: name, address, tag"
 aria-label="filter members"><select id="status-filter" aria-label="status">
<option value="">every status</option><option>alive</option><option>suspect</option>
<option>dead</option><option>left</option></select></div>
<div class="scroll"><table id="members"><thead><tr><th data-key="name">Name</th>
<th data-key="address">Address</th><th data-key="status">Status</th>
<th data-key="incarnation">Incarnation</th><th data-key="phi">Phi</th>
<th data-key="rtt_ms">RTT</th><th data-key="since_ms">Since</th><th data-key="tags">Tags</th>
</tr></thead><tbody></tbody></table></div></section>
<section><h2>Jobs <span id="jobs-omitted" class="dim"></span></h2><div class="scroll">
<table id="jobs"><thead><tr><th>Job</th><th>Training</th><th>Spares</th><th>Ranks</th>
<th>Formations</th>
<th>Formed</th><th>Hung nodes</th><th>Local ranks</th><th>Steps</th><th>Hung / paused ranks</th>
<th>Members</th></tr></thead><tbody></tbody></table></div></section>
<section><h2>Recent events <span id="events-missed" class="bad-text"></span></h2>
<div class="scroll"><table id="events"><thead><tr><th>Time</th><th>Event</th><th>Member</th>
<th>Status</th><th>Incarnation</th><th>Detail</th></tr></thead><tbody></tbody></table></div>
</section></main>
<footer>Read-only. Polls this agent every @POLL_S@ s; the view is this agent's.</footer>
<script>@SCRIPT@</script>
</body></html>
"""


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


PAGE = (
    _BODY.replace("@POLL_S@", f"{POLL_MS / 1000:g}")
    .replace("@STYLE@", _STYLE)
    .replace("@SCRIPT@", _SCRIPT)
    .encode()
)
CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; script-src {_sha256(_SCRIPT)}; style-src {_sha256(_STYLE)}; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
"""Only the inline script and style above run, fetches go to the page's own origin."""
