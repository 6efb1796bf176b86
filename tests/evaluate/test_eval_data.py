"""`dstc eval` on the user's data, with the layer-by-layer reference and the reference cache: the reference equals
transformers' whole model, a data file's windows score each token once, the cache is reused only when it may be
and gives the figures an uncached run gives."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from cli_helpers import dstc_here as dstc

from toolchain import source as sources
from toolchain.build import build
from toolchain.errors import InputError
from toolchain.evaluate.accuracy import compare_distributions
from toolchain.evaluate.dataset import load_data
from toolchain.models import corpus
from toolchain.reference import layered as layered_reference
from toolchain.reference.layered import LayeredReference
from toolchain.reference.whole import TorchDecoder
from toolchain.report.markdown import summary_settings
from toolchain.report.schema import Report, load_report
from toolchain.runtime.generate import left_pad
from toolchain.settings.evaluation import EvalSettings
from toolchain.tokenizer_loading import load_tokenizer

QUICK = ["--no-latency", "--texts", "20", "--problems", "10", "--json"]




@pytest.fixture(scope="module")
def artifact(tmp_path_factory, cache):
    root = tmp_path_factory.mktemp("eval-data")
    (root / "r.yaml").write_text(yaml.safe_dump({
        "name": "qwen-fp32", "model": "r1-distill-qwen-tiny", "export": {"parity": []},
        "compile": {"backend": "onnxruntime", "verify": False}}))
    build(root / "r.yaml", root / "art")
    return root / "art"


@pytest.fixture(scope="module")
def user_data(tmp_path_factory) -> Path:
    """A user's JSONL: held-out texts, prompt/answer records and a chat conversation."""
    path = tmp_path_factory.mktemp("data") / "mine.jsonl"
    rows = [{"text": t} for t in corpus.text_samples("heldout", 30, seed=7)]
    rows += [{"prompt": p, "answer": a} for p, a in corpus.task_examples("heldout", 6, seed=7)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "deepseek-v2-lite-tiny", "r1-distill-qwen-tiny",
                                  "r1-distill-llama-tiny"])
@pytest.mark.parametrize("layers", ["resident", "per pass", "experts on demand"])
def test_layered_reference_is_the_whole_model_bit_for_bit(name, layers, monkeypatch):
    """Prefill of a left-padded batch and three decode steps, logits and expert choices, against transformers'
    whole model (TorchDecoder); built once and kept, built again from the checkpoint at every call, or built
    without their routed experts, which are read as tokens hit them (one or three at a time)."""
    if layers != "resident":
        monkeypatch.setattr(layered_reference, "RESIDENT_MAX", 0)
    if layers == "experts on demand":
        monkeypatch.setattr(layered_reference, "EXPERTS_SHARE", 0)
    source = sources.resolve(name)
    layered, whole = LayeredReference(source), TorchDecoder(source)
    assert layered.resident is (layers == "resident")
    on_demand = layers == "experts on demand" and not name.startswith("r1-")
    assert set(layered.experts_at_once) == (set(layered._moe_layer_indices()) if on_demand else set())
    if on_demand:  # one expert at a time in one layer, three in the others
        first, *rest = layered.experts_at_once
        layered.experts_at_once = {first: 1, **{i: 3 for i in rest}}
    ids, mask = left_pad([[1, 5, 9, 22, 40, 7], [3, 4, 5]], 0)
    a, b = layered.forward(ids, mask), whole.forward(ids, mask)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1, 3:], b[1, 3:])
    assert layered.extras.keys() == whole.extras.keys()
    assert all(np.array_equal(layered.extras[k], whole.extras[k]) for k in whole.extras)
    for _ in range(3):
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
        token = a[:, -1].argmax(-1)[:, None]
        a, b = layered.forward(token, mask), whole.forward(token, mask)
        assert np.array_equal(a, b)
    assert name.startswith("r1-") or whole.extras  # the DeepSeek models record their routing


