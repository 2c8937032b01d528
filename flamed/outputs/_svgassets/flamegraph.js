"use strict";
// Interactivity of a flamed SVG: hover details, click to zoom, reset, regex search.
// Boxes live in the nested <svg id="fv"> whose user units are weights (samples):
// zooming only changes its viewBox, so positions stay exact at any depth of zoom.
// Labels are plain px text outside it, recomputed after every zoom.
var F = [], fv, labels, details, matched, unzoomBtn, icBtn, root, tip, tipName, tipInfo, tipBg;
var total = 0, left = 0, dw = 0, fs = 12, fw = 0.59, fh = 16, H = 0;
var view = null, searchRe = null, ignoreCase = false, NS = "http://www.w3.org/2000/svg";
var nametype = "Function:", hidden = [], measureCtx = null, zoomed = -1;

function num(s) { return parseFloat(s); }

function init() {
  root = document.documentElement;
  fv = document.getElementById("fv");
  labels = document.getElementById("labels");
  details = document.getElementById("details").firstChild;
  matched = document.getElementById("matched");
  unzoomBtn = document.getElementById("unzoom");
  icBtn = document.getElementById("ignorecase");
  tip = document.getElementById("tip");
  tipBg = tip.firstElementChild;
  tipName = document.getElementById("tipname");
  tipInfo = document.getElementById("tipinfo");
  total = num(fv.getAttribute("data-total"));
  left = num(fv.getAttribute("x"));
  dw = num(fv.getAttribute("width"));
  H = num(fv.getAttribute("height"));
  fs = num(root.getAttribute("data-fs"));
  fw = num(root.getAttribute("data-fw"));
  fh = num(root.getAttribute("data-fh"));
  if (root.hasAttribute("data-nametype")) nametype = root.getAttribute("data-nametype");
  // Boxes too narrow to draw, by name: the search counts their samples too.
  var hd = document.getElementById("hidden");
  if (hd) {
    var lines = hd.textContent.split("\n");
    for (var h = 0; h < lines.length; h++) {
      var tab = lines[h].lastIndexOf("\t");
      if (tab < 0) continue;
      var xs = lines[h].slice(tab + 1).split(" ").map(num), spans = [];
      for (var q = 0; q + 1 < xs.length; q += 2) spans.push([xs[q], xs[q] + xs[q + 1]]);
      hidden.push({name: lines[h].slice(0, tab), spans: spans});
    }
  }
  // Labels are fitted by measured text width (the label font, as drawn); the
  // file's own labels use fs*fw px per character, which is only an average.
  try {
    var c = document.createElementNS("http://www.w3.org/1999/xhtml", "canvas");
    measureCtx = c.getContext ? c.getContext("2d") : null;
    if (measureCtx) {
      // (The font of a text element: the stylesheet styles text, not the group.)
      var st = window.getComputedStyle(document.getElementById("details"));
      measureCtx.font = st.fontStyle + " " + st.fontWeight + " " + st.fontSize + " " + st.fontFamily;
    }
  } catch (err) { measureCtx = null; }
  var gs = fv.children;
  for (var i = 0; i < gs.length; i++) {
    var g = gs[i], t = g.firstElementChild, r = t.nextElementSibling, txt = t.textContent;
    // A tooltip replaced by --nameattr does not start with the name: data-n holds it.
    var named = g.hasAttribute("data-n");
    var name = named ? g.getAttribute("data-n") : txt.slice(0, txt.lastIndexOf(" (")), a = g.getAttribute("data-a");
    g.setAttribute("data-i", i);
    // name: as shown (no _[k]-style annotation); full: with it, for the search.
    F.push({g: g, r: r, x: num(r.getAttribute("x")), w: num(r.getAttribute("width")),
            y: num(r.getAttribute("y")), fill: r.getAttribute("fill"), title: txt,
            name: name, full: a ? name + "_[" + a + "]" : name,
            info: named ? txt : txt.slice(name.length + 2, -1)});
  }
  fv.addEventListener("click", function (e) {
    var f = frameOf(e);
    if (!f) return;
    // A box made a link (--nameattr href) follows it; Ctrl-click zooms instead, as in flamegraph.pl.
    if (f.g.localName === "a") {
      if (!e.ctrlKey && !e.metaKey) return;
      e.preventDefault();
    }
    zoom(f);
  });
  fv.addEventListener("mouseover", function (e) {
    var f = frameOf(e);
    if (!f) return;
    details.nodeValue = nametype + " " + f.title;
    showTip(f, e);
  });
  fv.addEventListener("mousemove", function (e) { if (!tip.classList.contains("hide")) placeTip(e); });
  fv.addEventListener("mouseout", function () { details.nodeValue = " "; tip.classList.add("hide"); });
  unzoomBtn.addEventListener("click", unzoom);
  document.getElementById("search").addEventListener("click", searchPrompt);
  icBtn.addEventListener("click", function () {
    ignoreCase = !ignoreCase;
    icBtn.classList.toggle("on", ignoreCase);
    if (searchRe) search(searchRe.source); else report();
  });
  window.addEventListener("keydown", function (e) {
    if (e.keyCode === 114 || ((e.ctrlKey || e.metaKey) && e.keyCode === 70)) { e.preventDefault(); searchPrompt(); }
    else if (e.keyCode === 27) { unzoom(); resetSearch(); }
  });
  if (measureCtx) relabel();  // the file's labels, refitted to the measured widths
  // The view asked for in the file's own URL (s: search regex, i=1: ignoring case, z: frame index).
  var p = new URLSearchParams(document.location.search);
  if (p.get("i") === "1") { ignoreCase = true; icBtn.classList.add("on"); }
  if (p.get("s")) search(p.get("s"));
  if (p.get("z") !== null && F[+p.get("z")]) zoom(F[+p.get("z")]);
}

