/* The attribution page: colours the text by one method's scores for one target, draws a
 * strip per method and the target's routes as SVG. Everything comes from the JSON in
 * #cw-attribution; nothing is fetched. Token text only ever reaches the page through
 * textContent or esc(). */
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("cw-attribution").textContent);
  const $ = (id) => document.getElementById(id);
  const T = D.tokens.length;
  const state = { method: D.methods[0], target: 0, contrast: "sqrt" };

  // ---- colours (those of the trace report and the figures: RdBu) ---------------------
  const NEG = [33, 102, 172];
  const POS = [178, 24, 43];
  const MID = [255, 255, 255];
  const AFTER = "#eceef2";
  function mix(a, b, t) {
    return [a[0] + (b[0] - a[0]) * t, a[1] + (b[1] - a[1]) * t, a[2] + (b[2] - a[2]) * t];
  }
  function shade(x) {
    let t = Math.max(-1, Math.min(1, x));
    if (state.contrast === "sqrt") t = Math.sign(t) * Math.sqrt(Math.abs(t));
    return t;
  }
  function colour(x) {
    const t = shade(x);
    return t >= 0 ? mix(MID, POS, t) : mix(MID, NEG, -t);
  }
  const css = (c) => "rgb(" + Math.round(c[0]) + "," + Math.round(c[1]) + "," + Math.round(c[2]) + ")";
  const POS_CSS = css(POS);
  const NEG_CSS = css(NEG);

  // ---- formatting -------------------------------------------------------------------
  function fmt(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (v === 0) return "0";
    const a = Math.abs(v);
    if (a >= 1000 || a < 1e-3) return v.toExponential(2);
    return v.toPrecision(3);
  }
  const signed = (v) => (v > 0 ? "+" : "") + fmt(v);
  function esc(s) {
    return String(s).replace(/[&<>"']/g, (c) =>
      ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  }
  function shown(tok) {
    return tok.replace(/\n/g, "↵").replace(/\r/g, "").replace(/\t/g, "⇥").replace(/ /g, "·") || "∅";
  }

  // ---- scores -----------------------------------------------------------------------
  /* The score of token i for a method and target: stored up to the target's position
   * (later tokens cannot drive it); null after it. */
  function score(method, k, i) {
    const row = D.scores[method][k];
    return i < row.length ? row[i] : null;
  }
  const limits = {};
  function limit(method, k) {
    const key = method + "\u0000" + k;
    if (!(key in limits)) {
      let m = 0;
      for (const v of D.scores[method][k]) if (v !== null && Math.abs(v) > m) m = Math.abs(v);
      limits[key] = m > 0 ? m : 1;
    }
    return limits[key];
  }

  // ---- tooltip ----------------------------------------------------------------------
  const tip = $("cw-tip");
  function showTip(html, e) {
    tip.innerHTML = html;
    tip.hidden = false;
    moveTip(e);
  }
  function moveTip(e) {
    if (tip.hidden) return;
    const pad = 14;
    let x = e.clientX + pad;
    let y = e.clientY + pad;
    const r = tip.getBoundingClientRect();
    if (x + r.width > window.innerWidth - 4) x = e.clientX - r.width - pad;
    if (y + r.height > window.innerHeight - 4) y = e.clientY - r.height - pad;
    tip.style.left = Math.max(4, x) + "px";
    tip.style.top = Math.max(4, y) + "px";
  }
  const hideTip = () => { tip.hidden = true; };
  function tokenTip(i) {
    const k = state.target;
    const t = D.targets[k];
    let html = "<code>" + esc(shown(D.tokens[i])) + "</code> · position " + i;
    if (outputOf[i] !== undefined) html += " · output of target " + outputOf[i];
    if (i > t.position) {
      return html + "<br>after the target's position " + t.position + ": it cannot drive it";
    }
    html += "<table>";
    for (const m of D.methods) {
      const v = score(m, k, i);
      const share = v === null ? "" : " (" + Math.round((100 * v) / limit(m, k)) + "% of max |score|)";
      html += '<tr class="' + (m === state.method ? "current" : "") + '"><td>' + esc(m) + "</td><td>" +
        signed(v) + share + "</td></tr>";
    }
    return html + "</table>";
  }

  // ---- the text ---------------------------------------------------------------------
  const tokenEls = Array.from(document.querySelectorAll("#cw-tokens .tok"));
  const outputOf = {};
  D.targets.forEach((t, k) => { if (t.output !== null) outputOf[t.output] = k; });
  tokenEls.forEach((el, i) => { if (outputOf[i] !== undefined) el.classList.add("out"); });

  function paintTokens() {
    const k = state.target;
    const t = D.targets[k];
    const lim = limit(state.method, k);
    tokenEls.forEach((el, i) => {
      const v = score(state.method, k, i);
      el.classList.toggle("after", v === null);
      el.classList.toggle("tgt", i === t.position);
      el.classList.toggle("predicted", i === t.output);
      if (v === null) {
        el.style.backgroundColor = "";
        el.classList.remove("dark");
        delete el.dataset.s;
      } else {
        el.style.backgroundColor = css(colour(v / lim));
        el.classList.toggle("dark", Math.abs(shade(v / lim)) > 0.62);
        el.dataset.s = String(v);
      }
    });
  }
  /* Scroll the text box (not the page) to show token i, when it is out of view. */
  function reveal(i) {
    const el = tokenEls[i];
    const top = el.offsetTop;
    if (top < box.scrollTop || top + el.offsetHeight > box.scrollTop + box.clientHeight) {
      box.scrollTop = Math.max(0, top - box.clientHeight / 2);
    }
  }
  function flash(i) {
    const el = tokenEls[i];
    if (!el) return;
    reveal(i);
    el.classList.add("flash");
    setTimeout(() => el.classList.remove("flash"), 900);
  }
  const box = $("cw-tokens");
  box.addEventListener("mouseover", (e) => {
    const el = e.target.closest(".tok");
    if (el) showTip(tokenTip(Number(el.dataset.i)), e);
  });
  box.addEventListener("mousemove", moveTip);
  box.addEventListener("mouseleave", hideTip);
  box.addEventListener("click", (e) => {
    const el = e.target.closest(".tok");
    if (!el) return;
    const k = outputOf[Number(el.dataset.i)];
    if (k !== undefined) setTarget(k);
  });

  // ---- outputs, target description, top tokens ---------------------------------------
  const outEls = Array.from(document.querySelectorAll("#cw-outputs .out"));
  outEls.forEach((el) => el.addEventListener("click", () => setTarget(Number(el.dataset.k))));
  function describe() {
    const k = state.target;
    const t = D.targets[k];
    outEls.forEach((el) => el.classList.toggle("sel", Number(el.dataset.k) === k));
    const desc = $("cw-target-desc");
    desc.textContent = "";
    const b = document.createElement("b");
    b.textContent = "Target " + k + ": ";
    desc.appendChild(b);
    desc.appendChild(document.createTextNode(t.description));
    const note = D.notes[state.method][k];
    if (note) {
      const span = document.createElement("span");
      span.className = "note";
      span.textContent = " · " + state.method + ": " + note;
      desc.appendChild(span);
    }
    const top = $("cw-top");
    top.textContent = "";
    const row = D.scores[state.method][k];
    // by size: a token that pushes the target down drives it as much as one that pushes it
    // up; token 0, the attention sink, aside (as Attribution.top and the evaluations)
    const order = row.map((v, i) => [v, i]).filter((x) => x[0] !== null && x[1] > 0)
      .sort((a, b2) => Math.abs(b2[0]) - Math.abs(a[0])).slice(0, 10);
    const label = document.createElement("span");
    label.className = "muted";
    label.textContent = "Strongest (" + state.method + ", token 0 aside):";
    top.appendChild(label);
    for (const [v, i] of order) {
      const c = document.createElement("code");
      c.textContent = shown(D.tokens[i]) + "@" + i + " " + signed(v);
      c.title = "find token " + i + " in the text";
      c.addEventListener("click", () => flash(i));
      top.appendChild(c);
    }
  }
  function legend() {
    const lim = limit(state.method, state.target);
    const stops = [-1, -0.5, 0, 0.5, 1].map((s) => css(colour(s))).join(",");
    $("cw-legend").innerHTML = "<span>" + fmt(-lim) + '</span><span class="bar" style="background:linear-gradient(90deg,' +
      stops + ')"></span><span>' + fmt(lim) + "</span><span>(" + esc(state.method) + ", target " + state.target + ")</span>";
  }

  // ---- strips -----------------------------------------------------------------------
  const strips = [];
  function buildStrips() {
    const holder = $("cw-strips");
    for (const m of D.methods) {
      const name = document.createElement("div");
      name.className = "name";
      name.textContent = m;
      const note = document.createElement("span");
      note.className = "note";
      name.appendChild(note);
      const canvas = document.createElement("canvas");
      canvas.dataset.method = m;
      holder.appendChild(name);
      holder.appendChild(canvas);
      const strip = { m, name, note, canvas };
      strips.push(strip);
      name.addEventListener("click", () => setMethod(m));
      canvas.addEventListener("click", (e) => {
        setMethod(m);
        flash(tokenAt(canvas, e));
      });
      canvas.addEventListener("mousemove", (e) => showTip(tokenTip(tokenAt(canvas, e)), e));
      canvas.addEventListener("mouseleave", hideTip);
    }
  }
  function tokenAt(canvas, e) {
    const r = canvas.getBoundingClientRect();
    return Math.max(0, Math.min(T - 1, Math.floor(((e.clientX - r.left) / r.width) * T)));
  }
  function paintStrips() {
    const k = state.target;
    const p = D.targets[k].position;
    for (const s of strips) {
      const c = s.canvas;
      const ratio = window.devicePixelRatio || 1;
      const width = Math.max(1, Math.round((c.clientWidth || 600) * ratio));
      const height = Math.max(1, Math.round((c.clientHeight || 26) * ratio));
      c.width = width;
      c.height = height;
      const g = c.getContext("2d");
      const lim = limit(s.m, k);
      const cells = Math.min(T, width);
      for (let x = 0; x < cells; x++) {  // each cell: its token of largest |score|
        const i0 = Math.floor((x * T) / cells);
        const i1 = Math.max(i0 + 1, Math.floor(((x + 1) * T) / cells));
        let best = null;
        for (let i = i0; i < i1; i++) {
          const v = score(s.m, k, i);
          if (v !== null && (best === null || Math.abs(v) > Math.abs(best))) best = v;
        }
        g.fillStyle = best === null ? AFTER : css(colour(best / lim));
        const a = Math.floor((x * width) / cells);
        const b = Math.floor(((x + 1) * width) / cells);
        g.fillRect(a, 0, Math.max(1, b - a), height);
      }
      const px = ((p + 0.5) / T) * width;  // the target: a black tick above and below
      g.fillStyle = "#111827";
      g.fillRect(Math.round(px - ratio), 0, Math.max(2, Math.round(2 * ratio)), Math.round(height * 0.25));
      g.fillRect(Math.round(px - ratio), Math.round(height * 0.75), Math.max(2, Math.round(2 * ratio)), height);
      s.note.textContent = "max |score| " + fmt(lim);
      s.name.classList.toggle("current", s.m === state.method);
      c.classList.toggle("current", s.m === state.method);
    }
  }

  // ---- routes -----------------------------------------------------------------------
  function drawRoutes() {
    const holder = $("cw-routes");
    const k = state.target;
    const where = $("cw-routes-where");
    if (!D.routes) {
      where.textContent = "";
      holder.innerHTML = '<p class="empty-note">This attribution has no routes: attribute with routes=True (command line: --routes) to see them.</p>';
      return;
    }
    const R = D.routes[k];
    if (!R) {
      holder.innerHTML = '<p class="empty-note">No routes for this target.</p>';
      return;
    }
    const L = R.num_layers;
    const seen = new Set([R.position]);
    for (const e of R.edges) { seen.add(e[1]); seen.add(e[2]); }
    const positions = Array.from(seen).sort((a, b) => a - b);
    const compress = T > 60;
    const col = {};
    positions.forEach((pos, i) => { col[pos] = compress ? i : pos; });
    const nx = compress ? positions.length : T;
    const dx = Math.max(22, Math.min(60, 900 / Math.max(nx, 1)));
    const dy = Math.max(14, Math.min(34, 560 / Math.max(L, 1)));
    const left = 46, top = 18, bottom = 110, right = 18;
    const W = left + right + dx * Math.max(nx - 1, 1);
    const H = top + bottom + dy * L;
    const X = (pos) => left + dx * col[pos];
    const Y = (lvl) => top + dy * (L - lvl);
    let biggest = 0;
    for (const e of R.edges) biggest = Math.max(biggest, Math.abs(e[4]));
    if (!(biggest > 0)) biggest = 1;
    const parts = [];
    parts.push('<svg width="' + W + '" height="' + H + '" viewBox="0 0 ' + W + " " + H +
      '" role="img" aria-label="routes of target ' + k + '">');
    const step = Math.max(1, Math.ceil(L / 15));
    for (let lvl = 0; lvl <= L; lvl++) {
      parts.push('<line class="grid-line" x1="' + left + '" x2="' + (W - right) + '" y1="' + Y(lvl) + '" y2="' + Y(lvl) + '"></line>');
      if (lvl % step === 0 || lvl === L) {
        parts.push('<text x="' + (left - 8) + '" y="' + (Y(lvl) + 4) + '" text-anchor="end">' + lvl + "</text>");
      }
    }
    const nodes = new Map();
    nodes.set(L + ":" + R.position, [L, R.position]);
    const sorted = R.edges.slice().sort((a, b) => Math.abs(a[4]) - Math.abs(b[4]));
    for (const e of sorted) {
      const [layer, src, dst, head, w] = e;
      nodes.set(layer + ":" + src, [layer, src]);
      nodes.set(layer + 1 + ":" + dst, [layer + 1, dst]);
      const x0 = X(src), y0 = Y(layer), x1 = X(dst), y1 = Y(layer + 1);
      const width = (0.6 + (6 * Math.abs(w)) / biggest).toFixed(2);
      const stroke = w >= 0 ? POS_CSS : NEG_CSS;
      const what = (head < 0 ? "residual stream" : "head " + head) + ", layer " + layer + ": " +
        shown(D.tokens[src]) + "@" + src + " → " + shown(D.tokens[dst]) + "@" + dst + ", weight " + signed(w);
      let d;
      let extra = "";
      if (head < 0) {
        d = "M" + x0 + " " + y0 + " L" + x1 + " " + y1;
        extra = ' stroke-dasharray="5 3"';
      } else {
        const bend = x0 === x1 ? dx * 0.3 : 0.15 * dx * Math.sign(x1 - x0);
        const cx = (x0 + x1) / 2 + bend, cy = (y0 + y1) / 2;
        d = "M" + x0 + " " + y0 + " Q" + cx + " " + cy + " " + x1 + " " + y1;
      }
      parts.push('<path class="edge" data-head="' + head + '" d="' + d + '" stroke="' + stroke +
        '" stroke-width="' + width + '" stroke-opacity="' + (head < 0 ? 0.8 : 0.7) + '"' + extra +
        "><title>" + esc(what) + "</title></path>");
    }
    for (const [lvl, pos] of nodes.values()) {
      const isTarget = lvl === L && pos === R.position;
      const what = "level " + lvl + ", " + shown(D.tokens[pos]) + "@" + pos +
        (isTarget ? " (the target's final state)" : "");
      parts.push('<circle class="node' + (isTarget ? " target" : "") + '" cx="' + X(pos) + '" cy="' + Y(lvl) +
        '" r="' + (isTarget ? 7 : 2.6) + '"><title>' + esc(what) + "</title></circle>");
    }
    for (const pos of positions) {
      const x = X(pos), y = Y(0) + 12;
      const label = (compress ? pos + " " : "") + shown(D.tokens[pos]).slice(0, 18);
      parts.push('<text class="tok-label' + (pos === R.position ? " target" : "") + '" x="' + x + '" y="' + y +
        '" text-anchor="end" transform="rotate(-60 ' + x + " " + y + ')">' + esc(label) + "</text>");
    }
    parts.push("</svg>");
    holder.innerHTML = parts.join("");
    where.textContent = "target " + k + ": into position " + R.position + "'s final state · " + R.edges.length +
      " edges with |weight| ≥ " + fmt(R.threshold) + " · widest " + fmt(biggest) +
      (compress ? " · only the positions the routes touch are shown, in order" : "");
  }

  // ---- controls ---------------------------------------------------------------------
  function render() {
    document.body.dataset.method = state.method;
    document.body.dataset.target = String(state.target);
    $("cw-method").value = state.method;
    $("cw-target").value = String(state.target);
    paintTokens();
    describe();
    legend();
    paintStrips();
  }
  function setMethod(m) {
    if (m === state.method) return;
    state.method = m;
    render();
  }
  function setTarget(k) {
    if (k === state.target) return;
    state.target = k;
    render();
    drawRoutes();
    reveal(D.targets[k].position);
  }
  function buildControls() {
    const ms = $("cw-method");
    for (const m of D.methods) {
      const o = document.createElement("option");
      o.value = m;
      o.textContent = m;
      ms.appendChild(o);
    }
    ms.addEventListener("change", () => setMethod(ms.value));
    const ts = $("cw-target");
    D.targets.forEach((t, k) => {
      const o = document.createElement("option");
      o.value = String(k);
      o.textContent = k + ": " + shown(t.token) + " after " + t.position;
      ts.appendChild(o);
    });
    ts.disabled = D.targets.length < 2;
    ts.addEventListener("change", () => setTarget(Number(ts.value)));
    const cs = $("cw-contrast");
    cs.addEventListener("change", () => { state.contrast = cs.value; render(); });
    window.addEventListener("resize", paintStrips);
  }

  buildControls();
  buildStrips();
  render();
  drawRoutes();
  reveal(D.targets[0].position);
  document.body.dataset.ready = "1";
})();
