"""DeepSeek-V4's MTP block (issue #26; toolchain/export/deepseek_v4_mtp.py), on a V4 checkpoint in its hub layout
with one ``mtp.0.`` block (FP8 / FP4, sliding + CSA + HCA layers): the reader's names for it, the main graph's
stream output it reads, the block's graph against its PyTorch reference on both backends, its cache cut back after
speculative positions, and the self-speculative drafter over the graphs: lossless, and drafting exactly what the
reference drafts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import TINY_V4

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
from toolchain.reference.whole import reference_model
from toolchain.runtime.decoder import OnnxRuntimeDecoder, StatelessDecoder
from toolchain.runtime.engines import GraphRunner
from toolchain.runtime.mtp_drafter import MtpDrafter
from toolchain.runtime.speculative import Acceptance, speculative_steps
from toolchain.verify.mtp_parity import MtpTorchDecoder, compare_mtp_graph, main_hidden, reference_mtp
from toolchain.verify.parity import parity_cases

BACKENDS = ("onnxruntime", "openvino")
LAYERS = 3  # the MTP block is layer 3
RNG_PROMPTS = [[(7 * i + 3) % 250 + 20 for i in range(n)] for n in (5, 13)]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A V4 hub checkpoint with one MTP block, and its main graph (with the stream output) and MTP graph."""
    from transformers import AutoConfig

    from toolchain.models.shape_faithful import write_random_checkpoint

    root = tmp_path_factory.mktemp("v4-mtp")
    config = AutoConfig.for_model("deepseek_v4", **{
        **TINY_V4, "index_n_heads": 8, "compress_ratios": None,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}})
    path = write_random_checkpoint(config, root / "hub", seed=3, mtp_layers=1)
    source = sources.resolve(str(path))
    arch = architecture_for("deepseek_v4")
    with open_checkpoint(path) as reader:
        skeleton = sources.skeleton(source, reader)
        save_graph(build_decoder(skeleton, arch, reader, hidden_output=True), root / "main.onnx")
    with open_checkpoint(path, mtp=True) as reader:
        save_graph(build_mtp_graph(skeleton, arch, reader, LAYERS), root / "mtp.onnx")
    model = reference_model(source)
    return path, root / "main.onnx", root / "mtp.onnx", model, reference_mtp(model, path)


def test_the_reader_names_the_mtp_block_as_the_exporter_reads_it(hub):
    path = hub[0]
    with open_checkpoint(path) as reader:
        assert reader.skipped_layers == (LAYERS,)
        assert not any(n.startswith(f"model.layers.{LAYERS}.") for n in reader.names())
    with open_checkpoint(path, mtp=True) as reader:
        assert reader.skipped_layers == ()
        assert mtp_layer_indices(reader.names(), reader.config) == [LAYERS]
        prefix = f"model.layers.{LAYERS}."
        assert reader.stored_name(prefix + "e_proj.weight") == "mtp.0.e_proj.weight"
        assert reader.stored_name(prefix + "shared_head.norm.weight") == "mtp.0.norm.weight"
        assert reader.stored_name(prefix + "hc_head.hc_fn") == "mtp.0.hc_head_fn"
        assert reader.stored_name(prefix + "self_attn.kv_proj.weight") == "mtp.0.attn.wkv.weight"
        assert reader.stored_name(prefix + "mlp.gate.e_score_correction_bias") == "mtp.0.ffn.gate.bias"
        assert reader.stored_name(prefix + "mlp.experts.1.up_proj.weight") == "mtp.0.ffn.experts.1.w3.weight"
        assert reader.natural_dtype(prefix + "h_proj.weight") == torch.bfloat16  # e4m3, dequantized
        # a sliding-window block routed by score: no compressor, no hash table
        assert not any(n.startswith(prefix) and ("compressor" in n or "tid2eid" in n) for n in reader.names())
    mtp = hub[4]
    assert mtp.layer.block.self_attn.compressor is None and not mtp.layer.block.mlp.is_hash


