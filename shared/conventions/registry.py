"""The registry of conventions, in detection order: the built-in ones, which
``shared/conventions/__init__.py`` lists, and any a plug-in adds with ``register``.

It imports no convention. The conventions describe their markers with ``shared.protocol``'s
Tags, and ``shared.protocol`` checks a card's convention here only when a card is built, by
then with the package (and so every built-in convention) imported: no import runs in a circle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.chat_template import ChatTemplate
    from shared.conventions.base import Convention
    from shared.tokenizer import Tokenizer

CONVENTIONS: dict[str, Convention] = {}  # by name, in the order the worker tries them


class UnknownConvention(ValueError):
    """A name no registered convention has: a worker and a gateway of other releases, or a
    plug-in registered in one process and not the other."""

    def __init__(self, name: str):
        self.message = (f"the model follows the reply convention {name!r}, which this process does not know "
                        f"(it knows {', '.join(CONVENTIONS)}); run the same lmserve release, with the same "
                        f"conventions registered, in the gateway and the worker")
        super().__init__(self.message)


def get(name: str) -> Convention:
    """The convention of this name; UnknownConvention when none is registered under it."""
    found = CONVENTIONS.get(name)
    if found is None:
        raise UnknownConvention(name)
    return found


def detect(tokenizer: Tokenizer, template: ChatTemplate | None = None) -> Convention:
    """The convention a model with this vocabulary and template follows: the first to claim it."""
    return next(convention for convention in CONVENTIONS.values() if convention.detects(tokenizer, template))


def register(convention: Convention, before: str | None = None) -> Convention:
    """Add a convention ahead of the one named ``before``, by default ahead of all (a new
    convention's markers are its own, so it is asked first); one of a name already registered
    replaces it."""
    if before is not None and before not in CONVENTIONS:
        raise UnknownConvention(before)
    entries = [(name, known) for name, known in CONVENTIONS.items() if name != convention.name]
    at = next((i for i, (name, _) in enumerate(entries) if name == before), 0)
    entries.insert(at, (convention.name, convention))
    CONVENTIONS.clear()
    CONVENTIONS.update(entries)
    return convention


def unregister(name: str) -> None:
    """Take a registered convention out (a test's own, when it is done)."""
    CONVENTIONS.pop(name, None)
