"""DeepSeek's MTP layer (issue #26), on the embedded DeepSeek-V3 and V3.2 models (V3.2's layer with its lightning
indexer and the indexer's key cache): the main graph's optional hidden-state output, the MTP layer's graph against
its PyTorch reference on both backends, the embedded models' trained MTP layers (main model untouched), the MTP
cache cut back after speculative positions, and the self-speculative drafter over the graphs: lossless, and
drafting exactly what the reference drafts."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import run_cli

from toolchain import source as sources
from toolchain.checkpoint.reader import open_checkpoint
from toolchain.export.architectures import architecture_for
from toolchain.export.decoder import build_decoder
from toolchain.export.graph import save_graph
from toolchain.export.mtp import build_mtp_graph
from toolchain.export.mtp_reference import mtp_layer_indices
from toolchain.interface.graph import (
    CACHE_KINDS,
    HIDDEN_OUTPUT,
    HIDDEN_STATES,
    MOE_LAYERS,
    MTP_HIDDEN,
    MTP_LAYER,
    graph_cache_spec,
)
from toolchain.models import corpus
from toolchain.reference.whole import reference_model
from toolchain.runtime.decoder import StatelessDecoder
from toolchain.runtime.engines import GraphRunner
from toolchain.runtime.mtp_drafter import MtpDrafter
from toolchain.tokenizer_loading import load_tokenizer
from toolchain.verify.mtp_parity import MtpTorchDecoder, compare_mtp_graph, reference_mtp
from toolchain.verify.parity import parity_cases

MODELS = ("deepseek-v3-tiny", "deepseek-v32-tiny")
BACKENDS = ("onnxruntime", "openvino")


@pytest.fixture(scope="module", params=MODELS)
def source(request):
    return sources.resolve(request.param)


@pytest.fixture(scope="module")
def graphs(source, tmp_path_factory):
    """The embedded model's main graph with its hidden-state output, and its MTP layer's graph."""
    out = tmp_path_factory.mktemp("mtp-graphs")
    arch = architecture_for(source.config["model_type"])
    with open_checkpoint(source.path) as reader:
        skeleton = sources.skeleton(source, reader)
        save_graph(build_decoder(skeleton, arch, reader, hidden_output=True), out / "main.onnx")
    with open_checkpoint(source.path, mtp=True) as reader:
        save_graph(build_mtp_graph(skeleton, arch, reader, 3), out / "mtp.onnx")
    return out / "main.onnx", out / "mtp.onnx"


def test_the_hidden_state_output_is_off_by_default_and_recorded_when_on(source):
    arch = architecture_for(source.config["model_type"])
    with open_checkpoint(source.path) as reader:
        skeleton = sources.skeleton(source, reader)
        plain = build_decoder(skeleton, arch, reader)
        with_hidden = build_decoder(skeleton, arch, reader, hidden_output=True)
    plain_outputs = [v.name for v in plain.graph.outputs]
    assert HIDDEN_STATES not in plain_outputs and HIDDEN_OUTPUT not in plain.metadata_props
    assert [v.name for v in with_hidden.graph.outputs] == [*plain_outputs, HIDDEN_STATES]
    assert with_hidden.metadata_props[HIDDEN_OUTPUT] == HIDDEN_STATES
    # the same nodes and weights: the output is the final norm's, which the lm_head reads
    assert len(with_hidden.graph) == len(plain.graph)
    assert list(with_hidden.graph.initializers) == list(plain.graph.initializers)


def test_the_embedded_checkpoint_holds_its_mtp_layer_beside_an_unchanged_main_model(source):
    config = json.loads((source.path / "config.json").read_text())
    assert "num_nextn_predict_layers" not in config  # kept byte-identical: the artifacts copy it
    with open_checkpoint(source.path) as reader:
        assert reader.skipped_layers == (3,)
        assert not any(n.startswith("model.layers.3.") for n in reader.names())
    with open_checkpoint(source.path, mtp=True) as reader:
        assert mtp_layer_indices(reader.names(), reader.config) == [3]
        # the embedding and head are the main model's (shared), not stored again
        assert not reader.has("model.layers.3.embed_tokens.weight")
        assert not reader.has("model.layers.3.shared_head.head.weight")
        assert reader.shape("model.layers.3.eh_proj.weight") == (128, 256)


def test_the_recorded_acceptance_is_what_the_checkpoint_gives(source):
    from toolchain.models.mtp_training import heldout_sequences, teacher_forced_acceptance

    record = json.loads((source.path / "training.json").read_text())["mtp"]
    model = reference_model(source)
    mtp = reference_mtp(model, source.path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as it was measured; and 2 threads on a loaded 2-core machine spin for minutes
    try:
        measured = teacher_forced_acceptance(model, mtp, heldout_sequences(load_tokenizer(source.path)))
    finally:
        torch.set_num_threads(threads)
    assert measured == {k: record["metrics"][k] for k in measured}
    assert record["metrics"]["mtp_acceptance"] > 0.6  # when trained: V3 0.7033, V3.2 0.7172


def test_mtp_training_is_deterministic_and_leaves_the_main_model_alone(source):
    """V3.2's indexer through its dense warm-up (1 step) and a sparse step: its KL trains it."""
    from toolchain.models.indexer_training import IndexerSettings
    from toolchain.models.mtp_training import MTP_SETTINGS, new_mtp, train_mtp
    from toolchain.models.train import encode_lines, pack_rows

    tokenizer = load_tokenizer(source.path)
    rows = pack_rows(encode_lines(tokenizer, corpus.text_samples("train", 64)), 64, tokenizer.bos_token_id,
                     tokenizer.eos_token_id, tokenizer.pad_token_id)
    settings = replace(MTP_SETTINGS, steps=3, batch_size=4, warmup=1)
    indexed = source.config["model_type"] == "deepseek_v32"
    indexer = IndexerSettings(dense_steps=1) if indexed else None
    model = sources.load(source)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    runs = []
    for _ in range(2):
        mtp = new_mtp(model, settings)
        initial = {k: v.clone() for k, v in mtp.layer.state_dict().items()}
        loss = train_mtp(model, mtp, rows, tokenizer.pad_token_id, settings, indexer=indexer)
        runs.append((loss, {k: v.clone() for k, v in mtp.layer.state_dict().items()}))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    if indexed:  # transformers' indexer has no gradient of its own: these moved by its KL alone
        assert runs[0][0]["mtp_final_indexer_kl"] > 0
        assert not torch.equal(initial["block.self_attn.indexer.wk.weight"],
                               runs[0][1]["block.self_attn.indexer.wk.weight"])
        assert mtp.layer.config._attn_implementation == model.config._attn_implementation  # set back


