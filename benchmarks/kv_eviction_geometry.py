"""Why contribution loses: the geometry of eviction (docs/kv-cache.md).

``python benchmarks/kv_eviction_geometry.py [--model smollm2] [--n 32] [--context 512]
[--continuation 64] [--window 64] [--nll-items 8] --out FILE.json [--figure FILE.png]``

On FineWeb-Edu items (``cw kv-eval``'s items, ``$CW_DATA_DIR``), for every compressible
layer, head and prefill key j that a window method ranks (j < C − window: the window's own
keys are always kept):

* **the truth**: the C-token prefill is continued by the next ``--continuation`` tokens on
  the *uncompressed* cache, on the capture path; for each of those future queries i the
  exact change of head h's projected output if key j alone were evicted,
  ``‖Δo_ij^(h)‖ = α_ij ‖o_i^(h) − ṽ_j^(h)‖ / (1 − α_ij)`` (:func:`renormalised_effect`),
  averaged over the future queries. Per KV head, the exact change of the layer's
  attention output when the group's cached key j goes (all its query heads at once),
  ``mean_i ‖Σ_{h∈g} Δo_ij^(h)‖``, from cross-Gram matrices ``W_O^(h)ᵀ W_O^(h')``.
* **the predictors**, from the prefill alone (the methods' own statistics, gathered by
  :class:`~contribution_weights.kv.StatsObserver` in the same capture pass, over the last
  ``--window`` prefill queries): mean α (``window_attention``), α accumulated over every
  prefill query (``h2o``), ``r = ‖ṽ_j‖``, ``κ`` (mean cos(o_i, ṽ_j), o_i the layer output,
  method §2), ``α/(1−α)``, ``α·r`` (the norm of the first-order change −α ṽ_j), Σ|ĉ|
  (``contribution``), Σ α‖o_i^(h) − ṽ_j‖ (the exact direction without the 1/(1−α)
  amplification) and Σ‖Δo‖ (``renormalised``); at the KV-head level also the registered
  methods' own scores (SnapKV, TOVA, H2O, observed attention, VATP, key norm, KeyDiff,
  expected attention, StreamingLLM, random, and the sink-protecting variants); and, as
  oracles, the first-order quantities measured on the future queries themselves.
* **how well each predicts**: per (layer, head) the Spearman rank correlation across the
  ranked keys between predictor and truth; per KV head the overlap of each predictor's
  top-m keys with the true top-m, m = n_kept − window, n_kept = int(C · (1 − ratio)) at
  ratios 0.5 and 0.75 (the share of the keys a method would keep that are truly the most
  important); paired differences between predictors with 95% bootstrap intervals over
  items.
* **why contribution loses**: the share of the true top-1% keys per head that a predictor
  ranks in its bottom half, and where they sit; the amplification of the exact effect over
  the first-order one on the future queries, ``‖Δo‖ / (α ‖ṽ‖) = ‖o − ṽ‖ / ((1 − α) ‖ṽ‖)``,
  split into ``1/(1−α)`` and the direction factor ``‖o − ṽ‖ / ‖ṽ‖``, for token 0 and the rest.
* **does the head-level truth track the NLL** (``--nll-items``): a sample of tokens is
  evicted one at a time from every compressible layer's cache (a true eviction) and the
  NLL of the continuation compared with the truth summed over layers and KV heads.

Each item's results go to ``OUT.partial.jsonl`` as it finishes; a rerun with the same
options continues from there, and the file is removed once ``OUT`` is written. Timing
(one thread, 2-core CPU shared with other runs): SmolLM2 about 11 s an item, 25 s with the
NLL check (n = 32: 8 minutes); Gemma 3 270M about 4 s and 25 s. Run with
``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
from _timing import data_dir  # benchmarks/_timing.py, beside this script

# predictors per query head, from the prefill's observation window (or every query: h2o)
HEAD_PREDICTORS = (
    "window_attention",
    "h2o",
    "value_norm",
    "kappa",
    "alpha_odds",
    "alpha_r",
    "contribution",
    "alpha_distance",
    "renormalised",
)
# the same quantities measured on the future queries (oracles: not available at prefill)
ORACLES = ("future_attention", "future_alpha_r", "future_contribution", "future_alpha_distance")
# registered methods whose scores are compared at the KV-head level (as they rank keys)
METHODS = (
    "window_attention",
    "snapkv",
    "tova",
    "h2o",
    "observed_attention",
    "vatp_wo",
    "knorm",
    "keydiff",
    "expected_attention",
    "streaming_llm",
    "random",
    "contribution",
    "contribution_sinks",
    "renormalised",
    "renormalised_sinks",
)
# KV-head predictors built from the per-head ones (group sums) besides the methods' scores
GROUP_DERIVED = ("value_norm", "kappa", "alpha_odds", "alpha_r", "alpha_distance", *ORACLES)
RATIOS = (0.5, 0.75)
PAIRS = (
    ("renormalised", "contribution"),
    ("window_attention", "contribution"),
    ("renormalised", "window_attention"),
    ("alpha_distance", "contribution"),
    ("alpha_r", "contribution"),
    ("renormalised", "alpha_r"),
    ("h2o", "window_attention"),
    ("future_contribution", "future_attention"),
)
# α bins for the amplification table (future queries)
ALPHA_EDGES = (0.0, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.5, 0.9, 1.0)
N_SINK = 4
# 1 − α below this is not resolved by the float32 probabilities: such entries are counted
# (``saturated``), left out of the amplification table, and 1 − α is floored here
SATURATED = 1e-6
CROSS_GRAMS: dict[int, Any] = {}  # per layer, for the one model a run loads


# ---- capture observers ---------------------------------------------------------------------
class WindowGeometry:
    """Prefill capture observer: per compressible layer, sums over the window's queries of
    the predictors the KV statistics do not hold: κ_ij (layer output, method §2),
    α_ij/(1 − α_ij) and α_ij ‖o_i^(h) − ṽ_j^(h)‖; each ``(B, H, T)``."""

    def __init__(self, layers: set[int], window: int) -> None:
        self.layers, self.window = layers, window
        self.sums: dict[int, dict[str, Any]] = {}

    def observe(self, view: Any) -> None:
        import torch

        from contribution_weights.kv.renormalised import renormalised_effect
        from contribution_weights.measures.layer import cosine

        call, rows = view.call, view.rows
        if call.layer_idx not in self.layers:
            return
        start = max(rows.start, call.q_len - min(self.window, call.q_len))
        if start >= rows.stop:
            return
        # the StatsObserver's dtype and rows: the block's LayerTensors are shared with it
        dtype = torch.promote_types(call.query.dtype, torch.float32)
        lt = view.tensors(dtype, rows=slice(start, rows.stop))
        probs = lt.probs
        effect = renormalised_effect(probs, lt.head_values, lt.head_states, lt.gram)
        parts = {
            "kappa": cosine(lt).sum(2),
            "alpha_odds": (probs / (1 - probs).clamp_min(1e-12)).sum(2),
            "alpha_distance": (effect * (1 - probs)).sum(2),
        }
        acc = self.sums.setdefault(call.layer_idx, {})
        for k, v in parts.items():
            acc[k] = v if k not in acc else acc[k] + v


class FutureEffects:
    """Continuation capture observer: for the future queries (every query row of the
    continuation pass) the true effects of evicting each prefill key, per layer.

    ``prefix`` is C; ``window`` the ranked keys' bound (keys < C − window are ranked).
    Kept per layer (arrays over the ranked keys): ``truth`` ``(H, N)`` mean_i ‖Δo_ij^(h)‖,
    ``group_truth`` ``(G, N)`` mean_i ‖Σ_{h∈g} Δo_ij^(h)‖, the oracles ``(H, N)``, and
    amplification sums.
    """

    def __init__(
        self, layers: set[int], prefix: int, window: int, sample: bool, cross: dict[int, Any]
    ) -> None:
        self.layers, self.prefix, self.window = layers, prefix, window
        self.sample = sample
        self.out: dict[int, dict[str, Any]] = {}
        self.points: list[np.ndarray] = []  # (α, r, ‖Δo‖, is token 0) samples, for the figure
        self.cross = cross  # per layer, the within-group W_O^(h)ᵀ W_O^(h') (shared by items)

    def wants(self, layer_idx: int) -> bool:
        return layer_idx in self.layers

    def observe(self, view: Any) -> None:
        import torch

        from contribution_weights.kv.renormalised import renormalised_effect
        from contribution_weights.measures.layer import contribution

        call = view.call
        if call.layer_idx not in self.layers:
            return
        if view.rows != slice(0, call.q_len):
            raise RuntimeError("the continuation must fit one capture block")
        f64 = torch.float64
        lt = view.tensors(f64)
        c, n = self.prefix, self.prefix - self.window
        probs = lt.probs  # (1, H, K, T_k), T_k = C + K
        effect = renormalised_effect(probs, lt.head_values, lt.head_states, lt.gram)
        alpha, eff = probs[0, :, :, :n], effect[0, :, :, :n]  # (H, K, N)
        r = lt.value_norm[0, :, :n]  # (H, N)
        first = alpha * r[:, None]  # ‖α ṽ‖, the first-order change's norm
        # the exact change projected on the layer output o_i, the eviction analogue of ĉ:
        # ⟨o_i, Δo_ij⟩ / ‖o_i‖² = a_ij (Σ_k α_ik p_ik − p_ij), p_ij = ⟨o_i, ṽ_j⟩ / ‖o_i‖²
        proj = lt.output_dot_values_per_norm2[0]  # (H, K, T_k)
        head_share = (probs[0] * proj).sum(-1, keepdim=True)
        odds_ = alpha / (1 - alpha).clamp_min(SATURATED)
        res: dict[str, Any] = {
            "truth": eff.mean(1),
            "truth_projected": (odds_ * (head_share - proj[..., :n])).abs().mean(1),
            "future_attention": alpha.mean(1),
            "future_alpha_r": first.mean(1),
            "future_contribution": contribution(lt)[0, :, :, :n].abs().mean(1),
            "future_alpha_distance": (eff * (1 - alpha)).mean(1),
            "group_truth": self._group_truth(call, lt, c, n),
            "saturated": int((1 - alpha <= SATURATED).sum()),
        }
        # amplification exact / first order = ‖o − ṽ‖ / ((1 − α) ‖ṽ‖), and its two factors;
        # not where 1 − α is below float32's resolution of α (the effect is a bound there)
        ok = (first > 0) & (1 - alpha > SATURATED)
        amp = torch.where(ok, eff / first.clamp_min(1e-300), 1.0).log()
        odds = -(1 - alpha).clamp_min(1e-300).log()  # log 1/(1−α)
        direction = amp - odds  # log ‖o − ṽ‖ / ‖ṽ‖
        bins = torch.bucketize(alpha.contiguous(), torch.tensor(ALPHA_EDGES[1:-1], dtype=f64))
        is0 = torch.zeros_like(alpha, dtype=torch.bool)
        is0[..., 0] = True
        table = np.zeros((2, len(ALPHA_EDGES) - 1, 4))  # [token 0 / others, bin, (n, Σ logs)]
        for g, sel in enumerate((is0 & ok, ~is0 & ok)):
            for b in range(len(ALPHA_EDGES) - 1):
                m = sel & (bins == b)
                table[g, b] = [
                    float(m.sum()),
                    float(amp[m].sum()),
                    float(odds[m].sum()),
                    float(direction[m].sum()),
                ]
        res["amplification"] = table
        self.out[call.layer_idx] = {
            k: (v.numpy() if torch.is_tensor(v) else v) for k, v in res.items()
        }
        if self.sample:  # figure points: every token-0 entry and 200 others per head
            gen = torch.Generator().manual_seed(call.layer_idx)
            h, k = alpha.shape[:2]
            picks = torch.randint(1, n, (h, k, 4), generator=gen)
            for idx, flag in ((torch.zeros(h, k, 1, dtype=torch.long), 1.0), (picks, 0.0)):
                a_ = alpha.gather(2, idx)
                r_ = r[:, None].expand(-1, k, -1).gather(2, idx)
                e_ = eff.gather(2, idx)
                pts = torch.stack([a_, r_, e_, torch.full_like(a_, flag)], -1).reshape(-1, 4)
                self.points.append(pts.numpy())

    def _group_truth(self, call: Any, lt: Any, c: int, n: int) -> Any:
        """``(G, N)``: mean over future queries of ‖Σ_{h∈g} Δo_ij^(h)‖, the exact change of
        the layer's attention output when KV head g loses key j (all its query heads).

        ‖Σ_h a_h (o_h − ṽ_h)‖² = Σ_{h,h'} a_h a_h' ⟨o_h − ṽ_h, o_h' − ṽ_h'⟩ (a = α/(1−α)),
        each inner product in the d_h-sized metric M_hh' = W_O^(h)ᵀ W_O^(h') on z_i, v_j."""
        import torch

        h, g = lt.probs.shape[1], lt.values.shape[1]
        rep = h // g
        if call.layer_idx not in self.cross:
            w = lt.w_o  # (H, d, d_h)
            blocks = w.reshape(g, rep, *w.shape[1:])
            self.cross[call.layer_idx] = torch.einsum("gred,gsef->grsdf", blocks, blocks)
        cross = self.cross[call.layer_idx]  # (G, rep, rep, d_h, d_h)
        probs = lt.probs[0, :, :, :n]
        a = (probs / (1 - probs).clamp_min(SATURATED)).reshape(g, rep, -1, n)  # (G, rep, K, N)
        z = lt.head_states[0].reshape(g, rep, -1, lt.values.shape[-1])  # (G, rep, K, d_h)
        v = lt.values[0, :, :n]  # (G, N, d_h)
        zm = torch.einsum("gakd,gabdf->gabkf", z, cross)  # z_a M_ab
        oo = (zm * z[:, None]).sum(-1)  # (G, a, b, K): ⟨o_a, o_b⟩
        ov = torch.einsum("gabkf,gnf->gabkn", zm, v)  # ⟨o_a, ṽ_b⟩
        vv = torch.einsum("gnd,gabdf,gnf->gabn", v, cross, v)  # ⟨ṽ_a, ṽ_b⟩
        inner = oo[..., None] - ov - ov.transpose(1, 2) + vv[:, :, :, None]
        total = torch.einsum("gakn,gbkn,gabkn->gkn", a, a, inner)
        return total.clamp_min(0).sqrt().mean(1)


# ---- statistics ----------------------------------------------------------------------------
def spearman(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman ρ along the last axis (average ranks for ties); 0 where a side is constant."""
    from scipy.stats import rankdata

    rx, ry = rankdata(x, axis=-1), rankdata(y, axis=-1)
    rx = rx - rx.mean(-1, keepdims=True)
    ry = ry - ry.mean(-1, keepdims=True)
    den = np.sqrt((rx**2).sum(-1) * (ry**2).sum(-1))
    return np.where(den > 0, (rx * ry).sum(-1) / np.where(den > 0, den, 1), 0.0)


