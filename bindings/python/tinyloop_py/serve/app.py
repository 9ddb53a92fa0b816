"""The Ray Serve application: engine replicas behind an OpenAI-compatible ingress.

Two deployments. ``TinyLoopEngine``: one :class:`tinyloop_py.Engine` per replica, on a GPU of
its own (``device=cuda``: ``num_gpus=1``) or on ``threads`` CPU cores; it tokenizes a checked
request, runs it and streams its text. ``OpenAIIngress``: the HTTP routes of ``tinyloop MODEL
serve`` (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``) through Serve's FastAPI ingress; it checks each request and sends it to an engine
replica through a handle whose router is :class:`~tinyloop_py.serve.router.PrefixRouter`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import os
import threading
import time
import uuid
from typing import Any, AsyncIterator, Dict, Literal, Optional, Tuple

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.serve.config import AutoscalingConfig, DeploymentActorConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.metrics import Gauge

import tinyloop_py as tl

from . import api
from .metrics import ENGINE_METRICS, IngressMetrics, StatsBoard
from .router import PrefixRouter

STATS_ACTOR = "tinyloop-stats"
REPLICA_HEADER = "x-tinyloop-replica"

#: Options that go to each replica's ``tinyloop_py.Model`` and ``tinyloop_py.Engine`` as they are
#: (those left unset take the binding's defaults), and to Serve's ``AutoscalingConfig``.
MODEL_ARGS = ("device", "kv_mode", "max_seq_len")
ENGINE_ARGS = ("max_step_rows", "max_running", "page_size", "pool_positions", "max_queued")
AUTOSCALING_ARGS = ("min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s",
                    "downscale_delay_s", "look_back_period_s", "metrics_interval_s")


class Options(BaseModel):
    """The application's arguments (``serve run tinyloop_py.serve:app KEY=VALUE ...``, or
    ``args`` of an application in a Serve config file). docs/DEPLOY.md describes each."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str
    name: Optional[str] = None
    loops: Optional[int] = Field(None, ge=1)
    # Each replica: MODEL_ARGS, ENGINE_ARGS, and the CPU threads of its engine.
    device: Literal["cpu", "cuda"] = "cpu"
    kv_mode: Optional[str] = None
    max_seq_len: Optional[int] = Field(None, ge=0)
    max_step_rows: Optional[int] = Field(None, ge=1)
    max_running: Optional[int] = Field(None, ge=1)
    page_size: Optional[int] = Field(None, ge=1)
    pool_positions: Optional[int] = Field(None, ge=0)
    max_queued: Optional[int] = Field(None, ge=1)
    threads: int = Field(1, ge=1)
    # How many replicas: a fixed count, or AUTOSCALING_ARGS.
    replicas: Optional[int] = Field(None, ge=1)
    min_replicas: int = Field(1, ge=1)
    max_replicas: Optional[int] = Field(None, ge=1)
    target_ongoing_requests: float = Field(16, gt=0)
    upscale_delay_s: float = Field(10, ge=0)
    downscale_delay_s: float = Field(300, ge=0)
    look_back_period_s: float = Field(10, gt=0)
    metrics_interval_s: float = Field(2, gt=0)
    # Which replica takes a request, and what happens when it fails.
    routing: Literal["prefix", "pow2"] = "prefix"
    prefix_block_chars: int = Field(16, ge=1)
    prefix_min_match_chars: int = Field(64, ge=1)
    prefix_max_imbalance: int = Field(8, ge=0)
    max_ongoing_requests: int = Field(64, ge=1)
    retries: int = Field(2, ge=0)
    # Serve's care of the replicas.
    ingress_replicas: int = Field(1, ge=1)
    graceful_shutdown_timeout_s: float = Field(60, gt=0)
    health_check_period_s: float = Field(5, gt=0)
    stats_period_s: float = Field(1, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, args: Any) -> Any:
        if isinstance(args, dict):
            unknown = sorted(set(args) - set(cls.model_fields))
            if unknown:
                raise ValueError(
                    f"unknown option {', '.join(map(repr, unknown))} for tinyloop_py.serve:app "
                    f"(options: {', '.join(cls.model_fields)})"
                )
            if args.get("replicas") is not None and args.get("max_replicas") is not None:
                raise ValueError(
                    "give replicas (a fixed count) or min_replicas / max_replicas (autoscaling), "
                    "not both"
                )
        return args

    @model_validator(mode="after")
    def _check(self) -> "Options":
        if not os.path.isfile(self.model):
            raise ValueError(f"model {self.model!r} is not a file")
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})"
            )
        return self

    def args(self, names: Tuple[str, ...]) -> Dict[str, Any]:
        """The options ``names`` that are set, as keyword arguments."""
        return self.model_dump(include=set(names), exclude_none=True)

    @property
    def served_name(self) -> str:
        return self.name or os.path.splitext(os.path.basename(self.model))[0]

    def engine_deployment(self) -> Dict[str, Any]:
        """The ``.options()`` of the engine deployment."""
        actor: Dict[str, Any] = {
            "num_cpus": self.threads,
            "runtime_env": {"env_vars": {"RAYON_NUM_THREADS": str(self.threads)}},
        }
        if self.device == "cuda":
            actor["num_gpus"] = 1
        out: Dict[str, Any] = {
            "ray_actor_options": actor,
            "max_ongoing_requests": self.max_ongoing_requests,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
            "health_check_period_s": self.health_check_period_s,
            "deployment_actors": [
                DeploymentActorConfig(
                    name=STATS_ACTOR,
                    actor_class=ray.remote(StatsBoard),
                    init_kwargs={"ttl_s": max(10.0, 5 * self.stats_period_s)},
                    actor_options={"num_cpus": 0},
                )
            ],
        }
        if self.max_replicas is None:
            out["num_replicas"] = self.replicas or 1
        else:
            out["autoscaling_config"] = AutoscalingConfig(**self.args(AUTOSCALING_ARGS))
        if self.routing == "prefix":
            out["request_router_config"] = RequestRouterConfig(
                request_router_class=PrefixRouter,
                request_router_kwargs={
                    "block_chars": self.prefix_block_chars,
                    "min_match_chars": self.prefix_min_match_chars,
                    "max_imbalance": self.prefix_max_imbalance,
                },
            )
        return out


