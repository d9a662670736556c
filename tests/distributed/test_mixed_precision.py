"""bf16 parameters with fp32 gradient reduction (torchtitan's default precision) through train.py:
every data-parallel layout gives the losses of one process in the same precision on the same
global batch, and FSDP2 with Inductor per-block compile (the GPU default) gives eager FSDP2's.

One process applies mixed precision through FSDP2 over its one rank (tests/unit/
test_mixed_precision.py checks the casts). Tensor or pipeline parallelism alone casts nothing, so
TP and PP are checked composed with FSDP2 on 4 ranks: FSDP2 x TP 2 (FSDP2 casting TP's DTensor
parameters on the 2-D mesh) and PP 2 x FSDP2 (bf16 activations between stages). They stand for
PP 2 x DP 2 x TP 2, which needs 8 ranks.

Launches (about 15-60 s each on 2 CPU cores): the reference, FSDP2, SimpleFSDP eager and compiled
with aot_eager on 2 ranks, HSDP 2 x 2, FSDP2 x TP 2 and PP 2 x FSDP2 on 4 ranks, FSDP2 with
Inductor on 2 ranks.
"""

from __future__ import annotations

import pytest

from tests.launch import RunBatch, losses

pytestmark = pytest.mark.slow  # every test here launches torchrun

GLOBAL_BATCH = ["--training.global_batch_size", "8"]
BF16 = ["--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "float32"]
SIMPLE_FSDP = ["--parallelism.data_parallel_impl", "simple_fsdp"]

LAYOUTS = {
    # name: (ranks, overrides)
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "simple_fsdp": (2, ["--training.local_batch_size", "4", *SIMPLE_FSDP]),
    "simple_fsdp_aot_eager": (
        2,
        ["--training.local_batch_size", "4", *SIMPLE_FSDP, "--compile.enable", "--compile.backend", "aot_eager"],
    ),
    "hsdp_2x2": (4, ["--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2"]),
    "fsdp2_x_tp2": (4, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    "pp2_x_fsdp2": (
        4,
        [
            "--training.local_batch_size",
            "2",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
        ],
    ),
    # Per-block compile with the default backend, Inductor.
    "fsdp2_inductor": (2, ["--training.local_batch_size", "4", "--compile.enable"]),
}

# bf16 rounds each rank's partial gradient (and TP's partial activations) where one process rounds
# the whole sum, so losses drift apart by rounding, not by a bug. Measured on 2026-11-23 over the 10
# steps, largest relative difference to one process: FSDP2 5.5e-5, SimpleFSDP eager and aot_eager
# 3.6e-5 (equal to each other), HSDP 2.8e-5, FSDP2 x TP 2 3.7e-5, PP 2 x FSDP2 2.5e-5, FSDP2 +
# Inductor 7.0e-5 (6.7e-5 to eager FSDP2). The fp32 run is 1.6e-4 from the bf16 one. A wrong
# reduction (a rank's gradient lost, averaged instead of summed) is off by 1e-3 and more.
TOLERANCE = 3e-4
MIXED_PRECISION_LINE = "mixed precision: bfloat16 parameters in forward and backward, gradients reduced in float32"


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """``bf16_run(name)``: the losses of that layout ("reference": one process), trained once per
    module in one launch per world size; checks that the run said it casts."""
    runs = {"reference": (1, ["--training.local_batch_size", "8"]), **LAYOUTS}
    batch = RunBatch(
        str(tmp_path_factory.mktemp("bf16")),
        {name: (nproc, [*overrides, *BF16, *GLOBAL_BATCH]) for name, (nproc, overrides) in runs.items()},
    )

    def get(name: str) -> list[float]:
        assert MIXED_PRECISION_LINE in batch.log(name)
        got = losses(batch.records(name))
        assert len(got) == 10 and got[-1] < got[0]
        return got

    return get


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "fsdp2_inductor"])
def test_bf16_losses_match_one_process(layout, bf16_run):
    assert bf16_run(layout) == pytest.approx(bf16_run("reference"), rel=TOLERANCE, abs=0)


def test_inductor_per_block_compile_matches_eager_in_bf16(bf16_run):
    assert bf16_run("fsdp2_inductor") == pytest.approx(bf16_run("fsdp2"), rel=TOLERANCE, abs=0)
    assert bf16_run("fsdp2_inductor") == pytest.approx(bf16_run("reference"), rel=TOLERANCE, abs=0)
