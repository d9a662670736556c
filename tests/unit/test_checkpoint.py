"""CheckpointManager in one process (a gloo group of one): completion marker, verification by
size and CRC-32, fallback past bad checkpoints, a disk that fills up during a save, purging, and the
names pipeline stages save under."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from config.errors import ConfigError
from config.job_config import Checkpoint, Debug
from models.llama3 import Transformer
from parallelisms.pipeline import plan_pipeline, split_stage
from tests.unit.test_mixture import arange_loader, global_order, take_window_ids
from tests.unit.test_model import tiny_args
from trainer.checkpoint.integrity import (
    COMPLETE_MARKER,
    CheckpointError,
    ChecksummedWriter,
    checkpoint_folders,
    file_crc32,
    parts_of,
    read_metadata,
    verify_files,
)
from trainer.checkpoint.manager import CheckpointManager, TrainState, whole_model
from trainer.checkpoint.rules import check_resume
from trainer.fault_injection import FailureInjector


def verify_checkpoint(path: str) -> set[str]:
    verify_files(path)
    return parts_of(read_metadata(path))


@pytest.fixture(scope="module", autouse=True)
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Counter:
    """A stand-in for the dataloader: any object with state_dict / load_state_dict."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


class Run:
    """A tiny model, its optimizer and a CheckpointManager over a dump folder."""

    def __init__(
        self,
        dump_folder: str,
        seed: int = 0,
        data=None,
        storage_writer=None,
        widths=(4, 8, 2),
        resolved_config: str = "[job]\n",
        **checkpoint_options,
    ) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(*(nn.Linear(a, b) for a, b in zip(widths, widths[1:])))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0 / (step + 1))
        self.data = Counter() if data is None else data
        self.step = 0
        self.manager = CheckpointManager(
            Checkpoint(enable=True, **checkpoint_options),
            dump_folder,
            resolved_config,
            model_parts=[self.model],
            optimizer=self.optimizer,
            lr_scheduler=self.scheduler,
            dataloader=self.data,
            train_state=TrainState(lambda: self.step, self._set_step, torch.device("cpu")),
            **({"storage_writer": storage_writer} if storage_writer else {}),
        )

    def _set_step(self, step: int) -> None:
        self.step = step

    def train(self, steps: int, save_every: int = 1) -> None:
        for _ in range(steps):
            self.step += 1
            self.data.position += 3
            self.optimizer.zero_grad()
            self.model(torch.full((2, 4), float(self.step))).square().sum().backward()
            self.manager.wait_for_staging()  # as the Trainer does: an async save may still be copying
            self.optimizer.step()
            self.scheduler.step()
            if self.step % save_every == 0:
                self.manager.write(self.step)
        self.manager.close()

    def snapshot(self) -> dict:
        return {
            "params": [p.detach().clone() for p in self.model.parameters()],
            "exp_avg": [self.optimizer.state[p]["exp_avg"].clone() for p in self.model.parameters()],
            "lr": self.scheduler.get_last_lr(),
            "data": self.data.position,
            "step": self.step,
        }


def assert_same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] and a["data"] == b["data"] and a["lr"] == b["lr"]
    for x, y in zip(a["params"] + a["exp_avg"], b["params"] + b["exp_avg"]):
        assert torch.equal(x, y)


def steps_on_disk(dump_folder: str) -> list[int]:
    return [step for step, _ in checkpoint_folders(os.path.join(dump_folder, "checkpoint"))]


@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_resume_restores_every_part(tmp_path, async_mode):
    first = Run(str(tmp_path), async_mode=async_mode)
    first.train(3)
    saved = first.snapshot()

    second = Run(str(tmp_path), seed=1)
    assert second.manager.resume() == 3
    assert_same(second.snapshot(), saved)
    assert steps_on_disk(str(tmp_path)) == [3, 2, 1]


