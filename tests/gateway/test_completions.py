"""POST /v1/completions through the real stack, on Gemma 3 270M (a base model, real weights):
the official openai SDK's completions client, streaming, echo, logprobs, stop strings, token-id
prompts, and the chat dialects' answer to a model without a chat template; fill-in-the-middle
(``suffix``) on a tiny qwen3 model, whose vocabulary has the FIM tokens."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "logits_gemma3_270m.npz"
# Gemma's turn markers, as its instruction-tuned siblings write them (a test template)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.fixture(scope="module")
def greedy() -> dict:
    with np.load(FIXTURE) as data:
        meta = json.loads(str(data["meta"]))["greedy"]
        return {"prompt": meta["prompt"], "text": meta["text"], "prompt_ids": data["greedy_prompt_ids"].tolist(),
                "n": len(data["greedy_ids"])}


@pytest.fixture(scope="module")
def gemma(start_worker, start_gateway, gemma3_model):
    return start_gateway(start_worker(gemma3_model, "--ctx", "512"))


@pytest.fixture(scope="module")
def client(gemma) -> openai.OpenAI:
    return openai.OpenAI(base_url=gemma.url + "/v1", api_key="x", max_retries=0)


def test_a_greedy_completion_continues_as_llama_cpp_does(client, greedy):
    """llama.cpp on the same file: " Paris, France. It is the tallest building in the world"."""
    completion = client.completions.create(model="m", prompt=greedy["prompt"], max_tokens=greedy["n"], temperature=0)
    assert completion.object == "text_completion"
    assert completion.choices[0].text == greedy["text"]
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.prompt_tokens == len(greedy["prompt_ids"])
    assert completion.usage.completion_tokens == greedy["n"]


def test_streaming_gives_the_same_text_then_usage(client, greedy):
    chunks = list(client.completions.create(model="m", prompt=greedy["prompt"], max_tokens=greedy["n"], temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == greedy["n"] and not chunks[-1].choices


def test_token_ids_echo_and_legacy_logprobs(client, greedy):
    """With echo, the prompt's tokens come first in the logprobs, the first one unscored."""
    completion = client.completions.create(model="m", prompt=greedy["prompt_ids"], max_tokens=4, temperature=0,
                                           echo=True, logprobs=3)
    choice = completion.choices[0]
    n = len(greedy["prompt_ids"])
    logprobs = choice.logprobs
    assert choice.text.startswith(greedy["prompt"]) and choice.text[len(greedy["prompt"]):] == greedy["text"][:len(
        "".join(logprobs.tokens[n:]))]
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == n + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(len(top) == 3 for top in logprobs.top_logprobs[1:])
    # greedy: each chosen token is its position's best alternative
    for token, logprob, top in zip(logprobs.tokens[n:], logprobs.token_logprobs[n:], logprobs.top_logprobs[n:]):
        assert logprob == pytest.approx(max(top.values()), abs=1e-4) and token in top
    assert logprobs.text_offset[n] == len(greedy["prompt"])
    for token, offset in zip(logprobs.tokens, logprobs.text_offset):
        assert choice.text[offset:offset + len(token)] == token


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_text_scored_without_a_continuation_matches_llama_cpp(gemma, stream):
    """echo, logprobs and max_tokens 0 (how evaluation harnesses ask for log-likelihoods): every
    prompt token's logprob, against llama.cpp's on the same text (its fixture holds the top 20
    of each position; the served Q4_K_M weights against its F32 copy: measured mean |Δ| 0.039,
    max 0.24, over the 150 positions whose token is in the reference's top 20)."""
    with np.load(FIXTURE) as data:
        tokens, top_ids = data["tokens"].tolist(), data["top_ids"]
        reference = data["top_logits"] - data["logsumexp"][:, None]
    body = {"model": "m", "prompt": tokens, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream}
    if not stream:
        reply = httpx.post(gemma.url + "/v1/completions", json=body, timeout=120).json()
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 0
        text, logprobs = choice["text"], choice["logprobs"]
    else:
        with httpx.stream("POST", gemma.url + "/v1/completions", json=body, timeout=120) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        [scored] = [c for c in chunks if c["choices"][0]["logprobs"]]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        text, logprobs = "".join(c["choices"][0]["text"] for c in chunks), scored["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(tokens) and logprobs["token_logprobs"][0] is None
    assert text == "".join(logprobs["tokens"])
    compared = []
    for i in range(len(tokens) - 1):
        listed = list(top_ids[i])
        if tokens[i + 1] in listed:
            compared.append(abs(logprobs["token_logprobs"][i + 1] - reference[i][listed.index(tokens[i + 1])]))
    assert len(compared) > 0.8 * len(tokens)
    assert np.mean(compared) < 0.1 and max(compared) < 0.6, (np.mean(compared), max(compared))


def test_max_tokens_zero_needs_echo(gemma):
    response = httpx.post(gemma.url + "/v1/completions", timeout=30,
                          json={"model": "m", "prompt": "Hi", "max_tokens": 0})
    assert response.status_code == 400 and "max_tokens" in response.json()["error"]["message"]


def test_a_stop_string_ends_the_text_before_it(client, greedy):
    completion = client.completions.create(model="m", prompt=greedy["prompt"], max_tokens=12, temperature=0, stop=[","])
    assert completion.choices[0].text == greedy["text"].split(",")[0]
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("body", "fragment"), [
    ({"prompt": ["one", "two"]}, "one per request"),
    ({"prompt": "x", "suffix": "y"}, "fill-in-the-middle"),
    ({"prompt": [1, 2, 10**7]}, "not a token id of this model"),
    ({"prompt": []}, "nothing to continue"),  # "" is a prompt of BOS alone: an unconditioned start
    ({"prompt": "x", "n": 2}, "'n' must be 1"),
    ({"prompt": "x", "logprobs": 9}, "'logprobs' must be between 0 and 5"),
])
def test_bad_completions_are_400s_that_say_what_to_fix(gemma, body, fragment):
    response = httpx.post(gemma.url + "/v1/completions", json={"model": "m", **body}, timeout=60)
    assert response.status_code == 400
    assert fragment in response.json()["error"]["message"]


