// Molt's page: a chat over the service's own streaming /v1/chat/completions, each token
// coloured by the rung that produced it (the `molt` object on every chunk names it), each
// switch a marker with its cost, and a live chart of the budget and the footprint. No
// framework and nothing fetched from elsewhere: the page must work on a machine without a
// network.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG_NS = "http://www.w3.org/2000/svg";
/** How often the status is read while the server answers, ms. */
const POLL_MS = 1000;
/** The longest wait between two attempts to reach a server that does not answer, ms. */
const POLL_MAX_BACKOFF_MS = 10000;
/** How much history the chart shows at most, and at least, ms. */
const WINDOW_MS = 120000;
const MIN_WINDOW_MS = 20000;
/** How a 401 starts, so that a good key clears it. */
const KEY_NEEDED = "The server needs an API key";

const state = {
  key: sessionStorage.getItem("molt-key") || "",
  rungs: [],            // names, largest first (from the status)
  rungCosts: [],        // the status's engine.rungs
  history: [],          // the conversation, as the API takes it
  streaming: null,      // the AbortController of the answer in flight
  series: { budget: [], rss: [], foot: [] }, // [ms, MiB or null]
  pollTimer: 0,
  pollRound: 0,
  pollFailures: 0,
};

// ---- API ----------------------------------------------------------------------------------

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

/** The server's words for a failed response, with what the user can do about it. */
async function describeFailure(resp) {
  let message = "";
  try {
    const body = await resp.json();
    message = (body && body.error && body.error.message) || "";
  } catch (_) {
    message = "";
  }
  const said = message ? ": " + message : "";
  switch (resp.status) {
    case 401:
      return KEY_NEEDED + " (401)" + said + " Enter it under “API key”.";
    case 503:
      return "The server cannot take the request now (503)" + said;
    case 400:
      return "The server refused the request (400)" + said;
    default:
      return "The server answered " + resp.status + said;
  }
}

function showError(text) {
  const e = $("error");
  e.textContent = text;
  e.hidden = !text;
}

async function postJson(path, body, signal) {
  return fetch(path, {
    method: "POST",
    headers: headers(true),
    body: JSON.stringify(body),
    signal,
  });
}

// ---- Rungs and legend ---------------------------------------------------------------------

/** The colour class of a rung: its place in the ladder, largest first. */
function rungClass(name) {
  let i = state.rungs.indexOf(name);
  if (i < 0) i = state.rungs.length;
  return "r" + Math.min(i, 4);
}

function renderLegend(engine) {
  const ul = $("legend");
  ul.replaceChildren();
  for (const r of state.rungCosts) {
    const li = document.createElement("li");
    if (r.name === engine.current_rung) li.className = "current";
    const name = document.createElement("span");
    name.className = "tok " + rungClass(r.name);
    name.textContent = r.name;
    li.append(name, " " + fmt(r.resident_mib) + " MiB resident, " +
      fmt(r.full_context_mib) + " MiB with a full context");
    ul.append(li);
  }
}

function fmt(x, digits = 0) {
  return x == null ? "–" : Number(x).toFixed(digits);
}

// ---- Status poll --------------------------------------------------------------------------

/** Reads the status once a second; a server that does not answer is tried again, less often
 * the longer it stays away, and the page says so meanwhile. */
async function poll() {
  clearTimeout(state.pollTimer);
  // A poll started while another is in flight supersedes it, so only one loop ever runs.
  const round = ++state.pollRound;
  let next = POLL_MS;
  try {
    const resp = await fetch("/v1/molt/status", { headers: headers(false) });
    if (!resp.ok) {
      const text = await describeFailure(resp);
      if (round !== state.pollRound) return;
      setConn(resp.status === 401 ? "API key needed" : "status unavailable", true);
      if (resp.status === 401) showError(text);
      next = POLL_MS * 3;
    } else {
      const s = await resp.json();
      if (round !== state.pollRound) return;
      if ($("error").textContent.startsWith(KEY_NEEDED)) showError("");
      state.pollFailures = 0;
      onStatus(s);
    }
  } catch (_) {
    if (round !== state.pollRound) return;
    state.pollFailures += 1;
    next = Math.min(POLL_MS * 2 ** state.pollFailures, POLL_MAX_BACKOFF_MS);
    setConn("server unreachable, trying again in " + Math.round(next / 1000) + " s", true);
  }
  state.pollTimer = setTimeout(poll, next);
}

