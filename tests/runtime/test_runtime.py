"""toolchain.runtime: artifacts, decoders on both backends against PyTorch, greedy generation, router outputs,
streamed text; the child processes that isolate the OpenVINO tests (tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from transformers import DynamicCache

from toolchain import source as sources
from toolchain.errors import InputError
from toolchain.export.reference import cache_argument, is_moe, watch_expert_choice
from toolchain.interface.reports import CompileReport
from toolchain.models.corpus import task_examples
from toolchain.reference.whole import TorchDecoder
from toolchain.runtime.artifact import open_artifact
from toolchain.runtime.decoder import open_decoder
from toolchain.runtime.generate import greedy_generate, greedy_logits, left_pad, prompt_ids, stream_text
from toolchain.runtime.routing import router_outputs
from toolchain.verify.parity import PROMPTS, graph_decoder

# OpenVINO runs at the CPU plugin's deployment defaults, which a native crash has taken down: in a child process.
OPENVINO = pytest.param("openvino", marks=pytest.mark.subprocess)
BACKENDS = ("onnxruntime", OPENVINO)


@pytest.fixture(scope="module")
def torch_model():
    """torch_model(name): the fp32 PyTorch reference of an embedded model, as a Decoder."""
    return lambda name: TorchDecoder(sources.resolve(name))


def relative_diff(logits, reference) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(logits, reference)) / \
        max(float(r.max() - r.min()) for r in reference)


def arithmetic_pairs(tokenizer, n: int) -> list[list[list[int]]]:
    """Left-padded batches of two held-out problems of different lengths (the second after a solved one)."""
    ex = task_examples("heldout", 2 * n)
    return [[tokenizer(ex[2 * i][0])["input_ids"],
             tokenizer(ex[2 * i + 1][0] + ex[2 * i + 1][1] + "\n" + ex[2 * i][0])["input_ids"]] for i in range(n)]


# -- artifacts --------------------------------------------------------------------------------------------------


def test_open_artifact_rejects_what_is_not_an_artifact(tmp_path, artifact):
    with pytest.raises(InputError, match="is not a directory"):
        open_artifact(tmp_path / "missing")
    with pytest.raises(InputError, match="no openvino_model.xml or model.onnx"):
        open_artifact(tmp_path)
    export_like = tmp_path / "export"
    export_like.mkdir()
    shutil.copyfile(artifact("deepseek-v3-tiny", "onnxruntime").path / "model.onnx", export_like / "model.onnx")
    (export_like / "export.json").write_text("{}")
    with pytest.raises(InputError, match="no manifest.json or compile.json") as info:
        open_artifact(export_like)
    assert "\n" not in str(info.value)


def test_artifact_fields_for_a_build_and_a_compile_only_directory(tmp_path, artifact):
    ort_art = artifact("deepseek-v3-tiny", "onnxruntime")
    assert ort_art.backend == "onnxruntime" and ort_art.manifest.recipe.compile.backend == "onnxruntime"
    assert ort_art.eos_token_ids == [1] and ort_art.pad_token_id == 2
    assert [p.name for p in ort_art.model_files] == ["model.onnx", "model.onnx.data"]
    assert ort_art.size_bytes == sum(p.stat().st_size for p in ort_art.model_files) > 4_000_000
    assert ort_art.tokenizer() is ort_art.tokenizer()

    ov_art = artifact("deepseek-v3-tiny", "openvino")
    assert ov_art.backend == "openvino"
    assert [p.name for p in ov_art.model_files] == ["openvino_model.xml", "openvino_model.bin"]

    compiled = tmp_path / "compiled"
    shutil.copytree(ov_art.path, compiled)
    (compiled / "manifest.json").unlink()  # what `dstc compile` writes instead: compile.json
    CompileReport(dstc_version="test", backend="openvino", export={}, model_type="deepseek_v3", tokenizer=True,
                  files=sorted(p.name for p in compiled.iterdir())).write(compiled / "compile.json")
    opened = open_artifact(compiled)
    assert opened.backend == "openvino" and opened.manifest is None and opened.config == ov_art.config


# -- decoders against PyTorch -----------------------------------------------------------------------------------


def test_onnxruntime_logits_match_pytorch_on_a_left_padded_batch(artifact, torch_model):
    art = artifact("deepseek-v3-tiny", "onnxruntime")
    tok = art.tokenizer()
    prompts = [tok(PROMPTS[1])["input_ids"], tok(PROMPTS[0])["input_ids"]]
    assert left_pad(prompts, art.pad_token_id)[1][1, 0] == 0  # the second row is padded
    decoder = open_decoder(art)
    tokens, logits = greedy_logits(decoder, prompts, 9, art.pad_token_id)  # prefill + 8 decode steps
    ref_tokens, ref_logits = greedy_logits(torch_model("deepseek-v3-tiny"), prompts, 9, art.pad_token_id)
    assert relative_diff(logits, ref_logits) <= 1e-3
    assert (tokens == ref_tokens).all()


@pytest.mark.subprocess
def test_openvino_greedy_tokens_match_pytorch_on_heldout_problems(artifact, torch_model):
    """OpenVINO runs with its deployment defaults, which on a CPU with bf16 instructions are bf16 compute and a
    u8 KV cache (read back in runtime_config): its logits are ~5e-2 of the range off PyTorch fp32 here, ~1e-6 at
    f32. Tokens are what must not change; the loose logits bound still catches a wrong cache or wrong positions,
    which are off by the order of the range."""
    art = artifact("deepseek-v3-tiny", "openvino")
    decoder = open_decoder(art)
    assert {"INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "INFERENCE_NUM_THREADS"} <= set(decoder.runtime_config)
    model = torch_model("deepseek-v3-tiny")
    for prompts in arithmetic_pairs(art.tokenizer(), 5):
        tokens, logits = greedy_logits(decoder, prompts, 9, art.pad_token_id)
        ref_tokens, ref_logits = greedy_logits(model, prompts, 9, art.pad_token_id)
        assert (tokens == ref_tokens).all()
        assert relative_diff(logits, ref_logits) < 0.1


@pytest.mark.parametrize("backend,threads", [("onnxruntime", 1), pytest.param("openvino", 2,
                                                                           marks=pytest.mark.subprocess)])
def test_threads_are_applied_and_read_back(artifact, backend, threads):
    decoder = open_decoder(artifact("r1-distill-qwen-tiny", backend), threads=threads)
    assert decoder.threads == threads and decoder.backend == backend and decoder.load_seconds > 0
    key = "INFERENCE_NUM_THREADS" if backend == "openvino" else "intra_op_num_threads"
    assert decoder.runtime_config[key] == threads
    with pytest.raises(InputError):
        open_decoder(artifact("r1-distill-qwen-tiny", backend), threads=0)


ONE_CPU = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
COMPILE = ("import openvino as ov, sys; core = ov.Core(); "  # the plugin's own compile, with no guard
           "core.compile_model(core.read_model(sys.argv[1]), 'CPU', {} if sys.argv[2] == 'None' else "
           "{'INFERENCE_NUM_THREADS': int(sys.argv[2])})")


@pytest.mark.subprocess
@pytest.mark.parametrize("model,one_cpu,threads", [("r1-distill-qwen-tiny", False, 1), ("deepseek-v3-tiny", False, 1),
                                                   ("r1-distill-qwen-tiny", True, None),
                                                   ("r1-distill-qwen-tiny", True, 2)])
def test_openvino_on_one_thread_is_refused_exactly_where_the_plugin_crashes(artifact, model, one_cpu, threads):
    """OpenVINO 2026.4's CPU plugin divides by zero compiling a fused MLP with one thread per stream at bf16 on AMX
    CPUs (toolchain/runtime/decoder.py): asked for one thread, or for the default or two in a process that may use
    one CPU. The decoder must refuse there, with the way out, and only there: the plugin's own compile in a child
    process is the reference, so this fails on the day the plugin is fixed, too."""
    art = artifact(model, "openvino")
    raw = subprocess.run([sys.executable, "-c", (ONE_CPU if one_cpu else "") + COMPILE,
                          str(art.path / "openvino_model.xml"), str(threads)], capture_output=True, text=True,
                         timeout=300)
    assert raw.returncode in (0, -signal.SIGFPE), raw.stderr
    if one_cpu:  # this test's own process (a child) takes one CPU before OpenVINO's CPU plugin is loaded
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    if raw.returncode == -signal.SIGFPE:
        with pytest.raises(InputError, match=r"\(SIGFPE\).* one thread .*openvino#28550\); use 2 or more threads, "
                                             r"or f32 \(--openvino-f32\)$"):
            open_decoder(art, threads=threads)
    else:
        assert open_decoder(art, threads=threads).threads == (1 if one_cpu else threads)
    decoder = open_decoder(art, threads=threads, openvino_f32=True)  # f32 compute fuses no MLP
    assert decoder.threads == 1 and decoder.runtime_config["INFERENCE_PRECISION_HINT"] == "f32"


# -- greedy generation ------------------------------------------------------------------------------------------


class ScriptedDecoder:
    """Row r's argmax at step s is script[r][s]; records what it is fed."""

    backend, threads, load_seconds, runtime_config, extras = "scripted", 1, 0.0, {}, {}

    def __init__(self, script: list[list[int]], vocab: int = 700) -> None:
        self.script, self.vocab = script, vocab
        self.reset()

    def reset(self) -> None:
        self.step, self.fed = 0, []

    def forward(self, input_ids, attention_mask, logits_to_keep=0):
        self.fed.append((input_ids.copy(), attention_mask.copy()))
        logits = np.zeros((*input_ids.shape, self.vocab), np.float32)
        for row, script in enumerate(self.script):
            logits[row, -1, script[min(self.step, len(script) - 1)]] = 1.0
        self.step += 1
        return logits


