/* contribution-weights report, long view (long_report.py): per-token heat over the whole
 * text, the maps of a window of queries, the first-token chart. Vanilla JS, no network.
 *
 * Loaded after report_data.js (cwBase64Bytes, cwInflate) and report_chart.js (cwChart).
 * One chunk per (measure, layer): float32 scales, source distances, then 8-bit codes;
 * long_report.py's docstring gives the layout.
 */
(function () {
  "use strict";

  const META = JSON.parse(document.getElementById("cw-meta").textContent);
  const T = META.num_tokens;
  const H = META.num_heads;
  const K = H + 1; // rows per chunk: the heads, then their sum
  const SUM = H;
  const KS = META.sources_k;
  const WIN = META.window; // [q0, q1) or null
  const W = WIN ? WIN[1] - WIN[0] : 0;
  const B = META.key_bins;
  const $ = (id) => document.getElementById(id);

  const state = {
    measure: META.measure_order.includes("contribution") ? "contribution" : META.measure_order[0],
    layer: META.layers.length ? META.layers[META.layers.length - 1] : null,
    head: SUM,
    heat: "scores",
    query: WIN ? WIN[1] - 1 : T - 1,
    contrast: "sqrt",
  };

  // ---- data -------------------------------------------------------------------------
  function decode(buf, signed) {
    const size = T > 65535 ? 4 : 2;
    let off = 0;
    const f32 = (n) => { const a = new Float32Array(buf, off, n); off += 4 * n; return a; };
    const sScale = f32(K), fScale = f32(K), wScale = f32(W);
    const Codes = signed ? Int8Array : Uint8Array;
    const codes = (n) => { const a = new Codes(buf, off, n); off += n; return a; };
    const scores = codes(K * T), first = codes(K * T), win = codes(W * B);
    const n = KS * H * T;
    const rel = new Int8Array(buf, off, n);
    off += n;
    const planes = new Uint8Array(buf, off, size * n); // byte plane by byte plane
    const empty = size === 4 ? 0xffffffff : 0xffff;
    const distance = (x) => {
      let d = 0;
      for (let p = size - 1; p >= 0; p--) d = d * 256 + planes[p * n + x];
      return d;
    };
    return {
      score: (b, j) => scores[b * T + j] * sScale[b],
      first: (b, i) => first[b * T + i] * fScale[b],
      win: (r, c) => win[r * B + c] * wScale[r],
      // [key, weight relative to the query's largest |w| in that head] or null
      source: (h, i, s) => {
        const x = (s * H + h) * T + i; // slot-major
        const d = distance(x);
        return d === empty ? null : [i - d, rel[x] / 127];
      },
    };
  }
  const cache = new Map();
  function chunk(measure, layer) {
    const key = measure + "/" + layer;
    if (!cache.has(key)) {
      const m = META.measure_order.indexOf(measure);
      const el = document.getElementById("cw-l" + m + "-" + layer);
      if (!el) return Promise.reject(new Error("no data for " + key));
      cache.set(key, cwInflate(cwBase64Bytes(el.textContent)).then((buf) => decode(buf, META.measures[measure].signed)));
      while (cache.size > 24) cache.delete(cache.keys().next().value);
    }
    return cache.get(key);
  }

  // ---- colours and text -------------------------------------------------------------
  const NEG = [33, 102, 172], POS = [178, 24, 43], MID = [255, 255, 255];
  const mix = (a, b, t) => [a[0] + (b[0] - a[0]) * t, a[1] + (b[1] - a[1]) * t, a[2] + (b[2] - a[2]) * t];
  function colour(x) {
    let t = Math.max(-1, Math.min(1, x));
    if (state.contrast === "sqrt") t = Math.sign(t) * Math.sqrt(Math.abs(t));
    return t >= 0 ? mix(MID, POS, t) : mix(MID, NEG, -t);
  }
  const css = (c) => "rgb(" + Math.round(c[0]) + "," + Math.round(c[1]) + "," + Math.round(c[2]) + ")";
  function fmt(v) {
    if (v === 0) return "0";
    const a = Math.abs(v);
    return a >= 1000 || a < 1e-3 ? v.toExponential(2) : v.toPrecision(3);
  }
  const esc = cwEsc;
  const shown = (tok) => tok.replace(/\n/g, "↵").replace(/\t/g, "⇥") || "∅";

  const { fail, during } = cwStatus();

  const tokenEls = [];
  function buildTokens() {
    const frag = document.createDocumentFragment();
    META.tokens.forEach((tok, i) => {
      const span = document.createElement("span");
      span.className = "tok";
      span.dataset.i = String(i);
      span.textContent = tok === "" ? "∅" : tok;
      span.title = "#" + i;
      tokenEls.push(span);
      frag.appendChild(span);
    });
    const box = $("cw-tokens");
    box.appendChild(frag);
    box.addEventListener("click", (e) => {
      const el = e.target.closest(".tok");
      if (el) select(Number(el.dataset.i));
    });
    box.addEventListener("keydown", (e) => {
      if (e.key === "ArrowRight" || e.key === "ArrowLeft") {
        e.preventDefault();
        select(Math.max(0, Math.min(T - 1, state.query + (e.key === "ArrowRight" ? 1 : -1))));
      }
    });
  }
  function select(i) {
    state.query = i;
    render();
  }

  // ---- views --------------------------------------------------------------------------
  /* the value each token shows in the chosen heat mode (null: not coloured) */
  function tokenValues(ch) {
    const vals = new Array(T).fill(null);
    const b = state.head;
    if (state.heat === "scores") for (let j = 0; j < T; j++) vals[j] = ch.score(b, j);
    else if (state.heat === "first") for (let i = 0; i < T; i++) vals[i] = ch.first(b, i);
    else {
      const heads = b === SUM ? [...Array(H).keys()] : [b];
      for (const h of heads) {
        for (let s = 0; s < KS; s++) {
          const src = ch.source(h, state.query, s);
          if (src === null) continue;
          const [j, w] = src;
          if (vals[j] === null || Math.abs(w) > Math.abs(vals[j])) vals[j] = w;
        }
      }
    }
    return vals;
  }
  const HEAT_TEXT = {
    scores: "each token's score: the mean weight later queries give it",
    first: "each query's weight on token 0 (normalised)",
    sources: "the selected query's top sources, relative to its largest",
  };
  function renderTokens(ch) {
    const vals = tokenValues(ch);
    let scale = 0;
    vals.forEach((v, j) => { if (v !== null && (j > 0 || state.heat === "sources")) scale = Math.max(scale, Math.abs(v)); });
    if (scale === 0) vals.forEach((v) => { if (v !== null) scale = Math.max(scale, Math.abs(v)); });
    tokenEls.forEach((el, j) => {
      const v = vals[j];
      el.classList.toggle("query", j === state.query);
      if (v === null) {
        el.style.backgroundColor = "";
        delete el.dataset.w;
        return;
      }
      el.dataset.w = String(v);
      el.style.backgroundColor = css(colour(scale > 0 ? v / scale : 0));
    });
    const signed = META.measures[state.measure].signed || state.heat === "sources";
    const stops = signed ? [-1, -0.5, 0, 0.5, 1] : [0, 0.25, 0.5, 0.75, 1];
    $("cw-legend").innerHTML = "<span>" + (signed ? fmt(-scale) : "0") + '</span><span class="bar" style="background:linear-gradient(90deg,' +
      stops.map((s) => css(colour(s))).join(",") + ')"></span><span>' + fmt(scale) + "</span>";
    $("cw-heat-what").textContent = HEAT_TEXT[state.heat] + (state.heat === "sources" ? "" : " (scale without token 0)");
    const q = state.query;
    let info = "Query #" + q + " " + esc(JSON.stringify(shown(META.tokens[q]))) +
      ": weight on token 0 " + fmt(ch.first(state.head, q));
    const heads = state.head === SUM ? [...Array(H).keys()] : [state.head];
    const tops = heads.map((h) => ch.source(h, q, 0)).filter((s) => s !== null).map((s) => s[0]);
    if (tops.length) info += "; top source" + (tops.length > 1 ? "s per head" : "") + ": " + tops.map((j) => "#" + j).join(", ");
    $("cw-query").innerHTML = info;
  }

  function renderWindow(ch) {
    const canvas = $("cw-win-canvas");
    if (!WIN) {
      $("cw-win-note").textContent = "This trace holds no maps: no window.";
      canvas.hidden = true;
      return;
    }
    canvas.width = B;
    canvas.height = W;
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(B, W);
    for (let r = 0; r < W; r++) {
      let peak = 0;
      for (let c = 0; c < B; c++) peak = Math.max(peak, Math.abs(ch.win(r, c)));
      const sel = WIN[0] + r === state.query;
      for (let c = 0; c < B; c++) {
        const rgb = sel ? [17, 24, 39] : colour(peak > 0 ? ch.win(r, c) / peak : 0);
        const p = 4 * (r * B + c);
        img.data[p] = rgb[0]; img.data[p + 1] = rgb[1]; img.data[p + 2] = rgb[2]; img.data[p + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
    $("cw-win-where").textContent = state.measure + ", layer " + state.layer + ", Σ heads";
    $("cw-win-note").textContent = "Rows: queries #" + WIN[0] + "–#" + (WIN[1] - 1) + " (top to bottom), each scaled to its own largest |w|; columns: " +
      (B === T ? "keys" : B + " bins of " + (T / B).toFixed(1) + " keys, summed") + ". The selected query's row is dark. Click a row to select it.";
  }

  function renderChart() {
    cwChart($("cw-chart"), META.first_token_weight, String(state.layer), esc, (layer) => {
      if (META.layers.includes(Number(layer))) {
        state.layer = Number(layer);
        $("cw-layer").value = layer;
        render();
      }
    });
  }

  async function render() {
    if (state.layer === null) return;
    await during(async () => {
      const ch = await chunk(state.measure, state.layer);
      renderTokens(ch);
      renderWindow(ch);
      renderChart();
      document.body.dataset.rendered = [state.measure, state.layer, state.head, state.heat, state.query].join("|");
    });
  }

  function setup() {
    const layers = META.layers.length;
    $("cw-subtitle").textContent = (META.model || "trace") + " · " + T.toLocaleString() + " tokens · " + layers + " of " +
      META.traced_layers.length + " traced layers embedded · " + H + " heads · long view (per-token heat; the full query × key maps of " +
      (WIN ? W + " queries" : "no queries") + ")";
    (META.warnings || []).forEach((w) => {
      const box = document.createElement("div");
      box.className = "warning";
      box.textContent = w;
      $("cw-warnings").appendChild(box);
    });
    cwFillSelect($("cw-measure"), META.measure_order.map((m) => [m, m]), state.measure);
    cwFillSelect($("cw-layer"), META.layers.map((l) => [l, "layer " + l]), state.layer);
    cwFillSelect($("cw-head"), [[SUM, "Σ heads"], ...[...Array(H).keys()].map((h) => [h, "head " + h])], state.head);
    $("cw-measure").addEventListener("change", (e) => { state.measure = e.target.value; render(); });
    $("cw-layer").addEventListener("change", (e) => { state.layer = Number(e.target.value); render(); });
    $("cw-head").addEventListener("change", (e) => { state.head = Number(e.target.value); render(); });
    $("cw-heat").addEventListener("change", (e) => { state.heat = e.target.value; render(); });
    $("cw-contrast").addEventListener("change", (e) => { state.contrast = e.target.value; render(); });
    $("cw-goto").addEventListener("change", (e) => {
      const i = Number(String(e.target.value).replace("#", ""));
      if (Number.isInteger(i) && i >= 0 && i < T) {
        select(i);
        tokenEls[i].scrollIntoView({ block: "center" });
      }
    });
    $("cw-win-canvas").addEventListener("click", (e) => {
      const rect = e.target.getBoundingClientRect();
      const r = Math.floor(((e.clientY - rect.top) / rect.height) * W);
      if (r >= 0 && r < W) select(WIN[0] + r);
    });
    buildTokens();
    render().then(() => { document.body.dataset.ready = "1"; });
  }

  try {
    setup();
  } catch (err) {
    fail(err);
  }
})();
