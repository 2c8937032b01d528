// flamed serve page: the timeline canvas, range selection, graph, table; state in the URL.
"use strict";
const $ = (id) => document.getElementById(id);
const KINDS = ["kernel", "native", "python"];
const FILTERS = ["pid", "tid", "comm", "include", "exclude"];
let IDX = null, TL = null, drag = null;
const S = {};  // start, end, bstart, bend (ms), view, filters, kinds; the graph's search, icase, zoom
let zoomKey = null;  // the graph a zoom (a frame index) belongs to: another range or filter drops it
// For tests and bench/serve.py: counts of graph loads and timeline draws, the first paint's time.
window.flamed = { state: S, loads: 0, timelines: 0, firstPaintMs: null, rangeMs: null, error: null };

function iso(ms) { return new Date(ms).toISOString(); }
function parseTime(text) { const t = Date.parse(text); return isNaN(t) ? null : t; }

function filterParams() {
  const p = new URLSearchParams();
  for (const k of FILTERS) if (S[k]) p.set(k, S[k]);
  if (S.kinds !== KINDS.join(",")) p.set("kinds", S.kinds);
  if (S.profile !== "cpu") p.set("profile", S.profile);
  return p;
}
function rangeParams(extra) {
  const p = filterParams();
  p.set("start", S.start); p.set("end", S.end);
  if (extra) for (const [k, v] of Object.entries(extra)) p.set(k, v);
  return p;
}
function saveUrl() {
  const p = rangeParams();
  if (S.bstart != null) { p.set("bstart", S.bstart); p.set("bend", S.bend); }
  if (S.view !== "auto") p.set("view", S.view);
  if (S.search) { p.set("search", S.search); if (S.icase) p.set("icase", "1"); }
  if (S.zoom != null) p.set("zoom", S.zoom);
  history.replaceState(null, "", "?" + p.toString());
}
async function getJSON(url) {
  const r = await fetch(url);
  const j = await r.json();
  if (!r.ok) throw new Error(j.error || r.statusText);
  return j;
}

function readForm() {
  for (const k of FILTERS) S[k] = $(k).value.trim();
  S.kinds = KINDS.filter((k) => $("k-" + k).checked).join(",");
  S.view = $("view").value;
  S.profile = $("profile").value;
}
// What the timeline's weights are: samples, or microseconds off the CPU (a daemon's off-CPU files).
function unitText() {
  const u = IDX && IDX.profiles && IDX.profiles[S.profile] ? IDX.profiles[S.profile].unit : "samples";
  return u === "microseconds" ? "us off-CPU" : u;
}
function writeForm() {
  for (const k of FILTERS) $(k).value = S[k] || "";
  for (const k of KINDS) $("k-" + k).checked = S.kinds.split(",").includes(k);
  $("view").value = S.view;
  $("profile").value = S.profile;
  $("from").value = iso(S.start); $("to").value = iso(S.end);
  $("bfrom").value = S.bstart != null ? iso(S.bstart) : "";
  $("bto").value = S.bend != null ? iso(S.bend) : "";
}

function showSource() {
  const kinds = IDX.profiles || {};
  $("profile-box").hidden = Object.keys(kinds).length < 2;  // only a daemon recording off-CPU time has two
  const files = kinds[S.profile] ? kinds[S.profile].files : IDX.files;
  $("source").textContent = `${IDX.kind}: ${IDX.source} (${files} ${S.profile === "offcpu" ? "off-CPU " : ""}files)`;
}
async function loadTimeline() {
  // The served range grows as the daemon writes files: ask again each time.
  IDX = await getJSON("/api/index");
  showSource();
  const p = filterParams();
  p.set("start", IDX.start_ms); p.set("end", IDX.end_ms); p.set("view", S.view);
  TL = await getJSON("/api/timeline?" + p);
  draw();
  window.flamed.timelines++;
  if (window.flamed.firstPaintMs === null) {
    requestAnimationFrame(() => { window.flamed.firstPaintMs = performance.now(); });  // drawn on screen
  }
}

