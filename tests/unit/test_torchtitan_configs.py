"""torchtitan v0.2.2's llama3 TOML files and command-line spellings load: renamed options as
aliases, options of missing features in one line, every unknown option in one message; and the
pre-launch check names every missing path in one line."""

from __future__ import annotations

import logging
import os

import pytest

from config.errors import ConfigError
from config.manager import load_config, named_as_given
from programs.preflight import check
from tests.launch import REPO

# The keys of torchtitan's debug_model.toml, with its values (written here, not copied from it).
TITAN_DEBUG = """
[job]
dump_folder = "./outputs"
description = "Llama 3 debug training"
print_config = false
[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 10
enable_memory_snapshot = false
save_memory_snapshot_folder = "memory_snapshot"
[metrics]
log_freq = 1
disable_color_printing = false
enable_tensorboard = false
save_tb_folder = "tb"
enable_wandb = false
[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "./tests/assets/tokenizer"
[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8
[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "linear"
min_lr_factor = 0.0
[training]
local_batch_size = 8
seq_len = 2048
max_norm = 1.0
steps = 10
dataset = "c4_test"
[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"
tensor_parallel_degree = 1
enable_async_tensor_parallel = false
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "Interleaved1F1B"
context_parallel_degree = 1
expert_parallel_degree = 1
[checkpoint]
enable = false
folder = "checkpoint"
interval = 10
last_save_model_only = false
export_dtype = "float32"
async_mode = "disabled"
[activation_checkpoint]
mode = "selective"
selective_ac_option = '2'
[compile]
enable = false
components = ["model", "loss"]
[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]
[validation]
enable = false
dataset = "c4_validation"
freq = 5
steps = 10
"""

ANCHOR = os.path.join(os.path.dirname(REPO), "shared", "anchors", "torchtitan-v0.2.2")
TOKENIZER = os.path.join(ANCHOR, "assets", "tokenizer")


def write(tmp_path, text: str, name: str = "titan.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture
def corpus(tmp_path) -> str:
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "The quick brown fox jumps over the lazy dog."}\n' * 50)
    return str(path)