# --------------------------------------------------------------------------------------------
# The engine replicas


class TinyLoopEngine:
    """One engine over one model. ``generate`` streams a request's events: first
    ``{"accepted": replica, "token_ids": bool}`` (whether the pieces carry token ids) or
    ``{"error": [status, message]}``, then ``{"text": piece, "tokens": ids}`` items and an
    ``{"end": ...}`` or ``{"error": ...}``. Serve drains a stopping replica (it
    waits for the requests in flight, up to ``graceful_shutdown_timeout_s``) before it calls
    ``__del__``, which closes the engine."""

    def __init__(self, options: Dict[str, Any]):
        o = Options(**options)
        self.loops = o.loops
        self.model = tl.Model(o.model, log=False, **o.args(MODEL_ARGS))
        self.engine = tl.Engine(self.model, **o.args(ENGINE_ARGS))
        self.prompter = api.Prompter(self.model, o.model)
        replica_id = serve.get_replica_context().replica_id
        self.replica = replica_id.unique_id
        #: Each running request's events come from a thread of this pool (the engine's waits
        #: block); Serve sends a replica at most max_ongoing_requests at once.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=o.max_ongoing_requests, thread_name_prefix="tinyloop-request")
        self._lock = threading.Lock()
        self._totals = {"prompt_tokens": 0, "cached_tokens": 0}
        self._gauges = {key: Gauge(name, description=help) for name, _, help, key in ENGINE_METRICS}
        self._stats_period_s = o.stats_period_s
        self._stopped = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, name="tinyloop-stats",
                                          daemon=True)
        self._reporter.start()

    # ---- serving

    async def generate(self, job: api.Job) -> AsyncIterator[Dict[str, Any]]:
        try:
            prompt = self.prompter.tokens(job)
            args = self.prompter.submit_args(job, prompt, self.loops)
            request = self.engine.submit(prompt, **args)
        except api.ApiError as e:
            yield {"error": [e.status, e.message]}
            return
        except Exception as e:  # the binding's checks: bad values, a full queue, a closed engine
            e = api.from_library(e)
            yield {"error": [e.status, e.message]}
            return
        token_ids = self.prompter.token_ids(job)
        yield {"accepted": self.replica, "token_ids": token_ids}
        loop = asyncio.get_running_loop()
        pending: collections.deque = collections.deque()
        ready = asyncio.Event()

        def emit(item: Dict[str, Any]) -> None:
            pending.append(item)
            loop.call_soon_threadsafe(ready.set)

        self._pool.submit(self._pump, request, job.stop, len(prompt), token_ids, emit)
        ended = False
        try:
            while not ended:
                await ready.wait()
                ready.clear()
                while pending and not ended:
                    item = pending.popleft()
                    # Pieces that arrived meanwhile go out as one.
                    while "text" in item and pending and "text" in pending[0]:
                        later = pending.popleft()
                        item = {"text": item["text"] + later["text"],
                                "tokens": item["tokens"] + later["tokens"]}
                    ended = "text" not in item
                    yield item
        finally:
            if not ended:  # the caller went away: stop the request
                _cancel(request)

    def _pump(self, request: tl.Request, stops, prompt_tokens: int, token_ids: bool,
              emit) -> None:
        """The request's tokens as text (streaming detokenizer, then the stop strings), on a
        pool thread; with ``token_ids``, a piece for every token, carrying it."""
        text = self.prompter.text_stream()
        stop = api.StopStrings(stops)
        tokens, held = 0, []
        try:
            for token in request:
                tokens += 1
                if token_ids:
                    held.append(int(token))
                out, stopped = stop.push(text.push(token))
                if out or held:
                    emit({"text": out, "tokens": held})
                    held = []
                if stopped:
                    # Tokens the engine made past the stop string are not returned.
                    _cancel(request)
                    emit({"end": api.End("stop", prompt_tokens, None, tokens)})
                    return
            stats = request.stats or {}
            out, stopped = stop.push(text.finish())
            if not stopped:
                out += stop.finish()
            if out:
                emit({"text": out, "tokens": []})
            finish = "stop" if stopped or stats.get("finish") == "stop" else "length"
            with self._lock:
                self._totals["prompt_tokens"] += prompt_tokens
                self._totals["cached_tokens"] += stats.get("cached_tokens", 0)
            emit({"end": api.End(finish, prompt_tokens, stats.get("cached_tokens"),
                                 stats.get("tokens", tokens))})
        except Exception as e:
            e = api.from_library(e)
            emit({"error": [e.status, e.message]})

    # ---- health, stats, shutdown

    def check_health(self) -> None:
        """Serve calls this every ``health_check_period_s``; raising marks the replica
        unhealthy and Serve replaces it. A closed engine (its thread failed) raises."""
        self.engine.stats()

    def stats(self) -> Dict[str, int]:
        """The engine's stats, plus the prompt and cached tokens of the requests it finished."""
        out = self.engine.stats()
        with self._lock:
            out.update(self._totals)
        return out

    def _report_loop(self) -> None:
        period_s, board = self._stats_period_s, None
        while not self._stopped.wait(period_s):
            try:
                stats = self.stats()
            except tl.TinyLoopError:
                continue
            for key, gauge in self._gauges.items():
                gauge.set(stats.get(key, 0))
            try:
                board = board or serve.get_deployment_actor(STATS_ACTOR)
                ray.get(board.put.remote(self.replica, stats), timeout=period_s + 5)
            except Exception:  # the board is being (re)started: find it again next period
                board = None
        # Stopping: leave the board after the last report (a replica that dies without
        # stopping leaves it when its entry expires).
        try:
            board = board or serve.get_deployment_actor(STATS_ACTOR)
            ray.get(board.put.remote(self.replica, None), timeout=5)
        except Exception:
            pass

    async def deployment_stats(self) -> Dict[str, Dict[str, int]]:
        """Every replica's latest stats (from the deployment's stats board)."""
        try:
            return await serve.get_deployment_actor(STATS_ACTOR).snapshot.remote()
        except Exception:  # the board is being (re)started
            return {self.replica: self.stats()}

    def __del__(self) -> None:
        """Serve calls this once the replica has drained, and Python again when it collects
        the object: the engine and the model close once."""
        stopped = getattr(self, "_stopped", None)
        if stopped is None or stopped.is_set():
            return  # __init__ failed before the engine was ready, or this ran already
        stopped.set()
        # Bounded: a report under way (period_s + 5 s at most), then the board's removal (5 s).
        self._reporter.join(timeout=self._stats_period_s + 11)
        self.engine.close()
        self.model.close()
        self._pool.shutdown(wait=False)


