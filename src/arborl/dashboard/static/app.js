// arborl dashboard: each page fetches JSON from api/... (relative to <base>) and draws it; curves poll.
"use strict";

const main = document.getElementById("main");
const params = new URLSearchParams(location.search);
const POLL_MS = 5000;

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

async function api(path) {
  const r = await fetch(path, {cache: "no-store"});
  const body = await r.json();
  if (!r.ok) throw new Error(body.detail || `${r.status} ${path}`);
  return body;
}

function fmt(v) {
  if (v === null || v === undefined) return "-";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toPrecision(4);
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

function status(text) { document.getElementById("status").textContent = text; }

function showError(err) { main.append(el("p", {class: "error", text: String(err.message || err)})); }

function setParams(p) {
  const q = new URLSearchParams(location.search);
  for (const [k, v] of Object.entries(p)) { if (v === null) q.delete(k); else q.set(k, v); }
  history.replaceState(null, "", "?" + q.toString());
}

async function runSelect(onChange) {
  const runs = await api("api/runs");
  const sel = el("select", {id: "run"});
  for (const r of runs) sel.append(el("option", {value: r.key, text: r.key}));
  if (params.get("run") && runs.some(r => r.key === params.get("run"))) sel.value = params.get("run");
  sel.addEventListener("change", () => onChange(sel.value));
  return {sel, runs};
}

const PLOT_CONFIG = {responsive: true, displaylogo: false};

// ---------------------------------------------------------------- runs
async function pageRuns() {
  const runs = await api("api/runs");
  if (!runs.length) { main.append(el("p", {text: "no run directories found"})); document.body.dataset.ready = "1"; return; }
  const cols = Object.keys(runs[0].headline);
  const table = el("table", {id: "runs"});
  table.append(el("tr", {}, ...["", ...cols, ""].map(c => el("th", {text: c}))));
  for (const r of runs) {
    const tr = el("tr", {"data-run": r.key});
    tr.append(el("td", {}, el("input", {type: "checkbox", value: r.key, checked: ""})));
    for (const c of cols) tr.append(el("td", {class: typeof r.headline[c] === "number" ? "num" : "", text: fmt(r.headline[c])}));
    const q = "run=" + encodeURIComponent(r.key);
    tr.append(el("td", {}, el("a", {href: "curves?" + q, text: "curves"}), " ",
      el("a", {href: "timeline?" + q, text: "timeline"}), " ", el("a", {href: "trajectories?" + q, text: "trajectories"}),
      " ", el("a", {href: "audit?" + q, text: "audit"}), " ", el("a", {href: "config?" + q, text: "config"})));
    table.append(tr);
  }
  const compare = el("button", {text: "curves of the checked runs", onclick: () => {
    const q = [...table.querySelectorAll("input:checked")].map(i => "run=" + encodeURIComponent(i.value)).join("&");
    location.href = "curves?" + q;
  }});
  main.append(el("h2", {text: `${runs.length} run(s)`}), table, el("p", {}, compare));
  document.body.dataset.ready = "1";
}

// ---------------------------------------------------------------- curves
// a chart's title is HTML above its plot: a Plotly title sits under the plot's toolbar (the modebar); a new
// object per chart, as Plotly writes its ranges into the layout it is given
function chartLayout(more) { return {margin: {l: 50, r: 10, t: 28, b: 30}, xaxis: {title: {text: "step"}}, ...more}; }

// what a run's chart of `metric` draws: its step rows, or, for a held-out column (no step row has it), a line
// per split and the SFT stage's evaluation apart (api/curves' eval_series)
function seriesOf(d, metric) {
  if (d.step.some(r => typeof r[metric] === "number")) return [{name: "", stage: "rl", rows: d.step}];
  return d.eval_series;
}

async function pageCurves() {
  const chosen = params.getAll("run");
  const q = chosen.map(r => "run=" + encodeURIComponent(r)).join("&");
  const head = el("div", {class: "controls"});
  const known = el("div", {class: "grid", id: "curves"});
  const split = el("div", {class: "grid", id: "split"});
  const more = el("details", {id: "more"}, el("summary", {text: "all other metrics"}));
  const moreGrid = el("div", {class: "grid"});
  more.append(moreGrid);
  main.append(head, known, el("h3", {text: "step time split (rollout / train / weight sync / other), seconds"}), split,
    more);
  const charts = new Map();  // metric -> div

  function chart(grid, metric, title) {
    let d = charts.get(metric);
    if (!d) {
      d = el("div", {class: "chart", "data-metric": metric});
      grid.append(el("figure", {class: "panel"}, el("figcaption", {text: title}), d));
      charts.set(metric, d);
    }
    return d;
  }

  async function draw() {
    const data = await api("api/curves" + (q ? "?" + q : ""));
    const runs = Object.keys(data.runs);
    head.textContent = `runs: ${runs.join(", ")} (updates every ${POLL_MS / 1000} s)`;
    const first = data.columns.slice(0, data.known);
    for (const metric of data.columns) {
      const traces = [];
      for (const run of runs) {
        for (const s of seriesOf(data.runs[run], metric)) {
          const pts = s.rows.filter(r => typeof r[metric] === "number");
          if (!pts.length) continue;
          const sft = s.stage === "after_sft";  // one point (per split) at step 0, not joined to the RL line
          traces.push({x: pts.map(r => r.step), y: pts.map(r => r[metric]), type: "scatter",
            name: [runs.length > 1 ? run : "", s.name].filter(Boolean).join(" ") || run,
            mode: sft ? "markers" : "lines+markers", ...(sft ? {marker: {symbol: "star", size: 12}} : {})});
        }
      }
      const grid = first.includes(metric) ? known : moreGrid;
      if (grid === moreGrid && !more.open && !charts.has(metric)) continue;  // drawn when opened
      Plotly.react(chart(grid, metric, metric), traces, chartLayout({showlegend: traces.length > 1 || runs.length > 1}),
        PLOT_CONFIG);
    }
    for (const run of runs) {
      const ts = data.runs[run].time_split;
      const traces = ts.parts.map(p => ({type: "bar", name: p.name, x: ts.x, y: p.y}));
      Plotly.react(chart(split, "split:" + run, run), traces, chartLayout({barmode: "stack",
        yaxis: {title: {text: "s"}}}), PLOT_CONFIG);
    }
    status("updated " + new Date().toLocaleTimeString());
    document.body.dataset.ready = "1";
  }

  more.addEventListener("toggle", () => { if (more.open) draw().catch(showError); });
  await draw();
  setInterval(() => draw().catch(e => status("update failed: " + e.message)), POLL_MS);
}

// ---------------------------------------------------------------- timeline
async function pageTimeline() {
  const controls = el("div", {class: "controls"});
  const info = el("div", {id: "timeline-info"});
  const plot = el("div", {id: "timeline"});
  main.append(controls, info, plot);
  const stepSel = el("select", {id: "step"});
  const {sel} = await runSelect(run => { setParams({run, step: null}); load(run, null); });
  controls.append("run ", sel, " step ", stepSel, el("span", {class: "muted",
    text: "time: seconds since the run started; drag to zoom, double-click to reset; one bar per request or piece, rows grouped by engine"}));
  stepSel.addEventListener("change", () => { setParams({step: stepSel.value}); load(sel.value, stepSel.value); });

  async function load(run, step) {
    const d = await api(`api/timeline?run=${encodeURIComponent(run)}` + (step ? `&step=${step}` : ""));
    stepSel.replaceChildren(...d.steps.map(s => el("option", {value: s, text: s})));
    if (d.step === null) { info.textContent = "this run has no rollout timeline (scheduling.timeline=false, or no step yet)"; Plotly.purge(plot); document.body.dataset.ready = "1"; return; }
    stepSel.value = d.step;
    info.textContent = `step ${d.step}: ${d.bars} bars (pieces) of ${d.requests} requests, ${d.probes} probes, ` +
      `${d.migrations} migrations` + (d.truncated ? `; ${d.truncated} more not drawn` : "");
    plot.dataset.bars = d.bars;
    await Plotly.react(plot, d.figure.data, d.figure.layout, PLOT_CONFIG);
    status("loaded " + new Date().toLocaleTimeString());
    document.body.dataset.ready = "1";
  }
  await load(sel.value, params.get("step"));
}

// ---------------------------------------------------------------- trajectories
const MODES = {
  mask: "loss mask (trained tokens green)",
  logprob: "log-prob of the sampled token (red: unlikely)",
  mismatch: "rollout / trainer mismatch",
  version: "policy version",
};

function tokenColor(t, mode) {
  if (mode === "mask") return t.mask ? "rgb(187, 247, 208)" : "rgb(229, 231, 235)";
  if (!t.mask) return "rgb(243, 244, 246)";
  if (mode === "logprob") {
    const p = Math.exp(Math.max(t.lp ?? 0, -20));
    return `rgb(255, ${Math.round(120 + 135 * p)}, ${Math.round(120 + 135 * p)})`;
  }
  if (mode === "mismatch") {
    if (t.tlp === null || t.tlp === undefined) return "rgb(255, 255, 255)";
    const d = Math.min(1, Math.abs(t.tlp - (t.blp ?? t.lp)));  // against what the trainer compares with
    return `rgb(255, ${Math.round(255 - 200 * d)}, ${Math.round(255 - 255 * d)})`;
  }
  const hue = ((t.v ?? 0) * 67) % 360;
  return `hsl(${hue}, 70%, 85%)`;
}

function tokenTitle(t) {
  return `id ${t.id} ${JSON.stringify(t.text)}\nloss mask ${t.mask}, call ${t.chunk}` + (t.mask ?
    `\nlog-prob ${fmt(t.lp)} (sampling ${fmt(t.slp)}), version ${t.v}` + (t.tlp != null ? `\ntrainer log-prob ${fmt(t.tlp)} (rollout ${fmt(t.blp ?? t.lp)})` : "") : "");
}

function kv(obj) {
  const t = el("table");
  for (const [k, v] of Object.entries(obj || {})) t.append(el("tr", {}, el("td", {text: k}), el("td", {class: "num", text: fmt(v)})));
  return t;
}

function pre(obj) { return el("pre", {text: typeof obj === "string" ? obj : JSON.stringify(obj, null, 2)}); }

async function pageTrajectories() {
  const controls = el("div", {class: "controls"});
  const bucketSel = el("select", {id: "bucket"});
  const groups = el("div", {class: "list", id: "groups"});
  const episodes = el("div", {class: "list", id: "episodes"});
  const detail = el("div", {id: "episode"});
  main.append(controls, el("div", {class: "cols"}, el("div", {}, el("h3", {text: "groups"}), groups),
    el("div", {}, el("h3", {text: "episodes"}), episodes), detail));
  let buckets = [];
  let mode = "mask";
  let current = null;
  const {sel} = await runSelect(run => { setParams({run, step: null, group: null, episode: null}); loadRun(run); });
  controls.append("run ", sel, " step ", bucketSel);
  bucketSel.addEventListener("change", () => { setParams({step: bucketSel.value, group: null, episode: null}); showGroups(); });

  async function loadRun(run) {
    groups.replaceChildren(); episodes.replaceChildren(); detail.replaceChildren();
    try { buckets = await api(`api/groups?run=${encodeURIComponent(run)}`); }
    catch (e) { detail.append(el("p", {class: "error", text: e.message})); document.body.dataset.ready = "1"; return; }
    bucketSel.replaceChildren(...buckets.map(b => el("option", {value: b.bucket, text: `${b.bucket} (${b.groups.length} groups)`})));
    const want = params.get("step");
    const group = params.get("group");
    const holding = group && buckets.find(b => b.groups.some(g => g.group_id === group));
    bucketSel.value = holding ? holding.bucket : (want && buckets.some(b => b.bucket === want) ? want
      : (buckets.filter(b => b.bucket.startsWith("step ")).pop() || buckets[0] || {}).bucket);
    await showGroups();
  }

  async function showGroups() {
    const b = buckets.find(x => x.bucket === bucketSel.value);
    groups.replaceChildren();
    if (!b) { document.body.dataset.ready = "1"; return; }
    for (const g of b.groups) {
      groups.append(el("div", {"data-group": g.group_id, text: `${g.group_id} · ${g.episodes} ep · reward ${fmt(g.mean_reward)}`,
        onclick: () => { setParams({group: g.group_id, episode: null}); showEpisodes(g.group_id); }}));
    }
    const want = params.get("group");
    await showEpisodes(b.groups.some(g => g.group_id === want) ? want : b.groups[0].group_id);
  }

  async function showEpisodes(group) {
    for (const d of groups.children) d.classList.toggle("on", d.dataset.group === group);
    const eps = await api(`api/episodes?run=${encodeURIComponent(sel.value)}&group=${encodeURIComponent(group)}`);
    episodes.replaceChildren(...eps.map(e => el("div", {"data-episode": e.episode_id,
      text: `${e.task_id} · ${e.status} · reward ${fmt(e.reward)}`, onclick: () => showEpisode(e.episode_id)})));
    const want = params.get("episode");
    await showEpisode(eps.some(e => e.episode_id === want) ? want : eps[0].episode_id);
  }

  function renderTokens() {
    for (const span of detail.querySelectorAll(".tok")) span.style.backgroundColor = tokenColor(current.tokens[+span.dataset.i], mode);
  }

  async function showEpisode(id) {
    setParams({episode: id});
    for (const d of episodes.children) d.classList.toggle("on", d.dataset.episode === id);
    const ep = await api(`api/episode?run=${encodeURIComponent(sel.value)}&id=${encodeURIComponent(id)}`);
    detail.replaceChildren();
    detail.append(el("h3", {text: `episode ${ep.episode_id}`}),
      el("p", {text: `task ${ep.task_id} · group ${ep.group_id} · ${ep.agent_kind} · ${ep.status} · reward ${fmt(ep.reward)}` +
        (ep.decoded ? "" : " · no tokenizer: token ids shown")}));
    detail.append(el("h4", {text: "reward components"}), kv(ep.reward_components));
    if (ep.process_rewards.length) detail.append(el("h4", {text: "process rewards"}), pre(ep.process_rewards));
    const modeBox = el("div", {class: "controls", id: "modes"}, "colour by:");
    for (const [m, label] of Object.entries(MODES)) {
      const disabled = m === "mismatch" && !ep.has_trainer_logprobs;
      const r = el("input", {type: "radio", name: "mode", value: m});
      if (m === mode) r.checked = true;
      if (disabled) r.disabled = true;
      r.addEventListener("change", () => { mode = m; renderTokens(); });
      modeBox.append(el("label", {title: disabled ? "no trainer log-probs recorded in this run" : ""}, r, " " + label));
    }
    detail.append(modeBox);
    const all = [];
    ep.samples.forEach((s, si) => {
      const box = el("div", {class: "tokens", "data-sample": si});
      let chunk = -1;
      for (const t of s.tokens) {
        const span = el("span", {class: "tok" + (t.chunk !== chunk ? " chunk-start" : ""), "data-i": all.length,
          "data-id": t.id, "data-mask": t.mask, title: tokenTitle(t)});
        span.textContent = t.text === "" ? `⟨${t.id}⟩` : t.text;
        chunk = t.chunk;
        all.push(t);
        box.append(span);
      }
      detail.append(el("h4", {text: `sample ${si + 1}: calls ${s.call_ids.join(", ")} (finish: ${s.finish_reason})`}), box);
      if (s.drift_events.length) detail.append(el("p", {class: "error", text: "drift: " + JSON.stringify(s.drift_events)}));
    });
    current = {tokens: all};
    renderTokens();
    const calls = el("table", {id: "calls"});
    calls.append(el("tr", {}, ...["#", "call", "engine", "finish", "prompt", "generated", "cached", "latency s", "versions", "tool calls", "drift"].map(c => el("th", {text: c}))));
    for (const c of ep.calls) {
      calls.append(el("tr", {}, ...[c.index, c.call_id, c.engine_id, c.finish_reason, c.prompt_tokens, c.completion_tokens,
        c.cached_prompt_tokens, c.latency_s, `${c.min_version}-${c.max_version}`, fmt(c.meta.tool_calls), c.drift ? JSON.stringify(c.drift) : ""]
        .map(v => el("td", {text: fmt(v)}))));
    }
    detail.append(el("h4", {text: "calls"}), calls);
    if (ep.aborted_calls.length) detail.append(el("h4", {text: "aborted calls (never trained)"}), pre(ep.aborted_calls));
    if (ep.interactions.length) detail.append(el("h4", {text: "tool calls and results"}), pre(ep.interactions));
    for (const [k, v] of Object.entries(ep.meta)) {
      detail.append(el("details", {open: ""}, el("summary", {text: k}), pre(v)));
    }
    detail.append(el("details", {}, el("summary", {text: "calls' meta"}), pre(ep.calls.map(c => c.meta))));
    status("loaded " + new Date().toLocaleTimeString());
    document.body.dataset.ready = "1";
  }

  await loadRun(sel.value);
}

// ---------------------------------------------------------------- token audit
// `arborl audit` over the run's data pool: computed when asked (the tokenizer, every recorded call), so
// on this page only and not polled
const AUDIT_COUNTS = [
  ["calls", "calls", "every recorded call"],
  ["audited", "re-rendered", "chat calls whose request was recorded, rendered again with the chat template"],
  ["drift_calls", "drifted", "the re-render's tokens differ from the ones the engine consumed"],
  ["drift_rate", "drift rate", "drifted / re-rendered"],
  ["unfaithful_calls", "unfaithful", "the prompt does not extend the tokens the episode's earlier call produced: trained on a history the policy did not generate"],
  ["unfaithful_rate", "unfaithful rate", "unfaithful / calls"],
  ["not_recorded", "not recorded", "chat calls recorded without their request (gateway.record_messages off)"],
  ["token_calls", "token-in", "token-in and completions calls: no conversation to re-render"],
];

async function pageAudit() {
  const controls = el("div", {class: "controls"});
  const body = el("div", {id: "audit"});
  main.append(controls, body);
  const {sel} = await runSelect(run => { setParams({run}); load(run); });
  controls.append("run ", sel, el("span", {class: "muted",
    text: "every recorded chat call rendered again with the run's chat template and compared with the token ids the engine consumed (arborl audit)"}));

  async function load(run) {
    delete document.body.dataset.ready;
    body.replaceChildren(el("p", {class: "muted", text: "auditing: loading the tokenizer and reading the data pool..."}));
    let d;
    try { d = await api(`api/audit?run=${encodeURIComponent(run)}`); }
    catch (e) { body.replaceChildren(el("p", {class: "error", text: e.message})); document.body.dataset.ready = "1"; return; }
    const counts = el("table", {id: "audit-counts"});
    for (const [k, label, meaning] of AUDIT_COUNTS) {
      const v = k.endsWith("_rate") ? (100 * d[k]).toFixed(1) + " %" : fmt(d[k]);
      counts.append(el("tr", {"data-key": k}, el("td", {text: label}), el("td", {class: "num", text: v}),
        el("td", {class: "muted", text: meaning})));
    }
    const ex = el("table", {id: "audit-examples"});
    ex.append(el("tr", {}, ...["call", "episode", "at token", "stitched", "unfaithful", "engine's tokens", "re-render's tokens"]
      .map(c => el("th", {text: c}))));
    for (const e of d.examples) {
      ex.append(el("tr", {"data-call": e.call_id}, el("td", {text: e.call_id}), el("td", {text: e.episode_id}),
        el("td", {class: "num", text: fmt(e.position)}),
        el("td", {text: e.stitched ? "yes: trained on the engine's tokens" : "no"}), el("td", {text: e.unfaithful ? "yes" : "no"}),
        el("td", {class: "mono", text: JSON.stringify(e.engine)}), el("td", {class: "mono", text: JSON.stringify(e.rerender)})));
    }
    body.replaceChildren(el("h3", {text: "counts"}), counts,
      el("h3", {text: `first drifted calls (${d.examples.length} of ${d.drift_calls}; the tokens from the first difference on, JSON-quoted)`}),
      d.examples.length ? ex : el("p", {id: "audit-none", text: "none: every re-rendered call is token for token what the engine consumed"}));
    status("audited " + new Date().toLocaleTimeString());
    document.body.dataset.ready = "1";
  }
  await load(sel.value);
}

// ---------------------------------------------------------------- config
async function pageConfig() {
  const controls = el("div", {class: "controls"});
  const body = el("div");
  main.append(controls, body);
  const only = el("input", {type: "checkbox", id: "only-changed"});
  const {sel} = await runSelect(run => { setParams({run}); load(run); });
  controls.append("run ", sel, el("label", {}, only, " only knobs changed from their defaults"));
  let knobs = [];

  function table() {
    const t = el("table", {id: "knobs"});
    t.append(el("tr", {}, ...["knob", "value", "default", "meaning"].map(c => el("th", {text: c}))));
    for (const k of knobs) {
      if (only.checked && !k.changed) continue;
      t.append(el("tr", {class: k.changed ? "changed" : "", "data-key": k.key}, el("td", {text: k.key}),
        el("td", {text: fmt(k.value)}), el("td", {text: fmt(k.default)}), el("td", {text: k.description})));
    }
    return t;
  }

  async function load(run) {
    const d = await api(`api/config?run=${encodeURIComponent(run)}`);
    knobs = d.knobs;
    const holder = el("div", {}, table());
    only.onchange = () => holder.replaceChildren(table());
    body.replaceChildren(el("p", {text: d.path}), el("h3", {text: "summary"}), kv(d.summary),
      el("h3", {text: `knobs (${knobs.filter(k => k.changed).length} changed from the defaults)`}), holder,
      el("h3", {text: "changes made by resumes"}), pre(d.changes.length ? d.changes : "none"),
      el("details", {}, el("summary", {text: "config.yaml"}), pre(d.config_yaml)));
    document.body.dataset.ready = "1";
  }
  await load(sel.value);
}

const PAGES = {runs: pageRuns, curves: pageCurves, timeline: pageTimeline, trajectories: pageTrajectories, audit: pageAudit,
  config: pageConfig};
if (typeof Plotly === "undefined") {
  showError("the charts' library did not load: install it with pip install 'arborl[dashboard]'");
  document.body.dataset.ready = "error";
} else {
  PAGES[document.body.dataset.page]().catch(e => { showError(e); document.body.dataset.ready = "error"; });
}
