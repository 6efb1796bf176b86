"""dstc serve --speculate (toolchain/serve/engine_runner.py, toolchain/runtime/batched_drafts.py): greedy output
identical to plain serving through the API and in the runner's backend, with requests of different lengths joining
and leaving so that one verify step's rows accept different counts (holes in the batch's cache, compacted on
rebuilds), for prompt lookup, the MTP layer and draft artifacts; the acceptance counters in /metrics; the
combinations refused."""

from __future__ import annotations

import json
import re
import shutil
import threading

import httpx
import numpy as np
import pytest
from conftest import run_cli
from serve_helpers import Server

from toolchain.models.corpus import task_examples
from toolchain.runtime.sampling import Sampling
from toolchain.serve.engine import Request
from toolchain.serve.engine_options import EngineOptions
from toolchain.serve.engine_runner import RunnerBackend
from toolchain.settings.speculation import SpeculationSettings

pytestmark = pytest.mark.timeout(300)

LATENT, GQA, V32, V4 = "deepseek-v3-tiny", "r1-distill-qwen-tiny", "deepseek-v32-tiny", "deepseek-v4-tiny"
ORT = {"compile": {"backend": "onnxruntime", "verify": False}}
INT4 = {"scheme": "int4-grouped", "group_size": 128, "sym": False, "backup": "int8"}
# draft models (model, backend, recipe sections) of the cases' "draft:NAME": a main model's own weights at INT4,
# which agree with its fp32 build on most tokens but not all (rejections beside acceptances)
DRAFTS = {
    "draft:ort-int4": (GQA, "onnxruntime", {"compress": INT4, "compile": {"backend": "onnxruntime", "verify": False}}),
    "draft:ov-int4": (GQA, "openvino", {"compress": INT4, "compile": {"backend": "openvino", "verify": False}}),
    "draft:ov-latent-int4": (LATENT, "openvino", {"compress": INT4, "compile": {"backend": "openvino",
                                                                                "verify": False}}),
    "draft:v4-int4": (V4, "onnxruntime", {"compress": INT4, "compile": {"backend": "onnxruntime", "verify": False}}),
}


def speculate(artifact, method: str) -> str:
    """The --speculate value of a case: a draft model's built for it."""
    if method not in DRAFTS:
        return method
    model, backend, recipe = DRAFTS[method]
    return f"draft:{artifact(model, backend, recipe).path}"


def sections(method: str, backend: str) -> dict | None:
    """The recipe sections of the artifact a case runs on: with the MTP layer for mtp drafts, else the default."""
    if method != "mtp":
        return None
    return {"export": {"parity": [], "mtp": True}, "compile": {"backend": backend, "verify": False}}


def texts(count: int = 6) -> list[str]:
    """Held-out problems after one to three solved ones (n-grams for prompt lookup), and a short one."""
    ex = task_examples("heldout", count + 6)
    return ["".join(p + a + "\n" for p, a in ex[i:i + 1 + i % 3]) + ex[i + 4][0] for i in range(count)] + ["12+345="]


def backend_run(art, speculation: SpeculationSettings | None, sampled: bool = False,
                steps: list | None = None) -> tuple[dict[int, list[int]], list[tuple[int, int]]]:
    """Each prompt's tokens from the runner's backend, two requests joining per step (max tokens 24..42), and
    every step's (proposed, accepted) per request (``steps``: appended each step's list of them).
    ``sampled``: every other request at temperature 0.8, seeded."""
    tokenizer = art.tokenizer()
    backend = RunnerBackend(art, EngineOptions(artifact=str(art.path), engine="dstc", threads=2, max_batch=16,
                                               max_context=256, f32=True,
                                               speculation=speculation or SpeculationSettings()))
    backend.load()
    requests = [Request(prompt=tokenizer(text)["input_ids"], max_tokens=24 + 3 * i,
                        sampling=Sampling(temperature=0.8, seed=i) if sampled and i % 2 else Sampling(),
                        stop_ids=frozenset(art.eos_token_ids), sink=lambda event: None, id=i + 1)
                for i, text in enumerate(texts())]
    out: dict[int, list[int]] = {r.id: [] for r in requests}
    pending, finished, drafted = list(requests), set(), []
    while len(finished) < len(requests):
        results = backend.add(pending[:2]) if pending else []
        pending = pending[2:]
        results += backend.step()
        drafted += backend.drafted
        if steps is not None:
            steps.append(backend.drafted)
        for request, tokens, finish in results:
            assert finish != "error", request.error
            out[request.id] += tokens
            if finish is not None:
                finished.add(request.id)
    return out, drafted


