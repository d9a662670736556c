"""``python -m programs.generate`` against transformers: a tiny Llama 3 folder made by transformers (random
weights, a Llama-3-style tokenizer with a chat template), a DCP checkpoint of it saved by train.py at
dp 2 x tp 2 (one step at lr 1e-30: an update of that size is below half a float32 step of every
weight, which stays as loaded), and 32 greedy tokens of a text prompt and of a chat, which must equal
transformers' ``generate`` (do_sample=False) token for token: from the folder, from the checkpoint in
one process and on every rank of a tensor-parallel group of 2, with the key/value cache and without.
Float32 on the CPU."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.hf_folders import corpus_text, folder_args, llama_config, write_chat_tokenizer
from tests.launch import REPO, launch_train, train_env
from tests.spawn import check_on_gloo_ranks

NEW_TOKENS = 32
TEXT = "The model reads a token"
MESSAGES = [{"role": "user", "content": "What does a checkpoint hold?"}]
EOS_ID = 9  # <|eot_id|>, the chat tokenizer's EOS


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict:
    """The transformers folder, a prompt file of the text and the chat, and transformers' ids and tokens."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("generate")
    folder = write_chat_tokenizer(str(root / "hf"))
    vocab_size = Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**llama_config(vocab_size=vocab_size, bos_token_id=0, eos_token_id=EOS_ID)))
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [
        tokenizer(TEXT)["input_ids"],
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False),
    ]
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = model.eval().generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            expected.append(out[0, len(ids) :].tolist())
    prompt_file = root / "prompts.jsonl"
    prompt_file.write_text(json.dumps({"prompt": TEXT}) + "\n" + json.dumps({"messages": MESSAGES}) + "\n")
    corpus = root / "corpus.txt"
    corpus.write_text(corpus_text())
    return {"folder": folder, "prompts": prompts, "expected": expected, "prompt_file": str(prompt_file), "root": root}


@pytest.fixture(scope="module")
def checkpoint(source) -> str:
    """step-1 of a dp 2 x tp 2 run started from the folder, its weights unchanged."""
    dump = str(source["root"] / "run")
    options = folder_args(source["folder"], str(source["root"] / "corpus.txt"))
    layout = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]
    step = ["--training.steps", "1", "--optimizer.lr", "1e-30", "--checkpoint.enable"]
    launch_train(dump, 4, *options, *layout, *step)
    return os.path.join(dump, "checkpoint", "step-1")


def _options(source: dict, load: str, *extra: str) -> list[str]:
    return [
        "--checkpoint.initial_load_path",
        load,
        "--model.architecture",
        source["folder"],
        "--model.tokenizer_path",
        source["folder"],
        "--training.seq_len",
        "128",
        "--training.mixed_precision_param",
        "float32",
        "--generation.prompt_file",
        source["prompt_file"],
        "--generation.max_new_tokens",
        str(NEW_TOKENS),
        "--job.dump_folder",
        str(source["root"] / "generate"),
        *extra,
    ]


def _run_generate(source: dict, load: str, *extra: str, launch: bool = True) -> list[dict]:
    """The output file's records of ``python -m programs.generate`` in a process of its own, or in
    this one (``launch`` False: its imports are this process's)."""
    from programs.generate import main

    output = str(source["root"] / "completions.jsonl")
    argv = _options(source, load, "--generation.output_file", output, *extra)
    if launch:
        command = [sys.executable, "-m", "programs.generate", *argv]
        result = subprocess.run(command, cwd=REPO, env=train_env(), capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"### {source['prompt_file']} line 1: {TEXT}" in result.stdout
    else:
        assert main(argv) == 0
    with open(output) as f:
        return [json.loads(line) for line in f]


def _check(source: dict, records: list[dict]) -> None:
    assert [record["prompt_tokens"] for record in records] == source["prompts"]
    assert [record["tokens"] for record in records] == source["expected"]


@pytest.mark.slow  # transformers builds the folder
def test_transformers_reference_is_32_varied_tokens(source):
    for tokens in source["expected"]:
        assert len(tokens) == NEW_TOKENS and EOS_ID not in tokens and len(set(tokens)) > 8


@pytest.mark.slow  # launches the program
def test_greedy_from_the_hf_folder_equals_transformers(source):
    _check(source, _run_generate(source, source["folder"]))


@pytest.mark.slow  # launches train.py on 4 ranks and the program
def test_greedy_from_the_dp2_tp2_checkpoint_without_the_cache_equals_transformers(source, checkpoint):
    _check(source, _run_generate(source, checkpoint, "--generation.use_cache", "false", launch=False))


def _tensor_parallel_rank(options: list[str], expected: list[list[int]], rank: int) -> None:
    from config.manager import load_config
    from programs.generate import load_model, prepare
    from trainer.generation import generate

    config, tokenizer, args, _, ids = prepare(load_config(options))
    model = load_model(config, args)
    for use_cache in (True, False):
        tokens = generate(model, ids, max_new_tokens=NEW_TOKENS, eos_id=tokenizer.eos_id, use_cache=use_cache)
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, tokens)
        assert every_rank == [expected] * dist.get_world_size(), (rank, use_cache)
    # Sampled: each rank draws from its copy of the replicated logits with a generator of the same seed.
    sampled = generate(model, ids, max_new_tokens=8, eos_id=None, temperature=1.0, top_p=0.9, seed=5)
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, sampled)
    assert every_rank == [sampled] * dist.get_world_size(), rank


@pytest.mark.slow  # spawns 2 ranks
def test_every_rank_of_a_tensor_parallel_group_gets_transformers_tokens(source, checkpoint):
    options = _options(source, checkpoint, "--parallelism.tensor_parallel_degree", "2")
    check_on_gloo_ranks(functools.partial(_tensor_parallel_rank, options, source["expected"]), 2, timeout_s=600)


@pytest.mark.slow  # launches train.py on 4 ranks
def test_a_checkpoint_of_another_model_size_is_refused_before_loading(source, checkpoint, capsys, monkeypatch):
    from programs import generate as program

    monkeypatch.setattr(program, "load_model", lambda *_: pytest.fail("the model was loaded"))
    assert program.main(_options(source, checkpoint, "--model.ffn_dim", "256")) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: checkpoint.initial_load_path: {checkpoint} holds another model than this job's")
    assert "of other shapes (layers.0.feed_forward.w1.weight: [192, 64] saved, [256, 64] in the model)" in error
    assert error.count("\n") == 1
