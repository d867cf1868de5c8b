"""Where a parameter lives across the mesh — one record per parameter, in the spirit of DTensor's placements.

    Placement()                       whole on every rank: a replica (norm gains, row-parallel biases, positions)
    Placement(tp=Split(dim, blocks))  tensor parallel: dimension ``dim`` of the full tensor is a concatenation of
                                      blocks (q | k | v, gate | up, or just one), block b being n_b units of u_b
                                      elements; rank r of tp keeps units [r·n_b/tp, (r+1)·n_b/tp) of every block —
                                      or, when n_b < tp (a Llama's K/V heads on more ranks than there are), the
                                      one unit r·n_b // tp, which tp/n_b ranks then share
    Split(0, ((V, 1),), pad=True)     a vocabulary table: rows split in ⌈V/tp⌉ per rank, the last padded with 0
    Placement(experts=True)           dimension 0 indexes the experts of a MoE layer, split over ep

``tp_size`` and ``ep_size`` are the degrees the parameter is placed over (1: that axis does not split the model).
Everything that depends on where a parameter lives reads this record: the global gradient norm (each element
counted once over all ranks: :attr:`Placement.norm_weight`), data parallelism and ZeRO (experts reduce over their
own replicas), checkpoints (:meth:`Split.local` / :meth:`Split.merge`) and the Hugging Face export that gathers
the whole tensors.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Split:
    dim: int
    blocks: tuple[tuple[int, int], ...]  # (units, elements per unit) of each block along ``dim``
    pad: bool = False  # one block of single rows, split ⌈n/tp⌉ per rank, zero-padded (vocabulary tables)

    def _units(self, n: int, tp: int, rank: int) -> slice:
        start = rank * n // tp
        return slice(start, start + max(1, n // tp))

    def local(self, full: np.ndarray, tp: int, rank: int) -> np.ndarray:
        """Rank ``rank``'s piece of the full tensor (a new, contiguous array that owns its memory: a view would
        keep the whole tensor alive)."""
        x = np.moveaxis(full, self.dim, 0)
        if self.pad:
            per_rank = -(-x.shape[0] // tp)
            piece = np.zeros((per_rank, *x.shape[1:]), full.dtype)
            rows = x[rank * per_rank:(rank + 1) * per_rank]
            piece[:len(rows)] = rows
        else:
            pieces, offset = [], 0
            for n, u in self.blocks:
                block = x[offset:offset + n * u].reshape(n, u, *x.shape[1:])
                pieces.append(block[self._units(n, tp, rank)].reshape(-1, *x.shape[1:]))
                offset += n * u
            piece = np.concatenate(pieces)
        return np.array(np.moveaxis(piece, 0, self.dim), order="C")

    def merge(self, pieces: list[np.ndarray]) -> np.ndarray:
        """The full tensor from every rank's piece, in rank order (a shared unit from the first rank holding it)."""
        tp, xs = len(pieces), [np.moveaxis(p, self.dim, 0) for p in pieces]
        if self.pad:
            whole = np.concatenate(xs)[:self.blocks[0][0]]
        else:
            blocks, offsets = [], [0] * tp
            for n, u in self.blocks:
                width = max(1, n // tp) * u
                owners = [r for r in range(tp) if r == 0 or self._units(n, tp, r) != self._units(n, tp, r - 1)]
                blocks += [xs[r][offsets[r]:offsets[r] + width] for r in owners]
                offsets = [o + width for o in offsets]
            whole = np.concatenate(blocks)
        return np.array(np.moveaxis(whole, 0, self.dim), order="C")

    def copies(self, tp: int) -> np.ndarray:
        """How many ranks hold each element of a rank's piece along ``dim`` (1, or tp/n for a shared unit)."""
        if self.pad:
            return np.ones(1)
        return np.concatenate([np.full(max(1, n // tp) * u, max(1, tp // n)) for n, u in self.blocks])


@dataclass(frozen=True)
class Placement:
    tp: Split | None = None  # None: whole on every tp rank
    experts: bool = False    # dimension 0 indexes experts (split over ep when ep_size > 1)
    tp_size: int = 1
    ep_size: int = 1

    def placed(self, **degrees: Any) -> Placement:
        return dataclasses.replace(self, **degrees)

    def norm_weight(self, ndim: int) -> Any:
        """The weight of this rank's squared gradient entries in the global norm, so that the sum over all ranks
        counts every element of the full gradient once: 1/tp for a tp replica, 1/copies for a shared unit, 1/ep
        for what the ep ranks all hold (everything but the experts). A scalar, or an array that broadcasts
        against the parameter (``ndim`` dimensions) along its split dimension."""
        weight: Any = 1.0 / (1 if self.experts else self.ep_size)
        if self.tp is None:
            return weight / self.tp_size
        copies = self.tp.copies(self.tp_size)
        if (copies == 1).all():
            return weight
        shape = [1] * ndim
        shape[self.tp.dim] = len(copies)
        return weight / copies.reshape(shape)


REPLICATED = Placement()
