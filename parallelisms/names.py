"""Parameter and module names as the model defines them, without the segments wrappers insert."""

from __future__ import annotations

import re

# Activation checkpointing's and torch.compile's wrapper modules.
_WRAPPER_SEGMENT = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod)(?=\.|$)")


def clean_name(name: str) -> str:
    """``name`` (a parameter or module path) with every wrapper segment removed."""
    return _WRAPPER_SEGMENT.sub("", name).strip(".")
