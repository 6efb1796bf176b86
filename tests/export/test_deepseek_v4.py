"""DeepSeek-V4's graph against transformers 5.24 on both backends, one attention type added at a time: sliding
window alone (with hyper-connections and hash / top-k MoE), then HCA, then CSA with its indexer.

The graph is built from the model transformers loads, for configs the test varies (tests/export/test_export.py exports V4
checkpoints through dstc's reader). Prompts and decode cross the sliding window (8), many CSA blocks (4, index_topk 3 of up to
17 entries) and four HCA blocks (16). The left-padded batch is compared with transformers running each row alone
(DeepseekV4Architecture.reference_row_by_row): its own batched V4 pools the padding into a row's entries."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from batching_helpers import decode_joining_and_leaving
from conftest import make_checkpoint, tiny_configs

from toolchain.export.architectures import architecture_for
from toolchain.export.decoder import build_decoder
from toolchain.export.graph import save_graph
from toolchain.interface.graph import cache_bytes_per_token
from toolchain.reference.whole import TorchDecoder
from toolchain.verify.parity import TOLERANCES, Case, compare, compare_decoders

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
STEPS = 20
LAYERS = {
    "sliding": [SLIDING, SLIDING],
    "sliding+hca": [SLIDING, HCA],
    "sliding+csa+hca": [SLIDING, CSA, HCA, CSA],  # tiny_configs' own
}


def v4_config(layer_types: list[str]):
    config = tiny_configs()["deepseek_v4"]
    config.num_hidden_layers = len(layer_types)
    config.layer_types = list(layer_types)
    config.mlp_layer_types = ["hash_moe", "moe", "hash_moe", "moe"][:len(layer_types)]
    return config


def v4_model(config, path):
    from transformers import AutoModelForCausalLM

    make_checkpoint(config, path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def cases(vocab: int) -> list[Case]:
    rng = np.random.default_rng(0)
    return [Case("short", [rng.integers(0, vocab, 5).tolist()]),
            Case("long", [rng.integers(0, vocab, 48).tolist()]),
            Case("batch2-left-padded", [rng.integers(0, vocab, 11).tolist(), rng.integers(0, vocab, 5).tolist()])]


@pytest.mark.parametrize("layers", sorted(LAYERS))
def test_deepseek_v4_matches_transformers_on_both_backends(tmp_path, layers):
    config = v4_config(LAYERS[layers])
    model = v4_model(config, tmp_path / "ckpt")
    save_graph(build_decoder(model, architecture_for("deepseek_v4")), tmp_path / "model.onnx")
    rates = config.compress_rates
    longest = 48 + STEPS
    # what the cases cross: the window, several HCA blocks, more CSA entries than the indexer keeps
    assert longest > 3 * rates[HCA] and longest > 2 * config.sliding_window
    assert longest // rates[CSA] > 4 * config.index_topk
    for backend in ("onnxruntime", "openvino"):
        result = compare(TorchDecoder.over(model), tmp_path / "model.onnx", backend, cases(config.vocab_size), STEPS,
                         pad_id=0)
        assert result["tokens_identical"], backend
        assert result["max_relative_diff"] <= TOLERANCES[backend], (backend, result["max_relative_diff"])
        assert result["passed"]
        assert all(c["steps"] == STEPS for c in result["cases"])


@pytest.fixture(scope="module")
def every_type(tmp_path_factory):
    """(config, model, graph path) of tiny_configs' V4: sliding, CSA and HCA layers."""
    root = tmp_path_factory.mktemp("v4")
    config = v4_config(LAYERS["sliding+csa+hca"])
    model = v4_model(config, root / "ckpt")
    save_graph(build_decoder(model, architecture_for("deepseek_v4")), root / "model.onnx")
    return config, model, root / "model.onnx"


