"""SimpleFSDP on 2 and 4 gloo ranks: one torchrun launch per world size runs that size's checks
(``simple_fsdp_checks.py``), and each check is reported here as its own test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO

pytestmark = pytest.mark.slow  # every test here launches torchrun / run_train.sh

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "simple_fsdp_checks.py")
# A launch takes ~25 s (2 ranks) / ~45 s (4 ranks) on 2 idle CPU cores; a hang must not block the suite.
TIMEOUT_SECONDS = 300

# The worker's checks at each world size (simple_fsdp_checks.checks): 4 ranks add HSDP and TP and
# leave out the checks whose counts and tolerances do not depend on the world size.
CHECKS = {
    2: [
        "parity_replicate",
        "parity_fully_shard",
        "state_dict",
        "materialized",
        "reshard_memory",
        "fsdp2_reshard_policy",
        "dcp",
        "bf16",
    ],
    4: [
        "parity_replicate",
        "parity_fully_shard",
        "parity_hybrid_shard",
        "state_dict",
        "materialized",
        "dcp",
        "tensor_parallel",
    ],
}


def _launch(nproc: int, out_dir: Path) -> dict:
    """Runs the worker on ``nproc`` ranks; returns its results, or raises with its output."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        WORKER,
        str(out_dir),
    ]
    python_path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=python_path)
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_SECONDS)
    results_file = out_dir / "results.json"
    if result.returncode != 0 or not results_file.exists():
        output = f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        raise AssertionError(f"worker failed ({result.returncode}):\n{output}")
    return json.loads(results_file.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``results(nproc)``: the worker's results on ``nproc`` ranks, launched once per module."""
    launched: dict[int, dict | Exception] = {}

    def get(nproc: int) -> dict:
        if nproc not in launched:
            try:
                launched[nproc] = _launch(nproc, tmp_path_factory.mktemp(f"simple_fsdp_{nproc}"))
            except (AssertionError, subprocess.TimeoutExpired) as error:
                launched[nproc] = error
        if isinstance(launched[nproc], Exception):
            raise launched[nproc]
        return launched[nproc]

    return get


@pytest.mark.parametrize("nproc, check", [(nproc, check) for nproc, checks in CHECKS.items() for check in checks])
def test_simple_fsdp(results, nproc: int, check: str):
    result = results(nproc)[check]
    assert result["ok"], result["error"] or json.dumps(result, indent=1)
