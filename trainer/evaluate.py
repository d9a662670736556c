"""Downstream evaluation: multiple-choice tasks scored by log-likelihood as lm-evaluation-harness scores
them (its tokenization of a context and a choice, its left truncation, its acc and acc_norm), and
generation tasks by exact match (trainer/evaluate_generation.py), during training at the training
layout; programs/lm_eval_model.py scores the harness's own requests here too."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from config.errors import ConfigError
from config.evaluation import GenerationRecord, Record, read_tasks
from config.job_config import JobConfig
from models.builder import BuiltModel
from parallelisms.parallel_dims import ParallelDims
from trainer.data.tokenizer import Tokenizer
from trainer.evaluate_generation import continuations, exact_matches, generation_prompt

Request = tuple[list[int], list[int]]  # the ids of a context and of its continuation
TARGET_DELIMITER = " "  # lm-evaluation-harness's between a context and a choice


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str, add_bos: bool) -> Request:
    """lm-evaluation-harness's split (TemplateLM.loglikelihood): the context's trailing spaces go to the
    continuation, the whole is encoded and cut at the length of the encoded context, so a token that
    spans the boundary is the continuation's; an empty context is the BOS token."""
    if not context:
        ids = tokenizer.encode(continuation)
        return ([tokenizer.bos_id], ids) if ids[0] != tokenizer.bos_id else (ids[:1], ids[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = tokenizer.encode(context, bos=add_bos)
    return context_ids, tokenizer.encode(context + continuation, bos=add_bos)[len(context_ids) :]


def choice_requests(records: list[Record], tokenizer: Tokenizer, add_bos: bool) -> list[Request]:
    """One request per choice of each record, in order."""
    return [
        encode_pair(tokenizer, record.context, TARGET_DELIMITER + choice, add_bos)
        for record in records
        for choice in record.choices
    ]


@torch.no_grad()
def loglikelihoods(
    forward: Callable[[torch.Tensor], torch.Tensor],
    requests: list[Request],
    max_length: int,
    batch_size: int,
    device: torch.device,
    pad_to: int | None = None,
) -> tuple[list[float], list[bool]]:
    """The summed log-probability of each request's continuation given its context, and whether it is the
    greedy one; sequences are the last ``max_length`` tokens before the last (the harness's truncation),
    ``batch_size`` a forward pass, padded at the end to ``pad_to`` tokens (None: the batch's longest)."""
    sums, greedy = [], []
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        windows = [(context + continuation)[-(max_length + 1) :][:-1] for context, continuation in batch]
        inputs = torch.zeros(len(batch), pad_to or max(map(len, windows)), dtype=torch.long)
        for row, window in enumerate(windows):
            inputs[row, : len(window)] = torch.tensor(window)
        logits = forward(inputs.to(device))
        if isinstance(logits, DTensor):  # vocabulary-sharded under loss parallel
            logits = logits.full_tensor()
        logprobs = F.log_softmax(logits.float(), dim=-1).cpu()
        for row, (window, (_, continuation)) in enumerate(zip(windows, batch)):
            rows = logprobs[row, len(window) - len(continuation) : len(window)]
            targets = torch.tensor(continuation)
            sums.append(float(rows.gather(-1, targets[:, None]).sum()))
            greedy.append(bool((rows.argmax(-1) == targets).all()))
    return sums, greedy


def accuracies(tasks: dict[str, list[Record]], sums: list[float]) -> dict[str, dict[str, float]]:
    """acc (the choice of the highest log-likelihood is the answer) and acc_norm (of the highest per
    character of the choice, as the harness's acc_norm) of each task; ``sums`` in choice_requests' order."""
    results, at = {}, 0
    for name, records in tasks.items():
        right = right_norm = 0
        for record in records:
            scores = sums[at : at + len(record.choices)]
            at += len(record.choices)
            # max() keeps the first of equal scores, as numpy's argmax in the harness.
            right += max(range(len(scores)), key=lambda i: scores[i]) == record.answer
            per_char = [score / len(choice) for score, choice in zip(scores, record.choices)]
            right_norm += max(range(len(scores)), key=lambda i: per_char[i]) == record.answer
        results[name] = {"acc": right / len(records), "acc_norm": right_norm / len(records)}
    return results


class Evaluator:
    """Scores eval.tasks every eval.freq steps: each data-parallel rank its share of the requests and of
    the generation prompts (the tensor-parallel ranks of a group the same share), every rank as many
    forward passes."""

    def __init__(self, config: JobConfig, tokenizer: Tokenizer, dims: ParallelDims, device: torch.device):
        e = config.eval
        self.freq, self.last_step, self.batch_size = e.freq, config.training.steps, e.batch_size
        self.max_length, self.max_new_tokens = e.max_length or config.training.seq_len, e.max_new_tokens
        self.dims, self.device, self.tokenizer = dims, device, tokenizer
        self.tasks = read_tasks(e, config.training.seq_len) if e.freq else {}
        self.choice_tasks = {name: r for name, r in self.tasks.items() if isinstance(r[0], Record)}
        self.generation_tasks = {name: r for name, r in self.tasks.items() if isinstance(r[0], GenerationRecord)}
        self.requests = [
            r for records in self.choice_tasks.values() for r in choice_requests(records, tokenizer, e.add_bos)
        ]
        longest = max((len(continuation) for _, continuation in self.requests), default=0)
        if longest > self.max_length:
            raise ConfigError(f"eval.tasks: a choice of {longest} tokens is longer than eval.max_length")
        context = self.max_length - self.max_new_tokens
        self.generations = [
            (generation_prompt(tokenizer, r.context, e.add_bos, context), r.until, r.answer)
            for records in self.generation_tasks.values()
            for r in records
        ]

    def due(self, step: int) -> bool:
        return self.freq > 0 and (step % self.freq == 0 or step == self.last_step)

    def evaluate(self, model: BuiltModel) -> tuple[dict[str, dict[str, float]], float]:
        """Each task's scores (acc and acc_norm, or exact_match), and the seconds the evaluation took."""
        start = time.perf_counter()
        for part in model.parts:
            part.eval()
        # Padded to the training's length: a length the layout takes (tensor-parallel sequence shards, say).
        sums = self._over_ranks(
            self.requests,
            lambda share: loglikelihoods(
                model.parts[0], share, self.max_length, self.batch_size, self.device, pad_to=self.max_length
            )[0],
        )
        matches = self._over_ranks(self.generations, lambda share: self._matches(model.parts[0], share))
        for part in model.parts:
            part.train()
        scores = {**accuracies(self.choice_tasks, sums), **exact_matches(self.generation_tasks, matches)}
        return {name: scores[name] for name in self.tasks}, time.perf_counter() - start

    def _matches(self, model: torch.nn.Module, share: list[tuple[list[int], list[str], str]]) -> list[float]:
        texts = continuations(
            model,
            self.tokenizer,
            [prompt for prompt, _, _ in share],
            [until for _, until, _ in share],
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            stop_at_eos=False,  # every rank as many decode steps: each is a collective under FSDP
        )
        return [float(text == answer) for text, (_, _, answer) in zip(texts, share)]

    def _over_ranks(self, items: list, score: Callable[[list], list[float]]) -> list[float]:
        """``score`` of every item, each data-parallel rank scoring every dp-th one and the results summed
        over the ranks. The same number of forward passes on every rank (FSDP gathers in each): the
        short shares repeat one."""
        if not items:
            return []
        ranks, rank = self.dims.dp_degree, self.dims.dp_rank
        share = items[rank::ranks]
        values = score(share + items[:1] * (math.ceil(len(items) / ranks) - len(share)))
        every = torch.zeros(len(items), dtype=torch.float64, device=self.device)
        every[rank::ranks] = torch.tensor(values[: len(share)], dtype=torch.float64, device=self.device)
        if self.dims.dp_mesh is not None:
            dist.all_reduce(every, group=self.dims.dp_mesh.get_group())
        return every.tolist()