def test_torchtitan_names_map_onto_tessera_options(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        config = load_config(["--job.config_file", write(tmp_path, TITAN_DEBUG), "--training.dataset_path", "x.jsonl"])
    assert config.model.tokenizer_path == "./tests/assets/tokenizer"
    assert config.training.dataset == "x.jsonl"  # the path wins over the dataset name
    assert (config.activation_checkpoint.mode, config.lr_scheduler.decay_ratio) == ("selective", 0.8)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("torchtitan options with no effect in Tessera, ignored:")
    for name in ("metrics.disable_color_printing", "parallelism.expert_parallel_degree"):
        assert name in warnings[0]
    # Float8's options are Tessera's own, under [float8].
    assert "quantize" not in warnings[0] and config.float8.filter_fqns == ["output"]


def test_a_missing_features_off_value_on_the_command_line_is_known_as_off(tmp_path, caplog):
    """The command line's strings read as the option's type: '1' for expert parallelism and
    'false' for the memory-budget pareto leave them off (they were compared as strings with 1 and False: an
    error, a warning that the feature is missing)."""
    with caplog.at_level(logging.WARNING):
        load_config(
            [
                *("--job.config_file", write(tmp_path, TITAN_DEBUG)),
                *("--parallelism.expert_parallel_degree", "1", "--parallelism.expert_tensor_parallel_degree=1"),
                *("--activation_checkpoint.visualize_memory_budget_pareto", "false"),
            ]
        )
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("torchtitan options with no effect in Tessera, ignored:")
    with pytest.raises(ConfigError, match=r"not available in Tessera: parallelism.expert_parallel_degree=2$"):
        load_config(["--parallelism.expert_parallel_degree", "2"])


def test_command_line_spellings(tmp_path):
    config = load_config(
        [
            *("--job.config_file", write(tmp_path, TITAN_DEBUG)),
            *("--training.local-batch-size", "2", "--parallelism.disable_loss_parallel"),
            *("--training.gc_freq", "7", "--checkpoint.no_last_save_model_only", "--compile.no-enable"),
            *("--checkpoint.enable", "--checkpoint.last_save_in_hf", "--job.print_config"),
        ]
    )
    assert config.training.local_batch_size == 2 and config.debug.gc_freq == 7
    assert not config.parallelism.enable_loss_parallel and not config.compile.enable
    assert config.checkpoint.export_hf and config.job.print_config


def test_missing_features_are_named_in_one_line(tmp_path, caplog):
    pareto = "[activation_checkpoint]\nvisualize_memory_budget_pareto = true\n"
    offload = write(tmp_path, TITAN_DEBUG.replace("[activation_checkpoint]\n", pareto))
    with caplog.at_level(logging.WARNING):
        load_config(["--job.config_file", offload, "--parallelism.tensor_parallel_degree", "1"])
    assert any(
        "training without them: activation_checkpoint.visualize_memory_budget_pareto=True" in r.getMessage()
        for r in caplog.records
    )
    both = offload.replace("titan.toml", "both.toml")
    with open(both, "w") as f:
        f.write(open(offload).read().replace("expert_parallel_degree = 1", "expert_parallel_degree = 2"))
    with pytest.raises(ConfigError) as error:
        load_config(["--job.config_file", both, "--comm.mode", "local_tensor"])
    message = str(error.value)
    assert message.startswith("not available in Tessera:") and "\n" not in message
    for name in (
        "activation_checkpoint.visualize_memory_budget_pareto",
        "parallelism.expert_parallel_degree=2",
        "comm.mode='local_tensor'",
    ):
        assert name in message


def test_an_export_dtype_without_the_hf_export_is_a_warning_from_a_file_too(tmp_path, caplog):
    """torchtitan saves its last checkpoint model-only in checkpoint.export_dtype; Tessera's last
    checkpoint is whole and export_dtype is the Hugging Face export's: set in a file with that
    export off, it is one warning (it was ignored without a word)."""
    text = TITAN_DEBUG.replace("[checkpoint]\nenable = false", "[checkpoint]\nenable = true")
    bf16 = write(tmp_path, text.replace('export_dtype = "float32"', 'export_dtype = "bfloat16"'))
    for options, warned in (([], True), (["--checkpoint.last_save_in_hf"], False), (["--checkpoint.no-enable"], False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="config"):
            load_config(["--job.config_file", bf16, *options])
        found = [m for m in caplog.messages if m.startswith("checkpoint.export_dtype bfloat16")]
        assert found == (
            [
                "checkpoint.export_dtype bfloat16 is the dtype of the Hugging Face export alone "
                "(checkpoint.export_hf), which is off: the last checkpoint is saved whole, as trained"
            ]
            if warned
            else []
        ), options


def test_every_unknown_option_in_one_message_and_suggestions_only_when_close(tmp_path):
    text = TITAN_DEBUG.replace("steps = 10\n", "steps = 10\nstepz = 3\n", 1)
    text = text.replace("[checkpoint]\n", "[checkpoint]\nsave_every_step = true\n") + "[wandb]\nproject = 'x'\n"
    with pytest.raises(ConfigError) as error:
        load_config(["--job.config_file", write(tmp_path, text), "--optimizer.momentum", "0.9"])
    message = str(error.value)
    assert "unknown option 'training.stepz'" in message and "did you mean 'training.steps'" in message
    assert "unknown option 'checkpoint.save_every_step'" in message and "unknown section [wandb]" in message
    assert "unknown option 'optimizer.momentum'" in message
    assert message.count("did you mean") == 1  # nothing close to the others


def test_the_last_config_file_wins(tmp_path, caplog):
    """With a warning, as for any option typed twice: the first file is not read at all (it was
    dropped without a word)."""
    first = write(tmp_path, "[training]\nsteps = 11\n", "first.toml")
    second = write(tmp_path, "[training]\nsteps = 12\n", "second.toml")
    with caplog.at_level("WARNING", logger="config"):
        assert load_config(["--job.config_file", first, "--job.config_file", second]).training.steps == 12
    assert [r.getMessage() for r in caplog.records] == [
        "given more than once, the last counts: --job.config_file (2 times)"
    ]
    with pytest.raises(ConfigError, match="config file not found: missing.toml"):
        load_config(["--job.config_file", first, "--job.config_file", "missing.toml"])


def test_preflight_names_every_missing_path_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as error:
        check(load_config(["--job.config_file", write(tmp_path, TITAN_DEBUG)]), world_size=2)
    message = str(error.value)
    assert "\n" not in message
    assert (
        "training.dataset: dataset path not found: tests/assets/c4_test" in message
        and "--training.dataset_path" in message
    )
    assert "model.tokenizer_path: tokenizer path not found: ./tests/assets/tokenizer" in message


@pytest.mark.skipif(not os.path.isdir(TOKENIZER), reason=f"torchtitan's test tokenizer is not at {TOKENIZER}")
@pytest.mark.parametrize(
    "name, world_size", [("debug_model", 2), ("llama3_8b", 8), ("llama3_70b", 8), ("llama3_405b", 8)]
)
def test_torchtitans_own_files_pass_the_pre_launch_check(name, world_size, corpus, caplog):
    path = os.path.join(ANCHOR, "train_configs", f"{name}.toml")
    overrides = ["--model.hf_assets_path", TOKENIZER, "--training.dataset_path", corpus]
    with caplog.at_level(logging.WARNING):
        check(load_config(["--job.config_file", path, *overrides]), world_size=world_size)
    if name != "debug_model":  # the flavors' 128,256 tokens give way to the tokenizer's, and the log says so
        assert any("model vocabulary: 2004 tokens from the tokenizer" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="tokenizer path not found") as error:
        check(load_config(["--job.config_file", path]), world_size=world_size)
    assert "training.dataset" in str(error.value) and "\n" not in str(error.value)


def test_no_torchtitan_name_shadows_an_option_of_tessera():
    """An option Tessera has is set as Tessera's; the same name left among torchtitan's foreign or
    renamed options would be dead (and its note of an ignored feature wrong)."""
    from config import torchtitan
    from config.manager import _all_keys

    tessera = set(_all_keys())
    assert tessera & (set(torchtitan.FOREIGN) | set(torchtitan.ALIASES) | set(torchtitan.NEGATED)) == set()


def test_an_error_names_an_option_as_the_user_gave_it(tmp_path):
    """Given by torchtitan's name, on the command line or in the file, an option is named so in the
    error line (it was named by Tessera's, which the user never wrote); given by Tessera's, as before."""
    error = ConfigError("model.tokenizer_path: tokenizer folder x has no tokenizer.json (model.tokenizer_path_b)")
    renamed = "model.hf_assets_path: tokenizer folder x has no tokenizer.json (model.tokenizer_path_b)"
    assert str(named_as_given(error, ["--model.hf_assets_path", "x"])) == renamed
    config = tmp_path / "job.toml"
    config.write_text('[model]\nhf_assets_path = "x"\n')
    assert str(named_as_given(error, ["--job.config_file", str(config)])) == renamed
    assert str(named_as_given(error, ["--model.tokenizer_path", "x"])) == str(error)
    # The command line's value wins over the file's, and so does the name it used.
    assert str(named_as_given(error, ["--job.config_file", str(config), "--model.tokenizer_path", "x"])) == str(error)
    tessera_file = tmp_path / "tessera.toml"
    tessera_file.write_text('[model]\ntokenizer_path = "x"\n')
    assert (
        str(named_as_given(error, ["--job.config_file", str(tessera_file), "--model.hf_assets_path", "x"])) == renamed
    )
    # Given by both names, an option is named by each where the line names it.
    both = ["--model.tokenizer_path", "x", "--model.hf_assets_path", "y"]
    with pytest.raises(ConfigError) as contradiction:
        load_config(both)
    assert str(named_as_given(contradiction.value, both)) == str(contradiction.value)
    assert '--model.tokenizer_path "x" and --model.hf_assets_path "y"' in str(contradiction.value)


def test_torchtitans_converter_name_and_the_missing_features_that_change_the_run(tmp_path, caplog):
    """torchtitan's converter name quantize.linear.float8 is float8, in a file's list and on the command
    line; a missing feature that changes what is trained is one line naming it and what is missing;
    memory_estimation's fake-mode switch takes any value."""
    text = TITAN_DEBUG.replace(
        'flavor = "debugmodel"', 'flavor = "debugmodel"\nconverters = ["quantize.linear.float8"]'
    )
    assert load_config(["--job.config_file", write(tmp_path, text)]).model.converters == ["float8"]
    assert load_config(["--model.converters", "quantize.linear.float8"]).model.converters == ["float8"]
    for option, missing in (
        ("--job.custom_config_module=my.config", "Tessera imports no module of yours"),
        ("--experimental.custom_import=my.model", "Tessera imports no module of yours"),
        ("--checkpoint.initial_load_in_hf_quantized", "would load as plain ones"),
        ("--comm.mode=fake_backend", "a dry run is COMM_MODE=fake ./run_train.sh"),
    ):
        with pytest.raises(ConfigError) as error:
            load_config([option])
        assert str(error.value).startswith(f"not available in Tessera: {option[2:].split('=')[0]}=")
        assert missing in str(error.value) and "\n" not in str(error.value)
    with caplog.at_level(logging.WARNING):
        config = load_config(["--memory_estimation.enable", "--memory_estimation.disable_fake_mode", "yes"])
    assert config.memory_estimation.enable
    assert "ignored: memory_estimation.disable_fake_mode" in caplog.text
