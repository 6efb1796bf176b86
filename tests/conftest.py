"""Small random checkpoints of every exported architecture, written once per test session; time limits; tests
isolated in a child process.

``@pytest.mark.subprocess`` runs a test in a fresh ``python -m pytest`` child (spawned, not forked: a fork after
OpenVINO's, ORT's or OpenBLAS's threads exist can deadlock). A native crash there (OpenVINO's CPU plugin dies with
SIGFPE on some CPUs, see toolchain/runtime/decoder.py) or a hang fails that test alone, with the signal's name and
the child's output; the child's fixtures are built again, from the stages the session has cached (``stage_cache``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# openvino_telemetry, which ov.convert_model reports to, forks a process (multiprocessing's default start method) from
# a background thread for every event; a fork runs OpenBLAS's atfork handler, which stops its thread pool under a
# matmul running in the main thread (reproduced; likely the session that hung 50 minutes in exec_blas). Every user
# of it (OpenVINO's converter, NNCF) falls back to a stub when it does not import.
sys.modules["openvino_telemetry"] = None

COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
              max_position_embeddings=256)
# DeepSeek-V4 at a scale where a prompt and 16 decode steps cross the sliding window (8), several CSA blocks (4) and
# HCA blocks (16), the indexer's top-k (3) is below the compressed entries a query sees, and swiglu_limit clips
# about half the gate and up values of random weights
V4 = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
          partial_rotary_factor=0.25, q_lora_rank=24, o_groups=2, o_lora_rank=16, n_routed_experts=8,
          num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=8, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
          index_n_heads=8, index_head_dim=16, index_topk=3, hc_mult=3, hc_sinkhorn_iters=5, swiglu_limit=0.1,
          routed_scaling_factor=1.5, max_position_embeddings=256,
          layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                       "compressed_sparse_attention"],
          mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"])
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
           n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1)


# The hub layouts of DeepSeek-V4 and V3.2 at small widths (tests/checkpoint/test_reader.py, tests/export/test_export.py).
# FP8 widths in whole 128 x 128 blocks: transformers' dequantization derives the block from the scale grid's shape
# (Fp8Dequantize._dequantize_one), which is only right for whole blocks. Layers: sliding + hash MoE, CSA, HCA.
TINY_V4 = dict(vocab_size=300, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
               num_key_value_heads=1, head_dim=128, qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=128,
               n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, index_n_heads=2, index_head_dim=128,
               index_topk=4, sliding_window=8, compress_ratios=[0, 4, 128], num_hash_layers=1,
               max_position_embeddings=512, hc_mult=2, hc_sinkhorn_iters=3)
TINY_V32 = dict(vocab_size=300, hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=192, qk_rope_head_dim=64,
                qk_nope_head_dim=64, v_head_dim=128, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                topk_group=1, first_k_dense_replace=1, index_n_heads=2, index_head_dim=128, index_topk=4,
                max_position_embeddings=512)


def tiny_configs() -> dict:
    # transformers and torch are imported where used: every isolated test's child process loads this file
    from transformers import (DeepseekV2Config, DeepseekV3Config, DeepseekV4Config, DeepseekV32Config, LlamaConfig,
                              Qwen2Config, Qwen3MoeConfig)

    return {
        "llama": LlamaConfig(**COMMON, num_key_value_heads=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen2": Qwen2Config(**COMMON, num_key_value_heads=2),
        "deepseek_v2": DeepseekV2Config(**COMMON, **MLA, q_lora_rank=None, n_routed_experts=8, topk_method="greedy",
                                        n_group=1, topk_group=1, routed_scaling_factor=1.0),
        "deepseek_v2_group_limited": DeepseekV2Config(**COMMON, **MLA, q_lora_rank=16, n_routed_experts=8,
                                                      topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                      routed_scaling_factor=1.5),
        "deepseek_v3": DeepseekV3Config(**COMMON, **MLA, q_lora_rank=24, n_routed_experts=16, n_group=4, topk_group=2,
                                        routed_scaling_factor=2.5, rope_interleave=True),
        "deepseek_v3_plain_rope": DeepseekV3Config(**COMMON, **MLA, q_lora_rank=24, n_routed_experts=8, n_group=2,
                                                   topk_group=1, routed_scaling_factor=1.0, rope_interleave=False,
                                                   norm_topk_prob=False),
        # no shared experts; a dense layer between two MoE ones (mlp_only_layers); head_dim apart from hidden/heads
        "qwen3_moe": Qwen3MoeConfig(**COMMON, num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
        # every second layer MoE (decoder_sparse_step), the top-k weights as softmax gives them
        "qwen3_moe_sparse_step": Qwen3MoeConfig(**COMMON, num_key_value_heads=1, num_experts=16, num_experts_per_tok=4,
                                                moe_intermediate_size=32, decoder_sparse_step=2, attention_bias=True),
        # index_topk 6: the parity prompts (5, 11 and 48 tokens, 16 steps) are below it at prefill and cross it in
        # decode, or are above it from the start
        "deepseek_v32": DeepseekV32Config(**COMMON, **MLA, q_lora_rank=24, n_routed_experts=16, n_group=4,
                                          topk_group=2, routed_scaling_factor=2.5, index_topk=6, index_head_dim=16,
                                          index_n_heads=8),
        "deepseek_v4": DeepseekV4Config(**V4),
    }


# Widths that are not multiples of 128, so that FP8 blocks on the right and bottom edges are partial.
WIDE_V3 = dict(vocab_size=97, hidden_size=200, intermediate_size=300, moe_intermediate_size=136,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=144, q_lora_rank=160,
               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, n_shared_experts=1,
               num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, max_position_embeddings=256,
               rope_interleave=True)


def wide_v3_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**WIDE_V3)


def make_checkpoint(config, path, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for module in model.modules():  # a bias that decides routing, as a trained V3 has
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)
            for norm in ("q_norm", "k_norm"):  # per-head norms that are not the identity, each its own
                if hasattr(module, norm):
                    getattr(module, norm).weight.normal_(1, 0.2)
        randomize_v4_initial_constants(model)
    model.save_pretrained(path)
    return path


def randomize_v4_initial_constants(model) -> None:
    """DeepSeek-V4's constants that transformers initializes to zeros or ones (hash routing table, attention sinks,
    compressors' position biases, hyper-connection biases and scales) given values that make each of them decide
    something, as a trained checkpoint's do: a zero table would send every token to expert 0 twice."""
    import torch

    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "tid2eid":  # distinct experts per token, as the hub's table has
            experts = model.config.n_routed_experts
            tensor.copy_(torch.stack([torch.randperm(experts)[:tensor.shape[1]] for _ in range(tensor.shape[0])]))
        elif leaf in ("sinks", "position_bias", "base", "hc_base"):
            tensor.normal_(0, 0.5)
        elif leaf in ("scale", "hc_scale"):
            tensor.uniform_(0.5, 1.5)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_checkpoint(cfg, root / name) for name, cfg in tiny_configs().items()}