function setConn(text, down) {
  const c = $("conn");
  c.textContent = text;
  c.classList.toggle("down", down);
}

function onStatus(s) {
  const now = Date.now();
  const e = s.engine;
  $("model").textContent = s.model;
  state.rungCosts = e.rungs;
  state.rungs = e.rungs.map((r) => r.name);
  renderLegend(e);
  setConn("connected · on " + e.current_rung + " · queue " + s.queue.waiting + "/" +
    s.queue.capacity, false);
  $("stats").textContent = "answers " + s.counters.completed + ", stopped " +
    s.counters.cancelled + ", switches " + s.counters.switches + ", tokens " +
    s.counters.tokens + "; resident set " + fmt(s.rss_mib) + " MiB";
  showBudget(s.budget);
  addPoint("rss", now, s.rss_mib);
  addPoint("foot", now, e.measured_footprint_mib);
  // While an answer streams its own budget events are newer than the status, which reports
  // a trace's value at the start of an answer.
  if (!state.streaming) addPoint("budget", now, s.budget.budget_mib);
  drawChart();
}

function showBudget(b) {
  // A trace's value is reported at the start of an answer; the answer's own budget events
  // tell where it went from there.
  const when = b.mode === "trace" ? " at the start of an answer" : " now";
  $("budget-now").textContent = b.mode + ": " + b.description +
    (b.budget_mib == null ? "" : " (" + fmt(b.budget_mib) + " MiB" + when + ")");
}

// ---- Chart --------------------------------------------------------------------------------

function addPoint(series, t, v) {
  const s = state.series[series];
  s.push([t, v == null ? null : Number(v)]);
  while (s.length > 2 && s[1][0] < t - WINDOW_MS) s.shift();
}

function svg(tag, attrs, text) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text != null) el.textContent = text;
  return el;
}

/** Budget (a step line: it holds until the next change), resident set and the loaded rungs'
 * measured footprint over the last two minutes at most, with each rung's full-context need
 * dotted. The engine publishes the footprint when an answer starts and ends, so during an
 * answer the resident set is the live line. */
function drawChart() {
  const chart = $("chart");
  const desc = chart.querySelector("desc");
  chart.replaceChildren(desc);
  const W = 480, H = 220, L = 44, R = 8, T = 8, B = 22;
  // The window grows with the page's age up to two minutes, so a first answer fills it.
  const now = Date.now();
  const first = Math.min(now, ...Object.values(state.series).filter((s) => s.length)
    .map((s) => s[0][0]));
  const span = Math.min(WINDOW_MS, Math.max(MIN_WINDOW_MS, now - first));
  const t0 = now - span;
  // The scale follows what the engine occupies and could occupy; a budget far above that
  // (a trace's "plenty" before its cut) is drawn along the top edge instead of flattening
  // everything else.
  const held = [];
  for (const k of ["rss", "foot"]) for (const [, v] of state.series[k]) if (v != null) held.push(v);
  for (const r of state.rungCosts) held.push(r.full_context_mib);
  const base = Math.max(1, ...held);
  const budgets = state.series.budget.map(([, v]) => v).filter((v) => v != null && v <= 3 * base);
  const top = Math.max(base, ...budgets) * 1.1;
  const x = (t) => L + ((Math.max(t, t0) - t0) / span) * (W - L - R);
  const y = (v) => T + (1 - Math.min(v, top) / top) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const v = (top / 4) * i;
    chart.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v) }));
    chart.append(svg("text", { x: L - 4, y: y(v) + 3, "text-anchor": "end" }, fmt(v)));
  }
  const step = [5, 10, 15, 30].find((s) => span / 1000 / s <= 5) || 30;
  for (let s = 0; s * 1000 <= span; s += step) {
    chart.append(svg("text", { x: x(now - s * 1000), y: H - 6, "text-anchor": "middle" },
      s === 0 ? "now" : "−" + s + " s"));
  }
  chart.append(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  chart.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  for (const r of state.rungCosts) {
    const yy = y(r.full_context_mib);
    chart.append(svg("line", { class: "rung", x1: L, x2: W - R, y1: yy, y2: yy }));
    chart.append(svg("text", { x: W - R - 2, y: yy - 2, "text-anchor": "end" }, r.name));
  }
  const path = (series, step) => {
    let d = "", pen = false, prevY = 0;
    for (const [t, v] of state.series[series]) {
      if (v == null) { pen = false; continue; }
      const X = x(t).toFixed(1), Y = y(v).toFixed(1);
      if (!pen) d += "M" + X + " " + Y;
      else d += (step ? "H" + X + "V" + Y : "L" + X + " " + Y);
      pen = true; prevY = Y;
    }
    if (pen && step) d += "H" + x(now).toFixed(1) + "V" + prevY;
    return d;
  };
  for (const [series, step] of [["budget", true], ["rss", false], ["foot", true]]) {
    const d = path(series, step);
    if (d) chart.append(svg("path", { class: series, d }));
  }
  const last = state.series.budget[state.series.budget.length - 1];
  if (last && last[1] == null) {
    chart.append(svg("text", { x: L + 6, y: T + 10 }, "budget: unlimited"));
  } else if (last && last[1] > top) {
    chart.append(svg("text", { x: L + 6, y: T + 10 }, "budget: " + fmt(last[1]) +
      " MiB, above the chart"));
  }
}

