"""OpenAI's embeddings (``POST /v1/embeddings``): wire JSON to an EMBED for the worker, and its
EMBEDDINGS back in OpenAI's shape.

``input`` is a string, an array of strings, an array of token ids or an array of token arrays;
a text is tokenized with the vocabulary's BOS (and EOS) where it adds them, its control-token
texts read as plain text. Each vector is the mean of the model's final normed hidden states
over the input's positions (worker/embeddings.py says why the mean), scaled to unit length as
OpenAI's are, so a dot product is a cosine. ``encoding_format`` ``base64`` sends the float32
values little-endian, as the openai SDK decodes them. The model's width is its embeddings'
width: ``dimensions`` other than it is refused, as there is no trained shorter form to cut to.
"""

from __future__ import annotations

import array
import base64
import math
import sys
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from gateway.prompting import ModelView
from gateway.request_fields import check_type, field, unknown_fields, token_ids
from gateway.worker_pool import WorkerPool
from shared.errors import InvalidRequestError, LmserveError, WorkerUnavailableError
from shared.protocol import Embed, Embeddings, Finished

FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
ENCODINGS = ("float", "base64")
MAX_INPUTS = 2048  # OpenAI's limits on one request
MAX_TOTAL_TOKENS = 300_000


@dataclass
class EmbeddingRequest:
    model: str  # echoed back
    inputs: list[list[int]]
    encoding: str  # float | base64


def parse(body: dict[str, Any], view: ModelView) -> EmbeddingRequest:
    unknown_fields(body, FIELDS)
    encoding = field(body, "encoding_format", str, default="float")
    if encoding not in ENCODINGS:
        raise InvalidRequestError(f"'encoding_format' must be float or base64, got {encoding!r}",
                                  param="encoding_format")
    width = view.card.facts.embedding_length
    dimensions = field(body, "dimensions", int)
    if dimensions is not None and dimensions != width:
        raise InvalidRequestError(
            f"'dimensions' is {dimensions}, but this model's embeddings have {width} dimensions and are not "
            f"trained to be shortened; leave 'dimensions' out or send {width}", param="dimensions")
    field(body, "user", str)
    return EmbeddingRequest(field(body, "model", str, default=view.model_id), _inputs(body, view), encoding)


def _inputs(body: dict[str, Any], view: ModelView) -> list[list[int]]:
    value = field(body, "input", (str, list), required=True)
    tokenizer, budget = view.tokenizer, view.context_budget
    if isinstance(value, str):
        texts = [("input", value)]
    elif not value:
        raise InvalidRequestError("'input' is an empty array: send a text, or an array of texts or token arrays",
                                  param="input")
    elif all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        texts = [("input", value)]  # one input of token ids
    else:
        texts = [(f"input[{i}]", check_type(item, (str, list), f"input[{i}]")) for i, item in enumerate(value)]
    if len(texts) > MAX_INPUTS:
        raise InvalidRequestError(f"'input' holds {len(texts)} inputs; at most {MAX_INPUTS} go in one request",
                                  param="input")
    inputs = []
    for where, item in texts:
        if isinstance(item, str):
            # no token stands for more characters than the longest one: a bound before tokenizing
            if len(item) > budget * tokenizer.max_token_chars:
                _beyond_context(where, -(-len(item) // tokenizer.max_token_chars), budget, at_least=True)
            ids = tokenizer.encode(item, add_special=True, parse_special=False) if item else []
        else:
            ids = token_ids(item, where, tokenizer.vocab_size)
        if not ids:
            raise InvalidRequestError(f"'{where}' is empty: there is nothing to embed", param=where)
        if len(ids) > budget:
            _beyond_context(where, len(ids), budget)
        inputs.append(ids)
    total = sum(map(len, inputs))
    if total > MAX_TOTAL_TOKENS:
        raise InvalidRequestError(f"'input' is {total} tokens in all; at most {MAX_TOTAL_TOKENS} go in one request",
                                  param="input")
    return inputs


def _beyond_context(where: str, tokens: int, budget: int, at_least: bool = False) -> None:
    raise InvalidRequestError(
        f"'{where}' is {'at least ' if at_least else ''}{tokens} tokens, more than the {budget} this server reads "
        f"at once (its context, --ctx): shorten it or split it", param=where, code="context_length_exceeded")


async def embed(workers: WorkerPool, inputs: list[list[int]]) -> Embeddings:
    """The worker's pooled vectors for the inputs, in order."""
    async with aclosing(workers.generate(Embed(workers.new_request_id(), inputs))) as replies:
        async for reply in replies:
            if isinstance(reply, Embeddings):
                return reply
            if isinstance(reply, Finished):
                raise LmserveError(reply.error or "the worker could not compute the embeddings")
    raise WorkerUnavailableError("the worker ended the embedding request without answering it")


def render(request: EmbeddingRequest, answer: Embeddings) -> dict[str, Any]:
    data = []
    for index, vector in enumerate(answer.vectors):
        unit = unit_length(vector)
        data.append({"object": "embedding", "index": index,
                     "embedding": _base64(unit) if request.encoding == "base64" else unit.tolist()})
    usage = {"prompt_tokens": answer.prompt_tokens, "total_tokens": answer.prompt_tokens}
    return {"object": "list", "data": data, "model": request.model, "usage": usage}


def unit_length(vector: list[float]) -> array.array:
    """The vector scaled to length 1, as float32 (what both encodings carry)."""
    norm = math.sqrt(math.fsum(value * value for value in vector))
    return array.array("f", (value / norm for value in vector) if norm else vector)


def _base64(values: array.array) -> str:
    little = array.array("f", values)
    if sys.byteorder == "big":
        little.byteswap()
    return base64.b64encode(little.tobytes()).decode("ascii")
