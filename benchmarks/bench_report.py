"""Benchmark: the HTML report's size and speed, the full view and the long view.

``OMP_NUM_THREADS=1 python benchmarks/bench_report.py [--full 512] [--long 2048,8192]
--out DIR`` (``$CW_DATA_DIR`` names the data folder)

On SmolLM2-135M and FineWeb-Edu documents:

* **full view** (``--full T``): the first document with at least T tokens, cut to T, traced
  in this process with the report's default measures. Timed: ``write_report`` of the
  trace in memory as ``uint8`` (the default), as ``float16`` and under
  ``max_bytes=32 MiB`` (the layers it keeps), and the notebook view's size. In headless
  Chromium (when ``chromium`` and ``chromedriver`` are installed: ``.ci/install-browser.sh``):
  the page opened from disk until interactive, then, with token 25 T / 32 pinned, a switch of
  layer, measure and head, each timed inside the page from the ``change`` event until the
  page has re-rendered, and the JavaScript heap at the end.
* **long view** (``--long T,...``): documents joined and cut at T tokens, traced by
  ``cw trace --measures attention,contribution --storage-dtype float16`` into a folder,
  then ``cw report --trace`` of it, timed with its peak resident memory
  (``/usr/bin/time -v``); in the browser the page's opening and a switch of layer,
  colouring and head, as above.

Every process runs one torch thread. Results go to ``DIR/results.json`` and their tables
to ``DIR/results.md`` (``--table DIR/results.json`` writes the tables again).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _timing import data_dir  # benchmarks/_timing.py, beside this script

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20
#: set a <select> and wait until the page has drawn the new state (milliseconds)
TIMED_CHANGE = (
    "const [id, value] = arguments; const before = document.body.dataset.rendered;"
    "const t0 = performance.now(); const s = document.getElementById(id);"
    "s.value = value; s.dispatchEvent(new Event('change'));"
    "return new Promise(r => { const f = () => (document.body.dataset.rendered !== before"
    " && document.body.dataset.pending === '0') ? r(performance.now() - t0) : setTimeout(f, 2);"
    " f(); });"
)
SETTLED = "document.body.dataset.ready === '1' && document.body.dataset.pending === '0'"


def browser() -> Any:
    """A headless Chromium (tests/webdriver_client.py), or None where there is none."""
    sys.path.insert(0, str(REPO / "tests"))
    from webdriver_client import Browser, find_browser

    found = find_browser()
    return None if found is None else Browser(*found)


def page_timings(b: Any, path: Path, changes: list[tuple[str, str, str]], pin: int) -> dict:
    """Seconds to open ``path`` until interactive, then each change's milliseconds."""
    start = time.perf_counter()
    b.open(path)
    b.wait(SETTLED, timeout=120)
    out: dict[str, float] = {"open_seconds": round(time.perf_counter() - start, 2)}
    b.click(f'.tok[data-i="{pin}"]')
    b.wait(SETTLED, timeout=60)
    for name, element, value in changes:
        out[f"{name}_ms"] = round(b.js(TIMED_CHANGE, element, value))
    out["js_heap_mb"] = round(b.js("return performance.memory.usedJSHeapSize;") / 1e6, 1)
    return out


