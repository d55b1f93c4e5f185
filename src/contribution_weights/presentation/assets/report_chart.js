/* contribution-weights report: the per-layer first-token weight chart (SVG, no library).
 *
 * cwChart(box, data, current, esc, onPick) draws data.series[measure][k] against
 * data.layers[k], marks the layer `current`, and calls onPick(layer as text) when a
 * point is clicked.
 */
function cwChart(box, data, current, esc, onPick) {
  "use strict";
  const PALETTE = ["#2f5bd3", "#b2182b", "#0f9d76", "#a855f7", "#d97706", "#0891b2", "#64748b", "#db2777"];
  const names = Object.keys(data.series);
  if (!names.length) {
    box.textContent = "No weight measure in this trace.";
    return;
  }
  const W = 560, Hh = 230, L = 44, R = 12, Tp = 12, B = 34;
  const xs = data.layers;
  let ymax = 0;
  names.forEach((n) => data.series[n].forEach((v) => { if (v !== null) ymax = Math.max(ymax, v); }));
  ymax = ymax > 0 ? ymax * 1.08 : 1;
  const x = (k) => L + (xs.length > 1 ? (k / (xs.length - 1)) * (W - L - R) : (W - L - R) / 2);
  const y = (v) => Tp + (1 - v / ymax) * (Hh - Tp - B);
  let svg = '<svg viewBox="0 0 ' + W + " " + (Hh + 22) + '" role="img" aria-label="First-token weight per layer">';
  for (let g = 0; g <= 4; g++) {
    const v = (ymax * g) / 4;
    svg += '<line class="grid-line" x1="' + L + '" x2="' + (W - R) + '" y1="' + y(v) + '" y2="' + y(v) + '"/>';
    svg += '<text x="' + (L - 6) + '" y="' + (y(v) + 4) + '" text-anchor="end">' + v.toFixed(2) + "</text>";
  }
  svg += '<line class="axis" x1="' + L + '" x2="' + (W - R) + '" y1="' + y(0) + '" y2="' + y(0) + '"/>';
  const every = Math.max(1, Math.ceil(xs.length / 15));
  xs.forEach((l, k) => {
    if (k % every === 0 || k === xs.length - 1) svg += '<text x="' + x(k) + '" y="' + (Hh - B + 16) + '" text-anchor="middle">' + l + "</text>";
  });
  svg += '<text x="' + (L + (W - L - R) / 2) + '" y="' + (Hh - 2) + '" text-anchor="middle">layer</text>';
  const cur = xs.indexOf(current);
  if (cur >= 0) svg += '<line class="cursor" x1="' + x(cur) + '" x2="' + x(cur) + '" y1="' + Tp + '" y2="' + y(0) + '"/>';
  names.forEach((n, s) => {
    const col = PALETTE[s % PALETTE.length];
    const pts = data.series[n].map((v, k) => (v === null ? null : x(k) + "," + y(v))).filter(Boolean);
    svg += '<polyline class="series" stroke="' + col + '" points="' + pts.join(" ") + '"/>';
    data.series[n].forEach((v, k) => {
      if (v === null) return;
      svg += '<circle class="pt" data-layer="' + xs[k] + '" cx="' + x(k) + '" cy="' + y(v) + '" r="3" fill="' + col +
        '"><title>' + esc(n) + " · layer " + xs[k] + ": " + v.toFixed(4) + "</title></circle>";
    });
    const lx = L + 8 + (s % 4) * 128, ly = Hh + 16 + Math.floor(s / 4) * 14;
    svg += '<g class="legend-item"><rect x="' + lx + '" y="' + (ly - 8) + '" width="12" height="4" fill="' + col +
      '"/><text x="' + (lx + 16) + '" y="' + (ly - 3) + '">' + esc(n) + "</text></g>";
  });
  const rows = Math.ceil(names.length / 4);
  svg = svg.replace('viewBox="0 0 ' + W + " " + (Hh + 22) + '"', 'viewBox="0 0 ' + W + " " + (Hh + 14 + rows * 14) + '"');
  box.innerHTML = svg + "</svg>";
  box.querySelectorAll(".pt").forEach((pt) => pt.addEventListener("click", () => onPick(pt.dataset.layer)));
}
