"""DeepSeek-V3.2 (toolchain/export/deepseek_v32.py): the lightning indexer's top-k sparse attention and its key
cache, exact against transformers on both backends and both MLA cache layouts, for prompts and decodes below,
at and above index_topk; the graph's interface and facts; the stages after export (stateful OpenVINO IR, INT4,
dstc build, generate) and what openvino_genai's continuous batching refuses."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from batching_helpers import decode_joining_and_leaving
from conftest import COMMON, MLA, make_checkpoint, run_cli, tiny_configs
from test_export import check_report

from toolchain.errors import InputError
from toolchain.reference.whole import TorchDecoder
from toolchain.source import load, resolve
from toolchain.stages.alone import compile_artifact, export
from toolchain.verify.parity import TOLERANCES, Case, compare

NAME = "deepseek_v32"
LAYOUTS = ("latent", "per-head")


def index_topk() -> int:
    return tiny_configs()[NAME].index_topk


def crossing_cases(vocab: int) -> list[Case]:
    """Prompts below, at, just above and far above index_topk (6), and a left-padded batch whose padded row has
    fewer allowed tokens than index_topk while the batch's sequence is longer than it."""
    rng = np.random.default_rng(1)
    k = index_topk()
    ids = {n: rng.integers(0, vocab, n).tolist() for n in (3, k, k + 1, 30, 20, 4)}
    return [Case("below", [ids[3]]), Case("at", [ids[k]]), Case("above", [ids[k + 1]]), Case("far-above", [ids[30]]),
            Case("batch2-left-padded", [ids[20], ids[4]])]


@pytest.fixture(scope="module")
def exports(tiny_checkpoints, tmp_path_factory):
    """{layout: export directory} of the tiny V3.2 checkpoint, unchecked (the tests compare)."""
    root = tmp_path_factory.mktemp("v32")
    for layout in LAYOUTS:
        export(str(tiny_checkpoints[NAME]), root / layout, parity=(), mla_cache=layout)
    return {layout: root / layout for layout in LAYOUTS}


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    return TorchDecoder.over(load(resolve(str(tiny_checkpoints[NAME]))))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_matches_pytorch_below_at_and_above_index_topk(exports, reference, layout, backend):
    """Prefill and 40 greedy steps, each case from an empty cache: every step's logits within the backend's
    tolerance and the same tokens."""
    cases = crossing_cases(reference.model.config.vocab_size)
    result = compare(reference, exports[layout] / "model.onnx", backend, cases, 40, 0)
    assert result["passed"], result["max_relative_diff"]
    assert result["tokens_identical"]
    assert result["max_relative_diff"] <= TOLERANCES[backend]
    assert [c["prompt_lengths"] for c in result["cases"]] == [[3], [6], [7], [30], [20, 4]]


def test_per_head_export_checks_itself_on_both_backends(tiny_checkpoints, tmp_path):
    """The export stage's own parity (test_export covers the latent default) on the per-head layout."""
    report = export(str(tiny_checkpoints[NAME]), tmp_path / "out", mla_cache="per-head")
    check_report(report)
    assert report["graph"]["kv_cache"] == "per-head"


