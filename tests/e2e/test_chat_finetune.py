"""The chat fine-tune recipe end to end: a Llama folder made by transformers with a Llama-3-style
tokenizer and chat template, fine-tuned 3 steps through ./run_train.sh on 2 CPU ranks on a JSONL file
of conversations (``training.dataset_format = "chat"``, which turns document masking on), exported;
transformers loads the export, and its logits differ from the source's (the export holds the
fine-tuned weights)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tests.hf_folders import folder_args, llama_config, write_chat_tokenizer
from tests.launch import read_metrics, run_script

_TURNS = [
    ("What does a checkpoint hold?", "The weights, the optimizer state and the data position."),
    ("How is a parameter sharded?", "Each rank keeps a shard and gathers the rest when it needs it."),
    ("def add(x, y): what does it return?", "It returns x + y."),
]


def conversations(count: int) -> list[dict]:
    records = []
    for i in range(count):
        question, answer = _TURNS[i % len(_TURNS)]
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if i % 2:
            messages.insert(0, {"role": "system", "content": "Answer in one sentence."})
        records.append({"messages": messages})
    return records


@pytest.mark.slow  # a launch of run_train.sh
def test_chat_finetune_exports_a_folder_transformers_loads(tmp_path):
    source, dump, corpus = str(tmp_path / "source"), str(tmp_path / "run"), tmp_path / "chat.jsonl"
    write_chat_tokenizer(source)
    vocab_size = Tokenizer.from_file(os.path.join(source, "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(**llama_config(vocab_size=vocab_size, bos_token_id=0, eos_token_id=9))
    ).save_pretrained(source)
    corpus.write_text("".join(json.dumps(record) + "\n" for record in conversations(200)))
    options = folder_args(
        source,
        str(corpus),
        "--training.dataset_format",
        "chat",
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
    )
    run = run_script(dump, *options, timeout=600)
    assert "document masking: packed documents attend within themselves" in run.stdout + run.stderr
    records = read_metrics(dump)
    assert records[-1]["step"] == 3 and all(0 < record["loss"] < 20 for record in records)

    export = os.path.join(dump, "checkpoint", "hf")
    hf = LlamaForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    original = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    messages = conversations(1)[0]["messages"]
    ids = AutoTokenizer.from_pretrained(source).apply_chat_template(messages, tokenize=True, return_dict=False)
    tokens = torch.tensor([ids])
    with torch.no_grad():
        after, before = hf(tokens).logits, original(tokens).logits
    assert torch.isfinite(after).all()
    assert (after - before).abs().max() > 1e-3
