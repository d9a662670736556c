"""``python -m programs.generate [--job.config_file F.toml] [--section.field VALUE ...]`` (installed:
``tessera-generate``): completes prompts with the model of ``checkpoint.initial_load_path``, a DCP
checkpoint saved at any layout or a Hugging Face folder, in one process or, under torchrun, in a
tensor-parallel group (``--parallelism.tensor_parallel_degree N``); the ``[generation]`` options say
what and how (docs/generation.md). Rank 0 prints the completions; bad input is one line on stderr and
exit 2, found before the model loads."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from config.errors import ConfigError, init_console_logging, print_error, user_input
from config.generation import Generation, check_generation
from config.job_config import JobConfig
from config.manager import help_text, load_config, named_as_given
from trainer.data.tokenizer import Tokenizer, build_tokenizer

if TYPE_CHECKING:  # torch's imports take seconds, which a mistyped option need not wait for
    from torch import nn

logger = logging.getLogger(__name__)

PROGRAM = "python -m programs.generate"


@dataclass
class Prompt:
    where: str  # the option, or the file and line, that gave it
    text: str | None = None
    messages: list[Any] | None = None  # a chat, rendered with the tokenizer's template


def read_prompts(generation: Generation) -> list[Prompt]:
    """generation.prompt, then the prompts of generation.prompt_file."""
    prompts = [Prompt("generation.prompt", text=generation.prompt)] if generation.prompt else []
    path = generation.prompt_file
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"generation.prompt_file: {path} {'is a folder' if os.path.isdir(path) else 'not found'}")
        with user_input("generation.prompt_file"), open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        for number, line in enumerate(lines, start=1):
            if line.strip():
                where = f"{path} line {number}"
                prompts.append(_json_prompt(line, where) if path.endswith(".jsonl") else Prompt(where, text=line))
    if not prompts:
        raise ConfigError("generation.prompt, generation.prompt_file: no prompt given")
    return prompts


def _json_prompt(line: str, where: str) -> Prompt:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise ConfigError(f"generation.prompt_file: {where}: not JSON: {e}") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return Prompt(where, text=record["prompt"])
    if isinstance(record, dict) and "messages" in record:
        return Prompt(where, messages=record["messages"])
    raise ConfigError(f'generation.prompt_file: {where}: expected {{"prompt": text}} or {{"messages": [...]}}')


def encode_prompts(prompts: list[Prompt], tokenizer: Tokenizer, config: JobConfig) -> list[list[int]]:
    """Token ids of each prompt: BOS and the text (as training frames a document), or the chat through the
    tokenizer folder's template with the assistant's header after it."""
    from trainer.data.chat import ChatEncoder

    chat = None
    ids = []
    for prompt in prompts:
        if prompt.messages is None and not config.generation.chat:
            ids.append(tokenizer.encode(prompt.text, bos=True))
            continue
        if chat is None:
            with user_input("generation.chat (chat prompts need a tokenizer folder with a chat template)"):
                chat = ChatEncoder(config.model.tokenizer_path)
        messages = prompt.messages if prompt.messages is not None else [{"role": "user", "content": prompt.text}]
        with user_input("generation.prompt_file" if prompt.messages is not None else prompt.where):
            ids.append(chat.encode_prompt(messages, prompt.where))
    return ids


def check_prompt_lengths(prompts: list[Prompt], ids: list[list[int]], context: int) -> None:
    for prompt, tokens in zip(prompts, ids):
        if len(tokens) > context:
            raise ConfigError(
                f"{prompt.where}: the prompt has {len(tokens)} tokens, more than the model's context of {context} "
                "(training.seq_len)"
            )


def check_checkpoint(config: JobConfig, args: Any) -> None:
    """checkpoint.initial_load_path names a checkpoint of the model ``args`` describe (read from its metadata)."""
    import torch

    from models.registry import get_model_spec
    from models.sizes import is_hf_folder
    from trainer.checkpoint.hf import check_hf_folder
    from trainer.checkpoint.rules import another_model, initial_load_problem, saved_model_difference

    path = config.checkpoint.initial_load_path
    if not path:
        raise ConfigError(
            "checkpoint.initial_load_path: give the checkpoint to generate with (a step-N folder or a Hugging Face folder)"
        )
    if problem := initial_load_problem(dataclasses.replace(config.checkpoint, initial_load_model_only=True)):
        raise ConfigError(problem)
    if is_hf_folder(path):
        with user_input("checkpoint.initial_load_path"):
            check_hf_folder(path, args)
        return
    with torch.device("meta"):
        model = get_model_spec(config.model.name).model_cls(args)
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    if difference := saved_model_difference(path, shapes):
        raise ConfigError(another_model("checkpoint.initial_load_path", path, difference))


def for_generation(config: JobConfig) -> JobConfig:
    """The job's options as generation builds the model: no activation checkpointing (no backward) and no
    compile (every step has another shape); only tensor parallelism splits it."""
    parallelism = config.parallelism
    for option in ("pipeline_parallel_degree", "context_parallel_degree"):
        if getattr(parallelism, option) != 1:
            raise ConfigError(
                f"parallelism.{option} {getattr(parallelism, option)}: generation runs the whole model on each "
                "rank of a tensor-parallel group; set it to 1 (parallelism.tensor_parallel_degree splits the model)"
            )
    return dataclasses.replace(
        config,
        activation_checkpoint=dataclasses.replace(config.activation_checkpoint, mode="none"),
        compile=dataclasses.replace(config.compile, enable=False),
    )


def load_model(config: JobConfig, args: Any) -> nn.Module:
    """The model of ``args`` on this rank's part of the mesh, its weights from checkpoint.initial_load_path."""
    import torch.distributed as dist

    from models.builder import build_model
    from models.sizes import is_hf_folder
    from trainer.checkpoint import integrity
    from trainer.checkpoint.state import load_model_weights
    from trainer.distributed import init_distributed, parallel_dims_from_config

    device = init_distributed(config.comm, config.job.dump_folder)
    dims = parallel_dims_from_config(config.parallelism, dist.get_world_size())
    dims.build_mesh(device.type)
    model = build_model(config, dims, device, args).parts[0]
    path = config.checkpoint.initial_load_path
    # A Hugging Face folder's mistakes (a missing or unreadable weight) are the user's: one line.
    named = user_input("checkpoint.initial_load_path") if is_hf_folder(path) else contextlib.nullcontext()
    try:
        with named:
            load_model_weights(model, path)
    except integrity.CheckpointError as e:
        raise ConfigError(f"checkpoint.initial_load_path, damaged: {e}") from None
    logger.info("weights loaded from %s", path)
    return model


