"""optimizer.early_step_in_backward (torchtitan's option) through train.py: updating each parameter
in backward gives the losses of updating after backward bitwise, on FSDP2, SimpleFSDP and DDP with
two microbatches a step, and its logged gradient norm is the one clipping measures; its checkpoints
hold the same optimizer state, so a run resumes across the option both ways.

Both sides train without clipping (training.max_norm 0), which the option cannot do. Launches:
six runs on 2 ranks in one launch (about 40 s), four 1-process runs for the resumes.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.launch import (
    GRAD_NORM_RTOL,
    TWO_BLOCKS,
    RunBatch,
    grad_norms,
    launch_train,
    losses,
    read_metrics,
    resumed_from,
)

pytestmark = pytest.mark.slow  # every test here launches torchrun

STEPS = 6
RUN = [
    *("--training.steps", str(STEPS), "--training.max_norm", "0", "--lr_scheduler.warmup_steps", "2"),
    *TWO_BLOCKS,
]
# 2 ranks x 4 sequences x 2 microbatches.
TWO_MICROBATCHES = ["--training.global_batch_size", "16", "--training.local_batch_size", "4"]
LAYOUTS = {
    "fsdp2": [],
    "simple_fsdp": ["--parallelism.data_parallel_impl", "simple_fsdp"],
    "ddp": ["--parallelism.data_parallel_replicate_degree", "2"],
}
EARLY = ["--optimizer.early_step_in_backward", "true"]
EARLY_LINE = "each parameter stepped in backward"


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> RunBatch:
    runs = {}
    for name, layout in LAYOUTS.items():
        runs[name] = (2, [*RUN, *TWO_MICROBATCHES, *layout])
        runs[f"{name}_early"] = (2, [*RUN, *TWO_MICROBATCHES, *layout, *EARLY])
    return RunBatch(str(tmp_path_factory.mktemp("early_step")), runs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_updates_in_backward_give_the_losses_of_updates_after_it_bitwise(batch, layout):
    early, after = batch.records(f"{layout}_early"), batch.records(layout)
    assert EARLY_LINE in batch.log(f"{layout}_early") and EARLY_LINE not in batch.log(layout)
    assert "2 microbatches of 4 per rank" in batch.log(layout)
    assert len(after) == STEPS and losses(after)[-1] < losses(after)[0]
    assert losses(early) == losses(after)
    assert grad_norms(early) == pytest.approx(grad_norms(after), rel=GRAD_NORM_RTOL)


@pytest.mark.parametrize("saved_early", [True, False], ids=["saved_early", "saved_after"])
def test_a_run_resumes_across_the_option(tmp_path, saved_early):
    """Steps 4-6 resumed from step 3 with the option flipped equal those of the run that saved."""
    checkpoints = ["--checkpoint.enable", "--checkpoint.interval", "3"]
    first = str(tmp_path / "first")
    launch_train(first, 1, *RUN, *checkpoints, *(EARLY if saved_early else []))
    shutil.copytree(os.path.join(first, "checkpoint", "step-3"), str(tmp_path / "second" / "checkpoint" / "step-3"))
    second = str(tmp_path / "second")
    result = launch_train(second, 1, *RUN, *checkpoints, *([] if saved_early else EARLY))
    assert resumed_from(result.stderr) == [3]
    tail = {r["step"]: r["loss"] for r in read_metrics(second)}
    assert tail == {r["step"]: r["loss"] for r in read_metrics(first) if r["step"] > 3}
