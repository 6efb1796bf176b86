"""toolchain.checkpoint.reader, fp8, fp4 and v4_layout: the hub's FP8 layout written and read back, sharded and
single-file, fused experts, tied embeddings, the MTP layer, one-line errors for malformed checkpoints, one shard
open at a time, and bounded memory while dequantizing; DeepSeek-V3.2's and V4's hub layouts (FP4 experts, ue8m0
scales, DeepSeek's names) read as transformers 5.24 loads them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import conftest
import pytest
import torch
from conftest import COMMON, TINY_V4, TINY_V32, WIDE_V3, make_checkpoint, wide_v3_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from toolchain.checkpoint import fp4, reader as reader_module
from toolchain.checkpoint.reader import open_checkpoint
from toolchain.checkpoint.fp8 import QUANTIZATION_CONFIG, quantize_fp8
from toolchain.checkpoint.v4_layout import QUANTIZATION_CONFIG as V4_QUANTIZATION
from toolchain.errors import InputError
from toolchain.models.shape_faithful import write_fp8_checkpoint, write_random_checkpoint

HUB_FP8 = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """A random V3 in fp32 and the same model in the hub's FP8 layout (9 shards, one MTP layer)."""
    root = tmp_path_factory.mktemp("v3")
    source = make_checkpoint(wide_v3_config(), root / "source")
    fp8 = write_fp8_checkpoint(source, root / "fp8", shard_bytes=400_000, mtp_layers=1)
    return source, fp8


def block_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference dequantization, independent of the reader: each scale repeated over its 128 x 128 block,
    the edge blocks cut to the weight's shape."""
    full = scale.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[:q.shape[0], :q.shape[1]]
    return q.to(torch.float32) * full


def raw(checkpoint: Path, name: str) -> torch.Tensor:
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(checkpoint / index[name], framework="pt") as f:
        return f.get_tensor(name)


def one_line_error(fn) -> str:
    with pytest.raises(InputError) as error:
        fn()
    message = str(error.value)
    assert message and "\n" not in message
    return message


# -- the hub's FP8 layout ----------------------------------------------------------------------------------------

