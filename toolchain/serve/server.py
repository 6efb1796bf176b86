"""``dstc serve``: an artifact behind an OpenAI-compatible HTTP server (uvicorn), with continuous batching.

``Service`` ties the parts together: the artifact and its tokenizer (prompts and chat templates are tokenized
here, with the tokenizer ``dstc generate`` uses), the engine over the artifact's backend, the metrics and the
health monitor. ``serve`` binds the socket first (so a port in use is an error before the artifact is even
opened), starts answering ``/health`` with ``loading`` at once, and loads the model in the engine's thread.

What one client can make the server hold is bounded (``ServeSettings``; docs/serve.md "Serving"): connections, the
time to send a request's headers and its body, the body's size, a prompt's characters (checked before it is tokenized),
the messages of a chat, the time a stream waits for a client that reads nothing. An address other than the
loopback's is served only with an API key, or when told to serve it without one.
"""

from __future__ import annotations

import logging
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn

from toolchain.errors import InputError
from toolchain.runtime.artifact import Artifact, open_artifact
from toolchain.runtime.batch_rows import batch_variance
from toolchain.runtime.batched_drafts import check_batch_speculation
from toolchain.runtime.generate import prompt_ids
from toolchain.runtime.memory import artifact_runtime_bytes, require_artifact_memory
from toolchain.runtime.sampling import Sampling
from toolchain.serve.api import ApiError, create_app
from toolchain.serve.auth import check_exposure, is_loopback
from toolchain.serve.connections import guarded_protocol
from toolchain.serve.engine_options import GENAI, engine_options, serving_engine
from toolchain.serve.engine_process import RemoteEngine
from toolchain.serve.health import (
    DEFAULT_THRESHOLDS,
    HealthMonitor,
    merge_thresholds,
    parse_threshold,
    recipe_thresholds,
)
from toolchain.serve.metrics import ServerMetrics
from toolchain.serve.settings import ServeSettings

if TYPE_CHECKING:
    from toolchain.serve.replicated import ReplicatedEngine

DRAIN_S = 30  # SIGTERM lets the requests in flight finish for this long (Kubernetes' default grace period)
DEFAULT_MAX_CONTEXT = 4096  # when the model's own is longer: the OpenVINO KV cache is allocated for it