def test_experts_on_demand_read_only_the_experts_hit(monkeypatch):
    """A decode step of one sequence reads, per MoE layer, the top-k experts its token chose and no others."""
    from toolchain.checkpoint.experts_on_demand import ExpertsOnDemand

    monkeypatch.setattr(layered_reference, "RESIDENT_MAX", 0)
    monkeypatch.setattr(layered_reference, "EXPERTS_SHARE", 0)
    layered = LayeredReference(sources.resolve("deepseek-v3-tiny"))
    read: list[int] = []
    built = ExpertsOnDemand._subset
    monkeypatch.setattr(ExpertsOnDemand, "_subset", lambda self, experts: (read.append(len(experts)),
                                                                         built(self, experts))[1])
    layered.forward(np.asarray([[3, 4, 5, 6]]), np.ones((1, 4), np.int64))
    read.clear()
    layered.forward(np.asarray([[7]]), np.ones((1, 5), np.int64))
    top_k = int(layered.config.num_experts_per_tok)
    assert layered.extras.keys() == {f"router.{i}" for i in layered.experts_at_once}
    assert sum(read) == top_k * len(layered.experts_at_once) < layered.config.n_routed_experts


def test_scoring_in_query_chunks_is_the_unchunked_forward():
    """score() prefills a long sequence a chunk of queries at a time through a cache of its own: the same logits
    and expert choices as one forward of the whole sequence."""
    source = sources.resolve("deepseek-v3-tiny")
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 600, 300)]
    whole = LayeredReference(source).forward(np.asarray([ids]), np.ones((1, len(ids)), np.int64))[0]
    chunked = LayeredReference(source, chunk=64)
    got = np.zeros_like(whole)

    def reduce(s, start, logits):
        assert s == 0
        got[start:start + len(logits)] = logits.numpy()

    routes = chunked.score([ids], reduce)
    assert np.abs(got - whole).max() <= 1e-5 * np.abs(whole).max()
    assert set(routes) == {1, 2} and all(r[0].shape == (300, 4) for r in routes.values())


def test_scoring_with_experts_on_demand_is_scoring_with_whole_layers(monkeypatch):
    """score() (what eval runs) of two sequences, the second longer than a query chunk, with the routed experts
    read as tokens hit them: the same logits and expert choices, bit for bit, as with the layers built whole."""
    monkeypatch.setattr(layered_reference, "RESIDENT_MAX", 0)
    source = sources.resolve("deepseek-v3-tiny")
    rng = np.random.default_rng(3)
    sequences = [[int(t) for t in rng.integers(3, 600, n)] for n in (40, 150)]

    def scored(reference):
        logits: dict[tuple[int, int], np.ndarray] = {}
        routes = reference.score(sequences, lambda s, a, x: logits.__setitem__((s, a), x.numpy().copy()))
        return logits, routes

    whole = scored(LayeredReference(source, chunk=64))
    monkeypatch.setattr(layered_reference, "EXPERTS_SHARE", 0)
    monkeypatch.setattr(layered_reference, "EXPERTS_AT_ONCE_BYTES", 1)  # one expert at a time
    on_demand = LayeredReference(source, chunk=64)
    assert set(on_demand.experts_at_once.values()) == {1}
    got = scored(on_demand)
    assert got[0].keys() == whole[0].keys() and all(np.array_equal(got[0][k], whole[0][k]) for k in whole[0])
    assert got[1].keys() == whole[1].keys() == {1, 2}
    assert all(np.array_equal(a, b) for k in whole[1] for a, b in zip(got[1][k], whole[1][k], strict=True))


def test_the_memory_need_counts_experts_read_on_demand(monkeypatch):
    """Layers built per pass: the largest layer twice, and a MoE layer whose experts are read on demand without
    them and with the experts built at a time."""
    from toolchain.checkpoint.reader import open_checkpoint

    monkeypatch.setattr(layered_reference, "RESIDENT_MAX", 0)
    path = sources.resolve("deepseek-v3-tiny").path
    with open_checkpoint(path) as reader:
        sizes = layered_reference.layer_sizes(reader)
    moe = max(sizes, key=lambda s: s.experts)
    assert moe.count == 16 and moe.experts == moe.count * moe.per_expert > 0
    whole = layered_reference.memory_need(path, 0)
    monkeypatch.setattr(layered_reference, "EXPERTS_SHARE", 0)
    monkeypatch.setattr(layered_reference, "EXPERTS_AT_ONCE_BYTES", 3 * moe.per_expert)
    largest = max(max(s.other + s.experts for s in sizes if not s.count), moe.other + 3 * moe.per_expert)
    assert whole - layered_reference.memory_need(path, 0) == 2 * (moe.other + moe.experts) - 2 * largest > 0


