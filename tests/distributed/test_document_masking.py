"""Document masking through the Trainer on gloo ranks: in every parallel layout (one process,
FSDP2, SimpleFSDP, tensor and pipeline parallel, compiled), step 1's loss of windows of packed
documents equals the token-weighted mean of each document's loss run alone, and its gradient norm
that of the documents alone; without masking the loss is the causal model's, bitwise on one process.

Two launches (1 and 2 ranks) of tests/distributed/document_masking_run.py, which feeds the
Trainer windows it packs itself (the loader's Batch), ~1-2 min on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.launch import FOUR_BLOCKS, GRAD_NORM_RTOL, REPO, TINY_RUN, read_metrics, train_command, train_env

pytestmark = pytest.mark.slow  # launches torchrun

WORKER = os.path.join("tests", "distributed", "document_masking_run.py")
STEPS = ["--training.steps", "2", "--training.global_batch_size", "4"]
MASKING = ["--training.document_masking", "on"]
COMPILED = ["--compile.enable", "--compile.backend", "aot_eager"]
SIMPLE_FSDP = ["--parallelism.data_parallel_impl", "simple_fsdp"]
PP2 = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.pipeline_parallel_schedule",
    "1F1B",
    "--parallelism.pipeline_parallel_microbatch_size",
    "2",
]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]

RUNS = {
    # name: (ranks, overrides)
    "one_process": (1, ["--training.local_batch_size", "4", *MASKING]),
    "one_process_off": (1, ["--training.local_batch_size", "4", "--training.document_masking", "off"]),
    # torchtitan's flavor turns masking on by itself ("auto").
    "one_process_compiled": (
        1,
        [
            "--training.local_batch_size",
            "4",
            "--model.flavor",
            "debugmodel_flex_attn",
            "--model.n_layers",
            "4",
            *COMPILED,
        ],
    ),
    # Two corpora: the windows' sources, whose tokens the metrics count on all DP ranks.
    "fsdp2": (2, ["--training.local_batch_size", "2", *MASKING, "--training.datasets", "web,code"]),
    "fsdp2_compiled": (2, ["--training.local_batch_size", "2", *MASKING, *COMPILED]),
    "simple_fsdp": (2, ["--training.local_batch_size", "2", *MASKING, *SIMPLE_FSDP]),
    "simple_fsdp_compiled": (2, ["--training.local_batch_size", "2", *MASKING, *SIMPLE_FSDP, *COMPILED]),
    "tp2": (2, ["--training.local_batch_size", "4", *MASKING, *TP2]),
    "pp2": (2, ["--training.local_batch_size", "4", *MASKING, *PP2]),
}
LAYOUTS = [name for name in RUNS if name != "one_process_off"]


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """``run_folder(name)``: the dump folder of that run, after its launch (one per world size)."""
    root = str(tmp_path_factory.mktemp("document_masking"))
    launched: dict[int, None] = {}

    def folder(name: str) -> str:
        nproc = RUNS[name][0]
        if nproc not in launched:
            batch = []
            for other, (ranks, overrides) in RUNS.items():
                if ranks == nproc:
                    layers = [] if "--model.n_layers" in overrides else FOUR_BLOCKS
                    batch += ["---", *TINY_RUN, "--job.dump_folder", os.path.join(root, other), *STEPS, *layers]
                    batch += overrides
            command = train_command(root, nproc, script=WORKER)
            command = command[: command.index(WORKER) + 1] + batch[1:]
            result = subprocess.run(command, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=900)
            assert result.returncode == 0, (
                f"{nproc}-rank launch failed:\n{result.stdout[-2000:]}\n{result.stderr[-6000:]}"
            )
            launched[nproc] = None
        return os.path.join(root, name)

    return folder


def step_one(folder: str) -> tuple[dict, dict]:
    """(step 1's metrics record, the one-process reference)."""
    with open(os.path.join(folder, "reference.json")) as f:
        return read_metrics(folder)[0], json.load(f)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_packed_windows_loss_is_the_token_weighted_mean_of_its_documents_alone(layout, run_folder):
    record, reference = step_one(run_folder(layout))
    assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-5)
    assert record["grad_norm"] == pytest.approx(reference["grad_norm"], rel=GRAD_NORM_RTOL)
    # The documents do see each other without the mask: the reference tells the two apart.
    assert abs(reference["plain_loss"] - reference["loss"]) > 1e-4


def test_without_masking_the_loss_is_the_causal_models_bitwise(run_folder):
    record, reference = step_one(run_folder("one_process_off"))
    assert record["loss"] == reference["plain_loss"]


def test_the_metrics_count_each_sources_trained_tokens_over_the_data_parallel_ranks(run_folder):
    """Two corpora on 2 DP ranks, each rank holding windows of both: the logged counts are the
    global batch's trained labels per source (its documents' tokens less their first)."""
    record, reference = step_one(run_folder("fsdp2"))
    assert record["tokens_per_source"] == reference["tokens_per_source"]
    assert sum(reference["tokens_per_source"].values()) < 4 * 64  # ignored labels are not counted
