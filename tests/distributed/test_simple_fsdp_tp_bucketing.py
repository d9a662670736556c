"""SimpleFSDP x tensor parallel (dp2 x tp2, 4 ranks) compiled whole-model with bucketed collectives.

Only the data-parallel collectives are bucketed; TP's collectives on activations stay one per
tensor (see parallelisms/bucketing.py). Manual buckets give the losses of one process training on
the same global batch. (They also equal bucketing none's bitwise: checked by hand, 8 all-gathers
and 8 reduce-scatters instead of 57 each; a third launch costs a minute.)
"""

from __future__ import annotations

import pytest

from tests.launch import losses, run_train

pytestmark = pytest.mark.slow  # every test here launches torchrun / run_train.sh

STEPS = ["--training.steps", "5", "--lr_scheduler.warmup_steps", "2", "--training.global_batch_size", "8"]


def test_manual_buckets_match_single_process(tmp_path):
    reference = losses(run_train(str(tmp_path / "one"), 1, *STEPS, "--training.local_batch_size", "8"))
    bucketed = losses(
        run_train(
            str(tmp_path / "bucketed"),
            4,
            *STEPS,
            "--training.local_batch_size",
            "4",
            "--parallelism.data_parallel_impl",
            "simple_fsdp",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--compile.enable",
            "--compile.backend",
            "aot_eager",
            "--compile.bucketing",
            "manual",
        )
    )
    assert len(bucketed) == len(reference) == 5
    # Measured: within 6.1e-8 (the reductions sum in another order).
    assert max(abs(a - b) / abs(b) for a, b in zip(bucketed, reference)) <= 1e-5, (bucketed, reference)
