"""Every data-parallel layout gives the losses of one process training on the same global batch."""

import pytest

from tests.launch import losses, run_train

GLOBAL_BATCH = ["--training.global_batch_size", "8"]

LAYOUTS = {
    # name: (ranks, overrides)
    "fsdp2_2": (2, ["--training.local_batch_size", "4"]),
    "fsdp2_2_grad_accum": (2, ["--training.local_batch_size", "2"]),
    "ddp_2": (2, ["--training.local_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2"]),
    "fsdp2_4": (4, ["--training.local_batch_size", "2"]),
    "hsdp_2x2": (4, ["--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2"]),
    "ddp_4": (
        4,
        [
            "--training.local_batch_size", "2",
            "--parallelism.data_parallel_replicate_degree", "4",
            "--parallelism.data_parallel_shard_degree", "1",
        ],
    ),
}


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("reference"))
    return losses(run_train(folder, 1, "--training.local_batch_size", "8", *GLOBAL_BATCH))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_losses_match_single_process(layout, reference_losses, tmp_path):
    nproc, overrides = LAYOUTS[layout]
    got = losses(run_train(str(tmp_path), nproc, *overrides, *GLOBAL_BATCH))
    assert len(got) == len(reference_losses) == 10
    assert got == pytest.approx(reference_losses, rel=1e-5, abs=0)
    # The model must actually learn, or equal losses would prove little.
    assert got[-1] < got[0]
