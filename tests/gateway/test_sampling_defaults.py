"""The model file's recommended sampling settings as the defaults of requests that set none,
the worker's flags over them, and the model listings that report them: real workers and
gateways, the official SDKs.

The model is the tiny random qwen3 written with ``general.sampling.top_k = 1`` (and a
temperature and top_p): with top_k 1 an unseeded request that sets nothing is greedy, equal to
one sent with temperature 0, while random weights make a reply sampled over the whole
vocabulary differ from the greedy one.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from tiny_models import write_tiny_gguf

from gateway.flags import build_parser as gateway_parser
from launcher.flags import build_parser as serve_parser, to_argv
from worker.flags import build_parser as worker_parser

FILE_SAMPLING = {"temp": 0.7, "top_k": 1, "top_p": 0.9}
QUESTION = [{"role": "user", "content": "Name a colour."}]
LENGTH = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("sampling-defaults") / "tiny-qwen3.gguf"
    write_tiny_gguf(path, "qwen3", context_length=1024, sampling=FILE_SAMPLING)
    return path


@pytest.fixture(scope="module")
def from_file(model, start_worker, start_gateway):
    return start_gateway(start_worker(model, "--ctx", "1024"))


@pytest.fixture(scope="module")
def from_flags(model, start_worker, start_gateway):
    return start_gateway(start_worker(model, "--ctx", "1024", "--top-k", "0", "--temperature", "1"))


def chat(gateway, **sampling) -> str:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=LENGTH, **sampling)
    assert reply.usage.completion_tokens == LENGTH or reply.choices[0].finish_reason == "stop"
    return reply.choices[0].message.content


def messages(gateway, **sampling) -> str:
    """(This SDK release names no sampling fields: they go as extra body fields, as Claude Code's do.)"""
    client = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0)
    return client.messages.create(model="m", messages=QUESTION, max_tokens=LENGTH, extra_body=sampling).content[0].text


def responses(gateway, **sampling) -> str:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    return client.responses.create(model="m", input=QUESTION, max_output_tokens=16, **sampling).output_text


def test_a_request_that_sets_nothing_samples_with_the_files_settings(from_file):
    greedy = chat(from_file, temperature=0)
    assert chat(from_file) == greedy  # unseeded, yet greedy: the file's top_k 1
    assert messages(from_file) == messages(from_file, temperature=0)
    assert responses(from_file) == responses(from_file, temperature=0)


def test_a_requests_own_fields_win_over_the_files(from_file):
    greedy = chat(from_file, temperature=0)
    # top_k 0 is the API's own default, and still the request's choice: the whole vocabulary
    assert chat(from_file, temperature=1.0, seed=7, extra_body={"top_k": 0}) != greedy
    assert messages(from_file, temperature=1.0, top_k=0) != messages(from_file, temperature=0)


def test_the_model_listings_report_the_defaults(from_file):
    listed = httpx.get(from_file.url + "/v1/models").json()["data"][0]["sampling_defaults"]
    assert listed == {"temperature": pytest.approx(0.7), "top_k": 1, "top_p": pytest.approx(0.9)}
    assert httpx.get(from_file.url + "/api/v0/models").json()["data"][0]["sampling_defaults"] == listed


def test_the_workers_flags_win_over_the_file(from_flags):
    listed = httpx.get(from_flags.url + "/v1/models").json()["data"][0]["sampling_defaults"]
    assert listed == {"temperature": 1.0, "top_k": 0, "top_p": pytest.approx(0.9)}
    assert chat(from_flags, seed=7) != chat(from_flags, temperature=0)


def test_lmserve_serve_hands_the_sampling_flags_and_the_limits_to_its_children():
    args = serve_parser().parse_args(["m.gguf", "--top-k", "20", "--min-p", "0.05", "--repeat-penalty", "1.1",
                                      "--max-request-seconds", "30", "--max-output-tokens", "512"])
    worker = to_argv(worker_parser(), args)
    assert worker[worker.index("--top-k") + 1] == "20" and worker[worker.index("--min-p") + 1] == "0.05"
    assert worker[worker.index("--repeat-penalty") + 1] == "1.1" and "--temperature" not in worker
    gateway = to_argv(gateway_parser(), args)
    assert gateway[gateway.index("--max-request-seconds") + 1] == "30.0"
    assert gateway[gateway.index("--max-output-tokens") + 1] == "512"


def test_a_sampling_flag_out_of_range_stops_the_worker(capsys):
    from worker.flags import check_worker_flags
    parser = worker_parser()
    for bad, said in ((["--top-p", "0"], "--top-p must be in (0, 1]"), (["--temperature", "-1"], "temperature must be >= 0")):
        with pytest.raises(SystemExit):
            check_worker_flags(parser, parser.parse_args(["m.gguf", *bad]))
        assert said in capsys.readouterr().err
