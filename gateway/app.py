"""The gateway's FastAPI application: routes, the worker connection, error mapping.

Every dialect request takes the same path: read and parse the body, let the dialect module
translate it, run ``gateway.generation``, and hand the events back to the dialect to render,
whole or as SSE.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.resources
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from gateway import access_log, embeddings, lmstudio_models, metrics, openapi, sse, tokenizing
from gateway.access_log import AccessLogMiddleware
from gateway.api_keys import KeyRing
from gateway.dialects import anthropic_messages, openai_chat, openai_completions, openai_responses
from gateway.edge import KEY_HELD, TENANT, EdgeMiddleware, EdgeSettings
from gateway.errors import dialect_for_path, error_response
from gateway.flags import MAX_BUFFERED, PING_INTERVAL
from gateway.generation import Completion, ReplyLimits, generate, prepare
from gateway.neutral import Event, NeutralRequest, Ping, Started
from gateway.prompting import ModelView
from gateway.request_fields import FieldTolerance, parse_json_object, tolerating
from gateway.tool_calls import ToolPlan
from gateway.worker_pool import WorkerPool
from shared.errors import (
    InvalidRequestError,
    LmserveError,
    NotFoundError,
    WorkerUnavailableError,
)
from shared.memory import give_back_freed_memory
from shared.protocol import DEFAULT_ENDPOINT, HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT
from shared.wire_security import ClientKeys

log = logging.getLogger("lmserve.gateway")
Answer = TypeVar("Answer")


@dataclass
class GatewaySettings:
    worker: str = DEFAULT_ENDPOINT  # endpoints, comma-separated; dns+tcp://NAME:PORT for all NAME resolves to
    route: str = "prefix"  # prefix | round-robin (gateway.worker_pool)
    route_queue_tokens: int = 0  # 0: measured (gateway.worker_pool.QueueCost)
    edge: EdgeSettings = field(default_factory=EdgeSettings)
    ping_interval: float = PING_INTERVAL  # seconds of silence before an SSE keep-alive
    limits: ReplyLimits = field(default_factory=ReplyLimits)  # --max-request-seconds, --max-output-tokens
    heartbeat_interval: float = HEARTBEAT_INTERVAL
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT
    max_buffered: int = MAX_BUFFERED  # unread replies per request before a slow reader is cut off
    drain_timeout: float = 30.0  # on shutdown, seconds in-flight replies get before they are cut
    docs: bool = True  # serve /openapi.json and /docs
    strict_fields: bool = False  # an unknown request field is a 400, not ignored (--strict-fields)
    wire: ClientKeys | None = None  # CURVE keys of the wire to the workers (None: in the clear)


class Gateway:
    """The state one gateway process keeps: its workers and the model they serve."""

    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.workers = WorkerPool(settings.worker, settings.heartbeat_interval, settings.heartbeat_timeout,
                                  max_buffered=settings.max_buffered, policy=settings.route,
                                  queue_tokens=settings.route_queue_tokens, wire=settings.wire)
        self._view: ModelView | None = None
        self._viewer: asyncio.Task | None = None
        self.cut: asyncio.Event | None = None  # set when the drain timeout runs out (lifespan)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._toolless_models: set[str] = set()  # models already logged as having no tool convention

    async def start(self) -> None:
        """In the server's event loop: connect to the worker; the drain timer will run in this loop."""
        self.cut, self._loop = asyncio.Event(), asyncio.get_running_loop()
        await self.workers.start()
        self._viewer = asyncio.create_task(self._keep_view(), name="model-view")

    async def close(self) -> None:
        if self._viewer is not None:
            self._viewer.cancel()
        await self.workers.close()

    async def _keep_view(self) -> None:
        """Build the model's view (tokenizer, encoder, template) as soon as a worker's card
        arrives, and again when a new card does, in a thread: the gateway answers ready only
        once it is built, and no request waits for it, nor stalls the others while it is made."""
        while True:
            card = self.workers.card
            if card is not None and (self._view is None or self._view.card is not card):
                try:
                    view = await asyncio.to_thread(ModelView.from_card, card)
                except Exception:  # the card's tokenizer refused: requests say why (``view``)
                    log.exception("the model card of %s could not be read", card.model_id)
                    await asyncio.sleep(1.0)
                    continue
                if self.workers.card is card:
                    self._view = view
                    give_back_freed_memory()  # what building the tokenizer freed
            await asyncio.sleep(0.05)

    @property
    def serving(self) -> bool:
        """A worker's card has come and the view of its model is built."""
        card = self.workers.card
        return card is not None and self._view is not None and self._view.card is card

    def begin_drain(self) -> None:
        """Shutdown began (any thread, a signal handler too): replies still running when the
        drain timeout is almost over end with an error event in their dialect, before the HTTP
        server drops their connections at the timeout itself."""
        loop, cut = self._loop, self.cut
        if loop is None or cut is None:
            return
        timeout = self.settings.drain_timeout
        delay = max(0.0, timeout - min(1.0, timeout / 10))
        loop.call_soon_threadsafe(loop.call_later, delay, cut.set)

    async def read(self, request: Request, work: Callable[[dict[str, Any], ModelView], Answer]) -> Answer:
        """``work`` done on the request's JSON body and the model, in a thread: parsing, rendering
        and tokenizing a large body take seconds of CPU, and this gateway's other streams go on."""
        raw = await request.body()
        view = self.view()
        tolerance = self.tolerance(request)

        def tolerant_work() -> Answer:
            with tolerating(tolerance):
                return work(parse_json_object(raw), view)

        return await asyncio.to_thread(tolerant_work)

    def tolerance(self, request: Request) -> FieldTolerance:
        """The request's rule for unknown fields, kept in its state for ``ignored_header``."""
        tolerance = FieldTolerance(strict=self.settings.strict_fields, endpoint=request.url.path)
        request.state.field_tolerance = tolerance
        return tolerance

    def view(self) -> ModelView:
        card = self.workers.card
        if card is None:
            raise WorkerUnavailableError(
                self.workers.version_error or "the model is not ready yet (the worker is loading or unreachable)")
        if self._view is None or self._view.card is not card:
            self._view = ModelView.from_card(card)
            give_back_freed_memory()  # what building the tokenizer freed
        return self._view

    def _log_toolless(self, model_id: str) -> None:
        if model_id not in self._toolless_models:
            self._toolless_models.add(model_id)
            log.warning("a request sent tools, but the model %s has no tool-call convention: it calls no tool "
                        "unless tool_choice forces one (said once; each such reply carries %s)", model_id,
                        WARNING_HEADER)

    async def run(self, request: Request, dialect: ModuleType) -> Response:
        raw = await request.body()
        view = self.view()
        # JSON, the dialect's parse, the template and the tokenizer take a large body seconds of
        # CPU: in a thread, so this gateway's other streams, heartbeats and /health go on.
        neutral, prepared = await asyncio.to_thread(_read_request, raw, dialect, view, request.headers,
                                                    self.tolerance(request))
        neutral.tenant = getattr(request.state, TENANT, "")
        events = access_log.observe(request.scope, neutral.stream,
                                    generate(view, self.workers, neutral, prepared, self.settings.ping_interval,
                                             self.cut, self.settings.limits))
        first = await _first_started(events)
        # which cartridges (KV prefixes) the worker put before this conversation
        served = {CARTRIDGES_HEADER: ",".join(first.cartridges)} if first.cartridges else {}
        if first.placement is not None:
            served[WORKER_HEADER] = first.placement.worker
        served.update(ignored_header(request))
        if neutral.tools and view.tool_call_tags is None:
            served[WARNING_HEADER] = NO_TOOL_CONVENTION
            self._log_toolless(view.model_id)
        if neutral.stream:
            response = sse.streaming_response(_stream_body(dialect, neutral, view, first, events))
            response.headers.update(served)
            return response
        completion = Completion()
        completion.add(first)
        async with _abort_on_disconnect(request) as hangup, aclosing(events):
            async for event in events:
                completion.add(event)
        if hangup.client_gone:  # nobody reads this; the access log has its 499 line
            return Response(status_code=access_log.CLIENT_GONE)
        finish = completion.finish
        if finish is None or finish.reason == "error":
            raise LmserveError(finish.error if finish and finish.error else "generation failed")
        if finish.usage.truncated:  # a stream says it in its usage alone: its headers are long gone
            served[TRUNCATED_HEADER] = finish.usage.truncated
        return JSONResponse(dialect.render(neutral, view, completion), headers=served)