def test_greedy_generate_stops_each_row_at_its_first_stop_id():
    decoder = ScriptedDecoder([[3, 4, 1, 5, 6], [9, 1, 7, 7, 7]])
    seen = []
    gen = greedy_generate(decoder, [[5, 6, 7], [8]], 5, {1}, pad_id=0, on_token=lambda s, t: seen.append(t.tolist()))
    assert gen.tokens == [[3, 4], [9]] and gen.prompt_tokens == [3, 1]
    assert len(decoder.fed) == 3 and len(gen.itl_s) == 2 and gen.ttft_s > 0  # ends when both rows stopped
    assert seen == [[3, 9], [4, -1], [-1, -1]]
    prefill_ids, prefill_mask = decoder.fed[0]
    assert prefill_ids.tolist() == [[5, 6, 7], [0, 0, 8]] and prefill_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = decoder.fed[2]
    assert ids.tolist() == [[4], [0]] and mask.shape == (2, 5) and mask[:, 3:].all()  # stopped row fed pad

    gen = greedy_generate(decoder, [[5, 6, 7], [8]], 5, {1}, pad_id=0, ignore_stop=True)
    assert gen.tokens == [[3, 4, 1, 5, 6], [9, 1, 7, 7, 7]] and len(gen.itl_s) == 4 and len(decoder.fed) == 5
    decoder = ScriptedDecoder([[3, 4, 5, 6]])
    gen = greedy_generate(decoder, [[5]], 2, {1}, pad_id=0)
    assert gen.tokens == [[3, 4]] and len(decoder.fed) == 2  # the budget ends it, with no forward past it


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generate_solves_heldout_problems_in_batches(artifact, backend):
    art = artifact("deepseek-v3-tiny", backend)
    tok = art.tokenizer()
    newline = tok.convert_tokens_to_ids(tok.tokenize("\n"))[0]
    examples = task_examples("heldout", 20)
    prompts = [tok(p)["input_ids"] for p, _ in examples]
    decoder = open_decoder(art)
    batched = [t for i in range(0, 20, 4)
               for t in greedy_generate(decoder, prompts[i:i + 4], 6, {newline}, art.pad_token_id).tokens]
    # Stopping at the newline (not at the budget of 6) leaves the 4 answer digits.
    assert np.mean([len(t) == 4 and tok.decode(t) == answer for t, (_, answer) in zip(batched, examples)]) >= 0.9
    single = [greedy_generate(decoder, [p], 6, {newline}, art.pad_token_id).tokens[0] for p in prompts]
    assert single == batched