def test_deepseek_v4_stateful_openvino_ir_matches_transformers(every_type, tmp_path):
    """The compile stage's stateful IR (each past/present pair a variable, whatever its name) decodes as the
    stateless graph does: the per-token caches need nothing of OpenVINO's conversion beyond a KV cache's."""
    import openvino as ov

    from toolchain.compile.openvino_ir import convert
    from toolchain.runtime.batching_openvino import pageable
    from toolchain.runtime.decoder import OpenVINODecoder

    config, model, path = every_type
    stateful = convert(path, {})
    assert len(stateful.get_sinks()) == 1 + 5 + 3 + 5  # one variable per cache input: sliding, CSA, HCA, CSA
    ov.save_model(stateful, str(tmp_path / "stateful.xml"), compress_to_fp16=False)
    # no ScaledDotProductAttention reads the state: dstc's runner batches it, not openvino_genai's paging
    assert not pageable(tmp_path / "stateful.xml")
    result = compare_decoders(TorchDecoder.over(model), lambda: OpenVINODecoder(tmp_path / "stateful.xml", None, (),
                                                                                "exact"),
                              cases(config.vocab_size), STEPS, 0, TOLERANCES["openvino"])
    assert result["tokens_identical"]
    assert result["max_relative_diff"] <= TOLERANCES["openvino"], result["max_relative_diff"]


def test_deepseek_v4_cache_is_per_token_state_named_by_layer_type(every_type):
    """Every cache input grows along the sequence axis like a KV cache and is paired to its present.* by name:
    the K=V of every layer, the compressor's projections of HCA and CSA layers, the indexer's of CSA layers."""
    config, _, path = every_type
    graph = onnx.load(path).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*graph.input, *graph.output]}
    head, index = config.head_dim, config.index_head_dim
    expected = {
        0: {"key": head},
        1: {"key": head, "compressor_kv": 2 * head, "compressor_gate": 2 * head, "indexer_kv": 2 * index,
            "indexer_gate": 2 * index},
        2: {"key": head, "compressor_kv": head, "compressor_gate": head},
        3: {"key": head, "compressor_kv": 2 * head, "compressor_gate": 2 * head, "indexer_kv": 2 * index,
            "indexer_gate": 2 * index},
    }
    past = {n for n in dims if n.startswith("past_key_values.")}
    assert past == {f"past_key_values.{i}.{name}" for i, names in expected.items() for name in names}
    for layer, names in expected.items():
        for name, width in names.items():
            assert dims[f"past_key_values.{layer}.{name}"] == ["batch_size", 1, "past_sequence_length", width]
            assert dims[f"present.{layer}.{name}"] == ["batch_size", 1, "total_sequence_length", width]
    # what export.json reports per layer type: a layer's cache widths in float32
    inputs = [(v.name, v.shape, v.dtype.itemsize) for v in ir.load(path).graph.inputs]
    assert cache_bytes_per_token(inputs, config.layer_types) == {
        config.layer_types[layer]: 4 * sum(names.values()) for layer, names in expected.items()}
    assert len(set(config.layer_types)) == 3
    props = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
    assert props["dstc.model_type"] == "deepseek_v4"
    assert props["dstc.kv_cache"] == "per-token"
    assert props["dstc.moe_layers"] == "[0, 1, 2, 3]"


def test_transformers_batched_v4_pools_a_padded_row_s_padding(every_type):
    """Why the reference runs V4's batches row by row (reference_row_by_row): transformers 5.24's own batch gives a
    left-padded row other logits than the row alone. Should an upgrade fix it, this fails: set it False."""
    from transformers import DynamicCache

    config, model, _ = every_type
    rng = np.random.default_rng(3)
    long, short = rng.integers(0, config.vocab_size, 30), rng.integers(0, config.vocab_size, 9)
    ids = np.zeros((2, 30), np.int64)
    ids[0], ids[1, -9:] = long, short
    mask = (ids != 0) | (np.arange(30) >= 21)
    mask[0] = True
    positions = np.clip(mask.cumsum(-1) - 1, 0, None)
    with torch.no_grad():
        batched = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64)),
                        position_ids=torch.from_numpy(positions), cache=DynamicCache(config=config)).logits[1, -9:]
        alone = model(input_ids=torch.from_numpy(short[None]), cache=DynamicCache(config=config)).logits[0]
    span = float(alone.max() - alone.min())
    assert float((batched - alone).abs().max()) > 0.01 * span