// ---- Chat ---------------------------------------------------------------------------------

function addMessage(role) {
  const li = document.createElement("li");
  li.className = role;
  const who = document.createElement("p");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Molt";
  const body = document.createElement("p");
  body.className = "answer";
  li.append(who, body);
  $("log").append(li);
  return li;
}

function marker(cls, text, title) {
  const m = document.createElement("span");
  m.className = cls;
  m.setAttribute("role", "note");
  m.textContent = text;
  if (title) m.title = title;
  return m;
}

/** One answer as its stream arrives. */
class Answer {
  constructor(li) {
    this.li = li;
    this.body = li.querySelector(".answer");
    this.meta = document.createElement("p");
    this.meta.className = "meta";
    li.append(this.meta);
    this.text = "";
    this.rung = "";
    this.ended = false;
    li.dataset.state = "streaming";
    this.meta.textContent = "waiting…";
  }

  token(content, m) {
    this.rung = m ? m.rung : this.rung;
    const span = document.createElement("span");
    span.className = "tok " + rungClass(this.rung);
    span.dataset.rung = this.rung;
    if (m) {
      span.dataset.index = m.index;
      span.title = this.rung + " · token " + m.index + " · " + fmt(m.latency_ms, 1) + " ms";
    }
    span.textContent = content;
    this.body.append(span);
    this.text += content;
    if (m) this.meta.textContent = "on " + this.rung + " · " + (m.index + 1) + " tokens";
  }

  /** A chunk's `molt` event other than a token. */
  event(m) {
    const now = Date.now();
    switch (m.event) {
      case "queued":
        this.meta.textContent = "queued, position " + m.position;
        break;
      case "deferred":
        this.meta.textContent = "waiting for memory: " + m.reason;
        break;
      case "start":
        this.rung = m.rung;
        this.meta.textContent = "reading the prompt on " + m.rung + " (" + m.prompt_tokens +
          " tokens, " + m.reused_tokens + " cached)";
        break;
      case "budget":
        addPoint("budget", now, m.budget_mib);
        drawChart();
        this.body.append(marker("event", "budget " + (m.budget_mib == null ? "unlimited" :
          fmt(m.budget_mib) + " MiB"), "pressure " + fmt(m.pressure, 2) + " · " + m.source));
        break;
      case "switch": {
        const el = marker("switch", "⇢ " + m.from + " → " + m.to + " · " + fmt(m.cost_ms, 1) +
          " ms", m.method + " before token " + m.at_token + ": export " + fmt(m.export_ms, 1) +
          " ms, project " + fmt(m.project_ms, 1) + " ms, import " + fmt(m.import_ms, 1) +
          " ms, first decode " + fmt(m.first_decode_ms, 1) + " ms; loading " + m.to + " " +
          fmt(m.load_ms, 1) + " ms; " + m.cells + " cells carried");
        el.dataset.costMs = m.cost_ms;
        el.dataset.from = m.from;
        el.dataset.to = m.to;
        this.body.append(el);
        break;
      }
      case "stall":
        this.body.append(marker("event", "parked: " + m.reason));
        break;
      case "lever":
        this.body.append(marker("event", m.lever + " on " + m.rung + " · " + fmt(m.cost_ms, 1) +
          " ms", m.tokens + " tokens, before token " + m.at_token));
        break;
      case "summary":
        this.summary(m);
        break;
    }
  }

