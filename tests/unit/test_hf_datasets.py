"""Corpora read through the Hugging Face ``datasets`` library: local Parquet, Arrow and JSON shards
(files, folders, comma-separated lists) with a configurable text field, the hub's names, and the
pre-launch check's one line for every bad input (through ``programs.preflight``'s main, in-process)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from config.manager import load_config
from programs import preflight
from tests.unit.conftest import CharTokenizer
from trainer.data.corpus import Corpus, corpus_of, corpus_texts, local_corpus_files
from trainer.data.shards import TextEncoder, prepare_tokens


def write_parquet(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({field: texts, "id": list(range(len(texts)))}), path)
    return path


def test_parquet_shards_as_files_folder_and_list(tmp_path: Path) -> None:
    """A folder reads its shards in sorted order (recursively), a comma-separated list in its own
    order; every record is one document."""
    folder = tmp_path / "shards"
    write_parquet(folder / "part-1.parquet", ["c", "d"])
    write_parquet(folder / "part-0.parquet", ["a", "b"])
    write_parquet(folder / "more" / "part-2.parquet", ["e"])
    assert list(corpus_texts(Corpus(str(folder)))) == ["e", "a", "b", "c", "d"]  # "more/" sorts before "part-0"
    listed = f"{folder / 'part-1.parquet'},{folder / 'part-0.parquet'}"
    assert list(corpus_texts(Corpus(listed))) == ["c", "d", "a", "b"]
    assert list(corpus_texts(Corpus(str(folder / "part-0.parquet")))) == ["a", "b"]


def test_arrow_folder_from_save_to_disk_and_json_shards(tmp_path: Path) -> None:
    """``Dataset.save_to_disk``'s folder reads as its .arrow shards (its JSON metadata skipped);
    JSON shards as JSON Lines or one array, gzipped or not; the text field is whichever the option
    names."""
    datasets.Dataset.from_dict({"content": ["x", "y", "z"]}).save_to_disk(str(tmp_path / "saved"))
    assert list(corpus_texts(Corpus(str(tmp_path / "saved"), text_field="content"))) == ["x", "y", "z"]
    (tmp_path / "lines.json").write_text("".join(json.dumps({"body": t}) + "\n" for t in ["j1", "j2"]))
    (tmp_path / "array.json").write_text(json.dumps([{"body": "j3"}]))
    listed = f"{tmp_path / 'lines.json'},{tmp_path / 'array.json'}"
    assert list(corpus_texts(Corpus(listed, text_field="body"))) == ["j1", "j2", "j3"]
    gzipped = tmp_path / "c4-train.00000-of-01024.json.gz"  # how C4 keeps its shards
    with gzip.open(gzipped, "wt") as f:
        f.write(json.dumps({"body": "gz1"}) + "\n" + json.dumps({"body": "gz2"}) + "\n")
    assert list(corpus_texts(Corpus(str(gzipped), text_field="body"))) == ["gz1", "gz2"]
    (tmp_path / "doc.jsonl").write_text(json.dumps({"body": "own reader"}) + "\n")
    assert list(corpus_texts(Corpus(str(tmp_path / "doc.jsonl"), text_field="body"))) == ["own reader"]


def load_token_stream(corpus: Corpus, tokenizer: CharTokenizer, cache_dir: str) -> np.ndarray:
    """The corpus's whole token stream, as its shards hold it."""
    source = prepare_tokens(corpus, TextEncoder(tokenizer, corpus.text_field), cache_dir, workers=1)
    return source.tokens(0, source.num_tokens)