@pytest.mark.parametrize("backend", ["onnxruntime-batch", "onnxruntime-gather", "openvino-stateful"])
def test_v4_sequences_joining_a_running_batch_get_their_batch_one_tokens(every_type, tmp_path, backend):
    """dstc's continuous batching left-pads the running cache when sequences join: the pooled windows follow each
    row's positions, so a row's tokens are those it decodes alone (on ONNX Runtime's two cache layouts and on
    OpenVINO's stateful IR)."""
    from toolchain.runtime.batching import batched_decoder
    from toolchain.runtime.batching_openvino import StatefulBatch
    from toolchain.runtime.decoder import OnnxRuntimeDecoder, OpenVINODecoder
    from toolchain.runtime.generate import greedy_generate

    config, _, path = every_type
    if backend == "openvino-stateful":
        import openvino as ov

        from toolchain.compile.openvino_ir import convert

        ov.save_model(convert(path, {}), str(tmp_path / "stateful.xml"), compress_to_fp16=False)
        decoder = OpenVINODecoder(tmp_path / "stateful.xml", 2, (), "exact")
        batch = StatefulBatch(decoder, 0)
    else:
        decoder = OnnxRuntimeDecoder(path, 2, ())
        batch = batched_decoder(decoder, 0, backend.split("-")[1])
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, config.vocab_size, n).tolist() for n in (23, 5, 14, 37, 9)]
    new = 20
    alone = [greedy_generate(decoder, [p], new, set(), 0).tokens[0] for p in prompts]
    assert decode_joining_and_leaving(batch, prompts, new) == alone


def test_deepseek_v4_router_scores_above_softplus_overflow(tmp_path):
    """Router logits beyond float32's exp range (~88): torch's softplus is linear above 20, the graph's too (ONNX's
    Softplus alone would give inf and route nowhere)."""
    config = v4_config(LAYERS["sliding"])
    model = v4_model(config, tmp_path / "ckpt")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(3000.0)
    save_graph(build_decoder(model, architecture_for("deepseek_v4")), tmp_path / "model.onnx")
    cases_ = cases(config.vocab_size)[:2]
    reference = TorchDecoder.over(model)
    reference.forward(np.array([cases_[1].prompts[0]]), np.ones((1, 48), np.int64))
    logits = model.model.layers[1].mlp.gate.weight @ torch.ones(config.hidden_size)
    assert float(logits.abs().max()) > 88
    for backend in ("onnxruntime", "openvino"):
        result = compare(TorchDecoder.over(model), tmp_path / "model.onnx", backend, cases_, 4, pad_id=0)
        assert result["passed"], (backend, result["max_relative_diff"])


