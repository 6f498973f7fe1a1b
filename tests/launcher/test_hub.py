"""Models named by their Hugging Face Hub repository (``OWNER/REPO[:QUANT|:FILE.gguf]``).

The rule that picks a file is checked on listings alone; everything else goes through the real
``huggingface_hub`` client and ``lmserve`` commands against a Hub of our own on a loopback port
(``tests/local_hub.py``), which serves tiny synthetic models, one of them split in parts.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import REPO, free_port
from gguf_split import split_gguf
from local_hub import HubRepo, LocalHub
from tiny_models import write_tiny_gguf

from shared.errors import ModelLoadError
from shared.gguf_names import model_name, quant_tag
from shared.hub import HubName, choose, parse_hub_name

# --- which file a name picks: listings alone, no network ------------------------------------

LISTING = ["mmproj-F16.gguf", "README.md", "Qwen3-0.6B-BF16.gguf", "Qwen3-0.6B-F16.gguf",
           "Qwen3-0.6B-Q4_K_S.gguf", "Qwen3-0.6B-Q4_K_M.gguf", "Qwen3-0.6B-UD-Q4_K_XL.gguf", "model.Q5_1.gguf",
           "Q8_0/Big-Q8_0-00002-of-00002.gguf", "Q8_0/Big-Q8_0-00001-of-00002.gguf"]


def pick(tag: str | None, listing: list[str] = LISTING) -> tuple[str, ...]:
    return choose(HubName("owner/repo", tag), listing)


@pytest.mark.parametrize("tag, picked", [
    ("Q4_K_M", "Qwen3-0.6B-Q4_K_M.gguf"),
    ("q4_k_s", "Qwen3-0.6B-Q4_K_S.gguf"),  # any case
    ("F16", "Qwen3-0.6B-F16.gguf"),  # not BF16: the tag stands between the name's separators
    ("bf16", "Qwen3-0.6B-BF16.gguf"),
    ("UD-Q4_K_XL", "Qwen3-0.6B-UD-Q4_K_XL.gguf"),
    ("Q4_K_XL", "Qwen3-0.6B-UD-Q4_K_XL.gguf"),
    ("Q5_1", "model.Q5_1.gguf"),
    (None, "Qwen3-0.6B-Q4_K_M.gguf"),  # no tag: Q4_K_M where there is one
    ("Qwen3-0.6B-Q4_K_S.gguf", "Qwen3-0.6B-Q4_K_S.gguf"),  # a file, named exactly
])
def test_a_tag_picks_the_file_whose_name_holds_it(tag, picked):
    assert pick(tag) == (picked,)


def test_without_q4_k_m_no_tag_picks_the_first_gguf_never_a_projector():
    assert pick(None, [name for name in LISTING if "Q4_K_M" not in name]) == ("Qwen3-0.6B-BF16.gguf",)
    with pytest.raises(ModelLoadError, match="matches 'mmproj'"):
        pick("mmproj")


def test_a_split_model_is_picked_whole_in_the_order_of_its_parts():
    parts = ("Q8_0/Big-Q8_0-00001-of-00002.gguf", "Q8_0/Big-Q8_0-00002-of-00002.gguf")
    assert pick("Q8_0") == parts
    assert pick("Q8_0/Big-Q8_0-00002-of-00002.gguf") == parts  # naming any part names the model
    with pytest.raises(ModelLoadError, match=r"1 of the 2 parts of Q8_0/Big-Q8_0"):
        pick("Q8_0", LISTING[:-1])


def test_a_tag_that_matches_nothing_lists_the_ggufs_and_their_tags():
    with pytest.raises(ModelLoadError) as refused:
        pick("Q4_K")  # a prefix of Q4_K_M and Q4_K_S is neither
    message = refused.value.message
    assert message.startswith("no GGUF file of owner/repo matches 'Q4_K'; the repository holds:")
    for line in ("Qwen3-0.6B-Q4_K_M.gguf  (Q4_K_M)", "Qwen3-0.6B-UD-Q4_K_XL.gguf  (Q4_K_XL)",
                 "model.Q5_1.gguf  (Q5_1)", "Q8_0/Big-Q8_0-00001-of-00002.gguf  (Q8_0, 2 parts)"):
        assert line in message
    assert "mmproj" not in message and "README" not in message


def test_what_names_a_hub_model_and_what_is_a_path():
    assert parse_hub_name("Qwen/Qwen3-0.6B-GGUF:Q8_0") == HubName("Qwen/Qwen3-0.6B-GGUF", "Q8_0")
    assert parse_hub_name("Qwen/Qwen3-0.6B-GGUF") == HubName("Qwen/Qwen3-0.6B-GGUF")
    assert parse_hub_name("org/repo:Q8_0/Big-Q8_0-00001-of-00002.gguf").tag == "Q8_0/Big-Q8_0-00001-of-00002.gguf"
    for path in ("models/model.gguf", "/models/a/b", "./a/b", "../a/b", "a/b/c", "SmolLM2-135M-Instruct", "a/b:"):
        assert parse_hub_name(path) is None, path


def test_a_path_that_exists_is_never_taken_for_a_hub_name(tmp_path, monkeypatch):
    from shared.default_model import resolve_model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # were it taken for one, no request would leave this machine
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "sft").mkdir()  # a nanochat checkpoint directory's name looks like OWNER/REPO
    assert resolve_model("runs/sft") == "runs/sft"


def test_what_a_file_name_says():
    assert quant_tag("Qwen3-0.6B-UD-Q4_K_XL.gguf") == "Q4_K_XL"
    assert quant_tag("smollm2-135m-instruct.q4_1.gguf") == "Q4_1"
    assert quant_tag("Big-IQ4_XS-00001-of-00003.gguf") == "IQ4_XS"
    assert quant_tag("model.gguf") is None
    assert model_name("/hub/snapshots/abc/Big-Q8_0-00001-of-00003.gguf") == "Big-Q8_0"


# --- through the real client, against a Hub on a loopback port ----------------------------

TOKEN = "hf_local_test_token"


@pytest.fixture(scope="module")
def hub(tmp_path_factory, default_model):  # default_model: the tiny llama's vocabulary is SmolLM2's
    files = tmp_path_factory.mktemp("hub-files")
    whole = files / "tiny-llama-Q8_0.gguf"
    write_tiny_gguf(whole, "llama", seed=0, tensor_type="Q8_0")
    write_tiny_gguf(files / "tiny-llama-F32.gguf", "llama", seed=0)  # over 10 MiB: a download resumes past it
    parts = split_gguf(whole, files / "split" / "tiny-llama-Q8_0.gguf", tensors_per_part=8)
    assert len(parts) == 4  # the first holds the metadata alone, the others the 21 tensors
    served = LocalHub().start()
    served.repos.update({
        "tiny/Llama-GGUF": HubRepo({"tiny-llama-Q8_0.gguf": whole, "tiny-llama-F32.gguf": files / "tiny-llama-F32.gguf",
                                    "mmproj-tiny-llama-F16.gguf": whole}),
        "tiny/Split-GGUF": HubRepo({part.name: part for part in parts}),
        "tiny/Gated-GGUF": HubRepo({"tiny-llama-Q8_0.gguf": whole}, token=TOKEN),
        "tiny/Refused-GGUF": HubRepo({"tiny-llama-Q8_0.gguf": whole}, refused=True),
    })
    yield served
    served.stop()


def hub_env(hub: LocalHub, home: Path, **more: str) -> dict[str, str]:
    """The environment of an lmserve command using the local Hub, its cache under ``home``."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    return {**env, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), **more}