function tlSpan() {
  if (!TL) return [0, 1];
  if (TL.view === "heatmap") return [TL.start_ms, TL.start_ms + TL.cols * TL.col_ms];
  return [TL.start_ms, TL.start_ms + TL.counts.length * TL.bucket_ms];
}
// Canvas point -> time (ms); "end" rounds up to the end of the cell / bucket.
function timeAt(x, y, end) {
  const c = $("timeline"), W = c.width, H = c.height;
  if (TL.view === "heatmap") {
    const col = Math.max(0, Math.min(TL.cols - 1, Math.floor(x / (W / TL.cols))));
    const row = Math.max(0, Math.min(TL.rows - 1, Math.floor(y / (H / TL.rows))));
    const rowMs = TL.col_ms / TL.rows;
    return TL.start_ms + col * TL.col_ms + (row + (end ? 1 : 0)) * rowMs;
  }
  const n = TL.counts.length;
  const i = Math.max(0, Math.min(n - 1, Math.floor(x / (W / n))));
  return TL.start_ms + (i + (end ? 1 : 0)) * TL.bucket_ms;
}
function xOf(ms) { const [a, b] = tlSpan(); return ((ms - a) / (b - a)) * $("timeline").width; }

function draw() {
  const c = $("timeline");
  c.width = c.clientWidth; c.height = c.clientHeight;
  const g = c.getContext("2d"), W = c.width, H = c.height;
  g.fillStyle = "#fff"; g.fillRect(0, 0, W, H);
  if (!TL) return;
  if (TL.view === "heatmap") {
    let max = 0;
    for (const col of TL.cells) for (const v of col) if (v > max) max = v;
    const cw = W / TL.cols, ch = H / TL.rows;
    for (let i = 0; i < TL.cols; i++) for (let j = 0; j < TL.rows; j++) {
      const v = TL.cells[i][j];
      if (!v) continue;
      const a = Math.sqrt(v / max);  // hot spots stand out, cold cells stay visible
      g.fillStyle = heatColor(a);
      g.fillRect(i * cw, j * ch, Math.ceil(cw), Math.ceil(ch));
    }
  } else {
    const n = TL.counts.length, bw = W / n;
    const max = Math.max(1, ...TL.counts);
    g.fillStyle = "#d9531e";
    TL.counts.forEach((v, i) => { const h = (v / max) * (H - 4); g.fillRect(i * bw, H - h, Math.max(1, bw - 0.5), h); });
  }
  const shade = (a, b, color) => { g.fillStyle = color; g.fillRect(xOf(a), 0, Math.max(2, xOf(b) - xOf(a)), H); };
  if (S.start != null) shade(S.start, S.end, "rgba(30,90,220,0.18)");
  if (S.bstart != null) shade(S.bstart, S.bend, "rgba(20,160,60,0.22)");
  if (drag && drag.x1 != null) {
    g.strokeStyle = "#000"; g.strokeRect(Math.min(drag.x0, drag.x1), 0, Math.abs(drag.x1 - drag.x0), H);
  }
  drawAxes();
}

