"""Context parallelism's options: the degrees with cp multiplying to the world size, and the
sequence lengths and torchtitan names, each a one-line mistake naming its option."""

import pytest

from config.errors import ConfigError
from config.manager import load_config
from config.rules import validate
from parallelisms.parallel_dims import ParallelDims


def test_cp_counts_among_the_degrees():
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, tp=2, pp=1, world_size=8, cp=2)
    assert (dims.dp_shard, dims.dp_degree) == (2, 2)
    assert dims.fsdp_enabled and dims.dp_cp_enabled
    # cp alone: no data parallelism (one batch), but the parameters shard over the cp ranks.
    alone = ParallelDims(dp_replicate=1, dp_shard=-1, tp=1, pp=1, world_size=4, cp=4)
    assert (alone.dp_shard, alone.dp_enabled, alone.fsdp_enabled, alone.dp_cp_enabled) == (1, False, True, True)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible .*cp 4"):
        ParallelDims(dp_replicate=1, dp_shard=-1, tp=1, pp=1, world_size=6, cp=4)
    with pytest.raises(ValueError, match=r"multiply to 8 \(shard 2 x replicate 1 x cp 4 .*world size is 4"):
        ParallelDims(dp_replicate=1, dp_shard=2, tp=1, pp=1, world_size=4, cp=4)


CP2 = ["--parallelism.context_parallel_degree", "2"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [*CP2, "--training.seq_len", "70"],
            "training.seq_len 70 does not split into 2 x parallelism.context_parallel_degree 2 equal chunks",
        ),
        (
            [*CP2, "--validation.enable", "--validation.seq_len", "34"],
            "validation.seq_len 34 does not split into 2 x parallelism.context_parallel_degree 2",
        ),
        (
            [*CP2, "--training.seq_len", "76", "--parallelism.tensor_parallel_degree", "4"],
            "training.seq_len 76: parallelism.context_parallel_degree 2 x tensor_parallel_degree 4 must divide it",
        ),
        (["--parallelism.context_parallel_degree", "0"], "parallelism.context_parallel_degree must be positive"),
    ],
)
def test_mistakes_are_one_line(argv, message):
    with pytest.raises(ConfigError) as error:
        validate(load_config(argv))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_valid_layouts_pass():
    validate(load_config([*CP2, "--training.seq_len", "72", "--parallelism.tensor_parallel_degree", "2"]))
    validate(load_config(["--training.seq_len", "65"]))  # without context parallelism any length
    validate(load_config([*CP2, "--compile.enable", "--compile.components", "loss"]))
    validate(load_config([*CP2, "--compile.enable"]))
    validate(load_config([*CP2, "--compile.enable", "--parallelism.data_parallel_impl", "simple_fsdp"]))
    for mode in ("full", "selective"):
        validate(load_config([*CP2, "--activation_checkpoint.mode", mode]))


def test_torchtitan_names():
    """torchtitan's context parallel options are Tessera's; its load balancer is always head-tail here."""
    config = load_config(
        [*CP2, "--parallelism.context_parallel_rotate_method", "alltoall"]
        + ["--parallelism.context_parallel_load_balancer", "headtail"]
    )
    assert config.parallelism.context_parallel_degree == 2
    assert config.parallelism.context_parallel_rotate_method == "alltoall"
