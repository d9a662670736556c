"""The Trainer: builds a run's components from the config, then runs the training loop."""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import logging
import math
import os

import torch
import torch.distributed as dist

from config.errors import ConfigError, user_input
from config.job_config import RESOLVED_CONFIG_FILE, RESOLVED_CONFIG_HEADER, JobConfig
from config.manager import to_toml
from config.rules import batch_layout
from models.builder import build_model, document_masking
from models.sizes import job_model_args
from parallelisms.compile import log_graph_breaks
from parallelisms.device import device_peak, use_deterministic_algorithms
from parallelisms.float8 import precompute_float8_scales
from parallelisms.tensor_parallel import local_loss
from trainer.checkpoint.elastic import fitted_to_world
from trainer.checkpoint.hf import job_export_assets
from trainer.checkpoint.manager import CheckpointManager, TrainState
from trainer.data.batch import Batch
from trainer.data.loader import config_dataloader
from trainer.data.tokenizer import build_tokenizer
from trainer.distributed import init_distributed, is_first_attempt, parallel_dims_from_config, set_collective_timeout
from trainer.evaluate import Evaluator
from trainer.fault_injection import FailureInjector
from trainer.fault_tolerance import data_share, join_replica_groups
from trainer.folders import check_folders_at_start, claim_folders, write_run_file
from trainer.loss import Loss
from trainer.metrics import (
    SourceTokens,
    ThroughputTracker,
    build_metrics_logger,
    log_peak,
    peak_memory_gib,
    tokens_of_this_rank,
)
from trainer.optim import OptimizerInBackward, build_optimizer_and_schedule, clip_grad_norm_
from trainer.profiling import collect_garbage_held_by_cycles, maybe_profile, maybe_snapshot_memory
from trainer.validate import Validator, validation_due
from trainer.watchdog import Watchdog

logger = logging.getLogger(__name__)

