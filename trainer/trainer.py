"""The Trainer: builds everything a run needs from the config, then trains."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models.registry import get_flavor, get_model_spec
from trainer.config import JobConfig, batch_layout, to_toml, user_input
from trainer.data import build_dataloader
from trainer.distributed import ParallelDims, init_distributed, set_collective_timeout
from trainer.metrics import MetricsLogger, ThroughputTracker, device_peak_flops, peak_memory_gib
from trainer.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from trainer.profiling import maybe_profile
from trainer.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, config: JobConfig):
        self.config = config
        self.device = init_distributed(config.comm.init_timeout_seconds)
        self.rank = dist.get_rank()
        self._set_determinism()

        p = config.parallelism
        self.parallel_dims = ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            world_size=dist.get_world_size(),
        )
        self.mesh = self.parallel_dims.build_mesh(self.device.type)
        self.dp_rank, self.dp_size = self.parallel_dims.dp_rank_and_size(self.mesh)
        self.global_batch_size, self.grad_accum_steps = batch_layout(config.training, self.dp_size)
        self.global_tokens_per_step = self.global_batch_size * config.training.seq_len

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

        self.model = self._build_model()
        with user_input():
            self.optimizer = build_optimizer(
                [self.model],
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

    def _build_model(self) -> torch.nn.Module:
        spec = get_model_spec(self.config.model.name)
        model_args = dataclasses.replace(
            get_flavor(spec, self.config.model.flavor),
            vocab_size=self.tokenizer.vocab_size,
            max_seq_len=self.config.training.seq_len,
        )
        # Built without storage, so that a model of any size is only ever materialized sharded.
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        self.flops_per_token = spec.flops_per_token_fn(model_args, model, self.config.training.seq_len)
        n_params = sum(p.numel() for p in model.parameters())
        logger.info("%s %s: %.2fM parameters", spec.name, self.config.model.flavor, n_params / 1e6)

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
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
        loss = loss / self.global_tokens_per_step
        loss.backward()
        return loss.detach()

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        """Forward/backward over the step's microbatches, clip, update; returns loss, grad norm, lr."""
        lr = self.lr_scheduler.get_last_lr()[0]
        self.optimizer.zero_grad()
        loss = sum(self.forward_backward(x.to(self.device), y.to(self.device)) for x, y in microbatches)
        grad_norm = clip_grad_norm_(
            [p for p in self.model.parameters() if p.grad is not None],
            self.config.training.max_norm if self.config.training.max_norm > 0 else float("inf"),
        )
        self.optimizer.step()
        self.lr_scheduler.step()
        # Each rank holds its share of the global mean; summing over data-parallel ranks completes it.
        dp_mesh = self.parallel_dims.dp_mesh(self.mesh)
        if dp_mesh is not None:
            dist.all_reduce(loss, group=dp_mesh.get_group())
        return {"loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr}

    def _next_microbatches(self, data_iter) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [next(data_iter) for _ in range(self.grad_accum_steps)]

    def train(self) -> None:
        config = self.config
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
        with maybe_profile(config.profiling, config.job.dump_folder, self.rank) as profiler:
            while self.step < config.training.steps:
                self.step += 1
                if gc_freq > 0 and self.step % gc_freq == 0:
                    gc.collect(1)
                with self.throughput.data_loading():
                    microbatches = self._next_microbatches(data_iter)

                step_metrics = self.train_step(microbatches)
                self.throughput.add_tokens(sum(x.numel() for x, _ in microbatches))
                if self.step == 1:
                    set_collective_timeout(config.comm.train_timeout_seconds, self.mesh)
                if self.step == 1 or self.step % config.metrics.log_freq == 0 or self.step == config.training.steps:
                    self._log(step_metrics)
                if config.validation.enable and self.step % config.validation.freq == 0:
                    self.validate()
                if profiler is not None:
                    profiler.step()
        self.metrics.close()
        logger.info("training finished after %d steps", self.step)

    def _log(self, step_metrics: dict[str, float]) -> None:
        summary = self.throughput.summarize(self.flops_per_token, self.peak_flops)
        self.metrics.log(self.step, {**step_metrics, **summary, "memory_gib": peak_memory_gib(self.device)})

    @torch.no_grad()
    def validate(self) -> None:
        """Mean loss over ``validation.steps`` batches of the validation corpus."""
        cfg = self.config.validation
        with user_input("validation.dataset"):
            loader = self._build_dataloader(cfg.dataset, self.config.debug.seed + 1)
        self.model.eval()
        total = torch.zeros((), device=self.device)
        tokens = 0
        for _, (inputs, labels) in zip(range(cfg.steps), loader):
            logits = self.model(inputs.to(self.device))
            total += F.cross_entropy(logits.flatten(0, 1).float(), labels.to(self.device).flatten(), reduction="sum")
            tokens += labels.numel()
        self.model.train()
        total /= tokens * self.dp_size
        dp_mesh = self.parallel_dims.dp_mesh(self.mesh)
        if dp_mesh is not None:
            dist.all_reduce(total, group=dp_mesh.get_group())
        self.metrics.log_validation(self.step, total.item())

    def close(self) -> None:
        if dist.is_initialized():
            # Leave together: a rank tearing down its connections while a peer still uses them
            # makes gloo abort the peer.
            dist.barrier()
            dist.destroy_process_group()