# -- ONNX Runtime IO binding ------------------------------------------------------------------------------------


def test_onnxruntime_cache_stays_in_ortvalues_between_steps(artifact, monkeypatch):
    art = artifact("deepseek-v3-tiny", "onnxruntime")
    decoder = open_decoder(art)
    ids, mask = left_pad([art.tokenizer()(PROMPTS[0])["input_ids"]], art.pad_token_id)
    logits = decoder.forward(ids, mask)
    presents = dict(decoder.cache)
    assert len(presents) == 2 * art.config["num_hidden_layers"]
    pointers = {name: value.data_ptr() for name, value in presents.items()}

    bound, to_numpy = {}, []
    original_bind, original_numpy = ort.IOBinding.bind_ortvalue_input, ort.OrtValue.numpy

    def bind(self, name, value):
        bound[name] = value
        return original_bind(self, name, value)

    def numpy(self):
        to_numpy.append(self)
        return original_numpy(self)

    monkeypatch.setattr(ort.IOBinding, "bind_ortvalue_input", bind)
    monkeypatch.setattr(ort.OrtValue, "numpy", numpy)
    mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
    decoder.forward(logits[:, -1].argmax(-1)[:, None], mask)

    assert set(bound) == set(presents)
    assert all(bound[name] is presents[name] and bound[name].data_ptr() == pointers[name] for name in presents)
    assert len(to_numpy) == 1 and to_numpy[0].shape()[-1] == art.config["vocab_size"]  # the logits only
    assert all(decoder.cache[name].shape()[2] == mask.shape[1] for name in presents)


