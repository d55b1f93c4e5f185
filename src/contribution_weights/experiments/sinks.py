"""Attention sinks as active suppressors (paper §6.2, method §5): three analyses.

* :class:`NormFit` — per head, the fit of ‖o_i^(h)‖² on the sink attention α = α_i0:
  ``‖o‖² ≈ α²‖ṽ_0‖² + 2α(1−α)γ' + (1−α)²κ'²``. With ``‖ṽ_0‖²`` measured (per sequence),
  the fit is linear in (γ', κ'²), so its normal equations accumulate exactly across
  sequences. The curve is ``qα² + 2(γ'−κ'²)α + κ'²`` with ``q = A − 2γ' + κ'²`` (A the
  mean ‖ṽ_0‖²): convex when q > 0, minimal at ``α_min = (κ'² − γ')/q``, and α_min < 1
  exactly when γ' < A (the sink is less aligned with the tail than with itself).
  ``convex_min_below_1`` marks the paper's shape: convex with an interior minimum,
  0 < α_min < 1 (α_min ≤ 0 would make ‖o‖ grow with α over all of [0, 1]).
* :class:`SemanticCone` — per head, μ̂ = normalised mean of the non-sink ṽ_j; the sink
  ṽ_0 = aμ̂ + bû; the cone is the smallest angle around μ̂ holding 90% of the non-sink
  values. Each head output o_i^(h) (i ≥ 1) is tested against the cone as is and with the
  sink's value set to 0 (o_i^(h) − α_i0 ṽ_0, the same layer inputs); counted for the
  low-norm outputs (the bottom ``low_quantile`` of ‖o_i^(h)‖ per head and sequence).
* :func:`sink_scaling_nll` — perplexity when v_0 is multiplied by γ in the sink layers,
  through :class:`~..interventions.SinkValueScale`, a capture intervention scaling v_0
  (Σ_j α_ij v_j with v_0 → γ v_0 is the same as α_i0 → γ α_i0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..interventions import DEFAULT_MEMORY_BYTES, SinkValueScale, intervened_logprobs, mean_nll
from ..loading import LoadedModel
from .stats import BlockView, Stat
from .streaming import Reservoir


class NormFit(Stat):
    """Per (layer, head) least squares of ‖o‖² − α²‖ṽ_0‖² on [2α(1−α), (1−α)²]."""

    def __init__(self, num_layers: int, num_heads: int, points_per_head: int = 256) -> None:
        super().__init__(num_layers)
        shape = (num_layers, num_heads)
        self.xtx = np.zeros((*shape, 2, 2))
        self.xty = np.zeros((*shape, 2))
        self.yty = np.zeros(shape)  # Σ y'² (y' = y − α² A_seq)
        self.ysum = np.zeros(shape)  # Σ y  (for the R² of y itself)
        self.ysq = np.zeros(shape)  # Σ y²
        self.n = np.zeros(shape)
        self.v0_sum = np.zeros(shape)
        self.v0_count = np.zeros(shape)
        self.points = [
            [
                Reservoir(("alpha", "norm2"), points_per_head, seed=97 * i + h)
                for h in range(num_heads)
            ]
            for i in range(num_layers)
        ]

    def observe(self, view: BlockView) -> None:
        layer = view.layer
        v0 = view.value_norm[:, 0].double().square()  # (H,)
        if view.first_block:
            self.v0_sum[layer] += v0.numpy()
            self.v0_count[layer] += 1
        a = view.alpha[:, :, 0].double()  # (H, I)
        y = view.lt.head_output_norm2[0].double()  # (H, I)
        y_res = y - a.square() * v0[:, None]
        x = torch.stack([2 * a * (1 - a), (1 - a).square()], dim=-1)  # (H, I, 2)
        self.xtx[layer] += torch.einsum("hik,hil->hkl", x, x).numpy()
        self.xty[layer] += torch.einsum("hik,hi->hk", x, y_res).numpy()
        self.yty[layer] += y_res.square().sum(-1).numpy()
        self.ysum[layer] += y.sum(-1).numpy()
        self.ysq[layer] += y.square().sum(-1).numpy()
        self.n[layer] += a.shape[1]
        for h, res in enumerate(self.points[layer]):
            res.add([a[h].float(), y[h].float()])

    def begin(self, num_tokens: int, unit: int = 0) -> None:
        for i, row in enumerate(self.points):
            for h, res in enumerate(row):
                res.reseed(97 * i + h, unit)

    def merge(self, state: dict[str, Any]) -> None:
        super().merge(state)
        for key in ("xtx", "xty", "yty", "ysum", "ysq", "n", "v0_sum", "v0_count"):
            setattr(self, key, getattr(self, key) + state[key])
        for row, row_state in zip(self.points, state["points"], strict=True):
            for res, res_state in zip(row, row_state, strict=True):
                res.merge(res_state)

    def fit(self) -> list[dict[str, Any]]:
        """One row per head: γ', κ'², A, the curve's q, α_min, convexity, R² of ‖o‖²."""
        rows = []
        for layer in range(self.xtx.shape[0]):
            for head in range(self.xtx.shape[1]):
                n = self.n[layer, head]
                if n < 3:
                    continue
                coef = np.linalg.lstsq(self.xtx[layer, head], self.xty[layer, head], rcond=None)[0]
                gamma, kappa2 = (float(c) for c in coef)
                a_mean = self.v0_sum[layer, head] / max(self.v0_count[layer, head], 1)
                q = a_mean - 2 * gamma + kappa2
                alpha_min = (kappa2 - gamma) / q if q != 0 else float("nan")
                sse = self.yty[layer, head] - 2 * coef @ self.xty[layer, head]
                sse += coef @ self.xtx[layer, head] @ coef
                sst = self.ysq[layer, head] - self.ysum[layer, head] ** 2 / n
                rows.append(
                    {
                        "layer": layer,
                        "head": head,
                        "gamma_prime": gamma,
                        "kappa2": kappa2,
                        "v0_norm2": float(a_mean),
                        "q": float(q),
                        "alpha_min": float(alpha_min),
                        "convex": bool(q > 0),
                        "convex_min_below_1": bool(q > 0 and 0 < alpha_min < 1),
                        "r2": float(1 - sse / sst) if sst > 0 else float("nan"),
                        "n": int(n),
                    }
                )
        return rows

    def state_dict(self) -> dict[str, Any]:
        state = {k: v for k, v in vars(self).items() if k != "points"}
        state["points"] = [[r.state_dict() for r in row] for row in self.points]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if key != "points":
                setattr(self, key, value)
        for row, row_state in zip(self.points, state["points"], strict=True):
            for res, res_state in zip(row, row_state, strict=True):
                res.load_state_dict(res_state)


