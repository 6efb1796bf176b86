"""toolchain.checkpoint.reader and fp8: the hub's FP8 layout written and read back, sharded and single-file,
fused experts, tied embeddings, the MTP layer, one-line errors for malformed checkpoints, one shard open at a
time, and bounded memory while dequantizing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import COMMON, make_checkpoint
from toolchain.checkpoint import open_checkpoint
from toolchain.checkpoint import reader as reader_module
from toolchain.checkpoint.fp8 import QUANTIZATION_CONFIG, quantize_fp8, write_fp8_checkpoint
from toolchain.errors import InputError

# Widths that are not multiples of 128, so that FP8 blocks on the right and bottom edges are partial.
WIDE_V3 = dict(vocab_size=97, hidden_size=200, intermediate_size=300, moe_intermediate_size=136,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=144, q_lora_rank=160,
               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, n_shared_experts=1,
               num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, max_position_embeddings=256,
               rope_interleave=True)
HUB_FP8 = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def wide_v3_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**WIDE_V3)


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
    from toolchain.checkpoint import open_checkpoint

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
                         check=True, cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    if out == "skip":
        pytest.skip("/proc/self/clear_refs is not writable here")
    assert float(out) < 2.5, f"peak RSS increase {float(out):.2f}x the fp32 output"
