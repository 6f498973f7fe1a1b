"""The pool of resident KV caches (``--kv-slots``) and the prefix-reuse choice among them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from shared.prefix_digest import prefix_digests
from worker.engine.kv_cache import KVCache
from worker.engine.model import DecoderModel


# A slot holding at least this many tokens past the prefix a new prompt shares with it holds
# another conversation: the shared prefix is copied out rather than the slot cut back.
FORK_MIN_TOKENS = 64


def resident_slot_count(kv_slots: int, batch: int) -> int:
    """Resident KV caches: --kv-slots, raised to --batch, since every stream of a batch holds one."""
    return max(kv_slots, batch)


@dataclass
class Slot:
    index: int
    cache: KVCache
    busy: bool = False
    last_used: int = 0
    session: str | None = None  # a client's cache-affinity hint, if it sent one
    namespace: str = ""  # whose cached prefixes the slot holds (a tenant's, with several API keys)


@dataclass
class SlotChoice:
    slot: Slot
    reused_tokens: int  # leading prompt tokens whose KV the slot already holds


@dataclass
class SlotPool:
    model: DecoderModel
    n_slots: int
    max_tokens: int
    # positions (of every layer, windows for sliding ones) all caches may hold together before
    # idle ones are dropped, least recently used first (0: no such limit). Running streams are
    # never cut: each may still grow to ``max_tokens``.
    budget_tokens: int = 0
    slots: list[Slot] = field(default_factory=list)
    _clock: itertools.count = field(default_factory=itertools.count)
    dropped: int = 0  # idle caches dropped to keep within the budget

    def __post_init__(self) -> None:
        self.slots = [Slot(i, self.model.new_cache(self.max_tokens)) for i in range(self.n_slots)]

    def free_count(self) -> int:
        return sum(not s.busy for s in self.slots)

    def acquire(self, prompt: list[int], session: str | None = None, floor: int = 0,
                namespace: str = "") -> SlotChoice | None:
        """The free slot sharing the longest prefix with ``prompt``; else the least recently used.

        Ties on prefix length go to the slot of the same session, then to the most recent one.
        The slot's cache is truncated to the reused prefix; at least one prompt token is always
        left to compute, because the next token's logits come from it. ``floor``: the leading
        tokens every cache holds alike (a cartridge's): sharing no more than those is sharing
        nothing, so the least recently used slot is taken, keeping at most those.

        When the best slot holds another conversation past the shared prefix (a system prompt
        many conversations start with), truncating it would throw that conversation away: the
        shared prefix is copied into the least recently used slot instead, and the other
        conversation stays whole.

        A slot of another ``namespace`` shares nothing with the prompt but the ``floor`` (which
        the operator put there for all): one tenant never reuses, nor times, another's prompts.
        """
        free = [s for s in self.slots if not s.busy]
        if not free:
            return None

        def shared(slot: Slot) -> int:
            common = slot.cache.common_prefix(prompt)
            return common if slot.namespace == namespace else min(common, floor)

        def score(slot: Slot) -> tuple[int, bool, int]:
            return shared(slot), session is not None and slot.session == session, slot.last_used

        best = max(free, key=score)
        reused = min(shared(best), len(prompt) - 1)
        oldest = min(free, key=lambda s: s.last_used)
        if reused <= floor:
            best = oldest
            reused = min(best.cache.common_prefix(prompt), floor, len(prompt) - 1)
        elif (oldest is not best and best.cache.rewindable and best.cache.length - reused >= FORK_MIN_TOKENS
              and (session is None or best.session != session)):  # the same session's older turn goes
            oldest.cache.copy_prefix(best.cache, reused)
            best = oldest
        best.cache.truncate(reused)
        self._make_room(best, len(prompt))
        best.busy = True
        best.session = session
        best.namespace = namespace
        best.last_used = next(self._clock)
        # a cache that cannot be cut back (recurrent state) kept all of it or nothing: the
        # exact prompt again keeps nothing, since one token must be computed
        return SlotChoice(best, best.cache.length)

    def _make_room(self, taken: Slot, prompt_tokens: int) -> None:
        """Drop idle caches, least recently used first, while all caches together with ``taken``
        holding the prompt would exceed the budget: one conversation's long prompt does not sit
        beside every earlier one's KV (a kvstore still holds their whole chunks)."""
        if not self.budget_tokens:
            return
        budget = taken.cache.full_bytes(self.budget_tokens)
        held = taken.cache.full_bytes(max(taken.cache.written, prompt_tokens)) + \
            sum(slot.cache.resident_bytes for slot in self.slots if slot is not taken)
        idle = sorted((slot for slot in self.slots if not slot.busy and slot is not taken and slot.cache.written),
                      key=lambda slot: slot.last_used)
        for slot in idle:
            if held <= budget:
                return
            held -= slot.cache.resident_bytes
            slot.cache.clear()
            slot.session = None
            self.dropped += 1

    def digests(self) -> list[bytes]:
        """What the slots hold, as the prefix digests gateways route by (conversation tokens
        only: a cartridge's pseudo-ids, alike in every slot, are left out)."""
        held: dict[bytes, None] = {}
        for slot in self.slots:
            tokens = slot.cache.tokens[:]  # a copy, taken whole while the engine thread works on
            skip = next((i for i, t in enumerate(tokens) if t >= 0), len(tokens))  # pseudo-ids lead
            held.update(dict.fromkeys(prefix_digests(tokens[skip:])))
        return list(held)

    def release(self, slot: Slot) -> None:
        slot.busy = False
        slot.last_used = next(self._clock)
