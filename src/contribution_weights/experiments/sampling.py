"""Reservoir sampling and running moments: statistics that accumulate across sequences
in bounded memory.

Every accumulator here takes data in batches of any size, gives the same answer as if
all the data had come at once, and exposes ``state_dict()`` / ``load_state_dict()`` so
that a long run can persist it after each sequence and resume later.

* :class:`Reservoir`: a uniform sample without replacement of at most ``cap`` rows from
  a stream (priority sampling: each row gets an independent uniform key and the ``cap``
  rows with the smallest keys are kept, which is a uniform sample of the rows seen).
* :class:`Moments`: count, means and the co-moment matrix of a stream of vectors,
  merged batch by batch with Chan et al.'s pairwise update (numerically stable), from
  which Pearson correlations follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor


class Reservoir:
    """A uniform sample of at most ``cap`` rows of ``len(columns)`` float32 numbers."""

    def __init__(self, columns: Sequence[str], cap: int, seed: int = 0) -> None:
        if cap < 1:
            raise ValueError(f"the reservoir cap must be at least 1, not {cap}")
        self.columns = list(columns)
        self.cap = int(cap)
        self.seen = 0
        self.keys = torch.empty(0, dtype=torch.float64)
        self.rows = torch.empty(0, len(self.columns))
        self._gen = torch.Generator().manual_seed(seed)
        self._bound = 2.0  # keys at or above this can no longer enter the sample
        self._pending: list[tuple[Tensor, Tensor]] = []  # offers not merged yet
        self._pending_n = 0

    def __len__(self) -> int:
        self._prune()
        return int(self.keys.numel())

    def add(self, rows: Tensor | Sequence[Tensor]) -> None:
        """Offer rows ``(N, C)`` (or C column tensors of N values each)."""
        if isinstance(rows, Tensor):
            self.add_masked(None, list(rows.T))
        else:
            self.add_masked(None, list(rows))

    def add_masked(self, mask: Tensor | None, columns: Sequence[Tensor]) -> None:
        """Offer the entries of C same-shaped ``columns`` where ``mask`` is True (all if None).

        Only rows whose random key can still make the sample are gathered, so once the
        reservoir is full an offer costs little more than drawing the keys.
        """
        if mask is None:
            flat = None
            n = columns[0].numel() if columns else 0
        else:
            flat = mask.reshape(-1).nonzero().squeeze(1)
            n = flat.numel()
        if n == 0:
            return
        keys = torch.rand(n, generator=self._gen, dtype=torch.float64)  # ties ~never
        self.seen += n
        keep = (keys < self._threshold).nonzero().squeeze(1)
        if keep.numel() == 0:
            return
        idx = keep if flat is None else flat[keep.to(flat.device)]
        new = torch.stack(
            [c.reshape(-1)[idx.to(c.device)].detach().float().cpu() for c in columns], 1
        )
        self._pending.append((keys[keep], new))
        self._pending_n += int(keep.numel())
        if self.keys.numel() + self._pending_n > 2 * self.cap:
            self._prune()

    @property
    def _threshold(self) -> float:
        return self._bound if self.keys.numel() >= self.cap else 2.0

    def _prune(self) -> None:
        """Merge the pending offers and keep the ``cap`` smallest keys."""
        if self._pending:
            self.keys = torch.cat([self.keys, *(k for k, _ in self._pending)])
            self.rows = torch.cat([self.rows, *(r for _, r in self._pending)])
            self._pending, self._pending_n = [], 0
        if self.keys.numel() > self.cap:
            best = torch.topk(self.keys, self.cap, largest=False, sorted=False).indices
            self.keys, self.rows = self.keys[best], self.rows[best]
            self._bound = float(self.keys.max())

    def reseed(self, seed: int, unit: int) -> None:
        """Draw the next keys from a generator fixed by ``(seed, unit)``.

        Reseeded at the start of every sequence, each row's key depends only on its
        sequence and place in it, so reservoirs filled in any order or split over
        processes and then merged hold the same sample.
        """
        self._gen.manual_seed(int(np.random.SeedSequence([seed, unit]).generate_state(1)[0]))

    def merge(self, other: Reservoir | dict[str, Any]) -> None:
        """Fold in another reservoir (or its state) over disjoint rows: the ``cap`` smallest
        keys of the union, which is the sample one reservoir fed every row would hold."""
        state = other.state_dict() if isinstance(other, Reservoir) else other
        self._prune()
        self.seen += int(state["seen"])
        self.keys = torch.cat([self.keys, state["keys"]])
        self.rows = torch.cat([self.rows, state["rows"]])
        self._prune()
        if self.keys.numel() >= self.cap:
            self._bound = float(self.keys.max())

    def column(self, name: str) -> Tensor:
        self._prune()
        return self.rows[:, self.columns.index(name)]

    def to_numpy(self) -> dict[str, np.ndarray]:
        """The sampled columns in key order (random, and the same however rows arrived)."""
        self._prune()
        order = torch.argsort(self.keys)
        self.keys, self.rows = self.keys[order], self.rows[order]
        return {name: self.rows[:, k].numpy() for k, name in enumerate(self.columns)}

    def state_dict(self) -> dict[str, Any]:
        self._prune()
        return {
            "columns": self.columns,
            "cap": self.cap,
            "seen": self.seen,
            "keys": self.keys,
            "rows": self.rows,
            "generator": self._gen.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.columns = list(state["columns"])
        self.cap = int(state["cap"])
        self.seen = int(state["seen"])
        self.keys = state["keys"]
        self.rows = state["rows"]
        self._gen.set_state(state["generator"])
        self._bound = float(self.keys.max()) if self.keys.numel() >= self.cap else 2.0


class Moments:
    """Running count, mean and co-moment matrix of ``k``-dimensional observations."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        k = len(self.names)
        self.n = 0
        self.mean = np.zeros(k)
        self.comoment = np.zeros((k, k))

    def add(self, x: Tensor | np.ndarray) -> None:
        """Add observations ``(N, k)``."""
        data = x.detach().double().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x, float)
        nb = data.shape[0]
        if nb == 0:
            return
        mean_b = data.mean(0)
        centred = data - mean_b
        m2_b = centred.T @ centred
        n = self.n + nb
        delta = mean_b - self.mean
        self.comoment = self.comoment + m2_b + np.outer(delta, delta) * (self.n * nb / n)
        self.mean = self.mean + delta * (nb / n)
        self.n = n

    def correlation(self) -> np.ndarray:
        """Pearson correlation matrix (0 where a variable is constant)."""
        sd = np.sqrt(np.clip(np.diag(self.comoment), 0, None))
        den = np.outer(sd, sd)
        out = np.divide(self.comoment, den, out=np.zeros_like(den), where=den > 0)
        np.fill_diagonal(out, 1.0)
        return out

    def merge(self, state: dict[str, Any]) -> None:
        """Fold in another stream's moments (Chan et al.'s pairwise update)."""
        nb = int(state["n"])
        if nb == 0:
            return
        mean_b = np.asarray(state["mean"], float)
        n = self.n + nb
        delta = mean_b - self.mean
        self.comoment = (
            self.comoment
            + np.asarray(state["comoment"], float)
            + np.outer(delta, delta) * (self.n * nb / n)
        )
        self.mean = self.mean + delta * (nb / n)
        self.n = n

    def state_dict(self) -> dict[str, Any]:
        return {"names": self.names, "n": self.n, "mean": self.mean, "comoment": self.comoment}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.names = list(state["names"])
        self.n = int(state["n"])
        self.mean = np.asarray(state["mean"], float)
        self.comoment = np.asarray(state["comoment"], float)
