"""Placements (minipar/placement.py): each parameter's one record of where it lives. Splitting and merging are
inverse for every block structure minipar uses (q|k|v with grouped or shared K/V heads, gate|up, padded
vocabulary rows), rank r's piece is the units an independent index computation gives, and the norm weights
count every element of the full gradient exactly once over all ranks."""
import dataclasses

import numpy as np
import pytest

from minipar.placement import Placement, Split

rng = np.random.default_rng(0)

SPLITS = [("q|k|v, K = H", Split(-1, ((4, 3), (4, 3), (4, 3)))),
          ("q|k|v, K < H", Split(-1, ((8, 2), (2, 2), (2, 2)))),
          ("q|k|v, K = 1", Split(-1, ((4, 2), (1, 2), (1, 2)))),  # one K/V head: shared by every tp rank
          ("gate|up", Split(-1, ((12, 1), (12, 1)))),
          ("rows of heads", Split(0, ((4, 3),))),
          ("vocabulary", Split(0, ((10, 1),), pad=True))]


def units_of(split, tp, rank):
    """Rank ``rank``'s element indices along the split dimension, computed one unit at a time."""
    if split.pad:
        per_rank = -(-split.blocks[0][0] // tp)
        return [i for i in range(rank * per_rank, (rank + 1) * per_rank)]  # indices past the end are the padding
    indices, offset = [], 0
    for n, u in split.blocks:
        mine = range(rank * n // tp, (rank + 1) * n // tp) if n >= tp else [rank * n // tp]
        indices += [offset + unit * u + e for unit in mine for e in range(u)]
        offset += n * u
    return indices


@pytest.mark.parametrize("name,split", SPLITS, ids=[s[0] for s in SPLITS])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_local_is_the_ranks_units_and_merge_inverts_it(name, split, tp):
    size = sum(n * u for n, u in split.blocks)
    full = rng.standard_normal((5, size) if split.dim == -1 else (size, 5))
    pieces = [split.local(full, tp, r) for r in range(tp)]
    for r, piece in enumerate(pieces):
        idx = units_of(split, tp, r)
        expected = np.take(np.concatenate([full, np.zeros_like(full)], axis=split.dim), idx, axis=split.dim)
        np.testing.assert_array_equal(piece, expected)
    np.testing.assert_array_equal(split.merge(pieces), full)


@pytest.mark.parametrize("name,split", SPLITS, ids=[s[0] for s in SPLITS])
@pytest.mark.parametrize("tp,ep,experts", [(1, 1, False), (2, 1, False), (4, 1, False), (4, 2, False), (2, 2, True)])
def test_norm_weights_count_every_element_once(name, split, tp, ep, experts):
    """Σ over all (tp, ep) ranks of Σ weight·g² of the rank's piece = Σ g² of the full gradient — for a split
    parameter (shared K/V units counted 1/copies), its replicated twin (1/tp) and the ep replicas (1/ep)."""
    size = sum(n * u for n, u in split.blocks)
    full = rng.standard_normal((size, 3) if split.dim == 0 else (3, size))
    if experts:  # dimension 0 indexes 2·ep experts; an expert tensor is whole on every tp rank
        full = rng.standard_normal((2 * ep, 3, size))
    total, whole = 0.0, 0.0
    candidates = [Placement(experts=experts, tp_size=tp, ep_size=ep)]
    for placement in candidates + ([] if experts else [Placement(tp=split, tp_size=tp, ep_size=ep)]):
        for e in range(ep):
            mine = np.array_split(full, ep)[e] if experts else full
            for r in range(tp):
                piece = placement.tp.local(mine, tp, r) if placement.tp else mine
                total += float((placement.norm_weight(piece.ndim) * piece ** 2).sum())
        whole += float((full ** 2).sum())
    assert total == pytest.approx(whole, rel=1e-12)


def test_a_placement_is_a_value():
    """Parameters share placement objects (every expert tensor holds moe.EXPERTS; ``placed`` makes new ones):
    changing one in place would move every parameter that shares it, so it cannot be changed."""
    placement = Placement(tp=SPLITS[0][1], tp_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        placement.tp_size = 4
    assert hash(placement) == hash(Placement(tp=SPLITS[0][1], tp_size=2))
