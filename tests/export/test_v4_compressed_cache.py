"""DeepSeek-V4's compressed cache (``export.v4_cache: compressed``): a bounded sliding window, the pooled CSA/HCA
entries and the incomplete window's tail, exact against transformers 5.24 on both backends and the stateful IR;
its tensors hold what their length rules say; prompts fed in chunks of any size give the per-token graph's logits;
speculation's rollback replays it exactly; the batch runners that cut caches refuse it in one line."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import tiny_configs
from test_deepseek_v4 import CSA, HCA, SLIDING, v4_model

from toolchain.errors import InputError
from toolchain.export.architectures import architecture_for
from toolchain.export.decoder import build_decoder
from toolchain.export.deepseek_v4 import with_v4_cache
from toolchain.export.graph import save_graph
from toolchain.interface.graph import cache_bytes_at, cache_bytes_per_token, cache_length, cache_lengths
from toolchain.reference.whole import TorchDecoder
from toolchain.verify.parity import TOLERANCES, Case, compare, compare_decoders

STEPS = 40


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """(config, model, compressed graph, per-token graph) of tiny_configs' V4: sliding, CSA, HCA and CSA layers
    (window 8, CSA rate 4 with index_topk 3, HCA rate 16)."""
    root = tmp_path_factory.mktemp("v4c")
    config = tiny_configs()["deepseek_v4"]
    assert config.layer_types == [SLIDING, CSA, HCA, CSA]
    model = v4_model(config, root / "ckpt")
    arch = architecture_for("deepseek_v4")
    save_graph(build_decoder(model, with_v4_cache(arch, "compressed")), root / "compressed.onnx")
    save_graph(build_decoder(model, arch), root / "per_token.onnx")
    return config, model, root / "compressed.onnx", root / "per_token.onnx"


def cases(vocab: int) -> list[Case]:
    rng = np.random.default_rng(0)
    return [Case("short", [rng.integers(0, vocab, 3).tolist()]), Case("long", [rng.integers(0, vocab, 70).tolist()]),
            Case("batch2-left-padded", [rng.integers(0, vocab, 29).tolist(), rng.integers(0, vocab, 9).tolist()])]


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino-stateful",
                                     pytest.param("openvino", marks=pytest.mark.slow)])
def test_compressed_cache_matches_transformers(graphs, tmp_path, backend):
    """Prompts of 3 and 70 tokens and a left-padded batch (rows completing windows at different steps), prefill
    and 40 steps: past the window, several HCA windows and many more CSA entries than the indexer keeps; on ONNX
    Runtime, on OpenVINO's stateful IR (the compile stage's conversion) and its stateless graph (slow)."""
    config, model, path, _ = graphs
    longest = 70 + STEPS
    assert longest > 6 * config.compress_rates[HCA] and longest // config.compress_rates[CSA] > 8 * config.index_topk
    if backend == "openvino-stateful":
        import openvino as ov

        from toolchain.compile.openvino_ir import convert
        from toolchain.runtime.decoder import OpenVINODecoder

        ov.save_model(convert(path, {}), str(tmp_path / "stateful.xml"), compress_to_fp16=False)
        result = compare_decoders(TorchDecoder.over(model),
                                  lambda: OpenVINODecoder(tmp_path / "stateful.xml", None, (), "exact"),
                                  cases(config.vocab_size), STEPS, 0, TOLERANCES["openvino"])
    else:
        result = compare(TorchDecoder.over(model), path, backend, cases(config.vocab_size), STEPS, pad_id=0)
    tolerance = TOLERANCES[backend.split("-")[0]]
    assert result["tokens_identical"]
    assert result["max_relative_diff"] <= tolerance, result["max_relative_diff"]
    assert all(c["steps"] == STEPS for c in result["cases"])


def test_prompts_fed_in_chunks_give_the_per_token_graph_s_logits(graphs):
    """A left-padded batch fed in chunks of 1 to 33 tokens (windows completing inside a chunk, across chunks, and
    several in one): every chunk's logits are the per-token graph's on the same feeds."""
    from toolchain.interface.graph import graph_cache_spec, graph_metadata
    from toolchain.runtime.decoder import StatelessDecoder
    from toolchain.runtime.engines import GraphRunner

    config, _, compressed, per_token = graphs
    decoders = [StatelessDecoder(GraphRunner(p, "onnxruntime"), graph_cache_spec(p), metadata=graph_metadata(p))
                for p in (compressed, per_token)]
    rng = np.random.default_rng(1)
    ids = rng.integers(1, config.vocab_size, (2, 160))  # 10 HCA windows, 40 CSA ones
    mask = np.ones_like(ids)
    mask[1, :37] = 0
    ids[1, :37] = 0
    start = 0
    for size in (5, 1, 23, 2, 17, 1, 1, 3, 16, 19, 8, 33, 1, 30):
        got, want = (d.forward(ids[:, start:start + size], mask[:, :start + size]) for d in decoders)
        span = float(want.max() - want.min())
        assert float(np.abs(got - want).max()) <= 1e-5 * span, (start, size)
        start += size
    assert start == 160


def test_each_cache_tensor_holds_what_its_length_rule_says(graphs):
    """After T positions: the window min(T, sliding_window - 1) slots, the pooled entries T // rate, the tail 2 x rate
    (CSA) or rate (HCA); bytes per token are the pooled entries' over their rate (window and tail are bounded)."""
    from toolchain.interface.graph import graph_cache_spec, graph_metadata
    from toolchain.runtime.decoder import StatelessDecoder
    from toolchain.runtime.engines import GraphRunner

    config, _, path, _ = graphs
    metadata = graph_metadata(path)
    assert metadata["dstc.kv_cache"] == "compressed"
    rules = cache_lengths(metadata)
    csa, hca, window = config.compress_rates[CSA], config.compress_rates[HCA], config.sliding_window
    assert rules["past_key_values.0.key"] == ("window", window - 1)
    assert rules["past_key_values.1.compressed"] == ("pooled", csa)
    assert rules["past_key_values.1.indexer_compressed"] == ("pooled", csa)
    assert rules["past_key_values.1.indexer_kv"] == ("tail", 2 * csa)
    assert rules["past_key_values.2.compressor_gate"] == ("tail", hca)
    assert rules["past_key_values.2.compressed"] == ("pooled", hca)
    decoder = StatelessDecoder(GraphRunner(path, "onnxruntime"), graph_cache_spec(path), metadata=metadata)
    ids = np.random.default_rng(2).integers(1, config.vocab_size, (1, 45))
    decoder.forward(ids[:, :40], np.ones((1, 40), np.int64))
    decoder.forward(ids[:, 40:], np.ones((1, 45), np.int64))
    assert set(decoder._past) == set(graph_cache_spec(path))
    for name, held in decoder._past.items():
        assert held.shape[2] == cache_length(*rules[name], 45), name
    inputs = [(v.name, v.shape, v.dtype.itemsize) for v in ir.load(path).graph.inputs]
    head, index = config.head_dim, config.index_head_dim
    assert cache_bytes_per_token(inputs, config.layer_types, rules) == {
        SLIDING: 0, CSA: 4 * (head + index) // csa, HCA: 4 * head // hca}
    held = sum(a.nbytes for a in decoder._past.values())
    assert cache_bytes_at(inputs, metadata, 45) == held
    # the per-token layout at the same length: every tensor one entry per position
    assert cache_bytes_at(inputs, metadata, 45) < cache_bytes_at(
        [(v.name, v.shape, v.dtype.itemsize) for v in ir.load(graphs[3]).graph.inputs], {}, 45)


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino-stateful"])
def test_sequences_joining_a_running_batch_get_their_batch_one_tokens(graphs, tmp_path, backend):
    """dstc's continuous batching with the compressed cache: joining sequences' windows left-padded, their pooled
    entries right-padded (each row's own windows), tails as they are; rows leave and join while others complete
    windows, and each gets the tokens it decodes alone."""
    from batching_helpers import decode_joining_and_leaving

    from toolchain.runtime.batching import PersistentBatch
    from toolchain.runtime.batching_openvino import StatefulBatch
    from toolchain.runtime.decoder import OnnxRuntimeDecoder, OpenVINODecoder
    from toolchain.runtime.generate import greedy_generate

    config, _, path, _ = graphs
    if backend == "openvino-stateful":
        import openvino as ov

        from toolchain.compile.openvino_ir import convert

        ov.save_model(convert(path, {}), str(tmp_path / "stateful.xml"), compress_to_fp16=False)
        decoder = OpenVINODecoder(tmp_path / "stateful.xml", 2, (), "exact")
        batch = StatefulBatch(decoder, 0)
    else:
        decoder = OnnxRuntimeDecoder(path, 2, ())
        batch = PersistentBatch(decoder, 0)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, config.vocab_size, n).tolist() for n in (23, 5, 14, 37, 9)]
    new = 20
    alone = [greedy_generate(decoder, [p], new, set(), 0).tokens[0] for p in prompts]
    assert decode_joining_and_leaving(batch, prompts, new) == alone


