"""Tests for parallelisms.bucket_plan: cost models, calibration, auto and manual bucket plans.

Most tests use world size 2 and a bandwidth of 0.5 B/s, so a collective of ``b`` full bytes takes
``alpha + 0.5 * b / 0.5 = alpha + b`` seconds, and a compute rate of 1 FLOP/s, so FLOPs are
seconds: every expected boundary below can be checked by hand.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import multiprocessing
import os
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from parallelisms.bucket_plan import (  # _Costs and _predict: the cost model plan_auto uses
    BucketPlan,
    PlanUnit,
    _Costs,
    _predict,
    default_manual_patterns,
    plan_auto,
    plan_manual,
    saved_or_new_plan,
)
from parallelisms.cost_model import FALLBACK_COMM_MODEL, CommModel, ComputeModel, calibrate_comm_model, measure_rate
from tests.spawn import spawn_ranks

_WORLD_SIZE = 2
_TIMEOUT_S = 90.0
_UNIT_RATE = ComputeModel(flops_per_second=1.0)


def _comm(alpha_s: float) -> CommModel:
    """At world size 2: a collective of ``b`` full bytes takes ``alpha_s + b`` seconds."""
    return CommModel(alpha_s=alpha_s, bandwidth_bytes_per_s=0.5)


def _units(*specs: tuple[int, float, float]) -> list[PlanUnit]:
    """Units ``u0, u1, ...`` from ``(param_bytes, forward_flops, backward_flops)``."""
    return [PlanUnit(f"u{i}", *spec) for i, spec in enumerate(specs)]


def _boundaries(plan: BucketPlan) -> list[list[str]]:
    return [bucket.units for bucket in plan.buckets]


# ---------------------------------------------------------------------------
# Cost models
# ---------------------------------------------------------------------------


def test_comm_model_from_config_units_and_ring_formula() -> None:
    comm = CommModel.from_config(alpha_us=10.0, bandwidth_gbps=2.0)
    assert comm.alpha_s == pytest.approx(10e-6)
    assert comm.bandwidth_bytes_per_s == pytest.approx(2e9)
    assert comm.time(4e9) == pytest.approx(10e-6 + 2.0)
    # Ring over 4 ranks: each rank moves 3/4 of the full bytes.
    assert comm.all_gather_time(4e9, world_size=4) == pytest.approx(10e-6 + 1.5)
    assert comm.reduce_scatter_time(4e9, world_size=4) == pytest.approx(10e-6 + 1.5)
    assert comm.all_gather_time(0, world_size=4) == 0.0


def test_compute_model_from_config_or_measured() -> None:
    def measure() -> float:
        raise AssertionError("a configured rate is not measured")

    assert ComputeModel.from_config(2e12, measure).time(4e12) == pytest.approx(2.0)
    assert ComputeModel.from_config(None, lambda: 5e9).flops_per_second == 5e9


class _Sleeper(torch.nn.Module):
    """Forward takes 20 ms, backward next to nothing; counts its passes."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.passes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.passes += 1
        time.sleep(0.02)
        return x * self.weight


def test_measure_rate_is_flops_over_the_time_of_a_pass() -> None:
    # 1e9 FLOPs per pass of at least 20 ms: at most 5e10 FLOP/s. Sleep overshoots under load, so the
    # lower bound is the rate over the whole call (the untimed first pass included), not a constant.
    sleeper = _Sleeper()
    start = time.perf_counter()
    rate = measure_rate(sleeper, (torch.ones(4, requires_grad=True),), flops=1e9, min_seconds=0.1)
    elapsed = time.perf_counter() - start
    timed_passes = sleeper.passes - 1
    # At least 2 timed passes over at least min_seconds, however long a sleep takes here.
    assert timed_passes >= 2
    assert 1e9 * timed_passes / elapsed <= rate <= min(5e10, 1e9 * timed_passes / 0.1)


# ---------------------------------------------------------------------------
# plan_auto: known plans
# ---------------------------------------------------------------------------


