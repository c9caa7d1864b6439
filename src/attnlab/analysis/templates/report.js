// attnlab report: head grids and the head explorer. Plain JS, no libraries, no network.
// Data comes from the inline JSON block #attnlab-data (see attnlab/analysis/report.py):
// example maps are integers in thousandths, index ((layer*H + head)*n + query)*n + key;
// DATA.replaced is null or an L x H table of the mechanism spec a plan put into each head
// (null where softmax stayed), marked in every grid and in the explorer.
(function () {
  "use strict";

  const DATA = JSON.parse(document.getElementById("attnlab-data").textContent);
  const byId = (id) => document.getElementById(id);
  const L = DATA.layers;
  const H = DATA.heads;
  const SVG_NS = byId("attn-lines").namespaceURI; // the inline <svg>'s namespace
  const scoreNames = Object.keys(DATA.scores);
  const state = { example: 0, layer: 0, head: 0, score: scoreNames[0] };
  const REPLACED = DATA.replaced || null;
  const MECH = DATA.mechanisms || {};
  const MECH_COLORS = ["#56B4E9", "#E69F00", "#009E73", "#CC79A7", "#F0E442", "#0072B2",
    "#D55E00", "#999999"];

  // ------------------------------------------------------------------ colours
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const BLUES = [[247, 251, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]];

  function ramp(stops, t) {
    const x = Math.min(1, Math.max(0, t)) * (stops.length - 1);
    const i = Math.min(stops.length - 2, Math.floor(x));
    const f = x - i;
    const a = stops[i];
    const b = stops[i + 1];
    return [0, 1, 2].map((k) => Math.round(a[k] + f * (b[k] - a[k])));
  }

  function css(rgb) {
    return "rgb(" + rgb[0] + "," + rgb[1] + "," + rgb[2] + ")";
  }

  function isDark(rgb) {
    return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 128;
  }

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function fmt(v) {
    return v === null || v === undefined ? "n/a" : Number(v).toFixed(3);
  }

  // ------------------------------------------------------------------ head grids
  function gridTable(id, cell) {
    const table = el("table", { class: "grid", id: id + "-table" });
    const head = el("tr");
    head.appendChild(el("th", {}, ""));
    for (let h = 0; h < H; h++) head.appendChild(el("th", {}, String(h)));
    table.appendChild(head);
    for (let l = 0; l < L; l++) {
      const row = el("tr");
      row.appendChild(el("th", {}, String(l)));
      for (let h = 0; h < H; h++) {
        const td = el("td", { "data-layer": l, "data-head": h });
        cell(td, l, h);
        markReplaced(td, l, h);
        td.addEventListener("click", () => selectHead(l, h));
        row.appendChild(td);
      }
      table.appendChild(row);
    }
    return table;
  }

  function replacedBy(l, h) {
    return REPLACED ? REPLACED[l][h] : null;
  }

  function markReplaced(td, l, h) {
    const spec = replacedBy(l, h);
    if (!spec) return;
    td.classList.add("replaced");
    td.dataset.mechanism = spec;
    td.title = (td.title ? td.title + " \u00b7 " : "") + "replaced by " + spec;
  }

  function drawMechGrid() {
    const host = byId("mech-grid");
    const legend = byId("mech-legend");
    host.textContent = "";
    legend.textContent = "";
    if (!REPLACED) {
      host.appendChild(el("p", { class: "empty" }, "No plan given: every head is softmax."));
      return;
    }
    const specs = Object.keys(MECH);
    const color = (spec) => MECH_COLORS[specs.indexOf(spec) % MECH_COLORS.length];
    host.appendChild(
      gridTable("mech-grid", (td, l, h) => {
        const spec = REPLACED[l][h];
        td.title = "layer " + l + ", head " + h + ": " + (spec || "softmax (kept)");
        if (spec) {
          td.style.background = color(spec);
          const lab = MECH[spec] || spec;
          td.textContent = lab.length <= 6 ? lab : lab.slice(0, 5) + "\u2026";
        } else {
          td.style.background = "#ffffff";
          td.style.color = "#888";
          td.textContent = "\u00b7";
        }
      })
    );
    let total = 0;
    for (const spec of specs) {
      const n = REPLACED.flat().filter((s) => s === spec).length;
      total += n;
      const sw = el("span", { class: "swatch" });
      sw.style.background = color(spec);
      legend.appendChild(sw);
      legend.appendChild(document.createTextNode(MECH[spec] + " = " + spec + " (" + n + ")"));
    }
    const sw = el("span", { class: "swatch" });
    legend.appendChild(sw);
    legend.appendChild(document.createTextNode("\u00b7 softmax, kept (" + (L * H - total) + ")"));
    const mark = el("span", { class: "swatch replaced" });
    legend.appendChild(el("br"));
    legend.appendChild(mark);
    legend.appendChild(document.createTextNode("replaced head (frame and red corner in every grid)"));
  }

  function drawClassGrid() {
    const host = byId("class-grid");
    host.textContent = "";
    if (!DATA.classes) {
      host.appendChild(el("p", { class: "empty" }, "No classes given."));
      return;
    }
    host.appendChild(
      gridTable("class-grid", (td, l, h) => {
        const c = DATA.classes[l][h];
        td.style.background = DATA.classColors[c];
        td.textContent = DATA.classAbbrev[c];
        td.title = "layer " + l + ", head " + h + ": " + c;
      })
    );
    const legend = byId("class-legend");
    legend.textContent = "";
    for (const c of DATA.classNames) {
      const sw = el("span", { class: "swatch" });
      sw.style.background = DATA.classColors[c];
      legend.appendChild(sw);
      const total = DATA.classCounts[c].reduce((a, b) => a + b, 0);
      legend.appendChild(document.createTextNode(DATA.classAbbrev[c] + " " + c + " (" + total + ")"));
    }
  }

  function drawScoreGrid() {
    const host = byId("score-grid");
    host.textContent = "";
    const table = DATA.scores[state.score];
    const finite = table.flat().filter((v) => v !== null);
    const lo = finite.length ? Math.min(...finite) : 0;
    const hi = finite.length ? Math.max(...finite) : 1;
    host.appendChild(
      gridTable("score-grid", (td, l, h) => {
        const v = table[l][h];
        td.title = "layer " + l + ", head " + h + ": " + state.score + " = " + fmt(v);
        if (v === null) {
          td.style.background = "#bbbbbb";
          td.textContent = "n/a";
          return;
        }
        const rgb = ramp(VIRIDIS, hi > lo ? (v - lo) / (hi - lo) : 0.5);
        td.style.background = css(rgb);
        td.style.color = isDark(rgb) ? "#fff" : "#000";
        td.textContent = v.toFixed(2);
      })
    );
    byId("score-range").textContent = finite.length
      ? "colour scale: " + lo.toFixed(3) + " (dark) to " + hi.toFixed(3) + " (yellow)"
      : "no value: this score applied to no example (e.g. block without pair inputs)";
    markSelected();
  }

  function markSelected() {
    for (const td of document.querySelectorAll("table.grid td.sel")) td.classList.remove("sel");
    const q = 'td[data-layer="' + state.layer + '"][data-head="' + state.head + '"]';
    for (const td of document.querySelectorAll("table.grid " + q)) td.classList.add("sel");
  }

  // ------------------------------------------------------------------ explorer
  function fillSelect(sel, items) {
    sel.textContent = "";
    items.forEach(([value, text]) => sel.appendChild(el("option", { value: value }, text)));
  }

  function weights() {
    const ex = DATA.examples[state.example];
    const n = ex.n;
    const off = (state.layer * H + state.head) * n * n;
    return { ex: ex, n: n, at: (i, j) => ex.maps[off + i * n + j] / DATA.scale, off: off };
  }

  function hashMap(w) {
    let h = 2166136261; // FNV-1a over the drawn weights and the selection
    const ex = w.ex;
    const feed = (v) => {
      h ^= v & 0xffff;
      h = Math.imul(h, 16777619) >>> 0;
    };
    feed(state.example);
    feed(state.layer);
    feed(state.head);
    for (let k = w.off; k < w.off + w.n * w.n; k++) feed(ex.maps[k]);
    return h.toString(16);
  }

  function label(tok) {
    return tok.length > 14 ? tok.slice(0, 13) + "\u2026" : tok;
  }

  function drawCanvas(w) {
    const canvas = byId("attn-canvas");
    const ctx = canvas.getContext("2d");
    const n = w.n;
    const cell = Math.max(4, Math.min(22, Math.floor(520 / n)));
    ctx.font = "11px system-ui, sans-serif";
    let margin = 20;
    for (const t of w.ex.tokens) margin = Math.max(margin, ctx.measureText(label(t)).width + 8);
    margin = Math.ceil(margin);
    canvas.width = margin + n * cell + 2;
    canvas.height = margin + n * cell + 2;
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    let vmax = 0.001; // colours span 0 .. this map's largest weight
    for (let k = w.off; k < w.off + n * n; k++) vmax = Math.max(vmax, w.ex.maps[k] / DATA.scale);
    byId("attn-scale").textContent = "Darkest blue = " + vmax.toFixed(3) + " (this map's maximum).";
    for (let i = 0; i < n; i++) {
      for (let j = 0; j < n; j++) {
        ctx.fillStyle = css(ramp(BLUES, w.at(i, j) / vmax));
        ctx.fillRect(margin + j * cell, margin + i * cell, cell, cell);
      }
    }
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#1d2330";
    ctx.textBaseline = "middle";
    if (cell >= 8) {
      ctx.textAlign = "right";
      w.ex.tokens.forEach((t, i) => ctx.fillText(label(t), margin - 4, margin + (i + 0.5) * cell));
      ctx.save();
      ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left";
      w.ex.tokens.forEach((t, j) => ctx.fillText(label(t), -margin + 4, margin + (j + 0.5) * cell));
      ctx.restore();
    }
    canvas.dataset.example = String(state.example);
    canvas.dataset.layer = String(state.layer);
    canvas.dataset.head = String(state.head);
    canvas.dataset.hash = hashMap(w);
    canvas.onmousemove = (ev) => {
      const r = canvas.getBoundingClientRect();
      const j = Math.floor((ev.clientX - r.left - margin) / cell);
      const i = Math.floor((ev.clientY - r.top - margin) / cell);
      if (i >= 0 && j >= 0 && i < n && j < n) {
        byId("attn-tip").textContent =
          w.ex.tokens[i] + " \u2192 " + w.ex.tokens[j] + ": " + w.at(i, j).toFixed(3);
      }
    };
  }

  function drawLines(w) {
    const svg = byId("attn-lines");
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const n = w.n;
    const row = 18;
    const leftX = 150;
    const rightX = 330;
    svg.setAttribute("width", String(rightX + 150));
    svg.setAttribute("height", String(n * row + 16));
    const lines = [];
    const group = document.createElementNS(SVG_NS, "g");
    svg.appendChild(group);
    for (let i = 0; i < n; i++) {
      for (let j = 0; j < n; j++) {
        const v = w.at(i, j);
        if (v < 0.01) continue; // invisible anyway; keeps the DOM small
        const line = document.createElementNS(SVG_NS, "line");
        line.setAttribute("x1", String(leftX + 6));
        line.setAttribute("y1", String(12 + i * row));
        line.setAttribute("x2", String(rightX - 6));
        line.setAttribute("y2", String(12 + j * row));
        line.setAttribute("stroke-opacity", v.toFixed(3));
        line.setAttribute("stroke-width", "2");
        group.appendChild(line);
        lines.push({ node: line, i: i, j: j });
      }
    }
    svg.dataset.lines = String(lines.length);
    const show = (pred) => {
      for (const ln of lines) ln.node.style.display = pred(ln) ? "" : "none";
    };
    const addToken = (x, y, text, anchor, side, k) => {
      const t = document.createElementNS(SVG_NS, "text");
      t.setAttribute("x", String(x));
      t.setAttribute("y", String(y));
      t.setAttribute("text-anchor", anchor);
      t.setAttribute("dominant-baseline", "middle");
      t.textContent = label(text);
      t.addEventListener("mouseenter", () => {
        t.classList.add("hot");
        show((ln) => (side === "left" ? ln.i === k : ln.j === k));
      });
      t.addEventListener("mouseleave", () => {
        t.classList.remove("hot");
        show(() => true);
      });
      svg.appendChild(t);
    };
    w.ex.tokens.forEach((tok, k) => {
      addToken(leftX, 12 + k * row, tok, "end", "left", k);
      addToken(rightX, 12 + k * row, tok, "start", "right", k);
    });
  }

  function headInfo() {
    const parts = ["Layer " + state.layer + ", head " + state.head];
    if (DATA.classes) parts.push("class: " + DATA.classes[state.layer][state.head]);
    for (const name of scoreNames) parts.push(name + " " + fmt(DATA.scores[name][state.layer][state.head]));
    byId("head-info").textContent = parts.join(" \u00b7 ");
    const badge = byId("head-mechanism");
    const spec = replacedBy(state.layer, state.head);
    badge.classList.toggle("replaced", Boolean(spec));
    badge.textContent = spec
      ? "replaced by the plan: " + spec
      : REPLACED
        ? "softmax attention (not replaced by the plan)"
        : "no plan: softmax attention";
  }

  function headLabel(l, h) {
    const spec = replacedBy(l, h);
    return spec ? h + " \u2014 " + (MECH[spec] || spec) + " (replaced)" : String(h);
  }

  function layerLabel(l) {
    const n = REPLACED ? REPLACED[l].filter((s) => s).length : 0;
    return n ? l + " (" + n + " replaced)" : String(l);
  }

  function fillHeads() {
    fillSelect(byId("head-select"), [...Array(H).keys()].map((h) => [h, headLabel(state.layer, h)]));
  }

  function render() {
    fillHeads();
    byId("layer-select").value = String(state.layer);
    byId("head-select").value = String(state.head);
    headInfo();
    markSelected();
    if (!DATA.examples.length) {
      byId("explorer-note").textContent = "No example maps were included in this report.";
      return;
    }
    byId("example-select").value = String(state.example);
    const w = weights();
    byId("explorer-note").textContent =
      w.ex.total > w.n ? "Showing the first " + w.n + " of " + w.ex.total + " tokens." : "";
    drawCanvas(w);
    drawLines(w);
    document.body.dataset.rendered = String(Number(document.body.dataset.rendered || 0) + 1);
  }

  function selectHead(l, h) {
    state.layer = l;
    state.head = h;
    render();
    byId("explorer").scrollIntoView({ behavior: "smooth", block: "start" });
  }

  function init() {
    fillSelect(byId("score-select"), scoreNames.map((s) => [s, s]));
    fillSelect(byId("layer-select"), [...Array(L).keys()].map((l) => [l, layerLabel(l)]));
    fillHeads();
    fillSelect(
      byId("example-select"),
      DATA.examples.map((ex, k) => [k, k + ": " + ex.tokens.slice(0, 8).join(" ")])
    );
    byId("score-select").addEventListener("change", (e) => {
      state.score = e.target.value;
      drawScoreGrid();
    });
    byId("example-select").addEventListener("change", (e) => {
      state.example = Number(e.target.value);
      render();
    });
    byId("layer-select").addEventListener("change", (e) => {
      state.layer = Number(e.target.value);
      render();
    });
    byId("head-select").addEventListener("change", (e) => {
      state.head = Number(e.target.value);
      render();
    });
    drawMechGrid();
    drawClassGrid();
    drawScoreGrid();
    render();
    document.body.dataset.ready = "1";
  }

  init();
})();