def test_fp8_checkpoint_has_the_hub_layout(v3):
    _, fp8 = v3
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) >= 3 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                          for i in range(1, len(files) + 1)]
    assert index["metadata"]["total_size"] == sum(
        raw(fp8, name).numel() * raw(fp8, name).element_size() for name in weight_map)
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [128, 128]}
    assert config["num_nextn_predict_layers"] == 1
    scales = {name for name in weight_map if name.endswith("_scale_inv")}
    for name in weight_map:
        tensor = raw(fp8, name)
        if name.endswith("_scale_inv"):
            assert tensor.dtype == torch.float32
        elif name.endswith("e_score_correction_bias"):
            assert tensor.dtype == torch.float32
        elif name.startswith("model.layers.") and name.split(".")[3] in ("self_attn", "mlp") \
                and name.split(".")[-2] in HUB_FP8:
            assert tensor.dtype == torch.float8_e4m3fn, name
            q_rows, q_cols = tensor.shape
            assert raw(fp8, name + "_scale_inv").shape == (-(-q_rows // 128), -(-q_cols // 128))
            assert weight_map[name + "_scale_inv"] == weight_map[name]  # a weight and its scales share a shard
            scales.discard(name + "_scale_inv")
        else:  # embeddings, head, norms, the router, MTP's own tensors
            assert tensor.dtype == torch.bfloat16, name
    assert not scales
    assert raw(fp8, "model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    hidden = WIDE_V3["hidden_size"]
    mtp = {name[len("model.layers.3."):] for name in weight_map if name.startswith("model.layers.3.")}
    assert {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "shared_head.head.weight", "self_attn.q_a_proj.weight_scale_inv", "mlp.experts.7.down_proj.weight",
            "mlp.gate.e_score_correction_bias"} <= mtp
    assert raw(fp8, "model.layers.3.eh_proj.weight").shape == (hidden, 2 * hidden)
    assert any(raw(fp8, n).shape[0] % 128 for n in weight_map if n.endswith("q_a_proj.weight"))  # partial blocks


def test_fp8_reads_back_as_block_dequantization_within_fp8_precision(v3):
    source, fp8 = v3
    original, reader = open_checkpoint(source), open_checkpoint(fp8)
    assert reader.names() == original.names()
    quantized = 0
    for name in reader.names():
        want = original.tensor(name)
        got = reader.tensor(name)
        assert got.dtype == torch.float32 and got.shape == want.shape == reader.shape(name)
        if reader.stored_dtype(name) == torch.float8_e4m3fn:
            quantized += 1
            scale = raw(fp8, name + "_scale_inv")
            exact = block_dequantize(raw(fp8, name), scale)
            assert torch.equal(got, exact), name
            assert torch.equal(reader.tensor(name, dtype=torch.bfloat16), exact.to(torch.bfloat16))
            # e4m3 keeps 3 mantissa bits (relative error <= 2^-4); its subnormals are 2^-9 apart (in units of s)
            per_element = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:want.shape[0], :want.shape[1]]
            assert ((got - want).abs() <= want.abs() * (2**-4 + 1e-6) + per_element * 2**-10).all(), name
        elif reader.stored_dtype(name) == torch.bfloat16:
            assert torch.equal(got, want.to(torch.bfloat16).float()), name
        else:
            assert torch.equal(got, want), name
    # layer 0: attention (5) and the dense MLP (3); layers 1-2: attention, shared expert, routed experts
    assert quantized == 5 + 3 + 2 * (5 + 3 + 3 * WIDE_V3["n_routed_experts"])
    assert (reader.array("model.layers.1.self_attn.o_proj.weight")
            == reader.tensor("model.layers.1.self_attn.o_proj.weight").numpy()).all()


def test_quantize_fp8_uses_deepseeks_scale():
    weight = torch.randn(300, 260) * 0.05
    weight[128:256, 128:256] = 0  # an all-zero block gets DeepSeek's floor, not a zero scale
    q, scale = quantize_fp8(weight)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 3)
    assert torch.equal(scale[0, 0], weight[:128, :128].abs().max() / 448)
    assert torch.equal(scale[2, 2], weight[256:, 256:].abs().max() / 448)
    assert scale[1, 1] == torch.tensor(1e-4) / 448
    assert q.float().abs().max() == 448


def test_mtp_layer_is_skipped_and_reported(v3):
    _, fp8 = v3
    reader = open_checkpoint(fp8)
    assert reader.skipped_layers == (3,)
    assert not [name for name in reader.names() if name.startswith("model.layers.3.")]
    assert not reader.has("model.layers.3.eh_proj.weight")
    one_line_error(lambda: reader.tensor("model.layers.3.eh_proj.weight"))
    assert open_checkpoint(v3[0]).skipped_layers == ()


def test_sharded_and_single_file_checkpoints_give_identical_tensors(v3, tmp_path):
    _, fp8 = v3
    single = tmp_path / "single"
    single.mkdir()
    tensors = {}
    for shard in sorted(fp8.glob("model-*.safetensors")):
        tensors.update(load_file(shard))
    save_file(tensors, single / "model.safetensors", metadata={"format": "pt"})
    shutil.copyfile(fp8 / "config.json", single / "config.json")
    sharded, one = open_checkpoint(fp8), open_checkpoint(single)
    assert sorted(sharded.names()) == sorted(one.names()) and one.skipped_layers == sharded.skipped_layers
    for name in sharded.names():
        assert sharded.stored_dtype(name) == one.stored_dtype(name)
        assert torch.equal(sharded.tensor(name), one.tensor(name)), name


def test_fused_experts_read_as_the_per_expert_hub_names(v3, tmp_path):
    """transformers' fused layout: gate_up_proj [E, 2I, H] with the gate rows first, down_proj [E, H, I]."""
    source, _ = v3
    tensors = load_file(source / "model.safetensors")
    experts, fused = WIDE_V3["n_routed_experts"], tmp_path / "fused"
    fused.mkdir()
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        per = {proj: [tensors.pop(f"{prefix}.{e}.{proj}.weight") for e in range(experts)]
               for proj in ("gate_proj", "up_proj", "down_proj")}
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in
                                                         zip(per["gate_proj"], per["up_proj"])])
        tensors[f"{prefix}.down_proj"] = torch.stack(per["down_proj"])
    save_file(tensors, fused / "model.safetensors", metadata={"format": "pt"})
    shutil.copyfile(source / "config.json", fused / "config.json")
    original, reader = open_checkpoint(source), open_checkpoint(fused)
    assert sorted(reader.names()) == sorted(original.names())
    for name in original.names():
        assert reader.shape(name) == original.shape(name)
        assert torch.equal(reader.tensor(name), original.tensor(name)), name