def lmserve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def pulled(env: dict[str, str], name: str) -> Path:
    done = lmserve(env, "pull", name)
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pull_by_quant_tag_or_file_name_fetches_that_file_into_the_hub_cache(hub, tmp_path):
    env, asked = hub_env(hub, tmp_path / "hf"), len(hub.requests)
    by_tag = pulled(env, "tiny/Llama-GGUF:q8_0")
    assert by_tag.is_relative_to(tmp_path / "hf" / "hub") and by_tag.name == "tiny-llama-Q8_0.gguf"
    assert sha256(by_tag) == sha256(hub.repos["tiny/Llama-GGUF"].files["tiny-llama-Q8_0.gguf"])
    assert pulled(env, "tiny/Llama-GGUF:tiny-llama-Q8_0.gguf") == by_tag
    # once, at the commit the listing named; the second name found it in the cache
    fetched = [r.path for r in hub.requests[asked:] if r.method == "GET" and "/resolve/" in r.path]
    assert fetched == [f"/tiny/Llama-GGUF/resolve/{hub.repos['tiny/Llama-GGUF'].commit}/tiny-llama-Q8_0.gguf"]


def test_a_tag_that_matches_nothing_is_refused_with_what_the_repository_holds(hub, tmp_path):
    done = lmserve(hub_env(hub, tmp_path / "hf"), "pull", "tiny/Llama-GGUF:Q4_K_M")
    assert done.returncode == 2
    assert "no GGUF file of tiny/Llama-GGUF matches 'Q4_K_M'; the repository holds:" in done.stderr
    assert "tiny-llama-F32.gguf  (F32)" in done.stderr and "tiny-llama-Q8_0.gguf  (Q8_0)" in done.stderr
    assert "mmproj" not in done.stderr


