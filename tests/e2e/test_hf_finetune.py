"""The README's fine-tune recipe end to end: Llama 3.0-, 3.2- (tied) and custom-shaped folders made
by transformers, fine-tuned 3 steps through ./run_train.sh on 2 CPU ranks (FSDP2, SimpleFSDP, DDP)
and exported; transformers
loads each export, and its logits equal those of the trained model read from the run's own DCP
checkpoint by Tessera's model (float32, 1e-5)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import LlamaConfig, LlamaForCausalLM

from config.manager import load_config
from models.llama3 import Transformer
from models.sizes import job_model_args
from tests.hf_folders import SEQ_LEN, SHAPES, corpus_text, folder_args, write_tokenizer
from tests.launch import run_script

# Each folder under another data-parallel implementation: the tied table under SimpleFSDP too.
LAYOUTS = {
    "llama3.0": [],
    "llama3.2": ["--parallelism.data_parallel_impl", "simple_fsdp"],
    "custom": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
}


def make_source(folder: str, config: dict) -> None:
    """An HF folder as transformers writes it (random weights), with the test tokenizer."""
    torch.manual_seed(0)
    # LlamaConfig rewrites the rope dict it is given: hand it a copy.
    LlamaForCausalLM(LlamaConfig(**copy.deepcopy(config))).save_pretrained(folder)
    assert write_tokenizer(folder) == config["vocab_size"]


def recipe(folder: str, corpus: str) -> list[str]:
    """The fine-tune options of the README's recipe, with a small run's lengths."""
    return folder_args(
        folder,
        corpus,
        "--checkpoint.enable",
        "--checkpoint.export_hf",
        "--training.steps",
        "3",
        "--training.local_batch_size",
        "2",
        "--lr_scheduler.warmup_steps",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.peak_flops",
        "1e12",
    )


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory) -> dict[str, tuple[str, str, list[str], float]]:
    """name -> (source folder, dump folder, the run's options, seconds the launch took)."""
    root = tmp_path_factory.mktemp("finetune")
    corpus = root / "corpus.txt"
    corpus.write_text(corpus_text())
    runs = {}
    for name, config in SHAPES.items():
        source, dump = str(root / name), str(root / f"{name}_run")
        make_source(source, config)
        options = recipe(source, str(corpus)) + LAYOUTS[name]
        start = time.monotonic()
        run_script(dump, *options, timeout=300)
        runs[name] = source, dump, options, time.monotonic() - start
    return runs


def trained_model(dump: str, options: list[str]) -> tuple[Transformer, dict[str, torch.Tensor]]:
    """The trained model as Tessera builds it (one process), with the last DCP checkpoint's weights,
    and those weights as saved (each name read into a tensor of its own)."""
    args = dataclasses.replace(job_model_args(load_config(options), vocab_size=300), max_seq_len=SEQ_LEN)
    model = Transformer(args).eval()
    state = {"model": {name: tensor.clone() for name, tensor in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=os.path.join(dump, "checkpoint", "step-3"))
    model.load_state_dict(state["model"])
    return model, state["model"]


@pytest.mark.slow  # three launches of run_train.sh
@pytest.mark.parametrize("name", SHAPES)
def test_finetuned_export_loads_in_transformers_with_the_trained_logits(name, finetuned):
    source, dump, options, seconds = finetuned[name]
    print(f"{name}: run_train.sh took {seconds:.1f} s")
    export = os.path.join(dump, "checkpoint", "hf")
    with open(os.path.join(export, "config.json")) as f:
        exported = json.load(f)
    config = SHAPES[name]
    assert exported["max_position_embeddings"] == config["max_position_embeddings"]
    assert exported["tie_word_embeddings"] == config["tie_word_embeddings"]
    assert exported["intermediate_size"] == config["intermediate_size"]
    assert exported["rope_scaling"] == config.get("rope_scaling")
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (0, 1)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(os.listdir(export))

    ours, saved = trained_model(dump, options)
    # A tied table stayed one parameter through sharding and training; an untied one did not.
    tied_after_training = torch.equal(saved["output.weight"], saved["tok_embeddings.weight"])
    assert tied_after_training == config["tie_word_embeddings"]
    hf = LlamaForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    original = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokens = torch.randint(0, config["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual, before = ours(tokens), hf(tokens).logits, original(tokens).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    assert (actual - before).abs().max() > 1e-3  # the export holds the fine-tuned weights