def test_fused_fp8_experts_are_dequantized_per_expert(tmp_path):
    """Fused FP8 experts (one scale grid per expert) split on block rows."""
    gate_up = torch.randn(2, 256, 200) * 0.1
    q, scale = zip(*(quantize_fp8(gate_up[e]) for e in range(2)))
    q, scale = torch.stack(q), torch.stack(scale)
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    save_file({fused: q, fused + "_scale_inv": scale}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 1,
                                                      "quantization_config": QUANTIZATION_CONFIG}))
    reader = open_checkpoint(tmp_path)
    assert reader.names() == [f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(2)
                              for p in ("gate_proj", "up_proj")]
    for e in range(2):
        exact = block_dequantize(q[e], scale[e])
        assert torch.equal(reader.tensor(f"model.layers.0.mlp.experts.{e}.gate_proj.weight"), exact[:128])
        assert torch.equal(reader.tensor(f"model.layers.0.mlp.experts.{e}.up_proj.weight"), exact[128:])


def test_tied_embeddings(tmp_path, v3):
    from transformers import Qwen2Config

    path = make_checkpoint(Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True), tmp_path / "tied")
    assert "lm_head.weight" not in safe_open(path / "model.safetensors", framework="pt").keys()
    reader = open_checkpoint(path)
    assert reader.tied and reader.has("lm_head.weight")
    assert reader.shape("lm_head.weight") == reader.shape("model.embed_tokens.weight")
    assert torch.equal(reader.tensor("lm_head.weight"), reader.tensor("model.embed_tokens.weight"))
    assert not open_checkpoint(v3[0]).tied


# -- malformed checkpoints: one line each ------------------------------------------------------------------------

def fp8_single(directory: Path, tensors: dict, quantization=QUANTIZATION_CONFIG) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors")
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 1}
    if quantization is not None:
        config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config))
    return directory


W = "model.layers.0.self_attn.o_proj.weight"
Q = torch.zeros(200, 300, dtype=torch.float8_e4m3fn)


def copy_of(fp8: Path, directory: Path) -> Path:
    shutil.copytree(fp8, directory)
    return directory


def edit_index(directory: Path, edit) -> Path:
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    edit(index["weight_map"])
    index_file.write_text(json.dumps(index))
    return directory


def first_shard(directory: Path) -> Path:
    return sorted(directory.glob("model-*.safetensors"))[0]


BAD = {}


def bad(make):
    """A malformed checkpoint: make(fp8 checkpoint, directory) writes one into directory and returns it."""
    BAD[make.__name__.replace("_", " ")] = make
    return make


@bad
def shard_missing(fp8, d):
    first_shard(copy_of(fp8, d)).unlink()
    return d


@bad
def tensor_missing_from_its_shard(fp8, d):
    def move(weight_map):
        weight_map["lm_head.weight"] = next(f for f in weight_map.values() if f != weight_map["lm_head.weight"])
    return edit_index(copy_of(fp8, d), move)


@bad
def shard_outside_the_directory(fp8, d):
    return edit_index(copy_of(fp8, d), lambda weight_map: weight_map.update(
        {"lm_head.weight": "../elsewhere.safetensors"}))


@bad
def index_not_json(fp8, d):
    (copy_of(fp8, d) / "model.safetensors.index.json").write_text("{")
    return d


@bad
def index_without_weight_map(fp8, d):
    (copy_of(fp8, d) / "model.safetensors.index.json").write_text('{"weight_map": ["a"]}')
    return d


@bad
def unreadable_header(fp8, d):
    first_shard(copy_of(fp8, d)).write_bytes(b"\xff" * 64)
    return d


@bad
def truncated_shard(fp8, d):
    shard = first_shard(copy_of(fp8, d))
    shard.write_bytes(shard.read_bytes()[:-100])
    return d


