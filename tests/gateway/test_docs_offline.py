"""/docs on a host with no way out: headless Chromium (Debian's chromium and chromium-driver,
through Selenium) reaches nothing but loopback, and Swagger UI still renders the operations,
since its scripts and styles come from the gateway itself (the fastapi-offline package's copy).
Behind --api-key the page and its assets open without the key, like the page always did. The cut
is checked to hold: a CDN's URL, fetched under it, fails and is seen going into the black hole
that stands for the outside, so the page as it was (Swagger UI from a CDN) would stay blank here."""

from __future__ import annotations

import shutil
import socket
import threading
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import wait_until

from gateway.app import DOCS_ASSETS

CDN_URL = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"


class BlackHole:
    """A proxy on loopback that takes every connection Chromium makes to the outside, notes what
    it asked for (``CONNECT host:443 ...``) and closes it unanswered: nothing leaves, and the test
    sees what tried to, whether or not this machine could have reached it."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.asked: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:  # closed
                return
            with connection:
                connection.settimeout(5)
                try:
                    self.asked.append(connection.recv(4096).split(b"\r\n", 1)[0].decode("latin-1"))
                except OSError:
                    self.asked.append("")

    def close(self) -> None:
        self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()


@pytest.fixture(scope="module")
def black_hole():
    hole = BlackHole()
    yield hole
    hole.close()


@pytest.fixture(scope="module")
def offline_browser(black_hole):
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        pytest.fail("chromium and chromedriver are not installed (Debian packages chromium and chromium-driver; "
                    ".ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    # all traffic but loopback's goes to the black hole as to a proxy, and no host name but
    # 127.0.0.1 resolves for a connection that would go around it
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,800",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 f"--proxy-server=http://127.0.0.1:{black_hole.port}", "--proxy-bypass-list=127.0.0.1",
                 "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def load(browser, url: str) -> str:
    """What a fetch of ``url`` from the current page comes to: 'loaded' or why it failed."""
    return browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0], {mode: 'no-cors', cache: 'no-store'})"
        "  .then(() => done('loaded'), (error) => done('failed: ' + error));", url)


@pytest.fixture(scope="module")
def keyed_gateway(stack_worker, start_gateway):
    return start_gateway(stack_worker, "--api-key", "sesame")


def test_docs_render_the_operations_with_only_loopback_reachable(offline_browser, black_hole, keyed_gateway):
    from selenium.webdriver.common.by import By

    browser = offline_browser
    browser.get(keyed_gateway.url + "/docs")

    def chat_operation():
        return [block for block in browser.find_elements(By.CSS_SELECTOR, ".opblock")
                if "/v1/chat/completions" in block.text]

    assert wait_until(chat_operation, timeout=30), browser.find_element(By.TAG_NAME, "body").text[:500]
    # styled by the gateway's CSS (an unstyled block has no border), and nothing fetched from
    # elsewhere (a failed fetch is listed too)
    assert chat_operation()[0].value_of_css_property("border-top-style") == "solid"
    fetched = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert f"{keyed_gateway.url}{DOCS_ASSETS}/swagger-ui-bundle.js" in fetched
    assert {urlsplit(url).hostname for url in fetched} == {"127.0.0.1"}, fetched
    # The cut holds: a CDN's URL, as the page once loaded Swagger UI from, ends in the black hole.
    # (Chromium's own requests, to Google's update and account hosts, end there too.)
    cdn = urlsplit(CDN_URL).hostname
    assert not any(cdn in asked for asked in black_hole.asked)
    assert load(browser, CDN_URL).startswith("failed")
    assert any(cdn in asked for asked in black_hole.asked), black_hole.asked


def test_the_assets_are_open_like_the_page_and_nothing_else_opens(keyed_gateway):
    for path in ("/docs", DOCS_ASSETS + "/swagger-ui-bundle.js", DOCS_ASSETS + "/swagger-ui.css"):
        assert httpx.get(keyed_gateway.url + path, timeout=10).status_code == 200, path
    assert httpx.get(keyed_gateway.url + DOCS_ASSETS + "/no-such-file.js", timeout=10).status_code == 404
    assert httpx.get(keyed_gateway.url + "/v1/models", timeout=10).status_code == 401
    # a path that climbs out of the assets is neither a file of them nor an open door to the API
    climb = httpx.get(keyed_gateway.url + DOCS_ASSETS + "/%2E%2E/%2E%2E/v1/models", timeout=10)
    assert climb.status_code in (401, 404) and "data" not in climb.text
