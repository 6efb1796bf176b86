"""dstc's own checkpoint reader: a Hugging Face safetensors checkpoint, tensor by tensor, never all at once.

A real checkpoint (DeepSeek-V3/R1: 671B parameters in FP8, 163 shards) cannot be loaded whole on a 24 GiB machine,
so the streaming exporter asks for one weight at a time by its name and lets it go before asking for the next.
``open_checkpoint`` reads only the headers (names, shapes, dtypes); each ``tensor()`` call reads that tensor from
its memory-mapped shard and returns a new tensor that nothing here keeps. At most one shard is open at a time.

Names are the hub's (``model.layers.L.mlp.experts.E.gate_proj.weight`` per expert, as transformers 5.5 also
saves them). What the reader hides:

- FP8 (DeepSeek-V3's hub format, ``quantization_config`` ``quant_method: fp8``, ``fmt: e4m3``): an e4m3 weight
  with a float32 ``<name>_scale_inv`` of one scale per ``weight_block_size`` block (128 x 128; the blocks on the
  right and bottom edges are partial) is returned dequantized, W = q * s per block, computed in float32 as
  DeepSeek's ``inference/kernel.py`` ``weight_dequant`` and llama.cpp's ``convert_hf_to_gguf.py`` do. The scales
  are part of their weight and not listed as names of their own. With ``scale_fmt: ue8m0`` (V3.1 and later)
  every scale must be a power of two.
- DeepSeek-V4's hub format (the same ``quantization_config`` with ``scale_fmt: ue8m0``, and ``expert_dtype: fp4``):
  FP8 weights with ``float8_e8m0fnu`` scales named ``<prefix>.scale``, and routed experts in FP4 (int8, two e2m1
  values per byte, with one e8m0 scale per 32 values of a row; toolchain/checkpoint/fp4.py), dequantized to
  bf16-exact values; tensors stored in bf16 (V4's compressor and indexer projections) are read as they are.
  Scales are checked against their weight's shape when the checkpoint is opened, and for NaN, infinities, zeros
  and (with ue8m0) non-powers of two when their weight is read.
- names other than transformers' module names (DeepSeek-V4's ``layers.0.attn.wq_a.weight``): renamed by
  transformers' own conversion mapping (toolchain/checkpoint/hub_names.py), routed experts kept per expert.
- transformers' fused experts (``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows first, and
  ``mlp.experts.down_proj`` [E, H, I]) are listed and read as the per-expert hub names.
- layers at index ``num_hidden_layers`` and beyond (DeepSeek-V3's multi-token-prediction layer) are not part of
  the causal LM: they are left out and their indices listed in ``skipped_layers``; so are DeepSeek-V4's
  ``mtp.N.`` blocks, listed as layer ``num_hidden_layers + N`` (the index V4's ``compress_ratios`` gives them).
  ``open_checkpoint(path, mtp=True)`` keeps them, for the MTP exporter (toolchain/export/mtp_reference.py): V4's
  under ``model.layers.{num_hidden_layers + N}.``, the block's tensors by transformers' names for a layer and its
  own ones as hub_names.py's ``MTP_MODULES`` name them.
- tied embeddings (``tie_word_embeddings`` with no ``lm_head.weight`` stored): ``lm_head.weight`` is the
  embedding table, and ``tied`` is True.

A malformed checkpoint is an InputError with one line, raised when it is opened where the headers show it.
"""

from __future__ import annotations

import json
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors import safe_open

from toolchain.checkpoint import fp4
from toolchain.checkpoint.hub_names import module_names, mtp_module_name
from toolchain.errors import InputError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
V4_SCALE_SUFFIX, WEIGHT_SUFFIX = ".scale", ".weight"  # DeepSeek-V4 names a weight's scales <prefix>.scale
EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
FP8 = torch.float8_e4m3fn
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": FP8,
          "F8_E8M0": fp4.E8M0, "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64}
PACKED_FP4 = (torch.int8, torch.uint8)
QUANTIZED = (FP8, *PACKED_FP4)
SCALE_DTYPES = (torch.float32, fp4.E8M0)
INTEGERS = (torch.int8, torch.uint8, torch.int32, torch.int64)
_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")
_MTP = re.compile(r"(?:model\.)?mtp\.(\d+)\.")
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