def test_mtp_graph_matches_pytorch_on_both_backends(source, graphs):
    """V3.2's: the indexer's keys a third cache, named and recorded as the main graph's; the long parity case and
    its greedy tokens cross the indexer's top-k (16)."""
    _, mtp_graph = graphs
    import onnx

    proto = onnx.load(str(mtp_graph), load_external_data=False)
    kinds = ["key", "value", *(["index_key"] if source.config["model_type"] == "deepseek_v32" else [])]
    assert [i.name for i in proto.graph.input] == ["input_ids", "attention_mask", "position_ids", HIDDEN_STATES,
                                                    *(f"past_key_values.0.{k}" for k in kinds)]
    assert [o.name for o in proto.graph.output] == ["logits", *(f"present.0.{k}" for k in kinds), MTP_HIDDEN]
    metadata = {p.key: p.value for p in proto.metadata_props}
    assert metadata[MTP_LAYER] == "3" and json.loads(metadata[CACHE_KINDS]) == kinds
    assert json.loads(metadata[MOE_LAYERS]) == [3]
    model = reference_model(source)
    results = compare_mtp_graph(model, source.path, mtp_graph, BACKENDS, parity_cases(source.path, 640), 8, 2)
    for backend, result in results.items():
        assert result["passed"], (backend, result)
        assert result["max_relative_diff"] < 1e-5  # measured 3e-7 on both


