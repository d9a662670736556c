"""Context parallelism: the sequence of each batch is split over a group of ranks, and attention
crosses the split.

The sequence is cut into ``2 * cp_degree`` equal chunks; rank r holds chunks r and
``2 * cp_degree - 1 - r`` (head and tail), so that under a causal mask every rank has the same
share of query-key pairs. Attention takes each rank's local queries, keys and values with the
global positions of its tokens:

- ``allgather``: every rank gathers all keys and values, then attends with a boolean mask;
- ``alltoall``: keys and values travel round the ring (rank r sends to r + 1), one block per
  round, and each block's attention merges into the result with an online softmax, so no rank
  holds all keys at once.

Both are written with torch's functional collectives, which carry gradients, and SDPA or plain
matmuls, so they train on any device (torch's experimental context parallel does not train on
CPU: see docs/parallelisms.md).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_single_autograd, all_to_all_single_autograd

RotateMethod = Literal["allgather", "alltoall"]
# The ring's float32 scores of one slice of queries against one block of keys: 2**24 is 64 MiB.
SCORES_PER_SLICE = 2**24
ROTATE_METHODS = ("allgather", "alltoall")


def check_sequence(seq_len: int, cp_degree: int) -> None:
    """ValueError unless ``seq_len`` splits into ``2 * cp_degree`` equal chunks."""
    if cp_degree < 1 or seq_len % (2 * cp_degree):
        raise ValueError(f"seq_len {seq_len} does not split into 2 x cp_degree {cp_degree} equal chunks")


def _chunk_starts(chunk: int, cp_degree: int, cp_rank: int) -> tuple[int, int]:
    """Where the head and tail chunks of rank ``cp_rank`` begin in the sequence."""
    return cp_rank * chunk, (2 * cp_degree - 1 - cp_rank) * chunk


def head_tail_positions(seq_len: int, cp_degree: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global indices (int64, ascending) of the tokens rank ``cp_rank`` holds: chunks ``cp_rank``
    and ``2 * cp_degree - 1 - cp_rank`` of ``2 * cp_degree``."""
    check_sequence(seq_len, cp_degree)
    chunk = seq_len // (2 * cp_degree)
    return torch.cat(
        [torch.arange(start, start + chunk, device=device) for start in _chunk_starts(chunk, cp_degree, cp_rank)]
    )


def shard_sequence(tensor: torch.Tensor, cp_degree: int, cp_rank: int) -> torch.Tensor:
    """This rank's tokens of ``tensor`` [batch, seq, ...], in the order of ``head_tail_positions``."""
    return tensor[:, head_tail_positions(tensor.shape[1], cp_degree, cp_rank, tensor.device)]