def test_token_stream_of_parquet_matches_hand_computation(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    shards = [write_parquet(tmp_path / f"{i}.parquet", texts) for i, texts in enumerate([["ab"], ["c", "de"]])]
    tokens = load_token_stream(Corpus(",".join(map(str, shards))), char_tokenizer, str(tmp_path / "cache"))
    assert tokens.tolist() == [1, 97, 98, 2, 1, 99, 2, 1, 100, 101, 2]


def test_formats_do_not_mix(tmp_path: Path) -> None:
    """The line names a file of each format, the rarest first: a stray LICENSE.txt among shards."""
    for i in range(3):
        write_parquet(tmp_path / f"part-{i}.parquet", ["a"])
    (tmp_path / "LICENSE.txt").write_text("terms")
    with pytest.raises(ValueError) as error:
        local_corpus_files(str(tmp_path))
    assert str(error.value) == (
        f"dataset {tmp_path} mixes formats (text: 1 ({tmp_path / 'LICENSE.txt'}); "
        f"parquet: 3 ({tmp_path / 'part-0.parquet'}, ...)); give files of one format"
    )


def test_torchtitan_names_and_the_hub(tmp_path: Path) -> None:
    """torchtitan's 'c4' and 'c4_validation' are allenai/c4 'en' on the hub; other names that are
    no local path are hub names with this section's config and split."""
    config = load_config(["--training.dataset", "c4", "--validation.dataset", "c4_validation"])
    assert corpus_of(config.training) == Corpus("allenai/c4", "en", "train", "text")
    assert corpus_of(config.validation) == Corpus("allenai/c4", "en", "validation", "text")
    config = load_config(["--training.dataset", "org/data", "--training.dataset_config", "sub"])
    assert corpus_of(config.training) == Corpus("org/data", "sub", "train", "text")


def preflight_error(capsys: pytest.CaptureFixture, *options: str) -> str:
    """The one stderr line of programs.preflight's main for ``options`` (exit code 2)."""
    assert preflight.main(["--world-size", "1", *options]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    folder = tmp_path / "shards"
    for i in range(3):
        write_parquet(folder / f"part-{i}.parquet", [f"document {i}.{j}" for j in range(4)])
    return folder


def test_preflight_accepts_good_shards(shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    validation = write_parquet(tmp_path / "held_out" / "val.parquet", ["held out"])
    options = ["--validation.enable", "--validation.dataset", str(validation)]
    assert preflight.main(["--world-size", "1", "--training.dataset", str(shards), *options]) == 0
    assert capsys.readouterr().err == ""


def test_a_split_or_config_for_local_files_is_a_warning(shards: Path, caplog: pytest.LogCaptureFixture) -> None:
    options = ["--training.dataset", str(shards), "--training.dataset_split", "test"]
    with caplog.at_level("WARNING"):
        assert preflight.main(["--world-size", "1", *options]) == 0
        assert preflight.main(["--world-size", "1", "--training.dataset_config", "en"]) == 0
        assert preflight.main(["--world-size", "1", "--training.dataset", str(shards)]) == 0
        # Plain text has no records to take a field of; JSON lines and shards do.
        assert preflight.main(["--world-size", "1", "--training.dataset_text_field", "content"]) == 0
    assert [r.getMessage() for r in caplog.records if "hub dataset" in r.getMessage()] == [
        "no effect in this run: training.dataset_split (training.dataset is read whole, not a hub dataset)",
        "no effect in this run: training.dataset_config (training.dataset is read whole, not a hub dataset)",
        "no effect in this run: training.dataset_text_field (training.dataset is read whole, not a hub dataset)",
    ]


def test_validation_left_on_the_default_corpus_while_training_reads_another_is_a_warning(
    shards: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its loss would be of the Python documentation: a warning says so. Validation on training's
    own corpus (the default for both) scores windows training reads: a warning too."""
    with caplog.at_level("WARNING"):
        assert preflight.main(["--world-size", "1", "--validation.enable"]) == 0
        assert preflight.main(["--world-size", "1", "--training.dataset", str(shards), "--validation.enable"]) == 0
        held_out = ["--validation.enable", "--validation.dataset", str(shards / "part-2.parquet")]
        assert preflight.main(["--world-size", "1", "--training.dataset", str(shards), *held_out]) == 0
        assert preflight.main(["--world-size", "1", "--training.dataset", str(shards), "--validation.steps", "2"]) == 0
    assert [r.getMessage() for r in caplog.records if "validation.dataset" in r.getMessage()] == [
        "validation.dataset reads training's corpus (python_docs): the windows it scores are ones training reads "
        "too (its whole second epoch in the same order); give validation.dataset a held-out corpus",
        f"validation.dataset is python_docs while training.dataset is {shards}: the validation loss is of the "
        "Python documentation; give validation.dataset the held-out part of the training corpus",
    ]


def test_preflight_names_a_missing_shard(shards: Path, capsys: pytest.CaptureFixture) -> None:
    listed = f"{shards / 'part-0.parquet'},{shards / 'part-9.parquet'}"
    line = preflight_error(capsys, "--training.dataset", listed)
    assert line == f"error: training.dataset: dataset path not found: {shards / 'part-9.parquet'}"


def test_preflight_names_a_wrong_text_field_in_any_shard(shards: Path, capsys: pytest.CaptureFixture) -> None:
    line = preflight_error(capsys, "--training.dataset", str(shards), "--training.dataset_text_field", "body")
    assert line == f"error: training.dataset: {shards / 'part-0.parquet'}: no field 'body' (its fields: text, id)"
    write_parquet(shards / "part-1.parquet", ["x"], field="content")  # only the second shard lacks it
    line = preflight_error(capsys, "--validation.enable", "--validation.dataset", str(shards))
    assert line == f"error: validation.dataset: {shards / 'part-1.parquet'}: no field 'text' (its fields: content, id)"


def test_preflight_names_an_unreadable_shard(shards: Path, capsys: pytest.CaptureFixture) -> None:
    (shards / "part-2.parquet").write_bytes(b"not parquet at all")
    line = preflight_error(capsys, "--training.dataset", str(shards))
    assert line.startswith(f"error: training.dataset: {shards / 'part-2.parquet'}: unreadable parquet file (")


def test_preflight_names_a_field_that_is_not_text(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), path)
    line = preflight_error(capsys, "--training.dataset", str(path))
    assert line == f"error: training.dataset: {path}: field 'text' holds int64, not text"


def test_preflight_names_a_json_record_without_the_field(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "records.json"
    path.write_text(json.dumps({"content": "x"}) + "\n")
    line = preflight_error(capsys, "--training.dataset", str(path))
    assert line == f"error: training.dataset: {path}: record 0 has no field 'text' (its fields: content)"


def test_a_later_record_whose_text_is_null_is_named_as_such(tmp_path: Path) -> None:
    """The pre-launch check reads the first record; a later one is refused in the ranks, by what it holds."""
    path = tmp_path / "records.json"
    path.write_text(json.dumps({"text": "a document"}) + "\n" + json.dumps({"text": None, "id": 7}) + "\n")
    corpus = corpus_of(load_config(["--training.dataset", str(path)]).training)
    with pytest.raises(ValueError) as raised:
        list(corpus_texts(corpus))
    assert str(raised.value) == f"{path}: record 1's field 'text' is null, not text"


def test_preflight_says_when_the_hub_cannot_answer(capsys: pytest.CaptureFixture) -> None:
    """Without a network the hub is asked once, with no retries: one line, at once. (With a network
    the name does not exist there: one line too.)"""
    line = preflight_error(capsys, "--training.dataset", "tessera-test/no-such-dataset")
    assert line.startswith("error: training.dataset: 'tessera-test/no-such-dataset' is ")
    assert "Hugging Face hub" in line
    line = preflight_error(capsys, "--training.dataset", "c4_test")
    assert line.endswith(
        "tests/assets/c4_test ('c4_test' is torchtitan's; give local files with --training.dataset_path)"
    )


def test_torchtitans_c4_test_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """'c4_test' is the folder torchtitan's configs read from the working folder: C4's JSON lines
    in data.json, read through ``datasets``."""
    folder = tmp_path / "tests" / "assets" / "c4_test"
    folder.mkdir(parents=True)
    records = [{"text": f"c4 document {i}", "timestamp": "2019-04-25T00:00:00Z", "url": f"u{i}"} for i in range(3)]
    (folder / "data.json").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.chdir(tmp_path)
    corpus = corpus_of(load_config(["--training.dataset", "c4_test"]).training)
    assert list(corpus_texts(corpus)) == ["c4 document 0", "c4 document 1", "c4 document 2"]
    assert preflight.main(["--world-size", "1", "--training.dataset", "c4_test"]) == 0


def test_hub_dataset_is_streamed_at_the_commit_its_cache_key_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, char_tokenizer: CharTokenizer
) -> None:
    """No network here, so the hub and the library stand in: one question for the commit, then the
    split streamed at that commit with the config; the token cache follows the commit."""
    import huggingface_hub

    commits, calls = ["c1"], []

    def dataset_info(self, name, timeout=None):
        calls.append(("info", name, timeout))
        return huggingface_hub.hf_api.DatasetInfo(id=name, sha=commits[-1])

    def load_dataset(path, **options):
        calls.append(("load", path, options))
        return iter([{"content": "ab"}, {"content": "c"}])

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    corpus = Corpus("org/data", "sub", "test", "content")
    cache = str(tmp_path / "cache")
    assert load_token_stream(corpus, char_tokenizer, cache).tolist() == [1, 97, 98, 2, 1, 99, 2]
    options = {"streaming": True, "name": "sub", "split": "test", "revision": "c1"}
    assert calls == [("info", "org/data", 10), ("load", "org/data", options)]
    load_token_stream(corpus, char_tokenizer, cache)
    assert [call[0] for call in calls] == ["info", "load", "info"]  # same commit: the cached tokens
    commits.append("c2")
    load_token_stream(corpus, char_tokenizer, cache)
    assert calls[-1] == ("load", "org/data", {**options, "revision": "c2"})


def test_preflight_names_a_broken_json_shard_once(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """The library logs the error it raises; only the one line reaches the user."""
    path = tmp_path / "broken.json"
    path.write_text('{"text": "ok"}\n{not json\n')
    with caplog.at_level("WARNING"):
        line = preflight_error(capsys, "--training.dataset", str(path))
    assert line.startswith(f"error: training.dataset: {path}: ArrowInvalid: JSON parse error")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("datasets")] == []


def test_a_gzipped_shard_cut_short_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A C4 shard whose download stopped part way: gzip's EOFError was a traceback, before launch and
    in every rank of every attempt."""
    records = "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(2000))
    compressed = gzip.compress(records.encode())
    path = tmp_path / "c4-train.00000-of-01024.json.gz"
    path.write_bytes(compressed[: len(compressed) // 2])
    line = preflight_error(capsys, "--training.dataset", str(path))
    assert line.startswith(f"error: training.dataset: {path}: a compressed file ends early, cut short (EOFError: ")
    with pytest.raises(ValueError, match="cut short"):
        list(corpus_texts(Corpus(str(path))))
