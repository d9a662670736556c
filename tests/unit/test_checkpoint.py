"""CheckpointManager in one process (a gloo group of one): completion marker, verification,
fallback past bad checkpoints, purging, and the names pipeline stages save under."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from config.job_config import Checkpoint, ConfigError
from models.llama3 import Transformer
from parallelisms.pipeline import plan_pipeline, split_stage
from tests.unit.test_data import arange_loader, global_order, take_window_ids
from tests.unit.test_model import tiny_args
from trainer.checkpoint import (
    COMPLETE_MARKER,
    CheckpointError,
    CheckpointManager,
    TrainState,
    checkpoint_folders,
    verify_checkpoint,
    whole_model,
)


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

    def __init__(self, dump_folder: str, seed: int = 0, data=None, **checkpoint_options) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0 / (step + 1))
        self.data = Counter() if data is None else data
        self.step = 0
        self.manager = CheckpointManager(
            Checkpoint(enable=True, **checkpoint_options),
            dump_folder,
            "[job]\n",
            model_parts=[self.model],
            optimizer=self.optimizer,
            lr_scheduler=self.scheduler,
            dataloader=self.data,
            train_state=TrainState(lambda: self.step, self._set_step, torch.device("cpu")),
        )

    def _set_step(self, step: int) -> None:
        self.step = step

    def train(self, steps: int, save_every: int = 1) -> None:
        for _ in range(steps):
            self.step += 1
            self.data.position += 3
            self.optimizer.zero_grad()
            self.model(torch.full((2, 4), float(self.step))).square().sum().backward()
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


def test_corrupt_metadata_is_named(tmp_path):
    Run(str(tmp_path)).train(1)
    folder = tmp_path / "checkpoint" / "step-1"
    metadata = folder / ".metadata"
    metadata.write_bytes(b"x" * metadata.stat().st_size)  # same size: only reading finds it
    with pytest.raises(CheckpointError, match=f"{metadata} is corrupt"):
        verify_checkpoint(str(folder))


def test_explicit_load_step_reports_instead_of_falling_back(tmp_path):
    Run(str(tmp_path)).train(2)
    shard = next((tmp_path / "checkpoint" / "step-2").glob("*.distcp"))
    shard.write_bytes(b"")
    with pytest.raises(CheckpointError, match=str(shard)):
        Run(str(tmp_path), load_step=2).manager.resume()
    with pytest.raises(ConfigError, match="checkpoint.load_step: no complete checkpoint step-7"):
        Run(str(tmp_path), load_step=7).manager.resume()


def test_incomplete_save_is_never_loaded_and_is_removed(tmp_path):
    run = Run(str(tmp_path))
    run.train(2)
    os.remove(tmp_path / "checkpoint" / "step-2" / COMPLETE_MARKER)  # as if the save died before the end
    resumed = Run(str(tmp_path), seed=1)
    assert resumed.manager.resume() == 1
    assert steps_on_disk(str(tmp_path)) == [1]


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

    step_2 = str(tmp_path / "checkpoint" / "step-2")
    fresh = Run(str(tmp_path / "other"), seed=1, initial_load_path=step_2)
    fresh.manager.load_at_start()
    assert fresh.step == 0 and all(torch.equal(p, q) for p, q in zip(fresh.model.parameters(), saved["params"]))

    # A DCP folder without our marker (written by another program) loads as initial weights, but
    # is never resumed from.
    os.remove(tmp_path / "checkpoint" / "step-2" / COMPLETE_MARKER)
    elsewhere = Run(str(tmp_path / "elsewhere"), seed=1, initial_load_path=step_2)
    elsewhere.manager.load_at_start()
    assert all(torch.equal(p, q) for p, q in zip(elsewhere.model.parameters(), saved["params"]))


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


def test_saved_data_position_continues_at_another_data_parallel_degree(tmp_path):
    """The dataloader state goes through a real checkpoint at dp 1 and comes back into two dp
    ranks: counted sample by sample, the global order goes on with none lost or repeated."""
    single = arange_loader(local_batch_size=4)
    batches = iter(single)
    consumed = sum(take_window_ids(batches, 3), [])
    run = Run(str(tmp_path), data=single)
    run.manager.write(3)
    run.manager.close()

    ranks = [arange_loader(local_batch_size=2, dp_rank=r, dp_world_size=2) for r in range(2)]
    for rank in ranks:
        Run(str(tmp_path), data=rank).manager.resume()
    rank_batches = [iter(rank) for rank in ranks]
    for _ in range(4):
        for batch in rank_batches:
            consumed += take_window_ids(batch, 1)[0]
    assert consumed == global_order(28)