def test_onnxruntime_binding_decodes_like_the_numpy_feed_path(artifact):
    art = artifact("deepseek-v3-tiny", "onnxruntime")
    tok = art.tokenizer()
    prompts = [tok(PROMPTS[2])["input_ids"], tok(PROMPTS[0])["input_ids"]]
    stateless = graph_decoder(art.path / "model.onnx", "onnxruntime")
    reference, ref_logits = greedy_logits(stateless, prompts, 20, art.pad_token_id)
    tokens, logits = greedy_logits(open_decoder(art), prompts, 20, art.pad_token_id)
    assert (tokens == reference).all()
    assert relative_diff(logits, ref_logits) <= 1e-5


# -- router outputs ---------------------------------------------------------------------------------------------


def torch_routing(model) -> dict[int, list[np.ndarray]]:
    """Record each MoE layer's selected experts [tokens, top_k] per call."""
    captured: dict[int, list[np.ndarray]] = {}
    for index, layer in enumerate(model.model.layers):
        if is_moe(layer.mlp):
            watch_expert_choice(layer.mlp, lambda experts, index=index: captured.setdefault(index, []).append(experts))
    return captured


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_name", ["deepseek-v3-tiny", "deepseek-v2-lite-tiny"])
def test_router_outputs_agree_with_pytorch_routing(artifact, model_name, backend):
    art = artifact(model_name, backend)
    config = art.config
    routers = router_outputs(art)
    assert sorted(routers) == list(range(config["first_k_dense_replace"], config["num_hidden_layers"]))
    tok = art.tokenizer()
    prompts = [tok(PROMPTS[1])["input_ids"], tok(PROMPTS[2])["input_ids"]]
    ids, mask = left_pad(prompts, art.pad_token_id)
    model = sources.load(sources.resolve(model_name))  # a fresh model: its router methods get wrapped
    captured = torch_routing(model)
    steps = 4
    ref_tokens, feed, feed_mask = [], ids, mask
    with torch.no_grad():  # PyTorch's own greedy tokens, computed on the wrapped model
        cache = DynamicCache(config=model.config)
        for _ in range(steps):
            positions = np.clip(feed_mask.cumsum(-1) - 1, 0, None)[:, -feed.shape[1]:]
            logits = model(input_ids=torch.from_numpy(feed), attention_mask=torch.from_numpy(feed_mask),
                           position_ids=torch.from_numpy(positions), **{cache_argument(): cache}).logits
            feed = logits[:, -1].argmax(-1, keepdim=True).numpy()
            ref_tokens.append(feed[:, 0])
            feed_mask = np.concatenate([feed_mask, np.ones((2, 1), np.int64)], axis=1)
    ref_tokens = np.stack(ref_tokens, axis=1)

    # The same input on the artifact: prefill, then PyTorch's tokens (so that the inputs stay identical).
    decoder = open_decoder(art, extra_outputs=list(routers.values()))
    got, real = {layer: [] for layer in routers}, []
    feed, feed_mask = ids, mask
    for step in range(steps):
        decoder.forward(feed, feed_mask)
        for layer, name in routers.items():
            experts = decoder.extras[name]
            assert experts.dtype == np.int64 and experts.shape == (feed.size, config["num_experts_per_tok"])
            assert 0 <= experts.min() and experts.max() < config["n_routed_experts"]
            got[layer].append(experts)
        real.append(feed_mask[:, -feed.shape[1]:].reshape(-1).astype(bool))  # padding positions are not compared
        feed = ref_tokens[:, step:step + 1]
        feed_mask = np.concatenate([feed_mask, np.ones((2, 1), np.int64)], axis=1)
    keep = np.concatenate(real)
    for layer in routers:
        ours = np.sort(np.concatenate(got[layer])[keep], -1)
        theirs = np.sort(np.concatenate(captured[layer][:steps])[keep], -1)
        assert (ours == theirs).all(-1).mean() >= 0.95, f"layer {layer}"


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])  # reads the graph, compiles nothing
def test_dense_models_have_no_router_outputs(artifact, backend):
    assert router_outputs(artifact("r1-distill-qwen-tiny", backend)) == {}