def _blocks(count: int, param_bytes: int, forward: float, backward: float) -> list[PlanUnit]:
    return [PlanUnit(f"layers.{i}", param_bytes, forward, backward) for i in range(count)]


def test_hidden_communication_gives_one_block_per_bucket() -> None:
    # AG and RS of one block take 1 s against 4 s forward and 8 s backward: every collective but the
    # first gather, the first re-gather and the last reduce-scatter hides, 3 s exposed in all. Two
    # blocks per bucket expose 2 s for each of those three instead: 6 s.
    blocks = _blocks(4, 1, 4.0, 8.0)
    plan = plan_auto(blocks, _comm(0.0), _UNIT_RATE, _WORLD_SIZE, memory_cap_bytes=10**9)
    assert _boundaries(plan) == [["layers.0"], ["layers.1"], ["layers.2"], ["layers.3"]]
    exposed = sum(b.predicted_exposed_forward_s + b.predicted_exposed_backward_s for b in plan.buckets)
    assert exposed == pytest.approx(3.0)
    pairs = predict_plan(blocks, [["layers.0", "layers.1"], ["layers.2", "layers.3"]], _comm(0.0), _UNIT_RATE, 2)
    assert sum(b.predicted_exposed_forward_s + b.predicted_exposed_backward_s for b in pairs.buckets) == 6.0


def test_latency_bound_blocks_share_buckets_of_equal_size_up_to_the_memory_cap() -> None:
    # alpha = 10 s; a block's AG or RS takes 11 s against F = 1 s and G = 2 s.
    # Exposed in all, 6 blocks: one per bucket 61 forward (11 + 5 x 10) + 120 backward (20 per step);
    # pairs (AG 12 s, F 2 s, G 4 s) 32 + 60 = 92 s. Triples would gather 6 bytes with their
    # neighbour, over the cap of 5.
    blocks = _blocks(6, 1, 1.0, 2.0)
    plan = plan_auto(blocks, _comm(10.0), _UNIT_RATE, _WORLD_SIZE, memory_cap_bytes=5)
    assert _boundaries(plan) == [["layers.0", "layers.1"], ["layers.2", "layers.3"], ["layers.4", "layers.5"]]
    exposed = sum(b.predicted_exposed_forward_s + b.predicted_exposed_backward_s for b in plan.buckets)
    assert exposed == pytest.approx(92.0)
    # Without a binding cap, one bucket: its gather, re-gather and reduce-scatter (16 s each) all exposed.
    assert _boundaries(plan_auto(blocks, _comm(10.0), _UNIT_RATE, _WORLD_SIZE, memory_cap_bytes=100)) == [
        [f"layers.{i}" for i in range(6)]
    ]


def test_units_before_and_after_the_blocks_get_a_bucket_each() -> None:
    # The embeddings do no matmuls, the norm none either: they cannot hide anything, and the blocks
    # (the longest run of equal units) keep buckets of equal size, the last holding the remainder.
    units = [PlanUnit("tok_embeddings", 4, 0.0, 0.0), *_blocks(5, 1, 1.0, 2.0)]
    units += [PlanUnit("norm", 1, 0.0, 0.0), PlanUnit("output", 4, 1.0, 2.0)]
    plan = plan_auto(units, _comm(10.0), _UNIT_RATE, _WORLD_SIZE, memory_cap_bytes=100)
    assert plan.buckets[0].units == ["tok_embeddings"] and plan.buckets[-1].units == ["norm", "output"]
    sizes = [len(bucket.units) for bucket in plan.buckets[1:-1]]
    assert sizes[0] > 1 and all(size == sizes[0] for size in sizes[:-1]) and sizes[-1] <= sizes[0], sizes
    cheap = plan_auto(units, _comm(0.0), _UNIT_RATE, _WORLD_SIZE, memory_cap_bytes=100)
    assert _boundaries(cheap) == [["tok_embeddings"], *[[f"layers.{i}"] for i in range(5)], ["norm", "output"]]


