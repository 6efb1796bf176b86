"""Compile stage: stateful OpenVINO IR and the ONNX Runtime artifact, checked against PyTorch greedy decoding and
loaded through the runtimes' own loaders (openvino_genai.LLMPipeline, optimum-intel's OVModelForCausalLM,
onnxruntime-genai)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import COMMON, MLA, make_checkpoint
from loader_helpers import (
    F32,
    MESSAGES,
    NEW_TOKENS,
    genai_greedy,
    llm_pipeline,
    optimum_intel_greedy,
    pipeline_greedy,
    reference_chat_tokens,
)
from transformers import AutoModelForCausalLM, DeepseekV3Config, PreTrainedTokenizerFast, Qwen2Config

from toolchain.atomic import MARKER
from toolchain.compile import onnxruntime_artifact
from toolchain.deployment import DSTC, OPENVINO_GENAI, OPTIMUM_INTEL, ORT_GENAI, loads_with
from toolchain.errors import InputError
from toolchain.models.registry import EMBEDDED, embedded_path
from toolchain.reference.whole import TorchDecoder
from toolchain.runtime.engines import openvino_compile
from toolchain.runtime.generate import greedy_logits
from toolchain.stages.alone import compile_artifact, export
from toolchain.tokenizer_loading import load_tokenizer

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
                 "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}"
                 "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")
TEXTS = ["the old man walked to the market with a basket of apples", "where is the red book?",
         "12+345=357", "607+58=665", "the children followed him along the river to see the boats"] * 4


def small_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with DeepSeek's special tokens and a DeepSeek-shaped chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS, EOS, PAD, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   extra_special_tokens=[USER, ASSISTANT], chat_template=CHAT_TEMPLATE)


def tokenized_checkpoint(model_type: str, path: Path) -> Path:
    tok = small_tokenizer()
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    config = {"qwen2": lambda: Qwen2Config(**{**COMMON, **ids}, num_key_value_heads=2),
              "deepseek_v3": lambda: DeepseekV3Config(**{**COMMON, **ids}, **MLA, q_lora_rank=24, n_routed_experts=16,
                                                      n_group=4, topk_group=2, routed_scaling_factor=2.5)}[model_type]()
    make_checkpoint(config, path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def exports(tiny_checkpoints, tmp_path_factory):
    """model_type -> export directory of the tiny random checkpoint (graph only, no parity run)."""
    root = tmp_path_factory.mktemp("exports")
    for name in ("llama", "qwen2", "deepseek_v2", "deepseek_v3"):
        export(str(tiny_checkpoints[name]), root / name, parity=())
    return {name: root / name for name in ("llama", "qwen2", "deepseek_v2", "deepseek_v3")}


@pytest.fixture(scope="module")
def tokenized_exports(tmp_path_factory):
    """model_type -> export directory of a tiny random checkpoint that has a tokenizer with a chat template."""
    root = tmp_path_factory.mktemp("tokenized")
    out = {}
    for model_type in ("qwen2", "deepseek_v3"):
        export(str(tokenized_checkpoint(model_type, root / "ckpt" / model_type)), root / model_type, parity=())
        out[model_type] = root / model_type
    return out


def check_verification(manifest: dict, new_tokens: int = NEW_TOKENS) -> None:
    verification = manifest["verification"]
    assert verification["passed"], verification
    assert {c["name"] for c in verification["cases"]} == {"short", "long", "batch2-left-padded"}
    for case in verification["cases"]:
        assert case["tokens_identical"], case
        assert len(case["tokens"][0]) == new_tokens


def source_of(export_dir: Path) -> Path:
    return Path(json.loads((export_dir / "export.json").read_text())["source"]["path"])


def chat_prompt_ids(tokenizer) -> list[int]:
    """MESSAGES through an openvino_genai tokenizer's chat template and encoder."""
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False).input_ids.data[0].tolist()


# --- OpenVINO -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_openvino_ir_is_stateful_and_decodes_like_pytorch(exports, tmp_path, name):
    import openvino as ov

    manifest = compile_artifact(exports[name], tmp_path / "ov", "openvino")
    check_verification(manifest)
    out = tmp_path / "ov"
    for f in ("openvino_model.xml", "openvino_model.bin", "config.json", "generation_config.json", "compile.json"):
        assert (out / f).is_file(), f
    assert not (out / "openvino_tokenizer.xml").exists()  # the random checkpoint has no tokenizer
    assert sorted(p.name for p in out.iterdir() if p.name != MARKER) == manifest["files"]

    model = ov.Core().read_model(out / "openvino_model.xml")
    inputs = {i.get_any_name(): i for i in model.inputs}
    assert list(inputs) == ["input_ids", "attention_mask", "position_ids", "beam_idx"]
    assert inputs["beam_idx"].get_element_type() == ov.Type.i32
    assert inputs["beam_idx"].get_partial_shape().rank.get_length() == 1
    assert [o.get_any_name() for o in model.outputs] == ["logits"]
    ops = [op.get_type_name() for op in model.get_ops()]
    layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    assert ops.count("ReadValue") == ops.count("Assign") == 2 * layers == len(model.get_sinks())
    # every cache variable is read through Gather(., beam_idx) before use
    beam_consumers = {t.get_node().get_type_name() for t in model.input("beam_idx").get_target_inputs()}
    assert beam_consumers == {"Gather"} and len(model.input("beam_idx").get_target_inputs()) == 2 * layers