Microbatches = list[Batch]


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm under ``training.nonfinite_policy = "error"``."""


class Trainer:
    def __init__(self, config: JobConfig):
        check_folders_at_start(config)
        self.config = config = fitted_to_world(config, int(os.environ.get("WORLD_SIZE", "1")))  # elastic resumes
        # Rank 0 (torchrun's RANK; the process group is not up yet) holds the folders until it ends.
        self._folder_claims = claim_folders(config) if os.environ.get("RANK", "0") == "0" else []
        self.device = init_distributed(config.comm, config.job.dump_folder)
        self.rank = dist.get_rank()
        torch.manual_seed(config.debug.seed)
        if config.debug.deterministic:
            use_deterministic_algorithms(warn_only=config.debug.deterministic_warn_only)
        self.parallel_dims = dims = parallel_dims_from_config(config.parallelism, dist.get_world_size())
        self.parallel_dims.build_mesh(self.device.type)
        self.cp_shard = dims.cp, dims.cp_rank  # which chunks of each sequence this rank trains on
        self.global_batch_size, self.grad_accum_steps = batch_layout(config.training, self.parallel_dims.dp_degree)
        tokens_per_step = self.global_batch_size * config.training.seq_len
        self._write_resolved_config()

        with user_input("model.tokenizer_path"):
            self.tokenizer = build_tokenizer(
                config.model.tokenizer_path, config.job.cache_dir, config.model.default_tokenizer_vocab_size
            )
        args = job_model_args(config, self.tokenizer.vocab_size)
        masking = document_masking(config.training, args)
        # The model's attention follows the decision (a block-causal flavor with masking off is causal).
        args = dataclasses.replace(args, attn_mask_type="block_causal" if masking else "causal")
        ignores_labels = masking or config.training.dataset_format == "chat"
        parallel = config.parallelism
        self.loss = Loss(
            tokens_per_step, self.parallel_dims, config.compile, parallel.enable_loss_parallel, ignores_labels
        )
        data = functools.partial(
            config_dataloader,
            training=config.training,
            tokenizer=self.tokenizer,
            parallel_dims=self.parallel_dims,
            cache_dir=config.job.cache_dir,
            document_masking=masking,
        )
        self.dataloader = data("training.dataset", config.training, seed=config.debug.seed, replica=data_share(config))
        self.model = build_model(config, self.parallel_dims, self.device, args, self.loss)
        self.optimizer, self.lr_scheduler = build_optimizer_and_schedule(
            config.optimizer, config.lr_scheduler, config.training, self.model.parts
        )
        self._precompute_float8 = (
            "float8" in config.model.converters and config.float8.precompute_float8_dynamic_scale_for_fsdp
        )
        if self._precompute_float8:
            self.optimizer.register_step_post_hook(lambda *_: self._refresh_float8_scales())

        self.metrics = build_metrics_logger(config, self.rank, tokens_per_step)
        self.peak_flops = log_peak(device_peak(self.device, self.model.compute_dtype, config.metrics.peak_flops))
        self.throughput = ThroughputTracker()
        self.source_tokens = SourceTokens(config.training.datasets, self.parallel_dims)
        # Another seed than training's: other windows of the same corpus.
        validation_data = functools.partial(data, "validation.dataset", config.validation, seed=config.debug.seed + 1)
        self.validator = Validator(config.validation, validation_data, dims.dp_degree, self.loss, self.cp_shard)
        self.failures = FailureInjector(config.debug, self.rank, dist.get_world_size())
        self.watchdog = Watchdog(config.comm, config.metrics, config.job.dump_folder, dims, self.device)
        self.step = 0
        self.checkpointer = self._build_checkpointer()

    def _write_resolved_config(self) -> None:
        os.makedirs(self.config.job.dump_folder, exist_ok=True)
        if self.rank == 0:
            resolved = RESOLVED_CONFIG_HEADER + to_toml(self.config)
            write_run_file(os.path.join(self.config.job.dump_folder, RESOLVED_CONFIG_FILE), resolved)
            if self.config.job.save_config_file:
                path = os.path.join(self.config.job.dump_folder, self.config.job.save_config_file)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                write_run_file(path, json.dumps(dataclasses.asdict(self.config), indent=2))
        if self.config.job.print_config:
            logger.info("resolved config:\n%s", to_toml(self.config))

    def _build_checkpointer(self) -> CheckpointManager | None:
        ckpt = self.config.checkpoint
        if not ckpt.enable and not ckpt.initial_load_path:
            return None
        return CheckpointManager(
            ckpt,
            self.config.job.dump_folder,
            to_toml(self.config),
            model_parts=self.model.parts,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader,
            train_state=TrainState(lambda: self.step, lambda step: setattr(self, "step", step), self.device),
            storage_writer=self.failures.storage_writer,
            timeout_seconds=self.config.comm.init_timeout_seconds,
        )

    def _start_data(self, resumed: str | None):
        """The batches from the saved position; one that does not fit the job is a one-line mistake, not a restart."""
        try:
            # iter() checks a restored position; a context-parallel rank keeps its chunks of each sequence.
            return (batch.context_parallel_shard(*self.cp_shard) for batch in self.dataloader)
        except ValueError as e:
            if resumed is None:
                raise
            initial = resumed == self.config.checkpoint.initial_load_path
            option = "checkpoint.initial_load_path" if initial else "checkpoint.folder"
            raise ConfigError(
                f"{option}: the data position saved in {resumed} does not fit this job: {e}; "
                "keep the checkpoint's training.dataset, seq_len, global batch and seed, or start the data "
                "over with --checkpoint.exclude_from_loading dataloader"
            ) from None

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """Forward and backward of one microbatch (on the device); returns this rank's share of the
        global-batch mean. ``loss.start_step`` comes first in the step."""
        if self.model.schedule is not None:
            # The schedule computes the loss and its backward inside its step.
            with self.loss.context():
                return self.model.run_pipeline(batch.inputs, batch.labels, train=True, positions=batch.positions)
        logits = self.model.parts[0](batch.inputs, positions=batch.positions)
        with self.loss.context():
            loss = self.loss(logits, batch.labels)
            loss.backward()
        return local_loss(loss.detach())

    def train_step(self, microbatches: Microbatches) -> dict[str, float]:
        """Forward/backward, clip, update; a non-finite loss or norm leaves the model untouched (but in backward)."""
        lr = self.lr_scheduler.get_last_lr()[0]
        self.optimizer.zero_grad()
        self.loss.start_step([batch.labels for batch in microbatches], self.device)
        if isinstance(self.optimizer, OptimizerInBackward):
            return self._train_step_updating_in_backward(microbatches, lr)
        loss = sum(self.forward_backward(batch.to(self.device)) for batch in microbatches)
        self.watchdog.mark("optimizer")
        params = [p for part in self.model.parts for p in part.parameters() if p.grad is not None]
        self.failures.poison(params)
        if (replicas := self.replicas.average_and_commit(params)) is None:
            return self.train_step(microbatches)  # not every replica group's gradient arrived: the same batches again
        max_norm = self.config.training.max_norm if self.config.training.max_norm > 0 else float("inf")
        grad_norm = clip_grad_norm_(params, max_norm, pp_mesh=self.parallel_dims.pp_mesh)
        step_metrics = {"loss": self._sum_over_ranks(loss).item(), "grad_norm": grad_norm.item(), "lr": lr, **replicas}
        # Both values are global, so every rank takes the same branch.
        if math.isfinite(step_metrics["loss"]) and math.isfinite(step_metrics["grad_norm"]):
            if self.checkpointer is not None:
                self.checkpointer.wait_for_staging()  # a background save may still be copying the state
            self.optimizer.step()
            self.lr_scheduler.step()
        return step_metrics

    def _train_step_updating_in_backward(self, microbatches: Microbatches, lr: float) -> dict[str, float]:
        """The last microbatch's backward updates each parameter; nothing is clipped or skipped."""
        if self.checkpointer is not None:
            self.checkpointer.wait_for_staging()  # the updates start in this step's backward
        losses = []
        for i, batch in enumerate(microbatches):
            self.optimizer.stepping = i == len(microbatches) - 1
            losses.append(self.forward_backward(batch.to(self.device)))
        grad_norm = self.optimizer.grad_norm()
        self.optimizer.step()  # nothing left to update; the schedule counts it
        self.lr_scheduler.step()
        return {"loss": self._sum_over_ranks(sum(losses)).item(), "grad_norm": grad_norm.item(), "lr": lr}

    def _sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """Sums a per-rank share of a global mean over the data-, context-parallel and pipeline ranks."""
        for mesh in (self.parallel_dims.pp_mesh, self.parallel_dims.dp_cp_mesh):
            if mesh is not None:
                dist.all_reduce(value, group=mesh.get_group())
        return value

    def train(self) -> None:
        config = self.config
        if config.checkpoint.create_seed_checkpoint:
            self.checkpointer.write_seed_checkpoint()
            return
        resumed = self.checkpointer.load_at_start() if self.checkpointer is not None else None
        self._refresh_float8_scales()  # loading the optimizer's state steps it once, before the weights load
        if self.step >= config.training.steps:
            logger.warning(
                f"resumed at step {self.step}, the run's end (training.steps {config.training.steps}): nothing left "
                "to train; raise training.steps to train on"
            )
        self.replicas = join_replica_groups(self)  # fault_tolerance.enable: a group behind takes a live one's state
        self.evaluator = Evaluator(config, self.tokenizer, self.parallel_dims, self.device)  # eval.tasks read
        data_iter = self.replicas.start_data(self._start_data, resumed)
        self.metrics.start(self.step, new_run=self.step == 0 and is_first_attempt())
        if config.debug.gc_freq > 0 or config.debug.gc_debug:
            gc.disable()
        logger.info(
            f"training {config.training.steps} steps: global batch {self.global_batch_size} sequences "
            f"({self.grad_accum_steps} microbatches of {config.training.local_batch_size} per rank x "
            f"{self.parallel_dims.dp_degree} dp ranks)"
        )
        first_step = self.step + 1
        profiling, dump = config.profiling, config.job.dump_folder
        with (
            maybe_profile(profiling, dump, self.rank, self.step) as profiler,
            maybe_snapshot_memory(profiling, dump, self.rank, self.device, self.step) as snapshots,
        ):
            while self.step < config.training.steps:
                step = self.step + 1
                self.watchdog.mark("data", step)
                self._collect_garbage(step)
                with self.throughput.data_loading():
                    microbatches = [next(data_iter) for _ in range(self.grad_accum_steps)]
                self.watchdog.mark("forward/backward")
                self.failures.before_step(step)
                step_metrics = self.train_step(microbatches)
                if step == first_step:
                    set_collective_timeout(config.comm.train_timeout_seconds, self.parallel_dims.mesh)
                    if config.compile.enable:
                        log_graph_breaks(logger)
                if not (math.isfinite(step_metrics["loss"]) and math.isfinite(step_metrics["grad_norm"])):
                    self._handle_nonfinite(step, step_metrics)
                    continue
                self.step = step
                self._after_step(step_metrics, microbatches, log=step == first_step)
                if profiler is not None:
                    profiler.step()
                if snapshots is not None:
                    snapshots.step_done(step)
        self.watchdog.stop()
        self._finish()

    def _refresh_float8_scales(self) -> None:
        """float8.precompute_float8_dynamic_scale_for_fsdp: after every change of the weights."""
        if self._precompute_float8:
            precompute_float8_scales(self.model.parts)

    def _collect_garbage(self, step: int) -> None:
        """Python's collector runs between steps, when debug.gc_freq or gc_debug says."""
        debug = self.config.debug
        if debug.gc_debug:
            collect_garbage_held_by_cycles()
        elif debug.gc_freq > 0 and step % debug.gc_freq == 0:
            gc.collect(1)

    def _finish(self) -> None:
        config = self.config
        hf_folder = None
        if config.checkpoint.export_hf:
            assets = job_export_assets(config, self.tokenizer.bos_id, self.tokenizer.eos_id)
            hf_folder = self.checkpointer.export_hf(self.model.args, assets)
        checkpoints = self.checkpointer.folder if config.checkpoint.enable else None
        self.metrics.summary(checkpoint_folder=checkpoints, hf_folder=hf_folder)
        self.metrics.close()

    def _after_step(self, step_metrics: dict[str, float], microbatches: Microbatches, log: bool) -> None:
        step, config = self.step, self.config
        self.throughput.add_tokens(tokens_of_this_rank(microbatches, self.parallel_dims))
        self.source_tokens.add(microbatches)
        self.metrics.step_done(step, step_metrics["loss"])
        if log or step % config.metrics.log_freq == 0 or step == config.training.steps:
            summary = self.throughput.summarize(self.model.flops_per_token, self.peak_flops)
            values = {**step_metrics, **summary, "memory_gib": peak_memory_gib(self.device)}
            self.metrics.log(step, values, self.source_tokens.take(self.device), self.watchdog.stragglers())
        if self.checkpointer is not None:
            self.watchdog.mark("checkpoint")
            self.checkpointer.save(step, config.training.steps)
        if config.validation.enable and validation_due(step, config.validation.freq):
            self.watchdog.mark("validation")
            loss = self._sum_over_ranks(self.validator.validate(self.model, self.device, step))
            self.metrics.log_validation(step, loss.item())
        if self.evaluator.due(step):
            self.watchdog.mark("evaluation")
            self.metrics.log_evaluation(step, *self.evaluator.evaluate(self.model))

    def _handle_nonfinite(self, step: int, step_metrics: dict[str, float]) -> None:
        policy = self.config.training.nonfinite_policy
        what = f"non-finite loss {step_metrics['loss']} or grad norm {step_metrics['grad_norm']} at step {step}"
        if policy == "error":
            if self.checkpointer is not None:
                self.checkpointer.wait()  # every rank sees the same loss: the save in flight completes
            raise NonFiniteError(f"{what} (training.nonfinite_policy=error)")
        if policy == "skip_step":
            logger.warning("%s: update skipped, batch dropped (training.nonfinite_policy=skip_step)", what)
            return
        self.step = self.checkpointer.rollback()
        self._refresh_float8_scales()
        logger.warning(
            f"{what}: rolled back to step {self.step}, going on with the next batches (training.nonfinite_policy=rollback)"
        )

    def close(self) -> None:
        """Waits for the checkpoint in flight, then for every rank: none leaves while a peer talks to it."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        if dist.is_initialized():
            dist.barrier()