def run_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """``dstc ARGS`` in this process: (exit code, stdout, stderr)."""
    from toolchain.cli import main

    monkeypatch.setattr(sys, "argv", ["dstc", *map(str, args)])
    with pytest.raises(SystemExit) as exc:
        main()
        raise SystemExit(0)
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


# -- two processes (pytest-xdist, pyproject's addopts) -----------------------------------------------------------


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist load (xdist's default), each batch of tests it sends a worker extended to the end of a test file: a
    module's fixtures (artifacts built, servers started) are set up by one worker, not by both. --dist loadfile
    groups the same way, but runs the test a worker died on again on the replacement worker, until the restarts
    run out (pytest-xdist 3.8, pull request 1371); load scheduling fails that test once and goes on."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScheduling

    class WholeFiles(LoadScheduling):
        def _send_tests(self, node, num):
            def file(index):
                return self.collection[index].split("::", 1)[0]

            if 0 < num < len(self.pending):
                last = file(self.pending[num - 1])
                while num < len(self.pending) and file(self.pending[num]) == last:
                    num += 1
            super()._send_tests(node, num)

    return WholeFiles(config, log)


if os.environ.get("PYTEST_XDIST_WORKER"):
    import pytest_timeout
    from _pytest.terminal import TerminalWriter

    _timeout_timer = pytest_timeout.timeout_timer

    def _timeout_timer_to_stderr(item, settings):
        """pytest-timeout's stack dump on the run's stderr (a worker's stdout, where its terminal writer writes, is
        /dev/null) before it ends the worker, which xdist reports as that test's failure and replaces."""
        writer = TerminalWriter(sys.__stderr__)
        item.config.get_terminal_writer = lambda: writer
        _timeout_timer(item, settings)

    pytest_timeout.timeout_timer = _timeout_timer_to_stderr


# -- time limits and isolated tests ------------------------------------------------------------------------------

SLOW_TIMEOUT = 2400  # seconds per slow-marked test; the fast ones get pyproject's ``timeout``
CHILD_ENV = "DSTC_TEST_CHILD_REPORT"  # set in an isolated test's child: the file its reports go to
STAGE_CACHE_ENV = "DSTC_TEST_STAGE_CACHE"
CHILD_STARTUP = 120  # seconds the parent's own limit allows beyond the child's, to start and stop it
BUDGET = pytest.StashKey[float]()


def _limit(item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        return float(marker.args[0] if marker.args else marker.kwargs["timeout"])
    return float(item.config.getoption("timeout") or item.config.getini("timeout") or 0)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))
        if item.get_closest_marker("subprocess") and CHILD_ENV not in os.environ:
            # The child gets the test's limit; the parent, which waits for it, a little more, so that a hang in the
            # child fails this test instead of ending the session.
            item.stash[BUDGET] = _limit(item)
            item.add_marker(pytest.mark.timeout(item.stash[BUDGET] + CHILD_STARTUP), append=False)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if BUDGET not in pyfuncitem.stash:
        return None
    _run_in_child(pyfuncitem, pyfuncitem.stash[BUDGET])
    return True