@dataclass(frozen=True)
class _Stored:
    """A tensor as a shard's header describes it."""

    file: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _Quantization:
    """What config.json's ``quantization_config`` (and V4's top-level ``expert_dtype``) declare."""

    block: tuple[int, int]  # FP8 weights' scale blocks
    scale_fmt: str  # "float" or "ue8m0" (every scale a power of two)
    expert_dtype: str  # "fp8" or "fp4" (routed experts packed two e2m1 values per byte)


@dataclass(frozen=True)
class _Entry:
    """Where a named tensor's values are: all of ``stored``, or rows [start, stop) of one expert of a fused
    [E, rows, cols] tensor; with its scales when it is quantized (``block``: the rows and columns one scale
    covers)."""

    stored: _Stored
    scale: _Stored | None = None
    expert: int | None = None
    rows: tuple[int, int] | None = None
    block: tuple[int, int] | None = None

    @property
    def fp4(self) -> bool:
        return self.scale is not None and self.stored.dtype in PACKED_FP4

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the values (an FP4 row holds twice as many values as it has bytes)."""
        *lead, cols = self.stored.shape
        cols *= 2 if self.fp4 else 1
        if self.expert is None:
            return (*lead, cols)
        assert self.rows is not None  # an expert's entry has its rows
        start, stop = self.rows
        return (stop - start, cols)


@dataclass(frozen=True)
class Shipped:
    """A quantized weight's stored form: its codes' format, the block one scale covers (rows, columns of values),
    the shape of its values and its scales' format ("f32", or "e8m0": powers of two)."""

    format: str
    block: tuple[int, int]
    shape: tuple[int, ...]
    scale_format: str


