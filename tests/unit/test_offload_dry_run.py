"""The dry run counts CPU offload (the sharded state in host memory, apart from the device's peak) and
the prefetch limits (more gathers ahead, a higher peak)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.launch import REPO

pytestmark = pytest.mark.slow  # dry runs of 70B (minutes on a loaded 2-core machine) and seven small ones

GiB = 2**30
# Llama 3 70B on 8 devices as torchtitan's train config runs it, without tensor parallelism.
LLAMA_70B = [
    *("--model.flavor", "70B", "--training.seq_len", "8192", "--training.local_batch_size", "1"),
    *("--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "bfloat16"),
]
# Dry runs of 8 ranks one after the other in one process (each its own fake process group): the
# interpreter's and torch's start-up paid once.
_REPORTS = """
import dataclasses, json, sys
import torch.distributed as dist
from config.manager import load_config
from programs.dry_run import dry_run
for argv in json.loads(sys.argv[1]):
    print("REPORT " + json.dumps(dataclasses.asdict(dry_run(load_config(argv), 8))))
    dist.destroy_process_group()
"""


def _start(*argv: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "programs.dry_run", "--world-size", "8", *argv]
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _summary(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=1800)
    assert process.returncode == 0, err[-3000:]
    return out


def _gib(text: str, pattern: str) -> float:
    return float(re.search(pattern + r" ([\d.]+) GiB", text).group(1))


def test_70b_on_8_devices_of_80_gib_fits_only_with_cpu_offload():
    """Without offload the fp32 state alone (16 bytes x 70.55B / 8 = 131 GiB) exceeds 80 GiB; with it
    that state is in host memory, by category, and the device's peak fits."""
    runs = [_start(*LLAMA_70B), _start(*LLAMA_70B, "--training.enable_cpu_offload")]  # side by side
    without, offloaded = (_summary(run) for run in runs)
    assert "does NOT fit a device of 80.00 GiB (plan.device_memory_gib)" in without
    assert "host memory" not in without
    assert re.search(r"\n  fits a device of 80.00 GiB \(plan.device_memory_gib\)", offloaded), offloaded
    host = re.search(r"host memory \(training.enable_cpu_offload\) ([\d.]+) GiB: (.*)", offloaded)
    assert host, offloaded
    shard = 70.55e9 * 4 / 8 / GiB  # one rank's fp32 weights
    parts = dict(re.findall(r"(\w+) ([\d.]+) GiB", host.group(2)))
    assert float(parts["parameter"]) == pytest.approx(shard, rel=0.01)
    # FSDP2 reduces the root's gradients (embedding, norm, output) into one buffer: up to 3% more.
    assert shard * 0.99 <= float(parts["gradient"]) <= shard * 1.04
    assert float(parts["optstate"]) >= 2 * shard * 0.99  # two Adam moments, and the host step's temporaries
    # The device no longer holds the sharded state: its peak drops by at least the weights' shard.
    peak_without = _gib(without, "peak memory per rank")
    peak_offloaded = _gib(offloaded, "peak memory per rank")
    assert peak_offloaded < peak_without - shard
    assert "optstate        0.0 MiB at the peak" in offloaded


def _reports(*runs: list[str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=REPO)
    command = [sys.executable, "-c", _REPORTS, json.dumps(runs)]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line[len("REPORT ") :]) for line in proc.stdout.splitlines() if line.startswith("REPORT ")]


def _prefetch(ahead: str) -> list[str]:
    return ["--parallelism.fsdp_forward_prefetch", ahead, "--parallelism.fsdp_backward_prefetch", ahead]


def test_the_peak_grows_with_the_prefetch_limit():
    """Small activations (32 tokens, full recomputation), so that gathered weights show. FSDP2 eager:
    the measured peak; compiled SimpleFSDP: the analytical neighbouring buckets gathered at once."""
    small = [
        *("--model.flavor", "debugmodel", "--training.seq_len", "32", "--training.local_batch_size", "1"),
        *("--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "bfloat16"),
    ]
    compiled = [*small, "--parallelism.data_parallel_impl", "simple_fsdp", "--compile.enable"]
    limits = ("1", "2", "-1")
    reports = _reports(small, *([*small, *_prefetch(a)] for a in limits), *([*compiled, *_prefetch(a)] for a in limits))
    default, fsdp2 = reports[0]["peak_bytes"], [r["peak_bytes"] for r in reports[1:4]]
    assert default <= fsdp2[0] < fsdp2[1] < fsdp2[2]
    buckets = [r["bucket_pair_bytes"] for r in reports[4:]]
    assert 0 < buckets[0] < buckets[1] < buckets[2]


def test_the_planner_offloads_70b_on_8_devices_when_nothing_fits_without(tmp_path):
    """The state alone (131 GiB per device) rules out every layout on 8 devices of 80 GiB; with CPU
    offload (8 x 131 GiB within the 2048 GiB of host memory per node) a sharded one fits, and the
    config written says so."""
    out = tmp_path / "plan.toml"
    argv = [*LLAMA_70B[:6], "--plan.devices", "8", "--training.global_batch_size", "8"]
    argv += ["--plan.activation_checkpoint_modes", "full", "--plan.top", "1", "--plan.max_measured", "2"]
    result = subprocess.run(
        [sys.executable, "-m", "programs.plan", *argv, "--plan.output", str(out)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    best = result.stdout.splitlines()[2]
    assert best.split()[1] in ("fsdp2", "simple_fsdp") and "cpu offload" in best, result.stdout
    assert float(best.split()[-3]) <= 80
    assert "enable_cpu_offload = true" in out.read_text()
    # Nor does it fit when the node's host memory cannot hold the offloaded state.
    small_host = subprocess.run(
        [sys.executable, "-m", "programs.plan", *argv, "--plan.host_memory_gib", "512", "--plan.output", str(out)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert small_host.returncode == 2
    assert "nor with CPU offload (0 layouts whose state fits plan.host_memory_gib 512 per node)" in small_host.stderr
