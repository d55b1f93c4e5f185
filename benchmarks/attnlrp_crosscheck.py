"""Cross-check of end-to-end attribution against AttnLRP (lxt 2.1, Achtibat et al. 2024).

lxt 2.1 needs transformers 4.x (``import lxt.efficient`` imports its BERT module, which
imports ``transformers.modeling_attn_mask_utils``, gone in 5.x; and its attention patch
replaces ``ALL_ATTENTION_FUNCTIONS`` with a plain dict, while 5.x's LlamaAttention calls
``ALL_ATTENTION_FUNCTIONS.get_interface``), this package needs 5.24, so the check runs in
two environments and meets in files::

    # 1. items (the project's .venv): known-answer items of cw attribution-eval (seed 0:
    #    its first n items per task), as ids
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/attnlrp_crosscheck.py items \\
        --n 24 --tokens 64 --out xl-items.json
    # 2. AttnLRP (its own venv, see benchmarks/attnlrp-requirements.txt): per-item input
    #    relevances on the same weights
    OMP_NUM_THREADS=1 .venv-lxt/bin/python benchmarks/attnlrp_crosscheck.py lxt \\
        --items xl-items.json --out xl-lxt.json
    # 3. ours (the project's .venv): flow, input x gradient and integrated gradients on the
    #    same items, hits on the known source and Spearman correlations with AttnLRP
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/attnlrp_crosscheck.py report \\
        --items xl-items.json --lxt xl-lxt.json \\
        --report docs/results/attnlrp-crosscheck-smollm2.json

docs/results/attnlrp-crosscheck-smollm2.json is that run (n = 24 per task, 72 items): about
15 minutes on one thread, 13 of them integrated gradients' 50 steps in step 3 (~10 s an
item; AttnLRP ~0.5 s an item, flow ~0.2 s).

Step 3 also runs our own AttnLRP (``attnlrp`` of ``cw attribute``, module
``contribution_weights.attribution.attnlrp``; ``attnlrp_cw`` and ``attnlrp_cw_logit`` in
the report, lxt's keep the names ``attnlrp`` and ``attnlrp_logit``) and compares it with
lxt's per item, like with like (log-probability with log-probability, logit with logit):
max |ours − lxt| / max |lxt|, the sums' relative difference and Spearman correlations
(``attnlrp_cw_vs_lxt``; worst items in ``checks``). ``--float64-check`` reruns ours in
float64, so the report says how far float32 rounding alone moves the scores.
docs/results/attnlrp-ours-vs-lxt-smollm2.json is that check (n = 8 per task, 24 items,
a few minutes)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/attnlrp_crosscheck.py items \\
        --n 8 --tokens 64 --out xl-items.json
    OMP_NUM_THREADS=1 .venv-lxt/bin/python benchmarks/attnlrp_crosscheck.py lxt \\
        --items xl-items.json --out xl-lxt.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/attnlrp_crosscheck.py report \\
        --items xl-items.json --lxt xl-lxt.json --no-ig --float64-check \\
        --report docs/results/attnlrp-ours-vs-lxt-smollm2.json

Setting up the lxt environment (not part of ``make test``)::

    python3 -m venv .venv-lxt
    .venv-lxt/bin/pip install torch==2.13.0    # CPU wheel, first
    .venv-lxt/bin/pip install --no-deps -r benchmarks/attnlrp-requirements.txt

``--no-deps``: the file is the whole environment. lxt declares torchvision, open_clip_torch,
bitsandbytes and zennit, which its LLaMA rules never use; torchvision's PyPI wheel for torch
2.13 is built against CUDA torch and fails to import with the CPU build (``operator
torchvision::nms does not exist``). Without torchvision ``import lxt.efficient`` fails too
(``lxt.efficient.models`` imports its ViT module, which imports torchvision), so this
script loads ``lxt.efficient.rules``, ``lxt.efficient.patches`` and
``lxt.efficient.models.llama`` without running the two package ``__init__`` files, and
applies ``lxt.efficient.core.monkey_patch(modeling_llama, patch_map=llama.attnLRP)``: the
same patch map that ``monkey_patch(modeling_llama)`` looks up by default.

Model: SmolLM2-135M (the package's embedded model), loaded in the lxt environment with
plain transformers 4.52.4 from the dequantised safetensors folder that ``cw.load_model()``
writes (its path is stored in the items file), float32, eager attention. The folder's
config was written by transformers 5 (``rope_parameters``), which 4.52 does not read, so
``rope_theta`` is passed explicitly; step 2 also computes plain (unpatched) input x gradient
and step 3 compares it and the answer's log-probability with ours, which checks that both
environments run the same model.

What AttnLRP explains: lxt's efficient AttnLRP is gradient x input with the gradient
rewritten by its rules (RMSNorm: identity rule, the variance held fixed; SiLU gate:
identity rule; gate x up and the attention products: uniform rule, gradients divided by 2
and 4); the relevance of token k is ``sum_d e_kd * g_kd`` on the input embeddings e. Its
native output is the target **logit** z_t (``attnlrp_logit``). For the log-probability the
backward pass starts at ``log_softmax(z)_t``: the softmax's own gradient (1 - P_t at t,
-P_v elsewhere) then weights every logit's relevance, so the scores are AttnLRP of
``z_t - sum_v P_v z_v`` with P held fixed, the linear part of log P_t that flow explains
too (method §7.3) (``attnlrp``, the reference for the correlations).

Report: per method, top-1 / top-5 hits of the known source, ranked among positions
1..p-1 (token 0 and the target position p excluded; ties broken as attribution-eval
does), and per item the Spearman correlation of each method's scores with AttnLRP's over
the same positions 1..p-1; mean and standard error over items, per task and pooled.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

TASKS = ("induction", "lookup", "passkey")
OURS = ("flow", "input_x_gradient", "integrated_gradients", "attnlrp")


# --- step 1: items (project venv) -------------------------------------------------------
def items(args: argparse.Namespace) -> None:
    import contribution_weights as cw
    from contribution_weights.attribution.tasks import make_item

    model = cw.load_model()
    record: dict[str, Any] = {
        "model": model.name,
        "model_dir": str(model.model.name_or_path),
        "tokens": args.tokens,
        "seed": args.seed,
        "n": args.n,
        "items": [],
    }
    for task in args.tasks:
        for i in range(args.n):
            item = make_item(task, model.tokenizer, i, args.seed, args.tokens)
            record["items"].append(
                {"task": task, "index": i, "ids": item.ids, "answer": item.answer,
                 "sources": item.sources}
            )  # fmt: skip
    Path(args.out).write_text(json.dumps(record))
    print(f"wrote {len(record['items'])} items to {args.out} (model folder {record['model_dir']})")


# --- step 2: AttnLRP (lxt venv) ---------------------------------------------------------
def _lxt_llama() -> tuple[Any, str]:
    """lxt's LLaMA patch map and ``monkey_patch``, without ``lxt.efficient.__init__``.

    Returns (monkey_patch with the LLaMA map bound, the error of ``import lxt.efficient``
    or "" where it imports)."""
    import importlib
    import importlib.util
    import types

    try:
        importlib.import_module("lxt.efficient")
        error = ""
    except Exception as e:  # reported, then worked around
        error = f"{type(e).__name__}: {e}"
        for name in [m for m in sys.modules if m.startswith("lxt.efficient")]:
            del sys.modules[name]
        spec = importlib.util.find_spec("lxt")
        assert spec is not None and spec.origin is not None
        root = Path(spec.origin).parent / "efficient"
        for name, path in (("lxt.efficient", root), ("lxt.efficient.models", root / "models")):
            stub = types.ModuleType(name)
            stub.__path__ = [str(path)]  # a package whose __init__ is not run
            sys.modules[name] = stub

        def no_default_map(module: Any) -> Any:
            raise ValueError("pass patch_map")

        sys.modules["lxt.efficient.models"].get_default_map = no_default_map  # type: ignore[attr-defined]
    from transformers.models.llama import modeling_llama

    core = importlib.import_module("lxt.efficient.core")
    llama = importlib.import_module("lxt.efficient.models.llama")

    def patch() -> None:
        core.monkey_patch(modeling_llama, patch_map=llama.attnLRP, verbose=True)

    return patch, error


def _relevances(model: Any, ids: list[int], answer: int) -> dict[str, Any]:
    """Gradient x input on the input embeddings (summed over the hidden dimension) of the
    answer's logit and of its log-probability at the last position, with whatever
    backward rules are patched in."""
    import torch

    x = torch.tensor(ids)[None]
    emb = model.get_input_embeddings()(x).detach().requires_grad_(True)
    logits = model(inputs_embeds=emb, use_cache=False).logits[0, -1].float()
    logp = torch.log_softmax(logits, -1)
    out: dict[str, Any] = {
        "logit": float(logits[answer].detach()),
        "logprob": float(logp[answer].detach()),
        # the linear part of log P that the log-probability's relevances are conservative for
        "logprob_linear": float((logits[answer] - (logp.exp() * logits).sum()).detach()),
        "answer_is_top": bool(int(logits.argmax()) == answer),
    }
    for name, value in (("logit", logits[answer]), ("logprob", logp[answer])):
        (grad,) = torch.autograd.grad(value, emb, retain_graph=True)
        out[f"rel_{name}"] = (emb.detach() * grad).sum(-1)[0].double().tolist()
    return out


def _load_model(folder: Path, extra: dict[str, Any]) -> Any:
    """The folder's model in float32 with eager attention, built from its config and loaded
    from its safetensors by hand: transformers 5 saved the tied embedding under
    ``lm_head.weight`` only, and 4.52's ``from_pretrained`` then leaves the (tied) embedding
    on the meta device."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, attn_implementation="eager", **extra)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    state: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f))
    if config.tie_word_embeddings:
        tied = state.get("model.embed_tokens.weight", state.get("lm_head.weight"))
        state["model.embed_tokens.weight"] = state["lm_head.weight"] = tied
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    bad = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
           if t.device.type != "cpu"]  # fmt: skip
    if bad:
        raise SystemExit(f"tensors not loaded: {bad}")
    return model.float().eval()