def document_ids(token_positions: torch.Tensor, document_positions: torch.Tensor) -> torch.Tensor:
    """Per token, an id of its document that is the same on every rank: the global index where the
    document starts (``document_positions``: each token's position in its document, consecutive
    within one, [batch, seq_local]; ``token_positions``: the tokens' global indices [seq_local])."""
    return token_positions - document_positions


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    group: dist.ProcessGroup,
    rotate_method: RotateMethod,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries [batch, heads, seq_local, head_dim] over the keys and
    values of every rank of ``group`` (each rank's tokens at ``positions`` [seq_local], its chunks of
    ``head_tail_positions``). With ``documents`` [batch, seq_local] (``document_ids``), a query sees
    only keys of its own document."""
    if rotate_method == "allgather":
        return _allgather_attention(q, k, v, positions, group, documents)
    if rotate_method == "alltoall":
        return _ring_attention(q, k, v, positions, group, documents)
    raise ValueError(f"rotate_method must be one of {ROTATE_METHODS}, got {rotate_method!r}")


def _all_positions(positions: torch.Tensor, cp_degree: int) -> list[torch.Tensor]:
    """Every rank's token positions, by rank."""
    seq_len = positions.shape[0] * cp_degree
    return [head_tail_positions(seq_len, cp_degree, r, positions.device) for r in range(cp_degree)]


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` [batch, heads, seq_local, ...] of every rank, concatenated on the sequence in rank order.
    Contiguous input: a strided one reaches the backend as is (wrong gradients on gloo)."""
    return all_gather_single_autograd(x.contiguous(), gather_dim=2, group=group)


def _mask(
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    q_documents: torch.Tensor | None,
    k_documents: torch.Tensor | None,
) -> torch.Tensor:
    """Boolean [batch or 1, 1, seq_q, seq_k]: True where the query may see the key."""
    mask = (q_positions[:, None] >= k_positions[None, :])[None, None]
    if q_documents is not None:
        mask = mask & (q_documents[:, None, :, None] == k_documents[:, None, None, :])
    return mask


def _allgather_attention(q, k, v, positions, group, documents):
    cp_degree = dist.get_world_size(group)
    keys, values = _gather_sequence(k, group), _gather_sequence(v, group)
    k_positions = torch.cat(_all_positions(positions, cp_degree))
    k_documents = None
    if documents is not None:
        k_documents = _gather_sequence(documents[:, None], group)[:, 0]
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=_mask(positions, k_positions, documents, k_documents)
    )


def _pass_on(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sends ``x`` to the next rank of the ring and returns the previous rank's (gradients flow back)."""
    cp_degree, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = x.shape[0]
    send = [rows if r == (rank + 1) % cp_degree else 0 for r in range(cp_degree)]
    receive = [rows if r == (rank - 1) % cp_degree else 0 for r in range(cp_degree)]
    return all_to_all_single_autograd(x.contiguous(), receive, send, group=group)


def _slices(query: torch.Tensor, cp_degree: int, rank: int, source: int) -> tuple[tuple[int, int, int], ...]:
    """(start, stop, keys): row ranges of ``query`` [batch, heads, seq_local, head_dim] (this rank's)
    whose scores against a block of ``seq_local`` keys (rank ``source``'s) hold at most
    ``SCORES_PER_SLICE`` values, each with how many of the block's keys it may see under the causal
    mask: a prefix, since positions ascend in both chunks. Plain integers from the chunk layout, so
    that a compiled graph holds no data-dependent shape."""
    batch, heads, seq_local, _ = query.shape
    chunk = seq_local // 2
    rows = max(1, SCORES_PER_SLICE // (batch * heads * seq_local))
    head, tail = _chunk_starts(chunk, cp_degree, rank)
    slices = []
    for start in range(0, seq_local, rows):
        stop = min(start + rows, seq_local)
        last = head + stop - 1 if stop <= chunk else tail + stop - 1 - chunk
        keys = sum(min(max(last - first + 1, 0), chunk) for first in _chunk_starts(chunk, cp_degree, source))
        slices.append((start, stop, keys))
    return tuple(slices)


def _largest(query: torch.Tensor, slices: tuple[tuple[int, int, int], ...]) -> int:
    """The most scores one of ``slices`` of ``query`` [batch, heads, seq_q, head_dim] computes."""
    batch, heads = query.shape[:2]
    return max(batch * heads * (stop - start) * keys for start, stop, keys in slices)


def _weights(query, keys, hidden, buffer, maximum=None):
    """exp(scores - maximum) of ``query`` against ``keys`` (0 where ``hidden``, the mask's negation,
    hides the key), built in place in ``buffer``, and the rows' maximum score (-inf where every key
    is hidden)."""
    weights = torch.matmul(query, keys.transpose(-2, -1), out=_scratch(buffer, query, keys))
    weights.masked_fill_(hidden, -math.inf)
    if maximum is None:
        maximum = weights.amax(dim=-1)
    return weights.sub_(maximum.nan_to_num(neginf=0.0)[..., None]).exp_(), maximum


def _scratch(buffer: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The front of ``buffer`` shaped as the product of ``rows`` [..., n, d] and ``columns`` [..., m, d]
    transposed: [..., n, m]."""
    shape = (*rows.shape[:-1], columns.shape[-2])
    return buffer[: math.prod(shape)].view(shape)


class _BlockAttention(torch.autograd.Function):
    """One block of keys' share of the online softmax: the rows' maximum score, the values weighted
    by exp(score - maximum) and those weights' sum, computed slice by slice of the queries (each
    against the keys ``slices`` says it may see) and recomputed in backward, so that at most ``SCORES_PER_SLICE`` scores (and as many gradients)
    exist at once. The results are allocated before the slices' buffers, which then reuse one
    another's memory: on a CPU, small results between them would fragment malloc's heap. No
    gradient flows through the maximum (the attention does not depend on it)."""

    @staticmethod
    def forward(ctx, query, keys, values, mask, slices):
        batch, heads, seq_q, _ = query.shape
        maximum = query.new_empty(batch, heads, seq_q)
        out = query.new_empty(batch, heads, seq_q, values.shape[-1])
        total = query.new_empty(batch, heads, seq_q)
        hidden = mask.logical_not()
        buffer = query.new_empty(_largest(query, slices))
        for start, stop, needed in slices:
            rows = slice(start, stop)
            if needed == 0:
                maximum[..., rows], out[..., rows, :], total[..., rows] = -math.inf, 0.0, 0.0
                continue
            weights, maximum[..., rows] = _weights(
                query[..., rows, :], keys[..., :needed, :], hidden[..., rows, :needed], buffer
            )
            out[..., rows, :] = weights @ values[..., :needed, :]
            total[..., rows] = weights.sum(dim=-1)
        ctx.save_for_backward(query, keys, values, mask, maximum)
        ctx.slices = slices
        ctx.mark_non_differentiable(maximum)
        return maximum, out, total

    @staticmethod
    def backward(ctx, _, grad_out, grad_total):
        query, keys, values, mask, maximum = ctx.saved_tensors
        grad_query, grad_keys, grad_values = torch.empty_like(query), torch.zeros_like(keys), torch.zeros_like(values)
        hidden = mask.logical_not()
        buffers = query.new_empty(2, _largest(query, ctx.slices))
        for start, stop, needed in ctx.slices:
            rows = slice(start, stop)
            if needed == 0:
                grad_query[..., rows, :] = 0.0
                continue
            keys_seen, values_seen = keys[..., :needed, :], values[..., :needed, :]
            queries, grads = query[..., rows, :], grad_out[..., rows, :]
            weights, _ = _weights(queries, keys_seen, hidden[..., rows, :needed], buffers[0], maximum[..., rows])
            grad_values[..., :needed, :] += weights.transpose(-2, -1) @ grads
            # d(total)/d(weight) is 1 and d(out)/d(weight) is the value; d(weight)/d(score) is the weight.
            grad_scores = torch.matmul(
                grads, values_seen.transpose(-2, -1), out=_scratch(buffers[1], grads, values_seen)
            )
            grad_scores.add_(grad_total[..., rows, None]).mul_(weights)
            grad_query[..., rows, :] = grad_scores @ keys_seen
            grad_keys[..., :needed, :] += grad_scores.transpose(-2, -1) @ queries
        return grad_query, grad_keys, grad_values, None, None


def _ring_attention(q, k, v, positions, group, documents):
    """Online softmax over the blocks of keys as they come round, in float32. Each block's scores
    are recomputed in backward rather than kept (a block's scores are seq_local^2 per head, all of
    them more than the all-gathered keys). Round 0 is the rank's own block, where every query sees
    at least itself, so the running maximum is finite from the start."""
    cp_degree, rank = dist.get_world_size(group), dist.get_rank(group)
    all_positions = _all_positions(positions, cp_degree)
    all_documents = None
    if documents is not None:  # integers, no gradient: all at once
        all_documents = _gather_sequence(documents[:, None], group)[:, 0].chunk(cp_degree, dim=1)
    query = q.float() / math.sqrt(q.shape[-1])
    block = torch.stack([k, v])
    out = total = maximum = None
    for step in range(cp_degree):
        if step > 0:
            block = _pass_on(block, group)
        source = (rank - step) % cp_degree
        k_documents = all_documents[source] if all_documents is not None else None
        mask = _mask(positions, all_positions[source], documents, k_documents)
        block_max, block_out, block_total = _BlockAttention.apply(
            query, block[0].float(), block[1].float(), mask, _slices(query, cp_degree, rank, source)
        )
        if out is None:
            out, total, maximum = block_out, block_total, block_max
            continue
        new_max = torch.maximum(maximum, block_max)
        old_scale, block_scale = torch.exp(maximum - new_max), torch.exp(block_max - new_max)
        out = out * old_scale[..., None] + block_out * block_scale[..., None]
        total = total * old_scale + block_total * block_scale
        maximum = new_max
    return (out / total[..., None]).to(q.dtype)