def test_kl_on_the_top_k_is_exact_with_the_whole_vocabulary_and_a_lower_bound_below_it():
    rng = np.random.default_rng(1)
    ref_logits, art_logits = rng.normal(size=(12, 50)) * 3, rng.normal(size=(12, 50)) * 3
    ids = [int(t) for t in rng.integers(0, 50, 12)]
    log_p = torch.log_softmax(torch.from_numpy(ref_logits), -1)
    log_q = torch.log_softmax(torch.from_numpy(art_logits), -1).numpy()
    full = (np.exp(log_p.numpy()) * (log_p.numpy() - log_q)).sum(-1)
    for k in (50, 10):
        values, indices = torch.topk(log_p, k, -1)
        kl, top1, nll = compare_distributions(art_logits.astype(np.float32), 0, ids, 0, indices.numpy(),
                                              values.float().numpy(), 50)
        halves = [compare_distributions(art_logits[a:a + 6].astype(np.float32), a, ids, 0, indices.numpy(),
                                        values.float().numpy(), 50) for a in (0, 6)]
        assert all(np.array_equal(np.concatenate([h[i] for h in halves]), x) for i, x in enumerate((kl, top1, nll)))
        if k == 50:
            assert np.allclose(kl, full, rtol=1e-5, atol=1e-6)
        else:  # the tokens outside the top 10 as one outcome: never more than the whole KL, and close to it
            assert np.all(kl <= full + 1e-6) and np.all(kl > 0)
        assert np.array_equal(top1, log_q.argmax(-1) == log_p.numpy().argmax(-1))
        assert np.allclose(nll, -log_q[np.arange(11), ids[1:]], rtol=1e-5)


def test_windows_with_a_stride_score_every_token_once(tmp_path):
    text = " ".join(corpus.text_samples("heldout", 60, seed=3))
    path = tmp_path / "doc.txt"
    path.write_text(text)
    tokenizer = load_tokenizer(sources.resolve("r1-distill-qwen-tiny").path)
    stream = tokenizer(text)["input_ids"]
    data = load_data(EvalSettings(dataset=str(path), window=128, stride=96, windows=1000), tokenizer, task=False,
                     max_length=1024)
    assert data.description["sha256"] and data.description["window"] == 128 and data.description["stride"] == 96
    assert data.description["scored_tokens"] == len(stream) - 1
    assert data.sequences[0].ids == stream[:128] and data.sequences[1].ids == stream[96:224]
    assert data.sequences[1].score_from == 32
    assert all(len(s.ids) <= 128 for s in data.sequences) and data.sequences[-1].ids[-1] == stream[-1]


@pytest.mark.parametrize(("context", "window"), [(512, 512), (1024, 1024), (32768, 2048)])
def test_the_default_window_fits_the_model(tmp_path, context, window):
    path = tmp_path / "doc.txt"
    path.write_text(" ".join(corpus.text_samples("heldout", 200, seed=3)))
    tokenizer = load_tokenizer(sources.resolve("r1-distill-qwen-tiny").path)
    data = load_data(EvalSettings(dataset=str(path)), tokenizer, task=False, max_length=context)
    assert data.description["window"] == window and len(data.sequences[0].ids) == window
    with pytest.raises(InputError, match="--stride 600 is longer than the window"):
        load_data(EvalSettings(dataset=str(path), stride=600), tokenizer, task=False, max_length=512)


@pytest.mark.parametrize(("continuation", "want", "given"), [
    ("9750\n000+100=", "9750", "9750"),  # the continuation runs on past a one-line answer: its first line
    (" 9750 \n", "9750", "9750"),
    ("975", "9750", "975"),
    ("a\nb\nc", "a\nb", "a\nb\nc"),  # a multi-line answer is compared whole
])
def test_exact_match_reads_a_one_line_answer_from_the_first_line(continuation, want, given):
    from toolchain.evaluate.accuracy import answer_given

    assert answer_given(continuation, want) == given


