"""How ``dstc serve`` runs an artifact, and what one client can make the server hold (docs/serve.md "Serving"). The
command's options are generated from these fields (toolchain/cli_options.py): the help is each field's description,
the bounds are checked by the section, from the command line as from Python."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field
from pydantic.config import JsonDict

from toolchain.settings.speculation import SpeculationSettings

SECONDS: JsonDict = {"metavar": "SECONDS"}  # the help's name for the value (toolchain/cli_options.py)


class ServeSettings(SpeculationSettings):
    model_config = ConfigDict(extra="forbid", frozen=True)

    speculate: str | None = Field(
        None, json_schema_extra={"metavar": "prompt-lookup|mtp|draft:ARTIFACT"},
        description="Speculative decoding of the running batch (lossless: the same greedy tokens, and sampling "
                    "follows the same distribution): each step drafts tokens per request by n-gram lookup in its "
                    "text so far, by the artifact's multi-token-prediction layer (built with export.mtp) or by a "
                    "smaller artifact of the same tokenizer, and one forward of the model verifies every request's "
                    "drafts (default: none; openvino_genai's pipeline does its own prompt lookup and draft-model "
                    "speculation, with an OpenVINO draft it pages, and no mtp).")

    deterministic: bool = Field(
        False, description="Batch-invariant greedy decoding: a request gets the tokens it gets when served alone, "
                           "whatever else runs beside it. On an artifact whose kernels give a row other bits in a "
                           "batch (ONNX Runtime INT4/INT8, OpenVINO) each request runs in a batch of its own, one "
                           "forward per request and step (dstc's runner), or one request at a time without prefix "
                           "caching (openvino_genai's pipeline); a no-op on fp32 ONNX Runtime artifacts, which are "
                           "batch-invariant. Not with --speculate.")
    served_model_name: list[str] = Field(
        default_factory=list, json_schema_extra={"metavar": "NAME"},
        description="A name clients ask for the model by (the first is the one /v1/models and responses give). "
                    "Default: the artifact directory's name.")
    access_log: bool = Field(
        True, description="A line per request on stderr: method, path, status, duration, prompt and generated "
                          "tokens, request id.")
    threads: int | None = Field(
        None, ge=1, description="Runtime threads (default: the runtime's choice; with --replicas, each replica's, "
                                "default the CPUs divided among the replicas).")
    replicas: int | None = Field(
        None, ge=1, description="Run this many engine replicas on Ray Serve, each pinned to cores of its own, behind "
                                "this one endpoint (routed by load and prompt prefix; a replica that dies is "
                                "replaced). Default: one engine, without Ray.")
    ray: str | None = Field(
        None, json_schema_extra={"metavar": "ADDRESS"},
        description="With --replicas: the Ray cluster to run them on, from one of its nodes (auto, or its HOST:PORT; "
                    "every node needs dstc and the artifact at the same path). Default: a local Ray started for the "
                    "server and stopped with it.")
    max_batch: int = Field(16, ge=1, description="Requests decoded together in the running batch.")
    max_context: int | None = Field(
        None, ge=2, description="Prompt + generated tokens per request (default: the model's context, at most 4096).")
    max_queue: int = Field(64, ge=0,
                           description="Requests that may wait for a slot; more are refused with 429 and Retry-After.")
    thresholds: list[str] = Field(
        default_factory=list, json_schema_extra={"metavar": "METRIC:warn=X[,ok=Y][,alert=Z]"},
        description="A /health threshold, e.g. ttft_p99_ms:warn=350,ok=250; replaces the recipe's and the default "
                    "for that metric.")
    health_window_s: float = Field(60.0, gt=0, json_schema_extra=SECONDS,
                                   description="/health judges the metrics of this many last seconds.")
    openvino_f32: bool = Field(
        False, description="OpenVINO at f32 compute and KV cache instead of the CPU plugin's defaults (bf16, u8 KV "
                           "cache).")
    prefix_caching: bool = Field(True, description="OpenVINO: reuse the KV cache of repeated prompt prefixes.")
    openvino_runtime_cache: int | None = Field(
        None, ge=0, json_schema_extra={"metavar": "ENTRIES"},
        description="OpenVINO: entries of the CPU plugin's cache of kernels built per input shape "
                    "(CPU_RUNTIME_CACHE_CAPACITY). A latent-MLA or V3.2/V4 artifact adds entries at every context "
                    "length, so its memory grows with each new length up to the plugin's 5000; a bound caps it, and "
                    "a step whose shape is not cached rebuilds its kernels (steps 2.8-3.4x slower on "
                    "deepseek-v3-tiny at 64 and 0). Default: dstc's choice, 16 (and oneDNN's primitive cache 64) "
                    "for such an artifact of 1 GiB or more, the plugin's otherwise (runtime/kernel_caches.py).")
    kv_layout: Literal["batch", "gather"] = Field(
        "batch", description="ONNX Runtime: the running batch's KV cache, one tensor for all rows (batch) or one per "
                             "sequence gathered each step (gather); toolchain/runtime/batching.py.")
    # who may ask (auth.py); the keys come from --api-key / --api-key-file, never from a generated option
    api_keys: list[str] = Field(default_factory=list, repr=False, description="The accepted API keys.")
    allow_unauthenticated: bool = Field(
        False, description="Serve an address other than the loopback's without an API key (refused otherwise).")
    # what one client can make the server hold; the defaults keep a 24 GiB machine safe from any client
    max_connections: int = Field(4096, ge=1, description="Open connections; requests beyond get a 503.")
    max_body_bytes: int = Field(
        1 << 20, ge=1,
        description="Request body size; larger ones get a 413, refused on their Content-Length or as they arrive.")
    max_prompt_chars: int | None = Field(
        None, ge=1,
        description="Prompt characters (a chat's, all messages together), refused with a 400 before they are "
                    "tokenized (default: the context times the tokenizer's longest token, the most that could fit).")
    max_messages: int = Field(256, ge=1, description="Messages in a chat request.")
    keep_alive_timeout_s: int = Field(5, ge=1, json_schema_extra=SECONDS,  # uvicorn takes whole seconds
                                      description="An idle connection between requests is closed after this.")
    header_timeout_s: float = Field(
        10.0, gt=0, json_schema_extra=SECONDS,
        description="A request's headers must arrive within this, or the connection is closed.")
    body_timeout_s: float = Field(
        30.0, gt=0, json_schema_extra=SECONDS,
        description="A request's body must arrive within this after its headers, or it gets a 408.")
    stream_idle_timeout_s: float = Field(
        30.0, gt=0, json_schema_extra=SECONDS,
        description="A client that reads nothing of its response for this long is disconnected, its request "
                    "cancelled.")


# the command's spellings of fields whose option is not --field-name
SERVE_SPELLINGS = {"thresholds": "--threshold", "health_window_s": "--health-window",
                   "prefix_caching": "--prefix-caching/--no-prefix-caching",
                   "keep_alive_timeout_s": "--keep-alive-timeout", "header_timeout_s": "--header-timeout",
                   "body_timeout_s": "--body-timeout", "stream_idle_timeout_s": "--stream-idle-timeout"}