  summary(s) {
    this.ended = true;
    this.li.dataset.state = "done";
    const parts = [s.tokens + " tokens on " + s.rungs_used.join(" → ")];
    if (s.migrations > 0) {
      parts.push(s.migrations + (s.migrations === 1 ? " switch, " : " switches, ") +
        fmt(s.migration_cost_ms, 1) + " ms");
    }
    parts.push("first token " + fmt(s.stream ? s.stream.ttft_ms : s.ttft_ms) + " ms");
    parts.push("total " + fmt(s.total_ms) + " ms");
    parts.push("ended: " + s.stop);
    this.meta.textContent = parts.join(" · ");
    this.meta.classList.add("summary");
  }

  fail(text) {
    this.ended = true;
    this.li.dataset.state = "error";
    this.meta.textContent = text;
  }

  stopped() {
    this.ended = true;
    this.li.dataset.state = "stopped";
    this.meta.textContent = "stopped by you after " + this.body.querySelectorAll(".tok").length +
      " tokens";
  }
}

/** Splits an SSE byte stream into the data of its events (comment lines, the keep-alives,
 * dropped). */
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf = (buf + decoder.decode(value, { stream: true })).replace(/\r\n/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(l.startsWith("data: ") ? 6 : 5));
      if (data.length) yield data.join("\n");
    }
  }
}

async function send(text) {
  showError("");
  const user = addMessage("user");
  user.querySelector(".answer").textContent = text;
  state.history.push({ role: "user", content: text });
  const answer = new Answer(addMessage("assistant"));
  const ctl = new AbortController();
  state.streaming = ctl;
  setBusy(true);
  const body = { messages: state.history, stream: true };
  const max = parseInt($("max-tokens").value, 10);
  if (max > 0) body.max_tokens = max;
  try {
    const resp = await postJson("/v1/chat/completions", body, ctl.signal);
    if (!resp.ok) {
      const why = await describeFailure(resp);
      answer.fail(why);
      showError(why);
    } else {
      for await (const data of sseData(resp.body)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          answer.fail("The answer failed: " + chunk.error.message);
          showError(answer.meta.textContent);
          continue;
        }
        const content = chunk.choices && chunk.choices[0] && chunk.choices[0].delta &&
          chunk.choices[0].delta.content;
        const m = chunk.molt;
        if (content) answer.token(content, m && m.event === "token" ? m : null);
        if (m && m.event !== "token") answer.event(m);
      }
      if (!answer.ended) answer.fail("The stream ended without a summary.");
    }
  } catch (err) {
    if (ctl.signal.aborted) answer.stopped();
    else answer.fail("Lost the connection to the server: " + err.message);
  } finally {
    state.streaming = null;
    setBusy(false);
  }
  // The conversation goes on from what was shown; a request that got no answer is taken back.
  if (answer.text) state.history.push({ role: "assistant", content: answer.text });
  else state.history.pop();
  poll();
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// ---- Budget controls ----------------------------------------------------------------------

async function setBudget(body) {
  showError("");
  try {
    const resp = await postJson("/v1/molt/budget", body);
    if (!resp.ok) {
      showError(await describeFailure(resp));
      return;
    }
    const view = await resp.json();
    showBudget(view);
    if (!state.streaming) {
      addPoint("budget", Date.now(), view.budget_mib);
      drawChart();
    }
  } catch (err) {
    showError("Could not reach the server: " + err.message);
  }
}

// ---- Wiring -------------------------------------------------------------------------------

function init() {
  $("key").value = state.key;
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.key = $("key").value.trim();
    if (state.key) sessionStorage.setItem("molt-key", state.key);
    else sessionStorage.removeItem("molt-key");
    showError("");
    poll();
  });
  $("ask").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.streaming) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("ask").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.streaming && state.streaming.abort());
  $("clear").addEventListener("click", () => {
    if (state.streaming) state.streaming.abort();
    state.history = [];
    $("log").replaceChildren();
  });
  $("cut").addEventListener("submit", (ev) => {
    ev.preventDefault();
    setBudget({ mib: Number($("cut-mib").value) });
  });
  $("unlimited").addEventListener("click", () => setBudget({ unlimited: true }));
  $("replay").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const spec = $("trace").value.trim();
    let trace = spec;
    if (spec.startsWith("{")) {
      try {
        trace = JSON.parse(spec);
      } catch (err) {
        showError("The trace is not valid JSON: " + err.message);
        return;
      }
    }
    setBudget({ trace });
  });
  drawChart();
  poll();
}

init();
