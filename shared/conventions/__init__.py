"""The conventions a model may follow in its replies.

Each convention is a module of this package declaring one ``Convention`` (``base.py``): how the
worker recognizes it in a vocabulary and template, its markers, how a reply splits into
reasoning and text, how its call blocks read, the grammar that forces a call, and how a request
switches its thinking. The registry (``registry.py``) holds them in the order the worker tries
them; the first whose ``detects`` says yes is the model's, and its name travels in the
MODEL_CARD (``Capabilities.convention``), which a gateway reads back with ``get``.
"""

from __future__ import annotations

from shared.conventions import gemma4, hermes, inkling, nanochat, qwen_xml
from shared.conventions.base import Convention
from shared.conventions.registry import CONVENTIONS, UnknownConvention, detect, get, register, unregister

__all__ = ["CONVENTIONS", "Convention", "UnknownConvention", "detect", "get", "register", "unregister"]

# The built-in conventions, in detection order: qwen_xml ahead of Hermes, whose markers it
# shares (its template tells it apart); Hermes, which claims whatever is left, last.
CONVENTIONS.update((convention.name, convention) for convention in (
    inkling.INKLING,
    gemma4.GEMMA4,
    nanochat.NANOCHAT,
    qwen_xml.QWEN_XML,
    hermes.HERMES,
))