def full_view(tokens: int, b: Any) -> dict[str, Any]:
    import contribution_weights as cw
    from contribution_weights.presentation.report import (
        notebook_html,
        traced_measures,
        write_report,
    )

    model = cw.load_model()
    text = next(
        t
        for t in cw.data.load_texts("fineweb-edu", 400)
        if len(model.tokenizer(t)["input_ids"]) >= tokens
    )
    measures = traced_measures()  # what cw report traces a text with
    trace = cw.trace(
        model, text, measures=measures, max_tokens=tokens, truncate=True, progress=False
    )
    out: dict[str, Any] = {"tokens": tokens, "measures": measures}
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in (
            ("uint8", {}),
            ("float16", {"precision": "float16"}),
            ("max_bytes_32MiB", {"max_bytes": 32 * MiB}),
        ):
            start = time.perf_counter()
            info = write_report(trace, Path(tmp) / f"{name}.html", progress=False, **options)
            out[name] = {
                "seconds": round(time.perf_counter() - start, 1),
                "mib": round(info.size_bytes / MiB, 2),
                "layers": list(info.layers),
            }
        out["notebook_mib"] = round(len(notebook_html(trace).encode()) / MiB, 2)
        if b is not None:
            last, middle = trace.layers[-1], trace.layers[len(trace.layers) // 2]
            changes = [("layer", "cw-layer", str(middle)), ("measure", "cw-measure", "attention")]
            changes.append(("head", "cw-head", "2"))
            out["page"] = page_timings(b, Path(tmp) / "uint8.html", changes, tokens * 25 // 32)
            out["page"]["layer_from"] = last
    out["layers_traced"] = len(trace.layers)
    return out


def joined_text(tokens: int) -> str:
    import contribution_weights as cw

    model = cw.load_model()
    parts, count = [], 0
    for text in cw.data.load_texts("fineweb-edu", 400):
        parts.append(text)
        count += len(model.tokenizer(text)["input_ids"])
        if count > tokens + 16:
            return "\n\n".join(parts)
    raise SystemExit(f"the FineWeb-Edu sample holds fewer than {tokens} tokens")


def long_view(tokens: int, b: Any) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cw_cmd = [sys.executable, "-m", "contribution_weights"]
    out: dict[str, Any] = {"tokens": tokens}
    with tempfile.TemporaryDirectory() as tmp:
        text, folder, page = Path(tmp) / "text.txt", Path(tmp) / "trace", Path(tmp) / "r.html"
        text.write_text(joined_text(tokens))
        start = time.perf_counter()
        subprocess.run(
            [*cw_cmd, "trace", "--file", str(text), "--max-tokens", str(tokens), "--truncate",
             "--measures", "attention,contribution", "--storage-dtype", "float16",
             "--out", str(folder)],
            check=True, env=env, capture_output=True,
        )  # fmt: skip
        out["trace_seconds"] = round(time.perf_counter() - start, 1)
        start = time.perf_counter()
        done = subprocess.run(
            ["/usr/bin/time", "-v", *cw_cmd, "report", "--trace", str(folder), "--out", str(page)],
            check=True, env=env, capture_output=True, text=True,
        )  # fmt: skip
        out["report_seconds"] = round(time.perf_counter() - start, 1)
        rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
        out["report_peak_gb"] = round(int(rss.group(1)) / 1e6, 2) if rss else None
        out["mib"] = round(page.stat().st_size / MiB, 2)
        if b is not None:
            changes = [("layer", "cw-layer", "12"), ("colouring", "cw-heat", "first")]
            changes.append(("head", "cw-head", "2"))
            out["page"] = page_timings(b, page, changes, max(tokens - 92, 0))
    return out


def _page_row(rows: list[dict[str, Any]], key: str, unit: str) -> list[str]:
    return [
        f"{r['page'][key]:g} {unit}" if "page" in r else "not measured (no browser)" for r in rows
    ]


def markdown(report: dict[str, Any]) -> str:
    """The two tables of a ``results.json``: the full view, then the long view."""
    from contribution_weights.fields import int_ranges

    lines = [f"{report['model']}, {report['machine']}, {report['threads']}", ""]
    if report.get("full"):
        full = report["full"]
        measures = ", ".join(full["measures"])
        lines += [
            f"Full view, {full['tokens']:,} tokens, {full['layers_traced']} layers, {measures}:",
            "",
            "| what | measured |",
            "| --- | --- |",
        ]
        layers = full["layers_traced"]
        for name, label in (
            ("uint8", "`uint8` (default), 100 MiB limit"),
            ("float16", "`--precision float16`, 100 MiB limit"),
            ("max_bytes_32MiB", "`uint8`, `--max-bytes 32MiB`"),
        ):
            kept = full[name]["layers"]
            which = "all" if len(kept) == layers else f"{len(kept)} ({int_ranges(kept)})"
            lines.append(
                f"| file, {label} | {full[name]['mib']:.1f} MiB, {which} of {layers} layers, "
                f"written in {full[name]['seconds']:g} s |"
            )
        lines.append(f"| notebook view (8 MiB limit) | {full['notebook_mib']:.1f} MiB |")
        if "page" in full:
            page = full["page"]
            lines += [
                f"| page: open from disk until interactive | {page['open_seconds']:g} s |",
                f"| switch layer / measure / head | {page['layer_ms']} / {page['measure_ms']} / "
                f"{page['head_ms']} ms |",
                f"| JavaScript heap | {page['js_heap_mb']:g} MB |",
            ]
        lines.append("")
    rows = report.get("long", [])
    if rows:
        lines += ["Long view, attention and contribution, traced to disk in float16:", ""]
        lines.append("| | " + " | ".join(f"{r['tokens']:,} tokens" for r in rows) + " |")
        lines.append("| --- |" + " ---: |" * len(rows))
        table = [
            ("`cw trace` (maps streamed to disk)", [f"{r['trace_seconds']:g} s" for r in rows]),
            ("`cw report` wall time", [f"{r['report_seconds']:g} s" for r in rows]),
            ("`cw report` peak resident memory", [f"{r['report_peak_gb']:g} GB" for r in rows]),
            ("file, every layer", [f"{r['mib']:.2f} MiB" for r in rows]),
            ("page open until interactive", _page_row(rows, "open_seconds", "s")),
            ("switch layer", _page_row(rows, "layer_ms", "ms")),
            ("switch colouring", _page_row(rows, "colouring_ms", "ms")),
            ("switch head", _page_row(rows, "head_ms", "ms")),
        ]
        lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in table]
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", type=int, default=512, help="tokens of the full view (0: none)")
    p.add_argument("--long", default="2048", help="lengths of the long view, e.g. 2048,8192")
    p.add_argument("--out", type=Path, default=None, help="write results.json and results.md here")
    p.add_argument("--table", type=Path, default=None, metavar="RESULTS.json",
                   help="write the results.md of this results.json beside it and stop")  # fmt: skip
    args = p.parse_args()
    if args.table is not None:
        args.table.with_suffix(".md").write_text(markdown(json.loads(args.table.read_text())))
        return 0
    data_dir()  # $CW_DATA_DIR, checked
    import torch

    torch.set_num_threads(1)
    b = browser()
    report: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "threads": "one torch thread per process",
        "browser": "headless Chromium" if b is not None else None,
    }
    try:
        if args.full:
            report["full"] = full_view(args.full, b)
            print(json.dumps(report["full"]), flush=True)
        report["long"] = []
        for tokens in (int(t) for t in args.long.split(",") if t):
            report["long"].append(long_view(tokens, b))
            print(json.dumps(report["long"][-1]), flush=True)
    finally:
        if b is not None:
            b.close()
    print(markdown(report))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=2))
        (args.out / "results.md").write_text(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