def test_a_dropped_download_resumes_with_a_range_request(hub, tmp_path):
    served = hub.repos["tiny/Llama-GGUF"].files["tiny-llama-F32.gguf"]
    hub.cut_short["tiny-llama-F32.gguf"] = 11 << 20  # past the client's first 10 MiB written to disk
    path = pulled(hub_env(hub, tmp_path / "hf"), "tiny/Llama-GGUF:F32")
    assert sha256(path) == sha256(served)
    assert any(r.range == f"bytes={10 << 20}-" for r in hub.requests if r.path.endswith("tiny-llama-F32.gguf"))


def test_a_split_model_loads_as_one_and_generates_the_tokens_of_the_whole_file(hub, tmp_path):
    from worker.engine import Engine

    first = pulled(hub_env(hub, tmp_path / "hf"), "tiny/Split-GGUF:Q8_0")
    assert sorted(path.name for path in first.parent.iterdir()) == sorted(hub.repos["tiny/Split-GGUF"].files)
    whole, split = (Engine.load(path) for path in (hub.repos["tiny/Llama-GGUF"].files["tiny-llama-Q8_0.gguf"], first))
    assert split.model_id == whole.model_id == "tiny-llama-Q8_0"

    def greedy(engine, prompt: list[int], count: int) -> list[int]:
        cache = engine.new_cache(64)
        logits, tokens = engine.prefill(cache, prompt), []
        for _ in range(count):
            tokens.append(int(np.argmax(logits)))
            logits = engine.model.forward([(cache, tokens[-1:])])[0]
        return tokens

    prompt = whole.tokenizer.encode("The capital of France is")
    assert greedy(split, prompt, 12) == greedy(whole, prompt, 12)


def test_every_part_of_a_split_model_counts(hub, tmp_path):
    from worker.cartridges.cartridge import model_identity
    from worker.engine import Engine

    first = pulled(hub_env(hub, tmp_path / "hf"), "tiny/Split-GGUF")
    copies = tmp_path / "copies"
    copies.mkdir()
    for part in first.parent.iterdir():
        (copies / part.name).write_bytes(part.read_bytes())
    served = Engine.load(copies / first.name)
    identity = model_identity(served)
    # a weight changed in the last part (the first holds only metadata) is another model's KV,
    # and another model for a cartridge
    last = copies / "tiny-llama-Q8_0-00004-of-00004.gguf"
    data = bytearray(last.read_bytes())
    data[-1] ^= 1  # an int8 weight of output.weight's last block
    last.write_bytes(bytes(data))
    changed = Engine.load(copies / first.name)
    assert changed.fingerprint != served.fingerprint
    assert model_identity(changed)["weights"] != identity["weights"]
    (copies / "tiny-llama-Q8_0-00003-of-00004.gguf").unlink()
    with pytest.raises(ModelLoadError, match=r"first of 4 parts of a split model; missing beside it: "
                                             r"tiny-llama-Q8_0-00003-of-00004\.gguf"):
        Engine.load(copies / first.name)