def test_eval_on_a_users_jsonl_records_the_data_and_reuses_the_cached_reference(artifact, user_data, cache):
    first = dstc("eval", artifact, "--dataset", user_data, "--window", "64", *QUICK, env=cache)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    data = report["settings"]["data"]
    assert data["format"] == "jsonl" and data["problems"] == 6 and data["window"] == 64
    assert data["sha256"] == __import__("hashlib").sha256(user_data.read_bytes()).hexdigest()
    metrics = {k: v["value"] for k, v in report["metrics"].items()}
    # fp32 ONNX Runtime against the fp32 reference: the same model, on data it was never given
    assert metrics["kl_max"] < 1e-6 and metrics["top1_agreement"] > 0.999 and metrics["exact_match_drop"] == 0
    assert report["reference"]["cache"]["reused"] is False
    # the summary says what was scored (windows of the user's data), not the embedded corpus's defaults
    assert report["settings"]["task"] == "prompt/answer records of --dataset"
    measured = summary_settings(Report.model_validate(report))
    assert f"{data['windows']} windows of 64 tokens" in measured and "6 problems" in measured
    assert not any("200" in item for item in measured)

    second = dstc("eval", artifact, "--dataset", user_data, "--window", "64", *QUICK, env=cache)
    again = json.loads(second.stdout)
    assert again["reference"]["cache"] == {**report["reference"]["cache"], "reused": True}
    assert "reused from the reference cache" in second.stderr
    assert {k: v["value"] for k, v in again["metrics"].items()} == metrics

    uncached = json.loads(dstc("eval", artifact, "--dataset", user_data, "--window", "64", "--no-reference-cache",
                               *QUICK, env=cache).stdout)
    assert uncached["reference"]["cache"]["reused"] is False
    assert abs(uncached["metrics"]["kl_mean"]["value"] - metrics["kl_mean"]) <= 1e-9

    # other data: another entry; a damaged entry: computed again, the same figures
    other = dstc("eval", artifact, "--dataset", user_data, "--window", "32", *QUICK, env=cache)
    assert json.loads(other.stdout)["reference"]["cache"]["key"] != report["reference"]["cache"]["key"]
    entry = Path(cache["DSTC_CACHE_DIR"]) / "references" / f"{report['reference']['cache']['key']}.npz"
    raw = bytearray(entry.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    entry.write_bytes(bytes(raw))
    damaged = dstc("eval", artifact, "--dataset", user_data, "--window", "64", *QUICK, env=cache)
    assert "computing the reference again" in damaged.stderr
    assert json.loads(damaged.stdout)["reference"]["cache"]["reused"] is False
    assert {k: v["value"] for k, v in json.loads(damaged.stdout)["metrics"].items()} == metrics


@pytest.mark.parametrize(("content", "fields", "message"), [
    (b"\xff\xfe bad", {}, "not UTF-8"),
    (b'{"text": "a"}\n[1, 2]\n', {}, "mine.jsonl:2: not a JSON object"),
    (b'{"prompt": 3, "answer": "x"}\n', {}, "prompt and answer must both be strings"),
    (b'{"messages": [{"role": "user"}]}\n', {}, "messages must be a list of {role, content} strings"),
    (b'{"text": "one two three"}\n', {"window": 4096}, "longer than the model's context"),
])
def test_bad_data_is_an_input_error(tmp_path, content, fields, message):
    path = tmp_path / "mine.jsonl"
    path.write_bytes(content)
    tokenizer = load_tokenizer(sources.resolve("r1-distill-qwen-tiny").path)
    with pytest.raises(InputError, match=re.escape(message)):
        load_data(EvalSettings(dataset=str(path), **fields), tokenizer, task=False, max_length=1024)


def test_bad_data_on_the_command_line_exits_2_with_one_line_and_writes_nothing(artifact, tmp_path, cache):
    path = tmp_path / "mine.jsonl"
    path.write_bytes(b'{"text": "a"}\n[1, 2]\n')
    before = (artifact / "report.json").read_bytes() if (artifact / "report.json").exists() else None
    for args in (["--dataset", path], ["--dataset", path, "--window", "16", "--stride", "32"]):
        proc = dstc("eval", artifact, *args, *QUICK, env=cache)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) <= 3 and "Traceback" not in proc.stderr
    assert "not a JSON object" in dstc("eval", artifact, "--dataset", path, *QUICK, env=cache).stderr
    after = (artifact / "report.json").read_bytes() if (artifact / "report.json").exists() else None
    assert before == after


