"""Which KV prefix a request is served behind: the cartridges it names (by name or id), composed
in its order; else the worker's default one; else, on a worker serving a fleet, the fleet's
choice for its conversation (made on the engine thread, where forward passes belong).

Compositions are made once and a few are kept, most recently used last."""

from __future__ import annotations

import threading

from shared.errors import InvalidRequestError
from shared.protocol import Generate
from worker.cartridges.cartridge import Cartridge, compose
from worker.cartridges.fleet import Fleet
from worker.engine import Engine

MAX_COMPOSITIONS = 16  # compositions of named cartridges kept made


class CartridgeChoice:
    def __init__(self, engine: Engine, default: Cartridge | None = None, library: list[Cartridge] | None = None,
                 fleet: Fleet | None = None):
        self.engine = engine
        self.default = default
        self.fleet = fleet
        fleet_parts = list(fleet.cartridges.values()) if fleet is not None else []
        # every cartridge a request may name, by name: the default first, a fleet's last
        self.available = {c.name: c for c in ([default] if default is not None else []) + (library or []) + fleet_parts}
        self.lock = threading.Lock()
        self.compositions: dict[tuple[str, ...], Cartridge] = {}

    @property
    def prefix(self) -> int:
        """Cache positions the default cartridge (or a fleet's largest choice) takes before each
        conversation's own."""
        if self.fleet is not None:
            return self.fleet.prefix_tokens
        return self.default.tokens if self.default is not None else 0

    def left_to_fleet(self, request: Generate) -> bool:
        """Whether the fleet chooses this request's cartridges (it names none)."""
        return not request.cartridge_ids and self.fleet is not None

    def named(self, request: Generate) -> Cartridge | None:
        """The prefix a request is served behind, as far as it is known on arrival: None where
        there is none, or where the fleet will choose (its query is checked here)."""
        if self.left_to_fleet(request):
            if not all(0 <= t < self.fleet.vocab for t in request.query):
                raise InvalidRequestError(f"query must be token ids in 0..{self.fleet.vocab - 1}")
            return None
        if not request.cartridge_ids:
            return self.default
        parts = []
        for name in request.cartridge_ids:
            found = next((c for c in self.available.values() if name in (c.name, c.cartridge_id)), None)
            if found is None:
                raise InvalidRequestError(f"unknown cartridge {name!r}: this worker serves "
                                          f"{', '.join(map(repr, self.available)) or 'none'} (--cartridge, --cartridges)",
                                          param="cartridges")
            if found in parts:
                raise InvalidRequestError(f"cartridge {name!r} is named twice", param="cartridges")
            parts.append(found)
        return self.composed(parts)

    def chosen(self, request: Generate) -> Cartridge:
        """Engine thread: the fleet's choice for a request's conversation, composed."""
        # a tenant's conversations are its own: another's session id recalls none of its choices
        conversation = request.conversation and "\0".join(filter(None, (request.namespace, request.conversation)))
        names = self.fleet.choose(conversation, request.query)
        return self.composed([self.fleet.cartridges[n] for n in names])

    def composed(self, parts: list[Cartridge]) -> Cartridge:
        """The composition of these parts in this order, made once and kept (a few of them)."""
        key = tuple(p.cartridge_id for p in parts)
        with self.lock:
            made = self.compositions.pop(key, None)
        if made is None:
            made = compose(parts, self.engine)
        with self.lock:
            self.compositions[key] = made  # most recently used last
            while len(self.compositions) > MAX_COMPOSITIONS:
                del self.compositions[next(iter(self.compositions))]
        return made
