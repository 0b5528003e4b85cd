// slogate console: renders the snapshot pushed by /console/events. No framework, no build.
"use strict";
const STAGES = ["gateway_queue", "retries", "connect", "engine_queue", "prefill", "first_token", "decode"];
const STAGE_LABEL = {gateway_queue: "gateway queue", retries: "earlier attempts", connect: "connect",
  engine_queue: "engine queue", prefill: "prefill", first_token: "first token (wait)", decode: "decode"};
const $ = (sel, root) => (root || document).querySelector(sel);
const el = (tag, attrs, ...kids) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v;
    else if (k === "style") {  // through CSSOM: the page's CSP allows no inline style attribute
      for (const decl of v.split(";")) {
        const i = decl.indexOf(":");
        if (i > 0) e.style.setProperty(decl.slice(0, i).trim(), decl.slice(i + 1).trim());
      }
    }
    else if (k.startsWith("data-") || k === "title") e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const k of kids) if (k != null) e.append(k);
  return e;
};
const fmt = (v, digits) => v == null ? "–" : (v >= 100 ? v.toFixed(0) : v.toFixed(digits == null ? 1 : digits));
const pct = v => v == null ? "–" : (v * 100).toFixed(1) + " %";
const cls3 = (v, good, meh) => v == null ? "" : (v >= good ? "good" : v >= meh ? "meh" : "badc");

function legend() {
  const box = $("#legend");
  for (const s of STAGES) box.append(el("span", {}, el("i", {style: `background:var(--${s})`}), STAGE_LABEL[s]));
  box.append(el("span", {class: "dim", text: "hatched = reported by the provider"}));
}