def prepare(config: JobConfig) -> tuple[JobConfig, Tokenizer, Any, list[Prompt], list[list[int]]]:
    """Every check that needs no model: the options, the prompts, the tokenizer, the checkpoint's shapes."""
    from models.sizes import job_model_args

    check_generation(config.generation)
    config = for_generation(config)
    prompts = read_prompts(config.generation)
    with user_input("model.tokenizer_path"):
        tokenizer = build_tokenizer(
            config.model.tokenizer_path, config.job.cache_dir, config.model.default_tokenizer_vocab_size
        )
    args = job_model_args(config, tokenizer.vocab_size)
    ids = encode_prompts(prompts, tokenizer, config)
    check_prompt_lengths(prompts, ids, args.max_seq_len)
    check_checkpoint(config, args)
    return config, tokenizer, args, prompts, ids


def complete(config: JobConfig, model: nn.Module, ids: list[list[int]], eos_id: int) -> list[list[int]]:
    """The new tokens of each prompt, generation.batch_size prompts at a time."""
    from trainer.generation import generate

    g = config.generation
    completions = []
    for start in range(0, len(ids), g.batch_size):
        completions += generate(
            model,
            ids[start : start + g.batch_size],
            max_new_tokens=g.max_new_tokens,
            eos_id=eos_id,
            temperature=g.temperature,
            top_k=g.top_k,
            top_p=g.top_p,
            seed=g.seed + start,
            use_cache=g.use_cache,
        )
    return completions


def report(
    config: JobConfig, tokenizer: Tokenizer, prompts: list[Prompt], ids: list[list[int]], completions: list[list[int]]
) -> None:
    """Prints each prompt and its completion (the end-of-text token not shown); writes generation.output_file."""
    records = []
    for prompt, prompt_ids, tokens in zip(prompts, ids, completions):
        shown = tokens[:-1] if tokens and tokens[-1] == tokenizer.eos_id else tokens
        completion = tokenizer.decode(shown)
        given = prompt.text if prompt.messages is None else json.dumps(prompt.messages, ensure_ascii=False)
        print(f"### {prompt.where}: {given}\n{completion}\n", flush=True)
        records.append({"prompt": given, "completion": completion, "prompt_tokens": prompt_ids, "tokens": tokens})
    if path := config.generation.output_file:
        with user_input("generation.output_file"), open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text(PROGRAM))
        return 0
    rank = int(os.environ.get("RANK", 0))
    init_console_logging()
    try:
        config, tokenizer, args, prompts, ids = prepare(load_config(argv))
        model = load_model(config, args)
    except ConfigError as e:
        if rank == 0:  # every rank finds it; one says so
            print_error(named_as_given(e, argv))
        return 2
    completions = complete(config, model, ids, tokenizer.eos_id)
    if rank == 0:
        report(config, tokenizer, prompts, ids, completions)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0


def cli() -> None:
    """The ``tessera-generate`` command."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
