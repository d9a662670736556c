"""Running out of memory is a mistake in the job, not a failure to restart: the same batches at the
same layout would run out again."""

from __future__ import annotations

from config.errors import ConfigError


def out_of_memory_error(what: str, batch: str = "training.local_batch_size") -> ConfigError:
    """The line for a run out of memory (``what`` says how) on the batches of ``batch``."""
    section = batch.split(".")[0]
    return ConfigError(
        f"{batch}: {what}; a smaller local_batch_size or seq_len in [{section}], activation_checkpoint.mode "
        "selective or full, or more ranks to shard over would fit (COMM_MODE=fake ./run_train.sh estimates a "
        "rank's peak)"
    )


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    # An accelerator's allocator raises OutOfMemoryError; the CPU's a RuntimeError saying so.
    return isinstance(error, torch.OutOfMemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(error)