@bad
def scale_of_the_wrong_block_grid(fp8, d):
    return fp8_single(d, {W: Q, W + "_scale_inv": torch.ones(2, 2)})


@bad
def scale_of_a_missing_weight(fp8, d):
    return fp8_single(d, {W + "_scale_inv": torch.ones(2, 3)})


@bad
def fp8_weight_without_scale(fp8, d):
    return fp8_single(d, {W: Q})


@bad
def scale_of_a_bf16_weight(fp8, d):
    return fp8_single(d, {W: torch.zeros(200, 300, dtype=torch.bfloat16), W + "_scale_inv": torch.ones(2, 3)})


@bad
def fp8_without_quantization_config(fp8, d):
    return fp8_single(d, {W: Q, W + "_scale_inv": torch.ones(2, 3)}, quantization=None)


@bad
def unknown_quant_method(fp8, d):
    return fp8_single(d, {W: Q, W + "_scale_inv": torch.ones(2, 3)}, quantization={"quant_method": "gptq"})


@bad
def fp8_fmt_e5m2(fp8, d):
    return fp8_single(d, {W: Q, W + "_scale_inv": torch.ones(2, 3)},
                      quantization={**QUANTIZATION_CONFIG, "fmt": "e5m2"})


@bad
def bad_weight_block_size(fp8, d):
    return fp8_single(d, {W: Q, W + "_scale_inv": torch.ones(2, 3)},
                      quantization={**QUANTIZATION_CONFIG, "weight_block_size": [0]})


@bad
def unsupported_dtype(fp8, d):
    return fp8_single(d, {W: torch.zeros(4, 4, dtype=torch.float8_e5m2)}, quantization=None)


@bad
def no_weights(fp8, d):
    (fp8_single(d, {W: Q}) / "model.safetensors").unlink()
    return d


@bad
def config_not_json(fp8, d):
    (fp8_single(d, {W: torch.zeros(2)}) / "config.json").write_text("{")
    return d


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_checkpoint_is_one_line_input_error(case, v3, tmp_path):
    directory = BAD[case](v3[1], tmp_path / "bad")
    one_line_error(lambda: open_checkpoint(directory))


def test_corrupt_headers_never_escape_as_tracebacks(v3, tmp_path):
    """Every byte of a shard's header (and its length) overwritten in turn: the reader opens it and reads it,
    or refuses it with an InputError."""
    directory = copy_of(v3[1], tmp_path / "corrupt")
    shard = first_shard(directory)
    original = shard.read_bytes()
    length = int.from_bytes(original[:8], "little")
    for position in range(0, 8 + length, 37):
        for value in (0x00, 0x7B, 0xFF):
            data = bytearray(original)
            data[position] = value
            shard.write_bytes(bytes(data))
            try:
                with open_checkpoint(directory) as reader:
                    for name in reader.names():
                        reader.tensor(name)
            except InputError as e:
                assert "\n" not in str(e)


# -- resources ---------------------------------------------------------------------------------------------------

def test_one_shard_open_at_a_time(v3, monkeypatch):
    _, fp8 = v3
    open_now, most, opened = set(), [0], []

    class Spy:
        def __init__(self, path, framework):
            self.handle = safe_open(path, framework=framework)
            self.path = path
            open_now.add(self)
            opened.append(Path(path).name)
            most[0] = max(most[0], len(open_now))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            open_now.discard(self)
            return self.handle.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.handle, name)

    monkeypatch.setattr(reader_module, "safe_open", Spy)
    with open_checkpoint(fp8) as reader:
        names = reader.names()
        for name in names[::2] + names[1::2] + names[::-3]:  # back and forth between shards
            reader.tensor(name)
            assert not open_now  # each read closes its shard again: its mapped pages leave the resident set
    assert most[0] == 1 and not open_now
    weight_map = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {file for name, file in weight_map.items() if not name.startswith("model.layers.3.")}
    assert set(opened) == needed  # shards with only the (skipped) MTP layer are never opened


