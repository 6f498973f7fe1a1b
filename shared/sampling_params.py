"""How a request wants its tokens chosen. Crosses the gateway-worker wire inside GENERATE."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shared.errors import InvalidRequestError
from shared.wire_types import fields_of


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # divides positive logits of recent tokens (1 = off)
    repetition_window: int = 64  # how many recent tokens (prompt included) it looks at
    presence_penalty: float = 0.0  # OpenAI: subtract once per token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the completion
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_logprobs: int = 0  # how many alternatives to report per token (0 = none)
    logprobs: bool = False

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]"),
            (self.seed is None or -(2**63) <= self.seed < 2**64, "seed must fit in 64 bits"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    def to_wire(self) -> dict[str, Any]:
        data = asdict(self)
        data["logit_bias"] = [[int(k), float(v)] for k, v in self.logit_bias.items()]
        return data

    @classmethod
    def from_wire(cls, data: dict[str, Any], path: str = "") -> "SamplingParams":
        """From ``to_wire``'s map, every field type-checked (``path`` goes before the names in
        messages); WireTypeError or InvalidRequestError say what is wrong."""
        values = fields_of(cls, data, path, wire_types={"logit_bias": list[tuple[int, float]] | None})
        values["logit_bias"] = {token: float(bias) for token, bias in values.get("logit_bias") or []}
        return cls(**values)


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field unset samples with: the model file's
    recommended settings (its GGUF's ``general.sampling.*``), overridden by the worker's flags
    (``--temperature``, ``--top-p``, ``--top-k``, ``--min-p``, ``--repeat-penalty``). None: no
    recommendation, so the API's own default (SamplingParams') holds. The worker sends them in
    its MODEL_CARD; the gateway fills a request's unset fields from them, where it still knows
    which fields the request set."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def given(self) -> dict[str, float | int]:
        """The recommended values, by SamplingParams' field names."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    def over(self, fallback: SamplingDefaults) -> SamplingDefaults:
        """These values where given, else ``fallback``'s (the command line over the file)."""
        return SamplingDefaults(**{**fallback.given(), **self.given()})

    def params(self, **request: Any) -> SamplingParams:
        """A request's SamplingParams: the fields it set (None: unset) as it set them, each unset
        one from these defaults, else the API's. A top_p of 0 would leave no token to sample:
        the smallest positive value stands for it (greedy)."""
        chosen = {**self.given(), **{name: value for name, value in request.items() if value is not None}}
        if chosen.get("top_p") == 0:
            chosen["top_p"] = 1e-9
        return SamplingParams(**chosen)
