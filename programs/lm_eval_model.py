"""A Tessera checkpoint as an lm-evaluation-harness model ("tessera"): a DCP checkpoint of a run (at any
layout) or a Hugging Face folder, loaded into one process and scored by trainer/evaluate.py.

lm_eval finds no models outside its own package, so this module registers the class and runs lm_eval's
command line: ``python -m programs.lm_eval_model --model tessera --model_args checkpoint=...,config=...``
takes lm_eval's options. In Python, importing this module registers "tessera" for ``lm_eval.simple_evaluate``.
"""

from __future__ import annotations

import json
import os
import sys

# lm_eval adds its own models to the registry only while it is empty: they go in before "tessera".
import lm_eval.models  # noqa: F401
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from config.errors import ConfigError
from config.job_config import RESOLVED_CONFIG_FILE
from config.manager import load_config
from models.llama3 import Transformer
from models.sizes import CONFIG_NAME, is_hf_folder, job_model_args, read_hf_config
from trainer.checkpoint.state import load_model_weights
from trainer.data.tokenizer import Tokenizer, build_tokenizer
from trainer.evaluate import Request, loglikelihoods
from trainer.evaluate_generation import continuations, generation_prompt

MAX_GEN_TOKS = 256  # the HF backend's, for a request that names none
DEFAULT_MAX_LENGTH = 2048  # lm_eval's HF backend's, for a folder whose config.json gives no context length


def load_model(checkpoint: str, config: str = "", max_length: int | None = None) -> tuple[Transformer, Tokenizer]:
    """The model and tokenizer of an HF folder, or of a run's DCP checkpoint folder (step-N) with the run's
    config.toml (``config``; by default the one in the run's folder, two levels up)."""
    if is_hf_folder(checkpoint):
        length = max_length or read_hf_config(checkpoint).get("max_position_embeddings") or DEFAULT_MAX_LENGTH
        options = ["--checkpoint.initial_load_path", checkpoint, "--model.tokenizer_path", checkpoint]
        job = load_config([*options, "--training.seq_len", str(length)])
    elif os.path.isfile(os.path.join(checkpoint, ".metadata")):
        config = config or os.path.join(checkpoint, os.pardir, os.pardir, RESOLVED_CONFIG_FILE)
        if not os.path.isfile(config):
            raise ConfigError(f"config={config}: not a file; name the run's config.toml of checkpoint={checkpoint}")
        job = load_config(["--job.config_file", config, *(["--training.seq_len", str(max_length)] * bool(max_length))])
    else:
        raise ConfigError(
            f"checkpoint={checkpoint}: neither a Hugging Face folder ({CONFIG_NAME} and safetensors) "
            "nor a DCP checkpoint folder (.metadata)"
        )
    tokenizer = build_tokenizer(job.model.tokenizer_path, job.job.cache_dir, job.model.default_tokenizer_vocab_size)
    model = Transformer(job_model_args(job, tokenizer.vocab_size))
    load_model_weights(model, checkpoint)
    return model.eval(), tokenizer


@register_model("tessera")
class TesseraLM(TemplateLM):
    """lm_eval's LM over a Tessera checkpoint. model_args: checkpoint (an HF folder or a DCP step folder),
    config (the run's config.toml of a DCP checkpoint), max_length (tokens; by default the run's
    training.seq_len or the folder's max_position_embeddings), add_bos (begin each context with BOS)."""

    def __init__(
        self,
        checkpoint: str,
        config: str = "",
        max_length: int | None = None,
        add_bos: bool = False,
        batch_size: int | str | None = 8,
        device: str | None = None,
        **_: object,
    ) -> None:
        super().__init__()
        self.model, self.tokenizer = load_model(checkpoint, config, int(max_length) if max_length else None)
        self._device = torch.device(device or "cpu")
        self.model.to(self._device)
        self.max_length = self.model.args.max_seq_len
        self.add_bos = str(add_bos).lower() in ("true", "1")
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # "auto" is the harness's HF search

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id  # an empty context's, as the HF backend's with a BOS token

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_: object) -> list[int]:
        return self.tokenizer.encode(string, bos=self.add_bos and add_special_tokens is not False)

    def _score(self, requests: list[Request]) -> tuple[list[float], list[bool]]:
        return loglikelihoods(self.model, requests, self.max_length, self.batch_size, self._device)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_: object) -> list[tuple[float, bool]]:
        sums, greedy = self._score([(context, continuation) for _, context, continuation in requests])
        return list(zip(sums, greedy))

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """The harness's disjoint windows of max_length tokens, each after the one token before it."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            tokens = self.tok_encode(text)
            rolling = get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1)
            for window in map(make_disjoint_window, rolling):
                windows.append(window)
                owners.append(index)
        sums, _ = self._score(windows)
        totals = [0.0] * len(requests)
        for owner, value in zip(owners, sums):
            totals[owner] += value
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation as the harness's HF backend makes it: up to max_gen_toks tokens (256
        by default) after the context's last max_length - max_gen_toks, greedy unless do_sample (then
        drawn at its temperature, top_k and top_p), ending at EOS, cut at the first of ``until``; the
        requests of the same gen_kwargs batch_size a generation."""
        texts: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], MAX_GEN_TOKS)
            limit = kwargs["max_gen_toks"]
            if limit >= self.max_length:
                raise ConfigError(f"max_gen_toks {limit} must be below the model's max_length {self.max_length}")
            sample = bool(kwargs.get("do_sample"))
            contexts = [requests[i].args[0] for i in indices]
            outputs = continuations(
                self.model,
                self.tokenizer,
                [generation_prompt(self.tokenizer, c, self.add_bos, self.max_length - limit) for c in contexts],
                [list(kwargs["until"])] * len(indices),
                max_new_tokens=limit,
                batch_size=self.batch_size,
                temperature=float(kwargs.get("temperature") or 0.0) if sample else 0.0,
                top_k=int(kwargs.get("top_k") or 0),
                top_p=float(kwargs.get("top_p") or 1.0),
            )
            for index, text in zip(indices, outputs):
                texts[index] = text
        return texts


def main(argv: list[str]) -> None:
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main(sys.argv[1:])
