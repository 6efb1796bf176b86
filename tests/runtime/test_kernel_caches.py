"""The capacity of OpenVINO's CPU kernel caches dstc chooses (toolchain/runtime/kernel_caches.py): bounded for a
large graph whose shapes follow the context, the defaults otherwise; what reaches the plugin and oneDNN, and what
`dstc generate --json` records."""

from __future__ import annotations

import json
import os

import pytest
from cli_helpers import assert_one_line_error, run_cli
from conftest import run_cli as run_cli_output

from toolchain.interface.graph import CACHE_KINDS, KV_CACHE
from toolchain.runtime import engines, kernel_caches
from toolchain.runtime.decoder import open_decoder
from toolchain.runtime.kernel_caches import LARGE_MODEL_BYTES, ONEDNN_BOUND, ONEDNN_CACHE, RUNTIME_BOUND, KernelCaches

LARGE = 5 * LARGE_MODEL_BYTES // 2  # the shape-faithful DeepSeek-V3's 2.3 GiB, about
SMALL = 2 << 20  # deepseek-v3-tiny's INT4 artifact


@pytest.mark.parametrize(("metadata", "size", "entries"), [
    ({KV_CACHE: "latent"}, LARGE, (RUNTIME_BOUND, ONEDNN_BOUND)),
    ({KV_CACHE: "per-token"}, LARGE, (RUNTIME_BOUND, ONEDNN_BOUND)),  # DeepSeek-V4
    ({KV_CACHE: "per-head", CACHE_KINDS: '["key", "value", "index_key"]'}, LARGE,  # V3.2's indexer
     (RUNTIME_BOUND, ONEDNN_BOUND)),
    ({KV_CACHE: "latent"}, SMALL, (None, None)),  # a step about as long as a rebuild: the defaults
    ({KV_CACHE: "latent"}, LARGE_MODEL_BYTES - 1, (None, None)),
    ({KV_CACHE: "per-head", CACHE_KINDS: '["key", "value"]'}, LARGE, (None, None)),  # ScaledDotProductAttention
    ({}, LARGE, (None, None)),  # a graph exported before the record: per-head
])
def test_bounded_only_for_a_large_graph_whose_shapes_follow_the_context(metadata, size, entries):
    chosen = kernel_caches.kernel_caches(None, metadata, size)
    assert (chosen.entries, chosen.onednn) == entries


def test_a_given_capacity_wins_either_way_and_leaves_onednn_to_the_environment():
    assert kernel_caches.kernel_caches(0, {KV_CACHE: "per-head"}, SMALL) == KernelCaches(0, None, "given")
    assert kernel_caches.kernel_caches(5000, {KV_CACHE: "latent"}, LARGE) == KernelCaches(5000, None, "given")


def spy_compile(monkeypatch) -> list[dict]:
    given: list[dict] = []
    compile_model = engines.openvino_compile

    def spy(model, numerics="exact", **kwargs):
        given.append(dict(kwargs.get("config") or {}))
        return compile_model(model, numerics, **kwargs)

    monkeypatch.setattr(engines, "openvino_compile", spy)
    return given


def test_the_choice_reaches_the_plugin_and_onednn(artifact, monkeypatch):
    """deepseek-v3-tiny (latent) keeps the defaults; taken for a large model, both caches are bounded: the plugin's
    property, and oneDNN's environment variable (unless the environment sets it)."""
    art = artifact("deepseek-v3-tiny", "openvino")
    given = spy_compile(monkeypatch)
    monkeypatch.delenv(ONEDNN_CACHE, raising=False)
    small = open_decoder(art, threads=2)
    assert small.kernel_caches.entries is None and "small model" in small.kernel_caches.reason
    assert "CPU_RUNTIME_CACHE_CAPACITY" not in given[-1] and ONEDNN_CACHE not in os.environ

    monkeypatch.setattr(kernel_caches, "LARGE_MODEL_BYTES", art.size_bytes)
    large = open_decoder(art, threads=2)
    assert given[-1]["CPU_RUNTIME_CACHE_CAPACITY"] == RUNTIME_BOUND
    assert large.kernel_caches.record() == {"runtime_cache": RUNTIME_BOUND, "onednn_primitive_cache": str(ONEDNN_BOUND),
                                            "reason": large.kernel_caches.reason}

    monkeypatch.setenv(ONEDNN_CACHE, "7")  # the user's environment wins
    assert open_decoder(art, threads=2).kernel_caches.record()["onednn_primitive_cache"] == "7"


def test_per_head_graphs_keep_the_defaults(artifact, monkeypatch):
    given = spy_compile(monkeypatch)
    monkeypatch.setattr(kernel_caches, "LARGE_MODEL_BYTES", 0)
    decoder = open_decoder(artifact("r1-distill-qwen-tiny", "openvino"), threads=2)
    assert decoder.kernel_caches.entries is None and "CPU_RUNTIME_CACHE_CAPACITY" not in given[-1]


def test_generate_takes_the_option_and_records_the_choice(artifact, monkeypatch, capsys):
    monkeypatch.delenv(ONEDNN_CACHE, raising=False)
    art = artifact("deepseek-v3-tiny", "openvino")
    records = {}
    for option in ((), ("--openvino-runtime-cache", "3")):
        code, out, err = run_cli_output(monkeypatch, capsys, "generate", art.path, "1+2=", "--raw",
                                        "--new-tokens", "2", "--threads", "2", "--json", *option)
        assert code == 0, err
        records[option] = json.loads(out)
    assert records[()]["openvino_kernel_caches"]["runtime_cache"] is None
    assert records[("--openvino-runtime-cache", "3")]["openvino_kernel_caches"] == {
        "runtime_cache": 3, "onednn_primitive_cache": None, "reason": "given"}
    assert records[()]["tokens"] == records[("--openvino-runtime-cache", "3")]["tokens"]


def test_generate_refuses_the_option_on_onnxruntime(artifact, monkeypatch, capsys):
    code, err = run_cli(monkeypatch, capsys, "generate", artifact("deepseek-v3-tiny", "onnxruntime").path, "1+2=",
                        "--raw", "--openvino-runtime-cache", "16")
    assert_one_line_error(code, err, "--openvino-runtime-cache is the OpenVINO CPU plugin's")
