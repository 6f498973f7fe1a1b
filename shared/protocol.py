"""The whole contract between gateways and the worker.

Transport: ZeroMQ. The worker binds a ROUTER; each gateway process connects a DEALER. A
message is ``[type, body, *raw]``: a one-byte type frame, a msgpack body, and for GENERATE the
prompt token ids as one raw little-endian int32 frame (prompts run to tens of thousands of
ids; a raw frame costs no per-item encoding); EMBED's inputs and EMBEDDINGS' vectors travel the
same way (int32 ids, float32 values).

Lifecycle of a request::

    gateway                       worker
    HELLO {version}          ->
                             <-   MODEL_CARD {...}            (or REJECTED on a version mismatch)
    GENERATE {id, ...}+ids   ->
                             <-   ACCEPTED | BUSY | REJECTED
                             <-   TOKENS {id, ids, logprobs}  (repeated)
                             <-   FINISHED {id, reason, usage}
    EMBED {id, lengths}+ids  ->
                             <-   ACCEPTED | BUSY | REJECTED
                             <-   EMBEDDINGS {id, count, width, prompt_tokens}+floats
                                  (or FINISHED with reason "error" or "abort")
    ABORT {id}               ->   (handled ahead of the queue; FINISHED reason "abort" follows)
    HEARTBEAT                <->  both ways, every HEARTBEAT_INTERVAL seconds

A worker ends the requests of a gateway it has not heard from for HEARTBEAT_TIMEOUT; a gateway
fails the in-flight requests of a worker it has not heard from for as long.
"""

from __future__ import annotations

import array
import enum
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, NamedTuple

import msgpack

from shared.errors import InvalidRequestError
from shared.sampling_params import SamplingDefaults, SamplingParams
from shared.tokenizer_spec import TokenizerSpec
from shared.wire_types import WireTypeError, checked, fields_of

# 2: every message a typed struct (MODEL_CARD capabilities, GENERATE sampling and grammar)
# 3: the MODEL_CARD's tokenizer a typed struct with every entry (nil where its kind has none)
# 4: EMBED and EMBEDDINGS (a gateway must not send EMBED to a worker that would drop it unanswered),
#    and the MODEL_CARD's facts (the model file's quantization, size and publisher, the embedding width)
# 5: GENERATE's reasoning_budget (a worker that dropped it would let a reply think past its budget)
#    and the MODEL_CARD's sampling defaults (a gateway that dropped them would sample unset fields
#    at the API's defaults, not the model's)
# 6: the MODEL_CARD's tokenizer carries its token strings as one blob and their offsets (spec
#    format 2), not as a list of strings
PROTOCOL_VERSION = 6
# Where a worker binds and a gateway connects when no --worker is given: this machine.
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
HEARTBEAT_INTERVAL = 1.0  # seconds between heartbeats, both directions
HEARTBEAT_TIMEOUT = 6.0  # silence after which the peer is presumed gone
DEFAULT_QUEUE = 16  # requests a worker holds waiting before it answers BUSY (its --queue)
# REJECTED kind for a GENERATE from a gateway this worker instance has not been greeted by
# (the worker restarted under it): the gateway says HELLO again and resends.
HELLO_FIRST = "hello_first"
# REJECTED kind for a HELLO of another protocol version.
VERSION_MISMATCH = "protocol_version"


class MsgType(bytes, enum.Enum):
    HELLO = b"H"
    MODEL_CARD = b"C"
    GENERATE = b"G"
    ACCEPTED = b"A"
    BUSY = b"B"
    REJECTED = b"R"
    TOKENS = b"T"
    FINISHED = b"F"
    ABORT = b"X"
    HEARTBEAT = b"P"
    EMBED = b"E"
    EMBEDDINGS = b"V"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token was produced (it is the last id sent)
    LENGTH = "length"  # max_tokens reached
    CONTEXT = "context"  # the per-request context budget is full
    ABORT = "abort"  # ABORT received, or the gateway vanished
    ERROR = "error"  # this stream failed; FINISHED.error says why


class ProtocolError(Exception):
    """A frame that does not parse as this protocol's message. ``request_id``: the request it
    names, where its body is a map whose request_id is a string (a reply to that request is
    then known to be lost), else None."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.request_id = request_id


class InvalidRequestMessage(ProtocolError):
    """A request (GENERATE, EMBED) that is malformed (a field of the wrong type, no ids frame) or
    asks for what no request may (a negative temperature): the worker answers it with REJECTED
    rather than dropping it, under its request id, or "" when that is not a string."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message, request_id)


class InvalidGenerate(InvalidRequestMessage):
    """A GENERATE the worker refuses as it arrives."""


