import dataclasses
import logging
import os
import subprocess
import sys

import pytest

from config.errors import ConfigError, print_error, typed_first_line
from config.job_config import RESOLVED_CONFIG_HEADER, JobConfig
from config.manager import help_text, load_config, to_toml
from config.rules import batch_layout
from programs.preflight import check

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_arguments():
    assert load_config([]) == JobConfig()


def test_cli_forms_and_types():
    config = load_config(
        [
            "--training.steps",
            "20",
            "--lr_scheduler.warmup_steps",
            "2",
            "--optimizer.lr=3e-4",
            "--profiling.enable_profiling",
            "--compile.manual_buckets",
            "layers.0+layers.1, norm+output",
            "--metrics.enable_tensorboard",
            "false",
            "--training.global_batch_size",
            "-1",
            "--lr_scheduler.decay_ratio",
            "0.2",
        ]
    )
    assert config.training.steps == 20
    assert config.optimizer.lr == 3e-4
    assert config.profiling.enable_profiling is True
    assert config.compile.manual_buckets == ["layers.0+layers.1", "norm+output"]
    assert config.metrics.enable_tensorboard is False
    assert config.training.global_batch_size == -1
    assert config.lr_scheduler.decay_ratio == 0.2


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write(
        tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.01\n[lr_scheduler]\nwarmup_steps = 2\n"
    )
    config = load_config(["--job.config_file", path, "--training.steps", "9"])
    assert config.training.steps == 9  # CLI wins
    assert config.training.seq_len == 64  # TOML wins over the default
    assert config.training.local_batch_size == JobConfig().training.local_batch_size
    assert config.job.config_file == path


def test_a_toml_file_beginning_with_a_byte_order_mark_loads(tmp_path):
    """As Windows editors save it ('invalid TOML: Invalid statement (at line 1, column 1)' before)."""
    path = tmp_path / "job.toml"
    path.write_bytes(b"\xef\xbb\xbf[training]\r\nsteps = 7\r\n")
    assert load_config(["--job.config_file", str(path)]).training.steps == 7


