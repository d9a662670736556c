"""Context parallelism trains as one process does: the losses of every layout, both rotate methods,
FSDP2 and SimpleFSDP, eager and compiled, with activation checkpointing, causal and with document
masking, against one process on the same global batch (float32, 1e-5 relative); validation too; and
a checkpoint saved at cp 2 resumes at cp 1 and cp 4 on the uninterrupted run's losses."""

from __future__ import annotations

import json
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
    losses_by_step,
    read_metrics,
    resumed_from,
    steps,
    write_word_corpus,
)

pytestmark = pytest.mark.slow  # every test here launches torchrun

STEPS = 6
# Constant learning rate: a resumed run's schedule does not depend on where it started.
COMMON = [
    *TWO_BLOCKS,
    *("--training.steps", str(STEPS), "--training.global_batch_size", "4"),
    *("--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0"),
]
VALIDATION = ["--validation.enable", "--validation.freq", "3", "--validation.steps", "2"]
DOCUMENTS = ["--training.document_masking", "on"]
SIMPLE_FSDP = ["--parallelism.data_parallel_impl", "simple_fsdp"]
COMPILED = ["--compile.enable", "--compile.backend", "aot_eager"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]


def ac(mode: str, *more: str) -> list[str]:
    return ["--activation_checkpoint.mode", mode, *more]


def cp(degree: int, method: str, *more: str) -> list[str]:
    return [
        "--parallelism.context_parallel_degree",
        str(degree),
        "--parallelism.context_parallel_rotate_method",
        method,
        *more,
    ]


def local(batch: int) -> list[str]:
    return ["--training.local_batch_size", str(batch)]


# name: (ranks, overrides, reference). The global batch is 4 sequences of 64 tokens.
LAYOUTS = {
    "cp2": (2, [*local(4), *cp(2, "allgather"), *VALIDATION], "reference"),
    "cp2_alltoall_simple_fsdp": (2, [*local(4), *cp(2, "alltoall"), *SIMPLE_FSDP, *VALIDATION], "reference"),
    "cp2_documents": (2, [*local(4), *cp(2, "allgather"), *DOCUMENTS], "reference_documents"),
    "cp2_documents_alltoall": (2, [*local(4), *cp(2, "alltoall"), *DOCUMENTS], "reference_documents"),
    # Compiled: FSDP2 per block, SimpleFSDP the whole model.
    "cp2_compiled": (2, [*local(4), *cp(2, "allgather"), *COMPILED], "reference"),
    "cp2_alltoall_compiled": (2, [*local(4), *cp(2, "alltoall"), *COMPILED], "reference"),
    "cp2_alltoall_simple_fsdp_compiled": (2, [*local(4), *cp(2, "alltoall"), *SIMPLE_FSDP, *COMPILED], "reference"),
    "cp2_ac_full": (2, [*local(4), *cp(2, "allgather"), *ac("full")], "reference"),
    "cp2_ac_selective": (2, [*local(4), *cp(2, "allgather"), *ac("selective")], "reference"),
    "cp2_alltoall_ac_selective_op": (
        2,
        [*local(4), *cp(2, "alltoall"), *ac("selective", "--activation_checkpoint.selective_ac_option", "op")],
        "reference",
    ),
    "cp4": (4, [*local(4), *cp(4, "allgather")], "reference"),
    "cp4_alltoall": (4, [*local(4), *cp(4, "alltoall")], "reference"),
    "cp2_dp2": (4, [*local(2), *cp(2, "allgather")], "reference"),
    "cp2_dp2_alltoall_simple_fsdp": (4, [*local(2), *cp(2, "alltoall"), *SIMPLE_FSDP], "reference"),
    "cp2_dp2_simple_fsdp_compiled": (4, [*local(2), *cp(2, "allgather"), *SIMPLE_FSDP, *COMPILED], "reference"),
    "cp2_tp2_alltoall_compiled": (4, [*local(4), *cp(2, "alltoall"), *TP2, *COMPILED], "reference"),
    # HSDP: the parameters shard over cp within each replica.
    "cp2_replicate2_alltoall": (
        4,
        [*local(2), *cp(2, "alltoall"), "--parallelism.data_parallel_replicate_degree", "2"],
        "reference",
    ),
    "cp2_tp2": (4, [*local(4), *cp(2, "allgather"), *TP2], "reference"),
    "cp2_tp2_alltoall": (4, [*local(4), *cp(2, "alltoall"), *TP2], "reference"),
    "cp2_pp2_dp2": (8, [*local(2), *cp(2, "allgather"), "--parallelism.pipeline_parallel_degree", "2"], "reference"),
    "cp2_pp2_dp2_alltoall": (
        8,
        [*local(2), *cp(2, "alltoall"), "--parallelism.pipeline_parallel_degree", "2"],
        "reference",
    ),
    # The later stage's input holds half the rank's sequence (sequence parallel): its rotary rows still all of it.
    "cp2_tp2_pp2": (
        8,
        [*local(4), *cp(2, "allgather"), *TP2, "--parallelism.pipeline_parallel_degree", "2", *VALIDATION],
        "reference",
    ),
    "cp2_pp2_dp2_compiled": (
        8,
        [*local(2), *cp(2, "allgather"), "--parallelism.pipeline_parallel_degree", "2", *COMPILED],
        "reference",
    ),
}
SAVE_AT = 3
CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", str(SAVE_AT)]


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> str:
    """A .jsonl corpus of documents of 4 to 16 words: several in every window of 64 tokens."""
    return write_word_corpus(tmp_path_factory.mktemp("documents") / "short.jsonl", 400, (4, 16))


