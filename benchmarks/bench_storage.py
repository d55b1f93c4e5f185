"""Benchmark: how a trace's maps are stored on disk (why packed safetensors shards).

Traces one layer of SmolLM2 at T tokens (real FineWeb-Edu text when the data folder is
there, else the packaged example text repeated), keeps the attention α and the factor p
that the default measures need, and writes them three ways:

* ``packed safetensors`` (the library's format): the lower triangle of each head, row
  after row, in one uncompressed safetensors shard, read through a memory map;
* ``dense safetensors``: the full ``(H, T, T)`` maps (the first file format);
* ``zarr v3 + zstd``: chunked ``(1 head, 256 queries, T)`` and compressed with zstd
  (needs ``pip install zarr``; skipped without it).

For each: size on disk, write time, and read times of one head's whole map and of a
block of 64 query rows of one head, each the median of 5 reads after one warm-up
(the page cache is warm, as when a report or notebook reads a trace it just wrote).

    python benchmarks/bench_storage.py --tokens 2048 --storage float16
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from _timing import data_dir, median_seconds  # benchmarks/_timing.py, beside this script


def _ids(model: Any, length: int) -> Any:
    import torch

    jsonl = data_dir() / "fineweb_edu" / "fineweb_edu_sample10BT_150docs.jsonl"
    if jsonl.exists():
        texts = [json.loads(line)["text"] for line in jsonl.read_text().splitlines()]
    else:
        from importlib.resources import files

        texts = [files("contribution_weights").joinpath("examples/example.txt").read_text()] * 400
    return torch.tensor(model.tokenizer("\n\n".join(texts))["input_ids"][:length])


def _size(path: Path) -> int:
    return (
        sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        if path.is_dir()
        else path.stat().st_size
    )


def storage_errors(model: Any, ids: Any) -> list[str]:
    """Table rows: the error float16 and bfloat16 storage adds to each default measure."""

    import contribution_weights as cw

    exact = cw.trace(model, ids)
    rows = []
    for dtype in ("float16", "bfloat16"):
        half = cw.trace(model, ids, storage_dtype=dtype)
        for name in exact.measures:
            a, b = exact[name].tensor(), half[name].tensor()
            err = (b - a).abs()
            big = a.abs() >= 1e-3
            rel = float((err[big] / a.abs()[big]).max()) if bool(big.any()) else 0.0
            stats = f"{float(err.max()):.2e} | {float(err.mean()):.2e} | {rel:.2e}"
            rows.append(f"| {name} | {dtype} | {stats} |")
        del half
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layer", type=int, default=5)
    parser.add_argument("--storage", default="float16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--error-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args(argv)
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    import contribution_weights as cw

    torch.set_num_threads(1)
    model = cw.load_model()
    ids = _ids(model, args.tokens)
    t = ids.numel()
    dtype = getattr(torch, args.storage)
    work = Path(tempfile.mkdtemp(prefix="cw-bench-storage-"))
    rows = slice(t // 2, min(t, t // 2 + 64))
    results = []

    # packed safetensors: what the trace writes as the forward runs, block by block (the
    # trace's own block size); timed here on an in-memory trace's maps, without the forward
    from contribution_weights.tracing.storage import PackedMaps

    measures = ["attention", "contribution"]
    trace = cw.trace(model, ids, measures=measures, layers=[args.layer], storage_dtype=dtype)
    trace.save(work / "packed")  # a whole trace folder, to read back below
    names = trace.maps.names  # type: ignore[union-attr]
    blocks = {n: list(trace.iter_blocks(n, 0)) for n in names}
    store = PackedMaps(work / "rewrite", names, [args.layer], trace.num_heads, t, dtype)
    start = time.perf_counter()
    store.start_layer(0, causal=True)
    for n in names:
        for q0, block in blocks[n]:
            store.write(n, 0, slice(q0, q0 + block.shape[1]), block)
    store.close()
    write = time.perf_counter() - start
    lazy = cw.Trace.load(work / "packed")
    maps: Any = lazy.maps
    stored, head = maps.names, slice(0, 1)
    results.append(
        {
            "format": "packed safetensors (this library)",
            "bytes": _size(work / "packed" / "maps"),
            "write_s": write,
            "read_head_s": median_seconds(lambda: maps.read(stored[0], 0, head, slice(0, t))),
            "read_rows_s": median_seconds(lambda: maps.read(stored[0], 0, head, rows)),
        }
    )

    dense = {name: trace[name][0].to(dtype).contiguous() for name in stored}
    start = time.perf_counter()
    save_file(dense, str(work / "dense.safetensors"))
    write = time.perf_counter() - start

    def read_dense(r: slice) -> Any:
        with safe_open(str(work / "dense.safetensors"), "pt") as f:
            return f.get_slice(stored[0])[0:1, r]

    results.append(
        {
            "format": "dense safetensors",
            "bytes": _size(work / "dense.safetensors"),
            "write_s": write,
            "read_head_s": median_seconds(lambda: read_dense(slice(0, t))),
            "read_rows_s": median_seconds(lambda: read_dense(rows)),
        }
    )

    try:
        import numpy as np
        import zarr
    except ImportError:
        print("zarr is not installed: pip install zarr to compare with it")
    else:
        group = zarr.open_group(str(work / "maps.zarr"), mode="w")
        np_dtype = np.float16 if dtype == torch.float16 else np.float32
        start = time.perf_counter()
        arrays = {}
        for name, x in dense.items():
            arr = group.create_array(name, shape=x.shape, chunks=(1, 256, t), dtype=np_dtype)
            arr[:] = x.float().numpy().astype(np_dtype)
            arrays[name] = arr
        write = time.perf_counter() - start
        results.append(
            {
                "format": "zarr v3 + zstd, chunks (1, 256, T)",
                "bytes": _size(work / "maps.zarr"),
                "write_s": write,
                "read_head_s": median_seconds(lambda: arrays[stored[0]][0:1, :]),
                "read_rows_s": median_seconds(lambda: arrays[stored[0]][0:1, rows]),
            }
        )

    shutil.rmtree(work, ignore_errors=True)
    errors = storage_errors(model, ids[: args.error_tokens])
    lines = [
        f"SmolLM2-135M, layer {args.layer}, T = {t}, maps {', '.join(stored)} in {args.storage} "
        f"({model.num_heads} heads each); one torch thread",
        "",
        "| format | MB on disk | write s | MB/s written | read a head s | read 64 rows ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        mb = r["bytes"] / 2**20
        speed = f"{mb / r['write_s']:.0f}" if r["write_s"] > 0 else ""
        lines.append(
            f"| {r['format']} | {mb:.1f} | {r['write_s']:.2f} | {speed} | "
            f"{r['read_head_s']:.3f} | {r['read_rows_s'] * 1e3:.1f} |"
        )
    lines += [
        "",
        f"Error of half-precision storage against float32 (all layers, T = "
        f"{min(t, args.error_tokens)}; compute is float32 either way):",
        "",
        "| measure | storage | max abs error | mean abs error | max rel error where abs >= 1e-3 |",
        "| --- | --- | ---: | ---: | ---: |",
        *errors,
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_storage.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