def test_a_recipe_names_its_dataset_relative_to_itself(tmp_path, user_data, cache):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.jsonl").write_bytes(user_data.read_bytes())
    recipe = tmp_path / "gated.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "gated", "model": "r1-distill-qwen-tiny", "export": {"parity": []},
        "compile": {"backend": "onnxruntime", "verify": False},
        "eval": {"dataset": "data/mine.jsonl", "window": 64, "latency": False, "greedy_prompts": 4},
        "gates": {"max_kl_mean": 1e-5, "min_top1_agreement": 0.99}}))
    build(recipe, tmp_path / "out")
    report = load_report(tmp_path / "out")
    assert report.settings["data"]["dataset"] == str((tmp_path / "data" / "mine.jsonl").resolve())
    assert report.gates and all(g.passed for g in report.gates)
    # eval does not replace the build's gated report unless told to: it writes beside the artifact
    gated = (tmp_path / "out" / "report.json").read_bytes()
    proc = dstc("eval", tmp_path / "out", "--dataset", user_data, "--window", "64", *QUICK, env=cache)
    assert proc.returncode == 0, proc.stderr
    assert "holds its build's gated report" in proc.stderr
    assert (tmp_path / "out" / "report.json").read_bytes() == gated
    assert load_report(tmp_path / "out-eval").settings["data"]["window"] == 64
    assert dstc("verify", tmp_path / "out", env=cache).returncode == 0
    recipe.write_text(recipe.read_text().replace("data/mine.jsonl", "data/absent.jsonl"))
    with pytest.raises(Exception, match="eval.dataset data/absent.jsonl is not a file"):
        build(recipe, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_sequences_in_groups_give_the_record_of_one_group(monkeypatch):
    """The reference's hidden states are held for a bounded group of sequences at a time: the same record."""
    from toolchain.reference import record as reference_record
    from toolchain.reference.record import compute_record

    source = sources.resolve("deepseek-v3-tiny")
    tokenizer = load_tokenizer(source.path)
    settings = EvalSettings(texts=12, greedy_prompts=2, greedy_tokens=4)
    data = load_data(settings, tokenizer, task=False, max_length=1024)
    args = dict(eos_ids=[1], pad_id=0, newline_id=None)
    whole = compute_record(LayeredReference(source), data, settings, **args)
    monkeypatch.setattr(reference_record, "GROUP_BYTES", 1)  # one sequence per group
    grouped = compute_record(LayeredReference(source), data, settings, **args)
    for a, b in [(whole.top_ids, grouped.top_ids), (whole.top_logp, grouped.top_logp),
                 (whole.target_logp, grouped.target_logp), *zip(whole.routes.values(), grouped.routes.values())]:
        assert len(a) == len(b) == 12 and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert sorted(whole.routes) == [1, 2] and whole.greedy == grouped.greedy


def test_a_long_window_run_in_prefill_chunks_gives_the_figures_of_one_prefill(artifact, monkeypatch):
    """The artifact runs a window PREFILL_CHUNK tokens at a time through its KV cache (bounded logits): on the fp32
    ONNX Runtime artifact the figures equal those of one prefill of the whole window."""
    from toolchain.evaluate import accuracy
    from toolchain.reference.record import compute_record
    from toolchain.runtime.artifact import open_artifact
    from toolchain.runtime.decoder import open_decoder

    art = open_artifact(artifact)
    tokenizer = art.tokenizer()
    settings = EvalSettings(texts=40, greedy_prompts=1, greedy_tokens=2)
    data = load_data(settings, tokenizer, task=False, max_length=1024)
    # one long sequence: the held-out texts end to end
    data.sequences = [type(data.sequences[0])([t for s in data.sequences for t in s.ids][:600])]
    record = compute_record(LayeredReference(sources.resolve("r1-distill-qwen-tiny")), data, settings,
                            eos_ids=art.eos_token_ids, pad_id=art.pad_token_id, newline_id=None)
    decoder = open_decoder(art, threads=1)

    def figures() -> dict:
        metrics, _ = accuracy.measure_accuracy(decoder, record, data, {}, tokenizer, eos_ids=art.eos_token_ids,
                                               pad_id=art.pad_token_id, newline_id=None, settings=settings)
        return {k: m.value for k, m in metrics.items() if k in ("perplexity", "kl_mean", "top1_agreement")}

    monkeypatch.setattr(accuracy, "PREFILL_CHUNK", 4096)
    whole = figures()
    monkeypatch.setattr(accuracy, "PREFILL_CHUNK", 128)
    chunked = figures()
    assert whole["kl_mean"] < 1e-7 and chunked["kl_mean"] < 1e-7
    assert chunked["top1_agreement"] == whole["top1_agreement"] == 1.0
    assert chunked["perplexity"] == pytest.approx(whole["perplexity"], rel=1e-5)


def test_eval_scores_an_lm_eval_task_on_both_sides_caches_the_reference_and_gates_the_drop(artifact, tmp_path, cache):
    """`dstc eval --tasks arc_easy --task-data DIR`: the harness's accuracy and standard error for the artifact, the
    reference's beside it, the drop in points; the second eval reuses the reference's scores, the third scores them
    again after they were edited in the cache; `dstc gate --max-task-drop` reads them."""
    rows = []
    for i, text in enumerate(corpus.text_samples("heldout", 24, seed=5)):
        question, answer = text.rsplit(" ", 1)
        choices = sorted({answer, "market.", "Bruno.", "river."})
        rows.append({"id": f"q{i}", "question": question,
                     "choices": {"text": choices, "label": list("ABCD")[:len(choices)]},
                     "answerKey": "ABCD"[choices.index(answer)]})
    (tmp_path / "tasks" / "arc_easy").mkdir(parents=True)
    (tmp_path / "tasks" / "arc_easy" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--tasks", "arc_easy", "--task-data", tmp_path / "tasks", "--task-limit", "16", "--texts", "4",
            "--problems", "2", "--greedy-prompts", "0", "--no-latency", "--json"]
    first = dstc("eval", artifact, *args, env=cache)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    acc = report["metrics"]["arc_easy/acc"]
    assert 0 <= acc["value"] <= 1 and acc["stderr"] > 0 and acc["direction"] == "higher"
    assert acc["reference"] == acc["value"]  # fp32 ONNX Runtime and fp32 PyTorch choose alike
    assert report["metrics"]["arc_easy/drop"]["value"] == 0
    assert report["reference"]["tasks_cache"]["reused"] is False
    second = json.loads(dstc("eval", artifact, *args, env=cache).stdout)
    assert second["reference"]["tasks_cache"] == {**report["reference"]["tasks_cache"], "reused": True}
    assert second["metrics"]["arc_easy/acc"] == acc
    # a cached score edited: not taken, the reference scored again (one line says so)
    entry = Path(cache["DSTC_CACHE_DIR"]) / "references" / f"tasks-{report['reference']['tasks_cache']['key']}.json"
    edited = json.loads(entry.read_text())
    edited["scores"]["arc_easy"]["metrics"]["acc,none"] = 0.0123
    entry.write_text(json.dumps(edited))
    third = dstc("eval", artifact, *args, env=cache)
    assert third.returncode == 0 and third.stderr.count("is not usable") == 1, third.stderr
    assert "does not match its digest); scoring the reference again" in third.stderr
    assert json.loads(third.stdout)["metrics"]["arc_easy/acc"] == acc
    gate = dstc("gate", artifact / "report.json", "--max-task-drop", "0.5", env=cache)
    assert gate.returncode == 0 and "max_task_drop (arc_easy)" in gate.stdout, gate.stdout + gate.stderr
    missing = dstc("eval", artifact, "--tasks", "arc_easy", "--no-latency", env=cache)
    assert missing.returncode == 2 and "--task-data" in missing.stderr


def test_the_layered_reference_is_refused_in_one_line_when_it_cannot_fit(monkeypatch):
    from toolchain.reference.outputs import require_layered_reference_memory

    source = sources.resolve("deepseek-v3-tiny")
    require_layered_reference_memory(source)  # a few MB: fits
    monkeypatch.setenv("DSTC_MEMORY_LIMIT_BYTES", "100000")
    with pytest.raises(InputError, match=r"the fp32 reference of deepseek-v3-tiny, one layer at a time \(.* MiB"):
        require_layered_reference_memory(source)
