"""The Trainer: builds everything a run needs from the config, then trains."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from models.registry import ModelSpec, get_flavor, get_model_spec
from parallelisms.compile import apply_compile_loss, log_graph_breaks
from parallelisms.pipeline import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES, PipelineLayout, Schedule, build_schedule, plan_pipeline, split_stage
from parallelisms.tensor_parallel import is_vocab_sharded
from trainer.checkpoint import CheckpointManager, ModelState, OptimizerState, TrainState
from trainer.config import ConfigError, JobConfig, batch_layout, to_toml, user_input
from trainer.data import build_dataloader
from trainer.hf_checkpoint import export_hf, is_hf_folder, load_hf_weights
from trainer.distributed import ParallelDims, init_distributed, set_collective_timeout
from trainer.metrics import MetricsLogger, ThroughputTracker, device_peak_flops, peak_memory_gib
from trainer.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from trainer.profiling import maybe_profile
from trainer.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm under ``training.nonfinite_policy = "error"``."""


def _loss_context(logits: torch.Tensor) -> contextlib.AbstractContextManager:
    """``loss_parallel()`` for vocab-sharded logits (tensor parallelism); it must also cover the
    backward. Otherwise no context."""
    return loss_parallel() if is_vocab_sharded(logits) else contextlib.nullcontext()


