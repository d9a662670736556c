"""Entry point: ``torchrun --nproc-per-node N train.py --job.config_file configs/debug_model.toml``."""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys

from config.errors import ConfigError, first_line, init_console_logging, print_error
from config.manager import help_text, load_config, named_as_given
from trainer.refusal import job_refused, refuse


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    rank = int(os.environ.get("RANK", 0))
    init_console_logging()
    if job_refused():
        return 0  # an earlier attempt of this job met a mistake that a restart cannot mend
    try:
        config = load_config(argv)
    except ConfigError as e:
        return refuse(named_as_given(e, argv))

    from trainer.checkpoint.manager import CheckpointError
    from trainer.out_of_memory import is_out_of_memory, out_of_memory_error
    from trainer.trainer import NonFiniteError, Trainer

    trainer = None
    try:
        trainer = Trainer(config)
        trainer.train()
        trainer.close()
    except ConfigError as e:
        return refuse(named_as_given(e, argv))
    except (CheckpointError, NonFiniteError) as e:
        print_error(e)
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # A restart would meet the same full disk (the folders' check then says so before launch).
        return refuse(ConfigError(f"job.dump_folder: {e.filename or 'a file'}: {e.strerror}"))
    except RuntimeError as e:
        step = trainer.step + 1 if trainer is not None else 0
        if is_out_of_memory(e):
            # The same batches at the same layout would run out again: not worth a restart.
            return refuse(out_of_memory_error(f"out of memory in step {step} on rank {rank} ({first_line(e)})"))
        if not _is_collective_failure(e):
            raise
        if job_refused():
            return 0  # a peer met a mistake no restart can mend: the launcher prints its line
        # A peer died or hung: torchrun restarts the job from the newest checkpoint.
        from trainer.distributed import dump_collective_trace

        traces = dump_collective_trace(config.comm, config.job.dump_folder)
        print_error(
            f"a collective failed at step {step} (a rank died or hung longer than "
            f"comm.train_timeout_seconds={config.comm.train_timeout_seconds}): {first_line(e)}"
            + (f"; the ranks' last collectives are in {traces}" if traces else "")
        )
        return 1
    return 0


def _is_collective_failure(error: BaseException) -> bool:
    import torch.distributed as dist

    # gloo reports a dead or hung peer as a RuntimeError naming its transport's source file; a wait
    # on a connection that another operation's timeout closed gets the stored reason alone.
    message = str(error)
    return isinstance(error, dist.DistError) or "/gloo/" in message or "timeout caused pair closure" in message


def exit_without_teardown(code: int) -> None:
    """Ends the process without finalization, once every rank passed its last barrier: tearing down
    gloo's connections at exit sometimes aborts a finished rank, a failed job to torchrun."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Helper processes (async checkpointing, dataloader workers) re-import this file: keep work here.
if __name__ == "__main__":
    # Ctrl-C reaches every rank and torchrun together: a rank just ends, without a traceback each;
    # torchrun stops the others (and under run_train.sh says so in one line).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    exit_without_teardown(main(sys.argv[1:]))