def read_config(path: Path) -> dict:
    """config.json of a checkpoint directory."""
    config_file = Path(path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise InputError(f"{path} is not a model directory: no config.json") from None
    except (OSError, ValueError) as e:
        raise InputError(f"{config_file} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise InputError(f"{config_file} is not a JSON object")
    return config


def open_checkpoint(path: str | Path, mtp: bool = False) -> CheckpointReader:
    return CheckpointReader(Path(path), mtp)


class CheckpointReader:
    """The tensors of one checkpoint directory, by name; see the module docstring. Use it as a context manager
    (or call ``close``) to release the shard it has open."""

    def __init__(self, path: Path, mtp: bool = False) -> None:
        self.path = path
        self.config = read_config(path)
        self.quantization = _quantization(self.config, path)
        self.block_size = self.quantization.block if self.quantization else None
        self._handle = None
        self._open_file: str | None = None
        self._lock = threading.RLock()  # the open shard is shared: an exporter writes weights on two threads
        layers = self.config.get("num_hidden_layers")
        stored, skipped = {}, set()
        for key, file in self._weight_map().items():
            layer, block = _LAYER.match(key), _MTP.match(key)
            if isinstance(layers, int) and layer and int(layer.group(1)) >= layers and not mtp:
                skipped.add(int(layer.group(1)))
            elif block and not (mtp and isinstance(layers, int)):
                skipped.add(int(block.group(1)) + (layers if isinstance(layers, int) else 0))
            else:
                stored[key] = file
        self.skipped_layers: tuple[int, ...] = tuple(sorted(skipped))
        self._entries = self._rename(self._index(self._headers(stored)))
        self.tied = bool(self.config.get("tie_word_embeddings")) and LM_HEAD not in self._entries \
            and EMBEDDING in self._entries
        if self.tied:
            self._entries[LM_HEAD] = self._entries[EMBEDDING]

    # -- what the checkpoint holds ------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._entries)

    def has(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def parameters(self) -> int:
        """How many values the checkpoint holds (a tied table once), from the headers alone."""
        return sum(math.prod(self.shape(n)) for n in self._entries if not (self.tied and n == LM_HEAD))

    def stored_dtype(self, name: str) -> torch.dtype:
        return self._entry(name).stored.dtype

    def stored_name(self, name: str) -> str:
        """The name the checkpoint's files give the tensor ``name``."""
        return self._entry(name).stored.key

    # -- reading ------------------------------------------------------------------------------------------------

    def natural_dtype(self, name: str) -> torch.dtype:
        """The dtype that holds the tensor's values exactly with the least memory: bfloat16 for bf16 and for FP8
        and FP4 weights (dequantized to bf16, as DeepSeek's own fp8_cast_bf16 does), int64 for integers (V4's
        hash-routing table), float32 otherwise."""
        entry = self._entry(name)
        if entry.stored.dtype == torch.bfloat16 or entry.scale is not None:
            return torch.bfloat16
        return torch.int64 if entry.stored.dtype in INTEGERS else torch.float32

    def tensor(self, name: str, dtype: torch.dtype = torch.float32,
               rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor in ``dtype`` (float32 or bfloat16; int64 for an integer tensor), read now; FP8 and FP4
        weights dequantized. ``rows``: only rows [start, stop) of its first axis.

        The shard is closed after each read, which unmaps the pages read: a shard is several GB, and its mapped
        pages would otherwise stay in the process's resident set until the next shard is opened."""
        entry = self._entry(name)
        integer = entry.scale is None and entry.stored.dtype in INTEGERS
        if dtype not in (torch.float32, torch.bfloat16) and not (integer and dtype == torch.int64):
            raise ValueError(f"tensor(): dtype must be torch.float32 or torch.bfloat16 (or torch.int64 for an "
                             f"integer tensor), not {dtype}")
        span = entry.rows
        if rows is not None:
            first = span[0] if span else 0
            span = (first + rows[0], first + rows[1])
        with self._lock:
            try:
                if entry.scale is not None:
                    return self._dequantize(entry, dtype, span)
                return self._read(entry.stored, entry.expert, span).to(dtype)
            finally:
                self.close()

    def array(self, name: str) -> np.ndarray:
        return self.tensor(name).numpy()

    # -- the stored codes of a quantized weight (toolchain/compress/shipped.py) ---------------------------------

    def shipped(self, name: str) -> Shipped | None:
        """How the quantized weight ``name`` is stored (None for a tensor the checkpoint does not quantize)."""
        entry = self._entry(name)
        if entry.scale is None or entry.block is None:
            return None
        return Shipped("f4e2m1" if entry.fp4 else "f8e4m3", entry.block, entry.shape,
                       "e8m0" if entry.scale.dtype == fp4.E8M0 else "f32")

    def shipped_codes(self, name: str) -> np.ndarray:
        """The weight's codes, one value per element [rows, cols]: ml_dtypes float8_e4m3fn, or float4_e2m1fn
        unpacked from two per byte (the low nibble is the even column: toolchain/checkpoint/fp4.py)."""
        entry = self._entry(name)
        with self._lock:
            try:
                q = self._read(entry.stored, entry.expert, entry.rows).contiguous()
            finally:
                self.close()
        if not entry.fp4:
            return q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        packed = q.view(torch.uint8).numpy()
        codes = np.empty((packed.shape[0], 2 * packed.shape[1]), np.uint8)
        codes[:, 0::2], codes[:, 1::2] = packed & 0x0F, packed >> 4
        return codes.view(ml_dtypes.float4_e2m1fn)

    def shipped_scales(self, name: str) -> np.ndarray:
        """float32 [row blocks, column blocks] of the weight's scales (the rows of an expert's part of a fused
        tensor), checked as when the weight is dequantized."""
        entry = self._entry(name)
        assert entry.scale is not None and entry.block is not None  # a shipped weight (``shipped``)
        with self._lock:
            try:
                scale = self._read(entry.scale, entry.expert).to(torch.float32)
            finally:
                self.close()
        self._check_scale_values(entry.scale, scale)
        if entry.rows is not None:
            start, stop = entry.rows
            scale = scale[start // entry.block[0]:math.ceil(stop / entry.block[0])]
        return scale.numpy()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
            self._handle, self._open_file = None, None

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise InputError(f"{self.path}: the checkpoint has no tensor {name}") from None

    def _weight_map(self) -> dict[str, str]:
        """Tensor name -> shard file name, from the index or the single file's header."""
        if (self.path / SINGLE_FILE).is_file():  # transformers' order of preference
            with self._open(SINGLE_FILE) as f:
                return dict.fromkeys(f.keys(), SINGLE_FILE)
        index_file = self.path / INDEX_FILE
        if not index_file.is_file():
            raise InputError(f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE}")
        try:
            weight_map = json.loads(index_file.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise InputError(f"{index_file} is not a readable index: {e}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise InputError(f"{index_file} has no weight_map of tensor names to shard files")
        for file in set(weight_map.values()):
            if Path(file).name != file or file in ("", ".", ".."):
                raise InputError(f"{index_file} names a shard outside the checkpoint directory: {file!r}")
        return weight_map

    def _headers(self, weight_map: dict[str, str]) -> dict[str, _Stored]:
        """Shape and dtype of each tensor from its shard's header (shards opened one at a time)."""
        by_file: dict[str, list[str]] = {}
        for key, file in weight_map.items():
            by_file.setdefault(file, []).append(key)
        stored = {}
        for file, keys in by_file.items():
            if not (self.path / file).is_file():
                raise InputError(f"{self.path / INDEX_FILE} names a shard that is missing: {self.path / file}")
            with self._open(file) as f:
                present = set(f.keys())
                for key in keys:
                    if key not in present:
                        raise InputError(f"{self.path / INDEX_FILE} places {key} in {file}, which does not hold it")
                    info = f.get_slice(key)
                    dtype = DTYPES.get(info.get_dtype())
                    if dtype is None:
                        raise InputError(f"{self.path / file}: {key} is {info.get_dtype()}; dstc reads "
                                         f"{', '.join(DTYPES)}")
                    stored[key] = _Stored(file, key, tuple(info.get_shape()), dtype)
        return {key: stored[key] for key in weight_map}  # in the index's order

    def _scales(self, stored: dict[str, _Stored]) -> dict[str, _Stored]:
        """weight name -> its scales: ``<weight>_scale_inv`` (DeepSeek-V3) or, for a weight ``<prefix>.weight``
        stored quantized, ``<prefix>.scale`` (DeepSeek-V4; other ``.scale`` tensors are parameters of their own)."""
        scales = {}
        for key, s in stored.items():
            if key.endswith(SCALE_SUFFIX):
                weight = key[:-len(SCALE_SUFFIX)]
                if weight not in stored:
                    raise InputError(f"{self.path}: {key} is the scale of {weight}, which the checkpoint does not "
                                     f"hold")
                scales[weight] = s
            elif key.endswith(V4_SCALE_SUFFIX):
                quantized = stored.get(key[:-len(V4_SCALE_SUFFIX)] + WEIGHT_SUFFIX)
                if quantized is not None and quantized.dtype in QUANTIZED:
                    scales[quantized.key] = s
        return scales

    def _index(self, stored: dict[str, _Stored]) -> dict[str, _Entry]:
        """Canonical name -> entry: scales attached to their weights, fused experts split."""
        scales = self._scales(stored)
        scale_keys = {s.key for s in scales.values()}
        entries = {}
        for key, s in stored.items():
            if key in scale_keys:
                continue
            scale = scales.get(key)
            block = self._check_scale(s, scale)
            fused = _FUSED.fullmatch(key)
            if fused is None:
                entries[key] = _Entry(s, scale, block=block)
                continue
            if len(s.shape) != 3:
                raise InputError(f"{self.path}: fused experts {key} must be [experts, rows, cols], not "
                                 f"{list(s.shape)}")
            prefix, kind = fused.groups()
            experts, rows, _ = s.shape
            if kind == "down_proj":
                parts = {"down_proj": (0, rows)}
            else:
                half = rows // 2
                if rows % 2 or (block is not None and half % block[0]):
                    raise InputError(f"{self.path}: {key} {list(s.shape)} does not split into gate and up "
                                     f"halves" + (" on scale block rows" if rows % 2 == 0 else ""))
                parts = {"gate_proj": (0, half), "up_proj": (half, rows)}
            for e in range(experts):
                for proj, span in parts.items():
                    entries[f"{prefix}.{e}.{proj}.weight"] = _Entry(s, scale, e, span, block)
        return entries

    def _rename(self, entries: dict[str, _Entry]) -> dict[str, _Entry]:
        """The entries under transformers' module names (hub_names.py), when the checkpoint's are others; V4's
        MTP blocks as the module docstring says."""
        layers = self.config.get("num_hidden_layers")
        first = layers if isinstance(layers, int) else 0  # kept only with an int num_hidden_layers (__init__)
        blocks = {name: mtp_module_name(name, first) for name in entries if _MTP.match(name)}
        # a block's layer tensors are renamed as a layer's at its index (transformers has none of its own)
        aliases = {name: _MTP.sub(lambda m: f"layers.{int(m.group(1)) + first}.", name, count=1)
                   for name, module in blocks.items() if module is None}
        names = module_names(self.path, self.config, [aliases.get(name, name) for name in entries
                                                      if blocks.get(name) is None])
        if names is None:
            return entries
        renamed: dict[str, _Entry] = {}
        for name, entry in entries.items():
            module = blocks.get(name) or names[aliases.get(name, name)]
            if name in aliases and not module.startswith("model."):
                module = "model." + module
            if module in renamed:
                raise InputError(f"{self.path}: {renamed[module].stored.key} and {entry.stored.key} are both "
                                 f"{module} in transformers' names")
            renamed[module] = entry
        return renamed

    def _check_scale(self, weight: _Stored, scale: _Stored | None) -> tuple[int, int] | None:
        """The block one scale covers (rows, columns of values) of a quantized weight, None for another tensor;
        an InputError for a scale that does not fit its weight or config.json."""
        where = self.path / weight.file
        quant = self.quantization
        fp4_weights = quant is not None and quant.expert_dtype == "fp4"
        if weight.dtype in PACKED_FP4 and scale is None and fp4_weights and weight.key.endswith(WEIGHT_SUFFIX):
            raise InputError(f"{where}: FP4 weight {weight.key} has no {weight.key.removesuffix(WEIGHT_SUFFIX)}"
                             f"{V4_SCALE_SUFFIX}")
        if weight.dtype not in QUANTIZED or (weight.dtype in PACKED_FP4 and scale is None):
            if scale is not None:
                raise InputError(f"{where}: {weight.key} has a {SCALE_SUFFIX} but is {weight.dtype}, not FP8")
            return None  # an int8 tensor without scales is an integer tensor
        if quant is None:
            raise InputError(f"{where}: {weight.key} is {'FP4' if weight.dtype in PACKED_FP4 else 'FP8'} but "
                             f"config.json has no quantization_config")
        if scale is None:
            v4_name = f" or {weight.key.removesuffix(WEIGHT_SUFFIX)}{V4_SCALE_SUFFIX}" \
                if weight.key.endswith(WEIGHT_SUFFIX) else ""
            raise InputError(f"{where}: FP8 weight {weight.key} has no scales ({weight.key}{SCALE_SUFFIX}{v4_name})")
        if len(weight.shape) not in (2, 3):
            raise InputError(f"{where}: quantized weight {weight.key} must be a matrix, not {list(weight.shape)}")
        scale_where = self.path / scale.file
        if scale.dtype not in SCALE_DTYPES:
            raise InputError(f"{scale_where}: {scale.key} must be a float32 or float8_e8m0fnu scale, not "
                             f"{scale.dtype}")
        if scale.dtype == fp4.E8M0 and quant.scale_fmt != "ue8m0":
            raise InputError(f"{scale_where}: {scale.key} is float8_e8m0fnu but config.json's quantization_config "
                             f"has scale_fmt {quant.scale_fmt!r}, not 'ue8m0'")
        *lead, rows, cols = weight.shape
        if weight.dtype in PACKED_FP4:
            if quant.expert_dtype != "fp4":
                raise InputError(f"{where}: {weight.key} is packed FP4 ({weight.dtype}) but config.json declares "
                                 f"expert_dtype {quant.expert_dtype!r}, not 'fp4'")
            block = fp4.BLOCK
            cols *= 2
            if cols % block[1]:
                raise InputError(f"{where}: FP4 weight {weight.key} has rows of {cols} values, not whole blocks of "
                                 f"{block[1]}")
        else:
            block = quant.block
        grid = [*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1])]
        if list(scale.shape) != grid:
            raise InputError(f"{scale_where}: {scale.key} is {list(scale.shape)}; {weight.key} of {rows}x{cols} "
                             f"values in {block[0]}x{block[1]} blocks needs {grid}")
        return block

    def _check_scale_values(self, scale: _Stored, values: torch.Tensor) -> None:
        """A one-line InputError for scales that are NaN, infinite, not positive or (with ue8m0) not powers of
        two."""
        power_of_two = self.quantization is not None and self.quantization.scale_fmt == "ue8m0"
        good = fp4.is_power_of_two(values) if power_of_two else torch.isfinite(values) & (values > 0)
        if not bool(good.all()):
            value = values[~good].flatten()[0].item()
            what = "finite positive powers of two (scale_fmt ue8m0)" if power_of_two else "finite and positive"
            raise InputError(f"{self.path / scale.file}: {scale.key} holds {value!r} at {int((~good).sum())} "
                             f"place(s); scales must be {what}")

    def _open(self, file: str):
        try:
            return safe_open(str(self.path / file), framework="pt")
        except Exception as e:  # safetensors raises several types for a damaged header
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise InputError(f"{self.path / file} is not a readable safetensors file: {message}") from None

    def _shard(self, file: str):
        """The open handle of ``file``; the shard open before it is closed first."""
        if self._open_file != file:
            self.close()
            self._handle = self._open(file)
            self._open_file = file
        return self._handle

    def _read(self, stored: _Stored, expert: int | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        handle = self._shard(stored.file)
        if expert is None and rows is None:
            return handle.get_tensor(stored.key)
        index = () if expert is None else (expert,)
        return handle.get_slice(stored.key)[index if rows is None else (*index, slice(*rows))]

    def _dequantize(self, entry: _Entry, dtype: torch.dtype, span: tuple[int, int] | None) -> torch.Tensor:
        """W = q * s in float32 per block, a band of whole block rows (at least _BAND rows) at a time: besides the
        output, only one band of q and its float32 product exist at once. ``span``: the stored rows to read (all
        by default)."""
        if entry.block is None or entry.scale is None:
            raise ValueError(f"{entry.stored.key} is not a quantized weight with its scales")
        block_rows, block_cols = entry.block
        scale = self._read(entry.scale, entry.expert).to(torch.float32)  # [row blocks, col blocks], small
        self._check_scale_values(entry.scale, scale)
        first, stop = span or (0, entry.stored.shape[-2])
        cols = entry.shape[-1]
        band = block_rows * math.ceil(_BAND / block_rows)
        out = torch.empty((stop - first, cols), dtype=dtype)
        start = first
        while start < stop:
            end = min((start // band + 1) * band, stop)  # up to the end of this band
            q = self._read(entry.stored, entry.expert, (start, end))
            values = fp4.unpack_e2m1(q) if entry.fp4 else q.to(torch.float32)
            s = scale[torch.arange(start, end) // block_rows]  # [rows, column blocks]
            target = out[start - first:end - first]
            if cols % block_cols == 0:  # whole column blocks (always for FP4): each scale broadcasts over its block
                blocks = (end - start, cols // block_cols, block_cols)
                torch.mul(values.view(blocks), s.unsqueeze(-1), out=target.view(blocks))
            else:
                torch.mul(values, s.repeat_interleave(block_cols, dim=1)[:, :cols], out=target)
            start = end
        return out


_BAND = 128  # rows dequantized at once: one FP8 block row, or 128 rows of an FP4 weight


def _quantization(config: dict, path: Path) -> _Quantization | None:
    """The scale blocks and formats from ``quantization_config`` (None without one); other quantizations are
    refused."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    where = f"{path / 'config.json'}: quantization_config"
    if not isinstance(quant, dict):
        raise InputError(f"{where} is not an object")
    if quant.get("quant_method") != "fp8":
        raise InputError(f"{where} has quant_method {quant.get('quant_method')!r}; dstc reads 'fp8' (DeepSeek's "
                         f"block-scaled e4m3) only")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise InputError(f"{where} has fmt {quant.get('fmt')!r}; dstc reads FP8 in 'e4m3' only")
    block = quant.get("weight_block_size", [128, 128])  # transformers' FineGrainedFP8Config default
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise InputError(f"{where} has weight_block_size {block!r}; it must be two positive integers")
    scale_fmt = quant.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise InputError(f"{where} has scale_fmt {scale_fmt!r}; dstc reads 'float' and 'ue8m0'")
    # V4's config.json declares expert_dtype at the top level, V4.1's in quantization_config (as transformers
    # moves it)
    expert_dtype = quant.get("expert_dtype", config.get("expert_dtype", "fp8"))
    if expert_dtype not in ("fp8", "fp4"):
        raise InputError(f"{where} has expert_dtype {expert_dtype!r}; dstc reads 'fp8' and 'fp4'")
    return _Quantization((block[0], block[1]), scale_fmt, expert_dtype)