def test_marker_lists_every_file_and_is_written_last(tmp_path):
    Run(str(tmp_path)).train(1)
    folder = tmp_path / "checkpoint" / "step-1"
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    on_disk = {p.name for p in folder.iterdir()} - {COMPLETE_MARKER}
    assert set(marker["files"]) == on_disk and ".metadata" in on_disk and "config.toml" in on_disk
    assert verify_checkpoint(str(folder)) == {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}


def test_truncated_checkpoint_is_named_and_skipped(tmp_path):
    run = Run(str(tmp_path))
    run.train(2)
    folder = tmp_path / "checkpoint" / "step-2"
    shard = next(p for p in folder.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{shard} is truncated"):
        verify_checkpoint(str(folder))

    resumed = Run(str(tmp_path), seed=1)
    assert resumed.manager.resume() == 1
    assert resumed.step == 1
    # The bad one is kept for inspection but out of the way of the next save of step 2.
    assert (tmp_path / "checkpoint" / "step-2.unloadable").is_dir()
    assert steps_on_disk(str(tmp_path)) == [1]


def flip_one_byte(file) -> None:
    """Changes one byte in the middle of ``file``, in place: same size, other content."""
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_writers_crcs_are_the_files_and_reach_the_marker(tmp_path):
    writer = ChecksummedWriter(str(tmp_path))
    dcp.save({"a": torch.arange(1000.0), "b": {"c": torch.ones(3, 5)}}, storage_writer=writer)
    shards = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert shards and sorted(writer.checksums) == shards  # computed while writing, not read back
    for name in shards:
        assert (
            writer.checksums[name] == f"{zlib.crc32((tmp_path / name).read_bytes()):08x}" == file_crc32(tmp_path / name)
        )

    Run(str(tmp_path / "run")).train(1)
    folder = tmp_path / "run" / "checkpoint" / "step-1"
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    assert marker["crc32"] == {name: file_crc32(folder / name) for name in marker["files"]}


def test_byte_changed_in_a_shard_is_named_and_resume_falls_back(tmp_path):
    Run(str(tmp_path)).train(2)
    at_one = Run(str(tmp_path / "reference"))
    at_one.train(1)
    folder = tmp_path / "checkpoint" / "step-2"
    shard = next(folder.glob("*.distcp"))
    size = shard.stat().st_size
    flip_one_byte(shard)
    assert shard.stat().st_size == size
    with pytest.raises(
        CheckpointError, match=f"{re.escape(str(shard))} is corrupt: its CRC-32 is [0-9a-f]{{8}}, the marker says"
    ):
        verify_checkpoint(str(folder))

    resumed = Run(str(tmp_path), seed=2)
    assert resumed.manager.resume() == 1
    assert_same(resumed.snapshot(), at_one.snapshot())
    assert (tmp_path / "checkpoint" / "step-2.unloadable").is_dir()


@pytest.mark.parametrize("how", ["load_step", "rollback", "initial_load_path"])
def test_every_way_of_loading_checks_the_content(tmp_path, how):
    Run(str(tmp_path)).train(2)
    step_2 = tmp_path / "checkpoint" / "step-2"
    flip_one_byte(next(step_2.glob("*.distcp")))
    # A checkpoint named by an option is refused naming it (exit 2: a restart meets the same files).
    if how == "load_step":
        with pytest.raises(ConfigError, match=re.escape(f"checkpoint.load_step 2: {step_2}/__0_0.distcp is corrupt")):
            Run(str(tmp_path), load_step=2).manager.resume()
    elif how == "rollback":
        assert Run(str(tmp_path)).manager.rollback() == 1  # step 2 is named in a warning and skipped
    else:
        fresh = Run(str(tmp_path / "other"), initial_load_path=str(step_2))
        expected = f"checkpoint.initial_load_path: {step_2}/__0_0.distcp is corrupt"
        with pytest.raises(ConfigError, match=re.escape(expected)):
            fresh.manager.load_at_start()


def test_marker_without_crcs_still_loads(tmp_path):
    """Checkpoints written before the CRCs: their files are checked by size, and they load."""
    first = Run(str(tmp_path))
    first.train(2)
    marker_file = tmp_path / "checkpoint" / "step-2" / COMPLETE_MARKER
    marker = json.loads(marker_file.read_text())
    marker_file.write_text(json.dumps({"step": marker["step"], "files": marker["files"]}))
    resumed = Run(str(tmp_path), seed=1)
    assert resumed.manager.resume() == 2
    assert_same(resumed.snapshot(), first.snapshot())


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_disk_full_during_a_save(tmp_path, async_mode):
    """The disk fills up while step 2 is written: one error naming the folder, no marker, and the
    next start drops the partial folder and resumes from step 1."""
    reference = Run(str(tmp_path / "reference"))
    reference.train(1)
    full_at_2 = FailureInjector(Debug(fail_at_step=2, failure="disk_full_during_save"), rank=0, world_size=1)
    folder = tmp_path / "checkpoint" / "step-2"
    expected = f"^saving {re.escape(str(folder))} failed on rank 0: OSError: \\[Errno 28\\] No space left on device"
    with pytest.raises(CheckpointError, match=expected):
        Run(str(tmp_path), storage_writer=full_at_2.storage_writer, async_mode=async_mode).train(2)
    assert folder.is_dir() and not (folder / COMPLETE_MARKER).exists()
    assert any(0 < p.stat().st_size for p in folder.glob("*.distcp"))  # a partial shard

    resumed = Run(str(tmp_path), seed=1)
    assert resumed.manager.resume() == 1
    assert_same(resumed.snapshot(), reference.snapshot())
    assert steps_on_disk(str(tmp_path)) == [1]


def test_corrupt_metadata_is_named(tmp_path):
    Run(str(tmp_path)).train(1)
    folder = tmp_path / "checkpoint" / "step-1"
    metadata = folder / ".metadata"
    metadata.write_bytes(b"x" * metadata.stat().st_size)  # same size: only reading finds it
    with pytest.raises(CheckpointError, match=f"{metadata} is corrupt"):
        verify_checkpoint(str(folder))


def test_explicit_load_step_reports_instead_of_falling_back(tmp_path):
    """A load_step that does not load is a refusal naming it, and the newer checkpoints stay where
    they are: moved aside first, a restart (which does not go back to load_step) would resume from
    an older one."""
    Run(str(tmp_path)).train(3)
    shard = next((tmp_path / "checkpoint" / "step-2").glob("*.distcp"))
    shard.write_bytes(b"")
    with pytest.raises(ConfigError, match=f"checkpoint.load_step 2: {shard}"):
        Run(str(tmp_path), load_step=2).manager.resume()
    assert steps_on_disk(str(tmp_path)) == [3, 2, 1]
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-1", "step-2", "step-3"]
    with pytest.raises(ConfigError, match="checkpoint.load_step: no complete checkpoint step-7"):
        Run(str(tmp_path), load_step=7).manager.resume()


def test_incomplete_save_is_never_loaded_and_is_removed(tmp_path):
    run = Run(str(tmp_path))
    run.train(2)
    os.remove(tmp_path / "checkpoint" / "step-2" / COMPLETE_MARKER)  # as if the save died before the end
    resumed = Run(str(tmp_path), seed=1)
    assert resumed.manager.resume() == 1
    assert steps_on_disk(str(tmp_path)) == [1]


def test_only_a_save_of_a_run_here_cut_short_is_removed(tmp_path):
    """Step folders without the marker are removed only when they hold nothing but what a save
    writes, begun (its config.toml first) or shards alone."""
    run = Run(str(tmp_path))
    run.train(3)
    folder = tmp_path / "checkpoint"
    os.remove(folder / "step-3" / COMPLETE_MARKER)  # cut short after DCP's metadata
    (folder / "step-5").mkdir()  # cut short before anything was written
    (folder / "step-6").mkdir()  # shards alone: a save cut short before its metadata
    (folder / "step-6" / "__1_0.distcp").write_bytes(b"partial")
    assert Run(str(tmp_path), seed=1).manager.resume() == 2
    assert steps_on_disk(str(tmp_path)) == [2, 1]


@pytest.mark.parametrize("entry", ["another_tools_checkpoint", "users_file", "file"])
def test_a_step_entry_no_save_left_is_refused_and_kept(tmp_path, entry):
    """Another tool's complete DCP checkpoint (torchtitan's, in the same step-N layout, has no
    marker and no config.toml), a step folder holding a user's file, or a file named step-N: a
    save of that step would write into it (keep_latest_k then deleted it whole), so the run is
    refused before it starts, naming it; it stays as it was. A load_only run, which saves nothing,
    goes on."""
    Run(str(tmp_path)).train(2)
    folder = tmp_path / "checkpoint"
    step_3 = folder / "step-3"
    if entry == "file":
        step_3.write_text("mine")
        why = "is a file, where a save writes a folder"
    else:
        shutil.copytree(folder / "step-2", step_3)
        os.remove(step_3 / COMPLETE_MARKER)
        if entry == "users_file":
            (step_3 / "notes.txt").write_text("mine")
        else:
            os.remove(step_3 / "config.toml")
        why = "holds files no save of this trainer wrote"
    before = sorted(os.listdir(step_3)) if step_3.is_dir() else step_3.read_text()
    with pytest.raises(ConfigError, match=re.escape(f"checkpoint.folder: {step_3} {why}")):
        check_resume(Checkpoint(enable=True), str(folder))
    with pytest.raises(ConfigError, match=re.escape(f"checkpoint.folder: {step_3} {why}")):
        Run(str(tmp_path), seed=1).manager.resume()
    assert Run(str(tmp_path), seed=1, load_only=True).manager.resume() == 2
    assert (sorted(os.listdir(step_3)) if step_3.is_dir() else step_3.read_text()) == before


def test_a_load_only_run_changes_nothing_on_disk(tmp_path):
    """load_only saves nothing, so it moves and deletes nothing either: a verification run at an
    older load_step left the newer checkpoints aside, and the next run resumed from the older."""
    Run(str(tmp_path)).train(3)
    folder = tmp_path / "checkpoint"
    os.remove(folder / "step-3" / COMPLETE_MARKER)  # cut short
    before = sorted(os.listdir(folder))
    assert Run(str(tmp_path), seed=1, load_only=True, load_step=1).manager.resume() == 1
    assert sorted(os.listdir(folder)) == before == ["step-1", "step-2", "step-3"]


def test_when_no_checkpoint_loads_the_run_is_refused_and_they_are_kept(tmp_path):
    """Every complete checkpoint corrupt: one error naming each, instead of moving them all aside
    and training from step 1."""
    Run(str(tmp_path)).train(2)
    folder = tmp_path / "checkpoint"
    for step in (1, 2):
        flip_one_byte(folder / f"step-{step}" / "__0_0.distcp")
    with pytest.raises(
        ConfigError,
        match=r"checkpoint.folder: none of the checkpoints in .* loads \(step-2: .*step-2/__0_0.distcp is corrupt.*; step-1: .*step-1/__0_0.distcp is corrupt",
    ):
        Run(str(tmp_path), seed=1).manager.resume()
    assert sorted(os.listdir(folder)) == ["step-1", "step-2"]


def test_a_chosen_load_step_moves_newer_checkpoints_aside_and_keeps_what_was_moved_before(tmp_path, caplog):
    """checkpoint.load_step 1 with steps 2 and 3 on disk: they are not unloadable, just not resumed
    from; moved aside under their own name, and a second such run does not replace the first's."""
    Run(str(tmp_path)).train(3)
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint.manager"):
        assert Run(str(tmp_path), load_step=1).manager.resume() == 1
    folder = tmp_path / "checkpoint"
    assert f"moved the checkpoint {folder / 'step-3'} (newer than checkpoint.load_step 1) to" in caplog.text
    Run(str(tmp_path), seed=1).train(2)  # steps 1 and 2 again, then resumed from step 1 once more
    assert Run(str(tmp_path), load_step=1).manager.resume() == 1
    aside = sorted(path.name for path in folder.iterdir() if not path.name.startswith("step-1"))
    assert aside == ["step-2.not-resumed", "step-2.not-resumed-1", "step-3.not-resumed"]


def test_a_restart_goes_on_from_its_own_saves_not_back_to_the_chosen_load_step(tmp_path, monkeypatch):
    """checkpoint.load_step 1 with step 3 on disk: the first attempt resumes from step 1 and saves
    steps 2 and 3 again; torchrun's restart of the same launch resumes from those, instead of going
    back to step 1 (and moving this launch's own saves aside) on every attempt."""
    Run(str(tmp_path)).train(3)
    first = Run(str(tmp_path), load_step=1)
    assert first.manager.resume() == 1
    first.train(2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert Run(str(tmp_path), seed=1, load_step=1).manager.resume() == 3
    folder = tmp_path / "checkpoint"
    aside = sorted(path.name for path in folder.iterdir() if "." in path.name)
    assert aside == ["step-2.not-resumed", "step-3.not-resumed"]  # the first attempt's, none since


def test_a_restart_loads_the_launchs_own_checkpoints_whole(tmp_path, monkeypatch):
    """exclude_from_loading is for what a launch starts from: torchrun's restart of it loads the
    checkpoints it saved whole (before, it left the optimizer and the data position out again,
    mid-run, and a train_state left out refused the restart after the steps)."""
    Run(str(tmp_path / "pretrained")).train(2)
    options = dict(initial_load_path=str(tmp_path / "pretrained" / "checkpoint" / "step-2"))
    options.update(initial_load_model_only=False, exclude_from_loading=["optimizer", "dataloader", "train_state"])
    monkeypatch.setenv("TESSERA_LAUNCH_ID", "launch-a")
    first = Run(str(tmp_path / "finetune"), **options)
    first.manager.load_at_start()
    assert first.step == 0 and first.data.position == 0 and not first.optimizer.state
    first.train(2)
    saved = first.snapshot()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = Run(str(tmp_path / "finetune"), seed=1, **options)
    assert restarted.manager.resume() == 2
    assert_same(restarted.snapshot(), saved)
    # Another launch's first attempt leaves out what it is told to (train_state: refused, as before).
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TESSERA_LAUNCH_ID", "launch-b")
    options["exclude_from_loading"] = ["optimizer", "dataloader"]
    relaunched = Run(str(tmp_path / "finetune"), seed=1, **options)
    assert relaunched.manager.resume() == 2
    assert relaunched.step == 2 and relaunched.data.position == 0 and not relaunched.optimizer.state


def test_options_a_resume_brings_back_from_the_checkpoint_are_named_when_typed_otherwise(tmp_path, caplog):
    """The optimizer's settings and the LR schedule come back from the checkpoint (the resumed run
    steps as the saved one would): a resume whose config sets them otherwise names each in one
    warning, with the saved value, instead of running at a rate the log never shows."""
    saved = "[training]\nsteps = 3\n[optimizer]\nlr = 0.002\nbeta1 = 0.9\n[lr_scheduler]\nwarmup_steps = 1\n"
    Run(str(tmp_path), resolved_config=saved).train(2)
    typed = saved.replace("steps = 3", "steps = 9").replace("lr = 0.002", "lr = 1e-05").replace("0.9", "0.5")
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint.manager"):
        Run(str(tmp_path), resolved_config=typed).manager.resume()
        changes = "optimizer.beta1 0.5 (saved: 0.9), optimizer.lr 1e-05 (saved: 0.002), training.steps 9 (saved: 3; "
        changes += "the run goes to step 9, its LR schedule is the saved one of 3 steps, at its final rate after those)"
        assert f"these options differ and do not count for them: {changes}" in caplog.text
        caplog.clear()
        Run(str(tmp_path), resolved_config=saved).manager.resume()  # the same options: nothing to say
        Run(str(tmp_path), resolved_config=typed, exclude_from_loading=["optimizer", "lr_scheduler"]).manager.resume()
    assert "do not count" not in caplog.text


def test_a_seed_checkpoint_beside_a_newer_one_says_which_a_resume_takes(tmp_path, caplog):
    """A seed written into a folder that holds step-2: a run there resumes from step-2 (the newest),
    so the seed would go unused without a word."""
    Run(str(tmp_path)).train(2)
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint.manager"):
        Run(str(tmp_path), seed=1).manager.write_seed_checkpoint()
    step_2 = tmp_path / "checkpoint" / "step-2"
    assert f"{step_2} is newer: a run in this folder resumes from it, not from the seed" in caplog.text
    assert Run(str(tmp_path), seed=2).manager.resume() == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint.manager"):
        Run(str(tmp_path / "fresh")).manager.write_seed_checkpoint()
    assert caplog.text == ""


def test_a_seed_checkpoint_never_writes_over_an_earlier_one(tmp_path):
    """A second seed (here of another model) in the same folder is refused, the first kept: it was
    overwritten with only torch's warning."""
    Run(str(tmp_path)).manager.write_seed_checkpoint()
    step_0 = tmp_path / "checkpoint" / "step-0"
    marker = (step_0 / COMPLETE_MARKER).read_text()
    with pytest.raises(ConfigError, match=f"checkpoint.create_seed_checkpoint: {step_0} already holds a checkpoint"):
        Run(str(tmp_path), widths=(4, 16, 2)).manager.write_seed_checkpoint()
    assert (step_0 / COMPLETE_MARKER).read_text() == marker
    assert Run(str(tmp_path), seed=1).manager.resume() == 0


def test_an_initial_load_path_a_resume_passes_over_is_named(tmp_path, caplog):
    """A run's own checkpoints come before checkpoint.initial_load_path: the path it was given is
    named as not loaded, instead of the resume going on without a word."""
    Run(str(tmp_path / "other")).train(1)
    Run(str(tmp_path)).train(2)
    initial = str(tmp_path / "other" / "checkpoint" / "step-1")
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint.manager"):
        assert Run(str(tmp_path), seed=1, initial_load_path=initial).manager.load_at_start() is not None
    assert f"checkpoint.initial_load_path {initial} is not loaded: a run resumes from its own" in caplog.text


def _saved_by_policy(folder: str, steps: range, last_step: int, **options) -> tuple[int, list[int]]:
    """The step a Run over ``folder`` resumed at (None: nothing to resume), and the steps on disk after it called
    ``save(step, last_step)`` after each of ``steps``, as the Trainer does."""
    run = Run(folder, **options)
    resumed = run.manager.resume()
    for step in steps:
        run.step = step
        run.manager.save(step, last_step)
    run.manager.close()
    return resumed, steps_on_disk(folder)


def test_saves_every_interval_at_the_end_at_step_one_if_asked_and_never_when_load_only(tmp_path):
    """torchtitan's enable_first_step_checkpoint adds step 1; load_only resumes and saves none."""
    assert _saved_by_policy(str(tmp_path / "a"), range(1, 8), 7, interval=3) == (None, [7, 6, 3])
    first = _saved_by_policy(str(tmp_path / "b"), range(1, 8), 7, interval=3, enable_first_step_checkpoint=True)
    assert first == (None, [7, 6, 3, 1])
    assert _saved_by_policy(str(tmp_path / "a"), range(8, 10), 9, interval=3, load_only=True) == (7, [7, 6, 3])


def test_keep_latest_k_deletes_older_complete_checkpoints(tmp_path):
    Run(str(tmp_path), keep_latest_k=2, async_mode="async").train(5)
    assert steps_on_disk(str(tmp_path)) == [5, 4]


def test_exclude_from_loading_and_model_only(tmp_path):
    first = Run(str(tmp_path))
    first.train(2)
    saved = first.snapshot()

    partial = Run(str(tmp_path), seed=1, exclude_from_loading=["dataloader", "optimizer"])
    partial.manager.resume()
    assert partial.data.position == 0 and partial.step == 2 and not partial.optimizer.state
    assert all(torch.equal(p, q) for p, q in zip(partial.model.parameters(), saved["params"]))

    # Without train_state a resume would count steps from 1 again and replace these checkpoints:
    # refused, with the option that starts a new run from them (and so for an initial load).
    with pytest.raises(ConfigError, match="^checkpoint.exclude_from_loading: train_state, but .*step-2 is resumed"):
        Run(str(tmp_path), seed=1, exclude_from_loading=["train_state"]).manager.resume()
    step_2 = str(tmp_path / "checkpoint" / "step-2")
    options = dict(initial_load_path=step_2, initial_load_model_only=False, exclude_from_loading=["train_state"])
    no_step = Run(str(tmp_path / "other_state"), seed=1, **options)
    assert no_step.manager.load_at_start() == step_2 and no_step.step == 0
    fresh = Run(str(tmp_path / "other"), seed=1, initial_load_path=step_2)
    fresh.manager.load_at_start()
    assert fresh.step == 0 and all(torch.equal(p, q) for p, q in zip(fresh.model.parameters(), saved["params"]))

    # torchtitan's initial_load_model_only = false: another job's checkpoint loads as a resume.
    whole = Run(str(tmp_path / "whole"), seed=1, initial_load_path=step_2, initial_load_model_only=False)
    assert whole.manager.load_at_start() == step_2
    assert_same(whole.snapshot(), saved)

    # A DCP folder without our marker (written by another program) loads as initial weights, but
    # is never resumed from.
    os.remove(tmp_path / "checkpoint" / "step-2" / COMPLETE_MARKER)
    elsewhere = Run(str(tmp_path / "elsewhere"), seed=1, initial_load_path=step_2)
    elsewhere.manager.load_at_start()
    assert all(torch.equal(p, q) for p, q in zip(elsewhere.model.parameters(), saved["params"]))


@pytest.mark.parametrize(
    "widths, difference",
    [
        ((4, 16, 2), "3 of other shapes (0.weight: [8, 4] saved, [16, 4] in the model)"),
        ((4, 8, 8, 2), "2 tensors it lacks (2.weight, 2.bias); 2 of other shapes (1.weight: [2, 8] saved, [8, 8]"),
        ((4, 2), "2 tensors the model has no place for (1.weight, 1.bias); 2 of other shapes"),
    ],
)
def test_a_checkpoint_of_another_model_is_refused_and_kept(tmp_path, widths, difference):
    """Resuming (or starting from) a checkpoint of another model is a mistake in the job, not a bad
    checkpoint: one line naming the option, the folder and how the models differ, and the
    checkpoints stay where they are (DCP would load a bigger checkpoint into part of a smaller
    model without a word, and a bigger model's failed loads moved every checkpoint aside)."""
    Run(str(tmp_path)).train(2)
    step_2 = str(tmp_path / "checkpoint" / "step-2")
    other = Run(str(tmp_path), seed=1, widths=widths)
    with pytest.raises(ConfigError) as refused:
        other.manager.resume()
    assert str(refused.value).startswith(f"checkpoint.folder: {step_2} holds another model than this job's: ")
    assert difference in str(refused.value)
    assert steps_on_disk(str(tmp_path)) == [2, 1] and other.step == 0
    fresh = Run(str(tmp_path / "fresh"), widths=widths, initial_load_path=step_2)
    with pytest.raises(ConfigError, match=f"^checkpoint.initial_load_path: {step_2} holds another model"):
        fresh.manager.load_at_start()


def test_rollback_keeps_the_dataloader_position(tmp_path):
    run = Run(str(tmp_path))
    run.train(2, save_every=2)
    at_two = run.snapshot()
    run.train(1, save_every=100)
    assert run.manager.rollback() == 2
    restored = run.snapshot()
    assert restored["data"] == 9  # three steps read, none re-read
    assert_same({**restored, "data": at_two["data"]}, at_two)


def test_pipeline_stages_save_under_the_full_models_names():
    args = dataclasses.replace(tiny_args(), n_layers=4)
    with torch.device("meta"):
        model = Transformer(args)
    layout = plan_pipeline(
        n_layers=4,
        pp_degree=2,
        schedule="Interleaved1F1B",
        layers_per_stage=None,
        split_points=[],
        local_batch_size=2,
        microbatch_size=1,
    )
    for pp_rank in range(2):
        stages = [split_stage(model, layout, i) for i in layout.stage_indices(pp_rank)]
        merged = dict(whole_model(stages).named_parameters())
        from_stages = {name for stage in stages for name, _ in stage.named_parameters()}
        assert set(merged) == from_stages
        assert all(merged[name] is param for stage in stages for name, param in stage.named_parameters())
    both = [split_stage(model, layout, i) for i in range(layout.num_stages)]
    assert set(dict(whole_model(both).named_parameters())) == set(dict(model.named_parameters()))


@pytest.mark.parametrize("single_batch, saved_batches", [(4, 3), (2, 4)], ids=["same_batches", "accumulated"])
def test_saved_data_position_continues_at_another_data_parallel_degree(tmp_path, single_batch, saved_batches):
    """The dataloader state goes through a real checkpoint at dp 1 and comes back into two dp
    ranks of 2 sequences: counted sample by sample, the global order goes on with none lost or
    repeated. Saved in batches of 4, or of 2 (a global batch of 4 accumulated in two microbatches:
    the loaders' batches differ, yet the saved step's end is where a batch of both begins)."""
    single = arange_loader(local_batch_size=single_batch)
    batches = iter(single)
    consumed = sum(take_window_ids(batches, saved_batches), [])
    run = Run(str(tmp_path), data=single)
    run.manager.write(saved_batches)
    run.manager.close()

    ranks = [arange_loader(local_batch_size=2, dp_rank=r, dp_world_size=2) for r in range(2)]
    for rank in ranks:
        Run(str(tmp_path), data=rank).manager.resume()
    rank_batches = [iter(rank) for rank in ranks]
    for _ in range(4):
        for batch in rank_batches:
            consumed += take_window_ids(batch, 1)[0]
    assert consumed == global_order(single_batch * saved_batches + 16)


def test_another_number_of_loader_workers_is_named_not_taken_for_a_bad_checkpoint(tmp_path):
    """The data position is each loader worker's: resumed with other dataloader_num_workers it
    does not load (DCP: a missing key), which would make every checkpoint look unloadable. One
    line names the option, and leaving the data position out resumes the rest."""
    Run(str(tmp_path), resolved_config="[training]\ndataloader_num_workers = 0\n").train(2)
    other = "[training]\ndataloader_num_workers = 2\n"
    expected = "training.dataloader_num_workers 2: the data position in .*step-2 was saved by 0; keep 0, or start"
    with pytest.raises(ConfigError, match=expected):
        Run(str(tmp_path), seed=1, resolved_config=other).manager.resume()
    resumed = Run(str(tmp_path), seed=1, resolved_config=other, exclude_from_loading=["dataloader"])
    assert resumed.manager.resume() == 2 and resumed.data.position == 0
