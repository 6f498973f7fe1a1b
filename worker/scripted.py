"""Scripted replies (``--scripted-replies FILE``): a test input, never a way to serve users.

A random-weight model chooses nothing useful, so the tests of tool calling and reasoning need
the model to say given tokens while everything else stays real: the prompt is prefilled, every
step runs the engine's forward pass and the logits are computed (logprobs come from them), but
the token chosen at each step is the next one of a scripted reply, and after the reply the model's
end-of-turn token.

The file is a JSON list of replies. A reply is a list of token ids, or an object with either
``"ids": [...]`` or ``"text": "..."`` (tokenized with the model's tokenizer when the worker
starts, special-token text such as ``<tool_call>`` becoming its id), and optionally
``"when": "MARKER"``, and ``"then": "sample"``: when the scripted tokens are said, the model
goes on by itself, sampled as usual (under the request's grammar, if it has one), instead of
ending its turn. Which reply a request gets:

- the keyed reply whose marker occurs latest in the decoded prompt (a marker in the newest
  message wins over one in the history, so a conversation can move from reply to reply);
- when no marker occurs, the next unkeyed reply, in file order, cycling.

The choice is made when the request's first token is chosen, so a request refused as busy or
invalid consumes nothing.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import LmserveError
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from worker.engine.sampling import SampledToken, Sampler


@dataclass(frozen=True)
class ScriptedReply:
    ids: tuple[int, ...]
    when: str | None = None  # a marker the prompt must contain; None: taken in turn
    then_sample: bool = False  # after the ids the model goes on by itself, instead of ending


class ScriptedReplies:
    """The replies of one script file and the turn of its unkeyed replies (shared by all requests)."""

    def __init__(self, replies: list[ScriptedReply], end_id: int, tokenizer: Tokenizer):
        if not replies:
            raise LmserveError("the scripted replies file holds no replies")
        self.replies = replies
        self.end_id = end_id
        self.tokenizer = tokenizer
        self._unkeyed = [reply for reply in replies if reply.when is None]
        self._next = 0
        self._lock = threading.Lock()  # the turn is shared by every request, whichever thread asks

    @classmethod
    def load(cls, path: str | Path, tokenizer: Tokenizer) -> ScriptedReplies:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise LmserveError(f"cannot read the scripted replies file {path}: {exc}") from exc
        if not isinstance(raw, list):
            raise LmserveError(f"the scripted replies file {path} must hold a JSON list of replies")
        replies = [_reply(entry, i, tokenizer) for i, entry in enumerate(raw)]
        for reply in replies:
            if any(not 0 <= token < tokenizer.vocab_size for token in reply.ids):
                raise LmserveError(f"a scripted reply has a token id outside 0..{tokenizer.vocab_size - 1}")
        return cls(replies, end_of_turn_id(tokenizer), tokenizer)

    def take(self, prompt: list[int]) -> ScriptedReply:
        """The reply for a request with this prompt (see the module docstring for the rule)."""
        keyed = [reply for reply in self.replies if reply.when is not None]
        if keyed:
            text = self.tokenizer.decode(prompt)
            found = [(text.rfind(reply.when), reply) for reply in keyed if reply.when in text]
            if found:
                return max(found, key=lambda hit: hit[0])[1]
        with self._lock:
            if not self._unkeyed:
                return ScriptedReply(())  # only keyed replies, none matched: end the turn at once
            reply = self._unkeyed[self._next % len(self._unkeyed)]
            self._next += 1
        return reply

    def sampler(self, params: SamplingParams, prompt: list[int]) -> ScriptedSampler:
        return ScriptedSampler(params, prompt, self)


class ScriptedSampler(Sampler):
    """A Sampler that reports logprobs from the real logits but picks the script's next token."""

    def __init__(self, params: SamplingParams, prompt: list[int], script: ScriptedReplies):
        super().__init__(params, prompt)
        self.script = script
        self.prompt = list(prompt)
        self.queue: deque[int] | None = None  # chosen at the first step, in the order streams start
        self.then_sample = False

    greedy = False  # the script chooses, from the logits' rows

    def sample(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> SampledToken:
        queue = self.reply()
        if not queue and self.then_sample:
            return super().sample(logits, allowed)
        return super().force(logits, queue.popleft() if queue else self.script.end_id, allowed)

    def force(self, logits: np.ndarray, token: int, allowed: np.ndarray | None = None) -> SampledToken:
        """A token the worker forces (a reasoning budget's closing marker) cuts the script's
        reasoning short: the script skips to just after its own writing of that token, so the
        answer it scripted follows the forced close (a script that never writes the token is
        over: the model goes on by itself, or ends its turn)."""
        queue = self.reply()
        while queue and queue.popleft() != token:
            pass
        return super().force(logits, token, allowed)

    def reply(self) -> deque[int]:
        """The scripted tokens still to say (the reply is chosen at the first step)."""
        if self.queue is None:
            reply = self.script.take(self.prompt)
            self.queue, self.then_sample = deque(reply.ids), reply.then_sample
        return self.queue


def end_of_turn_id(tokenizer: Tokenizer) -> int:
    """The token a scripted reply ends with: the vocabulary's EOS when it ends a turn, else
    the lowest of its end-of-turn ids (either stops the stream the same way)."""
    if tokenizer.eos_id is not None and tokenizer.eos_id in tokenizer.stop_ids:
        return tokenizer.eos_id
    if not tokenizer.stop_ids:
        raise LmserveError("the model's vocabulary has no end-of-turn token to end a scripted reply with")
    return min(tokenizer.stop_ids)


def _reply(entry: Any, i: int, tokenizer: Tokenizer) -> ScriptedReply:
    where = f"scripted reply {i}"
    if isinstance(entry, list):
        return ScriptedReply(_ids(entry, where))
    if not isinstance(entry, dict) or ("text" in entry) == ("ids" in entry):
        raise LmserveError(f"{where} must be a list of token ids or an object with 'text' or 'ids'")
    when = entry.get("when")
    if when is not None and (not isinstance(when, str) or not when):
        raise LmserveError(f"{where}: 'when' must be a non-empty string")
    then = entry.get("then", "end")
    if then not in ("end", "sample"):
        raise LmserveError(f"{where}: 'then' must be \"end\" or \"sample\", got {then!r}")
    if "ids" in entry:
        return ScriptedReply(_ids(entry["ids"], where), when, then == "sample")
    if not isinstance(entry["text"], str):
        raise LmserveError(f"{where}: 'text' must be a string")
    return ScriptedReply(tuple(tokenizer.encode(entry["text"], add_special=False)), when, then == "sample")


def _ids(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise LmserveError(f"{where} must be a list of integer token ids")
    return tuple(value)