def test_toml_position_does_not_matter(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\n[lr_scheduler]\nwarmup_steps = 2\n")
    config = load_config(["--training.steps", "9", f"--job.config_file={path}"])
    assert config.training.steps == 9


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.stpes", "3"], "did you mean 'training.steps'"),
        (["--trainig.steps", "3"], "did you mean 'training.steps'"),
        (["--training.steps", "three"], "training.steps: expected an integer"),
        (["--training.steps", "2.5"], "training.steps: expected an integer"),
        (["--optimizer.lr", "fast"], "optimizer.lr: expected a number"),
        (["--compile.enable", "maybe"], "compile.enable: expected true or false"),
        (["--checkpoint.interval", "0"], "checkpoint.interval must be positive"),
        (["--checkpoint.async_mode", "background"], "checkpoint.async_mode: 'background' is not one of"),
        (["--checkpoint.enable", "--checkpoint.exclude_from_loading", "optimizr"], "did you mean 'optimizer'"),
        (["--checkpoint.load_step", "5"], "checkpoint.load_step needs checkpoint.enable"),
        (
            [
                "--checkpoint.enable",
                "--checkpoint.exclude_from_loading",
                "model,optimizer,lr_scheduler,dataloader,train_state",
            ],
            "checkpoint.exclude_from_loading: every part (model, optimizer, lr_scheduler, dataloader, train_state)",
        ),
        (["--training.nonfinite_policy", "rollback"], "'rollback' needs checkpoint.enable"),
        (["--debug.failure", "explode"], "debug.failure: 'explode' is not one of"),
        (["--comm.alpha_us", "10"], "comm.alpha_us and comm.bandwidth_gbps go together"),
        (["--compile.bucketing", "greedy"], "compile.bucketing: 'greedy' is not one of none, manual, auto, block"),
        (["--training.steps"], "--training.steps needs a value"),
        (["--job.config_file", "/no/such/file.toml"], "config file not found: /no/such/file.toml"),
        (["--parallelism.data_parallel_impl", "zero3"], "parallelism.data_parallel_impl: 'zero3' is not one of"),
        (["--training.seq_len", "0"], "training.seq_len must be positive"),
        (["steps=3"], "unexpected argument 'steps=3'"),
        (["--job.dump_folder", " "], "job.dump_folder: no folder given ('.' is the working folder)"),
        (["--job.run_name", "../../etc"], "job.run_name: '../../etc' is not a plain folder name"),
        (["--job.run_name", "/tmp/fixb_tb"], "job.run_name: '/tmp/fixb_tb' is not a plain folder name"),
        (["--job.run_name", ".."], "job.run_name: '..' is not a plain folder name"),
        (["--job.run_name", " "], "job.run_name: ' ' is not a plain folder name"),
    ],
)
def test_bad_cli_input(argv, message):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(argv)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[trainig]\nsteps = 3\n", "unknown section [trainig] (did you mean 'training'?)"),
        ("[training]\nstep = 3\n", "unknown option 'training.step'"),
        ("[training]\nsteps = '3'\n", "training.steps: expected int, got the string"),
        ("[training]\nsteps = 3\nsteps = 4\n", "invalid TOML"),
        ("steps = 3\n", "'steps' must be a [section] table"),
        # An array of tables (it said "did you mean 'training'?").
        ("[[training]]\nsteps = 3\n", "'training' must be one [training] table, not [[training]] or a value"),
        ("training = 3\n", "'training' must be one [training] table"),
    ],
)
def test_bad_toml_input(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(["--job.config_file", path])
    assert message in str(err.value)
    assert path in str(err.value)


def test_degrees_must_match_world_size():
    with pytest.raises(ConfigError, match="multiply to 8 .* world size is 4"):
        check(
            load_config(
                ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.data_parallel_replicate_degree", "2"]
            ),
            4,
        )
    with pytest.raises(ConfigError, match="world size 6 is not divisible"):
        check(load_config(["--parallelism.data_parallel_replicate_degree", "4"]), 6)
    check(load_config(["--parallelism.data_parallel_replicate_degree", "2"]), 4)  # shard degree -1 takes the rest


def test_batch_sizes_must_divide():
    training = JobConfig().training
    training.local_batch_size, training.global_batch_size = 4, 24
    assert batch_layout(training, 2) == (24, 3)
    training.global_batch_size = 20
    with pytest.raises(ConfigError, match="global_batch_size 20 is not divisible"):
        batch_layout(training, 2)
    training.global_batch_size = -1
    assert batch_layout(training, 4) == (16, 1)


def test_help_lists_every_field_with_doc_and_default():
    text = help_text()
    for section, values in dataclasses.asdict(JobConfig()).items():
        for name in values:
            assert f"--{section}.{name} " in text
    assert "Optimizer steps to train. " in text or "Optimizer steps to train." in text
    assert "(default: 100)" in text


def test_resolved_config_round_trips_through_toml(tmp_path):
    config = load_config(
        [
            "--training.steps",
            "5",
            "--lr_scheduler.warmup_steps",
            "1",
            "--lr_scheduler.decay_ratio",
            "0.5",
            "--debug.deterministic",
        ]
    )
    path = write(tmp_path, to_toml(config))
    config.job.config_file = path
    assert load_config(["--job.config_file", path]) == config


def test_strings_with_newlines_and_quotes_round_trip_through_the_resolved_toml(tmp_path):
    """Newlines (of a multi-line TOML string too), tabs, quotes and backslashes are escaped in the
    resolved TOML and read back as they were."""
    text = 'a\nb\tc\r "q" \\ \\n \u00e9'
    path = write(tmp_path, '[job]\ndescription = """\nline one\nline two"""\n')
    config = load_config(["--job.config_file", path, "--training.dataset_config", text])
    assert config.job.description == "line one\nline two"
    written = tmp_path / "written.toml"
    written.write_text(to_toml(config))
    config.job.config_file = str(written)
    assert load_config(["--job.config_file", str(written)]) == config


def test_train_py_reports_bad_input_in_one_line():
    result = subprocess.run(
        [sys.executable, "train.py", "--training.stesp", "3"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "error: unknown option 'training.stesp' (did you mean 'training.steps'?)"


def test_an_error_line_is_one_write(monkeypatch):
    """Ranks share one stderr and run unbuffered (PYTHONUNBUFFERED): a line written in two pieces
    (print's text, then its newline) was once split by torchrun's own log line."""
    writes = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    print_error(ConfigError("training.steps must be positive"))
    assert writes == ["error: training.steps must be positive\n"]


def test_a_mistyped_option_is_reported_before_torch_is_imported():
    """Importing torch and the model costs seconds; the pre-launch check parses the options first."""
    probe = (
        "import sys; from programs import preflight; "
        "code = preflight.main(['--world-size', '2', '--training.stepz', '3']); "
        "print(code, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.stderr == "error: unknown option 'training.stepz' (did you mean 'training.steps'?)\n"
    assert result.stdout.split() == ["2", "False"]


@pytest.mark.parametrize(
    "launch, code",
    [
        (["--world-size=2"], 0),
        (["--nnodes", "1", "--nproc-per-node=2"], 0),
        (["--world-size"], 2),
        (["--nnodes", "abc", "--nproc-per-node", "2"], 2),  # a traceback of int()
        (["--nnodes", "1", "--nproc-per-node", "2", "--world-size", "4"], 2),  # world size 4 was taken
    ],
)
def test_the_pre_launch_checks_launch_options(launch, code, capsys):
    from programs import preflight

    assert preflight.main(launch) == code
    err = capsys.readouterr().err
    assert err == ("" if code == 0 else preflight.USAGE + "\n")


def test_preflight_catches_world_size_mismatch():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "programs.preflight",
            "--world-size",
            "3",
            "--parallelism.data_parallel_replicate_degree",
            "2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "not divisible" in result.stderr


def test_the_pre_launch_check_shows_each_warning_once():
    """It builds the model's sizes twice (the layout, then the files); their warning is shown once."""
    options = ["--model.max_position_embeddings", "32", "--training.seq_len", "64"]
    result = subprocess.run(
        [sys.executable, "-m", "programs.preflight", "--world-size", "1", *options],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("is longer than the 32 positions") == 1, result.stderr


def test_options_for_data_parallelism_are_named_where_there_is_none(caplog):
    """What shards weights or reduces gradients, typed for a layout with one data-parallel rank (or
    replicas only), is one warning before launch; it was taken without a word."""
    from programs import preflight

    options = ["--parallelism.fsdp_reshard_after_forward", "never", "--training.mixed_precision_reduce", "bfloat16"]
    unsharded = (
        "--parallelism.fsdp_reshard_after_forward (no sharded data parallelism: the data-parallel shard degree is 1)"
    )
    unreduced = "--training.mixed_precision_reduce (no data parallelism: one data-parallel rank)"
    layouts = [
        (["--world-size", "1"], [f"{unsharded}; {unreduced}"]),
        (["--world-size", "2", "--parallelism.data_parallel_replicate_degree", "2"], [unsharded]),
        (["--world-size", "2"], []),
    ]
    for layout, named in layouts:
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert preflight.main([*layout, *options]) == 0
        assert [r.getMessage() for r in caplog.records] == [f"no effect in this run: {line}" for line in named]


def test_the_planners_options_typed_for_a_run_are_named(caplog):
    """[plan] is read by python -m programs.plan alone: typed for a training run (or a dry run) it
    is one warning before launch, values the planner would refuse included; it was taken without a
    word."""
    from programs import preflight

    with caplog.at_level("WARNING"):
        assert preflight.main(["--world-size", "1", "--plan.devices", "-3", "--plan.mfu", "5"]) == 0
    assert [r.getMessage() for r in caplog.records] == [
        "no effect in this run: --plan.devices, --plan.mfu (the layout planner's options: python -m programs.plan)"
    ]


def test_options_typed_twice_or_that_do_nothing_in_the_run_are_named_once(tmp_path, caplog):
    """A typed option whose switch is off is one warning naming each with the switch; the same
    options in a file (torchtitan's files carry many: checkpoint.interval with enable false) are
    not."""
    argv = ["--checkpoint.interval", "5", "--compile.bucketing", "auto", "--float8.emulate", "--training.steps", "3"]
    argv += ["--parallelism.pipeline_parallel_schedule", "GPipe", "--validation.enable", "--validation.freq", "5"]
    argv += [
        "--training.steps",
        "4",
        "--training.steps=3",
        "--checkpoint.interval",
        "5",
        "--lr_scheduler.total_steps",
        "1",
    ]
    with caplog.at_level("WARNING", logger="config"):
        load_config(argv)
    assert [r.getMessage() for r in caplog.records] == [
        "given more than once, the last counts: --checkpoint.interval (2 times), --training.steps (3 times)",
        "no effect in this run: --checkpoint.interval (checkpoint.enable is false); --compile.bucketing "
        "(compile.enable is false); --float8.emulate (model.converters has no float8); "
        "--parallelism.pipeline_parallel_schedule (no pipeline parallelism)",
        "validation.freq 5 is more than training.steps 3: only validation after step 1 in this run",
        "lr_scheduler.total_steps 1 is less than training.steps 3: steps 2 to 3 train at the final learning rate",
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="config"):
        load_config(
            ["--compile.enable", "--parallelism.data_parallel_impl", "simple_fsdp", "--compile.bucketing", "auto"]
        )
        load_config(["--compile.enable", "--compile.bucketing", "auto"])
    assert [r.getMessage() for r in caplog.records] == [
        "no effect in this run: --compile.bucketing (parallelism.data_parallel_impl is fsdp2)"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="config"):  # test options of failure injection too
        load_config(["--debug.failure", "nan", "--training.steps", "3"])
        load_config(["--debug.fail_at_step", "2", "--debug.failure", "kill_during_save", "--training.steps", "3"])
        load_config(["--debug.fail_at_step", "5", "--training.steps", "3"])
    assert [r.getMessage() for r in caplog.records] == [
        "no effect in this run: --debug.failure (debug.fail_at_step is -1)",
        "no effect in this run: --debug.fail_at_step (debug.failure kill_during_save without checkpoint.enable); "
        "--debug.failure (debug.failure kill_during_save without checkpoint.enable)",
        "debug.fail_at_step 5 is more than training.steps 3: no injected failure in this run",
    ]
    caplog.clear()
    config = tmp_path / "inert.toml"
    config.write_text("[checkpoint]\ninterval = 5\n[compile]\nbucketing = 'auto'\n[float8]\nemulate = true\n")
    with caplog.at_level("WARNING", logger="config"):
        load_config(["--job.config_file", str(config)])
    assert caplog.records == []


@pytest.mark.parametrize(
    "argv, warning",
    [
        (
            ["--activation_checkpoint.debug", "--activation_checkpoint.preserve_rng_state"],
            "--activation_checkpoint.debug (activation_checkpoint.mode is none); "
            "--activation_checkpoint.preserve_rng_state (activation_checkpoint.mode is none)",
        ),
        (
            ["--activation_checkpoint.mode", "memory_budget", "--compile.enable"]
            + ["--activation_checkpoint.determinism_check", "none"],
            "--activation_checkpoint.determinism_check (activation_checkpoint.mode is memory_budget)",
        ),
        (
            ["--checkpoint.enable", "--checkpoint.export_dtype", "bfloat16"],
            "--checkpoint.export_dtype (checkpoint.export_hf is false)",
        ),
        (
            ["--metrics.save_for_all_ranks", "--metrics.enable_tensorboard", "false"],
            "--metrics.save_for_all_ranks (metrics.enable_tensorboard and metrics.enable_wandb are false)",
        ),
        (
            ["--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.interval", "5"],
            "--checkpoint.interval (checkpoint.load_only saves nothing)",
        ),
        (["--debug.deterministic_warn_only"], "--debug.deterministic_warn_only (debug.deterministic is false)"),
        (
            ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_split_points", "layers.3"]
            + ["--parallelism.pipeline_parallel_first_stage_less_layers", "2"],
            "--parallelism.pipeline_parallel_first_stage_less_layers (parallelism.pipeline_parallel_split_points "
            "gives the stages)",
        ),
        (
            ["--parallelism.data_parallel_impl", "simple_fsdp", "--compile.enable", "--compile.components", "loss"]
            + ["--compile.bucketing", "auto"],
            "--compile.bucketing (compile.components has no model)",
        ),
    ],
)
def test_an_option_whose_feature_is_off_is_named(argv, warning, caplog):
    """Options of a feature the rest of the config leaves out, typed on the command line: one
    warning naming each with the reason (they were taken without a word)."""
    with caplog.at_level("WARNING", logger="config"):
        load_config(argv)
    assert [r.getMessage() for r in caplog.records] == [f"no effect in this run: {warning}"]


@pytest.mark.parametrize(
    "argv, toml, message",
    [
        (
            ["--model.hf_assets_path", "/x", "--model.tokenizer_path", "/y"],
            "",
            '--model.tokenizer_path "/y" and --model.hf_assets_path "/x" contradict',
        ),
        ([], "[model]\nhf_assets_path = '/x'\ntokenizer_path = '/y'\n", 'tokenizer_path "/y" and model.hf_assets'),
        (
            [],
            "[parallelism]\ndisable_loss_parallel = true\nenable_loss_parallel = true\n",
            "parallelism.disable_loss_parallel true and parallelism.enable_loss_parallel true in ",
        ),
        (
            ["--parallelism.disable_loss_parallel", "--parallelism.enable_loss_parallel"],
            "",
            "--parallelism.disable_loss_parallel true and --parallelism.enable_loss_parallel true contradict",
        ),
        ([], "[checkpoint]\nlast_save_in_hf = true\nexport_hf = false\n", "export_hf false and checkpoint.last_save"),
        (
            [],
            "[float8]\nfilter_fqns = ['a']\n[quantize.linear.float8]\nfilter_fqns = ['output']\n",
            'float8.filter_fqns ["a"] and quantize.linear.float8.filter_fqns ["output"] in ',
        ),
    ],
)
def test_an_option_given_under_both_names_with_values_that_disagree_is_refused(tmp_path, argv, toml, message):
    """Tessera's name and torchtitan's for one option, in one file or on the command line: which
    one the user meant cannot be told (on the command line, the alias won whatever the order)."""
    if toml:
        argv = ["--job.config_file", write(tmp_path, toml)]
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    assert message in str(err.value)
    assert "contradict each other: one option by Tessera's and torchtitan's names; give one" in str(err.value)


def test_an_option_given_under_both_names_that_agree_or_in_two_sources_is_taken(tmp_path, caplog):
    """Agreeing names are one setting; the command line still wins over a file's other name; the
    last of one name typed twice counts, as the warning says; dataset_path wins over dataset, whose
    files it locates."""
    toml = write(tmp_path, "[model]\nhf_assets_path = '/x'\n[training]\ndataset = 'c4'\ndataset_path = '/data'\n")
    tp = ["--parallelism.tensor_parallel_degree", "2"]  # else loss parallelism has no effect, and says so
    with caplog.at_level("WARNING", logger="config"):
        agreeing = load_config(["--model.hf_assets_path", "/x", "--model.tokenizer_path", "/x"])
        negated = load_config(
            [*tp, "--parallelism.disable_loss_parallel", "false", "--parallelism.enable_loss_parallel"]
        )
        assert caplog.records == []
        across = load_config(["--job.config_file", toml, "--model.tokenizer_path", "/y"])
        typed_twice = load_config([*tp, "--parallelism.enable_loss_parallel", "--parallelism.no_enable_loss_parallel"])
    assert (agreeing.model.tokenizer_path, negated.parallelism.enable_loss_parallel) == ("/x", True)
    assert (across.model.tokenizer_path, across.training.dataset) == ("/y", "/data")
    assert typed_twice.parallelism.enable_loss_parallel is False
    assert [r.getMessage() for r in caplog.records] == [
        "given more than once, the last counts: --parallelism.enable_loss_parallel (2 times)"
    ]


def test_a_home_relative_path_is_the_home_folders(tmp_path):
    """'~/runs' in a TOML file or after --option= (where the shell leaves it) is not a folder
    named '~' in the working folder."""
    config = tmp_path / "home.toml"
    config.write_text("[job]\ndump_folder = '~/runs/a'\n[training]\ndataset = '~/corpus.jsonl'\n")
    loaded = load_config(["--job.config_file", str(config), "--checkpoint.initial_load_path=~/seed"])
    home = os.path.expanduser("~")
    assert (loaded.job.dump_folder, loaded.training.dataset) == (f"{home}/runs/a", f"{home}/corpus.jsonl")
    assert loaded.checkpoint.initial_load_path == f"{home}/seed"


def test_an_error_without_text_is_named_once():
    assert typed_first_line(EOFError()) == "EOFError"
    assert typed_first_line(OSError("disk full\nmore detail")) == "OSError: disk full"


def test_a_config_file_named_inside_a_config_file_is_a_warning(tmp_path, caplog):
    """torchtitan reads one file, the command line's, and so does Tessera: a file that names
    another under [job] is one warning (it was ignored without a word); a run's resolved config,
    which names the file it was made from, is not."""
    nested = write(tmp_path, '[job]\nconfig_file = "base.toml"\n[training]\nsteps = 3\n')
    resolved = tmp_path / "config.toml"
    resolved.write_text(RESOLVED_CONFIG_HEADER + '[job]\nconfig_file = "base.toml"\n[training]\nsteps = 3\n')
    for path, expected in ((nested, 1), (str(resolved), 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="config"):
            config = load_config(["--job.config_file", path])
        assert config.training.steps == 3 and config.job.config_file == path
        warned = [m for m in caplog.messages if m.startswith("job.config_file")]
        assert (
            warned
            == [
                f"job.config_file = 'base.toml' in {path} has no effect: a config file does not read another "
                "(the command line's --job.config_file names the one file read)"
            ][:expected]
        ), path