// Axes around the timeline: times below (UTC), the offset inside a column (or
// the bar scale) on the left, the colour scale on the right, ranges A and B
// marked on the time axis. What is drawn is kept in flamed.axes for tests.
const HEAT_A = "rgb(30,90,220)", HEAT_B = "rgb(20,160,60)";
function heatColor(a) { return `rgb(255,${Math.round(235 - 200 * a)},${Math.round(220 - 220 * a)})`; }
function canvas2d(id) {
  const c = $(id);
  c.width = c.clientWidth; c.height = c.clientHeight;
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  g.font = "11px sans-serif"; g.fillStyle = "#333"; g.strokeStyle = "#888";
  return [g, c.width, c.height];
}
function durText(ms) {
  if (ms === 0) return "0";
  if (ms >= 86400000 && ms % 86400000 === 0) return ms / 86400000 + " d";
  if (ms >= 3600000 && ms % 3600000 === 0) return ms / 3600000 + " h";
  if (ms >= 60000 && ms % 60000 === 0) return ms / 60000 + " min";
  if (ms >= 1000) return ms / 1000 + " s";
  return ms + " ms";
}
function numText(v) { return v >= 10000 ? v.toExponential(1) : String(Math.round(v * 100) / 100); }
const TICK_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
function timeTicks(a, b, W) {
  const step = 1000 * (TICK_STEPS.find((s) => (s * 1000 * W) / (b - a) >= 90) || 86400);
  const ticks = [];
  let prevDay = null;
  for (let t = Math.ceil(a / step) * step; t <= b; t += step) {
    const iso = new Date(t).toISOString();  // UTC, as the API's and the range boxes' times
    const day = iso.slice(0, 10);
    const label = step >= 86400000 ? day : step >= 60000 ? iso.slice(11, 16) : iso.slice(11, 19);
    ticks.push({ ms: t, x: xOf(t), label, day: day !== prevDay && step < 86400000 ? day : "" });
    prevDay = day;
  }
  return ticks;
}
function drawAxes() {
  const axes = { ticks: [], rows: [], legend: null, marks: {} };
  window.flamed.axes = axes;
  // Time axis
  let [g, W, H] = canvas2d("tlaxis");
  const [a, b] = tlSpan();
  for (const [k, lo, hi, color, y] of [["A", S.start, S.end, HEAT_A, 0], ["B", S.bstart, S.bend, HEAT_B, 5]]) {
    if (lo == null || hi == null) continue;
    const x0 = Math.max(0, xOf(lo)), x1 = Math.min(W, Math.max(x0 + 2, xOf(hi)));
    g.fillStyle = color; g.fillRect(x0, y, x1 - x0, 4);
    g.fillText(k, Math.min(W - 8, x1 + 2), y + 8);
    axes.marks[k] = [x0, x1];
  }
  g.fillStyle = "#333"; g.textBaseline = "top";
  for (const t of timeTicks(a, b, W)) {
    g.beginPath(); g.moveTo(t.x + 0.5, 0); g.lineTo(t.x + 0.5, 10); g.stroke();
    const tx = Math.max(0, Math.min(W - g.measureText(t.day || t.label).width, t.x + 2));
    g.fillText(t.label, tx, 11);
    if (t.day) g.fillText(t.day, tx, 23);
    axes.ticks.push(t);
  }
  if (!TL) return;
  // Left: offset inside a column (heatmap) or the bar scale (histogram)
  [g, W, H] = canvas2d("tlrows");
  g.textAlign = "right"; g.textBaseline = "middle";
  if (TL.view === "heatmap") {
    const rowMs = TL.col_ms / TL.rows, every = Math.max(1, Math.ceil(TL.rows / 6 / 5) * 5);
    for (let j = 0; j < TL.rows; j += every) {
      const y = (j * H) / TL.rows, label = "+" + durText(j * rowMs);
      g.fillRect(W - 4, y, 4, 1); g.fillText(label, W - 6, Math.max(6, y));
      axes.rows.push(label);
    }
  } else {
    const max = Math.max(1, ...TL.counts);
    for (const f of [0, 0.5, 1]) {
      const y = H - f * (H - 4), label = numText(f * max);
      g.fillRect(W - 4, y - 1, 4, 1); g.fillText(label, W - 6, Math.min(H - 6, Math.max(6, y)));
      axes.rows.push(label);
    }
  }
  // Right: the colour scale (heatmap) or what a bar is (histogram)
  [g, W, H] = canvas2d("tllegend");
  g.textBaseline = "middle";
  if (TL.view === "heatmap") {
    let max = 0;
    for (const col of TL.cells) for (const v of col) if (v > max) max = v;
    const top = 16, bot = H - 6, bw = 12;
    for (let y = top; y < bot; y++) { g.fillStyle = heatColor(Math.sqrt((bot - y) / (bot - top))); g.fillRect(4, y, bw, 1); }
    g.strokeRect(4.5, top + 0.5, bw, bot - top);
    g.fillStyle = "#333";
    const stops = [1, 0.25, 0];  // square-root scale: a quarter of the top is half way up
    for (const f of stops) {
      const y = bot - Math.sqrt(f) * (bot - top);
      g.fillRect(bw + 4, y, 4, 1); g.fillText(numText(f * max), bw + 10, y);
    }
    g.textBaseline = "top";
    const cell = durText(TL.col_ms / TL.rows);
    g.fillText(`${unitText()} / ${cell}`, 2, 1);
    axes.legend = { max, unit: unitText(), cell_ms: TL.col_ms / TL.rows, stops: stops.map((f) => f * max) };
  } else {
    g.fillStyle = "#d9531e"; g.fillRect(4, 20, 12, 12); g.fillStyle = "#333";
    g.fillText(`${unitText()} / ${durText(TL.bucket_ms)}`, 20, 26);
    axes.legend = { max: Math.max(0, ...TL.counts), unit: unitText(), bucket_ms: TL.bucket_ms };
  }
}

function setStatus(t) { $("status").textContent = t; }