def test_reduce_scatter_bytes_factor_and_resharding_reach_the_cost_model() -> None:
    blocks = _blocks(4, 1, 1.0, 2.0)
    for options in ({"reduce_scatter_bytes_factor": 2.0}, {"reshard_after_forward": False}):
        plan = plan_auto(blocks, _comm(10.0), _UNIT_RATE, _WORLD_SIZE, 10**9, **options)
        again = predict_plan(blocks, _boundaries(plan), _comm(10.0), _UNIT_RATE, _WORLD_SIZE, **options)
        assert plan.to_dict() == again.to_dict()


# ---------------------------------------------------------------------------
# plan_auto: the memory cap
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_memory_cap_holds_for_every_bucket_above_one_block(seed: int) -> None:
    rng = random.Random(seed)
    blocks = _blocks(rng.randint(4, 30), rng.randint(1, 50), 1.0, 2.0)
    cap = rng.randint(4, 12) * blocks[0].param_bytes  # pairs of pairs fit: buckets can grow
    plan = plan_auto(blocks, _comm(100.0), _UNIT_RATE, _WORLD_SIZE, memory_cap_bytes=cap)  # latency-bound
    assert [name for bucket in plan.buckets for name in bucket.units] == [unit.name for unit in blocks]
    for previous, bucket in zip([None, *plan.buckets], plan.buckets):
        assert bucket.param_bytes + (previous.param_bytes if previous else 0) <= cap, (bucket, previous, cap)
    assert len(plan.buckets) < len(blocks)  # the cap let buckets grow: this case is not vacuous


def test_blocks_larger_than_the_cap_get_a_bucket_each(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="parallelisms.bucket_plan"):
        plan = plan_auto(_blocks(3, 10, 1.0, 2.0), _comm(100.0), _UNIT_RATE, _WORLD_SIZE, memory_cap_bytes=5)
    assert _boundaries(plan) == [["layers.0"], ["layers.1"], ["layers.2"]]
    assert "memory cap" in caplog.text and "cannot be split" in caplog.text


# (param_bytes, forward, backward) of units that are not all alike.
_MIXED_UNITS = _units((2, 1, 2), (1, 4, 5), (1, 4, 8), (1, 4, 8), (1, 4, 8), (1, 2, 4))


# ---------------------------------------------------------------------------
# Predicted exposed communication
# ---------------------------------------------------------------------------


def predict_plan(units, bucket_units, comm, compute, world_size, **cost_options) -> BucketPlan:
    """The plan with the given buckets (unit names) and the exposed communication the auto
    planner's cost model predicts for it."""
    costs = _Costs(
        comm, compute, world_size, **{"reduce_scatter_bytes_factor": 1.0, "reshard_after_forward": True, **cost_options}
    )
    by_name = {unit.name: unit for unit in units}
    return _predict([[by_name[name] for name in names] for names in bucket_units], costs)


# Buckets B0 = [u0], B1 = [u1, u2], B2 = [u3]: bytes 2, 2, 3; F 1, 3, 2; G 2, 5, 4.
_THREE_BUCKET_UNITS = _units((2, 1, 2), (1, 2, 3), (1, 1, 2), (3, 2, 4))
_THREE_BUCKETS = [["u0"], ["u1", "u2"], ["u3"]]


def test_predicted_exposed_times_of_three_buckets_with_resharding() -> None:
    plan = predict_plan(
        _THREE_BUCKET_UNITS, _THREE_BUCKETS, _comm(1.0), _UNIT_RATE, _WORLD_SIZE, reduce_scatter_bytes_factor=2.0
    )
    # AG = 1 + bytes: 3, 3, 4.  RS = 1 + 2 * bytes: 5, 5, 7.
    # Forward: AG(B0) = 3 exposed; AG(B1) 3 - F0 1 = 2; AG(B2) 4 - F1 3 = 1.
    assert [b.predicted_exposed_forward_s for b in plan.buckets] == pytest.approx([3.0, 2.0, 1.0])
    # Backward step 2: AG(B1) 3 under G2 4 -> 0, plus its own unhidden re-gather AG(B2) 4 = 4.
    # Step 1: RS(B2) 7 + AG(B0) 3 = 10 under G1 5 -> 5.
    # Step 0: RS(B1) 5 under G0 2 -> 3, plus the unhidden RS(B0) 5 = 8.
    assert [b.predicted_exposed_backward_s for b in plan.buckets] == pytest.approx([8.0, 5.0, 4.0])