def _summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the tokens, in fp32. Vocab-sharded logits are used as they are
    (inside ``_loss_context``); other DTensor logits are gathered into one tensor first."""
    if isinstance(logits, DTensor) and not is_vocab_sharded(logits):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


def _local_value(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (loss parallel returns a replicated DTensor)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def pipeline_layout(config: JobConfig, n_layers: int) -> PipelineLayout:
    """The pipeline stages and microbatch count that ``config`` asks for, for a model of
    ``n_layers`` blocks; a one-line ConfigError when they are impossible."""
    p = config.parallelism
    schedule = p.pipeline_parallel_schedule
    if config.validation.enable and schedule in V_SCHEDULES:
        # torch's forward-only run (schedule.eval) of a V-shaped pipeline fails at its same-rank hand-over.
        raise ConfigError(f"validation.enable: not supported with the {schedule} pipeline schedule")
    if schedule in ZERO_BUBBLE_SCHEDULES:
        # These schedules split backward into input- and weight-gradient passes, which a compiled
        # backward does not support and FSDP's reshard/re-gather breaks (None or wrong gradients).
        if config.compile.enable:
            raise ConfigError(f"compile.enable: not supported with the {schedule} pipeline schedule")
        if p.fsdp_reshard_after_forward == "always":
            raise ConfigError(
                f"parallelism.fsdp_reshard_after_forward: 'always' gives wrong gradients with the {schedule} "
                "pipeline schedule; use default or never"
            )
    with user_input():
        return plan_pipeline(
            n_layers=n_layers,
            pp_degree=p.pipeline_parallel_degree,
            schedule=p.pipeline_parallel_schedule,
            layers_per_stage=p.pipeline_parallel_layers_per_stage,
            split_points=p.pipeline_parallel_split_points,
            local_batch_size=config.training.local_batch_size,
            microbatch_size=p.pipeline_parallel_microbatch_size,
        )


class Trainer:
    def __init__(self, config: JobConfig):
        self.config = config
        self.device = init_distributed(config.comm.init_timeout_seconds)
        self.rank = dist.get_rank()
        self._set_determinism()

        self.parallel_dims = ParallelDims.from_config(config.parallelism, dist.get_world_size())
        self.mesh = self.parallel_dims.build_mesh(self.device.type)
        self.pp_mesh = self.mesh["pp"] if self.parallel_dims.pp_enabled else None
        self.dp_rank, self.dp_size = self.parallel_dims.dp_rank_and_size(self.mesh)
        self.global_batch_size, self.grad_accum_steps = batch_layout(config.training, self.dp_size)
        self.global_tokens_per_step = self.global_batch_size * config.training.seq_len
        self._cross_entropy = _summed_cross_entropy
        if config.compile.enable and not self.parallel_dims.tp_enabled:
            # Under tensor parallelism the logits are DTensors handled by loss_parallel: left eager.
            self._cross_entropy = apply_compile_loss(_summed_cross_entropy, config.compile.backend)

        os.makedirs(config.job.dump_folder, exist_ok=True)
        if self.rank == 0:
            with open(os.path.join(config.job.dump_folder, "config.toml"), "w") as f:
                f.write(to_toml(config))
        logger.info("resolved config:\n%s", to_toml(config))

        with user_input("model.tokenizer_path"):
            self.tokenizer = build_tokenizer(
                config.model.tokenizer_path, config.job.cache_dir, config.model.default_tokenizer_vocab_size
            )
        with user_input("training.dataset"):
            self.dataloader = self._build_dataloader(config.training.dataset, config.debug.seed)

        self.pp_schedule: Schedule | None = None
        self.model_parts = self._build_model_parts()
        # Without pipeline parallelism the one part is the whole model.
        self.model: torch.nn.Module | None = self.model_parts[0] if self.pp_schedule is None else None
        with user_input():
            self.optimizer = build_optimizer(
                self.model_parts,
                name=config.optimizer.name,
                lr=config.optimizer.lr,
                betas=(config.optimizer.beta1, config.optimizer.beta2),
                eps=config.optimizer.eps,
                weight_decay=config.optimizer.weight_decay,
                implementation=config.optimizer.implementation,
            )
            self.lr_scheduler = build_lr_scheduler(
                self.optimizer,
                warmup_steps=config.lr_scheduler.warmup_steps,
                total_steps=config.training.steps,
                decay_type=config.lr_scheduler.decay_type,
                decay_ratio=config.lr_scheduler.decay_ratio,
                min_lr_factor=config.lr_scheduler.min_lr_factor,
            )

        run_name = config.job.run_name or time.strftime("%Y%m%d-%H%M%S")
        self.metrics = MetricsLogger(
            config.job.dump_folder,
            enable=self.rank == 0,
            enable_tensorboard=config.metrics.enable_tensorboard,
            tensorboard_dir=os.path.join(config.job.dump_folder, config.metrics.save_tb_folder, run_name),
        )
        self.peak_flops = device_peak_flops(
            self.device, getattr(torch, config.training.mixed_precision_param), config.metrics.peak_flops
        )
        self.throughput = ThroughputTracker()
        self.step = 0
        self._failure_injected = False
        self._poison_gradients = False
        self.checkpointer = self._build_checkpointer()

    def _is_first_attempt(self) -> bool:
        return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def _build_checkpointer(self) -> CheckpointManager | None:
        ckpt = self.config.checkpoint
        if not ckpt.enable and not ckpt.initial_load_path:
            return None
        states = {
            "model": ModelState(self.model_parts),
            "optimizer": OptimizerState(self.model_parts, self.optimizer),
            "lr_scheduler": self.lr_scheduler,
            "dataloader": self.dataloader,
            "train_state": TrainState(lambda: self.step, self._set_step, self.device),
        }
        checkpointer = CheckpointManager(ckpt, self.config.job.dump_folder, states, to_toml(self.config))
        debug = self.config.debug
        if debug.failure == "kill_during_save" and self._is_first_attempt():
            checkpointer.fail_during_save_at_step = debug.fail_at_step
        return checkpointer

    def _set_step(self, step: int) -> None:
        self.step = step

    # ------------------------------------------------------------------ set-up helpers

    def _set_determinism(self) -> None:
        torch.manual_seed(self.config.debug.seed)
        if self.config.debug.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False

    def _build_dataloader(self, dataset: str, seed: int):
        return build_dataloader(
            dataset,
            self.tokenizer,
            seq_len=self.config.training.seq_len,
            local_batch_size=self.config.training.local_batch_size,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_size,
            seed=seed,
            cache_dir=self.config.job.cache_dir,
            num_workers=self.config.training.dataloader_num_workers,
        )

    def _build_model_parts(self) -> list[torch.nn.Module]:
        """The model; under pipeline parallelism this rank's stages of it, and ``self.pp_schedule``
        running them."""
        spec = get_model_spec(self.config.model.name)
        model_args = dataclasses.replace(
            get_flavor(spec, self.config.model.flavor),
            vocab_size=self.tokenizer.vocab_size,
            max_seq_len=self.config.training.seq_len,
        )
        # Built without storage, so that a model of any size is only ever materialized sharded.
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        self.model_args = model_args
        self.flops_per_token = spec.flops_per_token_fn(model_args, model, self.config.training.seq_len)
        n_params = sum(p.numel() for p in model.parameters())
        logger.info("%s %s: %.2fM parameters", spec.name, self.config.model.flavor, n_params / 1e6)
        if self.pp_mesh is None:
            return [self._parallelize_and_init(spec, model)]

        layout = pipeline_layout(self.config, model_args.n_layers)
        logger.info(
            "pipeline %s, %d microbatches per step:\n%s", layout.schedule, layout.n_microbatches, layout.describe()
        )
        pp_rank = self.pp_mesh.get_local_rank()
        stage_indices = layout.stage_indices(pp_rank)
        stages = [self._parallelize_and_init(spec, split_stage(model, layout, i)) for i in stage_indices]
        self.pp_has_first_stage = 0 in stage_indices
        self.pp_has_last_stage = layout.num_stages - 1 in stage_indices
        self.pp_schedule = build_schedule(
            layout,
            stages,
            pp_rank=pp_rank,
            pp_group=self.pp_mesh.get_group(),
            device=self.device,
            loss_fn=self._loss,
        )
        return stages

    def _parallelize_and_init(self, spec: ModelSpec, model: torch.nn.Module) -> torch.nn.Module:
        """Applies the family's parallelisms to ``model`` (meta device), then materializes it."""
        spec.parallelize_fn(model, self.parallel_dims, self.mesh, self.config)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights(buffer_device=self.device, seed=self.config.debug.seed)
        model.train()
        return model

    # ------------------------------------------------------------------ training

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One microbatch. The loss is its summed cross-entropy over the global batch's token
        count, so gradients summed over microbatches and ranks equal the global-batch mean."""
        logits = self.model(inputs)
        with _loss_context(logits):
            loss = self._loss(logits, labels)
            loss.backward()
        return _local_value(loss.detach())

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """What backward starts from, per microbatch (and per pipeline microbatch on the last
        stage): summed cross-entropy over the global batch's token count."""
        return self._cross_entropy(logits, labels) / self.global_tokens_per_step

    def _pipeline_loss_context(self) -> contextlib.AbstractContextManager:
        # The schedule computes the loss and its backward inside step(): cover the whole step.
        loss_parallel_on = self.parallel_dims.tp_enabled and self.config.parallelism.enable_loss_parallel
        return loss_parallel() if loss_parallel_on else contextlib.nullcontext()

    def _run_pipeline(self, inputs: torch.Tensor, labels: torch.Tensor, *, train: bool) -> torch.Tensor:
        """Runs the schedule on one microbatch (it splits it into pipeline microbatches), with
        backward when ``train``. Returns the sum of the pipeline microbatches' losses on the rank
        holding the last stage, zero on the others."""
        losses: list[torch.Tensor] = []
        stage_inputs = (inputs,) if self.pp_has_first_stage else ()
        targets = labels if self.pp_has_last_stage else None
        run = self.pp_schedule.step if train else self.pp_schedule.eval
        with self._pipeline_loss_context():
            run(*stage_inputs, target=targets, losses=losses, return_outputs=False)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([_local_value(loss.detach()) for loss in losses]).sum()

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        """Forward/backward over the step's microbatches, clip, update; returns loss, grad norm, lr.
        A non-finite loss or gradient norm leaves the model and optimizer untouched."""
        lr = self.lr_scheduler.get_last_lr()[0]
        self.optimizer.zero_grad()
        if self.pp_schedule is None:
            loss = sum(self.forward_backward(x.to(self.device), y.to(self.device)) for x, y in microbatches)
        else:
            loss = sum(self._run_pipeline(x.to(self.device), y.to(self.device), train=True) for x, y in microbatches)
        params = [p for part in self.model_parts for p in part.parameters() if p.grad is not None]
        if self._poison_gradients:
            self._poison_gradients = False
            params[0].grad.fill_(float("nan"))
        grad_norm = clip_grad_norm_(
            params,
            self.config.training.max_norm if self.config.training.max_norm > 0 else float("inf"),
            pp_mesh=self.pp_mesh,
        )
        # Each rank holds its share of the global mean; summing over data-parallel ranks completes it.
        # Under pipelining only the last stage has a loss: the other pp ranks add zeros.
        for mesh in (self.pp_mesh, self.parallel_dims.dp_mesh(self.mesh)):
            if mesh is not None:
                dist.all_reduce(loss, group=mesh.get_group())
        step_metrics = {"loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr}
        # Both values are global (all-reduced), so every rank takes the same branch.
        if math.isfinite(step_metrics["loss"]) and math.isfinite(step_metrics["grad_norm"]):
            if self.checkpointer is not None:
                self.checkpointer.wait_for_staging()  # a background save may still be copying the state
            self.optimizer.step()
            self.lr_scheduler.step()
        return step_metrics

    def _next_microbatches(self, data_iter) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [next(data_iter) for _ in range(self.grad_accum_steps)]

    def _inject_failure(self, step: int) -> None:
        """``debug.fail_at_step``: acts once, on the first attempt, on the last rank (all ranks
        for ``nan``, so that they skip or roll back together)."""
        debug = self.config.debug
        if step != debug.fail_at_step or self._failure_injected or not self._is_first_attempt():
            return
        self._failure_injected = True
        if debug.failure == "nan":
            self._poison_gradients = self.rank == dist.get_world_size() - 1
            return
        if self.rank != dist.get_world_size() - 1 or debug.failure == "kill_during_save":
            return
        logger.warning("debug.fail_at_step=%d: injecting '%s' on rank %d", step, debug.failure, self.rank)
        if debug.failure == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while debug.failure == "hang":
            time.sleep(3600)

    def _handle_nonfinite(self, step: int, step_metrics: dict[str, float]) -> None:
        policy = self.config.training.nonfinite_policy
        what = f"non-finite loss {step_metrics['loss']} or grad norm {step_metrics['grad_norm']} at step {step}"
        if policy == "error":
            raise NonFiniteError(f"{what} (training.nonfinite_policy=error)")
        if policy == "skip_step":
            logger.warning("%s: update skipped, batch dropped (training.nonfinite_policy=skip_step)", what)
            return
        self.step = self.checkpointer.rollback()
        logger.warning(
            "%s: rolled back to step %d, going on with the next batches (training.nonfinite_policy=rollback)",
            what,
            self.step,
        )

    def train(self) -> None:
        config = self.config
        if config.checkpoint.create_seed_checkpoint:
            self._create_seed_checkpoint()
            return
        self._resume()
        data_iter = iter(self.dataloader)
        gc_freq = config.debug.gc_freq
        if gc_freq > 0:
            gc.disable()
        logger.info(
            "training %d steps: global batch %d sequences (%d microbatches of %d per rank x %d dp ranks)",
            config.training.steps,
            self.global_batch_size,
            self.grad_accum_steps,
            config.training.local_batch_size,
            self.dp_size,
        )
        first_step = self.step + 1
        with maybe_profile(config.profiling, config.job.dump_folder, self.rank) as profiler:
            while self.step < config.training.steps:
                step = self.step + 1
                if gc_freq > 0 and step % gc_freq == 0:
                    gc.collect(1)
                with self.throughput.data_loading():
                    microbatches = self._next_microbatches(data_iter)
                self._inject_failure(step)

                step_metrics = self.train_step(microbatches)
                if step == first_step:
                    set_collective_timeout(config.comm.train_timeout_seconds, self.mesh)
                    if config.compile.enable:
                        log_graph_breaks(logger)
                if not (math.isfinite(step_metrics["loss"]) and math.isfinite(step_metrics["grad_norm"])):
                    self._handle_nonfinite(step, step_metrics)
                    continue
                self.step = step
                # The ranks of a pipeline share its tokens: count this rank's share, so that tokens/s
                # and TFLOPs stay per rank.
                self.throughput.add_tokens(sum(x.numel() for x, _ in microbatches) // self.parallel_dims.pp)
                if step == first_step or step % config.metrics.log_freq == 0 or step == config.training.steps:
                    self._log(step_metrics)
                if self.checkpointer is not None and self.checkpointer.should_save(step, config.training.steps):
                    self.checkpointer.save(step)
                elif self.checkpointer is not None:
                    self.checkpointer.poll()
                if config.validation.enable and step % config.validation.freq == 0:
                    self.validate()
                if profiler is not None:
                    profiler.step()
        if config.checkpoint.export_hf:
            self._export_hf()
        self.metrics.close()
        logger.info("training finished after %d steps", self.step)

    def _resume(self) -> None:
        """Restores the newest complete checkpoint, or else loads ``checkpoint.initial_load_path``'s
        model weights."""
        ckpt = self.config.checkpoint
        if self.checkpointer is None:
            return
        if ckpt.enable and self.checkpointer.resume() is not None:
            logger.info("resumed from step %d", self.step)
            return
        if not ckpt.initial_load_path:
            return
        if not os.path.isdir(ckpt.initial_load_path):
            raise ConfigError(f"checkpoint.initial_load_path: {ckpt.initial_load_path} is not a folder")
        if is_hf_folder(ckpt.initial_load_path):
            with user_input("checkpoint.initial_load_path"):
                load_hf_weights(self.model_parts, ckpt.initial_load_path)
        else:
            self.checkpointer.load_model_only(ckpt.initial_load_path)
        logger.info("initial weights loaded from %s", ckpt.initial_load_path)

    def _create_seed_checkpoint(self) -> None:
        if dist.get_world_size() != 1:
            raise ConfigError(
                f"checkpoint.create_seed_checkpoint: run it on 1 rank (NGPU=1), not {dist.get_world_size()}"
            )
        self.checkpointer.save(0, parts=["model"])
        logger.info("seed checkpoint written to %s", os.path.join(self.checkpointer.folder, "step-0"))

    def _export_hf(self) -> None:
        folder = os.path.join(self.checkpointer.folder, "hf")
        dtype = getattr(torch, self.config.checkpoint.export_dtype)
        export_hf(self.model_parts, self.model_args, folder, dtype)
        logger.info("Hugging Face export (%s) written to %s", self.config.checkpoint.export_dtype, folder)

    def _log(self, step_metrics: dict[str, float]) -> None:
        summary = self.throughput.summarize(self.flops_per_token, self.peak_flops)
        self.metrics.log(self.step, {**step_metrics, **summary, "memory_gib": peak_memory_gib(self.device)})

    @torch.no_grad()
    def validate(self) -> None:
        """Mean loss over ``validation.steps`` batches of the validation corpus."""
        cfg = self.config.validation
        with user_input("validation.dataset"):
            loader = self._build_dataloader(cfg.dataset, self.config.debug.seed + 1)
        for part in self.model_parts:
            part.eval()
        total = torch.zeros((), device=self.device)
        tokens = 0
        for _, (inputs, labels) in zip(range(cfg.steps), loader):
            if self.pp_schedule is not None:
                # The pipeline's loss is over the training batch's token count: scale it back to a sum.
                pipeline_loss = self._run_pipeline(inputs.to(self.device), labels.to(self.device), train=False)
                total += pipeline_loss * self.global_tokens_per_step
            else:
                logits = self.model(inputs.to(self.device))
                with _loss_context(logits):
                    total += _local_value(self._cross_entropy(logits, labels.to(self.device)))
            tokens += labels.numel()
        for part in self.model_parts:
            part.train()
        total /= tokens * self.dp_size
        # Only the last pipeline stage has a loss: the other pp ranks add zeros.
        for mesh in (self.pp_mesh, self.parallel_dims.dp_mesh(self.mesh)):
            if mesh is not None:
                dist.all_reduce(total, group=mesh.get_group())
        self.metrics.log_validation(self.step, total.item())

    def close(self) -> None:
        """Waits for the checkpoint in flight, then until every rank has finished, so that none
        leaves while a peer still talks to it."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        if dist.is_initialized():
            dist.barrier()
