"""A Hugging Face Hub of our own on a loopback port, for the tests of models named OWNER/REPO:QUANT.

It answers what ``huggingface_hub`` (2.4) asks when it lists a model's files and fetches them:

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``: the model's commit
  (``sha``) and files (``siblings``);
- ``HEAD`` and ``GET /{repo}/resolve/{rev}/{file}``: the file, with the headers the library
  requires (``X-Repo-Commit``, ``ETag``, ``Content-Length``) and byte ranges (206) for a download
  that resumes.

It never sends ``X-Xet-Hash``, so the library fetches over plain HTTP, never from Xet storage.
Anything else is 404, the library's best-effort look-up of ``/api/agent-harnesses`` included.
A repository may be gated (401 ``GatedRepo`` unless the request bears its token) or refused to
everyone (403); an unknown repository is 404 ``RepoNotFound``, an unknown file 404
``EntryNotFound``, as the Hub answers. Every request is recorded, and a file can be made to cut
its first download short.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

REPO = r"(?P<repo>[^/]+/[^/]+)"
MODEL_INFO = re.compile(rf"^/api/models/{REPO}(?:/revision/(?P<revision>[^/]+))?$")
RESOLVE = re.compile(rf"^/{REPO}/resolve/(?P<revision>[^/]+)/(?P<file>.+)$")


@dataclass
class HubRepo:
    files: dict[str, Path]  # name in the repository -> the file served
    token: str | None = None  # gated: only a request bearing this token gets in
    refused: bool = False  # 403 to everyone
    etags: dict[str, str] = field(init=False)  # each file's SHA-256, as the Hub gives an LFS file's ETag
    commit: str = field(init=False)  # what its files make it

    def __post_init__(self) -> None:
        self.etags = {name: _sha256(path) for name, path in self.files.items()}
        self.commit = hashlib.sha1(json.dumps(sorted(self.etags.items())).encode()).hexdigest()


@dataclass
class Request:
    method: str
    path: str
    range: str | None


@dataclass
class LocalHub:
    repos: dict[str, HubRepo] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    cut_short: dict[str, int] = field(default_factory=dict)  # file -> bytes its next GET sends, then hangs up
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> LocalHub:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), HubHandler)
        self.server.daemon_threads = True
        self.server.hub = self
        threading.Thread(target=self.server.serve_forever, name="local-hub", daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the library's client expects

    def hub(self) -> LocalHub:
        return self.server.hub

    def log_message(self, format: str, *args: object) -> None:
        pass  # the tests read hub().requests instead

    def do_GET(self) -> None:
        self.answer(body=True)

    def do_HEAD(self) -> None:
        self.answer(body=False)

    def answer(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub().requests.append(Request(self.command, path, self.headers.get("Range")))
        info, resolve = MODEL_INFO.match(path), RESOLVE.match(path)
        match = info or resolve
        repo = self.hub().repos.get(match["repo"]) if match else None
        if match is None:
            return self.refuse(404, "", "Not found", body)
        if repo is None:
            return self.refuse(404, "RepoNotFound", "Repository not found", body)
        if repo.refused:
            return self.refuse(403, "", "Forbidden", body)
        if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
            return self.refuse(401, "GatedRepo", "Access to this model is restricted", body)
        if match["revision"] not in (None, "main", repo.commit):
            return self.refuse(404, "RevisionNotFound", "Invalid rev id", body)
        if info:
            return self.model_info(match["repo"], repo, body)
        if match["file"] not in repo.files:
            return self.refuse(404, "EntryNotFound", "Entry not found", body, commit=repo.commit)
        self.file(match["file"], repo, body)

    def model_info(self, repo_id: str, repo: HubRepo, body: bool) -> None:
        data = json.dumps({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                           "gated": "auto" if repo.token else False,
                           "siblings": [{"rfilename": name} for name in sorted(repo.files)]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def file(self, name: str, repo: HubRepo, body: bool) -> None:
        path = repo.files[name]
        size = path.stat().st_size
        start = int(re.match(r"bytes=(\d+)-", self.headers.get("Range") or "bytes=0-")[1])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("ETag", f'"{repo.etags[name]}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(size - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.end_headers()
        if not body:
            return
        cut = self.hub().cut_short.pop(name, None)
        with open(path, "rb") as fh:
            fh.seek(start)
            self.wfile.write(fh.read(cut if cut is not None else size - start))
        if cut is not None:  # the rest never comes: the client sees the body end early
            self.wfile.flush()
            self.close_connection = True

    def refuse(self, status: int, code: str, message: str, body: bool, commit: str | None = None) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