def test_predicted_exposed_times_of_three_buckets_without_resharding() -> None:
    plan = predict_plan(
        _THREE_BUCKET_UNITS,
        _THREE_BUCKETS,
        _comm(1.0),
        _UNIT_RATE,
        _WORLD_SIZE,
        reduce_scatter_bytes_factor=2.0,
        reshard_after_forward=False,
    )
    assert [b.predicted_exposed_forward_s for b in plan.buckets] == pytest.approx([3.0, 2.0, 1.0])
    # No re-gathers: step 2 -> 0; step 1: RS(B2) 7 - G1 5 = 2; step 0: 5 - 2 + RS(B0) 5 = 8.
    assert [b.predicted_exposed_backward_s for b in plan.buckets] == pytest.approx([8.0, 2.0, 0.0])


def test_predicted_exposed_times_when_backward_regathers_only_some_units() -> None:
    # u0 (an embedding: its backward needs no weight) and u3 (kept gathered, like the final norm
    # and output) are not gathered again; u1 and u2, the blocks, are.
    units = [dataclasses.replace(u, regathered=u.name in ("u1", "u2")) for u in _THREE_BUCKET_UNITS]
    plan = predict_plan(units, _THREE_BUCKETS, _comm(1.0), _UNIT_RATE, _WORLD_SIZE, reduce_scatter_bytes_factor=2.0)
    assert [b.predicted_exposed_forward_s for b in plan.buckets] == pytest.approx([3.0, 2.0, 1.0])
    # Step 2: AG(B1) 3 under G2 4 -> 0, no re-gather of B2 = 0. Step 1: RS(B2) 7 + nothing for B0
    # under G1 5 -> 2. Step 0: RS(B1) 5 under G0 2 -> 3, plus the unhidden RS(B0) 5 = 8.
    assert [b.predicted_exposed_backward_s for b in plan.buckets] == pytest.approx([8.0, 2.0, 0.0])


def test_auto_plan_carries_the_predictions_of_its_buckets() -> None:
    auto = plan_auto(_MIXED_UNITS, _comm(1.0), _UNIT_RATE, _WORLD_SIZE, memory_cap_bytes=3)
    again = predict_plan(_MIXED_UNITS, _boundaries(auto), _comm(1.0), _UNIT_RATE, _WORLD_SIZE)
    assert auto.to_dict() == again.to_dict()


def test_describe_and_to_dict() -> None:
    units = [PlanUnit(f"layers.{i}", 3 * 1024**2, 1.0, 2.0) for i in range(5)]
    plan = predict_plan(units, [["layers.0"], [f"layers.{i}" for i in range(1, 5)]], _comm(0.001), _UNIT_RATE, 2)
    text = plan.describe()
    lines = text.splitlines()
    assert len(lines) == 4  # header, 2 buckets, total
    assert "layers.1 .. layers.4 (4 modules)" in lines[2] and "12.00" in lines[2]
    assert lines[-1].split()[:3] == ["total", "2", "buckets"]
    record = json.loads(json.dumps(plan.to_dict()))
    assert record["buckets"][1]["units"] == [f"layers.{i}" for i in range(1, 5)]
    assert record["buckets"][0]["predicted_exposed_forward_s"] == pytest.approx(0.001 + 3 * 1024**2)


# ---------------------------------------------------------------------------
# plan_manual
# ---------------------------------------------------------------------------