def test_a_rolled_back_mtp_cache_gives_the_logits_of_one_that_never_held_the_rejected_positions(source, graphs):
    """The MTP graph's cache cut back after speculative positions (rejected drafts chained on the layer's own
    hidden state) is the cache that never held them: the next positions' logits are bit-identical, on ONNX
    Runtime's decoder (its OrtValue cache) and the stateless decoders of both backends. 20 positions and 4 more
    cross V3.2's index_topk (16), so its indexer chooses among its rolled-back keys."""
    from toolchain.runtime.decoder import OnnxRuntimeDecoder

    _, mtp_graph = graphs
    tokens = torch.tensor([[(7 * i + 3) % 600 + 20 for i in range(25)]])
    with torch.no_grad():
        hidden = reference_model(source).model(input_ids=tokens).last_hidden_state.numpy()
    ids = tokens.numpy()
    ones = lambda n: np.ones((1, n), np.int64)  # noqa: E731
    rejected = np.random.default_rng(0).standard_normal((1, 3, hidden.shape[-1])).astype(np.float32)
    spec = graph_cache_spec(mtp_graph)
    decoders = {"onnxruntime": lambda: OnnxRuntimeDecoder(mtp_graph, None, (MTP_HIDDEN,)),
                **{f"{b} stateless": (lambda b=b: StatelessDecoder(GraphRunner(mtp_graph, b), spec)) for b in BACKENDS}}
    for name, make in decoders.items():
        decoder = make()
        decoder.forward(ids[:, 1:21], ones(20), inputs={HIDDEN_STATES: hidden[:, :20]})
        never = decoder.forward(ids[:, 21:25], ones(24), inputs={HIDDEN_STATES: hidden[:, 20:24]})
        decoder.reset()
        decoder.forward(ids[:, 1:21], ones(20), inputs={HIDDEN_STATES: hidden[:, :20]})
        decoder.forward(np.array([[5, 6, 7]]), ones(23), inputs={HIDDEN_STATES: rejected})
        held = decoder.forward(ids[:, 21:25], ones(27), inputs={HIDDEN_STATES: hidden[:, 20:24]})
        assert not np.array_equal(held, never), name  # the rejected positions change what follows
        decoder.reset()
        decoder.forward(ids[:, 1:21], ones(20), inputs={HIDDEN_STATES: hidden[:, :20]})
        decoder.forward(np.array([[5, 6, 7]]), ones(23), inputs={HIDDEN_STATES: rejected})
        decoder.rollback(20)
        again = decoder.forward(ids[:, 21:25], ones(24), inputs={HIDDEN_STATES: hidden[:, 20:24]})
        np.testing.assert_array_equal(again, never, err_msg=name)


def prompts_of(source, n: int = 8) -> list[list[int]]:
    """Held-out text beginnings and held-out problems."""
    tok = load_tokenizer(source.path)
    texts = [tok(t)["input_ids"][:6] for t in corpus.text_samples("heldout", n, 1)]
    problems = [tok(p)["input_ids"] for p, _ in corpus.task_examples("heldout", n, 1)]
    return texts + problems


