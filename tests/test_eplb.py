"""EPLB: replica choice per token, load counters, rebalancing, moving the experts.

The distributed move (send / recv between ranks) runs in tests/test_ep.py (the *_eplb cases
rebalance between two rounds of calls on 2 and 4 gloo ranks).
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe import FusedMoE, ParallelConfig
from fusedmoe.parallel.eplb import (
    apply_placement,
    imbalance,
    map_to_physical,
    map_to_physical_ref,
    rank_loads,
    rebalance,
    rebalance_layer,
    record_expert_load,
)
from fusedmoe.parallel.placement import expert_placement
from tests.helpers import assert_close, assert_equal

E, H, I, TOP_K = 8, 128, 128, 3


@pytest.mark.parametrize(("num_experts", "redundant", "ep_size"), [(8, 0, 2), (8, 5, 3), (5, 7, 4)])
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_map_to_physical_matches_its_twin(num_experts, redundant, ep_size, placement):
    layout = expert_placement(num_experts, ep_size, placement, redundant)
    ids = torch.randint(0, num_experts, (37, 4), dtype=torch.int32)
    ids[::5, 1] = -1  # empty slots stay empty
    table, counts = layout.replica_table()
    physical = map_to_physical(ids, table, counts)
    assert physical.dtype == ids.dtype
    assert_equal(physical, map_to_physical_ref(ids, layout), what="physical ids")
    logical = torch.tensor(layout.physical_to_logical)[physical.long().clamp(min=0)]
    assert_equal(torch.where(ids >= 0, logical, -1), ids, what="a replica of the same expert")


def test_map_to_physical_spreads_a_hot_expert_over_its_replicas():
    layout = expert_placement(4, 2, "linear", num_redundant_experts=2)  # 0, 1: two replicas
    ids = torch.zeros(10, 1, dtype=torch.int32)
    physical = map_to_physical(ids, *layout.replica_table())
    assert physical.flatten().tolist() == [0, 4] * 5


def test_record_expert_load():
    load = torch.zeros(E, dtype=torch.int64)
    ids = torch.randint(-1, E + 2, (50, TOP_K), dtype=torch.int32)  # -1 and zero experts >= E
    record_expert_load(load, ids)
    record_expert_load(load, ids[:0])
    valid = ids[(ids >= 0) & (ids < E)].long()
    assert_equal(load, torch.bincount(valid, minlength=E), what="load")


LOADS = [
    [100, 1, 1, 1, 1, 1, 1, 1],  # one hot expert
    [5, 9, 0, 0, 30, 2, 2, 8],
    [0] * 8,  # nothing counted yet
    [3] * 8,
]


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize(("num_physical", "ep_size"), [(8, 2), (10, 2), (12, 4), (11, 3), (9, 1)])
def test_rebalance_proposes_a_valid_placement(load, num_physical, ep_size):
    placement = rebalance(torch.tensor(load), num_physical, ep_size)
    assert placement.num_physical == num_physical and placement.ep_size == ep_size
    base, extra = divmod(num_physical, ep_size)
    assert [placement.num_local(r) for r in range(ep_size)] == [
        base + (1 if r < extra else 0) for r in range(ep_size)
    ]
    assert placement == rebalance(load, num_physical, ep_size)  # deterministic
    initial = expert_placement(E, ep_size, "linear", num_physical - E)
    assert imbalance(load, placement) <= imbalance(load, initial) + 1e-9
    assert sum(rank_loads(load, placement)) == pytest.approx(sum(load))
    if load == LOADS[0] and ep_size > 1:  # the hot expert: one replica per rank, as it can
        assert placement.physical_to_logical.count(0) == min(ep_size, num_physical - E + 1)


def test_rebalance_validation():
    with pytest.raises(ValueError, match=r"num_physical \(4\) must be >= len\(load\) \(8\)"):
        rebalance([1] * 8, 4, 2)
    with pytest.raises(ValueError, match="ep_size must be in"):
        rebalance([1] * 8, 8, 9)
    with pytest.raises(ValueError, match="non-negative"):
        rebalance([1, -1], 2, 1)
    with pytest.raises(ValueError, match=r"load must be \[E\]"):
        rebalance(torch.ones(2, 2), 4, 1)
    with pytest.raises(TypeError, match="num_physical must be an int"):
        rebalance([1, 1], 2.0, 1)


def _layer(scheme=None, **pc) -> FusedMoE:
    layer = FusedMoE(
        E,
        TOP_K,
        H,
        I,
        params_dtype=torch.float32,
        backend="torch",
        parallel_config=ParallelConfig(**pc),
    )
    return layer


@pytest.mark.parametrize("scheme", [None, "fp8_block"])
def test_replicas_and_moves_keep_the_output(scheme):
    full = _layer()
    checkpoint = [
        ("experts.gate_up_proj", full.w13_weight.detach()),
        ("experts.down_proj", full.w2_weight.detach()),
    ]
    replicated = _layer(num_redundant_experts=3)
    replicated.load_weights(checkpoint)
    if scheme:
        full.quantize_(scheme)
        replicated.quantize_(scheme)
    assert replicated.record_expert_load and not full.record_expert_load
    x, logits = torch.randn(29, H), torch.randn(29, E)
    logits[:, 2] += 3.0  # expert 2 is hot
    with torch.no_grad():
        expected = full(x, logits)
        assert_close(replicated(x, logits), expected, torch.float32, what="initial replicas")
        load = replicated.expert_load.clone()
        assert int(load.sum()) == 29 * TOP_K and int(load.argmax()) == 2
        placement = rebalance_layer(replicated)
        assert placement.physical_to_logical.count(2) > 1  # the hot expert is replicated
        assert int(replicated.expert_load.sum()) == 0  # counters restart
        assert replicated.w13_weight.shape[0] == placement.num_local(0)
        assert_close(replicated(x, logits), expected, torch.float32, what="after the move")


def test_apply_placement_validation():
    layer = _layer(num_redundant_experts=2)
    with pytest.raises(TypeError, match="placement must be an ExpertPlacement"):
        apply_placement(layer, [0, 1])
    with pytest.raises(ValueError, match="has 11 physical experts, the layer 10"):
        apply_placement(layer, expert_placement(E, 1, "linear", 3))
    with pytest.raises(ValueError, match="for 7 experts over 1 ranks"):
        apply_placement(layer, expert_placement(7, 1, "linear", 3))
