"""The training loss: a microbatch's fp32 cross-entropy summed over its tokens, divided by the
global batch's token count, so that gradients summed over microbatches and ranks are the mean's.
Where labels can be ignored (``IGNORE_INDEX``: chat data, document masking) the count is that of
the step's trained labels on every data-parallel and context-parallel rank (each context-parallel
rank holds other tokens of its data-parallel rank's batch)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from config.job_config import Compile
from parallelisms.compile import apply_compile_loss
from parallelisms.parallel_dims import ParallelDims
from trainer.data.batch import IGNORE_INDEX


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # cross_entropy's default ignore_index is IGNORE_INDEX: those labels add nothing.
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


def trained_labels(labels: torch.Tensor) -> int:
    """The labels that take a loss."""
    return int((labels != IGNORE_INDEX).sum())


class Loss:
    """``loss(logits, labels)`` per microbatch; compute it, and its backward, inside ``context()``.
    With ``ignores_labels``, ``start_step`` sets the step's divisor before its first microbatch."""

    def __init__(
        self,
        tokens_per_step: int,
        parallel_dims: ParallelDims,
        compile: Compile,
        enable_loss_parallel: bool,
        ignores_labels: bool = False,
    ):
        self.tokens_per_step = tokens_per_step
        self.ignores_labels = ignores_labels
        self.divisor = tokens_per_step
        self.parallel_dims = parallel_dims
        # Loss parallel: under tensor parallelism the output layer leaves the logits sharded on the
        # vocabulary, and the cross-entropy runs on the shards.
        self.loss_parallel = parallel_dims.tp_enabled and enable_loss_parallel
        self.summed = summed_cross_entropy
        if compile.compiles_loss and not parallel_dims.tp_enabled:
            # Under tensor parallelism the logits are DTensors that loss parallel handles: left eager.
            self.summed = apply_compile_loss(summed_cross_entropy, compile.backend)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.summed(logits, labels) / self.divisor

    def start_step(self, microbatch_labels: list[torch.Tensor], device: torch.device) -> None:
        """Divides the step's losses by its trained labels on all data- and context-parallel ranks (this
        rank's microbatches given; the tensor and pipeline ranks of a data-parallel rank give the same)."""
        if self.ignores_labels:
            local = sum(trained_labels(labels) for labels in microbatch_labels)
            # At least 1: a step without a trained label has loss and gradients 0, not NaN.
            self.divisor = max(1, self.global_count(local, device))

    def global_count(self, local: int, device: torch.device) -> int:
        """``local`` summed over the data- and context-parallel ranks."""
        count = torch.tensor(local, dtype=torch.int64, device=device)
        mesh = self.parallel_dims.dp_cp_mesh
        if mesh is not None:
            dist.all_reduce(count, group=mesh.get_group())
        return int(count)

    def context(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()
