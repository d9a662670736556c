"""torchrun worker of ``bench/dp_compare.py``: trains one data-parallel variant and measures it.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/dp_compare_worker.py \\
        --out RESULT.json --warmup 2 --steps 5 -- --model.flavor debugmodel --compile.enable ...

Everything after ``--`` is a ``train.py`` config override on top of ``configs/debug_model.toml``.
The run is built by the trainer itself (``trainer.Trainer``: data loader, ``models.registry`` ->
``parallelize_llama``, AdamW, LR schedule) and stepped with ``Trainer.train_step``, so it is the
code path of ``train.py``; only the loop is ours, to time steps and to profile one of them.

Steps: ``warmup`` untimed steps (the first one compiles), ``steps`` timed steps, then one profiled
step (torch.profiler with shapes and memory) that is not timed. Rank 0 writes the result JSON.

With ``--interleave NAME=FLAGS`` (two or more), one process per rank builds a trainer for each
variant (``FLAGS`` on top of the common overrides), warms each up, then alternates their timed
steps, one step of each in turn (the order reversed every step), so that every variant's steps
meet the same load of a shared machine. Only times and losses are measured then: memory and
collectives belong to one trainer per process.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from config.manager import load_config
from parallelisms.device import reset_peak_memory
from train import exit_without_teardown
from trainer.distributed import set_collective_timeout
from trainer.metrics import peak_memory_gib
from trainer.trainer import Trainer

BASE_CONFIG = os.path.join(REPO, "configs", "debug_model.toml")

# ProcessGroup-level ops (namespace c10d): every collective, whether issued by torch.distributed
# (FSDP2), by a functional collective (SimpleFSDP, DTensor) or by compiled code, ends in exactly
# one of them, so counting these counts each collective once. Value: kind, index of the argument
# whose size is the collective's size (all-gather output, reduce-scatter input, all-reduce buffer).
C10D_OPS: dict[str, tuple[str, int]] = {
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::allgather_": ("all_gather", 0),
    "c10d::allgather_coalesced_": ("all_gather", 0),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "c10d::alltoall_base_": ("all_to_all", 1),
    "c10d::broadcast_": ("broadcast", 0),
}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "other")
# Per-rank bytes a ring algorithm sends for a collective of size S over N ranks, as a factor of
# S: all-gather, reduce-scatter and all-to-all S (N-1)/N, all-reduce (reduce-scatter + all-gather)
# twice that; a broadcast sends S to N-1 ranks, S (N-1)/N per rank on average over the N
# broadcasts (one per source) that make a gather on gloo.
WIRE_FACTOR = {
    "all_gather": 1.0,
    "reduce_scatter": 1.0,
    "all_reduce": 2.0,
    "all_to_all": 1.0,
    "broadcast": 1.0,
    "other": 0.0,
}
# Element sizes of the profiler's type names.
ITEMSIZE = {
    "float": 4,
    "double": 8,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "int": 4,
    "long int": 8,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}


@dataclass
class CollectiveStats:
    """Collectives one rank issued in one step: count and bytes per kind."""

    count: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    payload_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    other_ops: list[str] = field(default_factory=list)
    unknown_dtype: int = 0
    """Collectives sized as fp32 because the profiler recorded no dtype: tensor lists passed to
    torch.distributed directly (the trainer's loss all-reduce, which is fp32), other than FSDP2's
    gathers (sized by the buffer they fill)."""


def _numel(dims: list) -> int:
    """Elements of a profiler "Input Dims" entry: a shape, or a (nested) list of shapes."""
    if all(isinstance(d, int) for d in dims):
        return math.prod(dims)
    return sum(_numel(d) for d in dims)


def _gather_buffer_dtype(copy_ins: list[dict[str, Any]], op: dict[str, Any]) -> str | None:
    """The dtype of the output buffer FSDP2 last filled before ``op`` on its thread: its gather
    broadcasts slots of that buffer as tensor lists, whose dtype the profiler leaves out."""
    before = [e for e in copy_ins if e["tid"] == op["tid"] and e["ts"] <= op["ts"]]
    return max(before, key=lambda e: e["ts"])["args"]["Input type"][1] if before else None


def parse_collectives(events: list[dict[str, Any]]) -> CollectiveStats:
    """Counts the c10d ops in a Chrome trace and sums their sizes."""
    stats = CollectiveStats()
    ops = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("c10d::")]
    # A functional collective wraps its c10d op on the same thread and records a plain dtype.
    functional = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("_c10d_functional::")]
    copy_ins = [e for e in events if e.get("ph") == "X" and e.get("name") == "fsdp::all_gather_copy_in"]
    for op in ops:
        kind, arg = C10D_OPS.get(op["name"], ("other", -1))
        stats.count[kind] += 1
        if kind == "other":
            stats.other_ops.append(op["name"])
            continue
        args = op["args"]
        dtype = args["Input type"][arg]
        if dtype not in ITEMSIZE:  # a tensor list: take the dtype its functional collective recorded
            parent = next(
                (f for f in functional if f["tid"] == op["tid"] and f["ts"] <= op["ts"] <= f["ts"] + f["dur"]),
                None,
            )
            dtype = parent["args"]["Input type"][0] if parent is not None else None
        if dtype not in ITEMSIZE and kind == "broadcast":  # FSDP2's gather on gloo: into its output buffer
            dtype = _gather_buffer_dtype(copy_ins, op)
        itemsize = ITEMSIZE.get(dtype)
        if itemsize is None:
            stats.unknown_dtype += 1
            itemsize = 4
        stats.payload_bytes[kind] += _numel(args["Input Dims"][arg]) * itemsize
    return stats


def transient_peak_bytes(events: list[dict[str, Any]]) -> int:
    """Peak CPU-allocator bytes allocated during the profile and still live, above the start.

    The profiler's CPU memory reporter counts only blocks allocated while it runs, so this is the
    step's peak on top of what was already allocated when it started."""
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not memory:
        return 0
    start = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in memory) - start


