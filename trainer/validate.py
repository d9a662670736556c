"""Validation: the mean loss over a few batches of a held-out corpus."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from config.errors import first_line
from config.job_config import Validation
from models.builder import BuiltModel
from parallelisms.tensor_parallel import local_loss
from trainer.loss import Loss, trained_labels
from trainer.out_of_memory import is_out_of_memory, out_of_memory_error

logger = logging.getLogger(__name__)


def validation_due(step: int, freq: int) -> bool:
    """Whether a validation follows step ``step``: after step 1 and every ``freq``, as torchtitan's."""
    return step == 1 or step % freq == 0


class Validator:
    """Evaluates ``validation.steps`` batches of a fresh ``loader()``: the same windows each time."""

    def __init__(
        self,
        validation: Validation,
        loader: Callable[[], StatefulDataLoader],
        dp_degree: int,
        loss: Loss,
        context_parallel: tuple[int, int] = (1, 0),
    ):
        """``context_parallel``: (degree, this rank's index), whose chunks of each sequence this rank validates."""
        self.steps = validation.steps
        self.loader = loader
        self.dp_degree = dp_degree
        self.loss = loss
        self.context_parallel = context_parallel
        if validation.enable:
            # Tokenized now: a corpus too short for one window is refused before training, not after a step.
            windows, steps = loader().dataset, validation.steps
            if windows.num_windows < steps * windows.global_batch_size:
                logger.warning(
                    f"validation.dataset: {windows.num_windows} windows of seq_len + 1 = {windows.seq_len + 1} tokens, "
                    f"fewer than the {steps * windows.global_batch_size} that validation.steps {steps} x "
                    f"{windows.global_batch_size} sequences read: each validation reads some windows more than once"
                )

    def validate(self, model: BuiltModel, device: torch.device, step: int) -> torch.Tensor:
        """This rank's share of the global mean token loss after ``step`` (over the trained labels
        where labels can be ignored)."""
        try:
            return self._mean_loss(model, device)
        except RuntimeError as e:
            if not is_out_of_memory(e):
                raise
            # Validation's batches ran out, not training's: its option is the one to name.
            what = f"out of memory in validation after step {step} on rank {dist.get_rank()} ({first_line(e)})"
            raise out_of_memory_error(what, "validation.local_batch_size") from None

    @torch.no_grad()
    def _mean_loss(self, model: BuiltModel, device: torch.device) -> torch.Tensor:
        loader = self.loader()
        for part in model.parts:
            part.eval()
        total = torch.zeros((), device=device)
        tokens = trained = 0
        for _, batch in zip(range(self.steps), loader):
            batch = batch.context_parallel_shard(*self.context_parallel).to(device)
            if model.schedule is not None:
                with self.loss.context():
                    # The pipeline's loss is over the training step's divisor: back to a sum.
                    pipeline_loss = model.run_pipeline(
                        batch.inputs, batch.labels, train=False, positions=batch.positions
                    )
                    total += pipeline_loss * self.loss.divisor
            else:
                logits = model.parts[0](batch.inputs, positions=batch.positions)
                with self.loss.context():
                    total += local_loss(self.loss.summed(logits, batch.labels))
            tokens += batch.labels.numel()
            if self.loss.ignores_labels:
                trained += trained_labels(batch.labels)
        for part in model.parts:
            part.train()
        if self.loss.ignores_labels:
            return total / max(1, self.loss.global_count(trained, device))
        return total / (tokens * self.dp_degree * self.context_parallel[0])
