"""FSDP2's collectives as gloo runs them (parallelisms/fsdp2.py), against gloo's own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallelisms.fsdp2 import AllToAllReduceScatter, BroadcastAllGather
from tests.spawn import check_on_gloo_ranks

_WORLD_SIZE = 3  # more than 2: a slot swapped between two ranks would still pass on 2
_TIMEOUT_S = 120


def _check_collectives(rank: int) -> None:
    group = dist.group.WORLD
    torch.manual_seed(rank)
    shard = torch.randn(1000)
    expected = torch.empty(_WORLD_SIZE * shard.numel())
    dist.all_gather_into_tensor(expected, shard)

    # FSDP2 hands over its shard as a view of the output's own slot...
    output = torch.full_like(expected, float("nan"))
    own_slot = output.chunk(_WORLD_SIZE)[rank]
    own_slot.copy_(shard)
    assert BroadcastAllGather()(output, own_slot, group) is None
    assert torch.equal(output, expected)
    # ... or as a tensor of its own, which is copied in first.
    output = torch.full_like(expected, float("nan"))
    BroadcastAllGather()(output, shard.clone(), group)
    assert torch.equal(output, expected)
    # Asked for a Work to wait on (a pipeline schedule's prefetch): gloo's own all-gather.
    output = torch.full_like(expected, float("nan"))
    work = BroadcastAllGather()(output, shard, group, async_op=True)
    assert isinstance(work, dist.Work)
    work.wait()
    assert torch.equal(output, expected)

    gradients = torch.randn(_WORLD_SIZE * 1000)
    expected_part = torch.empty(1000)
    dist.reduce_scatter_tensor(expected_part, gradients)
    part = torch.empty(1000)
    AllToAllReduceScatter()(part, gradients, group, dist.ReduceOp.SUM)
    # Both sum 3 terms per element, in different orders: equal to fp32 rounding.
    torch.testing.assert_close(part, expected_part, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # spawns gloo ranks
def test_broadcast_all_gather_and_all_to_all_reduce_scatter_match_gloo() -> None:
    """The broadcast all-gather equals gloo's all-gather bitwise; the all-to-all reduce-scatter
    equals gloo's reduce-scatter to rounding, on 3 ranks."""
    check_on_gloo_ranks(_check_collectives, _WORLD_SIZE, timeout_s=_TIMEOUT_S)