// The floating tooltip: the frame's name, then its weight and share.
function showTip(f, e) {
  var name = f.name.length > 100 ? f.name.slice(0, 98) + ".." : f.name;
  tipName.textContent = name;
  tipInfo.textContent = f.info;
  tip.classList.remove("hide");
  var bb = tip.lastElementChild.getBBox();
  tipBg.setAttribute("width", Math.ceil(bb.width) + 12);
  tipBg.setAttribute("height", Math.ceil(bb.height) + 8);
  placeTip(e);
}

function placeTip(e) {
  var ctm = root.getScreenCTM(), p = root.createSVGPoint();
  p.x = e.clientX; p.y = e.clientY;
  if (ctm) p = p.matrixTransform(ctm.inverse());
  var w = num(tipBg.getAttribute("width")), h = num(tipBg.getAttribute("height"));
  var W = num(root.getAttribute("width")), Hh = num(root.getAttribute("height"));
  var x = p.x + 12, y = p.y + 16;
  if (x + w > W) x = Math.max(0, p.x - w - 8);
  if (y + h > Hh) y = Math.max(0, p.y - h - 8);
  tip.setAttribute("transform", "translate(" + x.toFixed(1) + "," + y.toFixed(1) + ")");
}

function frameOf(e) {
  var g = e.target.closest ? e.target.closest("[data-i]") : null;
  return g ? F[+g.getAttribute("data-i")] : null;
}

// The label of a name in px of room: the whole name when it fits, else the longest
// prefix that fits with "..", at least one character of it; "" when nothing fits.
function fitLabel(name, px) {
  if (!measureCtx) {
    var chars = Math.floor(px / (fs * fw));
    if (chars < 3) return "";
    return name.length > chars ? name.slice(0, chars - 2) + ".." : name;
  }
  var room = px - 3;  // the label starts 3 px into its box
  if (measureCtx.measureText(name).width <= room) return name;
  var lo = 0, hi = name.length - 1;  // the longest prefix with ".." that fits: binary search
  while (lo < hi) {
    var mid = (lo + hi + 1) >> 1;
    if (measureCtx.measureText(name.slice(0, mid) + "..").width <= room) lo = mid; else hi = mid - 1;
  }
  return lo >= 1 ? name.slice(0, lo) + ".." : "";
}

// Draw the labels of the boxes visible in the current view.
function relabel() {
  var vx = view ? view.x : 0, vw = view ? view.w : total, scale = dw / vw, cw = fs * fw;
  var frag = document.createDocumentFragment();
  for (var i = 0; i < F.length; i++) {
    var f = F[i], a = Math.max(f.x, vx), b = Math.min(f.x + f.w, vx + vw);
    if (b <= a) continue;
    var px = (b - a) * scale;
    if (px < 3 * cw * 0.5) continue;  // far too narrow for any text: skip the measuring
    var s = fitLabel(f.name, px);
    if (!s) continue;
    var t = document.createElementNS(NS, "text");
    t.setAttribute("x", (left + (a - vx) * scale + 3).toFixed(1));
    t.setAttribute("y", f.y + fh - 5);
    t.textContent = s;
    frag.appendChild(t);
  }
  labels.textContent = "";
  labels.appendChild(frag);
}

