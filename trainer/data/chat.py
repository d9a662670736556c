"""Chat data: records of ``messages`` (role, content) rendered with the tokenizer folder's chat template as
transformers' ``apply_chat_template`` renders them, with a loss mask that makes the assistant's messages the
only training targets."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from config.errors import first_line
from trainer.data.tokenizer import HF_CONFIG_FILE, HuggingFaceTokenizer, hf_tokenizer_files

# The file beside tokenizer.json that holds the template; it wins over tokenizer_config.json's entry.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The roles a record's messages may take: a template such as Llama 3's renders any role, so a misspelt one
# would otherwise train silently as a non-target turn.
CHAT_ROLES = ("system", "user", "assistant", "tool")
TARGET_ROLE = "assistant"
# tokenizer_config.json entries a template sees as variables (transformers' named special tokens).
_TEMPLATE_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Part of the fingerprint: bump when the records-to-tokens mapping of this module changes.
_CHAT_FORMAT_VERSION = b"tessera-chat-v1"


class ChatEncoder:
    """Encodes ``messages`` lists for token shards: ids of the rendered conversation, and a mask that is 1 on
    the tokens of each assistant message's text and of what the template writes after it (its end-of-turn
    token), 0 elsewhere (headers, other roles, the template's preamble)."""

    field = "messages"

    def __init__(self, tokenizer_path: str) -> None:
        if not (os.path.isdir(tokenizer_path) or tokenizer_path.endswith(".json")):
            raise ValueError(
                f"chat data (training.dataset_format = 'chat') needs a Hugging Face tokenizer folder with a chat "
                f"template as model.tokenizer_path, not {tokenizer_path or 'the default tokenizer'}"
            )
        json_path, config_path = hf_tokenizer_files(tokenizer_path)
        self.tokenizer = HuggingFaceTokenizer(json_path)
        self.vocab_size = self.tokenizer.vocab_size
        config = json.loads(Path(config_path).read_bytes()) if os.path.isfile(config_path) else {}
        self.template = _chat_template(os.path.dirname(json_path), config)
        self.template_tokens = {key: _token_content(config[key]) for key in _TEMPLATE_TOKEN_KEYS if config.get(key)}
        try:
            _compiled_template(self.template)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(
                f"the chat template of {os.path.dirname(json_path) or '.'} does not parse: "
                f"line {error.lineno}: {first_line(error)}"
            ) from None
        digest = hashlib.sha256(_CHAT_FORMAT_VERSION)
        for part in (self.tokenizer.fingerprint, self.template, json.dumps(self.template_tokens), *CHAT_ROLES):
            digest.update(hashlib.sha256(part.encode()).digest())
        self.fingerprint = digest.hexdigest()

    def encode_batch(self, values: list[Any], where: list[str]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        rendered = [self._render_with_targets(value, place) for value, place in zip(values, where)]
        encoded = self.tokenizer.encode_rendered_chats([text for text, _ in rendered])
        return [
            (np.asarray(ids, dtype=np.int64), _mask_of_spans(offsets, spans))
            for (ids, offsets), (_, spans) in zip(encoded, rendered)
        ]

    def _render_with_targets(self, value: Any, where: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant messages.

        A message's span is found by rendering the conversation up to it: it starts where the conversation
        before it, with the template's generation prompt (the assistant's header), ends, and it ends where the
        conversation through it ends. Character offsets, not token counts, carry the spans to the tokens, so a
        boundary inside a token (text merged across it) still marks that token."""
        messages = _checked_messages(value, where)
        text = self._render(messages, where)
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != TARGET_ROLE:
                continue
            through = text if index == len(messages) - 1 else self._render(messages[: index + 1], where)
            if not text.startswith(through):
                raise ValueError(
                    f"{where}: the chat template renders messages[{index}] differently once later messages "
                    "follow, so its tokens cannot be located"
                )
            spans.append((self._target_start(messages[:index], through), len(through)))
        return text, spans

    def _target_start(self, before: list[dict[str, Any]], through: str) -> int:
        """Where an assistant message's targets start: after its header when the template's generation prompt
        writes that header, else after the previous message (or at 0 when the template cannot render what
        comes before)."""
        for add_generation_prompt in (True, False):
            try:
                prefix = _compiled_template(self.template).render(
                    _template_variables(before, self.template_tokens, add_generation_prompt)
                )
            except Exception:  # a template may refuse an empty conversation or one ending with the user's turn
                continue
            if through.startswith(prefix):
                return len(prefix)
        return 0

    def encode_prompt(self, value: Any, where: str) -> list[int]:
        """Ids of a conversation rendered with the template's generation prompt (the assistant's header), for a
        model to continue, as transformers' ``apply_chat_template(add_generation_prompt=True)`` gives them."""
        text = self._render(_checked_messages(value, where), where, add_generation_prompt=True)
        return self.tokenizer.encode_rendered_chats([text])[0][0]

    def _render(self, messages: list[dict[str, Any]], where: str, add_generation_prompt: bool = False) -> str:
        variables = _template_variables(messages, self.template_tokens, add_generation_prompt)
        try:
            return _compiled_template(self.template).render(variables)
        except jinja2.TemplateError as error:  # raise_exception's, an undefined value, a sandbox refusal
            raise ValueError(f"{where}: the chat template refuses this conversation: {first_line(error)}") from None
        except Exception as error:  # the template's own expressions failing on this record's values
            raise ValueError(f"{where}: the chat template fails on this conversation: {first_line(error)}") from None


def _template_variables(
    messages: list[dict[str, Any]], template_tokens: dict[str, str], add_generation_prompt: bool = False
) -> dict[str, Any]:
    """What transformers hands a template: the messages, no tools or documents, the generation prompt flag,
    and the named special tokens."""
    return {
        "messages": messages,
        "tools": None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
        **template_tokens,
    }


def _checked_messages(value: Any, where: str) -> list[dict[str, Any]]:
    """The messages of a record, keys holding null dropped (as transformers drops them)."""
    if value is None:
        raise ValueError(f"{where}: the record has no 'messages'")
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"{where}: 'messages' is {_described(value)}, not a non-empty list of {{role, content}} objects"
        )
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: messages[{index}] is {_described(message)}, not a {{role, content}} object")
        message = {key: item for key, item in message.items() if item is not None}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                held = _described(message[key]) if key in message else "missing"
                raise ValueError(f"{where}: messages[{index}]'s {key!r} is {held}, not a string")
        if message["role"] not in CHAT_ROLES:
            raise ValueError(
                f"{where}: messages[{index}] has the role {message['role']!r}; chat data takes {', '.join(CHAT_ROLES)}"
            )
        messages.append(message)
    return messages