function graphKey() {
  const p = rangeParams();
  if (S.bstart != null) { p.set("bstart", S.bstart); p.set("bend", S.bend); }
  return p.toString();
}
// The graph's own parameters: flamegraph.js reads s, i and z from its URL.
// The graph is drawn as wide as its frame (less a scrollbar), so it fits
// without a horizontal scroll.
const GRAPH_WIDTH = 1200, XPAD = 10;
function graphWidth() { return Math.max(400, Math.min(8000, $("graph").clientWidth - 18)); }
function graphParams() {
  // Boxes under half a pixel (of a 1200 px graph) are left out of the page's
  // graph (search still counts their samples); the SVG download keeps flamed
  // svg's 0.1 px. The threshold in samples is the same at any width, so a
  // zoom in a link (a frame index) names the same frame on another screen.
  const w = graphWidth();
  const g = { width: String(w), minwidth: String((0.5 * (w - 2 * XPAD)) / (GRAPH_WIDTH - 2 * XPAD)) };
  if (S.search) { g.s = S.search; if (S.icase) g.i = "1"; }
  if (S.zoom != null) g.z = S.zoom;
  return g;
}
// The embedded graph reports each search and zoom; keep them in the URL.
window.addEventListener("message", (ev) => {
  const m = ev.data;
  if (ev.origin !== location.origin || ev.source !== $("graph").contentWindow || !m || !m.flamedGraph) return;
  S.search = m.s || ""; S.icase = !!m.i; S.zoom = m.z >= 0 ? m.z : null;
  zoomKey = graphKey();
  saveUrl();
});

async function loadRange() {
  if (graphKey() !== zoomKey) S.zoom = null;  // frame indices are those of another graph
  zoomKey = graphKey();
  const t0 = performance.now();
  saveUrl();
  writeForm();
  draw();
  setStatus("");
  const dl = $("downloads");
  dl.innerHTML = "";
  for (const f of ["folded", "svg", "pprof", "speedscope"]) {
    const a = document.createElement("a");
    a.href = "/api/profile?" + rangeParams({ format: f, download: "1" });
    a.textContent = "download " + f; a.className = "dl-" + f;
    dl.appendChild(a);
  }
  const frame = $("graph");
  const done = new Promise((res) => { frame.onload = res; });
  let table;
  try {
    if (S.bstart != null) {
      const b = { bstart: S.bstart, bend: S.bend };
      frame.src = "/api/diff?" + rangeParams({ ...b, ...graphParams() });
      table = await getJSON("/api/diff?" + rangeParams({ ...b, format: "json" }));
      fillDiff(table);
    } else {
      frame.src = "/api/profile?" + rangeParams({ format: "svg", ...graphParams() });
      table = await getJSON("/api/top?" + rangeParams());
      fillTop(table);
    }
    await done;  // the SVG's own script has run (it starts on the SVG's load)
    fitGraph(frame);
    await new Promise((res) => requestAnimationFrame(res));
    window.flamed.rangeMs = performance.now() - t0;
  } catch (e) {
    setStatus(String(e.message || e)); window.flamed.error = String(e.message || e);
  }
  window.flamed.loads++;
}

// Open a graph at its root, as flame graph viewers do: a deep graph (a
// recursion hundreds of frames high) is taller than its frame, and its top
// (the title, the tips of the deepest stacks) says little; the root and the
// processes are at the bottom (the top for an icicle graph).
function fitGraph(frame) {
  const d = frame.contentDocument, svg = d && d.documentElement;
  if (!svg || svg.nodeName.toLowerCase() !== "svg") return;
  const h = Number(svg.getAttribute("height")) || 0;
  // A short graph takes its own height, a tall one the rest of the window
  // below the frame's top, so its bottom (the root) is on screen.
  const room = innerHeight - (frame.getBoundingClientRect().top + scrollY) - 8;
  frame.style.height = Math.round(Math.max(240, Math.min(h + 4, Math.max(360, room)))) + "px";
  const inverted = svg.getAttribute("data-inverted") === "1";
  frame.contentWindow.scrollTo(0, inverted ? 0 : Math.max(d.documentElement.scrollHeight, h));
  window.flamed.graphScroll = frame.contentWindow.scrollY;
}

