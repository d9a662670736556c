"""SimpleFSDP x tensor parallel (dp2 x tp2, 4 ranks) compiled with bucketed collectives: the whole
model (manual buckets) or each block on its own (block buckets).

Only the data-parallel collectives are bucketed; TP's collectives on activations stay one per
tensor (see parallelisms/bucketing.py). Manual buckets give the losses and gradient norms of one
process training on the same global batch, and the compiled graphs hold one data-parallel
all-gather and one reduce-scatter per bucket: 4 (one per block, tok_embeddings, norm + output)
where bucketing none has one per parameter, 21. The counts are read from the graph pass's reports
of the trained model itself (tests/distributed/train_and_report.py runs train.py's Trainer).
Both layouts are checked against one reference run; they train one after the other in one launch.
"""

from __future__ import annotations

import pytest

from tests.launch import GRAD_NORM_RTOL, TWO_BLOCKS, RunBatch, losses

pytestmark = pytest.mark.slow  # every test here launches torchrun / run_train.sh

STEPS = [
    *("--training.steps", "5", "--lr_scheduler.warmup_steps", "2", "--training.global_batch_size", "8"),
    *TWO_BLOCKS,  # the whole model's graph, and its compile time, grow with depth
]
# Two blocks of 9 parameters, tok_embeddings, norm and output.
PARAMETERS = 2 * 9 + 3
BUCKETS = 2 + 2  # the default manual buckets: each block, tok_embeddings, norm + output


DP2_TP2 = [
    *("--training.local_batch_size", "4", "--parallelism.data_parallel_impl", "simple_fsdp"),
    *("--parallelism.tensor_parallel_degree", "2", "--compile.enable"),
]


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> RunBatch:
    """One process training on the same global batch ("reference"), and both dp2 x tp2 SimpleFSDP
    runs, compiled with manual buckets (aot_eager) and with block buckets (Inductor), one after the
    other in one 4-rank launch."""
    runs = {
        "reference": (1, [*STEPS, "--training.local_batch_size", "8"]),
        "manual": (4, [*STEPS, *DP2_TP2, "--compile.backend", "aot_eager", "--compile.bucketing", "manual"]),
        "block": (4, [*STEPS, *DP2_TP2, "--compile.bucketing", "block"]),
    }
    return RunBatch(str(tmp_path_factory.mktemp("dp2_tp2")), runs)


def dp2_tp2_reports(batch: RunBatch, name: str) -> list[dict]:
    """Every rank's compile report of the dp2 x tp2 run ``name``."""
    reports = batch.reports(name)
    assert [r["rank"] for r in reports] == [0, 1, 2, 3], reports
    return reports


def tp_collectives(forward: dict) -> dict[str, int]:
    """A forward graph's collectives that are not data-parallel (TP's), by kind."""
    tp = {kind: n - forward["data_parallel"].get(kind, 0) for kind, n in forward["collectives"].items()}
    return {kind: n for kind, n in tp.items() if n}


def assert_matches_reference(batch: RunBatch, name: str) -> list[dict]:
    records, reference = batch.records(name), batch.records("reference")
    assert len(records) == len(reference) == 5
    # Measured (manual): losses within 6.1e-8 (the reductions sum in another order), gradient norms 8.5e-5.
    for key, rtol in (("loss", 1e-5), ("grad_norm", GRAD_NORM_RTOL)):
        got, expected = [r[key] for r in records], [r[key] for r in reference]
        assert max(abs(a - b) / abs(b) for a, b in zip(got, expected)) <= rtol, (key, got, expected)
    return records


def test_manual_buckets_match_single_process(batch):
    for report in dp2_tp2_reports(batch, "manual"):
        assert report["parameters"] == PARAMETERS and report["compiled_parts"] == 1, report
        assert report["graph_breaks"] == 0, report
        # One pass (the whole model), run on one forward and one backward graph.
        ((forward, backward),) = report["graph_passes"]
        # On gloo each bucket's gather is one broadcast per data-parallel rank (2 here).
        assert forward["data_parallel"] == {"broadcast": 2 * BUCKETS}, report
        # Backward re-gathers the blocks' buckets (not tok_embeddings', whose backward needs no
        # weight, nor norm + output's, kept gathered after forward) and reduces every bucket's
        # gradients (on gloo an all-to-all: parallelisms/bucketing.py).
        assert backward["data_parallel"] == {"broadcast": 2 * (BUCKETS - 2), "all_to_all": BUCKETS}, report
        # TP's own collectives stay one per tensor: sequence parallel gathers each norm's output
        # (2 per block and the final norm's) and reduce-scatters each block's two output
        # projections and the embedding's output.
        assert tp_collectives(forward) == {"all_gather": 5, "reduce_scatter": 5}, report
    bucketed = assert_matches_reference(batch, "manual")
    assert losses(bucketed)[-1] < losses(bucketed)[0]


def test_block_buckets_match_single_process(batch):
    """Each block compiled on its own, its attention and feed-forward one bucket each. The pass
    must not take tensor parallelism's all-reduce of the block input's gradient (a graph output,
    as parameters' gradients are) for a data-parallel reduction and merge TP's all-reduces into
    one bucket."""
    for report in dp2_tp2_reports(batch, "block"):
        # One block graph, compiled once for all blocks: its forward and its backward.
        ((forward, backward),) = report["graph_passes"]
        # Two buckets, each gathered as one broadcast per data-parallel rank; in backward both
        # re-gathered and both reduced (one all-to-all each).
        assert forward["data_parallel"] == {"broadcast": 4}, report
        assert backward["data_parallel"] == {"broadcast": 4, "all_to_all": 2}, report
        # TP's collectives stay one per tensor: the block's two norms' outputs gathered, its two
        # output projections reduce-scattered.
        assert tp_collectives(forward) == {"all_gather": 2, "reduce_scatter": 2}, report
    assert_matches_reference(batch, "block")