def _described(value: Any) -> str:
    if value == []:
        return "an empty list"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _mask_of_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 on every token whose characters overlap a span (transformers' rule for its assistant masks)."""
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(bounds), dtype=bool)
    for start, end in spans:
        mask |= (bounds[:, 1] > start) & (bounds[:, 0] < end)
    return mask


def _chat_template(folder: str, config: dict[str, Any]) -> str:
    """The folder's template: chat_template.jinja, else tokenizer_config.json's (its "default" when named)."""
    template_path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.isfile(template_path):
        return Path(template_path).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise ValueError(
            f"tokenizer folder {folder or '.'} has no chat template ({HF_CONFIG_FILE}'s chat_template or "
            f"{CHAT_TEMPLATE_FILE}), which training.dataset_format = 'chat' needs"
        )
    return template


def _token_content(entry: Any) -> str:
    """A special token's text: tokenizer_config.json gives a string or an ``{"content": ...}`` object."""
    return str(entry.get("content")) if isinstance(entry, dict) else str(entry)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' mark of the assistant's text renders as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        line = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(line)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Unlike jinja's own filter: no HTML escaping, non-ASCII kept.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str) -> jinja2.Template:
    """The template in the environment transformers renders chat templates in: sandboxed, block tags taking
    their line's whitespace and newline, loop controls, and the helpers templates call."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)