def test_chat_to_a_base_model_points_to_completions(gemma):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses", {"input": "hi"}),
                       ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})):
        response = httpx.post(gemma.url + path, json={"model": "m", **body}, timeout=60,
                              headers={"anthropic-version": "2023-06-01"})
        assert response.status_code == 400, path
        assert "/v1/completions" in response.json()["error"]["message"] and "--chat-template" in \
            response.json()["error"]["message"]


def test_a_chat_template_from_the_command_line(start_worker, start_gateway, gemma3_model, tmp_path):
    template = tmp_path / "gemma.jinja"
    template.write_text(GEMMA_TEMPLATE, encoding="utf-8")
    gateway = start_gateway(start_worker(gemma3_model, "--ctx", "512", "--chat-template", str(template)))
    chat = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "The capital of France is"}], max_tokens=3, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop")
    # <bos> <start_of_turn> user \n … <end_of_turn> \n <start_of_turn> model \n: the template ran
    assert chat.usage.prompt_tokens > len("The capital of France is".split()) + 6


@pytest.fixture(scope="module")
def qwen_fim(tmp_path_factory, start_worker, start_gateway):
    """A tiny qwen3 model: its vocabulary has Qwen2.5-Coder's FIM tokens (found by their texts)."""
    from tiny_models import write_tiny_gguf

    model = tmp_path_factory.mktemp("fim") / "qwen3.gguf"
    write_tiny_gguf(model, "qwen3", context_length=1024)
    return start_gateway(start_worker(model, "--ctx", "1024"))


def test_a_suffix_asks_to_fill_the_middle_in_the_family_s_layout(qwen_fim, qwen_tokenizer):
    """Qwen2.5-Coder's published layout is <|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>;
    the same text written out as a plain prompt must give the same prompt and the same greedy
    continuation."""
    client = openai.OpenAI(base_url=qwen_fim.url + "/v1", api_key="x", max_retries=0)
    prefix, suffix = "def area(r):\n    return ", " * r * r\n"
    filled = client.completions.create(model="m", prompt=prefix, suffix=suffix, max_tokens=6, temperature=0)
    spelled = client.completions.create(model="m", prompt=f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>",
                                        max_tokens=6, temperature=0)
    expected = 3 + len(qwen_tokenizer.encode(prefix, add_special=False)) + \
        len(qwen_tokenizer.encode(suffix, add_special=False))
    assert filled.usage.prompt_tokens == spelled.usage.prompt_tokens == expected
    assert filled.choices[0].text == spelled.choices[0].text
    assert filled.usage.completion_tokens == 6


def test_an_empty_suffix_to_a_model_without_fim_asks_for_nothing(gemma):
    response = httpx.post(gemma.url + "/v1/completions", json={"model": "m", "prompt": "x", "suffix": "",
                                                               "max_tokens": 1}, timeout=60)
    assert response.status_code == 200