def _read_request(raw: bytes, dialect: ModuleType, view: ModelView, headers: Any, tolerance: FieldTolerance
                  ) -> tuple[NeutralRequest, tuple[ToolPlan, list[int]]]:
    with tolerating(tolerance):
        neutral = dialect.parse(parse_json_object(raw), view, headers)
    return neutral, prepare(view, neutral)


def ignored_header(request: Request) -> dict[str, str]:
    """``x-lmserve-ignored-fields``: the paths of the unknown fields the request's parse ignored."""
    tolerance: FieldTolerance | None = getattr(request.state, "field_tolerance", None)
    return {IGNORED_FIELDS_HEADER: ", ".join(tolerance.ignored)} if tolerance and tolerance.ignored else {}


async def _first_started(events: AsyncIterator[Event]) -> Started:
    """Wait for the worker to accept; errors before that become ordinary HTTP errors."""
    while True:
        event = await events.__anext__()
        if isinstance(event, Started):
            return event
        if not isinstance(event, Ping):
            raise LmserveError(f"unexpected {type(event).__name__} before the request started")


async def _stream_body(dialect: ModuleType, neutral, view: ModelView, first: Event,
                       events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    async def replay() -> AsyncIterator[Event]:
        yield first
        async for event in events:
            yield event

    async with aclosing(events), aclosing(replay()) as replayed, \
            aclosing(dialect.stream(neutral, view, replayed)) as chunks:
        async for chunk in chunks:
            yield chunk


@dataclass
class Hangup:
    """Whether the client of a whole (non-streamed) reply hung up before it was ready."""

    client_gone: bool = False


@asynccontextmanager
async def _abort_on_disconnect(request: Request):
    """Cancel the surrounding work if the client hangs up before a whole answer is ready. That
    cancellation ends here, with ``client_gone`` set: a client leaving is an access-log line
    (499), not an error with a CancelledError traceback."""
    task = asyncio.current_task()
    assert task is not None
    hangup = Hangup()

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                hangup.client_gone = True
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        yield hangup
    except asyncio.CancelledError:
        # ours alone is taken back; a cancellation from elsewhere too (shutdown) goes on
        if not hangup.client_gone or task.uncancel() > 0:
            raise
    finally:
        watcher.cancel()


def models_body(view: ModelView, created: int) -> dict[str, Any]:
    """One body both SDKs accept: OpenAI's list and Anthropic's page of model infos."""
    model_id = view.model_id
    entry = {"id": model_id, "object": "model", "created": created, "owned_by": "lmserve",
             "type": "model", "display_name": model_id,
             "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
             "max_input_tokens": view.context_budget, "context_length": view.context_budget,
             # what a request's unset sampling fields take: the model file's, the worker's flags over it
             "sampling_defaults": view.card.sampling.given(),
             # what the model can be asked for beyond text (the playground reads these)
             "reasoning": view.has_reasoning_channel, "tool_calls": view.tool_call_tags is not None,
             # the KV prefixes a request may name (its "cartridges" field), the one served to
             # those that name none, and a fleet's documents (chosen per conversation)
             "cartridges": view.card.capabilities.cartridges,
             "default_cartridge": view.card.capabilities.default_cartridge,
             "fleet": view.card.capabilities.fleet}
    return {"object": "list", "data": [entry], "has_more": False, "first_id": model_id, "last_id": model_id}


def package_version() -> str:
    try:
        return importlib.metadata.version("lmserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was not installed
        return "0+source"


VERSION = package_version()
# /docs renders with Swagger UI's scripts and styles as the fastapi-offline package ships them,
# served by the gateway itself under DOCS_ASSETS (open like /docs, gateway.edge): from a CDN the
# page would stay blank on a host with no way out.
SWAGGER_UI = importlib.resources.files("fastapi_offline") / "static"
DOCS_ASSETS = "/docs/assets"
CARTRIDGES_HEADER = "x-lmserve-cartridges"
WORKER_HEADER = "x-lmserve-worker"  # the worker (host:pid) that took the request
IGNORED_FIELDS_HEADER = "x-lmserve-ignored-fields"  # unknown fields a request sent (gateway.request_fields)
# on a reply to a request with tools when the model has no tool-call convention (gateway.tool_calls)
WARNING_HEADER = "x-lmserve-warning"
# on a whole reply a server limit cut: deadline (--max-request-seconds) or max_output_tokens
TRUNCATED_HEADER = "x-lmserve-truncated"
NO_TOOL_CONVENTION = "the served model has no tool-call convention; it calls no tool unless tool_choice forces one"
# The playground (GET / from a browser): one static page that talks to the API like any client.
PLAYGROUND = (Path(__file__).parent / "static" / "playground.html").read_text(encoding="utf-8")


def create_app(settings: GatewaySettings) -> FastAPI:
    gateway = Gateway(settings)
    started_at = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(title="lmserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway

    @app.exception_handler(LmserveError)
    async def on_lmserve_error(request: Request, error: LmserveError) -> Response:
        if error.status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, error.message)
        return error_response(dialect_for_path(request.url.path, request.headers), error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> Response:
        dialect = dialect_for_path(request.url.path, request.headers)
        if error.status_code == 404:
            return error_response(dialect, NotFoundError(f"there is no {request.url.path} on this server"))
        wrapped = InvalidRequestError(f"{request.method} is not allowed on {request.url.path}")
        wrapped.status = error.status_code
        return error_response(dialect, wrapped)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, error: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(dialect_for_path(request.url.path, request.headers),
                              LmserveError(f"internal error: {type(error).__name__}"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.run(request, openai_chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.run(request, openai_completions)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await gateway.run(request, openai_responses)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        raise NotFoundError(f"response {response_id!r} is not stored: this server is stateless (store is never kept)")

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await gateway.run(request, anthropic_messages)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        count = await gateway.read(
            request, lambda body, view: anthropic_messages.count_tokens(body, view, request.headers))
        return JSONResponse({"input_tokens": count}, headers=ignored_header(request))

    @app.post("/v1/responses/input_tokens")
    async def responses_input_tokens(request: Request) -> Response:
        count = await gateway.read(
            request, lambda body, view: openai_responses.input_tokens(body, view, request.headers))
        return JSONResponse({"object": "response.input_tokens", "input_tokens": count}, headers=ignored_header(request))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        tokens = await gateway.read(request, lambda body, view: tokenizing.tokenize(body, view, request.headers))
        return JSONResponse(tokens, headers=ignored_header(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return JSONResponse(await gateway.read(request, tokenizing.detokenize), headers=ignored_header(request))

    @app.post("/v1/embeddings")
    async def create_embeddings(request: Request) -> Response:
        asked = await gateway.read(request, embeddings.parse)
        answer = await embeddings.embed(gateway.workers, asked.inputs)
        return JSONResponse(await asyncio.to_thread(embeddings.render, asked, answer), headers=ignored_header(request))

    # LM Studio's listing, which routers read for the loaded context and the model's quantization
    @app.get("/api/v0/models")
    async def lmstudio_models_v0() -> Response:
        return JSONResponse(lmstudio_models.v0_list(gateway.view()))

    @app.get("/api/v0/models/{model_id:path}")
    async def lmstudio_model_v0(model_id: str) -> Response:
        return JSONResponse(lmstudio_models.v0_entry(gateway.view(), model_id))

    @app.get("/api/v1/models")
    async def lmstudio_models_v1() -> Response:
        return JSONResponse(lmstudio_models.v1_list(gateway.view()))

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(models_body(gateway.view(), started_at))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        body = models_body(gateway.view(), started_at)["data"][0]
        return JSONResponse({**body, "id": model_id})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/health")
    async def health(request: Request) -> Response:
        workers = gateway.workers
        card = workers.card if gateway.serving else None
        if not getattr(request.state, KEY_HELD, True):  # without the API key: ready or not, nothing more
            return JSONResponse({"status": "loading" if card is None else "ok"},
                                status_code=503 if card is None else 200)
        if card is None:
            return JSONResponse({"status": "loading", "error": workers.version_error,
                                 "workers": workers.describe()}, status_code=503)
        waiting, running = workers.worker_load
        return JSONResponse({"status": "ok", "model": card.model_id,
                             "worker": {"waiting": waiting, "running": running}, "workers": workers.describe()})

    if settings.docs:
        @app.get("/openapi.json")
        async def openapi_document() -> Response:
            return JSONResponse(openapi.document(VERSION, strict_fields=settings.strict_fields))

        @app.get("/docs")
        async def openapi_page() -> Response:
            # no validator badge either: Swagger UI would fetch it from validator.swagger.io
            return get_swagger_ui_html(openapi_url="/openapi.json", title="lmserve API",
                                       swagger_js_url=DOCS_ASSETS + "/swagger-ui-bundle.js",
                                       swagger_css_url=DOCS_ASSETS + "/swagger-ui.css",
                                       swagger_favicon_url=DOCS_ASSETS + "/favicon.png",
                                       swagger_ui_parameters={"validatorUrl": None})

        app.mount(DOCS_ASSETS, StaticFiles(directory=str(SWAGGER_UI)), name="docs-assets")

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root(request: Request) -> Response:
        # a browser gets the playground; probes and API clients the status they always got
        if "text/html" in request.headers.get("accept", ""):
            return HTMLResponse(PLAYGROUND)
        return JSONResponse({"status": "ok"})

    @app.api_route("/api/hello", methods=["GET", "HEAD"])
    async def hello() -> Response:
        return JSONResponse({"status": "ok"})

    # the keys in force, kept where a SIGHUP handler can reload them (gateway.main)
    app.state.api_keys = KeyRing(settings.edge.api_keys, settings.edge.api_keys_file)
    app.add_middleware(EdgeMiddleware, settings=settings.edge, keys=app.state.api_keys)
    app.add_middleware(AccessLogMiddleware)  # outermost: edge refusals are logged too
    return app