def top_overlap(pred: np.ndarray, truth: np.ndarray, m: int) -> np.ndarray:
    """Share of the true top-``m`` keys (last axis) among the predictor's top ``m``."""
    tp = np.argsort(-pred, axis=-1, kind="stable")[..., :m]
    tt = np.argsort(-truth, axis=-1, kind="stable")[..., :m]
    hit = np.zeros(pred.shape, dtype=bool)
    np.put_along_axis(hit, tp, True, axis=-1)
    return np.take_along_axis(hit, tt, axis=-1).mean(-1)


def percentile_rank(x: np.ndarray) -> np.ndarray:
    """Rank of each key within its row as a fraction in [0, 1] (1 = highest score)."""
    from scipy.stats import rankdata

    return (rankdata(x, axis=-1) - 1) / max(1, x.shape[-1] - 1)


def bootstrap(x: np.ndarray, reps: int = 10000, seed: int = 0) -> dict[str, float]:
    """Mean of ``x`` over items with a 95% percentile bootstrap interval."""
    x = np.asarray(x, dtype=float)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), (reps, len(x)))].mean(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"mean": float(x.mean()), "lo": float(lo), "hi": float(hi)}


def quartiles(x: np.ndarray) -> dict[str, float]:
    q1, med, q3 = np.percentile(np.asarray(x, dtype=float), [25, 50, 75])
    return {"median": float(med), "q1": float(q1), "q3": float(q3)}


