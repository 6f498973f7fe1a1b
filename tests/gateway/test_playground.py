"""The playground page (GET / from a browser) driven in headless Chromium (Debian's chromium and
chromium-driver, through Selenium): a message in each dialect streams into the page, tokens
showing before the reply ends, with the reply's token counts and speed under it; behind
--api-key it works once the key is typed in. A screenshot is saved (LMSERVE_SCREENSHOT names
where, for the README's)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

DIALECTS = ("chat", "responses", "anthropic")


@pytest.fixture(scope="module")
def browser():
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        pytest.fail("chromium and chromedriver are not installed (Debian packages chromium and chromium-driver; "
                    ".ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    yield driver
    driver.quit()


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("timed out waiting for the page")


def send(browser, text: str) -> dict:
    """Type a message, send it, and watch the reply stream in: what was seen mid-stream and at
    the end."""
    from selenium.webdriver.common.by import By

    replies_before = len(browser.find_elements(By.CSS_SELECTOR, ".reply"))
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(text)
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".reply")) > replies_before)
    reply = browser.find_elements(By.CSS_SELECTOR, ".reply")[-1]
    seen_while_streaming = ""
    while browser.find_element(By.TAG_NAME, "body").get_attribute("data-streaming") == "yes":
        current = reply.find_element(By.CSS_SELECTOR, ".text").text
        if current and not seen_while_streaming:
            seen_while_streaming = current
        time.sleep(0.01)
    return {"partial": seen_while_streaming, "text": reply.find_element(By.CSS_SELECTOR, ".text").text,
            "stats": reply.find_elements(By.CSS_SELECTOR, ".stats")[-1].text}


def test_each_dialect_streams_into_the_page(browser, stack, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(stack.url + "/")
    wait_for(lambda: "tokens of context" in browser.find_element(By.ID, "model").text)
    max_tokens = browser.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("48")
    browser.find_element(By.ID, "keep").click()  # each message on its own
    for dialect in DIALECTS:
        Select(browser.find_element(By.ID, "dialect")).select_by_value(dialect)
        seen = send(browser, "Tell me about Paris in three sentences.")
        assert seen["partial"] and seen["text"].startswith(seen["partial"]) and len(seen["text"]) > len(seen["partial"]), \
            (dialect, seen)
        for part in ("prompt ", "cached ", "completion ", "tok/s", "TTFT "):
            assert part in seen["stats"], (dialect, seen["stats"])
    screenshot = Path(os.environ.get("LMSERVE_SCREENSHOT") or tmp_path / "playground.png")
    browser.save_screenshot(str(screenshot))
    assert screenshot.stat().st_size > 10_000


def test_a_regex_holds_the_reply(browser, stack):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(stack.url + "/")
    wait_for(lambda: "tokens of context" in browser.find_element(By.ID, "model").text)
    Select(browser.find_element(By.ID, "dialect")).select_by_value("anthropic")
    Select(browser.find_element(By.ID, "constraint")).select_by_value("regex")
    source = browser.find_element(By.ID, "constraint-source")
    source.send_keys("(yes|no), [a-z]{1,12}\\.")
    seen = send(browser, "Is Paris in France?")
    import re
    assert re.fullmatch(r"(yes|no), [a-z]{1,12}\.", seen["text"]), seen


def test_behind_an_api_key_the_page_asks_for_it(browser, stack_worker, start_gateway):
    from selenium.webdriver.common.by import By

    gateway = start_gateway(stack_worker, "--api-key", "sesame")
    assert httpx.get(gateway.url + "/", headers={"accept": "text/html"}, timeout=10).status_code == 200
    browser.get(gateway.url + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    wait_for(lambda: "not ready" in browser.find_element(By.ID, "model").text)
    key = browser.find_element(By.ID, "key")
    key.send_keys("sesame")
    browser.find_element(By.ID, "temperature").click()  # leaving the field commits it
    wait_for(lambda: "tokens of context" in browser.find_element(By.ID, "model").text)
    seen = send(browser, "Hello!")
    assert seen["text"] and "completion " in seen["stats"]


THOUGHT = "I should call the tool."
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = '[{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", ' \
        '"properties": {"city": {"type": "string"}}, "required": ["city"]}}]'


@pytest.fixture(scope="module")
def scripted_qwen(tmp_path_factory, start_worker, start_gateway):
    """The tiny qwen3 (Hermes calls, think tags) replying from a script."""
    import json

    from tiny_models import write_tiny_gguf

    folder = tmp_path_factory.mktemp("playground-qwen3")
    write_tiny_gguf(folder / "tiny-qwen3.gguf", "qwen3", context_length=2048)
    script = folder / "replies.json"
    script.write_text(json.dumps([{"when": "[[call-weather]]", "text": f"<think>\n{THOUGHT}\n</think>\n\n{WEATHER_CALL}"},
                                  {"text": "There is no script for this."}]), encoding="utf-8")
    return start_gateway(start_worker(folder / "tiny-qwen3.gguf", "--scripted-replies", str(script), "--ctx", "2048"))


def test_reasoning_and_tool_calls_get_blocks_of_their_own(browser, scripted_qwen):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(scripted_qwen.url + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    wait_for(lambda: "tokens of context" in browser.find_element(By.ID, "model").text)
    browser.find_element(By.ID, "reasoning").click()
    browser.find_element(By.ID, "keep").click()
    browser.find_element(By.ID, "tools").send_keys(TOOLS)
    for dialect in DIALECTS:
        Select(browser.find_element(By.ID, "dialect")).select_by_value(dialect)
        send(browser, "What is the weather in Paris? [[call-weather]]")
        reply = browser.find_elements(By.CSS_SELECTOR, ".reply")[-1]
        assert reply.find_element(By.CSS_SELECTOR, ".reasoning-text").text == THOUGHT, dialect
        call = reply.find_element(By.CSS_SELECTOR, ".call").text
        assert call.startswith("tool call · get_weather") and '"city"' in call and "Paris" in call, (dialect, call)
        assert reply.find_element(By.CSS_SELECTOR, ".text").text == "", dialect  # no text beside the call
        assert "not sent back" in reply.text, dialect  # calls are not run: the exchange stays out
