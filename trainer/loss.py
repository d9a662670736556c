"""The training loss: a microbatch's fp32 cross-entropy summed over its tokens, divided by the
global batch's token count, so that gradients summed over microbatches and ranks are the mean's."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from config.job_config import Compile
from parallelisms.compile import apply_compile_loss
from parallelisms.parallel_dims import ParallelDims


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


class Loss:
    """``loss(logits, labels)`` per microbatch; compute it, and its backward, inside ``context()``."""

    def __init__(self, tokens_per_step: int, parallel_dims: ParallelDims, compile: Compile, enable_loss_parallel: bool):
        self.tokens_per_step = tokens_per_step
        # Loss parallel: under tensor parallelism the output layer leaves the logits sharded on the
        # vocabulary, and the cross-entropy runs on the shards.
        self.loss_parallel = parallel_dims.tp_enabled and enable_loss_parallel
        self.summed = summed_cross_entropy
        if compile.compiles_loss and not parallel_dims.tp_enabled:
            # Under tensor parallelism the logits are DTensors that loss parallel handles: left eager.
            self.summed = apply_compile_loss(summed_cross_entropy, compile.backend)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.summed(logits, labels) / self.tokens_per_step

    def context(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()