MEASURE = textwrap.dedent("""
    import sys, torch
    from toolchain.checkpoint.reader import open_checkpoint

    def status(field):
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))

    reader = open_checkpoint(sys.argv[1])
    torch.ones(8, dtype=torch.float8_e4m3fn).float() * torch.ones(8)  # torch's kernels loaded before measuring
    before = status("VmRSS:")
    try:
        open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    except OSError:
        print("skip")
        sys.exit()
    weight = reader.tensor("model.layers.0.mlp.down_proj.weight")
    print((status("VmHWM:") - before) / weight.nbytes)
""")


def test_dequantizing_a_large_weight_needs_little_more_than_its_output(tmp_path):
    """A 4096 x 4096 FP8 weight (64 MiB in fp32), measured in a fresh process: the peak RSS increase includes
    the shard's memory-mapped pages (16 MiB) and one block row at a time; dequantizing the whole weight at once
    would need three fp32 copies."""
    q, scale = quantize_fp8(torch.randn(4096, 4096) * 0.02)
    fp8_single(tmp_path / "big", {"model.layers.0.mlp.down_proj.weight": q,
                                  "model.layers.0.mlp.down_proj.weight_scale_inv": scale})
    out = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "big")], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    if out == "skip":
        pytest.skip("/proc/self/clear_refs is not writable here")
    assert float(out) < 2.5, f"peak RSS increase {float(out):.2f}x the fp32 output"


# -- DeepSeek-V4 and V3.2 as shipped -----------------------------------------------------------------------------

def tiny_config(model_type: str, fields: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **fields)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """A tiny DeepSeek-V4 in the hub layout, with one MTP block."""
    return write_random_checkpoint(tiny_config("deepseek_v4", TINY_V4), tmp_path_factory.mktemp("v4") / "hub",
                                   seed=3, mtp_layers=1)


