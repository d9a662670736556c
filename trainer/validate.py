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
from trainer.loss import Loss
from trainer.out_of_memory import is_out_of_memory, out_of_memory_error

logger = logging.getLogger(__name__)


def validation_due(step: int, freq: int) -> bool:
    """Whether a validation follows step ``step``: after step 1 and every ``freq``, as torchtitan's."""
    return step == 1 or step % freq == 0


class Validator:
    """Evaluates ``validation.steps`` batches of a fresh ``loader()``: the same windows each time."""

    def __init__(self, validation: Validation, loader: Callable[[], StatefulDataLoader], dp_degree: int, loss: Loss):
        self.steps = validation.steps
        self.loader = loader
        self.dp_degree = dp_degree
        self.loss = loss
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
        """This rank's share of the global mean token loss after ``step``."""
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
        tokens = 0
        for _, (inputs, labels) in zip(range(self.steps), loader):
            inputs, labels = inputs.to(device), labels.to(device)
            if model.schedule is not None:
                with self.loss.context():
                    # The pipeline's loss is over the training batch's token count: back to a sum.
                    total += model.run_pipeline(inputs, labels, train=False) * self.loss.tokens_per_step
            else:
                logits = model.parts[0](inputs)
                with self.loss.context():
                    total += local_loss(self.loss.summed(logits, labels))
            tokens += labels.numel()
        for part in model.parts:
            part.train()
        return total / (tokens * self.dp_degree)