def speculate(main, drafter, prompt: list[int], new_tokens: int, k: int):
    """A greedy speculative loop (the verify loop's contract): the tokens, and each proposal as (its place in the
    sequence, its drafts, how many were accepted)."""
    main.reset()
    drafter.reset()
    logits = main.forward(np.array([prompt]), np.ones((1, len(prompt)), np.int64))
    tokens = [*prompt, int(logits[0, -1].argmax())]
    hidden = main.extras[HIDDEN_STATES]
    proposals = []
    while len(tokens) < len(prompt) + new_tokens:
        drafts = drafter.propose(tokens, {HIDDEN_STATES: hidden}, k)
        feed = [tokens[-1], *drafts]
        greedy = main.forward(np.array([feed]), np.ones((1, len(tokens) - 1 + len(feed)), np.int64))[0].argmax(-1)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
            accepted += 1
        proposals.append((len(tokens), drafts, accepted))
        tokens += [*drafts[:accepted], int(greedy[accepted])]
        main.rollback(len(tokens) - 1)
        hidden = main.extras[HIDDEN_STATES][:, :accepted + 1]
        drafter.rollback(len(tokens) - 1)
    return tokens[:len(prompt) + new_tokens], proposals


def plain_greedy(main, prompt: list[int], new_tokens: int) -> list[int]:
    main.reset()
    tokens = list(prompt)
    logits = main.forward(np.array([prompt]), np.ones((1, len(prompt)), np.int64))
    while len(tokens) < len(prompt) + new_tokens:
        tokens.append(int(logits[0, -1].argmax()))
        logits = main.forward(np.array([tokens[-1:]]), np.ones((1, len(tokens)), np.int64))
    return tokens


def reference_drafts(model, mtp, tokens: list[int]) -> np.ndarray:
    """The PyTorch MTP layer's draft of every token j >= 2 of ``tokens`` (index j - 2), from the PyTorch main
    model's hidden states: what a drafter with only real cache entries proposes."""
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([tokens])).last_hidden_state.numpy()
    reference = MtpTorchDecoder(mtp)
    logits = reference.forward(np.array([tokens[1:]]), np.ones((1, len(tokens) - 1), np.int64),
                               inputs={HIDDEN_STATES: hidden[:, :-1]})
    return logits[0].argmax(-1)


def check_drafter(main, drafter, model, mtp, prompts, new_tokens: int = 24) -> float:
    """Speculation with one draft per step is lossless and drafts what the PyTorch reference drafts; deeper drafts
    stay lossless. The acceptance of the single drafts."""
    proposed = accepted = 0
    for prompt in prompts:
        greedy = plain_greedy(main, prompt, new_tokens)
        tokens, proposals = speculate(main, drafter, prompt, new_tokens, 1)
        assert tokens == greedy
        expected = reference_drafts(model, mtp, greedy)
        for place, drafts, taken in proposals:
            if place < len(greedy):
                assert drafts == [int(expected[place - 2])], (prompt, place)
            proposed += len(drafts)
            accepted += taken
        assert speculate(main, drafter, prompt, new_tokens, 3)[0] == greedy
    return accepted / proposed


