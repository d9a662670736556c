"""model.converters = ["float8"] through train.py (torchao's Float8Linear): float8 training is
not the high-precision run, stays within a small tolerance of it, and every layout trains the
float8 losses of one process.

One process with two microbatches of 4 sequences and 2 ranks with 4 each scale the same
activations (tensorwise scales are per microbatch), so the layouts agree with it bitwise or
within float32 summation order. FSDP2's float8 all-gather (casting each shard with the whole
weight's scale, and with the scales precomputed after the optimizer step) gives the losses of
gathering in float32 and casting after, bitwise, and resumes from its checkpoint bitwise.
Launches: 2 runs on 1 process, 5 on 2 ranks, and two resumes on 2 ranks.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.launch import TWO_BLOCKS, RunBatch, launch_train, losses, read_metrics, resumed_from, unloadable_checkpoints

pytestmark = pytest.mark.slow  # every test here launches torchrun

STEPS = 6
RUN = [
    *("--training.steps", str(STEPS)),
    *TWO_BLOCKS,
    "--training.global_batch_size",
    "8",
    "--training.local_batch_size",
    "4",
]
# Emulated: torch._scaled_mm's CPU kernel is correct but takes about 0.9 s for one 256 x 256 product on
# some hosts (AMX); emulation multiplies the same float8-rounded values in float32.
FLOAT8 = ["--model.converters", "float8", "--float8.filter_fqns", "output", "--float8.emulate"]
ALL_GATHER = ["--float8.enable_fsdp_float8_all_gather", "--float8.precompute_float8_dynamic_scale_for_fsdp"]
CHECKPOINTS = ["--checkpoint.enable", "--checkpoint.interval", "3"]
RUNS = {
    "reference": (1, [*RUN]),
    "one": (1, [*RUN, *FLOAT8]),
    "fsdp2": (2, [*RUN, *FLOAT8]),
    "fsdp2_all_gather": (2, [*RUN, *FLOAT8, *ALL_GATHER, *CHECKPOINTS]),
    "tp": (
        2,
        [*RUN, *FLOAT8, "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    ),
    "simple_fsdp": (2, [*RUN, *FLOAT8, "--parallelism.data_parallel_impl", "simple_fsdp"]),
    "fsdp2_compiled": (2, [*RUN, *FLOAT8, "--compile.enable"]),
}


# Relative loss differences: float8 against float32 reaches 9e-5 within the six steps, the
# layouts against one float8 process 1.5e-5 (their gradients sum in another order, which can tip a
# value's float8 rounding the next step).
LAYOUT_RTOL = 3e-5


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> RunBatch:
    return RunBatch(str(tmp_path_factory.mktemp("float8")), RUNS)


def test_float8_training_differs_from_float32_within_a_small_tolerance(batch):
    one, reference = losses(batch.records("one")), losses(batch.records("reference"))
    # Two blocks of seven linear layers each; the output is filtered out.
    assert "float8 tensorwise: 14 linear layers converted" in batch.log("one")
    assert "linear layers converted" not in batch.log("reference")
    assert len(one) == STEPS
    # One process both: without float8 the runs are bitwise equal, so any difference is float8's.
    assert max(abs(a - b) / abs(b) for a, b in zip(one, reference)) > 1e-6
    assert one == pytest.approx(reference, rel=1e-3)


@pytest.mark.parametrize("layout", ["fsdp2", "simple_fsdp", "tp", "fsdp2_compiled"])
def test_every_layout_trains_the_float8_losses_of_one_process(batch, layout):
    assert losses(batch.records(layout)) == pytest.approx(losses(batch.records("one")), rel=LAYOUT_RTOL)


def test_compiled_blocks_run_float8_in_one_graph_each(batch):
    for report in batch.reports("fsdp2_compiled"):
        assert report["compiled_blocks"] == report["blocks"] == 2
        assert report["aot_graphs"] > 0 and report["graph_breaks"] == 0


def test_gathering_in_float8_gives_the_losses_of_gathering_in_float32(batch):
    assert losses(batch.records("fsdp2_all_gather")) == losses(batch.records("fsdp2"))


def test_a_run_gathering_in_float8_resumes_bitwise(batch, tmp_path):
    """Steps 4-6 resumed from the step-3 checkpoint equal those of the run that saved it."""
    saved = batch.folder("fsdp2_all_gather")
    shutil.copytree(os.path.join(saved, "checkpoint", "step-3"), str(tmp_path / "checkpoint" / "step-3"))
    result = launch_train(str(tmp_path), 2, *RUNS["fsdp2_all_gather"][1])
    assert resumed_from(result.stderr) == [3]
    tail = {r["step"]: r["loss"] for r in read_metrics(str(tmp_path))}
    assert tail == {r["step"]: r["loss"] for r in read_metrics(saved) if r["step"] > 3}


def test_a_run_without_float8_resumes_from_a_checkpoint_gathering_in_float8(batch, tmp_path):
    """The checkpoint holds the weights and optimizer state, not torchao's subclass around them: a
    float32 run loads it (a fresh start's step 4 would be near the first loss, 8.1) and trains on
    within float8's tolerance of the saving run."""
    saved = batch.folder("fsdp2_all_gather")
    shutil.copytree(os.path.join(saved, "checkpoint", "step-3"), str(tmp_path / "checkpoint" / "step-3"))
    result = launch_train(str(tmp_path), 2, *RUN, *CHECKPOINTS)
    assert resumed_from(result.stderr) == [3] and unloadable_checkpoints(str(tmp_path)) == []
    tail = [r["loss"] for r in read_metrics(str(tmp_path))]
    assert tail == pytest.approx([r["loss"] for r in read_metrics(saved) if r["step"] > 3], rel=1e-3)