def test_yarn_an_unrotated_free_indexer_head_and_no_dense_layer(tmp_path):
    """Another V3.2: YaRN (its mscale in the attention scale and the RoPE tables the indexer shares), an indexer
    head no wider than the RoPE it rotates (no pass-through part), index_topk 3, 8 heads of odd sizes, every layer
    MoE. 16 indexer heads: with 2, relu zeroes both heads' scores of several tokens at once and the tie at the k-th
    place is broken differently by torch.topk (unspecified) and ONNX's TopK (lower position), as the module says."""
    from transformers import DeepseekV32Config

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    config = DeepseekV32Config(**{**COMMON, "num_attention_heads": 8}, **{
        **MLA, "num_key_value_heads": 8, "first_k_dense_replace": 0, "kv_lora_rank": 24, "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 12, "v_head_dim": 6, "num_experts_per_tok": 3}, q_lora_rank=40, n_routed_experts=12,
        n_group=3, topk_group=2, routed_scaling_factor=2.0, rope_parameters=yarn, index_topk=3, index_head_dim=4,
        index_n_heads=16)
    report = export(str(make_checkpoint(config, tmp_path / "ckpt")), tmp_path / "out")
    check_report(report)


def test_the_cases_exercise_the_sparse_selection(tiny_checkpoints):
    """transformers' own logits with index_topk 6 differ from dense attention's (index_topk above every length)
    on prompts above it and agree below it: the parity cases decide which tokens the indexer picks."""
    import torch

    model = load(resolve(str(tiny_checkpoints[NAME])))
    cases = crossing_cases(model.config.vocab_size)

    def logits(prompt):
        with torch.no_grad():
            return model(input_ids=torch.tensor([prompt])).logits[0].numpy()

    below, far_above = cases[0].prompts[0], cases[3].prompts[0]
    sparse = logits(below), logits(far_above)
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = 10**6
    dense = logits(below), logits(far_above)
    # equal up to float rounding: the two top-k sizes take other kernels (bit-equal on the Xeon, 1e-7 apart on the EPYC)
    atol = 1e-6 * np.ptp(dense[1])
    np.testing.assert_allclose(sparse[0], dense[0], rtol=0, atol=atol)
    k = index_topk()
    np.testing.assert_allclose(sparse[1][:k], dense[1][:k], rtol=0, atol=atol)  # at most k tokens to attend
    assert np.abs(sparse[1][k:] - dense[1][k:]).max() > 0.1 * np.ptp(dense[1])


def test_graph_interface_has_the_indexer_key_cache_and_the_facts(exports):
    config = tiny_configs()[NAME]
    layers = config.num_hidden_layers
    for layout, (heads, key_dim, value_dim) in {"latent": (1, 8, 32), "per-head": (4, 24, 12)}.items():
        model = onnx.load(str(exports[layout] / "model.onnx"))
        dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
                for v in [*model.graph.input, *model.graph.output]}
        assert dims["past_key_values.1.index_key"] == ["batch_size", 1, "past_sequence_length", 16]
        assert dims["present.1.index_key"] == ["batch_size", 1, "total_sequence_length", 16]
        assert dims["past_key_values.1.key"] == ["batch_size", heads, "past_sequence_length", key_dim]
        assert dims["present.2.value"] == ["batch_size", heads, "total_sequence_length", value_dim]
        caches = [i.name for i in model.graph.input][3:]
        assert caches == [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value",
                                                                                             "index_key")]
        assert [o.name for o in model.graph.output][1:] == [c.replace("past_key_values.", "present.") for c in caches]
        props = {p.key: p.value for p in model.metadata_props}
        assert props["dstc.model_type"] == NAME and props["dstc.attention"] == "mla"
        assert props["dstc.kv_cache"] == layout
        assert json.loads(props["dstc.moe_layers"]) == [1, 2]
        assert json.loads(props["dstc.head_layout"])["wq_b"] == ["out", 16]
        assert props["dstc.genai_model_type"] == ""
        assert json.loads(props["dstc.cache_kinds"]) == ["key", "value", "index_key"]
        ops = [n.op_type for n in model.graph.node]
        # one per layer's indexer, three per MoE layer's router (top 2 in each group, the groups, the experts)
        assert ops.count("TopK") == layers + 3 * 2
        roles = {p.value for t in model.graph.initializer if "/indexer/" in t.name for p in t.metadata_props
                 if p.key == "dstc.role"}
        assert roles == {"attention"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_decode_step_attends_to_k_gathered_entries_not_the_whole_cache(exports, layout):
    """A decode step over a cache of 4 x index_topk positions: each layer's attention Softmax (per-head: in the
    branch of its If that a step of one query takes) has k = index_topk scores per query and head, not the
    context's 25 (the masked dense form had 25)."""
    import onnxruntime as ort

    from toolchain.export.deepseek_v32 import GATHERED_QUERIES

    config = tiny_configs()[NAME]
    k, past = config.index_topk, 4 * config.index_topk
    model = onnx.load(str(exports[layout] / "model.onnx"))
    nodes, ifs = [], 0
    for node in model.graph.node:
        if node.op_type != "If":
            nodes.append(node)
            continue
        ifs += 1
        taken = next(a.g for a in node.attribute if a.name == "then_branch")  # a query length <= GATHERED_QUERIES
        assert GATHERED_QUERIES >= 1 and node.output[0].startswith(f"layers.{ifs - 1}/")
        for inner in taken.node:
            inner.output[:] = [node.output[0] if out == taken.output[0].name else out for out in inner.output]
            nodes.append(inner)
    assert ifs == (config.num_hidden_layers if layout == "per-head" else 0)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    scores = [n.input[0] for n in model.graph.node if n.op_type == "Softmax"]
    assert len(scores) == config.num_hidden_layers
    model.graph.output.extend(onnx.ValueInfoProto(name=name) for name in scores)
    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.array([[5]], np.int64), "attention_mask": np.ones((1, past + 1), np.int64),
             "position_ids": np.array([[past]], np.int64)}
    for value in model.graph.input[3:]:
        _, heads, _, dim = (d.dim_value for d in value.type.tensor_type.shape.dim)
        feeds[value.name] = rng.standard_normal((1, heads, past, dim)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert [out.shape[-1] for out in session.run(scores, feeds)] == [k] * config.num_hidden_layers


def test_export_is_byte_identical_when_repeated(tiny_checkpoints, tmp_path):
    for out in ("a", "b"):
        export(str(tiny_checkpoints[NAME]), tmp_path / out, parity=())
    assert (tmp_path / "a" / "model.onnx").read_bytes() == (tmp_path / "b" / "model.onnx").read_bytes()


def test_configs_the_builder_does_not_reproduce_are_refused(tiny_checkpoints, tmp_path, monkeypatch, capsys):
    """A V3.2 config whose indexer head is narrower than the RoPE it rotates: exit 2, one line, nothing written."""
    from toolchain.errors import UnsupportedModelError
    from toolchain.export.architectures import architecture_for

    config = tiny_configs()[NAME]
    config.index_head_dim = 4
    with pytest.raises(UnsupportedModelError, match="index_head_dim 4 is below qk_rope_head_dim 8"):
        architecture_for(NAME).check(config)
    src = tiny_checkpoints[NAME]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    raw = json.loads((src / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "layer_types": ["sliding_attention"] * 3}))
    code, _, err = run_cli(monkeypatch, capsys, "export", bad, "-o", tmp_path / "out")
    assert code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == ("dstc: error: deepseek_v32: layer types ['sliding_attention'] are not "
                                    "supported (indexed_attention)")
    assert not (tmp_path / "out").exists()


