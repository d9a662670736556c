"""SimpleFSDP compiled: collective counts, bucket order, prefetch order and resharding read from
the compiled graphs, and losses against eager (see compile_checks.py for each check)."""

from pathlib import Path

import pytest

from parallelisms import torch_release
from tests.launch import (
    TINY_RUN,
    TRAIN_AND_REPORT,
    TWO_BLOCKS,
    compile_reports,
    launch_train,
    losses,
    read_metrics,
    run_worker,
)

pytestmark = pytest.mark.slow  # every test here launches torchrun / run_train.sh

AOT_EAGER_CHECKS = [
    "none_counts",
    "none_losses",
    "none_one_reduction_in_flight",
    "manual_counts",
    "manual_losses",
    "manual_bucket_order",
    "manual_blocks_share_two_regions",
    "manual_prefetch_order",
    "manual_one_reduction_in_flight",
    "reshard_regathers",
    "reshard_frees_gathered",
    "block_graph_reused",
    "block_counts",
    "block_losses",
    "block_prefetch_order",
    "block_one_reduction_in_flight",
    "auto_plan_has_multi_unit_bucket",
    "auto_counts",
    "auto_losses",
    "never_no_regather",
    "never_keeps_gathered",
    "never_losses",
]
# Inductor runs the bucketing, resharding and block checks, not the unbucketed graph's, the auto
# plan's or `never`'s (each of those an Inductor compile of the whole model, about a minute here);
# then it reads the order of the code it generated, which its own scheduling could change.
INDUCTOR_CHECKS = [
    *AOT_EAGER_CHECKS[
        AOT_EAGER_CHECKS.index("manual_counts") : AOT_EAGER_CHECKS.index("auto_plan_has_multi_unit_bucket")
    ],
    *("manual_code_prefetch", "manual_code_reduction_overlap", "manual_code_one_transfer_at_a_time"),
    *("manual_code_reduction_freed_at_wait", "manual_code_reduction_made_after_previous_wait"),
    *("block_code_prefetch", "block_code_reduction_overlap", "block_code_one_transfer_at_a_time"),
    *("block_code_reduction_freed_at_wait", "block_code_reduction_made_after_previous_wait"),
]


@pytest.mark.parametrize("backend, expected", [("aot_eager", AOT_EAGER_CHECKS), ("inductor", INDUCTOR_CHECKS)])
def test_compiled_simple_fsdp(backend, expected):
    # The graph cache would skip our pass on a hit, and the checks read what the pass saw.
    output = run_worker("compile_checks.py", 2, backend, env={"TORCHINDUCTOR_FX_GRAPH_CACHE": "0"})
    passed = [line.split()[1] for line in output.splitlines() if line.startswith("CHECK ")]
    assert passed == expected


RESTARTS = {
    # SimpleFSDP's graphs hold its DeviceMesh and its gathers' annotations; a block's graph also
    # holds the op-level checkpoint's policy.
    "simple_fsdp_block": (
        2,
        [
            *("--training.local_batch_size", "4", "--parallelism.data_parallel_impl", "simple_fsdp"),
            *("--compile.bucketing", "block", "--activation_checkpoint.mode", "selective"),
            *("--activation_checkpoint.selective_ac_option", "op"),
        ],
    ),
    # The whole model, its blocks' attention and feed-forward as nested compile regions.
    "simple_fsdp_regions": (
        2,
        [
            *("--training.local_batch_size", "4", "--parallelism.data_parallel_impl", "simple_fsdp"),
            *("--compile.bucketing", "manual"),
        ],
    ),
}


@pytest.fixture(scope="module")
def restarts(tmp_path_factory) -> tuple[Path, dict[str, list[list[tuple[int, int]]]]]:
    """Both layouts compiled under Inductor and started twice on one Inductor cache folder (as a
    restart of the job would be), the two layouts one after the other in each start's processes
    (train_and_report.py resets dynamo between them): per layout, each start's (AOT graphs, AOT
    cache hits) per rank; and the folder of the starts' dump folders (``start/layout``)."""
    root = tmp_path_factory.mktemp("restarts")
    env = {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}
    common = [*TWO_BLOCKS, *("--training.steps", "2", "--lr_scheduler.warmup_steps", "1"), "--compile.enable"]
    (nproc,) = {ranks for ranks, _ in RESTARTS.values()}
    found: dict[str, list[list[tuple[int, int]]]] = {name: [] for name in RESTARTS}
    for start in ("first", "second"):
        (first, *others) = [(str(root / start / name), [*common, *layout]) for name, (_, layout) in RESTARTS.items()]
        more = [arg for folder, run in others for arg in ("---", *TINY_RUN, "--job.dump_folder", folder, *run)]
        result = launch_train(first[0], nproc, *first[1], *more, script=TRAIN_AND_REPORT, env=env)
        for run, name in enumerate(RESTARTS):
            found[name].append([(r["aot_graphs"], r["aot_cache_hits"]) for r in compile_reports(result.stdout, run)])
    return root, found


@pytest.mark.parametrize("name", RESTARTS)
def test_a_restart_takes_its_graphs_from_the_compile_caches(name, restarts):
    """Compiled under Inductor and started twice on one Inductor cache folder (as a restart of the
    job would be): the second start takes both graphs (a block's, the loss's) from torch's AOT
    autograd cache instead of compiling them. The keys pickle SimpleFSDP's DeviceMesh, whose hash
    changed from process to process (parallelisms/parallel_dims.py), and torch skips the cache for a
    graph holding a selective checkpoint whose context has no cache hash: every start missed."""
    nproc, _ = RESTARTS[name]
    root, found = restarts
    # torch 2.11 takes one of the two graphs from its cache, from 2.13 both.
    hits = 2 if torch_release.RELEASE >= (2, 13) else 1
    # The first start compiles both graphs, but for a later layout the loss's, which the layout
    # before it compiled in the same processes.
    first_hits = 0 if name == next(iter(RESTARTS)) else 1
    assert found[name] == [[(2, first_hits)] * nproc, [(2, hits)] * nproc]
    # The graphs taken from the cache train as the compiled ones did.
    first, second = (losses(read_metrics(str(root / start / name))) for start in ("first", "second"))
    assert first == second