@pytest.mark.parametrize("repo, status", [("tiny/Gated-GGUF", 401), ("tiny/Refused-GGUF", 403)])
def test_a_repository_that_refuses_says_to_set_hf_token(hub, tmp_path, repo, status):
    done = lmserve(hub_env(hub, tmp_path / "hf"), "pull", f"{repo}:Q8_0")
    assert done.returncode == 2
    assert "set HF_TOKEN to an access token that may read it" in done.stderr
    assert f"{hub.url}/{repo}" in done.stderr  # the page where a gated model's licence is accepted
    assert ("is a gated model" if status == 401 else f"refused {repo} ({status})") in done.stderr


def test_hf_token_opens_a_gated_repository(hub, tmp_path):
    path = pulled(hub_env(hub, tmp_path / "hf", HF_TOKEN=TOKEN), "tiny/Gated-GGUF:Q8_0")
    assert path.name == "tiny-llama-Q8_0.gguf"


def test_a_repository_that_does_not_exist_is_named(hub, tmp_path):
    done = lmserve(hub_env(hub, tmp_path / "hf"), "generate", "tiny/No-Such-GGUF:Q8_0", "--prompt", "hi")
    assert done.returncode == 2
    assert f"tiny/No-Such-GGUF: no such model repository on {hub.url}" in done.stderr


def test_models_lists_what_pull_fetched(hub, tmp_path):
    env = hub_env(hub, tmp_path / "hf")
    before = lmserve(env, "models")
    assert before.returncode == 0 and "Nothing from the Hugging Face Hub" in before.stdout
    pulled(env, "tiny/Split-GGUF:Q8_0")
    pulled(env, "tiny/Llama-GGUF:Q8_0")
    listed = lmserve(env, "models").stdout
    assert f"From the Hugging Face Hub, in {tmp_path / 'hf' / 'hub'}:" in listed
    rows = [line.split() for line in listed.splitlines() if line.startswith("tiny/")]
    whole = hub.repos["tiny/Llama-GGUF"].files["tiny-llama-Q8_0.gguf"].stat().st_size
    split = sum(path.stat().st_size for path in hub.repos["tiny/Split-GGUF"].files.values())
    assert rows == [["tiny/Llama-GGUF", "Q8_0", f"{whole / 1e6:.1f}", "MB", "tiny-llama-Q8_0.gguf"],
                    ["tiny/Split-GGUF", "Q8_0", f"{split / 1e6:.1f}", "MB", "tiny-llama-Q8_0-00001-of-00004.gguf",
                     "(+3", "parts)"]]
    assert "A Hub model is named OWNER/REPO[:QUANT]" in listed  # and how to name one


def test_a_cached_model_resolves_without_the_hub(hub, tmp_path):
    env = hub_env(hub, tmp_path / "hf")
    path = pulled(env, "tiny/Split-GGUF:Q8_0")
    asked = len(hub.requests)
    assert pulled({**env, "HF_HUB_OFFLINE": "1"}, "tiny/Split-GGUF:Q8_0") == path
    assert len(hub.requests) == asked  # offline: not one request
    nobody = f"http://127.0.0.1:{free_port()}"  # a Hub that is down
    assert pulled({**env, "HF_ENDPOINT": nobody}, "tiny/Split-GGUF") == path
    missing = lmserve({**env, "HF_ENDPOINT": nobody}, "pull", "tiny/Llama-GGUF:Q8_0")
    assert missing.returncode == 2 and "tiny/Llama-GGUF is not in the Hugging Face cache" in missing.stderr
    assert f"{nobody} cannot be reached" in missing.stderr


def test_serve_answers_a_chat_from_a_hub_model(hub, tmp_path):
    port = free_port()
    env = hub_env(hub, tmp_path / "hf")
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "serve", "tiny/Llama-GGUF:Q8_0",
                                 "--port", str(port), "--ctx", "256", "--kv-cache-dir", str(tmp_path / "kv")],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # a first start on this CPU compiles the kernels
        while not _healthy(url):
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "lmserve serve did not get ready"
            time.sleep(0.3)
        reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny-llama-Q8_0"
    finally:
        proc.terminate()
        proc.wait(60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