class Service:
    def __init__(self, artifact: Artifact, settings: ServeSettings | None = None) -> None:
        settings = settings or ServeSettings()
        self.artifact = artifact
        self.settings = settings
        # what clients ask for: --served-model-name (the first one is the name given back), else the directory's
        self.model_names = list(dict.fromkeys(settings.served_model_name)) or [artifact.path.resolve().name]
        self.model_name = self.model_names[0]
        self.determinism: str | None = None  # the startup log's line on --deterministic
        self.created = int(time.time())
        model_context = artifact.context_length
        if settings.max_context is not None:
            if model_context is not None and settings.max_context > model_context:
                raise InputError(f"--max-context {settings.max_context} exceeds the model's context of "
                                 f"{model_context} tokens")
            self.context = settings.max_context
        else:
            self.context = min(model_context or DEFAULT_MAX_CONTEXT, DEFAULT_MAX_CONTEXT)
        if self.context < 2:
            raise InputError(f"a context of {self.context} tokens leaves no room for a prompt and an answer")
        self.tokenizer = artifact.tokenizer()
        # A token stands for at most as many characters as its own string has (a byte-level BPE token's string has
        # a character per byte), so a text longer than this cannot fit the context: refused without tokenizing it.
        self.max_prompt_chars = settings.max_prompt_chars or \
            self.context * max(len(token) for token in self.tokenizer.get_vocab())
        from_recipe = recipe_thresholds(artifact.manifest.recipe.serve if artifact.manifest else None)
        thresholds = merge_thresholds(DEFAULT_THRESHOLDS, from_recipe,
                                      [parse_threshold(t) for t in settings.thresholds])
        self.engine_kind = serving_engine(artifact)  # openvino_genai's pipeline or dstc's runner, decided here once
        self.engine: RemoteEngine | ReplicatedEngine | None = None
        self.health = HealthMonitor(thresholds, window_s=settings.health_window_s, gauges=self._gauges)
        self.metrics = ServerMetrics(self.health, replica_label=settings.replicas is not None)
        self.engine = self._engine()
        self.metrics.attach(self.engine, artifact, self.model_name)
        generation = artifact.generation
        self._default_temperature = float(generation.get("temperature", 1.0)) if generation.get("do_sample") else 0.0
        self._default_top_p = float(generation.get("top_p", 1.0)) if generation.get("do_sample") else 1.0

    def _engine(self) -> RemoteEngine | ReplicatedEngine:
        """The engine, in a process of its own (engine_process.py), over the artifact's backend; with --replicas,
        that many of them on Ray Serve (replicated.py)."""
        s = self.settings
        check_batch_speculation(s, self.artifact, self.context)  # refused here, before an engine starts
        options = engine_options(self.artifact, s, self.engine_kind, context=self.context,
                                 rows_alone=self._deterministic())
        if s.replicas is not None:
            # Ray (the ray extra) loads only with --replicas
            from toolchain.serve.replicated import ReplicatedEngine

            return ReplicatedEngine(options, replicas=s.replicas, address=s.ray, max_queue=s.max_queue,
                                    memory_bytes=artifact_runtime_bytes(self.artifact), metrics=self.metrics)
        if s.ray is not None:
            raise InputError("--ray runs replicas on a Ray cluster: give --replicas N too")
        return RemoteEngine(options, max_queue=s.max_queue, observer=self.metrics)

    def _deterministic(self) -> bool:
        """With --deterministic, whether requests must run alone (batch_rows.py) for a request's tokens not to depend
        on its batch; ``determinism`` says what was decided, for the startup log."""
        s = self.settings
        if not s.deterministic:
            return False
        if s.speculate is not None:
            raise InputError("--deterministic decodes each request alone, and --speculate verifies drafts over "
                             "several positions, whose kernels give other bits than one token's on the artifacts "
                             "--deterministic is for: use one of them")
        variance = batch_variance(self.artifact)
        if variance is None:
            self.determinism = (f"--deterministic: nothing to do, {self.artifact.path.name} decodes a request "
                                "bit-equally in any batch (no quantized kernels)")
            return False
        how = ("one request at a time, without prefix caching" if self.engine_kind == GENAI
               else "each request in a batch of its own, one forward per request and step")
        self.determinism = f"--deterministic: {how} ({variance})"
        return True

    def _gauges(self) -> dict[str, float]:
        engine = self.engine
        if engine is None:
            return {}
        return {"queue_depth": engine.queue_depth, "running_batch": engine.running,
                "kv_cache_usage": engine.kv_cache_usage()}

    # -- what the API layer asks -------------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            served = ", ".join(map(repr, self.model_names))
            raise ApiError(404, f"the model {model!r} does not exist here; this server serves {served} "
                                f"(GET /v1/models)", param="model", code="model_not_found")

    def completion_prompt(self, prompt) -> list[int]:
        """Token ids of a completion's prompt: text encoded as ``dstc generate --raw`` does, or token ids."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
            try:
                ids = prompt_ids(self.artifact, prompt, chat=False)
            except InputError as e:
                raise ApiError(400, str(e), param="prompt", code="invalid_utf8") from None
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            vocab = int(self.artifact.config.get("vocab_size") or 0)
            bad = [t for t in prompt if t < 0 or (vocab and t >= vocab)]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt",
                               code="invalid_value")
            ids = list(prompt)
        else:
            raise ApiError(400, "one prompt per request (a string or a list of token ids)", param="prompt",
                           code="invalid_value")
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
        return ids

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation through the artifact tokenizer's chat template, with the assistant's
        generation prompt (as ``dstc generate`` without --raw, for one user message)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "the artifact's tokenizer has no chat template; use /v1/completions",
                           param="messages", code="no_chat_template")
        if len(messages) > self.settings.max_messages:
            raise ApiError(400, f"{len(messages)} messages: this server takes at most {self.settings.max_messages} "
                                f"(dstc serve --max-messages)", param="messages", code="invalid_value")
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)
        except Exception as e:  # a template that refuses the conversation (e.g. roles out of order)
            raise ApiError(400, f"the chat template refused the messages: {e}", param="messages",
                           code="invalid_value") from None
        return list(encoded["input_ids"])

    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"the {param} is {chars} characters; this server takes at most "
                                f"{self.max_prompt_chars} (dstc serve --max-prompt-chars; its context is "
                                f"{self.context} tokens)", param=param, code="context_length_exceeded")

    def budget(self, prompt_tokens: int, requested: int | None, *, default: int | None, param: str) -> int:
        """max_tokens for a request: ``requested`` when it fits the context, else a 400 with the numbers; when not
        given, ``default`` (None: the rest of the context), cut to the room the context leaves."""
        room = self.context - prompt_tokens
        if room < 1:
            raise ApiError(400, f"the prompt is {prompt_tokens} tokens; this server's context is {self.context} "
                                f"tokens, which leaves no room for an answer", param=param,
                           code="context_length_exceeded")
        if requested is None:
            return room if default is None else min(default, room)
        if requested < 1:
            raise ApiError(400, f"max_tokens must be at least 1, not {requested}", param="max_tokens",
                           code="invalid_value")
        if requested > room:
            raise ApiError(400, f"the prompt is {prompt_tokens} tokens and max_tokens is {requested}: "
                                f"{prompt_tokens + requested} exceeds this server's context of {self.context} tokens",
                           param="max_tokens", code="context_length_exceeded")
        return requested

    def sampling(self, params) -> Sampling:
        temperature = self._default_temperature if params.temperature is None else float(params.temperature)
        top_p = self._default_top_p if params.top_p is None else float(params.top_p)
        return Sampling(temperature=temperature, top_p=top_p, seed=params.seed)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, bound before the model loads (port 0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto given, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose proto is TCP,
    # and accepted connections inherit it. With Nagle on, each small SSE chunk after the first waited for the
    # client's delayed ACK: a 16-token stream arrived whole, 40 ms late.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _log_to_stderr() -> None:
    """The server's own log lines (a request's internal error with its id and traceback) on stderr, as they are."""
    logger = logging.getLogger("dstc.serve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _allow_open_files(connections: int) -> None:
    """Raise the soft limit on open files towards what ``connections`` need (each holds a descriptor), within the
    hard limit: at the common default of 1024, accept() would fail long before --max-connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + 256  # the artifact's files, the engine's socket, the runtimes' own
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _uvicorn_config(app, settings: ServeSettings) -> uvicorn.Config:
    # loop: asyncio's, on which connections.py's guards are tested (ray[serve] installs uvloop, which "auto" takes)
    return uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=DRAIN_S, lifespan="on", ws="none",
                          loop="asyncio",
                          http=guarded_protocol(settings.header_timeout_s, settings.stream_idle_timeout_s),
                          timeout_keep_alive=settings.keep_alive_timeout_s, limit_concurrency=settings.max_connections)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM (what an orchestrator stops a service with) is a drain and a clean exit: new
    connections are refused, the requests in flight finish (up to DRAIN_S), a log line says so, and ``serve``
    returns (exit 0) instead of uvicorn raising the signal again once it has shut down (exit 143)."""

    def __init__(self, config: uvicorn.Config, in_flight: Callable[[], str], log: Callable[[str], None]) -> None:
        super().__init__(config)
        self.in_flight, self.log, self.terminated = in_flight, log, False

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
        elif not self.terminated:
            self.terminated = self.should_exit = True
            self.log(f"dstc serve: SIGTERM: draining ({self.in_flight()}; new connections refused; up to {DRAIN_S} "
                     f"s), then stopping")


def serve(artifact_path, settings: ServeSettings, *, host: str = "127.0.0.1", port: int = 8000,
          log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> None:
    """Serve until interrupted (SIGINT / SIGTERM). InputError for a bad artifact, settings or address (one other
    than the loopback's without an API key, unless ``settings.allow_unauthenticated``), and when the model fails
    to load."""
    import asyncio

    check_exposure(host, settings.api_keys, settings.allow_unauthenticated)
    # before the artifact is opened: opening it and its tokenizer took 15 s of a refusal that needs none of it
    sock = bind(host, port)
    try:
        artifact = open_artifact(artifact_path)
        # the engine's process loads it; with --replicas on this machine, each replica's engine at once (on a
        # cluster at --ray ADDRESS, Ray places each replica on a node with the memory it asks for: replicated.py)
        require_artifact_memory(artifact, settings.replicas if settings.replicas and settings.ray is None else 1)
        service = Service(artifact, settings)
    except BaseException:
        sock.close()
        raise
    engine = service.engine
    assert engine is not None  # made by Service
    bound_host, bound_port = sock.getsockname()[:2]
    url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    app = create_app(service)
    _log_to_stderr()
    _allow_open_files(settings.max_connections)
    server = DrainingServer(_uvicorn_config(app, settings),
                            lambda: f"{engine.running} requests running, {engine.queue_depth} waiting", log)

    async def watch() -> None:
        while engine.state == "loading":
            await asyncio.sleep(0.05)
        if engine.state == "ready":
            log(f"dstc serve: ready in {engine.load_seconds:.1f} s (max batch {settings.max_batch}, "
                f"context {service.context} tokens)")
        else:
            server.should_exit = True

    async def main() -> None:
        log(f"dstc serve: {service.model_name} ({artifact.backend}) listening on http://{url_host}:{bound_port}/v1 "
            f"- loading the model")
        if service.determinism:
            log(f"dstc serve: {service.determinism}")
        if not settings.api_keys and not is_loopback(host):
            log(f"dstc serve: warning: {host} is reachable from other machines and any of them may use this server "
                f"(--allow-unauthenticated)")
        watcher = asyncio.create_task(watch())
        try:
            await server.serve(sockets=[sock])
        finally:
            watcher.cancel()

    asyncio.run(main())
    if server.terminated:
        log("dstc serve: stopped (SIGTERM)")
    if engine.state == "failed":
        raise InputError(f"the model failed to load: {engine.load_error}")