# --- compile, build, generate, serve ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_compiled_artifact_decodes_like_pytorch(exports, tmp_path, backend):
    """The compile stage's verification against PyTorch on the stateful OpenVINO IR, whose variables include the
    indexer's keys, and on the ORT artifact."""
    manifest = compile_artifact(exports["latent"], tmp_path / "art", backend)
    assert manifest["verification"]["passed"], manifest["verification"]
    assert all(c["tokens_identical"] for c in manifest["verification"]["cases"])
    if backend == "openvino":
        import openvino as ov

        model = ov.Core().read_model(tmp_path / "art" / "openvino_model.xml")
        assert [i.get_any_name() for i in model.inputs] == ["input_ids", "attention_mask", "position_ids", "beam_idx"]
        shapes = sorted(str(op.get_output_partial_shape(0)) for op in model.get_ops()
                        if op.get_type_name() == "ReadValue")
        assert shapes == sorted(["[?,1,?,8]", "[?,1,?,32]", "[?,1,?,16]"] * 3)


def test_openvino_continuous_batching_refuses_the_indexer_cache(exports, tmp_path):
    """openvino_genai pages keys and values only: a per-head V3.2 artifact is refused in one line, and dstc serve
    batches it with its own runner (pageable False)."""
    from toolchain.interface.files import MODEL_XML
    from toolchain.runtime.artifact import open_artifact
    from toolchain.runtime.batching import PipelineSettings, openvino_pipeline
    from toolchain.runtime.batching_openvino import pageable

    compile_artifact(exports["per-head"], tmp_path / "art", "openvino", verify=False)
    assert not pageable(tmp_path / "art" / MODEL_XML)
    with pytest.raises(InputError) as error:
        openvino_pipeline(open_artifact(tmp_path / "art"), PipelineSettings(max_batch=2, max_context=64))
    message = str(error.value)
    assert "\n" not in message and "index_key" in message and "StatefulBatch" in message