def _cancel(request: tl.Request) -> None:
    try:
        request.cancel()
    except (ValueError, tl.TinyLoopError):
        pass  # it has ended already


# --------------------------------------------------------------------------------------------
# The HTTP ingress

http = FastAPI(title="TinyLoop", docs_url=None, redoc_url=None)


class OpenAIIngress:
    """The OpenAI routes. A request whose engine replica dies before the client got any of its
    text (a request that is not streamed gets its text at the end) is sent to another replica,
    up to ``retries`` times; a stream that had returned text ends with an error event after
    it, which the client sees."""

    def __init__(self, engine: DeploymentHandle, name: str, retries: int):
        self.engine = engine
        self.stream = engine.options(stream=True)
        self.name = name
        self.retries = retries
        self.metrics = IngressMetrics()

    @http.get("/health")
    async def health(self) -> PlainTextResponse:
        return PlainTextResponse("ok")

    @http.get("/v1/models")
    async def models(self) -> JSONResponse:
        return JSONResponse(api.models_list(self.name))

    @http.get("/metrics")
    async def prometheus(self) -> Response:
        replicas = await self.engine.deployment_stats.remote()
        return Response(self.metrics.render(replicas),
                        media_type="text/plain; version=0.0.4")

    @http.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._respond(api.COMPLETION, request)

    @http.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._respond(api.CHAT, request)

    def _failed(self, kind: str, e: api.ApiError) -> JSONResponse:
        self.metrics.count(kind, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    async def _respond(self, kind: str, request: Request) -> Response:
        started = time.monotonic()
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return self._failed(kind, api.invalid(f"the request body is not JSON: {e}"))
        try:
            job = api.parse(kind, body)
        except api.ApiError as e:
            return self._failed(kind, e)
        events = self._events(job)
        first = await events.__anext__()
        if "error" in first:
            return self._failed(kind, api.ApiError(*first["error"]))
        reply = api.Reply(kind, self.name, uuid.uuid4().hex[:24], first["token_ids"])
        headers = {REPLICA_HEADER: first["accepted"]}
        if job.stream:
            return StreamingResponse(self._sse(reply, events, started), headers=headers,
                                     media_type="text/event-stream")
        text, tokens, first_text = [], [], True
        async for item in events:
            if "accepted" in item:  # sent again to another replica: its text starts anew
                headers[REPLICA_HEADER] = item["accepted"]
                text, tokens = [], []
            elif "text" in item:
                if first_text:
                    self.metrics.first(started)
                    first_text = False
                text.append(item["text"])
                tokens.extend(item["tokens"])
            elif "end" in item:
                end = item["end"]
                self.metrics.finished(kind, started, end.prompt_tokens, end.completion_tokens)
                return JSONResponse(reply.complete("".join(text), end, tokens), headers=headers)
            elif "error" in item:
                return self._failed(kind, api.ApiError(*item["error"]))
        return self._failed(kind, _UNFINISHED)

    async def _sse(self, reply: api.Reply, events, started: float) -> AsyncIterator[str]:
        def data(value: Dict[str, Any]) -> str:
            return f"data: {json.dumps(value)}\n\n"

        if reply.kind == api.CHAT:
            yield data(reply.chunk("", role="assistant"))
        first_text = True
        async for item in events:
            if "text" in item:
                if first_text:
                    self.metrics.first(started)
                    first_text = False
                yield data(reply.chunk(item["text"], tokens=item["tokens"]))
            elif "end" in item:
                end = item["end"]
                self.metrics.finished(reply.kind, started, end.prompt_tokens, end.completion_tokens)
                yield data(reply.chunk("", finish=end.finish))
                yield "data: [DONE]\n\n"
                return
            elif "error" in item:
                break
        else:
            item = {"error": [_UNFINISHED.status, _UNFINISHED.message]}
        e = api.ApiError(*item["error"])
        self.metrics.count(reply.kind, e.status)
        yield data(e.body())

    async def _events(self, job: api.Job) -> AsyncIterator[Dict[str, Any]]:
        """The request's events from an engine replica. When the replica dies before the
        request returned any text to the client, the request goes to another, whose
        ``{"accepted": ...}`` tells a collector to drop what it had; a stream that had returned
        text ends with an error event instead."""
        attempt, sent_text = 0, False
        while True:
            try:
                async for item in self.stream.generate.remote(job):
                    sent_text = sent_text or "text" in item
                    yield item
                return
            except ray.exceptions.RayActorError as e:
                cause = type(e).__name__
                if job.stream and sent_text:
                    message = (f"the engine replica serving this request died ({cause}) after "
                               "it returned part of the text: send the request again")
                elif attempt >= self.retries:
                    message = (f"the engine replicas tried for this request died ({cause}; "
                               f"{attempt + 1} tries): send the request again")
                else:
                    attempt += 1
                    self.metrics.retried()
                    continue
                yield {"error": [503, message]}
                return


_UNFINISHED = api.ApiError(500, "the engine replica ended the request without finishing it")


# --------------------------------------------------------------------------------------------
# The application builder

EngineDeployment = serve.deployment(TinyLoopEngine, name="TinyLoopEngine")
IngressDeployment = serve.deployment(serve.ingress(http)(OpenAIIngress), name="OpenAIIngress")


def build(options: Options) -> "serve.Application":
    """The application for checked options."""
    engine = EngineDeployment.options(**options.engine_deployment()).bind(
        options.model_dump())
    ingress = IngressDeployment.options(
        num_replicas=options.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(1000, 4 * options.max_ongoing_requests),
        graceful_shutdown_timeout_s=options.graceful_shutdown_timeout_s,
    )
    return ingress.bind(engine, options.served_name, options.retries)


def app(args: Dict[str, Any]) -> "serve.Application":
    """``serve run tinyloop_py.serve:app model=PATH [replicas=N] [device=cpu|cuda] ...``: the
    application for ``args`` (strings from the command line, or values from a config file).
    An unknown key or a bad value is an error naming it."""
    return build(Options(**args))
