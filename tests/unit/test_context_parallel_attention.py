"""Context-parallel attention on gloo ranks against one process's attention over the whole
sequence: outputs and the gradients of q, k and v (float32, within 1e-5), for both rotate methods,
causal and within packed documents, on 2 and 4 ranks; the ring also with its queries in slices."""

import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallelisms import context_parallel
from parallelisms.context_parallel import (
    context_parallel_attention,
    document_ids,
    head_tail_positions,
    shard_sequence,
)
from tests.spawn import check_on_gloo_ranks

BATCH, HEADS, SEQ, HEAD_DIM = 2, 3, 32, 8
TOLERANCE = 1e-5


def test_head_tail_positions():
    """Rank r holds chunks r and 2 cp - 1 - r: every rank the same share of a causal mask's work."""
    assert head_tail_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert head_tail_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert head_tail_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    every = torch.cat([head_tail_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    tokens = torch.arange(32).reshape(2, 16)
    assert shard_sequence(tokens, 2, 1).tolist() == [list(range(4, 12)), list(range(20, 28))]
    with pytest.raises(ValueError, match="seq_len 12 does not split into 2 x cp_degree 4"):
        head_tail_positions(12, 4, 0)


def _document_positions(generator: torch.Generator) -> torch.Tensor:
    """Each token's position in its packed document [BATCH, SEQ]; the first document began before the window."""
    rows = []
    for _ in range(BATCH):
        begins = np.full(SEQ, -5)
        starts = torch.randperm(SEQ - 1, generator=generator)[:4] + 1
        begins[starts.numpy()] = starts.numpy()
        rows.append(torch.from_numpy(np.arange(SEQ) - np.maximum.accumulate(begins)))
    return torch.stack(rows)


def _reference(q, k, v, positions):
    """One process: causal SDPA, or causal within each document (a document starts at position 0)."""
    if positions is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    documents = (positions == 0).cumsum(dim=1)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    mask = (documents[:, :, None] == documents[:, None, :]) & causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


def _check(rank: int, world_size: int, scores_per_slice: int | None = None) -> None:
    if scores_per_slice is not None:  # the ring's slices of queries: 5, 5, 5 and 1 of 16 on 2 ranks
        context_parallel.SCORES_PER_SLICE = scores_per_slice
    generator = torch.Generator().manual_seed(0)
    shape = (BATCH, HEADS, SEQ, HEAD_DIM)
    full = [torch.randn(shape, generator=generator, requires_grad=True) for _ in range(3)]
    grad_out = torch.randn(shape, generator=generator)
    masked = _document_positions(generator)
    mine = head_tail_positions(SEQ, world_size, rank)
    for positions in (None, masked):
        reference = _reference(*full, positions)
        expected_grads = torch.autograd.grad(reference, full, grad_out)
        documents = None if positions is None else document_ids(mine, shard_sequence(positions, world_size, rank))
        for method in ("allgather", "alltoall"):
            local = [x.detach()[:, :, mine].clone().requires_grad_() for x in full]
            out = context_parallel_attention(*local, mine, dist.group.WORLD, method, documents)
            grads = torch.autograd.grad(out, local, grad_out[:, :, mine])
            what = f"{method}, {'documents' if positions is not None else 'causal'}, rank {rank} of {world_size}"
            torch.testing.assert_close(out, reference.detach()[:, :, mine], rtol=0, atol=TOLERANCE, msg=what)
            for name, got, expected in zip("qkv", grads, expected_grads):
                torch.testing.assert_close(
                    got, expected[:, :, mine], rtol=0, atol=TOLERANCE, msg=lambda m, n=name, w=what: f"d{n} {w}: {m}"
                )


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_matches_one_process(world_size):
    check_on_gloo_ranks(functools.partial(_check, world_size=world_size), world_size, timeout_s=120)


def test_ring_in_slices_of_queries_matches_one_process():
    rows = 5
    check = functools.partial(_check, world_size=2, scores_per_slice=rows * BATCH * HEADS * SEQ // 2)
    check_on_gloo_ranks(check, 2, timeout_s=120)