def header(checkpoint: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) of a single-file checkpoint."""
    with safe_open(checkpoint / "model.safetensors", framework="pt") as f:
        return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}


def test_v4_hub_layout_is_deepseeks(v4):
    """Names, dtypes and shapes as deepseek-ai/DeepSeek-V4-Flash's index and shard headers show them."""
    stored = header(v4)
    hidden, inter, experts = TINY_V4["hidden_size"], TINY_V4["moe_intermediate_size"], TINY_V4["n_routed_experts"]
    assert stored["embed.weight"] == ("BF16", [300, hidden]) and stored["head.weight"] == ("BF16", [300, hidden])
    assert stored["hc_head_fn"] == ("F32", [2, 2 * hidden]) and stored["norm.weight"][0] == "BF16"
    assert stored["layers.0.attn.wq_a.weight"] == ("F8_E4M3", [128, hidden])
    assert stored["layers.0.attn.wq_a.scale"] == ("F8_E8M0", [1, 2])
    assert stored["layers.0.attn.wo_a.weight"] == ("F8_E4M3", [256, 128])  # o_groups x o_lora_rank
    assert stored["layers.0.attn.attn_sink"] == ("F32", [2]) and stored["layers.0.attn.kv_norm.weight"][0] == "BF16"
    assert stored["layers.0.ffn.experts.3.w1.weight"] == ("I8", [inter, hidden // 2])
    assert stored["layers.0.ffn.experts.3.w1.scale"] == ("F8_E8M0", [inter, hidden // 32])
    assert stored["layers.0.ffn.experts.3.w2.weight"] == ("I8", [hidden, inter // 2])
    assert stored["layers.0.ffn.shared_experts.w2.scale"] == ("F8_E8M0", [2, 1])
    assert stored["layers.0.ffn.gate.tid2eid"] == ("I64", [300, 2]) and "layers.0.ffn.gate.bias" not in stored
    assert stored["layers.1.ffn.gate.bias"] == ("F32", [experts]) and "layers.1.ffn.gate.tid2eid" not in stored
    assert not [n for n in stored if n.startswith("layers.0.attn.compressor.")]  # a sliding-window layer
    for layer in (1, 2):  # compressor projections ship in bf16, without scales
        assert stored[f"layers.{layer}.attn.compressor.wkv.weight"][0] == "BF16"
        assert f"layers.{layer}.attn.compressor.wkv.scale" not in stored
    assert stored["layers.1.attn.indexer.wq_b.weight"][0] == "F8_E4M3"  # CSA: the indexer
    assert stored["layers.1.attn.indexer.weights_proj.weight"][0] == "BF16"
    assert stored["layers.1.attn.indexer.compressor.ape"][0] == "F32"
    assert not [n for n in stored if n.startswith("layers.2.attn.indexer.")]  # HCA: no indexer
    assert stored["mtp.0.e_proj.weight"][0] == "F8_E4M3" and stored["mtp.0.ffn.experts.0.w3.weight"][0] == "I8"
    assert not [n for n in stored if n.startswith("model.")]
    config = json.loads((v4 / "config.json").read_text())
    assert config["quantization_config"] == {**V4_QUANTIZATION, "expert_dtype": "fp4"}
    assert config["num_nextn_predict_layers"] == 1


def assert_reads_as_transformers_loads(checkpoint: Path) -> int:
    """Every parameter of transformers' model loaded from ``checkpoint`` (on CPU its FP8 quantizer dequantizes)
    equals the reader's tensor of that name, fused experts per expert. Returns how many were compared."""
    from transformers import AutoModelForCausalLM

    from toolchain.quiet_transformers import quiet_transformers

    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
    reader = open_checkpoint(checkpoint)
    compared = 0
    for name, value in model.state_dict().items():
        head, _, leaf = name.rpartition(".")
        if head.endswith(".experts") and leaf in ("gate_up_proj", "down_proj"):
            for e in range(value.shape[0]):
                parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
                mine = torch.cat([reader.tensor(f"{head}.{e}.{p}.weight", torch.bfloat16) for p in parts])
                assert torch.equal(mine.float(), value[e].float()), f"{name}[{e}]"
                compared += len(parts)
            continue
        dtype = reader.natural_dtype(name)
        mine = reader.tensor(name, dtype)
        assert mine.dtype == dtype and mine.shape == value.shape, name
        assert torch.equal(mine if dtype == torch.int64 else mine.float(),
                           value if dtype == torch.int64 else value.float()), name
        compared += 1
    return compared


def test_v4_reads_as_transformers_loads_it(v4):
    reader = open_checkpoint(v4)
    assert reader.stored_name("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight") == \
        "layers.1.attn.indexer.wq_b.weight"
    assert reader.stored_name("model.layers.0.mlp.experts.3.up_proj.weight") == "layers.0.ffn.experts.3.w3.weight"
    assert reader.stored_name("lm_head.weight") == "head.weight"
    assert reader.shape("model.layers.0.mlp.experts.3.down_proj.weight") == (256, 128)  # values, not bytes
    assert reader.stored_dtype("model.layers.0.mlp.experts.3.down_proj.weight") == torch.int8
    assert reader.natural_dtype("model.layers.0.mlp.experts.3.down_proj.weight") == torch.bfloat16
    assert reader.natural_dtype("model.layers.1.self_attn.compressor.kv_proj.weight") == torch.bfloat16
    assert reader.natural_dtype("model.layers.0.mlp.gate.tid2eid") == torch.int64
    experts = 3 * TINY_V4["n_routed_experts"] * TINY_V4["num_hidden_layers"]
    assert assert_reads_as_transformers_loads(v4) == len(reader.names()) == 89 - 6 + experts


def test_v4_mtp_block_is_skipped_and_said_so(v4):
    reader = open_checkpoint(v4)
    assert reader.skipped_layers == (TINY_V4["num_hidden_layers"],)
    assert not [n for n in reader.names() if "mtp" in n or ".layers.3." in n]


def test_v32_reads_as_transformers_loads_it(tmp_path):
    """V3's FP8 layout with ue8m0 (power-of-two, float32) scales and the indexer: wq_b and wk in e4m3,
    weights_proj in bf16, the k_norm LayerNorm in float32."""
    path = write_random_checkpoint(tiny_config("deepseek_v32", TINY_V32), tmp_path / "v32", seed=1, scale_fmt="ue8m0")
    stored = header(path)
    prefix = "model.layers.1.self_attn.indexer."
    assert stored[prefix + "wq_b.weight"][0] == stored[prefix + "wk.weight"][0] == "F8_E4M3"
    assert stored[prefix + "wk.weight_scale_inv"] == ("F32", [1, 2])
    assert stored[prefix + "weights_proj.weight"][0] == "BF16"
    assert prefix + "weights_proj.weight_scale_inv" not in stored
    assert stored[prefix + "k_norm.weight"][0] == stored[prefix + "k_norm.bias"][0] == "F32"
    assert json.loads((path / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"
    scales = [raw_single(path, n) for n in stored if n.endswith("_scale_inv")]
    assert all(fp4.is_power_of_two(s).all() for s in scales)
    assert assert_reads_as_transformers_loads(path) > 0


def raw_single(checkpoint: Path, name: str) -> torch.Tensor:
    with safe_open(checkpoint / "model.safetensors", framework="pt") as f:
        return f.get_tensor(name)


def v4_single(directory: Path, tensors: dict, quantization: dict | None = None, **config) -> Path:
    """A single-file checkpoint with DeepSeek-V4's quantization_config (no model_type: names as stored)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors")
    quant = {**V4_QUANTIZATION, **(quantization or {})}
    (directory / "config.json").write_text(json.dumps({"num_hidden_layers": 1, "expert_dtype": "fp4",
                                                       "quantization_config": quant, **config}))
    return directory


EXPERT = "layers.0.ffn.experts.0.w1.weight"
EXPERT_SCALE = "layers.0.ffn.experts.0.w1.scale"
ATTN = "layers.0.attn.wq_a.weight"
ATTN_SCALE = "layers.0.attn.wq_a.scale"


def test_fp4_nibble_order_and_scales(tmp_path):
    """Column 2j in the low nibble, 2j + 1 in the high one; one e8m0 scale per 32 values of a row; and the same
    values as transformers' own unpacking (Fp8Dequantize._unpack_fp4)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    packed = torch.randint(-128, 128, (3, 32), dtype=torch.int8)
    packed[0, 0] = 0x21  # low nibble 1 (0.5), high nibble 2 (1.0)
    packed[0, 1] = -0x46 + 0  # 0xBA: low nibble 0xA (-1.0), high nibble 0xB (-1.5)
    scale = torch.tensor([[2.0, 0.25], [1.0, 1.0], [2.0**-20, 2.0**10]]).to(fp4.E8M0)
    reader = open_checkpoint(v4_single(tmp_path, {EXPERT: packed, EXPERT_SCALE: scale}))
    values = reader.tensor(EXPERT)
    assert values.shape == reader.shape(EXPERT) == (3, 64)
    assert values[0, :4].tolist() == [1.0, 2.0, -2.0, -3.0]  # times the first block's scale, 2
    codes = packed.view(torch.uint8).long()
    table = torch.tensor(fp4.E2M1_VALUES)
    by_hand = torch.stack([table[codes & 15], table[codes >> 4]], dim=-1).reshape(3, 64)
    assert torch.equal(values, by_hand * scale.float().repeat_interleave(32, dim=1))
    unpacked = Fp8Dequantize(None)._unpack_fp4(packed)
    assert torch.equal(values, unpacked * scale.float().repeat_interleave(32, dim=1))
    assert torch.equal(reader.tensor(EXPERT, torch.bfloat16), values.to(torch.bfloat16))
    assert torch.equal(reader.tensor(EXPERT, rows=(1, 3)), values[1:])


def test_quantize_fp4_rounds_to_nearest_e2m1_with_power_of_two_scales():
    weight = torch.randn(8, 64) * 0.03
    weight[1, 32:] = 0
    packed, scale = fp4.quantize_fp4(weight)
    assert packed.dtype == torch.int8 and packed.shape == (8, 32) and scale.dtype == fp4.E8M0
    s = scale.float()
    assert fp4.is_power_of_two(s).all()
    amax = weight.abs().reshape(8, 2, 32).amax(-1)
    assert ((amax / s <= 6) & ((amax / s > 3) | (amax == 0))).all()  # the smallest power of two that fits
    values = fp4.unpack_e2m1(packed) * s.repeat_interleave(32, dim=1)
    grid = torch.tensor(fp4.E2M1_VALUES[:8])
    nearest = (weight.abs() / s.repeat_interleave(32, dim=1)).unsqueeze(-1).sub(grid).abs().amin(-1)
    assert torch.allclose((values - weight).abs() / s.repeat_interleave(32, dim=1), nearest, atol=1e-6)
    assert torch.equal(fp4.unpack_e2m1(fp4.pack_e2m1(torch.tensor([0.25, 0.75, 2.5, 5.0]))),
                       torch.tensor([0.0, 1.0, 2.0, 4.0]))  # ties to the even code


def _e8m0(*shape, value=1.0):
    return torch.full(shape, value).to(fp4.E8M0)


Q8 = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
P4 = torch.zeros(4, 32, dtype=torch.int8)
V4_BAD = {  # case -> (tensors, quantization_config changes, config changes, raised when opened or when read)
    "fp4 scale of the wrong shape": ({EXPERT: P4, EXPERT_SCALE: _e8m0(4, 1)}, {}, {}, "open"),
    "fp4 weight without its scale": ({EXPERT: P4}, {}, {}, "open"),
    "fp4 rows not whole blocks of 32": ({EXPERT: torch.zeros(4, 8, dtype=torch.int8),
                                         EXPERT_SCALE: _e8m0(4, 1)}, {}, {}, "open"),
    "fp4 weight while expert_dtype is fp8": ({EXPERT: P4, EXPERT_SCALE: _e8m0(4, 2)}, {}, {"expert_dtype": "fp8"},
                                             "open"),
    "fp8 scale of the wrong block grid": ({ATTN: Q8, ATTN_SCALE: _e8m0(1, 1)}, {}, {}, "open"),
    "fp8 weight without its scale": ({ATTN: Q8}, {}, {}, "open"),
    "e8m0 scales while scale_fmt is float": ({ATTN: Q8, ATTN_SCALE: _e8m0(1, 2)}, {"scale_fmt": "float"}, {},
                                             "open"),
    "scale in int8": ({ATTN: Q8, ATTN_SCALE: torch.ones(1, 2, dtype=torch.int8)}, {}, {}, "open"),
    "unknown scale_fmt": ({ATTN: Q8, ATTN_SCALE: _e8m0(1, 2)}, {"scale_fmt": "ue4m3"}, {}, "open"),
    "unknown expert_dtype": ({ATTN: Q8, ATTN_SCALE: _e8m0(1, 2)}, {}, {"expert_dtype": "int4"}, "open"),
    "NaN e8m0 scale": ({EXPERT: P4, EXPERT_SCALE: torch.tensor([[1.0, 1.0]] * 3 + [[1.0, float("nan")]])
                        .to(fp4.E8M0)}, {}, {}, "read"),
    "infinite float32 scale": ({ATTN: Q8, ATTN_SCALE: torch.tensor([[1.0, float("inf")]])}, {}, {}, "read"),
    "non-power-of-two scale with ue8m0": ({ATTN: Q8, ATTN_SCALE: torch.tensor([[1.0, 0.3]])}, {}, {}, "read"),
    "zero float scale": ({ATTN: Q8, ATTN_SCALE: torch.tensor([[1.0, 0.0]])}, {"scale_fmt": "float"}, {}, "read"),
}


@pytest.mark.parametrize("case", sorted(V4_BAD))
def test_bad_or_mismatched_scales_are_one_line_input_errors(case, tmp_path):
    tensors, quantization, config, when = V4_BAD[case]
    directory = v4_single(tmp_path / "bad", tensors, quantization, **config)
    if when == "open":
        message = one_line_error(lambda: open_checkpoint(directory))
    else:
        reader = open_checkpoint(directory)
        message = one_line_error(lambda: reader.tensor(reader.names()[0]))
    assert str(directory) in message


def test_bad_scales_exit_2_at_the_cli(v3, tmp_path, monkeypatch, capsys):
    """A NaN among an FP8 checkpoint's scales, found when export reads the weight: one line, exit 2, nothing
    written."""
    bad = copy_of(v3[1], tmp_path / "nan")
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    weight_map = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    shard = bad / weight_map[name]
    tensors = load_file(shard)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    code, _, err = conftest.run_cli(monkeypatch, capsys, "export", bad, "-o", tmp_path / "out")
    lines = [line for line in err.splitlines() if line.startswith("dstc: error:")]
    assert code == 2 and len(lines) == 1 and name in lines[0] and "nan" in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