def replayed_logits(decoder, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits of positions 28-31 after positions 0-23 and 24-27 were fed, against the same after 24-31 were fed,
    rejected drafts fed and rolled back to 28 (a replay of 24-27 from the checkpoint at 24), then 28-31 fed: past
    the window (8), across CSA windows (4) and an HCA window (16)."""
    ids = np.random.default_rng(3).integers(1, vocab, (1, 32))
    ones = lambda n: np.ones((1, n), np.int64)  # noqa: E731
    decoder.reset()
    decoder.forward(ids[:, :24], ones(24))
    decoder.forward(ids[:, 24:28], ones(28))
    want = decoder.forward(ids[:, 28:], ones(32))
    decoder.reset()
    decoder.forward(ids[:, :24], ones(24))
    decoder.forward(ids[:, 24:], ones(32))  # the checkpoint at 24
    decoder.rollback(28)
    decoder.forward(np.array([[7, 8, 9]]), ones(31))  # a verify step's drafts, all rejected
    decoder.rollback(28)
    decoder.forward(np.array([[5]]), ones(29))  # one position at a time keeps the checkpoint and logs
    decoder.forward(np.array([[6]]), ones(30))
    decoder.rollback(28)
    return want, decoder.forward(ids[:, 28:], ones(32))


@pytest.mark.parametrize("backend", ["stateless", "onnxruntime", "openvino-stateful"])
def test_a_rolled_back_cache_gives_the_logits_of_one_that_never_held_the_rejected_positions(graphs, tmp_path,
                                                                                            backend):
    """The compressed cache rolled back by replay (toolchain/runtime/cache_replay.py): its window, tail and pooled
    entries those of a cache fed only the kept positions, exactly (the same forwards), on each decoder."""
    from toolchain.interface.graph import graph_cache_spec, graph_metadata
    from toolchain.runtime.decoder import OnnxRuntimeDecoder, OpenVINODecoder, StatelessDecoder
    from toolchain.runtime.engines import GraphRunner

    config, _, path, _ = graphs
    if backend == "openvino-stateful":
        import openvino as ov

        from toolchain.compile.openvino_ir import convert

        ov.save_model(convert(path, {}), str(tmp_path / "stateful.xml"), compress_to_fp16=False)
        decoder = OpenVINODecoder(tmp_path / "stateful.xml", 2, (), "exact")
    elif backend == "onnxruntime":
        decoder = OnnxRuntimeDecoder(path, 2, ())
    else:
        decoder = StatelessDecoder(GraphRunner(path, "onnxruntime"), graph_cache_spec(path),
                                   metadata=graph_metadata(path))
    assert decoder.replays
    want, got = replayed_logits(decoder, config.vocab_size)
    assert want.shape == got.shape == (1, 4, want.shape[-1])
    np.testing.assert_array_equal(want, got)
    with pytest.raises(ValueError, match="checkpointed at 28"):
        decoder.rollback(27)


def test_runners_that_cut_caches_refuse_it_in_one_line(graphs):
    """Verify steps' holes in a running batch and the gathered layout's per-sequence caches would cut the
    compressed cache along its sequence axis: each refuses it in one line."""
    from toolchain.runtime.batching import batched_decoder
    from toolchain.runtime.decoder import OnnxRuntimeDecoder

    _, _, path, per_token = graphs
    decoder = OnnxRuntimeDecoder(path, 1, ())
    with pytest.raises(InputError, match="compressed cache"):
        batched_decoder(decoder, 0, "gather")
    batch = batched_decoder(decoder, 0, "batch")
    batch.join({"a": [3, 4, 5]})
    with pytest.raises(InputError, match="holes") as error:
        batch.verify({"a": [6, 7]})
    assert "\n" not in str(error.value)
    batched_decoder(OnnxRuntimeDecoder(per_token, 1, ()), 0, "gather")  # the per-token layout does


def test_the_option_is_v4_s(tmp_path, tiny_checkpoints):
    from toolchain.stages.alone import export

    with pytest.raises(InputError, match="deepseek_v4"):
        with_v4_cache(architecture_for("deepseek_v3"), "compressed")
    report = export(str(tiny_checkpoints["deepseek_v4"]), tmp_path / "out", parity=("onnxruntime",),
                    v4_cache="compressed")
    assert report["graph"]["kv_cache"] == "compressed"
    props = {p.key: p.value for p in onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False)
             .metadata_props}
    assert props["dstc.kv_cache"] == "compressed"
    assert report["parity"]["onnxruntime"]["passed"]
    assert report["graph"]["cache_bytes_per_token"]["heavily_compressed_attention"] < 4 * 64