@dataclass
class ConeGeometry:
    """Per head ``(H, …)``: μ̂, û, the sink's (a, b), cos of the 90% cone angle."""

    mu: Tensor  # (H, d)
    u: Tensor  # (H, d)
    sink: Tensor  # (H, 2): a, b
    cos_cone: Tensor  # (H,)


def cone_geometry(projected: Tensor, coverage: float = 0.9) -> ConeGeometry:
    """Semantic direction, its orthogonal complement through the sink, and the cone."""
    sink, tail = projected[:, 0], projected[:, 1:]
    mean = tail.mean(1)
    mu = mean / mean.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    a = (sink * mu).sum(-1)
    resid = sink - a[:, None] * mu
    b = resid.norm(dim=-1)
    # where the sink lies on the μ̂ axis, û is taken from the tail's spread instead
    tail_resid = tail - (tail @ mu[:, :, None]) * mu[:, None]
    fallback = tail_resid[torch.arange(tail.shape[0]), tail_resid.norm(dim=-1).argmax(-1)]
    scale_ok = b > 1e-6 * sink.norm(dim=-1).clamp_min(1e-30)
    u = torch.where(scale_ok[:, None], resid, fallback)
    u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    tail_norm = tail.norm(dim=-1)
    cos = (tail @ mu[:, :, None]).squeeze(-1) / tail_norm.clamp_min(1e-30)
    cos = torch.where(tail_norm > 0, cos, torch.full_like(cos, float("nan")))  # no direction
    cos_cone = torch.nanquantile(cos.double(), 1 - coverage, dim=-1).to(cos.dtype)
    return ConeGeometry(mu, u, torch.stack([a, b], -1), cos_cone)