function row(cells, cls) {
  const tr = document.createElement("tr");
  if (cls) tr.className = cls;
  for (const c of cells) { const td = document.createElement("td"); td.textContent = c; tr.appendChild(td); }
  return tr;
}
function head(cols) { $("top").tHead.innerHTML = "<tr>" + cols.map((c) => `<th>${c}</th>`).join("") + "</tr>"; }
function pct(v, t) { return t ? (100 * v / t).toFixed(2) + "%" : "0%"; }
function fillTop(t) {
  head(["self", "self%", "total", "total%", "function"]);
  const body = $("top").tBodies[0]; body.innerHTML = "";
  for (const r of t.rows) body.appendChild(row([r.self, pct(r.self, t.total), r.total, pct(r.total, t.total), r.name]));
}
function fillDiff(t) {
  head(["A", "B", "change", "function"]);
  const body = $("top").tBodies[0]; body.innerHTML = "";
  for (const r of t.rows) body.appendChild(row([r.before, r.after, (r.delta > 0 ? "+" : "") + r.delta, r.name], r.delta > 0 ? "grown" : "shrunk"));
}

function canvasXY(ev) { const r = $("timeline").getBoundingClientRect(); return [ev.clientX - r.left, ev.clientY - r.top]; }
function setupCanvas() {
  const c = $("timeline");
  c.addEventListener("mousedown", (ev) => { const [x, y] = canvasXY(ev); drag = { x0: x, y0: y, x1: null, b: ev.shiftKey || $("cmpmode").checked }; });
  c.addEventListener("mousemove", (ev) => { if (drag) { drag.x1 = canvasXY(ev)[0]; draw(); } });
  window.addEventListener("mouseup", (ev) => {
    if (!drag) return;
    const [x, y] = canvasXY(ev);
    // Earlier point starts the range, whichever way the drag went.
    const first = x < drag.x0 || (x === drag.x0 && y < drag.y0) ? [x, y] : [drag.x0, drag.y0];
    const last = first[0] === x && first[1] === y ? [drag.x0, drag.y0] : [x, y];
    const a = timeAt(first[0], first[1], false), b = timeAt(last[0], last[1], true);
    const isB = drag.b;
    drag = null;
    if (b <= a) return;
    if (isB) { S.bstart = a; S.bend = b; } else { S.start = a; S.end = b; }
    loadRange();
  });
}

async function init() {
  try { IDX = await getJSON("/api/index"); } catch (e) { setStatus(String(e)); return; }
  const u = new URLSearchParams(location.search);
  S.profile = u.get("profile") === "offcpu" ? "offcpu" : "cpu";
  showSource();
  const num = (k) => (u.get(k) !== null && u.get(k) !== "" ? Number(u.get(k)) : null);
  for (const k of FILTERS) S[k] = u.get(k) || "";
  S.kinds = u.get("kinds") !== null ? u.get("kinds") : KINDS.join(",");
  S.view = u.get("view") || "auto";
  S.profile = u.get("profile") === "offcpu" ? "offcpu" : "cpu";
  S.end = num("end"); S.start = num("start");
  if (S.end === null) S.end = IDX.end_ms;
  if (S.start === null) S.start = Math.max(IDX.start_ms, S.end - 3600 * 1000);  // the most recent hour
  S.bstart = num("bstart"); S.bend = num("bend");
  if (S.bstart === null || S.bend === null) S.bstart = S.bend = null;
  S.search = u.get("search") || ""; S.icase = u.get("icase") === "1"; S.zoom = num("zoom");
  zoomKey = graphKey();  // a zoom in the link belongs to the graph the link shows
  writeForm();
  setupCanvas();
  $("apply").onclick = async () => { readForm(); await loadTimeline(); await loadRange(); };
  $("setrange").onclick = () => {
    const a = parseTime($("from").value), b = parseTime($("to").value);
    if (a === null || b === null || b <= a) { setStatus("range A: give two ISO times, the second later"); return; }
    S.start = a; S.end = b;
    const c = parseTime($("bfrom").value), d = parseTime($("bto").value);
    if (c !== null && d !== null && d > c) { S.bstart = c; S.bend = d; } else { S.bstart = S.bend = null; }
    loadRange();
  };
  $("clearb").onclick = () => { S.bstart = S.bend = null; loadRange(); };
  window.addEventListener("resize", draw);
  try { await loadTimeline(); } catch (e) { setStatus(String(e.message || e)); }
  await loadRange();
  if (IDX.live) setInterval(poll, POLL_MS);
}
// A state directory keeps growing: redraw the timeline when files came or went.
const POLL_MS = 5000;
async function poll() {
  if (drag) return;
  try {
    const i = await getJSON("/api/index");
    if (i.files !== IDX.files || i.start_ms !== IDX.start_ms || i.end_ms !== IDX.end_ms) await loadTimeline();
  } catch (e) { /* the server may be restarting: try again at the next tick */ }
}
init();