def live_tensor_bytes() -> int:
    """Bytes of the distinct CPU storages of all plain tensors reachable by the garbage collector.

    DTensors and FakeTensors are skipped (exact type check): a DTensor's local tensor is found on
    its own, and a FakeTensor has no real storage."""
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu" and obj.layout == torch.strided:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def profiled_step(trainer: Trainer, batch: list, trace_dir: str) -> tuple[CollectiveStats, int, int, float]:
    """One step under the profiler: (collectives, live bytes at start, transient peak bytes, loss)."""
    # Gradients of the previous step would be counted at start and freed (untracked) in the step.
    trainer.optimizer.zero_grad()
    gc.collect()
    baseline = live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
        loss = trainer.train_step(batch)["loss"]
    path = os.path.join(trace_dir, f"trace_rank{dist.get_rank()}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.remove(path)
    return parse_collectives(events), baseline, transient_peak_bytes(events), loss


def step_batches(trainer: Trainer, steps: int) -> list[list]:
    """The microbatches of ``steps`` steps, all up front: the timed steps measure training, not
    data loading."""
    data_iter = iter(trainer.dataloader)
    return [[next(data_iter) for _ in range(trainer.grad_accum_steps)] for _ in range(steps)]


def slowest_rank(step_times: list[list[float]]) -> list[float]:
    """Each step's time over the ranks' times of it: a step lasts until its slowest rank finishes it."""
    return [max(times) for times in zip(*step_times, strict=True)]


def timed_steps(trainer: Trainer, warmup: int, steps: int) -> dict[str, Any]:
    """Trains ``warmup`` untimed then ``steps`` timed steps and profiles one more; this rank's
    step times, losses, collectives and memory."""
    batches = step_batches(trainer, warmup + steps + 1)
    step_times: list[float] = []
    losses: list[float] = []
    for i, batch in enumerate(batches[:-1]):
        if i == warmup:
            # Steady state as train.py runs it: automatic gc off, peak RSS window from here.
            gc.collect()
            gc.disable()
            reset_peak_memory(trainer.device)
            # CPU seconds of the whole process: compute and the backend's communication threads.
            cpu_start = time.process_time()
        start = time.perf_counter()
        losses.append(trainer.train_step(batch)["loss"])
        step_times.append(time.perf_counter() - start)
        if i == 0:
            set_collective_timeout(trainer.config.comm.train_timeout_seconds, trainer.parallel_dims.mesh)
    cpu_s = time.process_time() - cpu_start
    peak_rss_gib = peak_memory_gib(trainer.device)
    gc.enable()
    with tempfile.TemporaryDirectory() as trace_dir:
        collectives, baseline, transient, profiled_loss = profiled_step(trainer, batches[-1], trace_dir)
    return {
        "step_times_s": step_times,
        "losses": losses,
        "profiled_loss": profiled_loss,
        "tokens": sum(x.numel() for x, _ in batches[0]),
        "collectives": asdict(collectives),
        "baseline_bytes": baseline,
        "transient_peak_bytes": transient,
        "peak_rss_gib": peak_rss_gib,
        "cpu_s_per_step": cpu_s / steps,
    }


def summarize(trainer: Trainer, gathered: list[dict[str, Any]], warmup: int, setup_s: float) -> dict[str, Any]:
    """The result JSON from every rank's measurements."""
    config, world, mine = trainer.config, len(gathered), gathered[0]
    times = slowest_rank([r["step_times_s"] for r in gathered])
    timed = times[warmup:]
    n_params = sum(p.numel() for part in trainer.model.parts for p in part.parameters())
    param_bytes = n_params * trainer.model.compute_dtype.itemsize
    gradient_bytes = n_params * getattr(torch, config.training.mixed_precision_reduce).itemsize
    stats = mine["collectives"]
    graph_pass = trainer.model.graph_passes[0] if trainer.model.graph_passes else None
    return {
        "world_size": world,
        "params": n_params,
        "param_bytes": param_bytes,
        "seq_len": config.training.seq_len,
        "local_batch_size": config.training.local_batch_size,
        "global_batch_size": trainer.global_batch_size,
        "tokens_per_rank_per_step": mine["tokens"],
        "warmup_steps": warmup,
        "timed_steps": len(timed),
        "setup_s": setup_s,
        "step_times_s": times,
        "first_step_s": times[0],
        "steady_step_s": statistics.median(timed),
        "compile_s": times[0] - statistics.median(timed),
        # Rate over the whole timed window (sum of step times), like the trainer's tokens/s.
        "tps_per_rank": mine["tokens"] * len(timed) / sum(timed),
        "tps_total": mine["tokens"] * world * len(timed) / sum(timed),
        # Compute plus communication work per step; below the step time, the rank waited.
        "cpu_s_per_step": statistics.mean(r["cpu_s_per_step"] for r in gathered),
        "losses": mine["losses"],
        "final_loss": mine["losses"][-1],
        "profiled_step_loss": mine["profiled_loss"],
        "collectives_per_rank": [r["collectives"] for r in gathered],
        "collectives": stats["count"],
        "payload_bytes": sum(stats["payload_bytes"].values()),
        "wire_bytes_estimate": sum(stats["payload_bytes"][k] * WIRE_FACTOR[k] * (world - 1) / world for k in KINDS),
        # Gathers in forward and backward at the compute width, one reduction at the reduce width.
        "theory_bytes": (2 * param_bytes + gradient_bytes) * (world - 1) / world,
        "memory": {
            "tracked_peak_bytes": max(r["baseline_bytes"] + r["transient_peak_bytes"] for r in gathered),
            "baseline_bytes": [r["baseline_bytes"] for r in gathered],
            "transient_peak_bytes": [r["transient_peak_bytes"] for r in gathered],
            "peak_rss_gib": max(r["peak_rss_gib"] for r in gathered),
        },
        "graph_reports": None
        if graph_pass is None
        else [
            {"collectives": dict(r.collectives), "all_gather_buckets": r.all_gather_buckets} for r in graph_pass.reports
        ],
        "buckets": None if graph_pass is None else graph_pass.buckets,
        "dynamo_frames_compiled": len(torch._dynamo.utils.get_compilation_metrics()),
    }


def build_trainer(dump_folder: str, warmup: int, steps: int, overrides: list[str]) -> Trainer:
    config = load_config(
        [
            "--job.config_file",
            BASE_CONFIG,
            "--training.steps",
            str(warmup + steps + 1),
            "--metrics.enable_tensorboard",
            "false",
            "--metrics.peak_flops",
            "1e12",  # no MFU here: skips the matmul benchmark
            "--job.dump_folder",
            dump_folder,
            *overrides,
        ]
    )
    return Trainer(config)


def run(out: str, warmup: int, steps: int, overrides: list[str]) -> None:
    setup_start = time.perf_counter()
    trainer = build_trainer(os.path.dirname(os.path.abspath(out)), warmup, steps, overrides)
    setup_s = time.perf_counter() - setup_start
    gathered: list[dict[str, Any]] = [{}] * dist.get_world_size()
    dist.all_gather_object(gathered, timed_steps(trainer, warmup, steps))
    trainer.close()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(summarize(trainer, gathered, warmup, setup_s), f, indent=1)


def interleaved_steps(trainers: dict[str, Trainer], warmup: int, steps: int) -> dict[str, dict[str, Any]]:
    """Warms every trainer up by ``warmup`` steps, then runs ``steps`` timed steps of each in turn;
    this rank's step times and losses per variant."""
    batches = {}
    for name, trainer in trainers.items():
        batches[name] = step_batches(trainer, warmup + steps)
        for batch in batches[name][:warmup]:
            trainer.train_step(batch)
        set_collective_timeout(trainer.config.comm.train_timeout_seconds, trainer.parallel_dims.mesh)
    gc.collect()
    gc.disable()
    measured: dict[str, dict[str, Any]] = {name: {"step_times_s": [], "losses": []} for name in trainers}
    names = list(trainers)
    for i in range(warmup, warmup + steps):
        # Reversed every step: no variant always runs right after the same other one.
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()  # each step starts with the ranks together, whatever the last one left
            start = time.perf_counter()
            measured[name]["losses"].append(trainers[name].train_step(batches[name][i])["loss"])
            measured[name]["step_times_s"].append(time.perf_counter() - start)
    gc.enable()
    for name, m in measured.items():
        m["tokens"] = sum(batch.inputs.numel() for batch in batches[name][0])
    return measured


def run_interleaved(out: str, warmup: int, steps: int, overrides: list[str], variants: dict[str, list[str]]) -> None:
    folder = os.path.dirname(os.path.abspath(out))
    trainers = {
        name: build_trainer(os.path.join(folder, name), warmup, steps, [*overrides, *flags])
        for name, flags in variants.items()
    }
    gathered: list[dict[str, Any]] = [{}] * dist.get_world_size()
    dist.all_gather_object(gathered, interleaved_steps(trainers, warmup, steps))
    for trainer in trainers.values():
        trainer.close()
    if dist.get_rank() == 0:
        result = {}
        for name in variants:
            times = slowest_rank([r[name]["step_times_s"] for r in gathered])
            tokens = gathered[0][name]["tokens"]
            result[name] = {
                "world_size": len(gathered),
                "tokens_per_rank_per_step": tokens,
                "step_times_s": times,
                "tps_per_rank": tokens * steps / sum(times),
                "losses": gathered[0][name]["losses"],
                "final_loss": gathered[0][name]["losses"][-1],
            }
        with open(out, "w") as f:
            json.dump({"per_variant": result}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="result JSON written by rank 0")
    parser.add_argument("--warmup", type=int, required=True, help="untimed steps first (compile included)")
    parser.add_argument("--steps", type=int, required=True, help="timed steps")
    parser.add_argument(
        "--interleave",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="a variant to alternate steps with the others (two or more): its train.py overrides, space-separated",
    )
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="-- then train.py config overrides")
    args = parser.parse_args()
    variants = {name: flags.split() for name, _, flags in (v.partition("=") for v in args.interleave)}
    if len(variants) == 1:
        parser.error("--interleave: give two variants or more")
    logging.basicConfig(
        level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    if variants:
        run_interleaved(args.out, args.warmup, args.steps, overrides, variants)
    else:
        run(args.out, args.warmup, args.steps, overrides)
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