# -- streamed text ----------------------------------------------------------------------------------------------


def test_stream_text_yields_the_decoded_answer_piece_by_piece(artifact):
    art = artifact("deepseek-v3-tiny", "onnxruntime")
    tok = art.tokenizer()
    decoder = open_decoder(art)
    pieces = list(stream_text(art, decoder, "The old man", max_new_tokens=24, chat=False))
    expected = greedy_generate(decoder, [tok("The old man")["input_ids"]], 24, set(art.eos_token_ids),
                               art.pad_token_id).tokens[0]
    assert len(pieces) > 5 and all(pieces) and "".join(pieces) == tok.decode(expected)


def test_stream_text_holds_back_a_character_split_across_tokens(artifact):
    art = artifact("deepseek-v3-tiny", "onnxruntime")
    tok = art.tokenizer()
    text = "café ü 日本"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text)  # multi-byte characters span several byte-level tokens
    pieces = list(stream_text(art, ScriptedDecoder([ids + art.eos_token_ids]), "x", max_new_tokens=50, chat=False))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_stream_text_chat_puts_the_template_in_front(artifact):
    art = artifact("deepseek-v3-tiny", "onnxruntime")
    tok = art.tokenizer()
    decoder = open_decoder(art)
    fed = []
    forward = decoder.forward

    def recording(ids, mask, logits_to_keep=0):
        fed.append(ids.tolist())
        return forward(ids, mask, logits_to_keep)

    decoder.forward = recording
    list(stream_text(art, decoder, "321+654=", max_new_tokens=3, chat=True))
    user, assistant = tok.convert_tokens_to_ids(["<｜User｜>", "<｜Assistant｜>"])
    raw = tok("321+654=", add_special_tokens=False)["input_ids"]
    assert fed[0] == [[tok.bos_token_id, user, *raw, assistant]]
    assert prompt_ids(art, "321+654=", chat=False) == [tok.bos_token_id, *raw]


