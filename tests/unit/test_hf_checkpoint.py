"""Hugging Face safetensors export/import of Llama 3: key names, round trips, the rotary
permutation against a hand-written HF-convention attention, and clear errors."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from config.manager import load_config
from models.builder import build_model
from models.llama3 import Transformer, TransformerModelArgs, llama3_flavors
from models.llama3.hf_adapter import (
    args_from_hf_config,
    from_hf_key,
    hf_config,
    permute_for_hf,
    to_hf_key,
    unpermute_from_hf,
)
from models.llama3.model import ffn_hidden_dim
from models.sizes import is_hf_folder
from parallelisms.parallel_dims import ParallelDims
from trainer.checkpoint.hf import export_hf, load_hf_weights

DEBUG_ARGS = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=256, max_seq_len=32)
# Grouped-query attention and Llama 3.1 RoPE scaling, which debugmodel does not use.
GQA_SCALED_ARGS = dataclasses.replace(DEBUG_ARGS, n_layers=2, n_kv_heads=4, use_rope_scaling=True)


def build(args: TransformerModelArgs, seed: int) -> Transformer:
    """A one-process model of ``args``, built the way training builds it."""
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)
    config = load_config(["--debug.seed", str(seed), "--training.mixed_precision_param", "float32"])
    return build_model(config, dims, torch.device("cpu"), args).parts[0].eval()


def hf_weights(folder: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def build_and_export(tmp_path_factory: pytest.TempPathFactory, args, seed: int) -> tuple[Transformer, str]:
    model = build(args, seed=seed)
    folder = str(tmp_path_factory.mktemp("hf") / "export")
    export_hf([model], args, folder, torch.float32)
    return model, folder


# Initialization dominates the run time: models are built once per module and copied.
@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Transformer, str]:
    """A debugmodel and its float32 export."""
    return build_and_export(tmp_path_factory, DEBUG_ARGS, seed=1)


@pytest.fixture(scope="module")
def fresh_model() -> Transformer:
    """A debugmodel initialized with another seed; tests load into copies of it."""
    return build(DEBUG_ARGS, seed=2)


@pytest.fixture(scope="module")
def gqa_exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Transformer, str]:
    """A model with grouped-query attention and llama3 RoPE scaling, and its float32 export."""
    return build_and_export(tmp_path_factory, GQA_SCALED_ARGS, seed=3)


# ---------------------------------------------------------------------------
# Key mapping
# ---------------------------------------------------------------------------


def expected_hf_keys(n_layers: int) -> set[str]:
    keys = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(n_layers):
        keys |= {
            f"model.layers.{i}.self_attn.q_proj.weight",
            f"model.layers.{i}.self_attn.k_proj.weight",
            f"model.layers.{i}.self_attn.v_proj.weight",
            f"model.layers.{i}.self_attn.o_proj.weight",
            f"model.layers.{i}.mlp.gate_proj.weight",
            f"model.layers.{i}.mlp.up_proj.weight",
            f"model.layers.{i}.mlp.down_proj.weight",
            f"model.layers.{i}.input_layernorm.weight",
            f"model.layers.{i}.post_attention_layernorm.weight",
        }
    return keys


def test_exported_keys_are_hf_llama_keys_and_map_back(exported):
    model, folder = exported
    assert is_hf_folder(folder)
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    hf_keys = set(hf_weights(folder))
    assert hf_keys == expected_hf_keys(6)
    assert {from_hf_key(k) for k in hf_keys} == set(model.state_dict())
    assert all(to_hf_key(from_hf_key(k)) == k for k in hf_keys)
    with pytest.raises(KeyError):
        to_hf_key("layers.0.attention.rope.weight")


def test_config_json_describes_the_model(exported):
    _, folder = exported
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (256, 768, 6)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (16, 16, 256)
    assert config["rope_scaling"] is None and config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "float32"
    # Without a published context length, the export states the one it was trained at.
    assert config["max_position_embeddings"] == DEBUG_ARGS.max_seq_len
    assert args_from_hf_config(config, base=DEBUG_ARGS) == dataclasses.replace(DEBUG_ARGS, max_position_embeddings=32)

    scaled = hf_config(llama3_flavors["8B"], torch.bfloat16)
    assert scaled["rope_scaling"]["rope_type"] == "llama3" and scaled["intermediate_size"] == 14336
    assert args_from_hf_config(scaled, base=llama3_flavors["8B"]) == llama3_flavors["8B"]
    # Default multiple_of / ffn_dim_multiplier do not give the 8B's FFN width: the file's is kept.
    assert ffn_hidden_dim(args_from_hf_config(scaled)) == 14336


def test_a_config_json_with_sizes_of_the_wrong_kind_names_each():
    config = hf_config(DEBUG_ARGS, torch.float32)
    config |= {"hidden_size": "256", "num_hidden_layers": 6.0, "num_key_value_heads": True, "rms_norm_eps": 0}
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}
    config["rope_scaling"]["original_max_position_embeddings"] = -8192
    with pytest.raises(ValueError) as error:
        args_from_hf_config(config, source="x/config.json")
    assert str(error.value) == (
        "x/config.json: hidden_size='256' is not a positive integer; num_hidden_layers=6.0 is not a positive "
        "integer; num_key_value_heads=True is not a positive integer; "
        "rope_scaling.original_max_position_embeddings=-8192 is not a positive integer; "
        "rms_norm_eps=0 is not a positive number; rope_scaling.low_freq_factor=4.0 is not below high_freq_factor=1.0"
    )


def test_permutation_is_inverted():
    weight = torch.randn(4 * 8, 5)
    permuted = permute_for_hf(weight, n_heads=4)
    assert not torch.equal(permuted, weight)
    # Head 1, feature pair 2 (rows 8 + 4, 8 + 5) goes to rows 8 + 2 and 8 + 2 + 4.
    assert torch.equal(permuted[10], weight[12]) and torch.equal(permuted[14], weight[13])
    assert torch.equal(unpermute_from_hf(permuted, n_heads=4), weight)


# ---------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------


def test_float32_round_trip_gives_bitwise_equal_logits(exported, fresh_model):
    model, folder = exported
    other = copy.deepcopy(fresh_model)
    tokens = torch.randint(0, DEBUG_ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.equal(other(tokens), model(tokens))
        load_hf_weights([other], folder)
        assert torch.equal(other(tokens), model(tokens))


def test_bfloat16_round_trip_is_close(exported, fresh_model, tmp_path):
    model, _ = exported
    folder = str(tmp_path / "bf16")
    export_hf([model], DEBUG_ARGS, folder, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in hf_weights(folder).values())
    other = copy.deepcopy(fresh_model)
    load_hf_weights([other], folder)
    assert all(p.dtype == torch.float32 for p in other.parameters())
    tokens = torch.randint(0, DEBUG_ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual = model(tokens), other(tokens)
    # bf16 keeps 8 significant bits (relative rounding <= 2**-9 per weight). The logits have
    # std ~1 and move by ~1e-2 at most; 5e-2 leaves room without hiding a layout error.
    assert (actual - expected).abs().max() < 5e-2


def pipeline_parts(model: Transformer) -> list[Transformer]:
    """Two pipeline-style stages of a 2-layer model: parameter names stay those of the full model."""
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    del first.layers["1"]
    first.norm = first.output = None
    del last.layers["0"]
    last.tok_embeddings = None
    return [first, last]


def test_sharded_export_and_pipeline_parts(gqa_exported, tmp_path):
    model, _ = gqa_exported
    folder = str(tmp_path / "sharded")
    export_hf(pipeline_parts(model), GQA_SCALED_ARGS, folder, torch.float32, max_shard_bytes=200_000)
    names = sorted(os.listdir(folder))
    assert "model.safetensors.index.json" in names and len([n for n in names if n.endswith(".safetensors")]) > 2
    assert is_hf_folder(folder)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary folder left

    other_first, other_last = pipeline_parts(model)
    with torch.no_grad():
        for param in [*other_first.parameters(), *other_last.parameters()]:
            param.zero_()
    load_hf_weights([other_first, other_last], folder)
    tokens = torch.randint(0, GQA_SCALED_ARGS.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(other_last(other_first(tokens)), model(tokens))

    # Re-exporting over an existing folder replaces it whole.
    export_hf([model], GQA_SCALED_ARGS, folder, torch.float32)
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]


# ---------------------------------------------------------------------------
# Rotary permutation against HF's convention, by hand
# ---------------------------------------------------------------------------


def hf_inv_freq(config: dict) -> torch.Tensor:
    """HF's RoPE frequencies from config.json, including its "llama3" rope_type."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    inv_freq = 1.0 / config["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    scaling = config["rope_scaling"]
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def hf_attention_scores(hf: dict[str, torch.Tensor], config: dict, layer: int, x: torch.Tensor) -> torch.Tensor:
    """q.k scores [batch, heads, seq, seq] of one layer, computed as HF's LlamaAttention does."""
    bs, seqlen, _ = x.shape
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // n_heads
    wq = hf[f"model.layers.{layer}.self_attn.q_proj.weight"].double()
    wk = hf[f"model.layers.{layer}.self_attn.k_proj.weight"].double()
    q = (x.double() @ wq.T).view(bs, seqlen, n_heads, head_dim).transpose(1, 2)
    k = (x.double() @ wk.T).view(bs, seqlen, n_kv, head_dim).transpose(1, 2)
    freqs = torch.outer(torch.arange(seqlen, dtype=torch.float64), hf_inv_freq(config))
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    # HF's repeat_kv: kv head j serves query heads j * n_rep ... (j + 1) * n_rep - 1.
    k = k.repeat_interleave(n_heads // n_kv, dim=1)
    return q @ k.transpose(-1, -2)


@pytest.mark.parametrize("which", ["exported", "gqa_exported"], ids=["debugmodel", "gqa_llama3_scaling"])
def test_rotary_permutation_matches_hf_convention(which, request, monkeypatch):
    model, folder = request.getfixturevalue(which)
    args = model.args
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    x = torch.randn(2, 24, args.dim, generator=torch.Generator().manual_seed(0))
    layer = 1

    # Our scores, taken from inside our own Attention.forward (wq/wk, apply_rotary_emb, GQA repeat).
    captured = {}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def capture(q, k, v, **kwargs):
        captured["scores"] = q @ k.transpose(-1, -2)
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", capture)
    with torch.no_grad():
        model.layers[str(layer)].attention(x, model.rope_cache)

    expected = hf_attention_scores(hf_weights(folder), config, layer, x)
    assert captured["scores"].shape == expected.shape
    torch.testing.assert_close(captured["scores"].double(), expected, atol=1e-5, rtol=1e-5)
    # Without the permutation the HF-convention scores would differ: the test can fail.
    ours = model.state_dict()
    raw = {
        f"model.layers.{layer}.self_attn.{n}_proj.weight": ours[f"layers.{layer}.attention.w{n}.weight"] for n in "qk"
    }
    assert not torch.allclose(hf_attention_scores(raw, config, layer, x), expected, atol=1e-3)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def copy_export(folder: str, tmp_path, tensors: dict[str, torch.Tensor] | None = None) -> str:
    """A copy of the export at ``folder`` with its weights replaced by ``tensors`` if given."""
    target = tmp_path / "broken"
    target.mkdir()
    (target / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    save_file(tensors if tensors is not None else hf_weights(folder), str(target / "model.safetensors"))
    return str(target)


def test_missing_folder_and_files(exported, tmp_path):
    model, _ = exported
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=f"{missing} does not exist"):
        load_hf_weights([model], missing)
    assert not is_hf_folder(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json does not exist"):
        load_hf_weights([model], str(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text(json.dumps(hf_config(DEBUG_ARGS, torch.float32)))
    with pytest.raises(ValueError, match="has neither model.safetensors nor"):
        load_hf_weights([model], str(tmp_path / "empty"))
    config = tmp_path / "empty" / "config.json"
    config.write_bytes(b'{"hidden_size": "\xff"}')  # not UTF-8: named, not a UnicodeDecodeError traceback
    with pytest.raises(ValueError, match=f"cannot read {config}: 'utf-8' codec can't decode"):
        load_hf_weights([model], str(tmp_path / "empty"))


def test_missing_key(exported, tmp_path):
    model, folder = exported
    tensors = hf_weights(folder)
    del tensors["model.layers.3.mlp.up_proj.weight"]
    broken = copy_export(folder, tmp_path, tensors)
    with pytest.raises(ValueError, match=f"{broken} is missing 'model.layers.3.mlp.up_proj.weight'"):
        load_hf_weights([model], broken)


def test_unexpected_key(exported, tmp_path):
    model, folder = exported
    tensors = {**hf_weights(folder), "model.layers.6.mlp.up_proj.weight": torch.zeros(1)}
    broken = copy_export(folder, tmp_path, tensors)
    with pytest.raises(ValueError, match="has unexpected 'model.layers.6.mlp.up_proj.weight'"):
        load_hf_weights([model], broken)


def test_wrong_shape(exported, tmp_path):
    model, folder = exported
    tensors = hf_weights(folder)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(128, 256)
    broken = copy_export(folder, tmp_path, tensors)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[128, 256\]"):
        load_hf_weights([model], broken)


def test_truncated_safetensors(exported, tmp_path):
    model, folder = exported
    broken = copy_export(folder, tmp_path)
    path = os.path.join(broken, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{path} is not a valid safetensors file"):
        load_hf_weights([model], broken)


def test_an_index_whose_weight_map_is_not_of_file_names_is_named(exported, tmp_path):
    """A number where a file name goes was a TypeError in the pre-launch check."""
    model, folder = exported
    broken = copy_export(folder, tmp_path)
    index = os.path.join(broken, "model.safetensors.index.json")
    open(index, "w").write(json.dumps({"weight_map": {"tok_embeddings.weight": 5}}))
    with pytest.raises(ValueError, match=f"{index} has no 'weight_map' of tensor names to file names"):
        load_hf_weights([model], broken)


def test_a_null_head_dim_is_the_derived_one_as_transformers_reads_it():
    config = hf_config(DEBUG_ARGS, torch.float32)
    config.pop("head_dim", None)
    assert args_from_hf_config(config | {"head_dim": None}) == args_from_hf_config(config)
    with pytest.raises(ValueError, match="head_dim=32 but hidden_size / num_attention_heads = 16"):
        args_from_hf_config(config | {"head_dim": 32})


def test_config_mismatch(exported, tmp_path):
    model, folder = exported
    broken = copy_export(folder, tmp_path)
    config = json.loads(open(os.path.join(broken, "config.json")).read())
    config["rope_theta"] = 10000.0
    open(os.path.join(broken, "config.json"), "w").write(json.dumps(config))
    with pytest.raises(ValueError, match="config.json does not match the model: rope_theta=10000.0"):
        load_hf_weights([model], broken)


def test_export_needs_every_parameter(exported, tmp_path):
    model = copy.deepcopy(exported[0])
    model.output = None
    with pytest.raises(ValueError, match="do not hold 'lm_head.weight'"):
        export_hf([model], DEBUG_ARGS, str(tmp_path / "out"), torch.float32)
    assert os.listdir(tmp_path) == []


def test_weights_that_are_not_floating_point_are_refused(exported, tmp_path):
    """Integers would be cast to the model's dtype without a word: a model of zeros and ones."""
    model, folder = exported
    tensors = hf_weights(folder)
    for key in ("model.layers.1.self_attn.q_proj.weight", "model.norm.weight"):
        tensors[key] = tensors[key].to(torch.int32)
    broken = copy_export(folder, tmp_path, tensors)
    expected = (
        f"HF checkpoint: {broken} 'model.layers.1.self_attn.q_proj.weight' in model.safetensors is I32, "
        "'model.norm.weight' in model.safetensors is I32; weights must be F16, BF16, F32 or F64"
    )
    with pytest.raises(ValueError) as error:
        load_hf_weights([model], broken)
    assert str(error.value) == expected


@pytest.mark.parametrize("value", [math.nan, -math.inf])
def test_a_weight_that_is_not_finite_is_named(exported, fresh_model, tmp_path, value):
    """Loaded, it would make every attempt's first loss NaN; the ranks refuse it as they read it."""
    _, folder = exported
    tensors = hf_weights(folder)
    tensors["model.layers.1.self_attn.q_proj.weight"][3, 5] = value
    broken = copy_export(folder, tmp_path, tensors)
    path = os.path.join(broken, "model.safetensors")
    with pytest.raises(ValueError) as error:
        load_hf_weights([copy.deepcopy(fresh_model)], broken)
    assert str(error.value) == (
        f"HF checkpoint: {path}: 1 of the 65536 values of 'model.layers.1.self_attn.q_proj.weight' are NaN or infinite"
    )


def test_float16_weights_whose_sum_overflows_load(exported, fresh_model, tmp_path):
    """The finiteness check sums each tensor first; a float16 sum past 65504 is no NaN."""
    _, folder = exported
    tensors = {key: tensor.to(torch.float16) for key, tensor in hf_weights(folder).items()}
    tensors["model.norm.weight"].fill_(60000.0)
    model = copy.deepcopy(fresh_model)
    load_hf_weights([model], copy_export(folder, tmp_path, tensors))
    assert torch.equal(model.norm.weight, torch.full_like(model.norm.weight, 60000.0))