class InvalidEmbed(InvalidRequestMessage):
    """An EMBED the worker refuses as it arrives."""


@dataclass
class Message:
    TYPE: ClassVar[MsgType]

    def body(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_body(cls, body: dict[str, Any], raw: list[bytes]) -> "Message":
        """Every field type-checked (shared/wire_types.py): WireTypeError names the one that is not."""
        return cls(**fields_of(cls, body))

    def frames(self) -> list[bytes]:
        return [self.TYPE.value, msgpack.packb(self.body(), use_bin_type=True)]


@dataclass
class Hello(Message):
    TYPE = MsgType.HELLO
    version: int = PROTOCOL_VERSION
    gateway: str = ""  # a readable name for logs (host:pid)


@dataclass
class Tags:
    """The pair of markers around a block of a reply, such as ``<think>`` and ``</think>``."""
    open: str
    close: str


@dataclass
class Capabilities:
    """What the model and its worker can do, decided once by the worker from the GGUF's
    vocabulary and chat template (worker/capabilities.py); a gateway reads it and never
    re-derives it."""
    context_length: int  # the model's trained context
    reasoning_tags: Tags  # where a reasoning block starts and ends in a reply
    reasoning: bool = False  # the template switches reasoning on and off on request
    tool_call_tags: Tags | None = None  # calls are blocks between these; None: no convention
    # the name of the model's convention in shared/conventions/ (hermes, gemma4, qwen_xml, nanochat,
    # inkling, or one registered there): how its reasoning and calls are written and read
    convention: str = "hermes"
    vision: bool = False  # image inputs
    grammar: bool = True  # constrained decoding
    batch: int = 1  # streams decoded together
    kv_slots: int = 1
    queue: int = DEFAULT_QUEUE
    kvstore: str | None = None  # the kvstore's description, None without one
    # names of the KV prefixes a request may name; the first is put before every conversation that
    # names none when default_cartridge is set
    cartridges: list[str] = field(default_factory=list)
    default_cartridge: str | None = None
    fleet: list[str] = field(default_factory=list)  # a fleet's documents (empty: none): send query ids
    worker: str = ""  # host:pid of the worker process

    def __post_init__(self) -> None:
        # A convention this process does not know cannot be read: the card is refused where it is
        # decoded, naming it. (Imported here: the conventions are described with this module's Tags.)
        from shared.conventions.registry import get as registered_convention
        registered_convention(self.convention)


@dataclass
class ModelFacts:
    """What the served model is, beyond what it can do: what model listings report (LM Studio's
    ``/api/v0/models``) and the width of its embeddings. Read once by the worker from the model
    (worker/model_facts.py)."""
    format: str = "gguf"  # the file's format: "gguf", or "safetensors" for a nanochat checkpoint
    quantization: str = ""  # the file's type as llama.cpp names it (Q4_K_M, Q8_0, F16); "" unknown
    bits_per_weight: float = 0.0  # of the weights as held
    size_bytes: int = 0  # the weights' bytes as held
    parameters: int = 0  # weights, norms included
    size_label: str = ""  # "135M", "7B": the file's general.size_label, else from the count
    publisher: str = ""  # the file's general.organization (else its author); "" when it names none
    embedding_length: int = 0  # the final hidden state's width: the length of an embedding


@dataclass
class ModelCard(Message):
    TYPE = MsgType.MODEL_CARD
    version: int
    model_id: str
    architecture: str
    context_budget: int  # per-request tokens, prompt + completion (--ctx)
    n_vocab: int
    tokenizer: TokenizerSpec  # shared.tokenizer.Tokenizer.to_spec()
    chat_template: str | None
    fingerprint: str
    capabilities: Capabilities
    instance: str = ""  # new on every worker start: a change means in-flight work is lost
    facts: ModelFacts = field(default_factory=ModelFacts)
    # what a request's unset sampling fields take: the file's recommendation, the worker's flags over it
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)


class GrammarKind(enum.StrEnum):
    """What a Grammar's source is written in (worker/grammar.py compiles each)."""
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"  # any JSON object; the source is unused
    REGEX = "regex"
    LARK = "lark"
    LLGUIDANCE = "llguidance"  # a serialized llguidance grammar


@dataclass
class Grammar:
    kind: GrammarKind  # a plain string of one of its values is taken too
    source: str

    def __post_init__(self) -> None:
        self.kind = GrammarKind(self.kind)


INT32 = next(code for code in "il" if array.array(code).itemsize == 4)  # the array type code of int32