function chart(series, keys, target, title) {
  const W = 400, H = 80, pad = 2;
  const vals = [];
  for (const k of keys) for (const v of series[k]) if (v != null) vals.push(v);
  if (target) vals.push(target);
  const max = vals.length ? Math.max(...vals) * 1.1 : 1;
  const n = series.t.length;
  const x = i => pad + (W - 2 * pad) * (n <= 1 ? 1 : i / (n - 1));
  const y = v => H - pad - (H - 2 * pad) * (v / max);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H + 12}`); svg.setAttribute("class", "chart");
  svg.setAttribute("preserveAspectRatio", "none");
  const line = (x1, y1, x2, y2, c) => { const l = document.createElementNS(ns, "line");
    l.setAttribute("x1", x1); l.setAttribute("y1", y1); l.setAttribute("x2", x2); l.setAttribute("y2", y2);
    l.setAttribute("class", c); svg.append(l); };
  line(pad, H - pad, W - pad, H - pad, "axis");
  if (target) line(pad, y(target), W - pad, y(target), "target");
  const colors = {p50: "var(--p50)", p99: "var(--p99)"};
  for (const k of keys) {
    let d = "", pen = false;
    series[k].forEach((v, i) => { if (v == null) { pen = false; return; }
      d += (pen ? "L" : "M") + x(i).toFixed(1) + " " + y(v).toFixed(1) + " "; pen = true; });
    if (!d) continue;
    const p = document.createElementNS(ns, "path");
    p.setAttribute("d", d); p.setAttribute("fill", "none"); p.setAttribute("stroke-width", "1.5");
    p.setAttribute("stroke", colors[k.split("_")[1]]); svg.append(p);
  }
  const t = document.createElementNS(ns, "text");
  t.setAttribute("x", 2); t.setAttribute("y", H + 11);
  t.textContent = `max ${fmt(max / 1.1)} ms · ${-series.t[0]} s ago → now`;
  svg.append(t);
  return el("div", {}, el("div", {class: "chart-title", text: title}), svg);
}

function renderClasses(s) {
  const box = $("#classes");
  box.textContent = "";
  const names = Object.keys(s.classes);
  if (!names.length) box.append(el("p", {class: "dim", text: "No SLO class has seen a request yet."}));
  for (const name of names) {
    const c = s.classes[name];
    const tgt = c.target || {};
    const num = (label, key, value, klass) => el("div", {class: "num"}, el("span", {class: "label", text: label}),
      el("span", {class: "value " + (klass || ""), "data-metric": key, text: value}));
    const ttftCls = c.ttft_ms.p99 == null || !tgt.ttft_ms ? "" : (c.ttft_ms.p99 <= tgt.ttft_ms ? "good" : "badc");
    const tpotCls = c.tpot_ms.p99 == null || !tgt.tpot_ms ? "" : (c.tpot_ms.p99 <= tgt.tpot_ms ? "good" : "badc");
    const card = el("div", {class: "card cls", "data-class": name},
      el("h3", {}, name + " ", el("span", {class: "dim", text: tgt.ttft_ms ?
        `TTFT ≤ ${tgt.ttft_ms} ms · TPOT ≤ ${tgt.tpot_ms} ms · ${c.requests} req` : `${c.requests} req`})),
      el("div", {class: "nums"},
        num("TTFT p50 ms", "ttft_p50", fmt(c.ttft_ms.p50)), num("TTFT p99 ms", "ttft_p99", fmt(c.ttft_ms.p99), ttftCls),
        num("TPOT p50 ms", "tpot_p50", fmt(c.tpot_ms.p50, 2)), num("TPOT p99 ms", "tpot_p99", fmt(c.tpot_ms.p99, 2), tpotCls),
        num("goodput", "goodput", pct(c.goodput), cls3(c.goodput, s.objective, 0.9)),
        num("error budget left", "budget_left", pct(c.budget_left), cls3(c.budget_left, 0.5, 0.1)),
        num("burn rate", "burn_rate", c.burn_rate == null ? "–" : c.burn_rate.toFixed(1) + "×"),
        num("judged / met", "judged", `${c.judged} / ${c.met}`)),
      chart(c.series, ["ttft_p50", "ttft_p99"], tgt.ttft_ms, "TTFT ms (p50 blue, p99 orange, dashed: target)"),
      chart(c.series, ["tpot_p50", "tpot_p99"], tgt.tpot_ms, "TPOT ms"));
    box.append(card);
  }
  if (s.refused_unclassified) box.append(el("p", {class: "dim", "data-metric": "refused_unclassified",
    text: `${s.refused_unclassified} requests refused before they had an SLO class (a bad key, body or route)`}));
  $("#window-note").textContent = `(last ${Math.round(s.window_s / 60)} min, ${s.slot_s} s points; goodput objective ${pct(s.objective)})`;
}

function renderWaterfall(s) {
  const box = $("#waterfall");
  box.textContent = "";
  if (!s.slowest.length) { box.append(el("p", {class: "dim", text: "No finished request in the last minute."})); return; }
  const span = Math.max(...s.slowest.map(r => r.e2e_ms), 1);
  for (const r of s.slowest) {
    const track = el("div", {class: "wf-track"});
    for (const st of r.stages) {
      const left = (100 * st.start_ms / span).toFixed(3), width = (100 * st.ms / span).toFixed(3);
      track.append(el("div", {class: "bar " + (st.source === "provider" ? "provider" : ""), "data-stage": st.stage,
        "data-ms": String(st.ms), title: `${STAGE_LABEL[st.stage] || st.stage}: ${st.ms.toFixed(1)} ms (${st.source})`,
        style: `left:${left}%;width:${width}%;background:var(--${st.stage})`}));
    }
    const id = el("div", {class: "wf-id"}, el("div", {text: r.request_id}),
      el("div", {class: "trace", text: `trace ${r.trace_id || "–"} · ${r.class} · ${r.backend || "no backend"} · ${r.verdict || r.outcome}` +
        (r.hedge ? ` · first-token race ${r.hedge}` : "") +
        (r.continued_from_token && r.continued_from_token.length ? ` · continued at token ${r.continued_from_token.join(", ")}` : "")}));
    box.append(el("div", {class: "wf-row", "data-request-id": r.request_id, "data-trace-id": r.trace_id || ""},
      id, track, el("div", {class: "wf-total", text: `${fmt(r.e2e_ms)} ms`})));
  }
}

function renderBackends(s) {
  const body = $("#backends tbody");
  body.textContent = "";
  for (const b of s.backends) {
    const breaker = el("td", {class: b.breaker === "closed" ? "good" : b.breaker === "open" ? "badc" : "meh", text: b.breaker});
    const health = el("td", {class: b.healthy ? "good" : "badc", text: b.health_checked ? (b.healthy ? "healthy" : "failing") : "no check"});
    body.append(el("tr", {"data-backend": b.name}, el("td", {text: b.name}), el("td", {class: "mono", text: b.address}),
      breaker, health, el("td", {text: b.in_flight}), el("td", {text: b.awaiting_first_token}),
      el("td", {text: b.predicted_ttft_ms == null ? (s.admission.enabled ? "learning" : "admission off") : fmt(b.predicted_ttft_ms) + " ms"})));
  }
}

function renderAdmission(s) {
  const box = $("#admission");
  box.textContent = "";
  const a = s.admission;
  if (!a.enabled) {
    box.append(el("p", {class: "dim", text: "Admission control is off: every request goes straight to a backend. Enable it with [admission] enabled = true."}));
  } else {
    box.append(el("p", {}, `${a.queued} waiting (≈ ${a.estimated_tokens} prompt tokens)`));
    const t = el("table", {}, el("thead", {}, el("tr", {}, el("th", {text: "class"}), el("th", {text: "waiting"}))));
    const tb = el("tbody");
    for (const [k, v] of Object.entries(a.by_class)) tb.append(el("tr", {}, el("td", {text: k}), el("td", {text: v})));
    if (!Object.keys(a.by_class).length) tb.append(el("tr", {}, el("td", {class: "dim", text: "queue empty"}), el("td")));
    t.append(tb); box.append(t);
    if (Object.keys(a.by_tenant).length) {
      const t2 = el("table", {}, el("thead", {}, el("tr", {}, el("th", {text: "tenant"}), el("th", {text: "waiting"}))));
      const tb2 = el("tbody");
      for (const [k, v] of Object.entries(a.by_tenant)) tb2.append(el("tr", {}, el("td", {text: k}), el("td", {text: v})));
      t2.append(tb2); box.append(t2);
    }
  }
}

function renderRecent(s) {
  const body = $("#recent tbody");
  body.textContent = "";
  for (const r of s.recent.slice(0, 20)) {
    body.append(el("tr", {}, el("td", {text: r.ago_s + " s"}), el("td", {class: "mono", text: r.request_id}),
      el("td", {text: r.class}), el("td", {text: r.backend || "–"}), el("td", {text: r.status}),
      el("td", {class: r.verdict === "met" ? "good" : r.verdict ? "badc" : "", text: r.verdict || r.outcome}),
      el("td", {text: fmt(r.ttft_ms)}), el("td", {text: fmt(r.tpot_ms, 2)}), el("td", {text: fmt(r.e2e_ms)})));
  }
}

function renderExplained(s) {
  const body = $("#explained tbody");
  body.textContent = "";
  const rows = s.explained || [];
  if (!rows.length) {
    body.append(el("tr", {}, el("td", {class: "dim", colSpan: 6, text: "No refused or slow request recorded."})));
    return;
  }
  const now = s.time;
  for (const r of rows) {
    body.append(el("tr", {}, el("td", {text: r.t ? fmt(Math.max(0, now - r.t)) + " s" : "–"}),
      el("td", {class: "mono", text: r.request_id}), el("td", {text: r.slo_class || "–"}),
      el("td", {text: r.tenant || "–"}), el("td", {class: "badc", text: r.status}),
      el("td", {class: "why", text: r.why})));
  }
}

function renderEmpty(s) {
  const empty = $("#empty");
  empty.hidden = s.requests_total > 0;
  const model = s.models[0] || "MODEL";
  $("#empty-curl").textContent = `curl -N ${location.origin}/v1/chat/completions -H 'Content-Type: application/json' \\\n` +
    `  -d '{"model": "${model}", "stream": true, "messages": [{"role": "user", "content": "Hello"}]}'`;
  $("#empty-sdk").textContent = `OpenAI(base_url="${location.origin}/v1", api_key="…")`;
}

function render(s) {
  window.__slogateSnapshot = s;
  $("#rate").textContent = fmt(s.rate_rps);
  $("#total").textContent = String(s.requests_total);
  $("#queued").textContent = s.admission.enabled ? String(s.admission.queued) : "off";
  $("#uptime").textContent = s.uptime_s < 120 ? `${Math.round(s.uptime_s)} s` : `${Math.round(s.uptime_s / 60)} min`;
  renderEmpty(s); renderClasses(s); renderWaterfall(s); renderBackends(s); renderAdmission(s); renderExplained(s); renderRecent(s);
  document.body.dataset.updates = String((Number(document.body.dataset.updates) || 0) + 1);
}

function connect() {
  const conn = $("#conn");
  const es = new EventSource("/console/events");
  es.onopen = () => { conn.className = "conn live"; conn.textContent = "live"; };
  es.onmessage = ev => { try { render(JSON.parse(ev.data)); } catch (e) { console.error(e); } };
  es.onerror = () => { conn.className = "conn down"; conn.textContent = "disconnected, retrying…"; };
}

legend();
connect();