_LLAMA_NAMES = ["tok_embeddings", *[f"layers.{i}" for i in range(12)], "norm", "output"]
_LLAMA_UNITS = [PlanUnit(name, 100 + i, 1.0, 2.0) for i, name in enumerate(_LLAMA_NAMES)]


def test_default_patterns_give_one_bucket_per_block_and_norm_with_output() -> None:
    patterns = default_manual_patterns(_LLAMA_NAMES)
    assert patterns == ["tok_embeddings", *[f"layers.{i}" for i in range(12)], "norm+output"]
    plan = plan_manual(_LLAMA_UNITS, patterns)
    # "layers.1" is literal: it must not also take layers.10 and layers.11.
    assert _boundaries(plan) == [["tok_embeddings"], *[[f"layers.{i}"] for i in range(12)], ["norm", "output"]]
    assert plan.buckets[-1].param_bytes == 113 + 114
    assert all(b.predicted_exposed_forward_s is None for b in plan.buckets)
    assert "-" in plan.describe().splitlines()[1]


def test_default_patterns_of_a_pipeline_stage_without_embeddings() -> None:
    stage_patterns = default_manual_patterns(["layers.4", "layers.5", "norm", "output"])
    assert stage_patterns == ["layers.4", "layers.5", "norm+output"]
    assert default_manual_patterns(["tok_embeddings", "layers.0"]) == ["tok_embeddings", "layers.0"]


def test_wildcard_spec_is_one_bucket_and_unmatched_units_stand_alone() -> None:
    plan = plan_manual(_LLAMA_UNITS, ["layers.*"])
    assert _boundaries(plan) == [["tok_embeddings"], [f"layers.{i}" for i in range(12)], ["norm"], ["output"]]


