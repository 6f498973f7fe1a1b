"""What a worker drafts with (``--spec``, ``--spec-max``): the settings alone, which the flags
read without the drafters' machinery (``worker/speculation.py``, whose ``drafter`` makes a
stream's drafter from them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NGRAM, DRAFT, MTP = "ngram", "draft", "mtp"
KINDS = (NGRAM, DRAFT, MTP)  # the drafters this worker has


@dataclass
class SpeculationSettings:
    kinds: tuple[str, ...] = (NGRAM,)  # what drafts, in order of preference; () is off
    max_draft: int = 16  # drafted tokens per pass at most (--spec-max)
    draft_engine: Any = None  # DRAFT: the draft model's Engine (worker/engine), of the same vocabulary
    model: Any = None  # MTP: the served model, which holds the MTP block

    @property
    def on(self) -> bool:
        return bool(self.kinds) and self.max_draft > 0
