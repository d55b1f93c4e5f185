/* contribution-weights report: the embedded data (see report_data.py for the layout).
 *
 * cwStore(META).chunk(measure, layer) resolves to an object whose get(b, i, j) is the
 * value of block b (a head, or H for the sum over heads), query i, key j <= i. Chunks
 * are base64 text in script elements, zlib-compressed; they are inflated on first use
 * with the browser's DecompressionStream and kept in a small LRU cache.
 */
/* base64 text -> bytes; zlib bytes -> Promise<ArrayBuffer> (shared by both views). */
function cwBase64Bytes(text) {
  const bin = atob(text.trim());
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

async function cwInflate(bytes) {
  if (typeof DecompressionStream === "undefined") {
    throw new Error("this browser lacks DecompressionStream (needs Chrome 80+, Firefox 113+ or Safari 16.4+)");
  }
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Response(stream).arrayBuffer();
}

/* The status line (#cw-status) and error banners (#cw-warnings) both views share:
 * busy(+1/-1) counts pending decodes in body[data-pending]; fail(err) shows an error. */
function cwStatus() {
  let pending = 0;
  function busy(delta) {
    pending += delta;
    document.body.dataset.pending = String(pending);
    document.getElementById("cw-status").textContent = pending > 0 ? "decoding…" : "";
  }
  function fail(err) {
    const box = document.createElement("div");
    box.className = "warning error";
    box.textContent = "Error: " + (err && err.message ? err.message : err);
    document.getElementById("cw-warnings").appendChild(box);
    console.error(err);
  }
  /* await during(task): runs the async task() busy, an error it throws shown by fail. */
  async function during(task) {
    busy(1);
    try {
      await task();
    } catch (err) {
      fail(err);
    } finally {
      busy(-1);
    }
  }
  return { busy, fail, during };
}

/* Text safe inside HTML markup and attribute values. */
function cwEsc(s) {
  return s.replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}

/* Fills a <select> with the options [value, label] of items and selects value. */
function cwFillSelect(el, items, value) {
  el.innerHTML = items.map(([v, label]) => '<option value="' + cwEsc(String(v)) + '">' + cwEsc(label) + "</option>").join("");
  el.value = String(value);
}

function cwStore(META) {
  "use strict";
  const T = META.num_tokens;
  const K = META.num_heads + 1;
  const N = (T * (T + 1)) / 2;
  // storage is key-major: key j's queries i = j..T-1 start at COL[j] within a block
  const COL = new Float64Array(T);
  for (let j = 0; j < T; j++) COL[j] = j * T - (j * (j - 1)) / 2;
  // inflated chunks kept in memory: about 300 MB at most, between 6 and 64 chunks
  const CHUNK_BYTES = K * N * (META.precision === "float16" ? 2 : 1) + 4 * K * T;
  const CACHE_MAX = Math.max(6, Math.min(64, Math.floor(3e8 / CHUNK_BYTES)));

  // ---- decoding ---------------------------------------------------------------------
  let F16 = null;
  function float16Table() {
    const table = new Float32Array(65536);
    for (let h = 0; h < 65536; h++) {
      const s = h & 0x8000 ? -1 : 1;
      const e = (h >> 10) & 0x1f;
      const f = h & 0x3ff;
      if (e === 0) table[h] = s * f * Math.pow(2, -24);
      else if (e === 31) table[h] = f ? NaN : s * Infinity;
      else table[h] = s * (1 + f / 1024) * Math.pow(2, e - 15);
    }
    return table;
  }

  function makeChunk(buf, signed) {
    if (META.precision === "float16") {
      F16 = F16 || float16Table();
      const h = new Uint16Array(buf, 0, K * N);
      return { get: (b, i, j) => F16[h[b * N + COL[j] + i - j]] };
    }
    const scales = new Float32Array(buf, 0, K * T);
    const codes = signed ? new Int8Array(buf, 4 * K * T, K * N) : new Uint8Array(buf, 4 * K * T, K * N);
    return { get: (b, i, j) => codes[b * N + COL[j] + i - j] * scales[b * T + i] };
  }

  const cache = new Map(); // "measure/layer" -> Promise<chunk>
  function chunk(measure, layer) {
    const key = measure + "/" + layer;
    if (cache.has(key)) {
      const hit = cache.get(key);
      cache.delete(key);
      cache.set(key, hit);
      return hit;
    }
    const id = META.chunks[key];
    if (!id) return Promise.reject(new Error("no data for " + key));
    const el = document.getElementById(id);
    const promise = cwInflate(cwBase64Bytes(el.textContent)).then((buf) => makeChunk(buf, META.measures[measure].signed));
    cache.set(key, promise);
    while (cache.size > CACHE_MAX) cache.delete(cache.keys().next().value);
    return promise;
  }

  return { chunk };
}