def test_openvino_beam_idx_reorders_the_cache(exports, tmp_path):
    compile_artifact(exports["deepseek_v3"], tmp_path / "ov", "openvino", verify=False)
    compiled = openvino_compile(tmp_path / "ov" / "openvino_model.xml", "exact")
    ids = np.array([[5, 17, 33, 2], [40, 41, 9, 60]], np.int64)
    mask, pos = np.ones_like(ids), np.tile(np.arange(4), (2, 1))
    nxt = np.array([[7], [7]], np.int64)
    request = compiled.create_infer_request()

    def run(ids, mask, pos, beam):
        return np.array(request.infer({"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                                       "beam_idx": np.array(beam, np.int32)})[compiled.output("logits")])

    run(ids, mask, pos, [0, 1])
    swapped = run(nxt, np.ones((2, 5), np.int64), np.full((2, 1), 4), [1, 0])
    request.reset_state()
    run(ids[::-1].copy(), mask, pos, [0, 1])
    direct = run(nxt, np.ones((2, 5), np.int64), np.full((2, 1), 4), [0, 1])
    np.testing.assert_allclose(swapped, direct, rtol=0, atol=1e-5)
    assert not np.allclose(swapped[0], swapped[1])


@pytest.mark.parametrize("name", ["qwen2", "deepseek_v3"])
def test_openvino_artifact_generates_through_llm_pipeline_and_optimum_intel(tokenized_exports, tmp_path, name):
    out = tmp_path / "ov"
    manifest = compile_artifact(tokenized_exports[name], out, "openvino", verify=False)
    assert manifest["tokenizer"]
    for f in ("openvino_tokenizer.xml", "openvino_detokenizer.xml", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).is_file(), f
    source = source_of(tokenized_exports[name])
    prompt, expected = reference_chat_tokens(source)
    reference = load_tokenizer(source)

    pipe, config = llm_pipeline(out, **F32)
    tokenizer = pipe.get_tokenizer()
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True) == \
        reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat_prompt_ids(tokenizer) == prompt
    # a string prompt goes through the chat template, the tokenizer IR, generation and the detokenizer IR
    assert pipe.generate(MESSAGES[0]["content"], config) == reference.decode(expected)
    assert pipeline_greedy(pipe, config, prompt) == expected

    assert optimum_intel_greedy(out, prompt) == expected
    # every runtime the manifest names (loads_with) loaded it above, MLA's latent cache (deepseek_v3) included
    assert loads_with(manifest["files"]) == [DSTC, OPENVINO_GENAI, OPTIMUM_INTEL]


# --- ONNX Runtime ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen2", "deepseek_v2"])
def test_onnxruntime_artifact_keeps_optimum_names_and_decodes_like_pytorch(exports, tmp_path, name):
    out = tmp_path / "ort"
    manifest = compile_artifact(exports[name], out, "onnxruntime")
    check_verification(manifest)  # our ORT greedy loop over optimum's input/output names
    assert manifest["onnxruntime"]["optimization_level"] == "basic"
    for f in ("model.onnx", "model.onnx.data", "config.json", "generation_config.json", "compile.json"):
        assert (out / f).is_file(), f
    assert sorted(p.name for p in out.iterdir() if p.name != MARKER) == manifest["files"]

    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    external = [t.name for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external and all(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer
                            if len(t.raw_data) > onnxruntime_artifact.INLINE_MAX_BYTES)
    assert {n.domain for n in graph.node} <= {"", "ai.onnx"}  # standard ops only: portable
    layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    kv = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask", "position_ids", *kv]
    assert [o.name for o in graph.output] == ["logits", *[n.replace("past_key_values.", "present.") for n in kv]]

    if name == "deepseek_v2":
        import onnxruntime_genai as og

        assert not (out / "genai_config.json").exists()
        assert "head dim" in manifest["onnxruntime"]["genai_unsupported_reason"]
        # what the manifest says (loads_with) and docs/serve.md "Which runtimes load an artifact" explains
        assert loads_with(manifest["files"]) == [DSTC]
        with pytest.raises(RuntimeError):  # 0.18: "Model package support requires building onnxruntime-genai ..."
            og.Model(str(out))
    else:
        assert loads_with(manifest["files"]) == [DSTC, ORT_GENAI]  # genai loads it, just below
        genai = json.loads((out / "genai_config.json").read_text())
        assert genai["model"]["type"] == "qwen2"
        assert genai["model"]["decoder"]["head_size"] == 16 and genai["model"]["decoder"]["num_key_value_heads"] == 2
        # the random checkpoint has no special token ids (left out of genai_config.json); genai still loads it
        model = AutoModelForCausalLM.from_pretrained(source_of(exports[name])).eval()
        prompt = [5, 17, 33, 2, 9, 41, 12]
        expected, _ = greedy_logits(TorchDecoder.over(model), [prompt], NEW_TOKENS, 0)
        assert genai_greedy(out, prompt) == expected[0].tolist()


def test_onnxruntime_artifact_generates_through_onnxruntime_genai(tokenized_exports, tmp_path):
    import onnxruntime_genai as og

    out = tmp_path / "ort"
    compile_artifact(tokenized_exports["qwen2"], out, "onnxruntime", verify=False)
    source = source_of(tokenized_exports["qwen2"])
    prompt, expected = reference_chat_tokens(source)

    tokenizer = og.Tokenizer(og.Model(str(out)))
    assert tokenizer.encode(tokenizer.apply_chat_template(json.dumps(MESSAGES), add_generation_prompt=True)).tolist() \
        == prompt
    assert genai_greedy(out, prompt) == expected
    # the tokenizer files are read by onnxruntime-extensions: same ids and text as Hugging Face's (a random model's
    # tokens can split UTF-8 sequences, which the two decoders render differently, so decode a real text)
    text = TEXTS[0]
    ids = load_tokenizer(source)(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.encode(text).tolist() == ids
    assert tokenizer.decode(np.array(ids, np.int32)) == text


# --- input errors and output handling -------------------------------------------------------------------------

def test_bad_input_is_an_input_error_and_writes_nothing(exports, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no model.onnx"):
        compile_artifact(empty, tmp_path / "out", "openvino")
    with pytest.raises(InputError, match="not a directory"):
        compile_artifact(tmp_path / "missing", tmp_path / "out", "onnxruntime")
    with pytest.raises(InputError, match="backend: Input should be 'openvino' or 'onnxruntime'"):
        compile_artifact(exports["llama"], tmp_path / "out", "tensorrt")
    no_report = tmp_path / "no-report"
    no_report.mkdir()
    (no_report / "model.onnx").write_bytes((exports["llama"] / "model.onnx").read_bytes())
    with pytest.raises(InputError, match="no export.json"):
        compile_artifact(no_report, tmp_path / "out", "onnxruntime")
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "model.onnx").write_bytes((exports["llama"] / "model.onnx").read_bytes())
    report = json.loads((exports["llama"] / "export.json").read_text())
    report["source"]["path"] = str(tmp_path / "gone")
    (moved / "export.json").write_text(json.dumps(report))
    with pytest.raises(InputError, match="source checkpoint"):
        compile_artifact(moved, tmp_path / "out", "openvino")
    report["source"]["path"] = str(source_of(exports["llama"]))
    report["parity"] = {"openvino": {**report["parity"].get("openvino", {
        "tolerance_relative_to_logits_range": 1e-3, "max_relative_diff": 1.0, "cases": []}), "passed": False}}
    (moved / "export.json").write_text(json.dumps(report))
    with pytest.raises(InputError, match="failed its parity check on openvino"):
        compile_artifact(moved, tmp_path / "out", "onnxruntime")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_rebuild_replaces_a_previous_artifact(exports, tmp_path):
    out = tmp_path / "ort"
    compile_artifact(exports["llama"], out, "onnxruntime", verify=False)
    (out / "stale.txt").write_text("from an earlier build")
    compile_artifact(exports["llama"], out, "onnxruntime", verify=False)
    assert not (out / "stale.txt").exists() and (out / "compile.json").is_file()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not dstc's")
    with pytest.raises(InputError, match="was not written by dstc"):
        compile_artifact(exports["llama"], foreign, "onnxruntime", verify=False)


# --- the embedded models (trained, with tokenizers), every loader -------------------------------------------

EMBEDDED_PRESENT = [n for n in sorted(EMBEDDED) if (embedded_path(n) / "config.json").is_file()]


@pytest.mark.slow
@pytest.mark.parametrize("name", EMBEDDED_PRESENT or [pytest.param("none", marks=pytest.mark.skip("no embedded models"))])
def test_embedded_model_loads_in_every_runtime(tmp_path, name):
    export(name, tmp_path / "export", parity=())
    prompt, expected = reference_chat_tokens(embedded_path(name), 16)

    ov_dir, ort_dir = tmp_path / "ov", tmp_path / "ort"
    check_verification(compile_artifact(tmp_path / "export", ov_dir, "openvino", new_tokens=16), 16)
    pipe, config = llm_pipeline(ov_dir, 16, **F32)
    assert chat_prompt_ids(pipe.get_tokenizer()) == prompt
    assert pipeline_greedy(pipe, config, prompt) == expected
    assert pipe.generate(MESSAGES[0]["content"], config) == \
        load_tokenizer(embedded_path(name)).decode(expected)

    manifest = compile_artifact(tmp_path / "export", ort_dir, "onnxruntime", new_tokens=16)
    check_verification(manifest, 16)
    if manifest["model_type"] in ("deepseek_v2", "deepseek_v3"):
        assert not manifest["onnxruntime"]["genai_config"]
    else:
        assert genai_greedy(ort_dir, prompt, 16) == expected
    assert optimum_intel_greedy(ov_dir, prompt, 16) == expected  # last: it skips where optimum-intel is missing