def test_mtp_drafter_over_the_graphs_drafts_what_the_reference_drafts(source, graphs):
    main_graph, mtp_graph = graphs
    model = reference_model(source)
    mtp = reference_mtp(model, source.path)
    main = StatelessDecoder(GraphRunner(main_graph, "onnxruntime"), graph_cache_spec(main_graph), (HIDDEN_STATES,))
    drafter = MtpDrafter(StatelessDecoder(GraphRunner(mtp_graph, "onnxruntime"), graph_cache_spec(mtp_graph),
                                          (MTP_HIDDEN,)))
    rate = check_drafter(main, drafter, model, mtp, prompts_of(source, 4))
    assert rate > 0.5, rate


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_speculative_loop_with_mtp_drafts_gives_the_plain_greedy_tokens(source, graphs, backend):
    """dstc's verify loop (toolchain/runtime/speculative.py, as generate and eval run it) with the MTP drafter, at
    fp32 on each backend: the plain greedy tokens at 1 and 3 drafts a step, and its acceptance counted."""
    from toolchain.runtime.speculative import Acceptance, speculative_steps

    main_graph, mtp_graph = graphs
    main = StatelessDecoder(GraphRunner(main_graph, backend), graph_cache_spec(main_graph), (HIDDEN_STATES,))
    drafter = MtpDrafter(StatelessDecoder(GraphRunner(mtp_graph, backend), graph_cache_spec(mtp_graph),
                                          (MTP_HIDDEN,)))
    for k in (1, 3):
        acceptance = Acceptance()
        for prompt in prompts_of(source, 2):
            greedy = plain_greedy(main, prompt, 16)[len(prompt):]
            steps = speculative_steps(main, drafter, prompt, max_new_tokens=16, stop_ids=set(), draft_tokens=k,
                                      acceptance=acceptance)
            assert [t for step in steps for t in step] == greedy, (k, prompt)
        assert acceptance.rate > 0.3, (k, acceptance.summary())


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_built_artifact_carries_the_mtp_layer_and_its_drafter_drafts_the_greedy_tokens(source, backend, tmp_path,
                                                                                       monkeypatch, capsys):
    from toolchain.runtime.artifact import open_artifact
    from toolchain.runtime.decoder import open_decoder
    from toolchain.runtime.mtp_drafter import open_mtp_drafter

    recipe = tmp_path / "mtp.yaml"
    recipe.write_text(f"name: mtp-{backend}\nmodel: {source.spec}\nexport:\n  mtp: true\n"
                      f"passes:\n  target: {backend}\ncompile:\n  backend: {backend}\n")
    out = tmp_path / "artifact"
    code, _, err = run_cli(monkeypatch, capsys, "build", recipe, "-o", out)
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    graph = "mtp/openvino_model.xml" if backend == "openvino" else "mtp/model.onnx"
    assert graph in manifest["files"]
    compile_report = manifest["provenance"]["stage_reports"]["compile/compile.json"]
    verification = compile_report["mtp"]["verification"]
    assert verification["passed"] and verification["drafts_identical"]
    print(f"{backend}: compiled MTP layer vs PyTorch, max relative diff {verification['max_relative_diff']:.2e}")
    artifact = open_artifact(out)
    main = open_decoder(artifact, extra_outputs=(HIDDEN_STATES,), openvino_f32=True)
    drafter = open_mtp_drafter(artifact, openvino_f32=True)
    model = reference_model(source)
    rate = check_drafter(main, drafter, model, reference_mtp(model, source.path), prompts_of(source))
    print(f"{backend}: acceptance of single drafts {rate:.4f}")
    assert rate > 0.5


@pytest.mark.slow
def test_mtp_layer_of_a_hub_fp8_checkpoint_with_its_own_embedding_and_head(tmp_path):
    """DeepSeek-V3's hub layout (toolchain/checkpoint/fp8.py): the MTP layer in FP8 with its own copies of the
    embedding and head, read dequantized by both the graph and the reference."""
    from toolchain.models.shape_faithful import write_fp8_checkpoint

    source = sources.resolve("deepseek-v3-tiny")
    fp8 = write_fp8_checkpoint(source.path, tmp_path / "fp8", shard_bytes=1_000_000, mtp_layers=1)
    with open_checkpoint(fp8, mtp=True) as reader:
        assert mtp_layer_indices(reader.names(), reader.config) == [3]
        assert reader.has("model.layers.3.embed_tokens.weight")
        assert reader.has("model.layers.3.shared_head.head.weight")
        hub = sources.resolve(str(fp8))
        with open_checkpoint(fp8) as main_reader:
            skeleton = sources.skeleton(hub, main_reader)
        graph = build_mtp_graph(skeleton, architecture_for("deepseek_v3"), reader, 3)
    save_graph(graph, tmp_path / "mtp.onnx")
    model = reference_model(hub)
    result = compare_mtp_graph(model, fp8, tmp_path / "mtp.onnx", ("onnxruntime",), parity_cases(fp8, 640), 4, 2)
    assert result["onnxruntime"]["passed"], result