@pytest.mark.parametrize(
    "patterns",
    [
        [],
        ["norm+output"],
        ["layers.[0-3]", "layers.[4-7]", "layers.8+layers.9+layers.1?"],
        ["tok_embeddings+layers.0", "layers.[1-3]", "output"],
    ],
)
def test_manual_plan_holds_every_unit_exactly_once_in_order(patterns: list[str]) -> None:
    plan = plan_manual(_LLAMA_UNITS, patterns)
    assert [name for bucket in plan.buckets for name in bucket.units] == _LLAMA_NAMES
    assert sum(bucket.param_bytes for bucket in plan.buckets) == sum(unit.param_bytes for unit in _LLAMA_UNITS)


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        (["norm+outptu"], r"'outptu'.*matches no module"),
        (["layers.0", "lyers.*"], r"'lyers\.\*'.*matches no module"),
        (["tok_embeddings+output"], r"'tok_embeddings\+output' is not contiguous"),
        (["layers.1*"], r"not contiguous.*'layers\.2'"),  # layers.1, layers.10, layers.11
        (["layers.*", "layers.0"], r"'layers\.0' is matched by two bucket specs"),
        (["norm+"], r"empty pattern"),
    ],
)
def test_manual_plan_errors(patterns: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_manual(_LLAMA_UNITS, patterns)


# ---------------------------------------------------------------------------
# Calibration on a real 2-process gloo group
# ---------------------------------------------------------------------------

# Rank r's fake all-gather: alpha (r + 1) * 100 us, bandwidth 1 GB/s / (r + 1). Rank 1 is slower
# at every size, so the MAX over ranks is rank 1's line on both ranks.
_FAKE_SIZES = (4096, 4096 * 1024)
_RESULTS = (
    "fake_alpha",
    "fake_bandwidth",
    "clamped_alpha",
    "not_slower_falls_back",
    "one_rank_raised",
    "real_alpha",
    "real_bandwidth",
)


def _fake_all_gather(alpha_s: float, bandwidth: float) -> Callable[[int], float]:
    """Times of an exact alpha-beta ring all-gather on ``_WORLD_SIZE`` ranks."""

    def time_all_gather(full_bytes: int) -> float:
        return alpha_s + (_WORLD_SIZE - 1) / _WORLD_SIZE * full_bytes / bandwidth

    return time_all_gather


def _calibration_worker(rank: int, init_method: str, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=_WORLD_SIZE)
    values: dict[str, float] = {}

    slow = rank + 1
    fake = _fake_all_gather(alpha_s=1e-4 * slow, bandwidth=1e9 / slow)
    model = calibrate_comm_model(sizes=_FAKE_SIZES, iters=3, warmup=1, time_all_gather=fake)
    values["fake_alpha"], values["fake_bandwidth"] = model.alpha_s, model.bandwidth_bytes_per_s

    # A fitted line below the origin (alpha -1 ms) is clamped to zero latency.
    below_origin = _fake_all_gather(alpha_s=-1e-3, bandwidth=1e9)
    values["clamped_alpha"] = calibrate_comm_model(sizes=_FAKE_SIZES, iters=1, time_all_gather=below_origin).alpha_s

    # Noise that makes the large message no slower: the stated fallback, not an error.
    flat = calibrate_comm_model(sizes=_FAKE_SIZES, iters=1, time_all_gather=lambda full_bytes: 1.0)
    values["not_slower_falls_back"] = float(flat == FALLBACK_COMM_MODEL)

    one_rank = dist.new_group([0])  # every rank must take part in creating it
    values["one_rank_raised"] = 1.0
    if rank == 0:
        try:
            calibrate_comm_model(group=one_rank)
            values["one_rank_raised"] = 0.0
        except ValueError:
            pass

    real = calibrate_comm_model(sizes=(4096, 4 * 1024**2), iters=5, warmup=1)
    values["real_alpha"], values["real_bandwidth"] = real.alpha_s, real.bandwidth_bytes_per_s

    for index, key in enumerate(_RESULTS):
        results[rank * len(_RESULTS) + index] = values[key]
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # spawns 2 gloo ranks
def test_calibration_on_two_gloo_ranks() -> None:
    results = multiprocessing.get_context("spawn").Array("d", [math.nan] * (_WORLD_SIZE * len(_RESULTS)))
    exit_codes = spawn_ranks(_calibration_worker, _WORLD_SIZE, results, timeout_s=_TIMEOUT_S)
    per_rank = [dict(zip(_RESULTS, results[r * len(_RESULTS) : (r + 1) * len(_RESULTS)])) for r in range(_WORLD_SIZE)]
    assert not any(math.isnan(v) for values in per_rank for v in values.values()), (
        f"results {per_rank}, exit codes {exit_codes}; see the worker tracebacks above"
    )
    for values in per_rank:
        # The slowest rank (rank 1) sets the model on every rank, recovered exactly.
        assert values["fake_alpha"] == pytest.approx(2e-4, rel=1e-9)
        assert values["fake_bandwidth"] == pytest.approx(5e8, rel=1e-9)
        assert values["clamped_alpha"] == 0.0
        assert values["not_slower_falls_back"] == 1.0
        assert values["one_rank_raised"] == 1.0
        assert math.isfinite(values["real_alpha"]) and values["real_alpha"] >= 0
        assert math.isfinite(values["real_bandwidth"]) and values["real_bandwidth"] > 0
    assert per_rank[0]["real_alpha"] == per_rank[1]["real_alpha"]  # all ranks agree
    assert per_rank[0]["real_bandwidth"] == per_rank[1]["real_bandwidth"]


def _saved_plan_worker(rank: int, init_method: str, root: str, results: Any) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=_WORLD_SIZE)
    # Rank 1's folder is not rank 0's: as on nodes without a shared dump folder.
    folder = os.path.join(root, f"rank{rank}")
    calls = []

    def make_plan(patterns: list[str]) -> Callable[[], BucketPlan]:
        units = [PlanUnit(name, 8, 1.0, 2.0) for name in ("a", "b")]
        return lambda: calls.append(patterns) or plan_manual(units, patterns)

    key = {"units": ["a", "b"], "world_size": 2}
    first, first_path = saved_or_new_plan(folder, key, make_plan(["a", "b"]), dist.group.WORLD)
    # A restart: the timings would now give another plan, but rank 0's saved one is used everywhere.
    again, again_path = saved_or_new_plan(folder, key, make_plan(["a+b"]), dist.group.WORLD)
    other, _ = saved_or_new_plan(folder, {**key, "world_size": 4}, make_plan(["a+b"]), dist.group.WORLD)
    results[rank * 5 : rank * 5 + 5] = [
        float(first_path is None),
        float(again == first and again_path is not None),
        float(len(other.buckets) == 1),
        float(len(calls)),
        float(os.path.exists(os.path.join(folder)) == (rank == 0)),
    ]
    dist.destroy_process_group()