# ---- one item ------------------------------------------------------------------------------
def analyse_item(
    model: Any, ids: Any, args: argparse.Namespace, item: int, sample: bool
) -> dict[str, Any]:
    import torch

    import contribution_weights as cw
    from contribution_weights.capture import capturing, check_all_layers_seen

    net = model.model
    c, w, k = args.context, args.window, args.continuation
    n = c - w
    prefix, fed = ids[None, :c], ids[None, c : c + k + 1]
    types = getattr(model.text_config, "layer_types", None) or []
    layers = set(range(model.num_layers)) - {i for i, t in enumerate(types) if "sliding" in str(t)}
    specs = [cw.kv.get_method(m) for m in METHODS]
    needs = {s for m in specs for s in cw.kv.methods.method_needs(m)}
    needs |= {"attn_sum", "window_probs", "window_contribution", "projected_value_norm"}
    stats_obs = cw.kv.StatsObserver(layers, w, needs)
    geo = WindowGeometry(layers, w)
    t0 = time.perf_counter()
    with torch.no_grad(), capturing(net, observers=[stats_obs, geo]) as session:
        out = net(input_ids=prefix, use_cache=True, **model.last_logits_only())
    check_all_layers_seen(session, model.num_layers)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    stats = {i: s for i, s in stats_obs.stats(seed=item).items() if i in layers}
    layer_ids = sorted(stats)
    t_prefill = time.perf_counter() - t0

    clean = copy.deepcopy(cache) if item < args.nll_items else None
    future = FutureEffects(set(layer_ids), c, w, sample, CROSS_GRAMS)
    t0 = time.perf_counter()
    pos = torch.arange(c, c + k)[None]
    with torch.no_grad(), capturing(net, observers=[future]) as session:
        net(input_ids=fed[:, :-1], position_ids=pos, **{cw.kv.cache_keyword(net): cache})
    check_all_layers_seen(session, model.num_layers)
    t_future = time.perf_counter() - t0

    # per query head: predictors (H, N) and truth
    def head_preds(i: int) -> dict[str, np.ndarray]:
        s, g = stats[i], geo.sums[i]
        window_alpha = s.window_probs.mean(2)[0, :, :n]
        r = s.projected_value_norm[0, :, :n]
        p = {
            "window_attention": window_alpha,
            "h2o": s.attn_sum[0, :, :n],
            "value_norm": r,
            "kappa": g["kappa"][0, :, :n],
            "alpha_odds": g["alpha_odds"][0, :, :n],
            "alpha_r": window_alpha * r,
            "contribution": s.window_contribution[0, :, :n],
            "alpha_distance": g["alpha_distance"][0, :, :n],
            "renormalised": s.window_renormalised[0, :, :n],
        }
        out = {name: v.double().numpy() for name, v in p.items()}
        for name in ORACLES:
            out[name] = future.out[i][name]
        return out

    all_head = [*HEAD_PREDICTORS, *ORACLES]
    rho_head, rho_group, overlap, rho_proj, rho_truths = [], [], [], [], []
    top1 = {p: [0, 0] for p in all_head}  # [true top-1% keys, of them in the bottom half]
    top1_pos = {"first4": 0, "token0": 0, "contribution_bottom_first4": 0}
    token0_rank = {p: [] for p in ["truth", *all_head]}
    group_names = [*METHODS, *GROUP_DERIVED]
    total_truth, total_proj = np.zeros(n), np.zeros(n)
    for i in layer_ids:
        preds, truth = head_preds(i), future.out[i]["truth"]
        h = truth.shape[0]
        rho_head.append(np.stack([spearman(preds[p], truth) for p in all_head], -1))
        tproj = future.out[i]["truth_projected"]
        rho_proj.append(np.stack([spearman(preds[p], tproj) for p in all_head], -1))
        rho_truths.append(spearman(truth, tproj))
        ranks_t = percentile_rank(truth)
        token0_rank["truth"].append(ranks_t[:, 0])
        m1 = max(1, math.ceil(0.01 * n))
        true_top = np.argsort(-truth, -1, kind="stable")[:, :m1]  # (H, m1)
        top1_pos["first4"] += int((true_top < N_SINK).sum())
        top1_pos["token0"] += int((true_top == 0).sum())
        for p in all_head:
            rk = percentile_rank(preds[p])
            token0_rank[p].append(rk[:, 0])
            bottom = np.take_along_axis(rk, true_top, -1) < 0.5
            top1[p][0] += true_top.size
            top1[p][1] += int(bottom.sum())
            if p == "contribution":
                top1_pos["contribution_bottom_first4"] += int((bottom & (true_top < N_SINK)).sum())
        # per KV head: the methods' scores and group sums of the derived predictors
        gt = future.out[i]["group_truth"]  # (G, N)
        g = gt.shape[0]
        total_truth += gt.sum(0)
        total_proj += future.out[i]["truth_projected"].sum(0)
        gp = {}
        for spec in specs:
            score = spec.score_for_budget(stats[i], max(1, c // 2))
            gp[spec.name] = score[0, :, :n].double().numpy()
        for p in GROUP_DERIVED:
            gp[p] = preds[p].reshape(g, h // g, n).sum(1)
        rho_group.append(np.stack([spearman(gp[p], gt) for p in group_names], -1))
        overlap.append(
            np.stack(
                [
                    np.stack(
                        [top_overlap(gp[p], gt, int(c * (1 - r)) - w) for p in group_names], -1
                    )
                    for r in RATIOS
                ]
            )
        )
    amp = sum(future.out[i]["amplification"] for i in layer_ids)
    res: dict[str, Any] = {
        "item": item,
        "layers": layer_ids,
        "rho_head": np.stack(rho_head).round(5).tolist(),  # (L, H, P)
        "rho_group": np.stack(rho_group).round(5).tolist(),  # (L, G, P')
        "rho_head_projected": np.stack(rho_proj).round(5).tolist(),  # (L, H, P)
        "rho_truths": np.stack(rho_truths).round(5).tolist(),  # (L, H): ‖Δo‖ vs projected
        "overlap": np.stack(overlap).round(5).tolist(),  # (L, ratio, G, P')
        "top1": top1,
        "top1_pos": top1_pos,
        "token0_rank": {p: float(np.mean(np.concatenate(v))) for p, v in token0_rank.items()},
        "amplification": amp.tolist(),
        "saturated": int(sum(future.out[i]["saturated"] for i in layer_ids)),
        "seconds": {"prefill": t_prefill, "future": t_future},
    }
    if sample:
        res["points"] = np.concatenate(future.points).round(7).tolist()
        # for a scatter: the head of this item whose contribution ρ is the median one
        flat = np.stack(rho_head)[..., all_head.index("contribution")]  # (L, H)
        order = np.argsort(flat, axis=None, kind="stable")
        li, hh = np.unravel_index(order[len(order) // 2], flat.shape)
        best = (layer_ids[li], int(hh))
        preds = head_preds(best[0])
        res["scatter"] = {
            "layer": best[0],
            "head": best[1],
            "rho": {"contribution": float(flat[li, hh])},
            "truth": future.out[best[0]]["truth"][best[1]].tolist(),
            **{
                p: preds[p][best[1]].tolist()
                for p in ("contribution", "renormalised", "window_attention")
            },
        }
    if clean is not None:
        t0 = time.perf_counter()
        res["nll"] = nll_check(net, clean, fed, c, layer_ids, total_truth, total_proj, item, pos)
        res["seconds"]["nll"] = time.perf_counter() - t0
    return res


def nll_check(
    net: Any,
    cache: Any,
    fed: Any,
    c: int,
    layers: list[int],
    total: np.ndarray,
    total_proj: np.ndarray,
    item: int,
    pos: Any,
) -> dict[str, Any]:
    """Evict single tokens from every compressible layer's cache (all KV heads) and measure
    the NLL of the continuation: the first 4 tokens, the 8 with the largest summed truth,
    12 random others; against the truth summed over layers and KV heads."""
    import torch

    from contribution_weights.kv import cache_keyword
    from contribution_weights.kv.evaluate import continuation_nll

    cache_key = cache_keyword(net)  # read once: the same for every eviction below

    def nll(cache_: Any) -> float:
        with torch.no_grad():
            logits = net(input_ids=fed[:, :-1], position_ids=pos, **{cache_key: cache_}).logits
        return continuation_nll(logits, fed[:, 1:])

    base = nll(copy.deepcopy(cache))
    order = [j for j in np.argsort(-total) if j >= N_SINK][:8]
    rest = [j for j in range(N_SINK, len(total)) if j not in order]
    rng = np.random.default_rng(item)
    tokens = [*range(N_SINK), *order, *rng.choice(rest, 12, replace=False).tolist()]
    rows = []
    for j in tokens:
        ev = copy.deepcopy(cache)
        for i in layers:
            lay = ev.layers[i]
            lay.keys = torch.cat([lay.keys[:, :, :j], lay.keys[:, :, j + 1 :]], 2).contiguous()
            lay.values = torch.cat(
                [lay.values[:, :, :j], lay.values[:, :, j + 1 :]], 2
            ).contiguous()
        rows.append(
            {
                "token": int(j),
                "dnll": nll(ev) - base,
                "truth": float(total[j]),
                "truth_projected": float(total_proj[j]),
            }
        )
    dn = np.array([r["dnll"] for r in rows])
    tr = np.array([r["truth"] for r in rows])
    tp = np.array([r["truth_projected"] for r in rows])
    return {
        "base_nll": base,
        "rows": rows,
        "rho": float(spearman(tr, dn)),
        "rho_abs": float(spearman(tr, np.abs(dn))),
        "rho_abs_projected": float(spearman(tp, np.abs(dn))),
        "rho_abs_no_sinks": float(spearman(tr[N_SINK:], np.abs(dn[N_SINK:]))),
    }


# ---- summary -------------------------------------------------------------------------------
def summarise(items: list[dict[str, Any]], layer_ids: list[int]) -> dict[str, Any]:
    all_head = [*HEAD_PREDICTORS, *ORACLES]
    group_names = [*METHODS, *GROUP_DERIVED]
    rh = np.array([it["rho_head"] for it in items])  # (n, L, H, P)
    rp = np.array([it["rho_head_projected"] for it in items])  # (n, L, H, P)
    rt = np.array([it["rho_truths"] for it in items])  # (n, L, H)
    rg = np.array([it["rho_group"] for it in items])  # (n, L, G, P')
    ov = np.array([it["overlap"] for it in items])  # (n, L, R, G, P')
    per_head = rh.mean(0).reshape(-1, len(all_head))  # heads, items averaged
    per_group = rg.mean(0).reshape(-1, len(group_names))
    out: dict[str, Any] = {
        "spearman_head": {
            p: {
                **quartiles(per_head[:, k]),
                "mean": float(per_head[:, k].mean()),
                "per_layer_median": [
                    float(np.median(rh[:, li, :, k])) for li in range(rh.shape[1])
                ],
                "item_mean": bootstrap(rh[..., k].mean((1, 2))),
            }
            for k, p in enumerate(all_head)
        },
        "spearman_head_projected": {
            p: {
                **quartiles(rp.mean(0).reshape(-1, len(all_head))[:, k]),
                "item_mean": bootstrap(rp[..., k].mean((1, 2))),
            }
            for k, p in enumerate(all_head)
        },
        "spearman_truth_vs_projected": quartiles(rt.mean(0).ravel()),
        "spearman_group": {
            p: {**quartiles(per_group[:, k]), "item_mean": bootstrap(rg[..., k].mean((1, 2)))}
            for k, p in enumerate(group_names)
        },
        "overlap": {
            str(r): {
                p: bootstrap(ov[:, :, ri, :, k].mean((1, 2))) for k, p in enumerate(group_names)
            }
            for ri, r in enumerate(RATIOS)
        },
        "layers": layer_ids,
    }
    paired: dict[str, Any] = {}
    for a, b in PAIRS:
        ka, kb = all_head.index(a), all_head.index(b)
        d = rh[..., ka].mean((1, 2)) - rh[..., kb].mean((1, 2))
        dp = rp[..., ka].mean((1, 2)) - rp[..., kb].mean((1, 2))
        entry: dict[str, Any] = {
            "spearman_head": bootstrap(d),
            "spearman_head_projected": bootstrap(dp),
        }
        if a in group_names and b in group_names:
            ga, gb = group_names.index(a), group_names.index(b)
            entry["spearman_group"] = bootstrap(rg[..., ga].mean((1, 2)) - rg[..., gb].mean((1, 2)))
            for ri, r in enumerate(RATIOS):
                da = ov[:, :, ri, :, ga].mean((1, 2)) - ov[:, :, ri, :, gb].mean((1, 2))
                entry[f"overlap_{r}"] = bootstrap(da)
        lo, hi = entry["spearman_head"]["lo"], entry["spearman_head"]["hi"]
        entry["called"] = bool(lo > 0 or hi < 0)
        paired[f"{a} - {b}"] = entry
    out["paired"] = paired
    # the sinks' methods against the plain ones at the KV level
    for a, b in (("contribution_sinks", "renormalised_sinks"), ("renormalised", "snapkv")):
        ga, gb = group_names.index(a), group_names.index(b)
        out["paired"][f"{a} - {b}"] = {
            f"overlap_{r}": bootstrap(
                ov[:, :, ri, :, ga].mean((1, 2)) - ov[:, :, ri, :, gb].mean((1, 2))
            )
            for ri, r in enumerate(RATIOS)
        }
    # true top-1% keys ranked in a predictor's bottom half
    t1 = {p: [sum(it["top1"][p][j] for it in items) for j in (0, 1)] for p in all_head}
    pos = {k: sum(it["top1_pos"][k] for it in items) for k in items[0]["top1_pos"]}
    out["top1"] = {
        "keys": t1["contribution"][0],
        "share_first4": pos["first4"] / t1["contribution"][0],
        "share_token0": pos["token0"] / t1["contribution"][0],
        "bottom_half_share": {p: t1[p][1] / t1[p][0] for p in all_head},
        "contribution_bottom_half_first4_share": (
            pos["contribution_bottom_first4"] / max(1, t1["contribution"][1])
        ),
        "bottom_half_item": {
            p: bootstrap(np.array([it["top1"][p][1] / it["top1"][p][0] for it in items]))
            for p in all_head
        },
    }
    out["token0_percentile"] = {
        p: float(np.mean([it["token0_rank"][p] for it in items])) for p in items[0]["token0_rank"]
    }
    amp = sum(np.array(it["amplification"]) for it in items)  # (2, bins, 4)
    rows = []
    for g, who in enumerate(("token0", "others")):
        for b in range(len(ALPHA_EDGES) - 1):
            cnt = amp[g, b, 0]
            if cnt == 0:
                continue
            rows.append(
                {
                    "keys": who,
                    "alpha": [ALPHA_EDGES[b], ALPHA_EDGES[b + 1]],
                    "n": int(cnt),
                    "geo_mean_exact_over_first_order": float(np.exp(amp[g, b, 1] / cnt)),
                    "geo_mean_odds_factor": float(np.exp(amp[g, b, 2] / cnt)),
                    "geo_mean_direction_factor": float(np.exp(amp[g, b, 3] / cnt)),
                }
            )
        tot = amp[g].sum(0)
        rows.append(
            {
                "keys": who,
                "alpha": "all",
                "n": int(tot[0]),
                "geo_mean_exact_over_first_order": float(np.exp(tot[1] / tot[0])),
                "geo_mean_odds_factor": float(np.exp(tot[2] / tot[0])),
                "geo_mean_direction_factor": float(np.exp(tot[3] / tot[0])),
            }
        )
    out["amplification"] = rows
    out["saturated_entries"] = int(sum(it["saturated"] for it in items))
    nll = [it["nll"] for it in items if "nll" in it]
    if nll:
        out["nll_check"] = {
            "items": len(nll),
            "tokens_per_item": len(nll[0]["rows"]),
            "rho_truth_dnll": bootstrap(np.array([x["rho"] for x in nll])),
            "rho_truth_abs_dnll": bootstrap(np.array([x["rho_abs"] for x in nll])),
            "rho_truth_abs_dnll_no_sinks": bootstrap(
                np.array([x["rho_abs_no_sinks"] for x in nll])
            ),
            "rho_projected_abs_dnll": bootstrap(np.array([x["rho_abs_projected"] for x in nll])),
            "mean_dnll_token0": float(np.mean([x["rows"][0]["dnll"] for x in nll])),
            "mean_dnll_tokens1_3": float(np.mean([r["dnll"] for x in nll for r in x["rows"][1:4]])),
            "mean_dnll_top8": float(np.mean([r["dnll"] for x in nll for r in x["rows"][4:12]])),
            "mean_dnll_random12": float(np.mean([r["dnll"] for x in nll for r in x["rows"][12:]])),
        }
    return out


# ---- figure --------------------------------------------------------------------------------
def draw(result: dict[str, Any], first: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 10.5))
    ax = axes[0, 0]
    shown = (
        "window_attention",
        "h2o",
        "value_norm",
        "alpha_r",
        "contribution",
        "alpha_distance",
        "renormalised",
    )
    for p in shown:
        y = s["spearman_head"][p]["per_layer_median"]
        ax.plot(
            s["layers"],
            y,
            marker="o",
            ms=3,
            lw=2 if p in ("contribution", "renormalised") else 1.2,
            label=p,
        )
    y = s["spearman_head"]["future_contribution"]["per_layer_median"]
    ax.plot(s["layers"], y, ls="--", color="grey", label="future_contribution (oracle)")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("median Spearman ρ over heads and items")
    ax.set_title("(a) prediction of the future true effect ‖Δo‖, per layer")
    ax.legend(fontsize=8, ncol=2)

    ax = axes[0, 1]
    names = [*HEAD_PREDICTORS, *ORACLES]
    rh = np.array(first["_per_head"])  # (heads, P)
    ax.boxplot([rh[:, k] for k in range(len(names))], showfliers=False)
    ax.set_xticks(range(1, len(names) + 1), names, rotation=40, ha="right", fontsize=8)
    ax.axhline(0, color="k", lw=0.5)
    ax.axvline(len(HEAD_PREDICTORS) + 0.5, color="grey", ls=":")
    ax.set_ylabel("Spearman ρ per (layer, head), mean over items")
    ax.set_title("(b) per-head ρ: prefill predictors | oracles on the future queries")

    ax = axes[1, 0]
    sc = first["scatter"]
    truth = np.array(sc["truth"])
    for p, colour in (("contribution", "tab:blue"), ("renormalised", "tab:red")):
        x = np.array(sc[p])
        x = x / np.median(x)
        ax.scatter(x[N_SINK:], truth[N_SINK:], s=6, alpha=0.5, color=colour, label=p)
        ax.scatter(x[:N_SINK], truth[:N_SINK], s=70, marker="*", color=colour, edgecolor="k")
        if p == "contribution":
            ax.annotate(
                "token 0", (x[0], truth[0]), fontsize=8, xytext=(6, -10), textcoords="offset points"
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prefill score / its median over keys (stars: tokens 0–3)")
    ax.set_ylabel("true future mean ‖Δo_ij‖")
    ax.set_title(
        f"(c) a median head (contribution ρ = {sc['rho']['contribution']:.2f}): "
        f"layer {sc['layer']}, head {sc['head']}, item 0"
    )
    ax.legend(fontsize=8)

    ax = axes[1, 1]
    pts = np.array(first["points"])  # (α, r, ‖Δo‖, token0)
    a, r, e, t0 = pts.T
    ratio = e / np.maximum(a * r, 1e-300)
    keep = (a > 1e-6) & (a * r > 0)
    others, sink = keep & (t0 == 0), keep & (t0 == 1)
    ax.scatter(
        a[others], ratio[others], s=2, alpha=0.25, color="tab:grey", label="other keys (sample)"
    )
    ax.scatter(a[sink], ratio[sink], s=2, alpha=0.25, color="tab:orange", label="token 0")
    grid = np.logspace(-6, np.log10(0.999), 200)
    ax.plot(grid, 1 / (1 - grid), color="k", lw=1, label="1/(1−α)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("α_ij (future query i, key j)")
    ax.set_ylabel("‖Δo_ij‖ / ‖α_ij ṽ_j‖  (exact / first order)")
    ax.set_title("(d) how far eviction exceeds the first-order change (item 0)")
    ax.legend(fontsize=8, markerscale=4)
    fig.suptitle(
        f"Eviction geometry, {result['model']}, FineWeb-Edu, C = {result['context']}, "
        f"{result['continuation']} future queries, n = {result['n']}",
        fontsize=12,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main ----------------------------------------------------------------------------------
#: the table's names for the predictors (the others are named as they are)
LABELS = {
    "alpha_r": "α·r",
    "alpha_distance": "α·distance",
    "future_contribution": "oracle: future |ĉ|",
    "future_attention": "future α",
}
MODELS = {"smollm2": "SmolLM2", "gemma3-270m": "Gemma 3"}
#: the oracles' quantities, as the ranking table names them
ORACLE_OF = {
    "attention": "α",
    "alpha_r": "α·r",
    "contribution": "|ĉ|",
    "alpha_distance": "α·distance",
}


def _label(pair: str) -> str:
    return " − ".join(LABELS.get(name, name) for name in pair.split(" - ")).replace("|", "\\|")


def _interval(cell: dict[str, float]) -> str:
    return "{:+.3f} [{:+.3f}, {:+.3f}]".format(cell["mean"], cell["lo"], cell["hi"]).replace(
        "-", "−"
    )


def markdown(results: list[dict[str, Any]]) -> str:
    """The paired differences of every pair that has them all, per result (a model): Δρ per
    head and Δ top-50% overlap per KV head, mean over items and 95% bootstrap interval."""
    header = ["A − B"]
    for result in results:
        name = MODELS.get(result["model"], result["model"])
        header += [f"{name} Δρ per head", f"{name} Δ overlap 50%"]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    pairs = [k for k, v in results[0]["summary"]["paired"].items() if "spearman_head" in v]
    for pair in pairs:
        cells = [_label(pair)]
        for result in results:
            entry = result["summary"]["paired"][pair]
            cells += [_interval(entry["spearman_head"]), _interval(entry["overlap_0.5"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + rankings(results)


def rankings(results: list[dict[str, Any]]) -> str:
    """How well each predictor ranks the future effect (Spearman ρ per head, mean over
    items and its 95% interval), the oracles on the future queries below the prefill
    predictors; then how single-token evictions' truth tracks the NLL (the NLL check)."""
    names = [MODELS.get(r["model"], r["model"]) for r in results]
    lines = ["| predictor (ρ per head with the future effect) | " + " | ".join(names) + " |"]
    lines.append("| --- |" + " ---: |" * len(results))
    rho = [r["summary"]["spearman_head"] for r in results]
    for name in rho[0]:
        cells = [_interval(r[name]["item_mean"]) for r in rho]
        base = name.removeprefix("future_")
        label = LABELS.get(base, base) if base == name else f"oracle: future {ORACLE_OF[base]}"
        label = label.replace("|", "\\|")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    checks = [r["summary"]["nll_check"] for r in results]
    lines.append(
        "| single-token evictions: ρ(truth, \\|ΔNLL\\|) | "
        + " | ".join(_interval(c["rho_truth_abs_dnll"]) for c in checks)
        + " |"
    )
    lines.append(
        "| single-token evictions: token 0's mean ΔNLL (nats) | "
        + " | ".join(f"{c['mean_dnll_token0']:+.3f}".replace("-", "−") for c in checks)
        + " |"
    )
    return "\n".join(lines) + "\n"


def write_table(out: Path, sources: list[Path]) -> int:
    """``--table OUT.md RESULT.json ...``: the Markdown table of committed results."""
    out.write_text(markdown([json.loads(source.read_text()) for source in sources]))
    print(f"wrote {out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--table", nargs="+", type=Path, metavar=("OUT.md", "RESULT.json"),
        help="write the paired-difference table of these results (one per model) and stop",
    )  # fmt: skip
    p.add_argument("--model", default=None)
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--continuation", type=int, default=64)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--nll-items", type=int, default=8, help="items with the NLL check")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--figure", type=Path, default=None)
    args = p.parse_args()
    if args.table:
        if len(args.table) < 2:
            p.error("--table takes OUT.md and at least one RESULT.json")
        return write_table(args.table[0], args.table[1:])
    if args.out is None:
        p.error("--out is required (or --table OUT.md RESULT.json ...)")
    data_dir()  # $CW_DATA_DIR, checked

    import torch

    import contribution_weights as cw
    from contribution_weights.kv.evaluate import CONTINUATION, lm_items

    if args.continuation > CONTINUATION:
        raise SystemExit(f"--continuation is at most {CONTINUATION} (the LM items' length)")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_suffix(".partial.jsonl")
    done: list[dict[str, Any]] = []
    if partial.exists():
        lines = partial.read_text().splitlines()
        if lines and json.loads(lines[0]) == {"config": config}:
            done = [json.loads(x) for x in lines[1:] if x.strip()]
            print(f"resuming: {len(done)} items done", flush=True)
        else:
            partial.unlink(missing_ok=True)
    if not partial.exists():
        partial.write_text(json.dumps({"config": config}) + "\n")
    model = cw.load_model(args.model)
    texts = cw.data.load_texts("fineweb-edu")
    start = time.perf_counter()
    with partial.open("a") as fh:
        for item, ids in enumerate(lm_items(model, texts, args.context, args.n)):
            if item < len(done):
                continue
            t0 = time.perf_counter()
            res = analyse_item(model, ids, args, item, sample=item == 0)
            res["seconds"]["item"] = time.perf_counter() - t0
            fh.write(json.dumps(res) + "\n")
            fh.flush()
            done.append(res)
            print(
                f"item {item}: {res['seconds']['item']:.1f} s "
                f"(prefill {res['seconds']['prefill']:.1f}, future {res['seconds']['future']:.1f}"
                + (f", nll {res['seconds']['nll']:.1f}" if "nll" in res["seconds"] else "")
                + ")",
                flush=True,
            )
    summary = summarise(done, done[0]["layers"])
    n_rank = args.context - args.window
    summary["overlap_random_expected"] = {
        str(r): (int(args.context * (1 - r)) - args.window) / n_rank for r in RATIOS
    }
    result = {
        "model": model.name,
        "dataset": "fineweb-edu",
        "context": args.context,
        "continuation": args.continuation,
        "window": args.window,
        "ranked_keys": n_rank,
        "n": len(done),
        "head_predictors": list(HEAD_PREDICTORS),
        "oracles": list(ORACLES),
        "group_predictors": [*METHODS, *GROUP_DERIVED],
        "ratios": list(RATIOS),
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "seconds_per_item": float(np.mean([it["seconds"]["item"] for it in done])),
        "seconds_this_session": time.perf_counter() - start,
        "scatter": done[0]["scatter"],
        # per (layer, head, predictor) ρ, mean over items; per item the NLL check's rows
        "rho_head_mean": np.array([it["rho_head"] for it in done]).mean(0).round(4).tolist(),
        "rho_group_mean": np.array([it["rho_group"] for it in done]).mean(0).round(4).tolist(),
        "nll_rows": [it["nll"]["rows"] for it in done if "nll" in it],
        "summary": summary,
    }
    args.out.write_text(json.dumps(result, indent=1))
    if args.figure is not None:
        rh = np.array([it["rho_head"] for it in done]).mean(0)
        first = {**done[0], "_per_head": rh.reshape(-1, rh.shape[-1]).tolist()}
        draw(result, first, args.figure)
    partial.unlink(missing_ok=True)
    print(json.dumps({k: v for k, v in summary.items() if k != "spearman_head"}, indent=1)[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