def lxt_side(args: argparse.Namespace) -> None:
    import torch
    import transformers

    torch.set_num_threads(1)
    record = json.loads(Path(args.items).read_text())
    folder = Path(record["model_dir"])
    config = json.loads((folder / "config.json").read_text())
    extra: dict[str, Any] = {}
    if "rope_theta" not in config and "rope_parameters" in config:  # written by transformers 5
        rope = config["rope_parameters"]
        if rope.get("rope_type", "default") != "default":
            raise SystemExit(f"rope {rope} is not the default rope; pass it by hand")
        extra["rope_theta"] = float(rope["rope_theta"])
    model = _load_model(folder, extra)
    for p in model.parameters():
        p.requires_grad_(False)
    rows = record["items"]
    if args.n:  # the first n of every task
        rows = [r for r in record["items"] if r["index"] < args.n]
    # plain gradient x input first (the patch changes the classes for good)
    start = time.perf_counter()
    plain = [_relevances(model, r["ids"], r["answer"]) for r in rows]
    plain_seconds = (time.perf_counter() - start) / max(1, len(rows))
    patch, import_error = _lxt_llama()
    patch()
    out_items = []
    seconds = []
    for r, p in zip(rows, plain, strict=True):
        start = time.perf_counter()
        rel = _relevances(model, r["ids"], r["answer"])
        seconds.append(time.perf_counter() - start)
        out_items.append(
            {"task": r["task"], "index": r["index"], **rel,
             "plain_logprob": p["logprob"], "plain_rel_logprob": p["rel_logprob"],
             "seconds": seconds[-1]}
        )  # fmt: skip
        if len(out_items) == 1 or len(out_items) % 8 == 0:
            print(f"lxt: item {len(out_items)}/{len(rows)} ({seconds[-1]:.2f} s)", flush=True)
    from importlib.metadata import version

    report = {
        "lxt": version("lxt"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "import_lxt_efficient_error": import_error,
        "rope_theta": float(model.config.rope_theta),
        "attn_implementation": model.config._attn_implementation,
        "model_dir": str(folder),
        "seconds_per_item_attnlrp": sum(seconds) / max(1, len(seconds)),
        "seconds_per_item_plain": plain_seconds,
        "items": out_items,
    }
    Path(args.out).write_text(json.dumps(report))
    print(f"wrote {args.out}: {len(out_items)} items, "
          f"{report['seconds_per_item_attnlrp']:.2f} s per item")  # fmt: skip


# --- step 3: ours and the report (project venv) ----------------------------------------
def _rank(scores: list[float], sources: list[int], position: int) -> int:
    """The source's rank among positions 1..position-1, ties broken as attribution-eval."""
    order = sorted(range(1, position), key=lambda j: (-float(scores[j]), -j))
    return 1 + min(order.index(s) for s in sources)


def _spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr

    rho = spearmanr(a, b).statistic
    return float(rho)


def _mean_se(values: list[float]) -> dict[str, float]:
    xs = [v for v in values if math.isfinite(v)]
    n = len(xs)
    if n == 0:
        return {"mean": math.nan, "se": math.nan, "n": 0}
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else math.nan
    return {"mean": mean, "se": math.sqrt(var / n) if n > 1 else math.nan, "n": n}


def _agreement(mine: list[float], theirs: list[float]) -> dict[str, float]:
    """Ours against lxt on one item: max |diff| relative to lxt's max |score|, the sums'
    relative difference, Spearman over all positions and over 1..p-1."""
    scale = max(abs(y) for y in theirs)
    cand = slice(1, len(theirs) - 1)
    return {
        "max_rel_diff": max(abs(x - y) for x, y in zip(mine, theirs, strict=True)) / scale,
        "rel_diff_of_sums": abs(sum(mine) - sum(theirs)) / max(abs(sum(theirs)), 1e-30),
        "spearman": _spearman(mine, theirs),
        "spearman_candidates": _spearman(mine[cand], theirs[cand]),
    }


def _float64_check(model: Any, record: dict[str, Any], theirs: dict[str, Any],
                   rows: list[dict[str, Any]]) -> None:  # fmt: skip
    """Per row, our AttnLRP in float64 against ours in float32 and against lxt (float32),
    relative to the float64 scores' max |score|: where ours-vs-lxt is no larger than
    float32-vs-float64, the two agree to rounding."""
    import torch

    from contribution_weights.attribution.attnlrp import attnlrp
    from contribution_weights.attribution.targets import Target

    by_key = {(r["task"], r["index"]): r for r in record["items"]}
    lx_by_key = {(r["task"], r["index"]): r for r in theirs["items"]}
    f32 = {}
    for dtype in (torch.float32, torch.float64):
        model.model.to(dtype)
        for row in rows:
            item = by_key[(row["task"], row["index"])]
            ids = torch.tensor(item["ids"])
            for q in ("logprob", "logit"):
                target = Target(len(ids) - 1, item["answer"], q)
                got = attnlrp(model, ids, [target])[0].double()
                if dtype == torch.float32:
                    f32[(row["task"], row["index"], q)] = got
                    continue
                lxt = torch.tensor(lx_by_key[(row["task"], row["index"])][f"rel_{q}"])
                scale = float(got.abs().max())
                row["attnlrp_cw_vs_lxt"][q]["float64"] = {
                    "ours_f32_vs_f64": float((f32[(row["task"], row["index"], q)] - got)
                                             .abs().max()) / scale,
                    "lxt_vs_ours_f64": float((lxt.double() - got).abs().max()) / scale,
                }  # fmt: skip
    model.model.to(torch.float32)


def report(args: argparse.Namespace) -> None:
    import torch

    import contribution_weights as cw

    torch.set_num_threads(1)
    record = json.loads(Path(args.items).read_text())
    theirs = json.loads(Path(args.lxt).read_text())
    model = cw.load_model()
    by_key = {(r["task"], r["index"]): r for r in record["items"]}
    # ours: our own AttnLRP is "attnlrp_cw" here; "attnlrp" is lxt's (the reference)
    ours = [m for m in OURS if not (args.no_ig and m == "integrated_gradients")]
    named = ["attnlrp_cw" if m == "attnlrp" else m for m in ours]
    rankings = [*named, "attnlrp", "attnlrp_logit", "attnlrp_cw_logit"]
    rows: list[dict[str, Any]] = []
    seconds: dict[str, list[float]] = {m: [] for m in named}
    for n_item, lx in enumerate(theirs["items"]):
        item = by_key[(lx["task"], lx["index"])]
        ids, p = item["ids"], len(item["ids"]) - 1
        a = cw.attribute(model, torch.tensor(item["ids"]), token=item["answer"],
                         quantity="logprob", methods=",".join(ours), steps=args.steps,
                         progress=False)  # fmt: skip
        scores = {n: a[m][0].tolist() for m, n in zip(ours, named, strict=True)}
        for m, n in zip(ours, named, strict=True):
            seconds[n].append(a.seconds[m])
        # like with like: our AttnLRP of the logit against lxt's native logit relevances
        b = cw.attribute(model, torch.tensor(item["ids"]), token=item["answer"],
                         quantity="logit", methods="attnlrp", progress=False)  # fmt: skip
        scores["attnlrp_cw_logit"] = b["attnlrp"][0].tolist()
        scores["attnlrp"] = lx["rel_logprob"]
        scores["attnlrp_logit"] = lx["rel_logit"]
        cand = slice(1, p)
        agreement = {
            q: _agreement(scores[mine], scores[theirs_])
            for q, mine, theirs_ in (("logprob", "attnlrp_cw", "attnlrp"),
                                     ("logit", "attnlrp_cw_logit", "attnlrp_logit"))
        }  # fmt: skip
        row: dict[str, Any] = {
            "task": lx["task"],
            "index": lx["index"],
            "tokens": len(ids),
            "sources": item["sources"],
            "logprob_ours": float(a.values[0]),
            "logprob_lxt_env": lx["logprob"],
            "logit_lxt_env": lx["logit"],
            "attnlrp_sum_logit": sum(lx["rel_logit"]),
            "attnlrp_sum_logprob": sum(lx["rel_logprob"]),
            "logprob_linear": lx["logprob_linear"],
            "answer_is_top": lx["answer_is_top"],
            # lxt's patch changes only the backward pass: the forwards agree
            "patched_logprob_diff": abs(lx["logprob"] - lx["plain_logprob"]),
            # plain gradient x input in the lxt env against ours: same model, same numbers
            "ixg_max_abs_diff": max(
                abs(x - y)
                for x, y in zip(lx["plain_rel_logprob"], scores["input_x_gradient"], strict=True)
            ),
            "ixg_max_abs": max(abs(y) for y in scores["input_x_gradient"]),
            # our AttnLRP against lxt's, per item: max |diff| / max |lxt|, Spearman (all
            # positions and 1..p-1)
            "attnlrp_cw_vs_lxt": agreement,
            "rank": {m: _rank(scores[m], item["sources"], p) for m in rankings},
            "spearman_vs_attnlrp": {
                m: _spearman(scores[m][cand], scores["attnlrp"][cand])
                for m in [*named, "attnlrp_logit"]
            },
            "spearman_vs_attnlrp_logit": {
                m: _spearman(scores[m][cand], scores["attnlrp_logit"][cand])
                for m in [*named, "attnlrp_cw_logit"]
            },
            "attnlrp": [round(v, 6) for v in lx["rel_logprob"]],
            "attnlrp_logit": [round(v, 6) for v in lx["rel_logit"]],
        }
        rows.append(row)
        if n_item == 0 or (n_item + 1) % 8 == 0:
            print(f"ours: item {n_item + 1}/{len(theirs['items'])}", flush=True)
    if args.float64_check:  # how much of ours-vs-lxt is float32 rounding: ours in float64
        _float64_check(model, record, theirs, rows)
    summary: dict[str, Any] = {}
    for task in [*TASKS, "all"]:
        sub = [r for r in rows if task in ("all", r["task"])]
        if not sub:
            continue
        summary[task] = {
            "n": len(sub),
            "answer_is_top": sum(r["answer_is_top"] for r in sub) / len(sub),
            "top1": {m: sum(r["rank"][m] == 1 for r in sub) / len(sub) for m in rankings},
            "top5": {m: sum(r["rank"][m] <= 5 for r in sub) / len(sub) for m in rankings},
            "mean_rank": {m: sum(r["rank"][m] for r in sub) / len(sub) for m in rankings},
            "spearman_vs_attnlrp": {
                m: _mean_se([r["spearman_vs_attnlrp"][m] for r in sub])
                for m in [*named, "attnlrp_logit"]
            },
            "spearman_vs_attnlrp_logit": {
                m: _mean_se([r["spearman_vs_attnlrp_logit"][m] for r in sub])
                for m in [*named, "attnlrp_cw_logit"]
            },
        }
    checks = {
        "logprob_max_abs_diff": max(abs(r["logprob_ours"] - r["logprob_lxt_env"]) for r in rows),
        "patched_forward_logprob_max_abs_diff": max(r["patched_logprob_diff"] for r in rows),
        "plain_ixg_max_abs_diff": max(r["ixg_max_abs_diff"] for r in rows),
        "plain_ixg_max_abs": max(r["ixg_max_abs"] for r in rows),
        # our AttnLRP against lxt's: the worst item, and the least Spearman
        "attnlrp_cw_vs_lxt": {
            q: {
                "max_rel_diff": max(r["attnlrp_cw_vs_lxt"][q]["max_rel_diff"] for r in rows),
                "min_spearman": min(r["attnlrp_cw_vs_lxt"][q]["spearman"] for r in rows),
                "min_spearman_candidates": min(
                    r["attnlrp_cw_vs_lxt"][q]["spearman_candidates"] for r in rows
                ),
                "max_rel_diff_of_sums": max(
                    r["attnlrp_cw_vs_lxt"][q]["rel_diff_of_sums"] for r in rows
                ),
                **(
                    {
                        f"max_{k}": max(r["attnlrp_cw_vs_lxt"][q]["float64"][k] for r in rows)
                        for k in ("ours_f32_vs_f64", "lxt_vs_ours_f64")
                    }
                    if args.float64_check
                    else {}
                ),
            }
            for q in ("logprob", "logit")
        },
        # AttnLRP is conservative up to its rules' leaks (eps, the softmax rule): sum / value
        "attnlrp_logit_sum_over_logit": _mean_se(
            [r["attnlrp_sum_logit"] / r["logit_lxt_env"] for r in rows]
        ),
        "attnlrp_logprob_sum_over_linear_part": _mean_se(
            [r["attnlrp_sum_logprob"] / r["logprob_linear"] for r in rows]
        ),
    }
    import transformers

    out = {
        "what": "AttnLRP (lxt 2.1, efficient LLaMA rules) against our own AttnLRP "
        "(attnlrp_cw, contribution_weights.attribution.attnlrp), contribution flow, input x "
        "gradient" + ("" if args.no_ig else " and integrated gradients") + " on the "
        "known-answer items of cw attribution-eval; see benchmarks/attnlrp_crosscheck.py",
        "methods": rankings,
        "model": record["model"],
        "tokens": record["tokens"],
        "seed": record["seed"],
        "n_per_task": max(r["index"] for r in rows) + 1,
        "steps": None if args.no_ig else args.steps,
        "explained": {
            "ours": "log P(answer) at the last position (flow: its linear part, method §7.3)",
            "attnlrp": "backward from log_softmax(logits)[answer]: AttnLRP of z_t - sum_v P_v "
            "z_v with P fixed (the linear part of log P)",
            "attnlrp_logit": "the answer's logit z_t (what AttnLRP natively explains)",
            "attnlrp_cw": "ours, as attnlrp (cw.attribute quantity logprob)",
            "attnlrp_cw_logit": "ours, as attnlrp_logit (cw.attribute quantity logit)",
        },
        "candidates": "positions 1..p-1 (token 0 and the target position p excluded), for "
        "the ranks and for the Spearman correlations",
        "environments": {
            "ours": {"transformers": transformers.__version__, "torch": torch.__version__},
            "lxt": {
                k: theirs[k]
                for k in (
                    "lxt",
                    "transformers",
                    "torch",
                    "python",
                    "attn_implementation",
                    "rope_theta",
                    "import_lxt_efficient_error",
                )
            },
        },
        "seconds_per_item": {
            **{m: sum(v) / len(v) for m, v in seconds.items()},
            "attnlrp": theirs["seconds_per_item_attnlrp"],
        },
        "checks": checks,
        "summary": summary,
        "items": rows,
    }
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(out, indent=1)
    # one line per list of numbers (the per-item score vectors)
    text = re.sub(r"\[\s+(-?[\d.e+-]+(?:,\s+-?[\d.e+-]+)*)\s+\]",
                  lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)  # fmt: skip
    Path(args.report).write_text(text + "\n")
    _print_summary(out)
    print(f"wrote {args.report}")


def _print_summary(out: dict[str, Any]) -> None:
    print(json.dumps(out["checks"], indent=1))
    print("seconds per item:", {k: round(v, 3) for k, v in out["seconds_per_item"].items()})
    head = f"{'task':10} {'method':22} {'n':>3} {'top1':>6} {'top5':>6} {'rank':>6} " \
           f"{'rho(attnlrp)':>16}"  # fmt: skip
    print(head)
    for task, s in out["summary"].items():
        for m in s["top1"]:
            rho = s["spearman_vs_attnlrp"].get(m)
            rho_s = f"{rho['mean']:.3f} ± {rho['se']:.3f}" if rho else "-"
            print(f"{task:10} {m:22} {s['n']:>3} {s['top1'][m]:>6.3f} {s['top5'][m]:>6.3f} "
                  f"{s['mean_rank'][m]:>6.2f} {rho_s:>16}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = p.add_subparsers(dest="side", required=True)
    a = sub.add_parser("items", help="run in the project's environment")
    a.add_argument("--n", type=int, default=16, help="items per task (default 16)")
    a.add_argument("--tokens", type=int, default=64, help="tokens per item (default 64)")
    a.add_argument("--seed", type=int, default=0, help="item seed (default 0, as attribution-eval)")
    a.add_argument("--tasks", type=lambda s: s.split(","), default=list(TASKS))
    a.add_argument("--out", type=Path, required=True)
    b = sub.add_parser("lxt", help="run in the lxt environment")
    b.add_argument("--items", type=Path, required=True)
    b.add_argument("--n", type=int, default=0, help="only the first n items per task (0: all)")
    b.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("report", help="run in the project's environment")
    c.add_argument("--items", type=Path, required=True)
    c.add_argument("--lxt", type=Path, required=True)
    c.add_argument("--steps", type=int, default=50, help="integrated gradients steps (50)")
    c.add_argument(
        "--no-ig",
        action="store_true",
        help="leave integrated gradients out (most of the step's time)",
    )
    c.add_argument("--float64-check", action="store_true",
                   help="also run our AttnLRP in float64: how much of ours-vs-lxt is float32 "
                   "rounding")  # fmt: skip
    c.add_argument("--report", type=Path, required=True)
    args = p.parse_args()
    {"items": items, "lxt": lxt_side, "report": report}[args.side](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
