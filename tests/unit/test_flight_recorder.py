"""A rank's flight recorder written where comm.save_traces_folder says when its collective fails
(trainer/distributed.py): the record, the error line's phrase for it, and a folder that cannot be
written (the line goes out without it). The whole path, a hung rank: test_fault_tolerance.py."""

from __future__ import annotations

import logging
import os
import pickle
import tempfile

import pytest
import torch
import torch.distributed as dist

from config.job_config import Comm
from tests.spawn import check_on_gloo_ranks
from trainer.distributed import dump_collective_trace


def _check_dump(rank: int) -> None:
    dist.all_reduce(torch.ones(2))
    dist.broadcast(torch.ones(3), src=0)
    dump = tempfile.mkdtemp()
    phrase = dump_collective_trace(Comm(), dump)
    folder = os.path.join(dump, "comm_traces")
    assert phrase == f"{folder} (this rank's last: gloo:broadcast #2 of default_pg)", phrase
    with open(os.path.join(folder, f"rank_{rank}"), "rb") as f:
        entries = pickle.load(f)["entries"]
    assert [entry["profiling_name"] for entry in entries] == ["gloo:all_reduce", "gloo:broadcast"]
    assert entries[-1]["input_sizes"] == [[3]]

    open(os.path.join(dump, "a_file"), "w").close()
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("trainer.distributed").addHandler(handler)
    assert dump_collective_trace(Comm(save_traces_folder="a_file/traces"), dump) is None
    assert warnings == [
        f"comm.save_traces_folder: cannot write the flight recorder to {dump}/a_file/traces (Not a directory)"
    ]
    assert dump_collective_trace(Comm(trace_buf_size=0), dump) is None


@pytest.mark.slow  # spawns a gloo rank
def test_a_ranks_record_is_written_and_named_or_left_out_with_a_warning(monkeypatch) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")  # the spawned rank inherits it, as from init_distributed
    check_on_gloo_ranks(_check_dump, 1, timeout_s=60)
