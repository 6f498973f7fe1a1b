"""The worker's embeddings in-process, on a tiny model: each vector is the mean of the input's
final normed hidden states, the same whether the input is read alone, in a batch or a chunk at
a time; a bad EMBED is refused, a full queue answers BUSY, an abort or a failing pass ends its
request alone."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import write_tiny_gguf

from shared.protocol import Accepted, Busy, Embed, Embeddings, Finished, Rejected
from worker.embeddings import Embedder
from worker.engine import Engine

CHUNK = 4  # tokens per pass: small, so inputs are read both together and a chunk at a time


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llama.gguf"
    write_tiny_gguf(path, "llama", seed=3)
    return Engine.load(path)


class Outbox(list):
    def __call__(self, gateway, message):
        self.append(message)

    def answer(self, rid: str):
        return next(m for m in self if m.request_id == rid and isinstance(m, (Embeddings, Finished)))


def embedder(engine, queue: int = 8) -> tuple[Embedder, Outbox]:
    outbox = Outbox()
    return Embedder(engine, ctx=64, queue=queue, chunk=CHUNK, send=outbox, wake=lambda: None), outbox


def run(embedding: Embedder) -> None:
    for _ in range(1000):
        if not embedding.jobs:
            return
        embedding.run_pending()
    raise AssertionError("the embedder never finished")


def embed(engine, inputs: list[list[int]]) -> list[list[float]]:
    embedding, outbox = embedder(engine)
    embedding.submit(b"gw", Embed("r", inputs))
    run(embedding)
    answer = outbox.answer("r")
    assert isinstance(answer, Embeddings), answer
    return answer.vectors


SHORT, LONG, ONE = [5, 6, 7], list(range(3, 20)), [9]  # LONG spans five passes of CHUNK


def test_each_vector_is_the_mean_of_the_final_normed_hidden_states(engine):
    embedding, outbox = embedder(engine)
    embedding.submit(b"gw", Embed("r", [SHORT, LONG, ONE]))
    assert isinstance(outbox[0], Accepted)
    run(embedding)
    answer = outbox.answer("r")
    assert answer.prompt_tokens == len(SHORT) + len(LONG) + len(ONE)
    for ids, vector in zip([SHORT, LONG, ONE], answer.vectors):
        rows = engine.model.forward([(engine.new_cache(len(ids)), ids)], all_logits=True, hidden=True)[0]
        assert rows.shape == (len(ids), engine.model.hp.n_embd)  # the output norm's rows, not logits
        np.testing.assert_allclose(vector, rows.mean(axis=0, dtype=np.float64), rtol=1e-6, atol=1e-6)


def test_a_batch_embeds_each_input_exactly_as_alone(engine):
    inputs = [SHORT, ONE, LONG, [8, 8], SHORT]
    together = embed(engine, inputs)
    assert together == [embed(engine, [ids])[0] for ids in inputs]
    assert together[0] == together[4] and together[0] != together[1]


@pytest.mark.parametrize("inputs, words", [
    ([], "at least one input"),
    ([[1, 2], [3, 10 ** 6]], "input 1 holds 1000000, which is not a token id"),
    ([[1] * 65], "input 0 is 65 tokens, more than this worker's context of 64"),
])
def test_a_bad_embed_is_refused(engine, inputs, words):
    embedding, outbox = embedder(engine)
    embedding.submit(b"gw", Embed("r", inputs))
    assert len(outbox) == 1 and isinstance(outbox[0], Rejected) and words in outbox[0].message
    assert outbox[0].status == 400 and not embedding.jobs


def test_a_full_queue_answers_busy_and_a_repeated_id_is_refused(engine):
    embedding, outbox = embedder(engine, queue=1)
    embedding.submit(b"gw", Embed("a", [SHORT]))
    embedding.submit(b"gw", Embed("a", [SHORT]))
    embedding.submit(b"gw", Embed("b", [SHORT]))
    assert [type(m) for m in outbox] == [Accepted, Rejected, Busy]
    assert "already in flight" in outbox[1].message and "--queue 1" in outbox[2].message


def test_an_abort_ends_its_request_and_the_next_is_answered(engine):
    embedding, outbox = embedder(engine)
    embedding.submit(b"gw", Embed("a", [LONG]))
    embedding.submit(b"other", Embed("b", [SHORT]))
    embedding.run_pending()  # a first chunk of "a"
    embedding.abort(b"gw", "a")
    run(embedding)
    assert outbox.answer("a").reason == "abort"
    assert isinstance(outbox.answer("b"), Embeddings)
    embedding.submit(b"gone", Embed("c", [SHORT]))
    assert embedding.abort_gateway(b"gone", "silent") == 1
    run(embedding)
    assert outbox.answer("c").reason == "abort" and outbox.answer("c").error == "silent"


def test_a_failing_pass_ends_only_its_request(engine, monkeypatch):
    embedding, outbox = embedder(engine)
    forward = engine.model.forward
    calls = []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the pass broke")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", fails_once)
    embedding.submit(b"gw", Embed("a", [SHORT]))
    embedding.submit(b"gw", Embed("b", [SHORT]))
    run(embedding)
    assert outbox.answer("a").reason == "error" and "failed" in outbox.answer("a").error
    assert isinstance(outbox.answer("b"), Embeddings)