@pytest.mark.slow  # spawns 2 gloo ranks
def test_an_auto_plan_saved_at_the_first_start_is_every_ranks_plan_at_the_next(tmp_path) -> None:
    results = multiprocessing.get_context("spawn").Array("d", [math.nan] * (_WORLD_SIZE * 5))
    spawn_ranks(_saved_plan_worker, _WORLD_SIZE, str(tmp_path), results, timeout_s=_TIMEOUT_S)
    for rank in range(_WORLD_SIZE):
        new, reused, replanned, calls, folder_written = results[rank * 5 : rank * 5 + 5]
        assert (new, reused, replanned, folder_written) == (1.0, 1.0, 1.0, 1.0), (rank, list(results))
        assert calls == 2  # the first start and the changed key, not the restart


def test_a_checkpointed_blocks_collective_is_attributed_to_its_unit():
    """Compiled alone (block bucketing), a checkpointed block's submodules are reached through the
    wrapper's dict; its gathers were attributed to no unit (a RuntimeError in every rank's first step)."""
    from torch import fx

    from models.llama3.parallelize import BLOCK_BUCKETS
    from parallelisms.bucketing import module_path, unit_of

    graph = fx.Graph()
    shard = graph.placeholder("shard")
    gather = graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (shard, 2, "0"))
    wrapper = "L['self'].__dict__['_modules']['_checkpoint_wrapped_module']"  # as dynamo records it
    gather.meta["nn_module_stack"] = {
        "1": (wrapper, torch.nn.Module),
        "2": (f"{wrapper}.attention_norm", torch.nn.Module),
    }
    assert unit_of(module_path(gather), [unit for bucket in BLOCK_BUCKETS for unit in bucket]) == "attention_norm"


def test_a_block_is_timed_from_the_models_shape_alone(monkeypatch):
    """Auto bucketing times a fresh block built from the model's arguments, so a pipeline stage
    holding no block (the embeddings or the output alone) plans too: it needed a block of its own
    to time (a refusal inside the ranks, after the launch). The FLOPs counted are the plan's own
    for a block, and its attention runs as the model's does on this device."""
    from models.llama3 import Transformer, parallelize
    from parallelisms.device import attention_dtype, causal_query_chunk
    from tests.unit.test_model import tiny_args

    args = dataclasses.replace(tiny_args(), max_seq_len=16)
    timed = {}

    def fake_measure_rate(block, inputs, flops):
        timed.update(flops=flops, attention=(block.attention.attention_dtype, block.attention.query_chunk))
        return 1e9

    monkeypatch.setattr(parallelize, "measure_rate", fake_measure_rate)
    assert parallelize.block_rate(args, batch=3, device=torch.device("cpu"), dtype=torch.bfloat16) == 1e9
    block_unit = next(
        u
        for u in parallelize.plan_units(Transformer(args), tokens=3 * 16, param_dtype=torch.float32)
        if u.name == "layers.0"
    )
    assert timed["flops"] == block_unit.forward_flops + block_unit.backward_flops
    assert timed["attention"] == (attention_dtype("cpu", torch.bfloat16, args.head_dim), causal_query_chunk("cpu", 16))