@pytest.mark.parametrize(("backend", "layout"), [("onnxruntime", "batch"), ("onnxruntime", "gather"),
                                                 ("openvino", "batch")])
def test_sequences_joining_and_leaving_a_batch_get_their_batch_one_tokens(exports, tmp_path, backend, layout):
    """dstc serve's batching (ORT's PersistentBatch layouts, OpenVINO's StatefulBatch on the stateful IR) carries
    the indexer's keys with the MLA cache when sequences of different lengths join and leave."""
    from toolchain.runtime.artifact import open_artifact
    from toolchain.runtime.batching import batched_decoder
    from toolchain.runtime.batching_openvino import StatefulBatch
    from toolchain.runtime.decoder import open_decoder
    from toolchain.runtime.generate import greedy_generate

    compile_artifact(exports["latent"], tmp_path / "art", backend, verify=False)
    art = open_artifact(tmp_path / "art")
    decoder = open_decoder(art, threads=2, openvino_f32=True)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, n).tolist() for n in (3, 12, 5, 9, 20)]
    new = 10
    alone = [greedy_generate(decoder, [p], new, set(), art.pad_token_id).tokens[0] for p in prompts]
    batch = StatefulBatch(decoder, art.pad_token_id) if backend == "openvino" else \
        batched_decoder(decoder, art.pad_token_id, layout)
    assert decode_joining_and_leaving(batch, prompts, new) == alone


def past_concats(proto) -> int:
    """Concat nodes reading a past_key_values.* input, in the graph and its subgraphs."""
    from toolchain.runtime.appending_cache import _graphs

    return sum(n.op_type == "Concat" and n.input[0].startswith("past_key_values.")
               for g in _graphs(proto.graph) for n in g.node)


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_the_stateless_runner_appends_the_latent_graphs_new_entries_and_decodes_the_same(exports, backend):
    """The latent graph's three caches per layer are Concats that feed their present outputs only (the indexer
    scores, and attention gathers, the past and the new entries apart), so the appending runner drops them: a
    decode step copies no cache. Its logits over a left-padded batch's prompt, decode steps and a rollback are
    those of the graph run as it is, bit for bit. The per-head layout's attention reads its grown caches: run as
    it is."""
    from toolchain.interface.graph import graph_cache_spec
    from toolchain.runtime.appending_cache import appending_onnx
    from toolchain.runtime.decoder import StatelessDecoder
    from toolchain.runtime.engines import GraphRunner
    from toolchain.runtime.generate import greedy_logits

    config = tiny_configs()[NAME]
    path = exports["latent"] / "model.onnx"
    proto = onnx.load(str(path))
    assert past_concats(proto) == 3 * config.num_hidden_layers
    assert appending_onnx(proto) and past_concats(proto) == 0
    assert not GraphRunner(exports["per-head"] / "model.onnx", backend, appending=True).appends

    spec = graph_cache_spec(path)
    appending = StatelessDecoder(GraphRunner(path, backend, appending=True), spec)
    full = StatelessDecoder(GraphRunner(path, backend), spec)
    assert appending.runner.appends
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (20, 4)]
    runs = [greedy_logits(d, prompts, 12, 0) for d in (appending, full)]
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        np.testing.assert_array_equal(a, b)
    step = np.ones((2, 1), np.int64)
    logits = []
    for decoder in (appending, full):
        decoder.rollback(22)  # the batch's 20 prompt columns and 2 steps
        mask = np.ones((2, 23), np.int64)
        mask[1, :16] = 0
        logits.append(decoder.forward(step, mask))
    np.testing.assert_array_equal(*logits)
