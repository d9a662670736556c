"""SimpleFSDP compiled: collective counts, bucket order, prefetch order and resharding read from
the compiled graphs, and losses against eager (see compile_checks.py for each check)."""

import pytest

from tests.launch import run_worker

pytestmark = pytest.mark.slow  # every test here launches torchrun / run_train.sh

AOT_EAGER_CHECKS = [
    "none_counts",
    "none_losses",
    "manual_counts",
    "manual_losses",
    "manual_bucket_order",
    "manual_prefetch_order",
    "reshard_regathers",
    "reshard_frees_gathered",
    "block_graph_reused",
    "block_counts",
    "block_losses",
    "block_prefetch_order",
    "auto_plan_has_multi_unit_bucket",
    "auto_counts",
    "auto_losses",
    "never_no_regather",
    "never_keeps_gathered",
    "never_losses",
]
# Inductor runs the bucketing, resharding and block checks, not the unbucketed graph's, the auto
# plan's or `never`'s (each of those an Inductor compile of the whole model, about a minute here).
INDUCTOR_CHECKS = AOT_EAGER_CHECKS[2:12]


@pytest.mark.parametrize("backend, expected", [("aot_eager", AOT_EAGER_CHECKS), ("inductor", INDUCTOR_CHECKS)])
def test_compiled_simple_fsdp(backend, expected):
    # The graph cache would skip our pass on a hit, and the checks read what the pass saw.
    output = run_worker("compile_checks.py", 2, backend, env={"TORCHINDUCTOR_FX_GRAPH_CACHE": "0"})
    passed = [line.split()[1] for line in output.splitlines() if line.startswith("CHECK ")]
    assert passed == expected
