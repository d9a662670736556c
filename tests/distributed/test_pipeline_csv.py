"""A custom pipeline schedule read from a CSV file (parallelism.pipeline_parallel_schedule_csv) trains
as the built-in schedule whose order it spells; a CSV that is missing or not such a schedule is one
line naming the option before the ranks start."""

import os

import pytest

from config.errors import ConfigError
from config.manager import load_config
from programs.preflight import check
from tests.launch import FOUR_BLOCKS, REPO, RunBatch, grad_norms, losses

# torch's Interleaved1F1B order on 2 ranks for 4 stages and 8 microbatches (its pipeline_order, written out).
INTERLEAVED_CSV = os.path.join(REPO, "tests", "assets", "custom_schedule.csv")
# torch's 1F1B order on 2 ranks for 8 microbatches (one stage per rank).
ONE_F_ONE_B = [
    "0F0,0F1,,0B0,0F2,0B1,0F3,0B2,0F4,0B3,0F5,0B4,0F6,0B5,0F7,0B6,,0B7",
    ",1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3,1F4,1B4,1F5,1B5,1F6,1B6,1F7,1B7",
]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8", *FOUR_BLOCKS]
STEPS = ["--training.steps", "4", "--lr_scheduler.warmup_steps", "1"]


def schedule(name: str, csv: str = "") -> list[str]:
    given = ["--parallelism.pipeline_parallel_schedule_csv", csv] if csv else []
    return [*PP2, *STEPS, "--parallelism.pipeline_parallel_schedule", name, *given]


@pytest.fixture(scope="module")
def one_f_one_b_csv(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("csv") / "1f1b.csv"
    path.write_text("\n".join(ONE_F_ONE_B) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_f_one_b_csv) -> RunBatch:
    return RunBatch(
        str(tmp_path_factory.mktemp("pipeline_csv")),
        {
            "Interleaved1F1B": (2, schedule("Interleaved1F1B")),
            "Interleaved1F1B_csv": (2, schedule("PipelineScheduleMulti", INTERLEAVED_CSV)),
            "1F1B": (2, schedule("1F1B")),
            "1F1B_csv": (2, schedule("PipelineScheduleSingle", one_f_one_b_csv)),
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize("built_in", ["Interleaved1F1B", "1F1B"])
def test_a_csv_schedule_trains_as_the_built_in_schedule_it_spells(runs, built_in):
    """The same computations in the same order: bitwise the same losses and gradient norms."""
    expected, got = runs.records(built_in), runs.records(f"{built_in}_csv")
    assert len(got) == 4
    assert (losses(got), grad_norms(got)) == (losses(expected), grad_norms(expected))
    assert "pipeline PipelineSchedule" in runs.log(f"{built_in}_csv")


def test_a_missing_or_malformed_csv_is_one_line_naming_the_option(tmp_path, one_f_one_b_csv):
    bad = {
        "missing.csv": "cannot read",
        "words.csv": "'hello' is not an action",
        "short.csv": "has 1 rows of actions, one per rank of parallelism.pipeline_parallel_degree 2",
        "comms.csv": "only computations",
        "order.csv": "without first running Forward",
    }
    (tmp_path / "words.csv").write_text("hello,world\n1F0\n")
    (tmp_path / "short.csv").write_text(ONE_F_ONE_B[0] + "\n")
    (tmp_path / "comms.csv").write_text(ONE_F_ONE_B[0].replace("0F1", "0SEND_F0") + "\n" + ONE_F_ONE_B[1] + "\n")
    (tmp_path / "order.csv").write_text(ONE_F_ONE_B[0].replace("0F0,0F1,,0B0", "0B0,0F0,,0F1") + "\n" + ONE_F_ONE_B[1])
    for name, says in bad.items():
        config = load_config(schedule("PipelineScheduleSingle", str(tmp_path / name)))
        with pytest.raises(ConfigError) as error:
            check(config, world_size=2)
        line = str(error.value)
        assert line.startswith("parallelism.pipeline_parallel_schedule_csv: ") and says in line, line
        assert "\n" not in line
    check(load_config(schedule("PipelineScheduleSingle", one_f_one_b_csv)), world_size=2)
    with pytest.raises(ConfigError, match="give that CSV file, or name a built-in schedule"):
        load_config(schedule("PipelineScheduleMulti"))
