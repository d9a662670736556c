"""Model sizes from the config and from a Hugging Face folder's config.json, the pre-launch check
of such a folder (every mismatch in one line), tied embeddings, and what an export carries besides
the weights (context length, ids, generation config, tokenizer, file modes)."""

from __future__ import annotations

import dataclasses
import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from config.errors import ConfigError
from config.manager import load_config
from models.builder import build_model
from models.llama3 import Transformer, llama3_flavors
from models.llama3.model import ffn_hidden_dim
from models.sizes import job_model_args
from parallelisms.parallel_dims import ParallelDims
from programs import preflight
from tests.hf_folders import SHAPES, corpus_text, folder_args, llama_config, write_llama_folder, write_tokenizer
from trainer.checkpoint.hf import export_hf, job_export_assets, load_hf_weights


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(corpus_text())
    return str(path)


@pytest.mark.parametrize("name", SHAPES)
def test_the_folder_gives_the_architecture(name, tmp_path, corpus):
    source = SHAPES[name]
    folder = write_llama_folder(str(tmp_path / name), source)
    args = job_model_args(load_config(folder_args(folder, corpus)), vocab_size=300)
    expected = {
        "dim": 64,
        "n_layers": 2,
        "n_heads": source["num_attention_heads"],
        "vocab_size": 300,
        "norm_eps": source["rms_norm_eps"],
        "rope_theta": source["rope_theta"],
        "use_rope_scaling": "rope_scaling" in source,
        "tie_word_embeddings": source["tie_word_embeddings"],
        "max_position_embeddings": source["max_position_embeddings"],
        "max_seq_len": 64,
    }
    assert {key: getattr(args, key) for key in expected} == expected
    assert (args.n_kv_heads or args.n_heads) == source["num_key_value_heads"]
    assert ffn_hidden_dim(args) == source["intermediate_size"]
    if "rope_scaling" in source:
        assert args.rope_scaling_factor == 32.0
    # The folder passes the pre-launch check and loads.
    preflight.check(load_config(folder_args(folder, corpus)), world_size=2)
    model = Transformer(args)
    load_hf_weights([model], folder)
    embeddings = load_file(os.path.join(folder, "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(model.tok_embeddings.weight.detach(), embeddings)


def test_a_sequence_longer_than_the_folders_context_is_a_warning(tmp_path, corpus, caplog):
    folder = write_llama_folder(str(tmp_path / "f"), llama_config(max_position_embeddings=48))
    with caplog.at_level("WARNING"):
        args = job_model_args(load_config(folder_args(folder, corpus)), vocab_size=300)
    assert args.max_seq_len == 64
    config_json = os.path.join(folder, "config.json")
    expected = f"training.seq_len 64 is longer than the 48 positions of {config_json} (max_position_embeddings)"
    assert [r.getMessage() for r in caplog.records if "positions" in r.getMessage()] == [expected]
    caplog.clear()
    job_model_args(load_config(folder_args(folder, corpus, "--training.seq_len", "48")), vocab_size=300)
    assert not [r for r in caplog.records if "positions" in r.getMessage()]


def test_model_fields_override_the_flavor_and_the_folder(tmp_path, corpus):
    config = load_config(["--model.dim", "128", "--model.n_layers", "3", "--model.ffn_dim", "320"])
    args = job_model_args(config)
    assert (args.dim, args.n_layers, args.n_heads, ffn_hidden_dim(args)) == (128, 3, 16, 320)
    # A multiplier asks for the derived width, even where the architecture had an explicit one.
    args = job_model_args(load_config(["--model.flavor", "1B", "--model.ffn_dim_multiplier", "1.0"]))
    assert ffn_hidden_dim(args) == 5632 and args.tie_word_embeddings
    folder = write_llama_folder(str(tmp_path / "f"), SHAPES["llama3.2"])
    args = job_model_args(load_config(folder_args(folder, corpus, "--model.tie_word_embeddings", "false")), 300)
    assert not args.tie_word_embeddings and args.use_rope_scaling
    # A folder's (or its config.json's) sizes without loading its weights.
    args = job_model_args(load_config(["--model.architecture", os.path.join(folder, "config.json")]), 300)
    assert (args.dim, args.n_layers, ffn_hidden_dim(args), args.tie_word_embeddings) == (64, 2, 192, True)
    # The flavor alone, when asked.
    args = job_model_args(load_config(folder_args(folder, corpus, "--model.architecture", "flavor")), 300)
    assert dataclasses.replace(args, vocab_size=2048, max_seq_len=2048) == llama3_flavors["debugmodel"]


def test_published_llama32_presets():
    one_b, three_b = llama3_flavors["1B"], llama3_flavors["3B"]
    assert one_b.tie_word_embeddings and three_b.tie_word_embeddings
    assert ffn_hidden_dim(one_b) == ffn_hidden_dim(three_b) == 8192
    assert (one_b.rope_scaling_factor, one_b.max_position_embeddings) == (32.0, 131072)


# (what is wrong, config.json fields, tensors left out, extra options, what the one line must say)
BAD_FOLDERS = [
    (
        "biases",
        {"attention_bias": True, "mlp_bias": True},
        (),
        [],
        ["checkpoint.initial_load_path", "attention_bias=True is not supported", "mlp_bias=True is not supported"],
    ),
    (
        "another family, a flag as text",
        {"model_type": "mistral", "tie_word_embeddings": "false"},
        (),
        [],
        ["model_type='mistral' is not supported (need 'llama')", "tie_word_embeddings='false' is not true or false"],
    ),
    (
        "missing weights",
        {},
        ("model.layers.1.mlp.up_proj.weight", "lm_head.weight"),
        [],
        ["is missing 'model.layers.1.mlp.up_proj.weight', 'lm_head.weight'"],
    ),
    (
        "explicit flavor",
        {},
        (),
        ["--model.architecture", "flavor"],
        [
            "hidden_size=64 but the model has dim=256",
            "num_hidden_layers=2 but the model has n_layers=6",
            "num_attention_heads=4 but the model has n_heads=16",
            "num_key_value_heads=2 but the model has n_kv_heads=16",
            "intermediate_size=192 but the model has ffn_dim=768",
        ],
    ),
    (
        "explicit field",
        {},
        (),
        ["--model.n_layers", "3", "--model.rope_theta", "10000"],
        [
            "num_hidden_layers=2 but the model has n_layers=3",
            "rope_theta=500000.0 but the model has rope_theta=10000.0",
        ],
    ),
    (
        "smaller vocabulary than the tokenizer",
        {"vocab_size": 200},
        (),
        [],
        ["the tokenizer has 300 tokens but vocab_size of", "config.json is 200"],
    ),
    (
        "tied table under tensor parallelism",
        {"tie_word_embeddings": True},
        (),
        ["--parallelism.tensor_parallel_degree", "2"],
        ["model.tie_word_embeddings: a tied embedding table does not work with tensor parallelism"],
    ),
    (
        "a training state asked of weights",
        {},
        (),
        ["--checkpoint.initial_load_model_only", "false"],
        [
            "checkpoint.initial_load_model_only: false loads a training checkpoint's state, but",
            "is a Hugging Face folder of weights only",
        ],
    ),
    (
        "rope type",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        (),
        [],
        ["rope_type 'yarn' is not supported"],
    ),
]


@pytest.mark.parametrize(
    ("fields", "drop", "extra", "expected"), [case[1:] for case in BAD_FOLDERS], ids=[case[0] for case in BAD_FOLDERS]
)
def test_a_bad_folder_gets_one_line_before_the_ranks_start(fields, drop, extra, expected, tmp_path, corpus, capsys):
    folder = write_llama_folder(str(tmp_path / "bad"), llama_config(**fields), drop=drop)
    code = preflight.main(["--world-size", "2", *folder_args(folder, corpus, *extra)])
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    missing = [part for part in expected if part not in lines[0]]
    assert not missing, (missing, lines[0])


# ---------------------------------------------------------------------------
# Tied embeddings and the export's assets
# ---------------------------------------------------------------------------


def one_process_model(args, seed: int) -> Transformer:
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)
    return build_model(load_config(["--debug.seed", str(seed)]), dims, torch.device("cpu"), args).parts[0].eval()


def test_tied_model_exports_one_table_and_loads_back(tmp_path, corpus):
    folder = write_llama_folder(str(tmp_path / "src"), SHAPES["llama3.2"])
    config = load_config(folder_args(folder, corpus, "--checkpoint.enable", "--checkpoint.export_hf"))
    args = job_model_args(config, 300)
    model = one_process_model(args, seed=1)
    assert model.output.weight is model.tok_embeddings.weight
    assert len(list(model.parameters())) == 2 * 9 + 2  # the table counted once

    export = str(tmp_path / "out" / "hf")
    old_umask = os.umask(0o027)
    try:
        export_hf([model], args, export, torch.float32, assets=job_export_assets(config, bos_id=0, eos_id=1))
    finally:
        os.umask(old_umask)
    assert "lm_head.weight" not in load_file(os.path.join(export, "model.safetensors"))
    exported = json.loads(open(os.path.join(export, "config.json")).read())
    assert exported["tie_word_embeddings"] is True and exported["max_position_embeddings"] == 131072
    assert exported["rope_scaling"]["factor"] == 32.0
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (0, 1)
    assert json.loads(open(os.path.join(export, "generation_config.json")).read()) == {
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert open(os.path.join(export, name)).read() == open(os.path.join(folder, name)).read()
    # Modes follow the umask (027: rwxr-x--- folders, rw-r----- files), not mkdtemp's 0700.
    assert stat.S_IMODE(os.stat(export).st_mode) == 0o750
    for name in os.listdir(export):
        assert stat.S_IMODE(os.stat(os.path.join(export, name)).st_mode) == 0o640, name

    other = one_process_model(args, seed=2)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.equal(other(tokens), model(tokens))
        load_hf_weights([other], export)
        assert torch.equal(other(tokens), model(tokens))
    assert other.output.weight is other.tok_embeddings.weight


def test_export_keeps_the_source_ids_and_generation_config(tmp_path, corpus):
    source = write_llama_folder(str(tmp_path / "src"), llama_config(eos_token_id=[1, 0]))
    generation = {"bos_token_id": 0, "eos_token_id": [1, 0], "temperature": 0.6, "do_sample": True}
    with open(os.path.join(source, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    assets = job_export_assets(load_config(folder_args(source, corpus)), bos_id=0, eos_id=1)
    assert assets.generation_config == generation and assets.config["eos_token_id"] == [1, 0]
    # A tokenizer.json named by itself and no source folder: it and the tokenizer_config.json
    # beside it, which the loader reads too, go into the export.
    tokenizer = str(tmp_path / "tok")
    write_tokenizer(tokenizer)
    assets = job_export_assets(load_config(["--model.tokenizer_path", tokenizer + "/tokenizer.json"]), 0, 1)
    assert list(assets.files) == ["tokenizer.json", "tokenizer_config.json"] and assets.generation_config == {
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


def test_tokenizer_larger_than_the_model_vocabulary_is_refused():
    with pytest.raises(ConfigError, match="the tokenizer has 4000 tokens but model.vocab_size is 3000"):
        job_model_args(load_config(["--model.vocab_size", "3000"]), vocab_size=4000)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model.dim", "0"], "error: model.dim must be positive, got 0"),
        (["--model.rope_theta", "-1"], "error: model.rope_theta must be positive, got -1.0"),
        (["--model.n_heads", "5"], "error: model: need dim % n_heads == 0"),
        (
            ["--model.architecture", "/nonexistent"],
            "error: model.architecture: HF checkpoint: /nonexistent does not exist",
        ),
    ],
)
def test_impossible_sizes_get_one_line(args, expected, capsys):
    assert preflight.main(["--world-size", "2", *args]) == 2
    assert capsys.readouterr().err.strip().startswith(expected)


def test_integer_weights_get_one_line_before_the_ranks_start(tmp_path, corpus, capsys):
    """The dtype is in the safetensors header: the pre-launch check reads it, not the weights."""
    folder = write_llama_folder(str(tmp_path / "ints"), llama_config())
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(torch.int32)
    save_file(tensors, path)
    code = preflight.main(["--world-size", "2", *folder_args(folder, corpus)])
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]
    assert code == 2 and lines == [
        f"error: checkpoint.initial_load_path: HF checkpoint: {folder} 'model.layers.0.mlp.up_proj.weight' "
        "in model.safetensors is I32; weights must be F16, BF16, F32 or F64"
    ]