def pytest_runtest_logreport(report):
    if CHILD_ENV in os.environ:
        skip = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else None
        with open(os.environ[CHILD_ENV], "a") as out:
            out.write(json.dumps({"when": report.when, "outcome": report.outcome, "skip": skip,
                                  "text": report.longreprtext, "sections": report.sections}) + "\n")


def _run_in_child(item, budget: float) -> None:
    with tempfile.TemporaryDirectory(prefix="dstc-child-") as tmp:
        reports_file = Path(tmp) / "reports.jsonl"
        # -m "" undoes addopts' -m 'not slow': the node id alone selects the test
        # -n 0: one process, whatever addopts' -n says
        command = [sys.executable, "-m", "pytest", item.nodeid, "-q", "-p", "no:cacheprovider", "-m", "", "-n", "0",
                   "--basetemp", str(Path(tmp) / "basetemp")]
        child = subprocess.Popen(command, cwd=item.config.rootpath, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env={**os.environ, CHILD_ENV: str(reports_file)})
        try:
            output, _ = child.communicate(timeout=budget or None)
            timed_out = False
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGABRT)  # its faulthandler prints every thread's stack, then it dies
            output, _ = child.communicate()
            timed_out = True
        reports = [json.loads(line) for line in reports_file.read_text().splitlines()] \
            if reports_file.exists() else []
    if timed_out:
        pytest.fail(f"timed out after {budget:.0f} s in its child process:\n{_tail(output)}", pytrace=False)
    if child.returncode < 0:
        pytest.fail(f"its child process was killed by {signal.Signals(-child.returncode).name}:\n{_tail(output)}",
                    pytrace=False)
    failed = [r for r in reports if r["outcome"] == "failed"]
    if failed:
        pytest.fail("\n".join(f"in its child process ({r['when']}):\n{r['text']}" + "".join(
            f"\n{'-' * 20} {title} {'-' * 20}\n{content}" for title, content in r["sections"]) for r in failed),
            pytrace=False)
    skipped = next((r for r in reports if r["outcome"] == "skipped"), None)
    if skipped:
        pytest.skip(skipped["skip"])
    if child.returncode != 0 or not any(r["when"] == "call" and r["outcome"] == "passed" for r in reports):
        pytest.fail(f"its child process exited with {child.returncode} without a passing run:\n{_tail(output)}",
                    pytrace=False)


def _tail(text: str, limit: int = 20000) -> str:
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


@pytest.fixture(scope="session")
def stage_cache(tmp_path_factory):
    """A stage cache (DSTC_CACHE_DIR) shared by the session, its xdist workers and its isolated tests' child
    processes, which then assemble their artifacts from the stages already built instead of building them again
    (a worker building a stage another one is building waits for it: the cache locks an entry while it is built)."""
    if STAGE_CACHE_ENV in os.environ:
        return Path(os.environ[STAGE_CACHE_ENV])
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the run's base directory, above each worker's own
        path = tmp_path_factory.getbasetemp().parent / "stage-cache"
        path.mkdir(exist_ok=True)
    else:
        path = tmp_path_factory.mktemp("stage-cache")
    os.environ[STAGE_CACHE_ENV] = str(path)  # inherited by the children
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A stage and reference cache (DSTC_CACHE_DIR) of the module's own, set for this process; the environment to
    give the module's `dstc` child processes."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSTC_CACHE_DIR", str(cache))
        yield {**os.environ, "DSTC_CACHE_DIR": str(cache)}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, stage_cache):
    """artifact(model, backend[, sections]): an fp32 build of an embedded model (or a checkpoint directory), built on
    first use; ``sections``: recipe sections in place of the default compile section (e.g. compress and compile)."""
    import yaml

    from toolchain.build import build
    from toolchain.runtime.artifact import open_artifact

    root = tmp_path_factory.mktemp("runtime")
    built = {}

    def get(model: str, backend: str, sections: dict | None = None):
        key = (model, backend, yaml.safe_dump(sections))
        if key not in built:
            name = f"{Path(model).name}-{backend}-{len(built)}"
            recipe = root / f"{name}.yaml"
            recipe.write_text(yaml.safe_dump({"name": "t", "model": str(model), "export": {"parity": []},
                                              **(sections or {"compile": {"backend": backend, "verify": False}})}))
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("DSTC_CACHE_DIR", str(stage_cache))
                build(recipe, root / name)
            built[key] = open_artifact(root / name)
        return built[key]

    return get