@pytest.fixture(scope="module")
def batch(tmp_path_factory, short_documents) -> RunBatch:
    """The references (one process) and every layout, in one launch per world size; the cp 2 run
    that saves a checkpoint for the resumes stops at step 3. Document masking trains on short
    documents (and one process without masking shows that it changes the losses)."""
    documents = ["--training.dataset", short_documents]
    runs = {
        "reference": (1, [*local(4), *VALIDATION]),
        "reference_documents": (1, [*local(4), *DOCUMENTS]),
        "reference_documents_off": (1, [*local(4), *documents]),
        **{name: (nproc, overrides) for name, (nproc, overrides, _) in LAYOUTS.items()},
        "cp2_saved": (2, [*local(4), *cp(2, "alltoall"), *CHECKPOINT, "--training.steps", str(SAVE_AT)]),
    }
    root = str(tmp_path_factory.mktemp("cp"))
    runs = {name: (nproc, [*o, *documents] if DOCUMENTS[0] in o else o) for name, (nproc, o) in runs.items()}
    return RunBatch(root, {name: (nproc, [*COMMON, *overrides]) for name, (nproc, overrides) in runs.items()})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_losses_match_single_process(layout, batch):
    reference = batch.records(LAYOUTS[layout][2])
    records = batch.records(layout)
    got = losses(records)
    assert len(got) == len(reference) == STEPS
    assert got == pytest.approx(losses(reference), rel=1e-5, abs=0)
    assert grad_norms(records) == pytest.approx(grad_norms(reference), rel=GRAD_NORM_RTOL, abs=0)
    assert got[-1] < got[0]
    if DOCUMENTS[0] in LAYOUTS[layout][1]:  # the masking is at work: without it, other losses
        assert losses(reference) != losses(batch.records("reference_documents_off"))
    if COMPILED[0] in LAYOUTS[layout][1]:
        _check_compiled(batch.reports(layout), SIMPLE_FSDP[1] in LAYOUTS[layout][1])
    if "--validation.enable" in LAYOUTS[layout][1]:
        expected = _validation(batch.folder("reference"))
        assert _validation(batch.folder(layout)) == pytest.approx(expected, rel=1e-5, abs=0)


def _check_compiled(reports: list[dict], simple_fsdp: bool) -> None:
    """Every rank compiled without a graph break: SimpleFSDP its model whole, FSDP2 each block."""
    for report in reports:
        assert report["aot_graphs"] > 0 and report["graph_breaks"] == 0, report
        if simple_fsdp:
            assert (report["compiled_parts"], report["compiled_blocks"]) == (1, 0), report
        else:
            assert report["compiled_blocks"] == report["blocks"] > 0 and report["compiled_parts"] == 0, report


def _validation(folder: str) -> list[float]:
    with open(os.path.join(folder, "validation.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.mark.parametrize("nproc", [1, 4])
def test_a_cp2_checkpoint_resumes_at_another_degree(nproc, batch, tmp_path):
    """Saved at step 3 by cp 2 (2 ranks), resumed by one process and by cp 4 (4 ranks): steps 4-6
    are the uninterrupted run's."""
    dump = str(tmp_path / "resumed")
    shutil.copytree(batch.folder("cp2_saved"), dump)
    logged_before = len(read_metrics(dump))
    overrides = [*COMMON, *local(4), *CHECKPOINT, *(cp(4, "allgather") if nproc == 4 else [])]
    result = launch_train(dump, nproc, *overrides)
    assert resumed_from(result.stdout + result.stderr) == [SAVE_AT]
    records = read_metrics(dump)[logged_before:]
    assert steps(records) == list(range(SAVE_AT + 1, STEPS + 1))
    expected = losses_by_step(batch.records("reference"))
    got = losses_by_step(records)
    assert list(got.values()) == pytest.approx([expected[step] for step in got], rel=1e-5, abs=0)
