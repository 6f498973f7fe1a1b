"""POST /v1/embeddings through the real stack, driven by the official openai SDK: float and base64
carry the same vectors, a batch embeds each input as it would be embedded alone, SmolLM2's
mean-pooled vectors put paraphrases closer than unrelated sentences, embeddings never disturb a
generation running beside them, and bad input is a 400 that says what to change."""

from __future__ import annotations

import concurrent.futures
import math

import httpx
import numpy as np
import openai
import pytest

WIDTH = 576  # SmolLM2-135M's hidden size
# longer than a prompt chunk (256 tokens): read a chunk at a time, through a cache of its own
LONG = " ".join(f"Paragraph {i}: the river bends past the old mill, where the miller counts his sacks." for i in range(20))

# each: a sentence, a paraphrase of it, and a sentence about something else
PAIRS = [
    ("The cat is sleeping on the sofa.", "A cat naps on the couch.",
     "Interest rates rose by half a percent this quarter."),
    ("How do I reset my password?", "What are the steps to change my forgotten password?",
     "The volcano erupted and covered the village in ash."),
    ("He bought a new laptop for work.", "He purchased a new computer for his job.",
     "The orchestra played a symphony by Beethoven."),
    ("It is raining heavily outside today.", "There is a lot of rain falling outside today.",
     "The software update fixed the login bug."),
]

http = httpx.Client(timeout=300)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def vectors(reply) -> list[list[float]]:
    assert [item.index for item in reply.data] == list(range(len(reply.data)))
    return [item.embedding for item in reply.data]


def test_float_and_base64_carry_the_same_unit_vectors(client, stack):
    texts = ["The quick brown fox jumps over the lazy dog.", "Zürich 漢字 🙂"]
    floats = client.embeddings.create(model="any-model", input=texts, encoding_format="float")
    # without encoding_format the SDK asks for base64 and decodes the little-endian float32 itself
    decoded = client.embeddings.create(model="any-model", input=texts)
    assert vectors(floats) == vectors(decoded)
    assert floats.model == "any-model" and floats.object == "list"
    assert all(item.object == "embedding" for item in floats.data)
    for vector in vectors(floats):
        assert len(vector) == WIDTH and math.isclose(math.hypot(*vector), 1.0, rel_tol=1e-5)
    raw = http.post(stack.url + "/v1/embeddings",
                    json={"input": texts[0], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    assert isinstance(raw, str)
    tokens = sum(len(http.post(stack.url + "/tokenize", json={"content": text, "parse_special": False}).json()["tokens"])
                 for text in texts)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens


def test_a_batch_embeds_each_input_exactly_as_alone(client):
    inputs = [LONG, "short one", "Another sentence, of middling length, about trains.", "short one"]
    together = vectors(client.embeddings.create(model="m", input=inputs, encoding_format="float"))
    alone = [vectors(client.embeddings.create(model="m", input=text, encoding_format="float"))[0] for text in inputs]
    assert together == alone
    assert together[1] == together[3] and together[0] != together[1]


def test_token_ids_embed_as_their_text_does(client, stack):
    text = "Token ids in, the same vector out."
    ids = http.post(stack.url + "/tokenize", json={"content": text}).json()["tokens"]
    by_text = vectors(client.embeddings.create(model="m", input=text, encoding_format="float"))
    by_ids = vectors(client.embeddings.create(model="m", input=ids, encoding_format="float"))
    by_lists = vectors(client.embeddings.create(model="m", input=[ids, ids[:3]], encoding_format="float"))
    assert by_ids == by_text == by_lists[:1] and by_lists[1] != by_text[0]


def test_paraphrases_are_closer_than_unrelated_sentences(client):
    texts = [text for triple in PAIRS for text in triple]
    unit = np.array(vectors(client.embeddings.create(model="m", input=texts)))
    for i, (sentence, paraphrase, unrelated) in enumerate(PAIRS):
        a, b, other = unit[3 * i:3 * i + 3]
        close = float(a @ b)
        assert close > float(a @ other) and close > float(b @ other), (sentence, paraphrase, unrelated)


def test_embeddings_never_disturb_a_generation_beside_them(client):
    chat = {"model": "m", "messages": [{"role": "user", "content": "Count from one to ten in words."}],
            "max_tokens": 24, "temperature": 0}
    alone = client.chat.completions.create(**chat).choices[0].message.content
    batch = [f"{LONG} Variation {i}." for i in range(2)]  # nearly a thousand tokens: several passes
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        embedded = pool.submit(client.embeddings.create, model="m", input=batch, encoding_format="float")
        replied = pool.submit(client.chat.completions.create, **chat)
        assert replied.result().choices[0].message.content == alone
        assert len(embedded.result().data) == len(batch)


@pytest.mark.parametrize("body, words, param", [
    ({"input": "Hi", "dimensions": 256}, "'dimensions' is 256, but this model's embeddings have 576 dimensions",
     "dimensions"),
    ({"input": "Hi", "encoding_format": "int8"}, "'encoding_format' must be float or base64", "encoding_format"),
    ({"input": ""}, "'input' is empty: there is nothing to embed", "input"),
    ({"input": ["fine", ""]}, "'input[1]' is empty", "input[1]"),
    ({"input": []}, "'input' is an empty array", "input"),
    ({"input": [[1, 2], [3, 49152]]}, "'input[1][1]' is 49152, which is not a token id of this model", "input[1][1]"),
    ({"input": ["text", 5]}, "'input[1]' must be a string or an array, got an integer", "input[1]"),
    ({"input": {"text": "Hi"}}, "'input' must be a string or an array, got an object", "input"),
    ({}, "'input' is required", "input"),
    ({"input": "word " * 2100}, "'input' is 2101 tokens, more than the 2048 this server reads at once", "input"),
    ({"input": ["x"] * 2049}, "at most 2048 go in one request", "input"),
])
def test_bad_input_is_a_400_that_says_what_to_change(stack, body, words, param):
    response = http.post(stack.url + "/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"


def test_an_unknown_field_is_ignored_or_under_strict_fields_a_400(stack, strict_stack):
    ignored = http.post(stack.url + "/v1/embeddings", json={"input": "Hi", "pooling": "cls"})
    assert ignored.status_code == 200 and ignored.headers["x-lmserve-ignored-fields"] == "pooling"
    error = http.post(strict_stack.url + "/v1/embeddings", json={"input": "Hi", "pooling": "cls"}).json()["error"]
    assert "unknown field 'pooling'" in error["message"] and error["param"] == "pooling"


def test_the_sdk_raises_the_400_and_takes_the_models_own_width(client):
    with pytest.raises(openai.BadRequestError, match="576 dimensions"):
        client.embeddings.create(model="m", input="Hi", dimensions=8)
    assert len(client.embeddings.create(model="m", input="Hi", dimensions=WIDTH).data[0].embedding) == WIDTH
