"""The GPU check's launched processes other than train.py (bench/gpu_check_steps.py starts them):

    python bench/gpu_check_worker.py dp [train.py options]
    python bench/gpu_check_worker.py assets FOLDER
    torchrun ... bench/gpu_check_worker.py titan NAME MODEL_JSON LAUNCHER [torchtitan options]

``dp``: train.py's run (the same Trainer, config and output files) with data parallelism applied on a
one-rank mesh. train.py applies FSDP2 and SimpleFSDP only from two data-parallel ranks on, and NCCL
refuses two ranks on one GPU; here ParallelDims counts the single rank as a sharding one, so that
models/llama3/parallelize.py applies ``apply_fsdp2`` or ``apply_simple_fsdp`` and their compile and
bucketing passes over a mesh of one. Then one line ``REPORT {json}``: the model's and parameters'
classes and the data-parallel collectives in SimpleFSDP's compiled graphs.

``assets``: a byte-level BPE tokenizer (Hugging Face ``tokenizer.json`` and ``tokenizer_config.json``)
trained on Tessera's default corpus, and that corpus as C4-style JSON lines (``corpus/data.json``, a
folder of its own as torchtitan's c4_test is): what Tessera and torchtitan both read, so that they
train on the same tokens.

``titan``: torchtitan's trainer with one more llama3 size, NAME: its 8B with the fields of Tessera's
8B flavor changed by MODEL_JSON (e.g. ``{"n_layers": 4}``). LAUNCHER, when not empty, runs first
(torchtitan's CPU launcher in a rehearsal; on a GPU torchtitan runs as it is).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CORPUS = ("corpus", "data.json")  # in the assets folder
TOKENIZER_VOCAB = 2048  # as Tessera's default tokenizer's


def _report(trainer) -> dict:
    model = trainer.model.parts[0]
    passes = trainer.model.graph_passes
    graphs = [report for graph_pass in passes for report in graph_pass.reports]
    return {
        "model_class": type(model).__name__,
        "parameter_class": type(next(model.parameters())).__name__,
        # None: nothing compiled with SimpleFSDP's pass; its reports cover the graphs with collectives
        "graphs": len(graphs) if passes else None,
        "data_parallel_collectives": sum(sum(r.data_parallel.values()) for r in graphs),
    }


def train_on_one_rank_mesh(argv: list[str]) -> int:
    """train.py's run with data parallelism over one rank; returns the exit status."""
    import trainer.trainer as trainer_module
    from config.manager import load_config
    from parallelisms.parallel_dims import ParallelDims

    class OneRankDataParallel(ParallelDims):
        """Counts a lone rank as a sharding data-parallel one."""

        @property
        def dp_enabled(self) -> bool:
            return self.world_size == 1 or super().dp_enabled

        @property
        def fsdp_enabled(self) -> bool:
            return self.world_size == 1 or super().fsdp_enabled

    if not hasattr(trainer_module, "parallel_dims_from_config"):
        raise RuntimeError("trainer.trainer no longer builds its ParallelDims with parallel_dims_from_config")
    build = trainer_module.parallel_dims_from_config

    def one_rank_dims(parallelism, world_size):
        dims = build(parallelism, world_size)
        return OneRankDataParallel(dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.world_size)

    trainer_module.parallel_dims_from_config = one_rank_dims
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    trainer = trainer_module.Trainer(load_config(argv))
    trainer.train()
    print("REPORT " + json.dumps(_report(trainer)), flush=True)
    trainer.close()
    return 0


def write_shared_assets(folder: str) -> int:
    """The tokenizer and documents both trainers read (see the module's docstring)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from trainer.data.corpus import default_corpus_texts

    os.makedirs(os.path.join(folder, "corpus"), exist_ok=True)
    texts = list(default_corpus_texts())
    with open(os.path.join(folder, *CORPUS), "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"text": text, "url": f"python_docs://{i}"}) + "\n")
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, bpe)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS}, f)
    print(f"{len(texts)} documents, {tokenizer.get_vocab_size()} tokens in {folder}")
    return 0


def run_torchtitan(name: str, model_json: str, launcher: str, options: list[str]) -> int:
    """torchtitan.train as ``__main__`` with the llama3 size ``name`` registered."""
    # First: torchtitan's option parser takes sys.argv[1:] as a default when it is imported.
    sys.argv = ["torchtitan.train", *options]
    if launcher:
        runpy.run_path(launcher, run_name="titan_cpu")  # its patches, without its __main__ block
    from torchtitan.models.llama3 import llama3_args

    from bench.vs_torchtitan import TITAN_MODEL_FIELDS
    from models.llama3 import llama3_flavors

    tessera = dataclasses.replace(llama3_flavors["8B"], **json.loads(model_json))
    fields = {field: getattr(tessera, field) for field in TITAN_MODEL_FIELDS}
    llama3_args[name] = dataclasses.replace(llama3_args["8B"], **fields)
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
    return 0


def main(argv: list[str]) -> int:
    mode, rest = (argv[0], argv[1:]) if argv else ("", [])
    if mode == "dp":
        from train import exit_without_teardown

        exit_without_teardown(train_on_one_rank_mesh(rest))  # as train.py ends
    if mode == "assets":
        return write_shared_assets(rest[0])
    if mode == "titan":
        return run_torchtitan(rest[0], rest[1], rest[2], rest[3:])
    print(f"error: unknown mode {mode!r} (dp, assets or titan)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