def pack_ids(ids: list[int]) -> bytes:
    """Token ids as the little-endian int32 frame of the wire."""
    packed = array.array(INT32, ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(raw: bytes) -> list[int]:
    ids = array.array(INT32)
    ids.frombytes(raw)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def _request_id_of(body: dict[str, Any]) -> str:
    """The request id a refusal goes out under: the body's, or "" when it is not a string (no
    request could be matched to it)."""
    request_id = body.get("request_id")
    return request_id if isinstance(request_id, str) else ""


@dataclass
class Generate(Message):
    TYPE = MsgType.GENERATE
    request_id: str
    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop_ids: list[int] | None = None  # None: the model's own end-of-turn tokens
    grammar: Grammar | None = None
    grammar_after_reasoning: bool = False
    cartridge_ids: list[str] = field(default_factory=list)
    cache_hint: str | None = None  # a session id for slot affinity
    # for a worker serving a fleet: the conversation's key (its choice of cartridges is kept under
    # it) and the ids of its last user message (what retrieval reads)
    conversation: str | None = None
    query: list[int] = field(default_factory=list)
    # >= 0: score the prompt too, each token's logprob with this many alternatives (the prompt is
    # then computed whole, and max_tokens may be 0); -1: not
    prompt_logprobs: int = -1
    # whose cached prefixes the request may reuse: a tenant's digest with several API keys, "" for all
    namespace: str = ""
    speculate: bool = True  # False: no speculative decoding for this request (it never changes a token)
    # at most this many tokens inside a reasoning block, its closing marker included: the worker
    # then writes the marker itself and the answer follows (worker/reasoning_budget.py); None: no cap
    reasoning_budget: int | None = None

    def body(self) -> dict[str, Any]:
        data = asdict(self)
        del data["prompt"]  # travels as a raw frame
        data["sampling"] = self.sampling.to_wire()
        return data

    def frames(self) -> list[bytes]:
        return super().frames() + [pack_ids(self.prompt)]

    @classmethod
    def from_body(cls, body: dict[str, Any], raw: list[bytes]) -> "Generate":
        # the reply goes out under the request's id; one that is not a string cannot be matched
        # to any request, so its REJECTED carries ""
        request_id = _request_id_of(body)
        if len(raw) != 1 or len(raw[0]) % 4:
            raise InvalidGenerate(request_id, "GENERATE needs exactly one int32 frame of prompt ids")
        try:
            values = fields_of(cls, body, skip=frozenset({"prompt"}))
        except (WireTypeError, InvalidRequestError) as exc:  # a field's type, or a value no request may ask for
            raise InvalidGenerate(request_id, exc.message) from exc
        return cls(prompt=unpack_ids(raw[0]), **values)


@dataclass
class Embed(Message):
    """The mean of the model's final normed hidden states (after the output norm) over every
    position of each input: one vector per input, computed on the engine thread between
    generation steps (worker/embeddings.py)."""
    TYPE = MsgType.EMBED
    request_id: str
    inputs: list[list[int]]  # token ids; on the wire "lengths" and one int32 frame of them all

    def body(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "lengths": [len(ids) for ids in self.inputs]}

    def frames(self) -> list[bytes]:
        return super().frames() + [pack_ids([token for ids in self.inputs for token in ids])]

    @classmethod
    def from_body(cls, body: dict[str, Any], raw: list[bytes]) -> "Embed":
        request_id = _request_id_of(body)
        try:
            fields_of(cls, body, skip=frozenset({"inputs"}))
            lengths = checked(body.get("lengths"), list[int], "lengths")
        except WireTypeError as exc:
            raise InvalidEmbed(request_id, exc.message) from exc
        if len(raw) != 1 or len(raw[0]) != 4 * sum(lengths) or any(n < 1 for n in lengths):
            raise InvalidEmbed(request_id, "EMBED needs inputs of at least one id each, their ids in one int32 "
                                           "frame of the lengths' sum")
        ids, inputs, start = unpack_ids(raw[0]), [], 0
        for length in lengths:
            inputs.append(ids[start:start + length])
            start += length
        return cls(request_id, inputs)


@dataclass
class Embeddings(Message):
    """The answer to an EMBED: one vector per input, in order (not normalized)."""
    TYPE = MsgType.EMBEDDINGS
    request_id: str
    vectors: list[list[float]]  # on the wire "count", "width" and one float32 frame of them all
    prompt_tokens: int = 0  # the inputs' tokens, all of them computed

    def body(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "prompt_tokens": self.prompt_tokens,
                "count": len(self.vectors), "width": len(self.vectors[0]) if self.vectors else 0}

    def frames(self) -> list[bytes]:
        values = array.array("f", (value for vector in self.vectors for value in vector))
        if sys.byteorder == "big":
            values.byteswap()
        return super().frames() + [values.tobytes()]

    @classmethod
    def from_body(cls, body: dict[str, Any], raw: list[bytes]) -> "Embeddings":
        values = fields_of(cls, body, skip=frozenset({"vectors"}))
        count, width = (checked(body.get(key), int, key) for key in ("count", "width"))
        if len(raw) != 1 or count < 0 or width < 0 or len(raw[0]) != 4 * count * width:
            raise ProtocolError(f"EMBEDDINGS needs one float32 frame of {count} x {width} values",
                                values["request_id"])
        floats = array.array("f")
        floats.frombytes(raw[0])
        if sys.byteorder == "big":
            floats.byteswap()
        flat = floats.tolist()
        return cls(vectors=[flat[i * width:(i + 1) * width] for i in range(count)], **values)


@dataclass
class Accepted(Message):
    TYPE = MsgType.ACCEPTED
    request_id: str
    queue_position: int = 0
    cartridges: list[str] = field(default_factory=list)  # names of the KV prefixes it is served behind


@dataclass
class Busy(Message):
    TYPE = MsgType.BUSY
    request_id: str
    retry_after: float = 1.0
    message: str = ""


@dataclass
class Rejected(Message):
    TYPE = MsgType.REJECTED
    request_id: str
    status: int = 400
    kind: str = InvalidRequestError.kind
    message: str = ""


class TopLogprob(NamedTuple):
    """One of the likeliest tokens at a position; ``[id, logprob]`` on the wire."""
    token_id: int
    logprob: float


class PromptLogprob(NamedTuple):
    """One prompt token scored; ``[logprob, [[id, logprob], ...]]`` on the wire."""
    logprob: float | None  # None for the first token: nothing predicts it
    top: list[TopLogprob]


@dataclass
class Tokens(Message):
    TYPE = MsgType.TOKENS
    request_id: str
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None  # per token, its alternatives
    cached_tokens: int | None = None  # on a stream's first TOKENS: prompt tokens reused from cache
    # once, before any generated token, for a request with prompt_logprobs: per prompt token
    prompt_logprobs: list[PromptLogprob] | None = None


@dataclass
class Finished(Message):
    TYPE = MsgType.FINISHED
    request_id: str
    reason: FinishReason
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    # speculative decoding: tokens drafted for the reply, and of them those that stood
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {**asdict(self), "reason": self.reason.value}


@dataclass
class Abort(Message):
    TYPE = MsgType.ABORT
    request_id: str


@dataclass
class Heartbeat(Message):
    TYPE = MsgType.HEARTBEAT
    sent_at: float = 0.0
    instance: str = ""  # the worker's ModelCard.instance (empty from gateways)
    # the worker reports its load so gateways (and /health) can see it, and routing can use it
    waiting: int = 0
    running: int = 0
    free_slots: int = 0  # resident KV slots no stream is using
    # what its resident KV slots hold: shared.prefix_digest digests of their tokens (gateways
    # route a prompt to the worker holding most of it); empty from gateways
    prefixes: list[bytes] = field(default_factory=list)


MESSAGE_CLASSES: dict[bytes, type[Message]] = {
    cls.TYPE.value: cls
    for cls in (Hello, ModelCard, Generate, Accepted, Busy, Rejected, Tokens, Finished, Abort, Heartbeat,
                Embed, Embeddings)
}


def decode(frames: list[bytes]) -> Message:
    """Parse ``[type, body, *raw]`` into its message; ProtocolError on anything else."""
    if len(frames) < 2:
        raise ProtocolError(f"a message needs a type frame and a body, got {len(frames)} frame(s)")
    cls = MESSAGE_CLASSES.get(bytes(frames[0]))
    if cls is None:
        raise ProtocolError(f"unknown message type {bytes(frames[0])!r}")
    try:
        body = msgpack.unpackb(frames[1], raw=False)
    except Exception as exc:
        raise ProtocolError(f"{cls.__name__} body is not valid msgpack: {exc}") from exc
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__} body must be a map")
    try:
        return cls.from_body(body, [bytes(f) for f in frames[2:]])
    except ProtocolError:
        raise
    except (TypeError, ValueError, InvalidRequestError) as exc:
        request_id = body.get("request_id")
        raise ProtocolError(f"malformed {cls.__name__}: {exc}",
                            request_id if isinstance(request_id, str) else None) from exc


def version_mismatch_message(ours: int, theirs: int, side: str) -> str:
    return (f"protocol version mismatch: this {side} speaks version {ours}, the peer speaks "
            f"version {theirs}; run the same lmserve release on gateway and worker")