class SemanticCone(Stat):
    """Fractions of (low-norm) head outputs inside the 90% cone, with and without the sink."""

    COUNTS = (
        "low",
        "low_inside_with_sink",
        "low_inside_without_sink",
        "all",
        "all_inside_with_sink",
        "all_inside_without_sink",
    )

    def __init__(
        self, num_layers: int, num_heads: int, low_quantile: float = 0.25, coverage: float = 0.9
    ) -> None:
        super().__init__(num_layers)
        self.low_quantile = low_quantile
        self.coverage = coverage
        self.counts = np.zeros((num_layers, len(self.COUNTS)))
        self.snapshot: dict[str, Tensor] = {}  # projections of the first sequence
        self._buf: dict[int, Tensor] = {}
        self._t = 0
        self._unit = 0

    def begin(self, num_tokens: int, unit: int = 0) -> None:
        self._buf = {}
        self._t = num_tokens
        self._unit = unit

    def merge(self, state: dict[str, Any]) -> None:
        super().merge(state)
        self.counts = self.counts + state["counts"]
        if state["snapshot"] and not self.snapshot:  # the first sequence's, wherever it ran
            self.snapshot = dict(state["snapshot"])

    def observe(self, view: BlockView) -> None:
        if self._t < 3:
            return
        if view.first_block:
            view.scratch["cone"] = cone_geometry(view.projected_values, self.coverage)
            h = view.alpha.shape[0]
            self._buf[view.layer] = torch.zeros(3, h, self._t)
        geo: ConeGeometry = view.scratch["cone"]
        out = view.lt.head_outputs[0]  # (H, I, d)
        v0 = view.projected_values[:, 0]
        no_sink = out - view.alpha[:, :, 0, None] * v0[:, None, :]
        buf = self._buf[view.layer]
        for k, o in ((1, out), (2, no_sink)):
            norm = o.norm(dim=-1)
            cos = (o @ geo.mu[:, :, None]).squeeze(-1) / norm.clamp_min(1e-30)
            buf[k, :, view.rows] = ((cos >= geo.cos_cone[:, None]) & (norm > 0)).float()
            if k == 1:
                buf[0, :, view.rows] = norm
        if self._unit == 0:  # the snapshot is of the run's first sequence
            self._snap(view, geo, out, no_sink)

    def _snap(self, view: BlockView, geo: ConeGeometry, out: Tensor, no_sink: Tensor) -> None:
        basis = torch.stack([geo.mu, geo.u], dim=-1)  # (H, d, 2)
        h, t = view.alpha.shape[0], self._t
        snap = self.snapshot
        if view.layer == 0 and view.first_block:
            snap.clear()
        if f"with_{view.layer}" not in snap:
            snap[f"with_{view.layer}"] = torch.zeros(h, t, 2)
            snap[f"without_{view.layer}"] = torch.zeros(h, t, 2)
            snap[f"sink_{view.layer}"] = geo.sink.float().cpu()
            snap[f"cos_cone_{view.layer}"] = geo.cos_cone.float().cpu()
            snap[f"sink_rate_{view.layer}"] = torch.zeros(h)
        snap[f"with_{view.layer}"][:, view.rows] = (out @ basis).float().cpu()
        snap[f"without_{view.layer}"][:, view.rows] = (no_sink @ basis).float().cpu()
        snap[f"sink_rate_{view.layer}"] += view.alpha[:, :, 0].sum(-1).float().cpu() / t

    def end(self) -> None:
        for layer, buf in self._buf.items():
            norm, with_sink, without = buf[0, :, 1:], buf[1, :, 1:], buf[2, :, 1:]
            thr = torch.quantile(norm.double(), self.low_quantile, dim=-1, keepdim=True)
            low = (norm.double() <= thr).float()
            self.counts[layer] += [
                float(low.sum()),
                float((low * with_sink).sum()),
                float((low * without).sum()),
                float(norm.numel()),
                float(with_sink.sum()),
                float(without.sum()),
            ]
        self._buf = {}
        super().end()

    def fractions(self) -> np.ndarray:
        """``(L, 4)``: low-norm inside with / without sink, all inside with / without."""
        c = self.counts
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.stack(
                [c[:, 1] / c[:, 0], c[:, 2] / c[:, 0], c[:, 4] / c[:, 3], c[:, 5] / c[:, 3]], 1
            )


def sink_scaling_nll(
    model: LoadedModel,
    ids: Tensor,
    gammas: Sequence[float],
    layers: Sequence[int],
    *,
    batch_size: int | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> list[float]:
    """Mean NLL of one sequence for each γ (v_0 scaled by γ in ``layers``).

    One batch row per γ, run by :func:`~..interventions.intervened_logprobs` (chunked to fit
    ``memory_bytes`` unless ``batch_size`` is given, halved on out-of-memory).
    """
    if ids.numel() < 2:
        raise ValueError("perplexity needs at least 2 tokens; pass a longer text")
    sink_layers = frozenset(int(x) for x in layers)
    gamma_rows = torch.tensor([float(g) for g in gammas], dtype=torch.float32)
    logprobs = intervened_logprobs(
        model,
        ids.reshape(-1)[None].expand(len(gamma_rows), -1),
        lambda rows: nullcontext(SinkValueScale(sink_layers, gamma_rows[rows])),
        batch_size=batch_size,
        memory_bytes=memory_bytes,
    )
    return [float(x) for x in mean_nll(logprobs)]


def detect_sink_layers(sink_rate: np.ndarray, threshold: float = 0.5) -> list[int]:
    """Layers whose mean α_i0 exceeds ``threshold`` (NaN rates never qualify)."""
    return [int(i) for i, rate in enumerate(sink_rate) if not math.isnan(rate) and rate > threshold]
