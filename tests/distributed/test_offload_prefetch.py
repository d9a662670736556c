"""CPU offload and prefetch limits change where state lives and when gathers run, not the math: on
2 CPU ranks (float32) the losses equal those of the same run without them, bitwise, for FSDP2 and
SimpleFSDP (eager and compiled with aot_eager). On CPU ranks host and device memory are one, so
offload is checked for its numerics here; its memory is the dry run's (tests/unit/test_offload_dry_run.py)."""

import pytest

from tests.launch import TWO_BLOCKS, RunBatch, losses

pytestmark = pytest.mark.slow  # one launch of 2 ranks training ten runs, three of them compiled

OFFLOAD = ["--training.enable_cpu_offload"]
SIMPLE = ["--parallelism.data_parallel_impl", "simple_fsdp"]
COMPILED = [*SIMPLE, "--compile.enable", "--compile.backend", "aot_eager", "--compile.bucketing", "manual"]


def _prefetch(ahead: str) -> list[str]:
    return ["--parallelism.fsdp_forward_prefetch", ahead, "--parallelism.fsdp_backward_prefetch", ahead]


RUNS = {
    "fsdp2": [],
    "fsdp2_offload": OFFLOAD,
    "simple_fsdp": SIMPLE,
    "simple_fsdp_offload": [*SIMPLE, *OFFLOAD],
    "fsdp2_prefetch_1": _prefetch("1"),
    "fsdp2_prefetch_2": _prefetch("2"),
    "fsdp2_prefetch_all": _prefetch("-1"),
    "compiled_prefetch_1": [*COMPILED, *_prefetch("1")],
    "compiled_prefetch_2": [*COMPILED, *_prefetch("2")],
    # Offloaded too: the shard's copy to the device is traced with the gathers.
    "compiled_prefetch_all_offload": [*COMPILED, *_prefetch("-1"), *OFFLOAD],
}
# Manual buckets of the two-block model: tok_embeddings, layers.0, layers.1, norm + output.
FORWARD_BUCKETS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> RunBatch:
    common = ["--training.local_batch_size", "4", *TWO_BLOCKS]
    return RunBatch(
        str(tmp_path_factory.mktemp("offload_prefetch")), {name: (2, [*common, *extra]) for name, extra in RUNS.items()}
    )


def test_offloaded_runs_equal_the_runs_without(runs):
    base = losses(runs.records("fsdp2"))
    assert len(base) == 10 and base[-1] < base[0]
    assert losses(runs.records("fsdp2_offload")) == base
    assert losses(runs.records("simple_fsdp_offload")) == losses(runs.records("simple_fsdp")) == base
    for name in ("fsdp2_offload", "simple_fsdp_offload", "compiled_prefetch_all_offload"):
        assert "CPU offload: sharded weights, gradients and optimizer state in host memory" in runs.log(name)
        # Every parameter's wrapper keeps it in host memory (on CPU ranks, the same memory).
        assert all(r["offloaded"] == r["parameters"] > 0 for r in runs.reports(name)), name
    assert "CPU offload" not in runs.log("fsdp2")
    assert all(r["offloaded"] == 0 for name in ("fsdp2", "simple_fsdp") for r in runs.reports(name))


def test_prefetch_limits_leave_the_losses_bitwise(runs):
    base = losses(runs.records("fsdp2"))
    for name in RUNS:
        if "prefetch" in name:
            assert losses(runs.records(name)) == base, name


def test_compiled_forward_issues_as_many_gathers_ahead_as_the_limit(runs):
    """The forward graph (the first the pass rewrites) holds 1, 2 or all other buckets' all-gathers in
    flight while one is waited for. Backward re-gathers the two blocks: with limit 1 the second is issued
    beside the first block's compute, after the first's wait; with more both are issued at its start."""
    for name, ahead in [("1", 1), ("2", 2), ("all_offload", FORWARD_BUCKETS - 1)]:
        forward, backward = runs.reports(f"compiled_prefetch_{name}")[0]["graph_passes"][0]
        assert forward["ahead"] == ahead, name
        assert backward["ahead"] == (0 if ahead == 1 else 1), name