@pytest.mark.parametrize(("model", "method", "backend"), [
    (LATENT, "mtp", "onnxruntime"), (LATENT, "prompt-lookup", "onnxruntime"), (GQA, "prompt-lookup", "onnxruntime"),
    (LATENT, "prompt-lookup", "openvino"), (LATENT, "mtp", "openvino"),  # dstc's OpenVINO latent runner, at f32
    (V32, "mtp", "onnxruntime"), (V32, "mtp", "openvino"),  # MTP's own indexer keys, with holes
    (GQA, "draft:ort-int4", "onnxruntime"), (GQA, "draft:ov-int4", "onnxruntime"),  # the draft's own batch
    (LATENT, "draft:ov-latent-int4", "openvino"),
    # DeepSeek-V4's per-token cache, compacted after every step (its rows' slots are counted from held columns)
    (V4, "prompt-lookup", "onnxruntime"), (V4, "prompt-lookup", "openvino"),
    (V4, "mtp", "onnxruntime"), (V4, "mtp", "openvino"),  # its MTP block's cache is per-token too
    pytest.param(V4, "draft:v4-int4", "onnxruntime", marks=pytest.mark.slow)])  # an INT4 V4 build: a minute more
def test_backend_speculates_to_plain_serving_tokens(artifact, model, method, backend):
    art = artifact(model, backend, sections(method, backend))
    plain, none = backend_run(art, None)
    assert none == [] and all(plain.values())
    steps: list[list[tuple[int, int]]] = []
    spoken, drafted = backend_run(art, SpeculationSettings(speculate=speculate(artifact, method), draft_tokens=4),
                                  steps=steps)
    assert spoken == plain
    accepted = [a for _, a in drafted]
    assert max(p for p, _ in drafted) == 4 and sum(accepted) > 0
    # rows of one step accepted different counts (what leaves holes of different widths in the cache)
    assert len(set(accepted)) > 2
    if method.startswith("draft:"):  # a step whose rows accepted every draft beside rows that rejected one
        assert any({a == p for p, a in step} == {True, False} for step in steps), steps


@pytest.mark.parametrize(("model", "method"), [(LATENT, "mtp"), (GQA, "draft:ort-int4")])
def test_sampled_requests_beside_greedy_ones(artifact, model, method):
    """Speculative sampling rows (seeded) in the same verify steps as greedy ones: the greedy rows keep plain
    serving's tokens, a sampled row's tokens are the same from run to run and fill its budget or end at a stop."""
    art = artifact(model, "onnxruntime", sections(method, "onnxruntime"))
    plain, _ = backend_run(art, None)
    settings = SpeculationSettings(speculate=speculate(artifact, method), draft_tokens=3)
    first, drafted = backend_run(art, settings, sampled=True)
    again, _ = backend_run(art, settings, sampled=True)
    assert first == again and sum(a for _, a in drafted) > 0
    greedy = [i for i in first if i % 2]  # request ids are 1-based: the odd ones were greedy
    sampled = [i for i in first if not i % 2]
    assert all(first[i] == plain[i] for i in greedy)
    assert all(0 < len(first[i]) <= 24 + 3 * (i - 1) for i in sampled)
    assert any(first[i] != plain[i] for i in sampled)  # (a confident answer may be drawn as the greedy one)


@pytest.mark.slow
def test_backend_speculates_to_plain_serving_tokens_past_the_indexer_top_k(artifact):
    """DeepSeek-V3.2: the indexer adds the mask to its scores before its top-k, so holes are never chosen."""
    art = artifact(V32, "onnxruntime", ORT)
    plain, _ = backend_run(art, None)
    spoken, drafted = backend_run(art, SpeculationSettings(speculate="prompt-lookup", draft_tokens=4))
    assert spoken == plain and sum(p for p, _ in drafted) > 0