// Tell a same-origin page embedding this graph (flamed serve) its search and zoom,
// so that page can keep them in its own URL.
function report() {
  try {
    if (window.parent === window || window.parent.location.origin !== location.origin) return;
    window.parent.postMessage({flamedGraph: true, s: searchRe ? searchRe.source : "", i: ignoreCase, z: zoomed},
                              location.origin);
  } catch (err) { /* a foreign parent: nothing to tell */ }
}

function zoom(f) {
  view = {x: f.x, w: f.w};
  zoomed = F.indexOf(f);
  fv.setAttribute("viewBox", f.x + " 0 " + f.w + " " + H);
  var inverted = root.getAttribute("data-inverted") === "1";
  for (var i = 0; i < F.length; i++) {
    var o = F[i];
    // Ancestors span the zoomed box and sit nearer the root: drawn faded, clipped to the view.
    var anc = o !== f && o.x <= f.x && o.x + o.w >= f.x + f.w && (inverted ? o.y < f.y : o.y > f.y);
    o.g.classList.toggle("a", anc);
  }
  unzoomBtn.classList.remove("hide");
  relabel();
  if (searchRe) search(searchRe.source); else report();
}

function unzoom() {
  if (!view) return;
  view = null;
  zoomed = -1;
  fv.setAttribute("viewBox", "0 0 " + total + " " + H);
  for (var i = 0; i < F.length; i++) F[i].g.classList.remove("a");
  unzoomBtn.classList.add("hide");
  relabel();
  if (searchRe) search(searchRe.source); else report();
}

function searchPrompt() {
  var term = prompt("Search for a frame (regular expression, e.g. ^ext4_ or \\.py:)", searchRe ? searchRe.source : "");
  if (term === null) return;
  if (term === "") resetSearch(); else search(term);
}

function resetSearch() {
  searchRe = null;
  for (var i = 0; i < F.length; i++) F[i].r.setAttribute("fill", F[i].fill);
  matched.classList.add("hide");
  matched.textContent = " ";
  report();
}

// A name matches as shown or with its annotation: "read$" finds sys_read_[k] as
// flamegraph.pl's search does, and _\[k\] still finds the kernel frames.
function matches(re, full) {
  if (re.test(full)) return true;
  var m = /_\[[kwij]\]$/.exec(full);
  return m !== null && re.test(full.slice(0, m.index));
}

// Color every box whose name matches; the matched share counts each sample once
// (nested matches overlap their ancestor's interval and are merged away), the
// samples of boxes too narrow to draw included.
function search(term) {
  var re;
  try { re = new RegExp(term, ignoreCase ? "i" : ""); }
  catch (err) { matched.textContent = "Bad regex: " + err.message; matched.classList.remove("hide"); return; }
  searchRe = re;
  var hits = [];
  for (var i = 0; i < F.length; i++) {
    var f = F[i];
    if (matches(re, f.full)) { f.r.setAttribute("fill", "#e600e6"); hits.push([f.x, f.x + f.w]); }
    else f.r.setAttribute("fill", f.fill);
  }
  for (var m = 0; m < hidden.length; m++) {
    if (matches(re, hidden[m].name)) Array.prototype.push.apply(hits, hidden[m].spans);
  }
  hits.sort(function (p, q) { return p[0] - q[0]; });
  var merged = [], end = -Infinity;
  for (var j = 0; j < hits.length; j++) {
    var h = hits[j];
    if (h[0] >= end) { merged.push([h[0], h[1]]); end = h[1]; }
    else if (h[1] > end) { merged[merged.length - 1][1] = h[1]; end = h[1]; }
  }
  var vx = view ? view.x : 0, vw = view ? view.w : total, sum = 0, inView = 0;
  for (var k = 0; k < merged.length; k++) {
    var a = merged[k][0], b = merged[k][1];
    sum += b - a;
    inView += Math.max(0, Math.min(b, vx + vw) - Math.max(a, vx));
  }
  var pct = total > 0 ? 100 * sum / total : 0;
  var text = "Matched: " + pct.toFixed(2) + "%";
  if (view) text += " (" + (vw > 0 ? 100 * inView / vw : 0).toFixed(2) + "% of view)";
  matched.textContent = text;
  matched.setAttribute("data-pct", pct.toFixed(4));
  matched.classList.remove("hide");
  report();
}

window.addEventListener("load", init);
