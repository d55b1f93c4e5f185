/* contribution-weights interactive report: the page's behaviour. Vanilla JS, no network.
 *
 * Loaded after report_data.js (cwStore: the embedded chunks) and report_chart.js
 * (cwChart: the first-token chart). META (#cw-meta) describes the trace; the state
 * object below is the whole UI state, and render() redraws from it.
 */
(function () {
  "use strict";

  const META = JSON.parse(document.getElementById("cw-meta").textContent);
  const STORE = cwStore(META);
  const chunk = STORE.chunk;
  const T = META.num_tokens;
  const H = META.num_heads;
  const SUM = H; // block index of the sum over heads
  const MEAN = "mean";
  const $ = (id) => document.getElementById(id);

  const state = {
    measure: META.measure_order.includes("contribution") ? "contribution" : META.measure_order[0],
    layer: META.layers.length ? String(META.layers[META.layers.length - 1]) : MEAN,
    head: SUM,
    query: null, // the query shown (hovered or pinned)
    pinned: null,
    ignoreFirst: false,
    // long texts open with √ contrast and per-row heatmap scaling (META.defaults, set by
    // report.py's view_defaults): a linear scale for the whole block is nearly blank there
    contrast: (META.defaults && META.defaults.contrast) || "linear",
    heatRows: (META.defaults && META.defaults.heat_rows) || "block", // "block" (one scale for all cells) or "row" (each query row)
    hm: [
      META.measure_order.includes("attention") ? "attention" : META.measure_order[0],
      META.measure_order.includes("contribution") ? "contribution" : META.measure_order[META.measure_order.length - 1],
    ],
    matches: [],
    matchPos: -1,
  };

  // ---- colours ----------------------------------------------------------------------
  const NEG = [33, 102, 172];
  const POS = [178, 24, 43];
  const MID = [255, 255, 255];
  function mix(a, b, t) {
    return [a[0] + (b[0] - a[0]) * t, a[1] + (b[1] - a[1]) * t, a[2] + (b[2] - a[2]) * t];
  }
  /* value / scale in [-1, 1] -> rgb; unsigned measures only use the positive half. */
  function colour(x) {
    let t = Math.max(-1, Math.min(1, x));
    if (state.contrast === "sqrt") t = Math.sign(t) * Math.sqrt(Math.abs(t));
    return t >= 0 ? mix(MID, POS, t) : mix(MID, NEG, -t);
  }
  const css = (c) => "rgb(" + Math.round(c[0]) + "," + Math.round(c[1]) + "," + Math.round(c[2]) + ")";
  const isDark = (x) => Math.abs(state.contrast === "sqrt" ? Math.sqrt(Math.abs(x)) : x) > 0.62;

  function legendHTML(scale, signed) {
    const stops = signed ? [-1, -0.5, 0, 0.5, 1] : [0, 0.25, 0.5, 0.75, 1];
    const grad = stops.map((s) => css(colour(s))).join(",");
    const lo = signed ? fmt(-scale) : "0";
    return '<span>' + lo + '</span><span class="bar" style="background:linear-gradient(90deg,' + grad +
      ')"></span><span>' + fmt(scale) + "</span>";
  }

  // ---- formatting -------------------------------------------------------------------
  function fmt(v) {
    if (v === 0) return "0";
    const a = Math.abs(v);
    if (a >= 1000 || a < 1e-3) return v.toExponential(2);
    return v.toPrecision(3);
  }
  const esc = cwEsc;
  function shown(tok) {
    return tok.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/ /g, "·") || "∅";
  }
  const layerName = (l) => (l === MEAN ? "mean over " + META.traced_layers.length + " layers" : "layer " + l);
  const headName = (h) => (h === SUM ? "Σ heads" : "head " + h);

  // ---- status -----------------------------------------------------------------------
  const { fail, during } = cwStatus();

  // ---- tokens -----------------------------------------------------------------------
  const tokenEls = [];
  function buildTokens() {
    const box = $("cw-tokens");
    const frag = document.createDocumentFragment();
    META.tokens.forEach((tok, i) => {
      const span = document.createElement("span");
      span.className = "tok";
      span.dataset.i = String(i);
      if (tok.includes("\n")) {
        const parts = tok.split("\n");
        parts.forEach((p, k) => {
          if (p) span.appendChild(document.createTextNode(p));
          if (k < parts.length - 1) {
            const nl = document.createElement("span");
            nl.className = "nl";
            nl.textContent = "↵";
            span.appendChild(nl);
            span.appendChild(document.createTextNode("\n"));
          }
        });
      } else {
        span.textContent = tok === "" ? "∅" : tok;
      }
      tokenEls.push(span);
      frag.appendChild(span);
    });
    box.appendChild(frag);
    box.addEventListener("mouseover", (e) => {
      const el = e.target.closest(".tok");
      if (!el) return;
      const i = Number(el.dataset.i);
      if (state.pinned === null) setQuery(i);
      showTokenTip(el, i);
    });
    box.addEventListener("mousemove", (e) => moveTip(e));
    box.addEventListener("mouseleave", () => {
      hideTip();
      if (state.pinned === null) setQuery(null);
    });
    box.addEventListener("click", (e) => {
      const el = e.target.closest(".tok");
      if (!el) return;
      const i = Number(el.dataset.i);
      pin(state.pinned === i ? null : i);
      showTokenTip(el, i);
    });
  }

  function pin(i) {
    hideTip();
    state.pinned = i;
    tokenEls.forEach((el) => el.classList.remove("pinned"));
    if (i !== null) tokenEls[i].classList.add("pinned");
    setQuery(i);
  }

  function setQuery(i) {
    state.query = i;
    renderTokens();
    renderRowMarkers();
  }

  let tokenChunk = null; // the chunk for the current measure/layer, once loaded
  function rowValues(ch, b, i) {
    const out = new Float64Array(i + 1);
    for (let j = 0; j <= i; j++) out[j] = ch.get(b, i, j);
    return out;
  }
  function rowScale(vals) {
    let m = 0;
    for (let j = state.ignoreFirst && vals.length > 1 ? 1 : 0; j < vals.length; j++) m = Math.max(m, Math.abs(vals[j]));
    return m;
  }

  function renderTokens() {
    const q = state.query;
    const signed = META.measures[state.measure].signed;
    tokenEls.forEach((el) => el.classList.remove("query"));
    if (q === null || !tokenChunk) {
      tokenEls.forEach((el) => {
        el.style.background = "";
        el.classList.remove("after", "dark");
        delete el.dataset.w;
      });
      $("cw-token-legend").innerHTML = "";
      $("cw-query").innerHTML = q === null ? "No token selected." : "Decoding…";
      return;
    }
    const vals = rowValues(tokenChunk, state.head, q);
    const scale = rowScale(vals);
    for (let j = 0; j < T; j++) {
      const el = tokenEls[j];
      if (j <= q) {
        const x = scale > 0 ? vals[j] / scale : 0;
        el.style.background = css(colour(x));
        el.classList.toggle("dark", isDark(x));
        el.classList.remove("after");
        el.dataset.w = String(vals[j]);
      } else {
        el.style.background = "";
        el.classList.remove("dark");
        el.classList.add("after");
        delete el.dataset.w;
      }
    }
    tokenEls[q].classList.add("query");
    $("cw-token-legend").innerHTML = legendHTML(scale, signed) +
      '<span>' + esc(state.measure) + " · " + layerName(state.layer) + " · " + headName(state.head) + "</span>";
    renderQueryInfo(q, vals);
  }

  function renderQueryInfo(q, vals) {
    let total = 0;
    for (let j = 0; j <= q; j++) total += vals[j];
    const order = Array.from(vals.keys()).sort((a, b) => Math.abs(vals[b]) - Math.abs(vals[a])).slice(0, 6);
    const degenerate = state.layer !== MEAN && (META.degenerate[state.layer] || []).includes(q);
    $("cw-query").innerHTML =
      "<b>Query #" + q + "</b> <code>" + esc(shown(META.tokens[q])) + "</code> · " + esc(state.measure) + " · " +
      layerName(state.layer) + " · " + headName(state.head) + " · Σ<sub>j</sub> = " + fmt(total) +
      (degenerate ? ' · <span class="warning-inline">‖o<sub>i</sub>‖ = 0 here: measures are 0 by convention</span>' : "") +
      '<div class="top-keys">Largest |w|: ' +
      order.map((j) => "<span>#" + j + " <code>" + esc(shown(META.tokens[j])) + "</code> " + fmt(vals[j]) + "</span>").join("") +
      "</div>";
  }

  // ---- tooltip ----------------------------------------------------------------------
  const tip = $("cw-tip");
  function showTip(html, e) {
    tip.innerHTML = html;
    tip.hidden = false;
    if (e) moveTip(e);
  }
  function moveTip(e) {
    if (tip.hidden) return;
    const x = Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    const y = e.clientY + 18 + tip.offsetHeight > window.innerHeight ? e.clientY - tip.offsetHeight - 10 : e.clientY + 18;
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  function hideTip() {
    tip.hidden = true;
  }
  function showTokenTip(el, j) {
    let html = "#" + j + " <code>" + esc(shown(META.tokens[j])) + "</code> (id " + META.ids[j] + ")";
    const q = state.query;
    if (q !== null && el.dataset.w !== undefined && q !== j) {
      html += "<br>" + esc(state.measure) + " of query #" + q + " on it: <b>" + fmt(Number(el.dataset.w)) + "</b>";
    } else if (q === j && el.dataset.w !== undefined) {
      html += "<br>weight on itself: <b>" + fmt(Number(el.dataset.w)) + "</b>";
    }
    showTip(html, null);
    const r = el.getBoundingClientRect();
    tip.style.left = Math.min(r.left, window.innerWidth - tip.offsetWidth - 8) + "px";
    tip.style.top = r.bottom + 6 + "px";
  }

  // ---- heatmaps ---------------------------------------------------------------------
  const heatmaps = [0, 1].map((k) => {
    const fig = $("cw-hm-" + k);
    const canvas = fig.querySelector("canvas");
    canvas.width = T;
    canvas.height = T;
    // nearest-neighbour when enlarging a short text; smoothing when shrinking a long one
    canvas.style.imageRendering = T < 320 ? "pixelated" : "auto";
    return { fig, canvas, select: fig.querySelector("select"), row: fig.querySelector(".hm-row"), legend: fig.querySelector(".legend"), chunk: null };
  });

  function drawHeatmap(hm, measure, ch) {
    hm.chunk = ch;
    const ctx = hm.canvas.getContext("2d");
    const img = ctx.createImageData(T, T);
    const px = img.data;
    const b = state.head;
    const first = state.ignoreFirst ? 1 : 0;
    const rowScales = new Float64Array(T);
    let scale = 0;
    for (let i = 0; i < T; i++) {
      let m = 0;
      for (let j = first; j <= i; j++) m = Math.max(m, Math.abs(ch.get(b, i, j)));
      rowScales[i] = m;
      scale = Math.max(scale, m);
    }
    const perRow = state.heatRows === "row";
    for (let i = 0; i < T; i++) {
      const s = perRow ? rowScales[i] : scale;
      for (let j = 0; j < T; j++) {
        const o = 4 * (i * T + j);
        if (j > i) {
          px[o] = 236; px[o + 1] = 238; px[o + 2] = 242; px[o + 3] = 255;
          continue;
        }
        const c = colour(s > 0 ? ch.get(b, i, j) / s : 0);
        px[o] = c[0]; px[o + 1] = c[1]; px[o + 2] = c[2]; px[o + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
    hm.legend.innerHTML = perRow
      ? legendHTML(1, META.measures[measure].signed).replace(/>1\.00</, ">row max<").replace(/>-1\.00</, ">−row max<")
      : legendHTML(scale, META.measures[measure].signed);
  }

  function renderRowMarkers() {
    heatmaps.forEach((hm) => {
      if (state.query === null) {
        hm.row.style.display = "none";
        return;
      }
      hm.row.style.display = "block";
      hm.row.style.top = ((state.query + 0.5) / T) * 100 + "%";
    });
  }

  function heatmapCell(hm, e) {
    const r = hm.canvas.getBoundingClientRect();
    const i = Math.floor(((e.clientY - r.top) / r.height) * T);
    const j = Math.floor(((e.clientX - r.left) / r.width) * T);
    return i >= 0 && i < T && j >= 0 && j < T ? [i, j] : null;
  }

  heatmaps.forEach((hm, k) => {
    hm.canvas.addEventListener("mousemove", (e) => {
      const cell = heatmapCell(hm, e);
      if (!cell || !hm.chunk) return hideTip();
      const [i, j] = cell;
      const v = j <= i ? fmt(hm.chunk.get(state.head, i, j)) : "masked";
      showTip(
        "query #" + i + " <code>" + esc(shown(META.tokens[i])) + "</code><br>key #" + j + " <code>" +
          esc(shown(META.tokens[j])) + "</code><br>" + esc(state.hm[k]) + ": <b>" + v + "</b>",
        e,
      );
    });
    hm.canvas.addEventListener("mouseleave", hideTip);
    hm.canvas.addEventListener("click", (e) => {
      const cell = heatmapCell(hm, e);
      if (cell) pin(cell[0]);
    });
    hm.select.addEventListener("change", () => {
      state.hm[k] = hm.select.value;
      render();
    });
  });

  // ---- first-token chart ------------------------------------------------------------
  function renderChart() {
    const layers = META.layers.map(String);
    cwChart($("cw-chart"), META.first_token_weight, Number(state.layer), esc, (l) => {
      if (layers.includes(l)) {
        $("cw-layer").value = l;
        state.layer = l;
        render();
      } else {
        $("cw-status").textContent = "layer " + l + " is not embedded in this report";
      }
    });
  }

  function renderSummary() {
    const t = META.summary;
    if (!t.rows.length) {
      $("cw-summary").textContent = "No weight measure in this trace.";
      return;
    }
    const label = { first_token_weight: "first-token weight", entropy: "entropy", entropy_excl_first: "entropy (j ≥ 1)" };
    let html = '<table class="summary"><thead><tr><th>measure</th>' +
      t.columns.map((c) => "<th>" + esc(label[c] || c) + "</th>").join("") + "</tr></thead><tbody>";
    t.rows.forEach((r) => {
      html += '<tr data-measure="' + esc(r.measure) + '"' + (r.measure === state.measure ? ' class="current"' : "") +
        "><td>" + esc(r.measure) + "</td>" + t.columns.map((c) => "<td>" + (r[c] === null ? "–" : r[c].toFixed(3)) + "</td>").join("") + "</tr>";
    });
    $("cw-summary").innerHTML = html + "</tbody></table>";
  }

  // ---- search -----------------------------------------------------------------------
  function search(text) {
    tokenEls.forEach((el) => el.classList.remove("match"));
    state.matches = [];
    state.matchPos = -1;
    const q = text.trim();
    if (!q) {
      $("cw-search-count").textContent = "";
      return;
    }
    const m = /^#(\d+)$/.exec(q);
    if (m) {
      const i = Number(m[1]);
      if (i < T) state.matches = [i];
    } else {
      const needle = q.toLowerCase();
      META.tokens.forEach((tok, i) => { if (tok.toLowerCase().includes(needle)) state.matches.push(i); });
    }
    state.matches.forEach((i) => tokenEls[i].classList.add("match"));
    $("cw-search-count").textContent = state.matches.length + (state.matches.length === 1 ? " match" : " matches") +
      (state.matches.length ? " (Enter: next)" : "");
  }
  function nextMatch() {
    if (!state.matches.length) return;
    state.matchPos = (state.matchPos + 1) % state.matches.length;
    const i = state.matches[state.matchPos];
    pin(i);
    tokenEls[i].scrollIntoView({ block: "nearest" });
  }

  // ---- rendering --------------------------------------------------------------------
  let generation = 0;
  async function render() {
    const gen = ++generation;
    hideTip();
    await during(async () => {
      const [tc, h0, h1] = await Promise.all([
        chunk(state.measure, state.layer),
        chunk(state.hm[0], state.layer),
        chunk(state.hm[1], state.layer),
      ]);
      if (gen !== generation) return;
      tokenChunk = tc;
      drawHeatmap(heatmaps[0], state.hm[0], h0);
      drawHeatmap(heatmaps[1], state.hm[1], h1);
      $("cw-heat-where").textContent = layerName(state.layer) + " · " + headName(state.head);
      renderTokens();
      renderRowMarkers();
      renderChart();
      renderSummary();
      document.body.dataset.rendered = [state.measure, state.layer, state.head, state.query].join("|");
    });
  }

  function setup() {
    const sub = [
      META.model ? esc(META.model) : "",
      T + " tokens",
      META.layers.length + " of " + META.traced_layers.length + " traced layers embedded",
      H + " heads",
      (META.precision === "uint8" ? "values rounded to 8 bits" : "values rounded to float16") +
        " for this page (the trace itself is not rounded; see “About these numbers”)",
    ].filter(Boolean);
    $("cw-subtitle").innerHTML = sub.join(" · ");
    META.warnings.forEach((w) => {
      const box = document.createElement("div");
      box.className = "warning";
      box.textContent = w;
      $("cw-warnings").appendChild(box);
    });
    $("cw-rounding").textContent = META.rounding;
    $("cw-measure-list").innerHTML = META.measure_order
      .map((m) => "<dt>" + esc(m) + "</dt><dd>" + esc(META.measures[m].description) + (META.measures[m].signed ? " (signed)" : "") + "</dd>")
      .join("");

    const measures = META.measure_order.map((m) => [m, m]);
    cwFillSelect($("cw-measure"), measures, state.measure);
    cwFillSelect($("cw-layer"), META.layers.map((l) => [l, "layer " + l]).concat([[MEAN, "mean over layers"]]), state.layer);
    cwFillSelect($("cw-head"), Array.from({ length: H }, (_, h) => [h, "head " + h]).concat([[SUM, "Σ sum over heads"]]), state.head);
    heatmaps.forEach((hm, k) => cwFillSelect(hm.select, measures, state.hm[k]));
    $("cw-contrast").value = state.contrast;
    $("cw-heat-rows").value = state.heatRows;

    $("cw-measure").addEventListener("change", (e) => { state.measure = e.target.value; render(); });
    $("cw-layer").addEventListener("change", (e) => { state.layer = e.target.value; render(); });
    $("cw-head").addEventListener("change", (e) => { state.head = Number(e.target.value); render(); });
    $("cw-ignore-first").addEventListener("change", (e) => { state.ignoreFirst = e.target.checked; render(); });
    $("cw-contrast").addEventListener("change", (e) => { state.contrast = e.target.value; render(); });
    $("cw-heat-rows").addEventListener("change", (e) => { state.heatRows = e.target.value; render(); });
    $("cw-search").addEventListener("input", (e) => search(e.target.value));
    $("cw-search").addEventListener("keydown", (e) => {
      if (e.key === "Enter") { e.preventDefault(); nextMatch(); }
    });
    document.addEventListener("keydown", (e) => {
      if (e.target instanceof HTMLInputElement || e.target instanceof HTMLSelectElement) return;
      const cur = state.pinned === null ? (state.query === null ? -1 : state.query) : state.pinned;
      if (e.key === "ArrowRight") { e.preventDefault(); pin(Math.min(T - 1, cur + 1)); }
      else if (e.key === "ArrowLeft") { e.preventDefault(); pin(Math.max(0, cur <= 0 ? 0 : cur - 1)); }
      else if (e.key === "Escape") pin(null);
    });
    buildTokens();
  }

  try {
    setup();
    render().then(() => { document.body.dataset.ready = "1"; });
  } catch (err) {
    fail(err);
  }
})();
