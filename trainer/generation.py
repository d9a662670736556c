"""Text generation from a model of any layout that runs whole on each rank's group: greedy or sampled
(temperature, top-k, top-p) continuations of a batch of prompts, with a key/value cache or without.
Every rank of a tensor-parallel group runs ``generate`` and gets the same tokens: the logits are
replicated, and each rank samples from them with a generator of the same seed."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from models.llama3.kv_cache import KVCache

# What fills a row of a batch past its tokens: causal attention keeps it from every real token.
_PAD_ID = 0


def generate(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_id: int | None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    use_cache: bool = True,
) -> list[list[int]]:
    """The new tokens of each prompt (token ids): up to ``max_new_tokens``, ending with ``eos_id`` when
    it comes, and stopping at the model's context (``args.max_seq_len``). ``temperature`` 0 picks
    the most likely token; above 0 tokens are drawn from the softmax of the logits / temperature,
    cut to the ``top_k`` most likely (0: all) and to the fewest whose probability reaches ``top_p``.
    The same ``seed`` draws the same tokens. ``use_cache``: each step runs the model on the new
    tokens only, attending to the cached keys and values of the positions before."""
    context = model.args.max_seq_len
    for index, prompt in enumerate(prompts):
        if not prompt or len(prompt) > context:
            raise ValueError(f"prompt {index} has {len(prompt)} tokens; the model takes 1 to {context}")
    sequences = [list(prompt) for prompt in prompts]
    budgets = [min(max_new_tokens, context - len(prompt)) for prompt in prompts]
    new_tokens: list[list[int]] = [[] for _ in prompts]
    generator = torch.Generator().manual_seed(seed)
    step = _CachedStep(model, len(prompts)) if use_cache else _FullStep(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            while active := [i for i, new in enumerate(new_tokens) if _wants_more(new, budgets[i], eos_id)]:
                logits = step(sequences)
                probabilities = sampling_probabilities(logits[active], temperature, top_k, top_p)
                if probabilities is None:
                    chosen = logits[active].argmax(dim=-1)
                else:
                    chosen = torch.multinomial(probabilities, 1, generator=generator)[:, 0]
                for i, token in zip(active, chosen.tolist()):
                    sequences[i].append(token)
                    new_tokens[i].append(token)
    finally:
        model.train(was_training)
    return new_tokens


def _wants_more(new: list[int], budget: int, eos_id: int | None) -> bool:
    return len(new) < budget and not (new and new[-1] == eos_id)


def sampling_probabilities(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor | None:
    """The distribution [batch, vocab] next tokens are drawn from, given their ``logits`` [batch,
    vocab]: the softmax of logits / ``temperature`` over the ``top_k`` most likely tokens (0: all),
    then over the most likely ones whose probabilities sum to ``top_p`` or more (the token that
    crosses it included), renormalised. None for temperature 0 (greedy: the argmax)."""
    if temperature == 0:
        return None
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        ordered, order = torch.sort(probabilities, dim=-1, descending=True)
        # A token stays while the ones more likely than it hold less than top_p.
        before = torch.cumsum(ordered, dim=-1) - ordered
        ordered = ordered.masked_fill(before >= top_p, 0.0)
        probabilities = torch.zeros_like(probabilities).scatter(-1, order, ordered)
    return probabilities / probabilities.sum(dim=-1, keepdim=True)


def _round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


class _FullStep:
    """The logits [batch, vocab] (float32, on the CPU) after each sequence, the model run on all of
    them from position 0, right-padded to one length."""

    def __init__(self, model: nn.Module):
        self.model = model
        # Tensor parallelism's sequence parallelism splits every sequence evenly over the ranks.
        self.multiple = getattr(model, "hidden_sequence_shards", 1)

    def __call__(self, sequences: list[list[int]]) -> torch.Tensor:
        length = _round_up(max(map(len, sequences)), self.multiple)
        rows = [sequence + [_PAD_ID] * (length - len(sequence)) for sequence in sequences]
        logits = self.model(torch.tensor(rows, device=_device(self.model)))
        return _last_logits(logits, [len(sequence) - 1 for sequence in sequences])


class _CachedStep:
    """As ``_FullStep``, the model run on the tokens not yet cached: each row's last ``n`` tokens, ``n``
    the most any row has uncached (rounded up to a multiple of the sequence shards; a row shorter
    than that is right-padded, its padding written past its tokens and overwritten before it is read)."""

    def __init__(self, model: nn.Module, batch: int):
        self.model = model
        self.multiple = getattr(model, "hidden_sequence_shards", 1)
        self.cache = KVCache(batch, model.args.max_seq_len)
        self.cached = [0] * batch

    def __call__(self, sequences: list[list[int]]) -> torch.Tensor:
        uncached = max(len(sequence) - cached for sequence, cached in zip(sequences, self.cached))
        length = _round_up(max(uncached, 1), self.multiple)
        rows, positions, last = [], [], []
        for sequence in sequences:
            start = max(len(sequence) - length, 0)
            window = sequence[start:]
            rows.append(window + [_PAD_ID] * (length - len(window)))
            positions.append(list(range(start, start + length)))
            last.append(len(window) - 1)
        device = _device(self.model)
        logits = self.model(torch.tensor(rows, device=device), torch.tensor(positions, device=device), cache=self.cache)
        self.cached = [len(sequence) for sequence in sequences]
        return _last_logits(logits, last)


def _device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters())
    return parameter.to_local().device if isinstance(parameter, DTensor) else parameter.device


def _last_logits(logits: torch.Tensor, columns: list[int]) -> torch.Tensor:
    """Each row's logits at its column, gathered whole (loss parallel leaves them vocabulary-sharded)."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    rows = torch.arange(logits.shape[0], device=logits.device)
    return logits[rows, torch.tensor(columns, device=logits.device)].float().cpu()