def test_v4_routers_are_found_on_both_backends_and_hash_layers_route_by_the_table(tiny_checkpoints, tmp_path):
    """V4's routers are the MoE component's (routers.HashRouter, BiasedTopK): the runtimes find one router output
    per MoE layer by structure, in the ONNX graph and in the stateful IR; a hash layer's is the table's experts at
    the token ids, a top-k layer's the experts transformers chooses."""
    import openvino as ov

    from toolchain.checkpoint.reader import open_checkpoint
    from toolchain.compile.openvino_ir import convert
    from toolchain.runtime.decoder import OnnxRuntimeDecoder, OpenVINODecoder
    from toolchain.runtime.routing import router_values
    from toolchain.source import load, resolve
    from toolchain.stages.alone import export

    checkpoint = tiny_checkpoints["deepseek_v4"]
    export(str(checkpoint), tmp_path / "out", parity=())
    path = tmp_path / "out" / "model.onnx"
    ov.save_model(convert(path, {}), str(tmp_path / "stateful.xml"), compress_to_fp16=False)
    ids = np.random.default_rng(2).integers(0, 97, (1, 21))
    mask = np.ones_like(ids)
    model = load(resolve(str(checkpoint)))
    reference = TorchDecoder.over(model)
    reference.forward(ids, mask)
    hash_layers = [i for i, t in enumerate(model.config.mlp_layer_types) if t == "hash_moe"]
    assert hash_layers == [0, 2]
    with open_checkpoint(checkpoint) as reader:
        tables = {i: reader.tensor(f"model.layers.{i}.mlp.gate.tid2eid", torch.int64).numpy() for i in hash_layers}
    for graph, decoder_of in ((path, lambda names: OnnxRuntimeDecoder(path, 1, names)),
                              (tmp_path / "stateful.xml",
                               lambda names: OpenVINODecoder(tmp_path / "stateful.xml", 1, names, "exact"))):
        names = router_values(graph, "dispatch")
        assert len(names) == 4, graph
        decoder = decoder_of(tuple(names))
        decoder.forward(ids, mask)
        for layer, name in enumerate(names):
            chosen = np.sort(decoder.extras[name].reshape(-1, 2), -1)
            if layer in tables:
                assert np.array_equal(chosen, np.sort(tables[layer][ids.reshape(-1)], -1)), (graph, layer)
            assert np.array_equal(chosen, np.sort(reference.extras[f"router.{layer}"], -1)), (graph, layer)


def test_whole_model_reference_scores_as_the_layered_one_promises(tiny_checkpoints, monkeypatch):
    """Eval's reference for V4 (TorchDecoder.score): every position's logits of each sequence alone, in blocks, and
    each MoE layer's experts per token; the hash layers' are the table's."""
    from toolchain.reference import whole as torch_reference
    from toolchain.source import resolve

    monkeypatch.setattr(torch_reference, "SCORE_ROWS", 4)  # blocks that split the sequences
    reference = TorchDecoder(resolve(str(tiny_checkpoints["deepseek_v4"])))
    rng = np.random.default_rng(4)
    sequences = [rng.integers(0, 97, n).tolist() for n in (9, 14)]
    got: dict[int, list] = {0: [], 1: []}
    routes = reference.score(sequences, lambda s, start, logits: got[s].append((start, logits)))
    for s, ids in enumerate(sequences):
        assert [start for start, _ in got[s]] == list(range(0, len(ids), 4))
        with torch.no_grad():
            want = reference.model(input_ids=torch.tensor([ids])).logits[0]
        assert torch.equal(torch.cat([logits for _, logits in got[s]]), want)
    assert sorted(routes) == [0, 1, 2, 3]
    table = reference.model.model.layers[0].mlp.gate.tid2eid
    for s, ids in enumerate(sequences):
        assert routes[0][s].shape == (len(ids), 2)
        assert np.array_equal(np.sort(routes[0][s], -1), np.sort(table[ids].numpy(), -1))
    reference.close()
    assert not torch_reference._loaded


def test_every_v4_weight_compression_plans_has_the_role_the_exporter_recorded(every_type):
    """Compression reads each weight's role from the exporter's record only: the hyper-connections' mixing weights
    (per layer, and the head's) are recorded too, and planned at the scheme's precision."""
    from toolchain.compress.engine import graph_weights
    from toolchain.compress.policy import Policy
    from toolchain.export.graph import load_graph

    weights = graph_weights(load_graph(every_type[2]), with_arrays=False)
    roles = {w.name: w.role for w in weights}
    hc = {name for name in roles if "_hc/" in name or name.startswith("hc_head/")}
    assert hc and {roles[name] for name in hc} == {"hyper_connection"}
    assert None not in roles.values()
    plan = Policy("int4-grouped").plan(weights)
    assert {plan[name] for name in hc} == {"int4"}
