"""Checkpoints across layouts and formats: a chain of resumes through four layouts against one
process, the Hugging Face export loaded back, a seed checkpoint loaded at another layout, and the
non-finite policies."""

from __future__ import annotations

import os
import subprocess

import pytest

from config.job_config import CHECKPOINT_PARTS
from tests.launch import (
    REPO,
    TWO_BLOCKS,
    launch_train,
    losses_by_step,
    read_metrics,
    resumed_from,
    run_train,
    steps,
    train_command,
    unloadable_checkpoints,
)
from trainer.checkpoint.integrity import complete_checkpoints

pytestmark = pytest.mark.slow  # every test here launches torchrun / run_train.sh

CONSTANT_LR = ["--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0"]
# Every run here: the debug model cut to 2 blocks (resharding does not depend on depth).
SMALL = [*CONSTANT_LR, *TWO_BLOCKS]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]

# Global batch 8 throughout: local batch x data-parallel degree.
LAYOUT_CHAIN = [
    ["--training.local_batch_size", "2"],  # fsdp2 dp4
    ["--training.local_batch_size", "4", *TP2, "--parallelism.data_parallel_impl", "simple_fsdp"],
    ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "4"],
    ["--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2"],  # fsdp2 pp2 x dp2
]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted single-process run the other layouts are held to."""
    dump = str(tmp_path_factory.mktemp("one_process"))
    return losses_by_step(run_train(dump, 1, "--training.steps", str(2 * len(LAYOUT_CHAIN)), *SMALL))


def assert_close(actual: dict[int, float], expected: dict[int, float], rel: float) -> None:
    assert actual.keys() == expected.keys()
    for step in actual:
        assert abs(actual[step] - expected[step]) <= rel * abs(expected[step]), (step, actual[step], expected[step])


@pytest.fixture(scope="module")
def layout_chain(tmp_path_factory) -> tuple[str, list[tuple[str, list[dict]]]]:
    """dp4 -> SimpleFSDP dp2 x tp2 -> tp4 -> pp2 x dp2, two steps each, every run resuming the
    previous one's checkpoint; the last one also exports to Hugging Face's layout. Returns the
    dump folder and, per run, its output and the metrics.jsonl records it appended."""
    dump = str(tmp_path_factory.mktemp("chain"))
    launches = []
    for i, layout in enumerate(LAYOUT_CHAIN):
        last = i == len(LAYOUT_CHAIN) - 1
        logged_before = len(read_metrics(dump)) if i else 0
        result = launch_train(
            dump,
            4,
            "--training.steps",
            str(2 * (i + 1)),
            *SMALL,
            "--checkpoint.enable",
            "--checkpoint.interval",
            "2",
            *layout,
            *(["--checkpoint.export_hf"] if last else []),
        )
        launches.append((result.stdout + result.stderr, read_metrics(dump)[logged_before:]))
    return dump, launches


def test_resume_through_four_layouts_matches_one_process(layout_chain, one_process):
    """Model, optimizer and the global data position are resharded at every resume: the losses
    follow the uninterrupted single-process run within 1e-5 relative (reduction orders differ);
    a lost or repeated sample would change them far more. Every run after the first resumes the
    previous one's last checkpoint, all of it, and trains only its own two steps (a run that
    started over would log steps 1 and 2 again and still end on the same losses)."""
    dump, launches = layout_chain
    for i, (output, records) in enumerate(launches):
        if i:
            checkpoint = os.path.join(dump, "checkpoint", f"step-{2 * i}")
            assert resumed_from(output) == [2 * i], output[-3000:]
            assert f"loaded {', '.join(CHECKPOINT_PARTS)} from {checkpoint}" in output, output[-3000:]
        else:
            assert resumed_from(output) == []
        assert steps(records) == [2 * i + 1, 2 * i + 2], (i, records)
    assert unloadable_checkpoints(dump) == []
    assert_close(losses_by_step(read_metrics(dump)), one_process, 1e-5)


def test_hf_export_loads_back_like_the_dcp_checkpoint(tmp_path, layout_chain, one_process):
    """The export written by the pipelined run (each rank holding some blocks) and that run's own
    DCP checkpoint, each loaded as initial weights, train identically (fp32 export: bitwise)."""
    dump, _ = layout_chain
    hf = os.path.join(dump, "checkpoint", "hf")
    assert {"config.json", "model.safetensors"} <= set(os.listdir(hf))
    after = ["--training.steps", "2", *SMALL, "--checkpoint.initial_load_path"]
    from_hf = losses_by_step(run_train(str(tmp_path / "from_hf"), 1, *after, hf))
    dcp_folder = os.path.join(dump, "checkpoint", f"step-{2 * len(LAYOUT_CHAIN)}")
    from_dcp = losses_by_step(run_train(str(tmp_path / "from_dcp"), 1, *after, dcp_folder))
    assert from_hf == from_dcp
    assert from_dcp[1] != one_process[1]  # the trained weights were loaded, not the initial ones


def test_seed_checkpoint_loads_at_another_layout(tmp_path, one_process):
    seed_dump = str(tmp_path / "seed")
    run_train(
        seed_dump, 1, *TWO_BLOCKS, "--debug.seed", "7", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"
    )
    seed = os.path.join(seed_dump, "checkpoint", "step-0")
    assert sorted(os.listdir(seed))[:2] == [".metadata", "__0_0.distcp"]

    common = ["--training.steps", "3", *SMALL, "--checkpoint.initial_load_path", seed]
    at_tp2 = losses_by_step(run_train(str(tmp_path / "tp2"), 4, *common, "--training.local_batch_size", "4", *TP2))
    one = losses_by_step(run_train(str(tmp_path / "one"), 1, *common))
    assert_close(at_tp2, one, 1e-5)
    assert one_process[1] != one[1]  # the weights did come from the seed-7 checkpoint


def test_nonfinite_policies(tmp_path, one_process):
    """NaN gradients at step 3. skip_step drops that update and batch; rollback to the step-2
    checkpoint, going on past the bad batch, must end in exactly the same place; error stops
    with one line, once the step-2 save still in the background is complete (else it would be left
    without its marker, and a restart would resume from the step before)."""
    common = ["--training.steps", "5", *SMALL, "--debug.fail_at_step", "3", "--debug.failure", "nan"]
    clean = one_process  # a constant learning rate: the run's length does not matter
    skipped = losses_by_step(run_train(str(tmp_path / "skip"), 1, *common, "--training.nonfinite_policy", "skip_step"))
    rolled = losses_by_step(
        run_train(
            str(tmp_path / "rollback"),
            1,
            *common,
            "--training.nonfinite_policy",
            "rollback",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "2",
        )
    )
    assert skipped == rolled
    assert [skipped[s] for s in (1, 2)] == [clean[s] for s in (1, 2)] and skipped[3] != clean[3]

    saving = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async"]
    result = subprocess.run(
        train_command(str(tmp_path / "error"), 1, *common, *saving),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "error: non-finite loss" in result.stderr and "at step 3 (training.nonfinite_policy=error)" in result.stderr
    assert "Traceback" not in result.stderr
    assert complete_checkpoints(str(tmp_path / "error" / "checkpoint")) == [
        (2, str(tmp_path / "error" / "checkpoint" / "step-2"))
    ]
