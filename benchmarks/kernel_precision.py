"""The error budget of the tiled kernels' product precisions against a float64 reference.

``python benchmarks/kernel_precision.py [--model smollm2] [--tokens 128] [--layers 0,14,29]``

One text (the package's example, repeated to ``--tokens`` tokens: several tiles) is
traced without maps three ways by ``kernels="triton"``, one per ``kernel_precision``
(``ieee``, ``tf32``, ``bf16``), and once by the plain path in float64 (``kernels="torch"``,
``compute_dtype="float64"``), the reference. For every measure and reduction it reports
the largest absolute error over layers, heads and tokens, and that error relative to the
largest magnitude of the reduction (so token sums, which grow with the length, and
entropies compare alike). Top values are compared by magnitude, the order they are ranked
in (a signed measure's near ties of opposite sign may swap places).

On a CPU the kernels run in Triton's interpreter, which multiplies float32 numbers: the
tf32 and bf16 rows are then the rounding of the operands alone (the kernels round them as
the tensor cores read them: TF32 to 10 mantissa bits, bfloat16 to 7, both to nearest),
with float32 sums, which is what the tensor cores compute up to the order of the
additions. A GPU run (the device's own tensor cores) is ``--device cuda``.

``--dtype bfloat16`` loads the model in bfloat16, as 8B models run: its queries, keys and
values are then bfloat16 numbers already, and ``bf16`` products round only the vectors
derived from the layer output (``W_Oᵀ o_i / ‖o_i‖²`` and the like). The reference is the
same bfloat16 model traced in float64.

Writes ``kernel-precision-{model}-{dtype}.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from contribution_weights.defaults import KERNEL_PRECISIONS as PRECISIONS  # light: no torch

FIELDS = ("token_sums", "row_sum", "first", "entropy", "entropy_excl_first", "top_values")


def errors(reference, other) -> dict[str, dict[str, float]]:
    """measure -> field -> (max abs error, max abs error / max |reference|)."""
    out: dict[str, dict[str, float]] = {}
    for name, r in reference.reductions.items():
        c = other.reductions[name]
        for field in FIELDS:
            x, y = getattr(c, field), getattr(r, field)
            if x is None or y is None:
                continue
            x, y = x.double(), y.double()
            if field == "top_values":  # ranked by magnitude: near ties of ± weights may swap
                x, y = x.abs(), y.abs()
            err = float((x - y).abs().max())
            scale = float(y.abs().max()) or 1.0
            out.setdefault(name, {})[field] = err
            out[name][f"{field}_rel"] = err / scale
    return out


def table(result: dict) -> str:
    lines = [
        f"Error of each product precision against float64: {result['model']}, "
        f"in {result['model_dtype']}, {result['tokens']} tokens, layers {result['layers']}, "
        f"{result['device']} "
        f"({result['where']}). Largest absolute error over layers, heads and tokens; in "
        "brackets, relative to the reduction's largest magnitude.",
        "",
        "| measure | reduction | " + " | ".join(PRECISIONS) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in PRECISIONS) + " |",
    ]
    first = result["errors"][PRECISIONS[0]]
    for name in first:
        for field in FIELDS:
            if field not in first[name]:
                continue
            cells = [
                f"{e[name][field]:.1e} ({e[name][field + '_rel']:.0e})"
                for e in (result["errors"][p] for p in PRECISIONS)
            ]
            lines.append(f"| {name} | {field} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--layers", default="0,14,29")
    p.add_argument("--measures", default="all,ihc,projection")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="the model's weights: float32, bfloat16")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

    import torch

    import contribution_weights as cw
    from contribution_weights.measures.registry import resolve_measures

    text = (Path(cw.__file__).parent / "examples" / "example.txt").read_text()
    model = cw.load_model(args.model, device=args.device, dtype=args.dtype)
    once = model.tokenizer(text, return_tensors="pt").input_ids[0]
    ids = once.repeat(-(-args.tokens // once.numel()))[: args.tokens]
    layers = [int(x) for x in args.layers.split(",")]
    measures = [m for m in resolve_measures(args.measures) if m != "distance"]
    common = dict(maps=False, layers=layers, measures=measures, progress=False)
    reference = cw.trace(model, ids, kernels="torch", compute_dtype="float64", **common)
    result: dict = {
        "model": model.name,
        "tokens": int(ids.numel()),
        "layers": layers,
        "measures": measures,
        "model_dtype": args.dtype,
        "device": args.device,
        "where": "Triton's interpreter" if args.device == "cpu" else torch.cuda.get_device_name(),
        "errors": {},
        "seconds": {},
    }
    for precision in PRECISIONS:
        start = time.perf_counter()
        got = cw.trace(model, ids, kernels="triton", kernel_precision=precision, **common)
        result["seconds"][precision] = round(time.perf_counter() - start, 2)
        result["errors"][precision] = errors(reference, got)
        print(precision, result["seconds"][precision], "s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"kernel-precision-{args.model}-{args.dtype}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