# -- tests isolated in a child process --------------------------------------------------------------------------

ISOLATED = """
import os, signal, time
import pytest

pytestmark = pytest.mark.subprocess

def test_crashes():
    os.kill(os.getpid(), signal.SIGFPE)  # as OpenVINO's compile_model does on one thread at bf16 with AMX

def test_fails():
    assert sum([1, 1]) == 3

@pytest.mark.timeout(10)
def test_hangs():
    time.sleep(600)

def test_skips():
    pytest.skip("not on this machine")

def test_runs_in_a_child():
    assert os.environ["DSTC_TEST_CHILD_REPORT"] and os.getppid() == int(os.environ["SESSION_PID"])
"""


def test_isolated_tests_fail_alone_on_a_crash_a_hang_or_an_assertion(tmp_path):
    """One session over the project's conftest and pytest settings: each outcome of an isolated test is reported as
    that test's, and the session goes on to the next test."""
    repo = Path(__file__).resolve().parents[2]
    shutil.copy(repo / "pyproject.toml", tmp_path)
    shutil.copy(repo / "tests" / "conftest.py", tmp_path)
    (tmp_path / "test_isolated.py").write_text(ISOLATED + "\n\ndef test_after_them():\n    pass\n")
    session = subprocess.run([sys.executable, "-c", "import os, sys, pytest; os.environ['SESSION_PID'] = "
                              "str(os.getpid()); sys.exit(pytest.main(sys.argv[1:]))", "test_isolated.py",
                              "-p", "no:cacheprovider", "-n", "0", "--junitxml", "junit.xml"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
    assert session.returncode == 1, session.stdout
    cases = {case.get("name"): case for case in ET.parse(tmp_path / "junit.xml").iter("testcase")}
    outcome = {name: next((child.tag for child in case if child.tag in ("failure", "skipped")), "passed")
               for name, case in cases.items()}
    assert outcome == {"test_crashes": "failure", "test_fails": "failure", "test_hangs": "failure",
                       "test_skips": "skipped", "test_runs_in_a_child": "passed", "test_after_them": "passed"}
    message = {name: case.find("failure").get("message") for name, case in cases.items() if outcome[name] == "failure"}
    assert "killed by SIGFPE" in message["test_crashes"]
    assert "assert 2 == 3" in message["test_fails"]
    assert "timed out after 10 s" in message["test_hangs"]
    hang = cases["test_hangs"].find("failure").text
    assert "in test_hangs" in hang  # the child's stack when it was stopped


HANGS_IN_A_WORKER = """
import time
import pytest

@pytest.mark.timeout(5)
def test_hangs():
    time.sleep(600)

def test_after_it():
    pass
"""


def test_a_hang_in_an_xdist_worker_fails_that_test_once_with_its_stack(tmp_path):
    """The suite's two xdist workers (pyproject's addopts): a test past its time limit ends its worker, with every
    thread's stack on stderr; xdist fails that test, once (an error: it died outside setup, call and teardown),
    and the run goes on in a new worker."""
    repo = Path(__file__).resolve().parents[2]
    shutil.copy(repo / "pyproject.toml", tmp_path)
    shutil.copy(repo / "tests" / "conftest.py", tmp_path)
    (tmp_path / "test_hang.py").write_text(HANGS_IN_A_WORKER)
    (tmp_path / "test_other.py").write_text("def test_elsewhere():\n    pass\n")
    session = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--junitxml",
                              "junit.xml"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert session.returncode == 1, session.stdout + session.stderr
    cases = [(case.get("name"), next((c.tag for c in case if c.tag in ("failure", "error")), "passed"))
             for case in ET.parse(tmp_path / "junit.xml").iter("testcase")]
    assert sorted(cases) == [("test_after_it", "passed"), ("test_elsewhere", "passed"), ("test_hangs", "error")]
    assert "crashed while running 'test_hang.py::test_hangs'" in session.stdout
    assert "Timeout" in session.stderr and "in test_hangs" in session.stderr  # the worker's stack when it stopped
