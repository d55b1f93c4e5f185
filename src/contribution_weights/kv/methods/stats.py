"""What one attention layer showed during a prefill: :class:`LayerStats`, the input of
every KV-cache method, and the names of the statistics a prefill can gather.
"""

# ruff: noqa: F722  (jaxtyping shape strings are not forward references)

from __future__ import annotations

from dataclasses import dataclass, field

from jaxtyping import Float
from torch import Tensor

from ...defaults import KV_WINDOW

WINDOW = KV_WINDOW  # defaults.py: light, the CLI shows it

Scores = Float[Tensor, "b g t"]


#: what a prefill can gather for the methods (each a field of :class:`LayerStats`); the
#: cached keys and values are always there
STATISTICS = (
    "attn_sum",
    "window_probs",
    "window_contribution",
    "projected_value_norm",
    "window_queries",
    "window_renormalised",
)


@dataclass
class LayerStats:
    """What one attention layer showed during a prefill of ``T`` tokens (see :mod:`..scoring`).

    Attributes:
        keys: ``(B, G, T, d_h)`` cached keys (after RoPE), values ``(B, G, T, d_h)``.
        attn_sum: ``(B, H, T)`` Σ_i α_ij over every prefill query.
        window_probs: ``(B, H, w, T)`` α of the last ``w`` queries (the observation window).
        window_contribution: ``(B, H, T)`` Σ_i |ĉ_ij^(h)| over the last ``w`` queries.
        projected_value_norm: ``(B, H, T)`` ‖W_O^(h) v_j‖.
        window_queries: ``(B, H, w, d_h)`` the last ``w`` queries as the attention saw them
            (after RoPE and any query norm), with ``scaling`` the attention's scale (their
            logits are ``scaling · q_i · k_j``).
        window_renormalised: ``(B, H, T)`` Σ_i ‖Δo_ij^(h)‖ over the last ``w`` queries, the
            exact change of head h's projected output for query i when key j is evicted
            (:func:`~..renormalised.renormalised_effect`).
        seed: for ``random``.
        contribution_by_window: Σ_i |ĉ_ij^(h)| over the last ``n`` queries, for the windows
            ``n`` of methods whose own window is shorter than the observation window.
        renormalised_by_window: Σ_i ‖Δo_ij^(h)‖ over the last ``n`` queries, likewise.

    A statistic no chosen method needs is None (:func:`~..scoring.prefill` skips it).
    """

    keys: Float[Tensor, "b g t dh"]
    values: Float[Tensor, "b g t dh"]
    attn_sum: Float[Tensor, "b h t"] | None = None
    window_probs: Float[Tensor, "b h w t"] | None = None
    window_contribution: Float[Tensor, "b h t"] | None = None
    projected_value_norm: Float[Tensor, "b h t"] | None = None
    window_queries: Float[Tensor, "b h w dh"] | None = None
    window_renormalised: Float[Tensor, "b h t"] | None = None
    scaling: float = 1.0
    seed: int = 0
    window: int = WINDOW
    contribution_by_window: dict[int, Tensor] = field(default_factory=dict)
    renormalised_by_window: dict[int, Tensor] = field(default_factory=dict)

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def per_kv_head(self, x: Float[Tensor, "b h t"], reduce: str = "mean") -> Scores:
        """``(B, H, T)`` → ``(B, G, T)`` over the query heads of each KV group."""
        b, h, t = x.shape
        grouped = x.reshape(b, self.num_kv_heads, h // self.num_kv_heads, t)
        return grouped.sum(2) if reduce == "sum" else grouped.mean(2)

    def need(self, name: str) -> Tensor:
        """A statistic, or a clear error when the prefill did not gather it."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(
                f"the prefill did not gather {name}; prefill with the methods you will "
                "compress by (cw.kv.prefill(model, ids, methods=[...]))"
            )
        return value

    def probs_of_window(self, window: int | None) -> Tensor:
        """``(B, H, w, T)``: α of the last ``window`` queries (None: the whole window)."""
        probs = self.need("window_probs")
        w = self._window(window)
        return probs[:, :, probs.shape[2] - w :]

    def contribution_of_window(self, window: int | None) -> Tensor:
        """``(B, H, T)``: Σ |ĉ| over the last ``window`` queries (None: the whole window)."""
        return self._sum_of_window(
            "window_contribution", self.contribution_by_window, window, "contribution"
        )

    def renormalised_of_window(self, window: int | None) -> Tensor:
        """``(B, H, T)``: Σ ‖Δo‖ over the last ``window`` queries (None: the whole window)."""
        return self._sum_of_window(
            "window_renormalised", self.renormalised_by_window, window, "renormalised effect"
        )

    def _sum_of_window(
        self, name: str, by_window: dict[int, Tensor], window: int | None, what: str
    ) -> Tensor:
        """A window sum: the statistic ``name`` for the whole window, else ``by_window``."""
        w = self._window(window)
        if w == self.window_size:
            return self.need(name)
        if w not in by_window:
            raise ValueError(
                f"the prefill gathered no {what} over the last {w} queries; prefill "
                "with the methods you will compress by (cw.kv.prefill(model, ids, methods=[...]))"
            )
        return by_window[w]

    def queries_of_window(self, window: int | None) -> Tensor:
        """``(B, H, w, d_h)``: the last ``window`` queries (None: the whole window)."""
        queries = self.need("window_queries")
        w = self._window(window)
        return queries[:, :, queries.shape[2] - w :]

    @property
    def window_size(self) -> int:
        """Queries in the observation window (fewer than ``window`` for a short prefill)."""
        return min(self.window, self.length)

    def _window(self, window: int | None) -> int:
        if window is None:
            return self.window_size
        if window > self.window:
            raise ValueError(
                f"a method's window of {window} queries exceeds the prefill's observation "
                f"window of {self.window}; prefill with window={window} or more"
            )
        return min(window, self.length)
