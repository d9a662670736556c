"""training.enable_cpu_offload and the FSDP prefetch limits: what is refused in one line before the
ranks start, and which gathers each unit of FSDP2 prefetches."""

import pytest

from config.errors import ConfigError
from config.manager import load_config
from models.llama3.parallelize import check_offload
from parallelisms.fsdp2 import prefetch_plan
from parallelisms.parallel_dims import ParallelDims
from programs.preflight import check


def test_offload_needs_sharded_data_parallelism():
    """Refused before the ranks start (preflight's check); allowed with a shard degree above 1."""
    offload = load_config(["--training.enable_cpu_offload"])
    with pytest.raises(ConfigError, match=r"^training.enable_cpu_offload: needs sharded data parallelism"):
        check(offload, 1)
    with pytest.raises(ConfigError, match=r"^training.enable_cpu_offload: needs sharded data parallelism"):
        check_offload(ParallelDims(dp_replicate=2, dp_shard=1, tp=1, pp=1, world_size=2), offload)
    check_offload(ParallelDims(dp_replicate=1, dp_shard=2, tp=1, pp=1, world_size=2), offload)


@pytest.mark.parametrize("name", ["fsdp_forward_prefetch", "fsdp_backward_prefetch"])
def test_prefetch_limits_are_all_or_positive(name):
    with pytest.raises(ConfigError, match=rf"^parallelism.{name} must be -1 or positive, got 0$"):
        load_config([f"--parallelism.{name}", "0"])
    for value in ("-1", "3"):
        assert getattr(load_config([f"--parallelism.{name}", value]).parallelism, name) == int(value)


def test_eager_simple_fsdp_refuses_prefetch_limits():
    simple = ["--parallelism.data_parallel_impl", "simple_fsdp", "--parallelism.fsdp_forward_prefetch", "2"]
    for extra in ([], ["--compile.enable", "--compile.bucketing", "block"]):
        with pytest.raises(ConfigError, match=r"^parallelism.fsdp_forward_prefetch: SimpleFSDP moves gathers ahead"):
            load_config([*simple, *extra])
    load_config([*simple, "--compile.enable"])


def test_fsdp2_prefetches_the_next_units():
    assert prefetch_plan(4, 1, "forward_prefetch") == [[1], [2], [3], []]
    assert prefetch_plan(4, 2, "forward_prefetch") == [[1, 2], [2, 3], [3], []]
    assert prefetch_plan(4, -1, "forward_prefetch") == [[1, 2, 3], [2, 3], [3], []]
    with pytest.raises(ValueError, match="backward_prefetch must be -1"):
        prefetch_plan(4, 0, "backward_prefetch")
