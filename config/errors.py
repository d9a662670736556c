"""The one user-error type, the one-line messages every program reports mistakes in, and the ranks' console."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator


class ConfigError(ValueError):
    """A user error in the configuration: reported as one line, without a traceback."""


def init_console_logging() -> None:
    """Timed log lines on the console: INFO from rank 0 (torchrun's RANK, or a lone process), warnings and
    errors from every rank."""
    logging.basicConfig(
        level=logging.INFO if int(os.environ.get("RANK", 0)) == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )


def print_error(message: object) -> None:
    """``error: <message>`` on stderr in one write: print()'s two, unbuffered, let another rank's output split it."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def first_line(error: BaseException) -> str:
    """An error's first line, for a one-line message (its type's name when it says nothing)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def first_few(items: list[str], limit: int = 4) -> str:
    """The first ``limit`` of ``items``, and how many more, for a one-line message."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def typed_first_line(error: BaseException) -> str:
    """'Type: first line' of an error, or its type's name alone when it says nothing."""
    return f"{type(error).__name__}: {first_line(error)}" if str(error).strip() else type(error).__name__


@contextlib.contextmanager
def user_input(option: str = "") -> Iterator[None]:
    """A ValueError or OSError raised while acting on ``option``'s value as a one-line ConfigError: code below the
    config raises them naming what is wrong; the code that hands it a config value wraps the call in this."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, OSError) as e:
        raise ConfigError(f"{option}: {e}" if option else str(e)) from None