def served(server: Server, prompts: list[str]) -> list[str]:
    """Greedy completions of ``prompts``, sent at once (max tokens 20..41)."""
    out: list[str] = [""] * len(prompts)

    def one(i: int) -> None:
        response = httpx.post(server.base + "/v1/completions", timeout=120, json={
            "model": server.name, "prompt": prompts[i], "max_tokens": 20 + 3 * i, "temperature": 0})
        assert response.status_code == 200, response.text
        out[i] = response.json()["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


@pytest.mark.slow  # two servers per case (about 30 s each)
@pytest.mark.parametrize(("model", "method", "backend"), [
    (LATENT, "mtp", "onnxruntime"), (GQA, "prompt-lookup", "onnxruntime"), (GQA, "draft:ort-int4", "onnxruntime"),
    (LATENT, "mtp", "openvino"), (LATENT, "draft:ov-latent-int4", "openvino"),  # dstc's runner of the latent cache
    (GQA, "prompt-lookup", "openvino"), (GQA, "draft:ov-int4", "openvino")])  # openvino_genai's pipeline, its own
def test_served_greedy_completions_are_plain_servings_and_metrics_count_drafts(artifact, model, method, backend):
    art = artifact(model, backend, sections(method, backend))
    prompts = texts() * 2
    f32 = ("--openvino-f32",) if backend == "openvino" else ()
    plain = Server(art, *f32)
    try:
        expected = served(plain, prompts)
        assert not any(name.startswith("dstc_speculative_accepted_total{") for name in plain.metrics())
    finally:
        plain.stop()
    server = Server(art, *f32, "--speculate", speculate(artifact, method), "--draft-tokens", "3")
    try:
        assert served(server, prompts) == expected
        engine = httpx.get(server.base + "/health").json()["engine"]
        metrics = server.metrics()
    finally:
        server.stop()
    proposed = [metrics.get(f"dstc_speculative_proposed_total{{position={i}}}", 0.0) for i in range(4)]
    accepted = [metrics.get(f"dstc_speculative_accepted_total{{position={i}}}", 0.0) for i in range(4)]
    assert accepted[0] > 0 and accepted[3] == 0 and accepted[0] >= accepted[1] >= accepted[2]
    if engine == "openvino_genai":  # it does not say what it proposed
        assert proposed == [0.0] * 4
    else:
        assert proposed[0] > 0 and proposed[3] == 0 and proposed[0] >= proposed[1] >= proposed[2]
        assert all(a <= p for a, p in zip(accepted, proposed))
    steps = metrics["dstc_speculative_verify_steps_total"]
    # a verify step gives a request its accepted drafts and one token (fewer at a stop token), the prefill the first
    assert steps < metrics["dstc_generation_tokens_total"] <= steps + sum(accepted) + len(prompts)


@pytest.mark.parametrize(("model", "args", "message"), [
    (GQA, ("--speculate", "mtp"), "has no MTP layer (mtp/) to draft with"),
    (GQA, ("--speculate", "prompt-lookup", "--kv-layout", "gather"), "in the 'batch' KV-cache layout"),
    (GQA, ("--speculate", "draft:/nowhere"), "/nowhere is not a directory (expected an artifact"),
    (GQA, ("--speculate", "draft:SELF", "--kv-layout", "gather"), "in the 'batch' KV-cache layout"),
    (GQA, ("--speculate", "draft:TINY"), "has no tokenizer.json"),
    (GQA, ("--speculate", "draft:OTHER"), "has another tokenizer than"),
    (GQA, ("--speculate", "ngram"), "is not 'prompt-lookup', 'mtp' or draft:ARTIFACT"),
    (GQA, ("--speculate", "draft:SHORT"), "has a context of 512 tokens, and sequences here reach 1024: use a shorter"),
    # a verify forward's kernels are not one token's: no bit-equal speculation on a batch-variant artifact
    (GQA, ("--speculate", "prompt-lookup", "--deterministic"), "--deterministic decodes each request alone"),
])
def test_combinations_that_cannot_work_are_refused_in_one_line(artifact, monkeypatch, capsys, tiny_checkpoints,
                                                               tmp_path, model, args, message):
    art = artifact(model, "onnxruntime")
    # draft artifacts: the main one, one without its tokenizer (a random checkpoint's), one with a token more
    tiny = str(artifact(tiny_checkpoints["deepseek_v32"], "onnxruntime").path)
    other = tmp_path / "other"
    shutil.copytree(art.path, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({**tokenizer["added_tokens"][-1], "id": 640, "content": "<extra>"})
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    short = shorter_context(art.path, tmp_path / "short", 512)
    args = tuple(arg.replace("TINY", tiny).replace("SELF", str(art.path)).replace("OTHER", str(other))
                 .replace("SHORT", str(short)) for arg in args)
    code, _, err = run_cli(monkeypatch, capsys, "serve", art.path, "--port", "0", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def shorter_context(path, to, context: int):
    """A copy of the artifact at ``path`` whose config says its context is ``context`` tokens."""
    shutil.copytree(path, to)
    config = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
    return to


def test_a_draft_is_checked_against_the_longest_sequence_it_follows(artifact, monkeypatch, capsys, tmp_path):
    """A draft model whose context is shorter than the sequences it would draft after (it would draft garbage past
    it) is refused before anything loads; a context that fits the sequences is taken."""
    from toolchain.runtime.batched_drafts import check_batch_speculation

    art = artifact(GQA, "onnxruntime")
    short = shorter_context(art.path, tmp_path / "short", 64)
    code, _, err = run_cli(monkeypatch, capsys, "generate", art.path, "12+345=", "--new-tokens", "60",
                           "--speculate", f"draft:{short}")
    assert code == 2 and "has a context of 64 tokens, and sequences here reach" in err, err
    code, _, err = run_cli(monkeypatch, capsys, "generate", art.path, "12+345=", "--new-tokens", "8",
                             "--raw", "--speculate", f"draft:{short}")
    assert code == 0, err
    check_batch_speculation(SpeculationSettings(speculate=f"draft:{short}"), art, 64)  # serve --max-context 64


@pytest.mark.parametrize(("model", "backend", "method", "message"), [
    (GQA, "openvino", "mtp", "served by openvino_genai's ContinuousBatchingPipeline, which drafts by"),
    (GQA, "openvino", "draft:ort", "draft-model speculation pages the draft's KV cache as the main one's: the draft"),
])
def test_engines_without_a_batched_verify_are_refused(artifact, model, backend, method, message):
    from toolchain.errors import InputError
    from toolchain.runtime.batched_drafts import check_batch_speculation

    art = artifact(model, backend, {"compile": {"backend": backend, "verify": False}})
    if method == "draft:ort":
        draft = artifact(GQA, "onnxruntime", {"compile": {"backend": "onnxruntime", "verify": False}})
        method = f"draft:{draft.path}"
    with pytest.raises(InputError, match=re.escape(message)):
        check_batch_speculation(SpeculationSettings(speculate=method), art)


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_batched_draft_model_drafts_what_it_drafts_for_one_sequence(artifact, backend):
    """BatchDraftModel over sequences that join, grow by a random accepted prefix and a token of their own, and
    leave, at different steps: each propose's drafts are the draft model's greedy continuation of each sequence
    alone (DraftModel at batch 1, from an empty cache). Its chained positions stay cached: a row is refed only the
    tokens past the drafts it accepted (the catch-up forward's width counted), the rest forgotten."""
    from toolchain.runtime.batched_drafts import BatchDraftModel, batch_drafter
    from toolchain.runtime.decoder import open_decoder
    from toolchain.runtime.speculative import DraftModel

    main = artifact(GQA, "onnxruntime")
    draft = artifact(GQA, backend)
    drafter = batch_drafter(SpeculationSettings(speculate=f"draft:{draft.path}"), main, threads=2, openvino_f32=True)
    assert isinstance(drafter, BatchDraftModel)
    alone = DraftModel(open_decoder(draft, threads=2, openvino_f32=True))
    tokenizer = main.tokenizer()
    prompts = [tokenizer(text)["input_ids"] for text in texts(4)]
    rng = np.random.default_rng(0)
    sequences: dict[int, list[int]] = {}
    accepted = []
    catch_up: list[dict] = []
    verify = drafter.batch.verify
    drafter.batch.verify = lambda fed, *rest: (catch_up.append({key: len(t) for key, t in fed.items()}),
                                               verify(fed, *rest))[1]
    expected: dict[int, int] = {}  # tokens each running row is refed at the next propose
    for step in range(10):
        if step < len(prompts):  # one joins per step
            sequences[step] = list(prompts[step])
        if step in (5, 7):  # and leaves
            drafter.leave([min(sequences)])
            expected.pop(min(sequences))
            del sequences[min(sequences)]
        catch_up.clear()
        proposed = drafter.propose(sequences, {}, 3)
        if expected:
            assert catch_up[0] == expected, step
        for key, tokens in sequences.items():
            alone.reset()
            assert proposed[key] == alone.propose(tokens, {}, 3), (step, key)
            taken = int(rng.integers(0, 4))
            accepted.append(taken)
            sequences[key] = [*tokens, *proposed[key][:taken], int(rng.integers(10, 600))]  # (a vocabulary of 640)
            # the chained positions were fed the first two drafts: those accepted are not fed again
            expected[key] = 1 + taken - min(taken, 2)
    assert len(set(accepted)) == 4
    drafter.reset()
    assert drafter.batch.keys == [] and drafter.propose({9: list(prompts[0])}, {}, 2)[9] == \
        (alone.reset(), alone.propose(list(prompts[0]), {}, 2))[1]


@pytest.mark.parametrize(("model", "backend"), [(LATENT, "onnxruntime"), (V4, "onnxruntime"), (V4, "openvino")])
def test_batched_mtp_drafts_what_it_drafts_for_one_sequence(artifact, model, backend):
    """BatchMtp over sequences that join, grow by a random accepted prefix and a token of their own, and leave:
    each propose's drafts are the MTP layer's for that sequence alone (MtpDrafter at batch 1, from an empty cache,
    fed the main model's hidden states of the sequence alone). Served greedy tokens do not show a wrong draft
    cache (speculation keeps them whatever it drafts); this does: DeepSeek-V4's MTP batch fails it without its
    compaction after each step."""
    from toolchain.interface.graph import HIDDEN_STATES
    from toolchain.runtime.batched_drafts import BatchMtp, batch_drafter
    from toolchain.runtime.decoder import open_decoder
    from toolchain.runtime.mtp_drafter import open_mtp_drafter

    art = artifact(model, backend, sections("mtp", backend))
    drafter = batch_drafter(SpeculationSettings(speculate="mtp"), art, threads=2, openvino_f32=True)
    assert isinstance(drafter, BatchMtp)
    alone = open_mtp_drafter(art, threads=2, openvino_f32=True)
    main = open_decoder(art, threads=2, openvino_f32=True, extra_outputs=(HIDDEN_STATES,))

    def states(tokens: list[int]) -> np.ndarray:
        """The main model's hidden states at each position of ``tokens``, run alone."""
        main.reset()
        main.forward(np.array([tokens], np.int64), np.ones((1, len(tokens)), np.int64), 1)
        return main.extras[HIDDEN_STATES][0]

    tokenizer = art.tokenizer()
    prompts = [tokenizer(text)["input_ids"] for text in texts(4)]
    rng = np.random.default_rng(1)
    sequences: dict[int, list[int]] = {}
    seen: dict[int, int] = {}  # per sequence, the last position whose hidden state the drafter was given
    accepted = []
    for step in range(8):
        if step < len(prompts):
            sequences[step] = list(prompts[step])
        if step == 5:
            drafter.leave([min(sequences)])
            del sequences[min(sequences)]
        hidden = {key: states(tokens)[seen.get(key, -1) + 1:len(tokens) - 1] for key, tokens in sequences.items()}
        proposed = drafter.propose(sequences, hidden, 3)
        for key, tokens in sequences.items():
            alone.reset()
            assert proposed[key] == alone.propose(tokens, {HIDDEN_STATES: states(tokens)[None, :-1]}, 3), (step, key)
            seen[key] = len(tokens) - 2
            taken = int(rng.integers(0, 4))
            accepted.append(taken)
            sequences[key] = [*tokens, *proposed[key][:taken], int(rng.integers(10, 600))]
    assert len(set(accepted)) == 4


def test_holes_are_masked_out_and_compacted_once_they_fill_half_the_cache(artifact):
    """PersistentBatch: what a row does not keep of a verify step turns into holes (not held); the next steps'
    logits are those of a batch that was never fed them; once holes are as many as the held positions the cache is
    rebuilt without them."""
    from toolchain.runtime.batching import PersistentBatch
    from toolchain.runtime.decoder import open_decoder

    art = artifact(GQA, "onnxruntime")
    batch = PersistentBatch(open_decoder(art, threads=2), art.pad_token_id)
    clean = PersistentBatch(open_decoder(art, threads=2), art.pad_token_id)
    prompts = {"a": [5, 17, 3, 9, 40, 22], "b": [8, 31, 12]}
    batch.join(prompts)
    clean.join(prompts)
    batch.verify({"a": [60, 61, 62, 63], "b": [70, 71]})
    batch.keep({"a": 1, "b": 2})  # holes: a's 61-63, b's two padding columns
    assert batch.tokens_held() == 12 and batch.holes() == 5
    clean.verify({"a": [60], "b": [70, 71]})
    clean.keep({"a": 1, "b": 2})

    def same(fed: dict, kept: dict) -> None:
        ours, theirs = batch.verify(fed), clean.verify(fed)
        for key in fed:
            np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, atol=1e-5)
        batch.keep(kept)
        clean.keep(kept)

    same({"a": [64, 65], "b": [72]}, {"a": 2, "b": 1})
    assert batch.tokens_held() == 15 and batch.holes() == 6 and batch.padded_positions() == 2 * 12
    batch.verify({"a": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "b": [11]})
    batch.keep({"a": 1, "b": 1})  # 24 holes against 17 held: compacted
    clean.verify({"a": [1], "b": [11]})
    clean.keep({"a": 1, "b": 1})
    assert batch.tokens_held() == 17 and batch.holes() == 0 and batch.padded_positions() == 2 * 10
    same({"a": [80, 81], "b": [82, 83]}, {"a": 2, "b": 2})


@pytest.mark.parametrize("replicas", [False, True])
def test_draft_counters_per_position_and_per_replica(replicas):
    """Each request's (proposed, accepted) of a step counts at positions 0..; with --replicas each replica's under
    its rank (not summed), /health's summary over all of them; openvino_genai's unknown proposed count adds none."""
    from prometheus_client.parser import text_string_to_metric_families

    from toolchain.serve.health import HealthMonitor
    from toolchain.serve.metrics import ServerMetrics

    metrics = ServerMetrics(HealthMonitor([]), replica_label=replicas)
    first, second = (metrics.replica("0"), metrics.replica("1")) if replicas else (metrics, metrics)
    first.drafts(3, 1)
    first.drafts(2, 2)
    second.drafts(1, 1)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(render_text(metrics)) for s in family.samples}

    def value(name: str, replica: str, **labels) -> float:
        key = {**labels, **({"replica": replica} if replicas else {})}
        return samples.get((name, tuple(sorted(key.items()))), 0.0)

    assert [value("dstc_speculative_proposed_total", "0", position=str(i)) for i in range(4)] == \
        ([2, 2, 1, 0] if replicas else [3, 2, 1, 0])
    assert [value("dstc_speculative_accepted_total", "0", position=str(i)) for i in range(3)] == \
        ([2, 1, 0] if replicas else [3, 1, 0])
    if replicas:
        assert value("dstc_speculative_accepted_total", "1", position="0") == 1
        assert value("dstc_speculative_proposed_total", "1", position="0") == 1
        assert value("dstc_speculative_verify_steps_total", "0") == 2
    assert metrics.speculation() == {"verify_steps": 3, "proposed_per_position": [3, 2, 1],
                                     "accepted_per_position": [3, 1], "acceptance_per_position": [1.0, 0.5],
                                     "accepted_per_verify_step": round(4 / 3, 4)}
    genai = ServerMetrics(HealthMonitor([]))
    genai.drafts(None, 2)  # openvino_genai's prompt lookup: accepted drafts only
    assert genai.speculation()["proposed_per_position"] == [] and genai.speculation()["accepted_per_position"] == \
        [1, 1]


def render_text(metrics) -> str:
    from toolchain.serve.metrics import render

    return render(metrics).decode()