def test_the_main_graph_outputs_the_streams_before_hc_head(hub):
    """The MTP block reads the last layer's hyper-connection streams [B, S, hc_mult, D], not hc_head's collapse."""
    _, main_graph, _, model, _ = hub
    import onnx

    proto = onnx.load(str(main_graph), load_external_data=False)
    assert proto.graph.output[-1].name == HIDDEN_STATES
    assert {p.key: p.value for p in proto.metadata_props}[HIDDEN_OUTPUT] == HIDDEN_STATES
    decoder = StatelessDecoder(GraphRunner(main_graph, "onnxruntime"), graph_cache_spec(main_graph),
                               (HIDDEN_STATES,))
    ids = np.array([RNG_PROMPTS[1]])
    decoder.forward(ids, np.ones_like(ids))
    streams = decoder.extras[HIDDEN_STATES]
    assert streams.shape == (1, ids.shape[1], TINY_V4["hc_mult"], TINY_V4["hidden_size"])
    expected = main_hidden(model, ids, np.ones_like(ids))
    np.testing.assert_allclose(streams, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_mtp_graph_matches_pytorch_on_both_backends(hub):
    path, _, mtp_graph, model, _ = hub
    import onnx

    proto = onnx.load(str(mtp_graph), load_external_data=False)
    assert [i.name for i in proto.graph.input] == ["input_ids", "attention_mask", "position_ids", HIDDEN_STATES,
                                                    "past_key_values.0.key"]
    assert [o.name for o in proto.graph.output] == ["logits", "present.0.key", MTP_HIDDEN]
    metadata = {p.key: p.value for p in proto.metadata_props}
    assert metadata[MTP_LAYER] == str(LAYERS) and json.loads(metadata[MOE_LAYERS]) == [LAYERS]
    assert json.loads(metadata[CACHE_KINDS]) == ["key", "value"]  # V4's main graph records the same
    results = compare_mtp_graph(model, path, mtp_graph, BACKENDS, parity_cases(path, TINY_V4["vocab_size"]), 4, 2)
    for backend, result in results.items():
        assert result["passed"], (backend, result)
        assert result["max_relative_diff"] < 1e-5  # measured 3.6e-07 (ONNX Runtime), 3.5e-07 (OpenVINO)


def test_a_rolled_back_mtp_cache_gives_the_logits_of_one_that_never_held_the_rejected_positions(hub):
    """20 positions and 4 more cross the sliding window (8): the rolled-back entries would be inside it."""
    _, _, mtp_graph, model, _ = hub
    tokens = np.array([[(7 * i + 3) % 250 + 20 for i in range(25)]])
    hidden = main_hidden(model, tokens, np.ones_like(tokens))
    ones = lambda n: np.ones((1, n), np.int64)  # noqa: E731
    rejected = np.random.default_rng(0).standard_normal((1, 3, *hidden.shape[2:])).astype(np.float32)
    spec = graph_cache_spec(mtp_graph)
    decoders = {"onnxruntime": lambda: OnnxRuntimeDecoder(mtp_graph, None, (MTP_HIDDEN,)),
                **{f"{b} stateless": (lambda b=b: StatelessDecoder(GraphRunner(mtp_graph, b), spec)) for b in BACKENDS}}
    for name, make in decoders.items():
        decoder = make()
        decoder.forward(tokens[:, 1:21], ones(20), inputs={HIDDEN_STATES: hidden[:, :20]})
        never = decoder.forward(tokens[:, 21:25], ones(24), inputs={HIDDEN_STATES: hidden[:, 20:24]})
        decoder.reset()
        decoder.forward(tokens[:, 1:21], ones(20), inputs={HIDDEN_STATES: hidden[:, :20]})
        decoder.forward(np.array([[5, 6, 7]]), ones(23), inputs={HIDDEN_STATES: rejected})
        held = decoder.forward(tokens[:, 21:25], ones(27), inputs={HIDDEN_STATES: hidden[:, 20:24]})
        assert not np.array_equal(held, never), name  # the rejected positions change what follows
        decoder.reset()
        decoder.forward(tokens[:, 1:21], ones(20), inputs={HIDDEN_STATES: hidden[:, :20]})
        decoder.forward(np.array([[5, 6, 7]]), ones(23), inputs={HIDDEN_STATES: rejected})
        decoder.rollback(20)
        again = decoder.forward(tokens[:, 21:25], ones(24), inputs={HIDDEN_STATES: hidden[:, 20:24]})
        np.testing.assert_array_equal(again, never, err_msg=name)


def plain_greedy(main, prompt: list[int], new_tokens: int) -> list[int]:
    main.reset()
    tokens = list(prompt)
    logits = main.forward(np.array([prompt]), np.ones((1, len(prompt)), np.int64))
    while len(tokens) < len(prompt) + new_tokens:
        tokens.append(int(logits[0, -1].argmax()))
        logits = main.forward(np.array([tokens[-1:]]), np.ones((1, len(tokens)), np.int64))
    return tokens


def reference_drafts(model, mtp, tokens: list[int]) -> np.ndarray:
    """The PyTorch MTP block's draft of every token j >= 2 of ``tokens`` (index j - 2) from the PyTorch main
    model's streams: what a drafter with only real cache entries proposes."""
    ids = np.array([tokens])
    hidden = main_hidden(model, ids, np.ones_like(ids))
    logits = MtpTorchDecoder(mtp).forward(ids[:, 1:], np.ones((1, len(tokens) - 1), np.int64),
                                          inputs={HIDDEN_STATES: hidden[:, :-1]})
    return logits[0].argmax(-1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_speculative_loop_with_mtp_drafts_is_lossless_and_drafts_what_the_reference_drafts(hub, backend):
    """dstc's verify loop (toolchain/runtime/speculative.py) with the MTP drafter over the graphs, at fp32: the
    plain greedy tokens at 1 and 3 drafts a step, and each step's first draft the reference's from the true
    streams (the drafter's cache holds only real positions when it drafts it: a chained draft's entry left in it,
    or a wrong stream fed, changes the drafts). 24 tokens cross the sliding window (8) several times."""
    _, main_graph, mtp_graph, model, mtp = hub
    main = StatelessDecoder(GraphRunner(main_graph, backend), graph_cache_spec(main_graph), (HIDDEN_STATES,))
    drafter = MtpDrafter(StatelessDecoder(GraphRunner(mtp_graph, backend), graph_cache_spec(mtp_graph),
                                          (MTP_HIDDEN,)))
    new_tokens = 24
    for prompt in RNG_PROMPTS[1:]:
        greedy = plain_greedy(main, prompt, new_tokens)
        expected = reference_drafts(model, mtp, greedy)
        for k in (1, 3):
            acceptance = Acceptance()
            drafted: list[tuple[int, list[int]]] = []
            propose = drafter.propose

            def recording(tokens, extras, k, propose=propose, drafted=drafted):
                drafts = propose(tokens, extras, k)
                drafted.append((len(tokens), drafts))
                return drafts

            drafter.propose = recording  # type: ignore[method-assign]
            try:
                steps = speculative_steps(main, drafter, prompt, max_new_tokens=new_tokens, stop_ids=set(),
                                          draft_tokens=k, acceptance=acceptance)
                assert prompt + [t for step in steps for t in step] == greedy, (backend, k, prompt)
            finally:
                del drafter.propose
            # each step's first draft: from real positions alone (the chained ones before it cut back)
            assert drafted and all(drafts[0] == int(expected[place - 2]) for place, drafts in drafted if drafts), \
                (backend, k, prompt)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_dstc_generate_speculates_with_a_v4_artifacts_mtp_block(hub, backend, tmp_path, monkeypatch, capsys):
    """`dstc build` with export.mtp writes and verifies the block's graph; `dstc generate --speculate mtp` gives
    the plain greedy tokens (a random model's drafts are rejected: the verify loop's own tokens); a running batch
    takes it (its batches compact after every step: tests/serve/test_serve_speculative.py)."""
    from conftest import run_cli

    from toolchain.runtime.artifact import open_artifact
    from toolchain.runtime.batched_drafts import check_batch_speculation
    from toolchain.settings.speculation import MTP, SpeculationSettings

    recipe = tmp_path / "mtp.yaml"
    recipe.write_text(f"name: v4-mtp-{backend}\nmodel: {hub[0]}\nexport:\n  mtp: true\n"
                      f"passes:\n  target: {backend}\ncompile:\n  backend: {backend}\n")
    out = tmp_path / "artifact"
    code, _, err = run_cli(monkeypatch, capsys, "build", recipe, "-o", out)
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert ("mtp/openvino_model.xml" if backend == "openvino" else "mtp/model.onnx") in manifest["files"]
    verification = manifest["provenance"]["stage_reports"]["compile/compile.json"]["mtp"]["verification"]
    assert verification["passed"] and verification["drafts_identical"]
    runs = {}
    for draft_tokens in (None, 1, 3):
        speculate = () if draft_tokens is None else ("--speculate", "mtp", "--draft-tokens", draft_tokens)
        # ids below the random model's vocabulary (300) in the copied tokenizer
        code, stdout, err = run_cli(monkeypatch, capsys, "generate", out, "1 2 3 4 5 6 7 8", "--raw",
                                    "--new-tokens", 24, "--json", *speculate)
        assert code == 0, err
        runs[draft_tokens] = json.loads(stdout)
    assert runs[1]["tokens"] == runs[3]["tokens"] == runs[None]["tokens"]
    assert runs[3]["speculation"]["method"] == MTP and runs[3]["speculation"]["proposed_per_position"][2] > 0
    check_batch_speculation(SpeculationSettings(speculate=MTP), open_artifact(out))


def test_the_embedded_v4_tiny_holds_its_trained_mtp_block_beside_an_unchanged_main_model():
    """Appended under V4's hub names after the main model's training (toolchain/models/mtp_training.py); the main
    model's reader does not see it, the MTP exporter's does, and the acceptance recorded is what it gives."""
    from toolchain.models.mtp_training import heldout_sequences, teacher_forced_acceptance
    from toolchain.tokenizer_loading import load_tokenizer

    source = sources.resolve("deepseek-v4-tiny")
    layers = source.config["num_hidden_layers"]
    with open_checkpoint(source.path) as reader:
        assert reader.skipped_layers == (layers,)
        assert not any(n.startswith(f"model.layers.{layers}.") or "mtp" in n for n in reader.names())
    with open_checkpoint(source.path, mtp=True) as reader:
        assert mtp_layer_indices(reader.names(), reader.config) == [layers]
        assert reader.stored_name(f"model.layers.{layers}.e_proj.weight") == "mtp.0.e_proj.weight"
    record = json.loads((source.path / "training.json").read_text())["mtp"]
    model = reference_model(source)
    mtp = reference_mtp(model, source.path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as it was measured
    try:
        measured = teacher_forced_acceptance(model, mtp, heldout_sequences(load_tokenizer(source.path)))
    finally:
        torch.set_num_threads(threads)
    # the block read back through the reader's names is the block trained
    assert measured == {k: record["metrics"][k] for k in measured}
    assert record["metrics"]["mtp_acceptance"] > 0.6  # when trained (400 steps): 0.716


def test_v4_mtp_training_is_deterministic_and_leaves_the_main_model_alone():
    from dataclasses import replace

    from toolchain.models import corpus
    from toolchain.models.mtp_training import MTP_SETTINGS, new_mtp, train_mtp
    from toolchain.models.train import encode_lines, pack_rows
    from toolchain.tokenizer_loading import load_tokenizer

    source = sources.resolve("deepseek-v4-tiny")
    tokenizer = load_tokenizer(source.path)
    rows = pack_rows(encode_lines(tokenizer, corpus.text_samples("train", 32)), 64, tokenizer.bos_token_id,
                     tokenizer.eos_token_id, tokenizer.pad_token_id)
    settings = replace(MTP_SETTINGS, steps=2, batch_size=4, warmup=1)
    model = sources.load(source)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    runs = []
    for _ in range(2):
        mtp = new_mtp(model, settings)
        initial = {k: v.clone() for k, v in mtp.layer.state_dict().items()}
        loss = train_mtp(model, mtp, rows, tokenizer.pad_token_id, settings)
        runs.append((loss, {k: v.clone() for k, v in mtp.layer.state_dict().items()}))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    assert not torch.equal(initial["h_proj.weight"], runs[0][1]["h_proj.weight"])  # it learns from the streams
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
