"""Named API keys from ``--api-keys-file`` (plain and hashed, reread on SIGHUP), their names in
the access log and the metrics, and CORS for the origins ``--cors-origin`` lists, through real
HTTP against gateway processes."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from conftest import REPO, wait_until
from prometheus_client.parser import text_string_to_metric_families

from gateway.api_keys import KeyRing, read_keys_file
from shared.errors import LmserveError

http = httpx.Client(timeout=60)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
HASHED_SECRET = "hashed-secret-of-bob"
PAGE = "https://app.example"


def keys_file(tmp_path, text: str):
    path = tmp_path / "keys.txt"
    path.write_text(text, encoding="utf-8")
    return path


def chat(gateway, key: str | None = None, **headers: str) -> httpx.Response:
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=headers)


def requests_by_key(gateway, key: str) -> float:
    page = http.get(gateway.url + "/metrics", headers={"authorization": "Bearer flag-key"}).text
    return sum(sample.value for family in text_string_to_metric_families(page) for sample in family.samples
               if sample.name == "lmserve_requests_total" and sample.labels.get("key") == key)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, start_gateway, stack_worker):
    folder = tmp_path_factory.mktemp("keys")
    hashed = hashlib.sha256(HASHED_SECRET.encode()).hexdigest()
    path = keys_file(folder, f"# the team\nalice:alice-plain-key\n\nbob:sha256:{hashed}\n")
    gateway = start_gateway(stack_worker, "--api-keys-file", str(path), "--api-key", "flag-key",
                            "--cors-origin", PAGE)
    return gateway, path


def test_plain_and_hashed_keys_work_and_a_wrong_one_is_401(keyed):
    gateway, _ = keyed
    assert chat(gateway, "alice-plain-key").status_code == 200
    assert chat(gateway, HASHED_SECRET).status_code == 200
    assert chat(gateway, "flag-key").status_code == 200
    assert chat(gateway, "wrong").status_code == 401
    assert chat(gateway, hashlib.sha256(HASHED_SECRET.encode()).hexdigest()).status_code == 401  # the hash is no key
    assert chat(gateway).status_code == 401
    sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key=HASHED_SECRET, max_retries=0)
    assert sdk.chat.completions.create(**CHAT).usage.completion_tokens == 2


def test_the_key_name_goes_to_the_access_log_and_the_metrics(keyed):
    gateway, _ = keyed
    before = requests_by_key(gateway, "alice")
    assert chat(gateway, "alice-plain-key").status_code == 200
    assert chat(gateway, "flag-key").status_code == 200
    assert wait_until(lambda: requests_by_key(gateway, "alice") == before + 1)
    assert requests_by_key(gateway, "key1") >= 1  # --api-key's first key
    log = gateway.log_path.read_text()
    assert " key=alice" in log and " key=key1" in log
    assert "alice-plain-key" not in log and HASHED_SECRET not in log
    assert "API keys: 2 from --api-keys-file" in log


def test_sighup_rereads_the_file_and_a_bad_file_keeps_the_keys(keyed):
    gateway, path = keyed
    original = path.read_text()
    try:
        path.write_text("carol:carol-key\n", encoding="utf-8")
        gateway.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: chat(gateway, "carol-key").status_code == 200)
        assert chat(gateway, "alice-plain-key").status_code == 401
        assert chat(gateway, "flag-key").status_code == 200  # --api-key's keys stay
        path.write_text("dave:dave-key\nno colon here\n", encoding="utf-8")
        gateway.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "line 2: not NAME:KEY" in gateway.log_path.read_text())
        assert chat(gateway, "carol-key").status_code == 200
        assert chat(gateway, "dave-key").status_code == 401
        assert "carol-key" not in gateway.log_path.read_text()
    finally:
        path.write_text(original, encoding="utf-8")
        gateway.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: chat(gateway, "alice-plain-key").status_code == 200)


def test_a_bad_line_stops_the_start_with_its_number(tmp_path, stack_worker):
    path = keys_file(tmp_path, "alice:one\n# fine\nbob:sha256:abc\n")
    started = subprocess.run([sys.executable, "-m", "launcher.cli", "gateway", "--worker", stack_worker.endpoint,
                              "--port", "0", "--api-keys-file", str(path)], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    assert started.returncode == 2
    assert "line 3: a hashed key is sha256: and 64 hex digits" in started.stderr


def test_keys_file_lines(tmp_path):
    keys = read_keys_file(str(keys_file(tmp_path, "a:x:y\n  # note\nb: sha256:" + "0" * 64 + "\n")))
    assert [key.name for key in keys] == ["a", "b"]
    assert keys[0].digest == hashlib.sha256(b"x:y").digest() and keys[1].digest == bytes(32)
    for text, error in (("a:1\na:2\n", "line 2: the name 'a' is already"), (":k\n", "line 1: not NAME:KEY"),
                        ("a:\n", "line 1: not NAME:KEY")):
        with pytest.raises(LmserveError, match=error):
            read_keys_file(str(keys_file(tmp_path, text)))
    ring = KeyRing(["p", "q"])
    assert [key.name for key in ring.keys] == ["key1", "key2"] and ring.match([b"nope", b"q"]).name == "key2"


# --- CORS -----------------------------------------------------------------------------------

def preflight(gateway, origin: str, **headers: str) -> httpx.Response:
    return http.options(gateway.url + "/v1/chat/completions", headers={
        "origin": origin, "access-control-request-method": "POST", **headers})


@pytest.fixture(scope="module")
def open_cors(start_gateway, stack_worker):
    return start_gateway(stack_worker, "--cors-origin", f"{PAGE},http://localhost:5173")


@pytest.mark.parametrize("which", ["keyed", "open_cors"])
def test_preflight_and_request_from_an_allowed_origin(which, request):
    gateway = request.getfixturevalue(which)
    gateway = gateway[0] if isinstance(gateway, tuple) else gateway
    key = "alice-plain-key" if which == "keyed" else None
    answer = preflight(gateway, PAGE, **{"access-control-request-headers": "authorization, content-type, x-stainless-os"})
    assert answer.status_code == 204  # before the key: a browser sends none with a preflight
    assert answer.headers["access-control-allow-origin"] == PAGE
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert answer.headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"
    assert int(answer.headers["access-control-max-age"]) > 0 and "Origin" in answer.headers["vary"]
    plain = preflight(gateway, PAGE)
    assert "anthropic-version" in plain.headers["access-control-allow-headers"]
    actual = chat(gateway, key, origin=PAGE)
    assert actual.status_code == 200
    assert actual.headers["access-control-allow-origin"] == PAGE and "Origin" in actual.headers["vary"]
    assert "x-lmserve-ignored-fields" in actual.headers["access-control-expose-headers"]
    if key is not None:  # a refusal is readable by the page too
        refused = chat(gateway, "wrong", origin=PAGE)
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == PAGE


@pytest.mark.parametrize("which", ["keyed", "open_cors"])
def test_another_origin_gets_no_cors_headers(which, request):
    gateway = request.getfixturevalue(which)
    gateway = gateway[0] if isinstance(gateway, tuple) else gateway
    key = "alice-plain-key" if which == "keyed" else None
    answer = preflight(gateway, "https://evil.example")
    assert answer.status_code in (401, 405)  # not a preflight answer: the edge and the routes as usual
    assert not any(name.startswith("access-control-") for name in answer.headers)
    actual = chat(gateway, key, origin="https://evil.example")
    assert actual.status_code == 200
    assert not any(name.startswith("access-control-") for name in actual.headers)


def test_no_cors_without_the_flag(stack):
    answer = preflight(stack, PAGE)
    assert answer.status_code == 405 and "access-control-allow-origin" not in answer.headers
    assert "access-control-allow-origin" not in chat(stack, origin=PAGE).headers


def test_any_origin(start_gateway, stack_worker):
    gateway = start_gateway(stack_worker, "--cors-origin", "*")
    answer = preflight(gateway, "http://anything.test")
    assert answer.status_code == 204 and answer.headers["access-control-allow-origin"] == "http://anything.test"
