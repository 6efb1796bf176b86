"""Build recipes: YAML files validated with pydantic, so that a typo is an error naming the key and the file.

A recipe names a source model and the stages to run on it, in this order: export, passes (optional),
compress (optional), compile. Each stage's section is its configuration; its hash becomes part of the stage id.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import typing
from pathlib import Path
from typing import Literal, cast

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from toolchain.errors import InputError, RecipeError
from toolchain.gates import GateLimits
from toolchain.interface.moe_lowerings import RUNS_ON, parity_backends
from toolchain.interface.reports import CompressionScheme
from toolchain.settings.evaluation import EvalSettings
from toolchain.settings.section import Section
from toolchain.settings.serve_health import ServeSection

Backend = Literal["openvino", "onnxruntime"]
_PARITY: tuple[Backend, ...] = ("onnxruntime", "openvino")


class ExportSection(Section):
    parity: list[Backend] = Field(default_factory=lambda: list(_PARITY), description=(
        "Backends to check against PyTorch fp32 (default: every backend that runs the graph)."))
    new_tokens: int = Field(16, ge=1, description="Greedy decode steps in the parity check.")
    # how MoE layers' routed experts are lowered (toolchain/export/moe.py LOWERINGS); auto: chosen for the build's
    # backend, expert count and compression (moe.py auto_lowering), dispatch for an export alone
    moe: Literal["auto", "dispatch", "fused-onnxruntime", "fused-openvino"] = Field("auto", description=(
        "MoE routed experts: per-expert sparse dispatch (any runtime), one com.microsoft.MoE node per layer (ONNX"
        " Runtime only), or the tiled block OpenVINO's CPU plugin runs as GatherMatmul; auto: in a build, the one"
        ' measured fastest for its backend, expert count and compression (docs/deepseek-generations.md "Export", '
        "export.moe), dispatch for an export alone."))
    # what MLA's KV cache holds (toolchain/export/deepseek.py MLA_CACHES); None: the architecture's default
    # (latent; per-head for serving on OpenVINO). An MLA-free model refuses a layout at export, when its
    # architecture is known
    mla_cache: Literal["latent", "per-head"] | None = Field(None, description=(
        "What MLA attention (DeepSeek-V2/V3) caches per token: the normalized latent and the rotary key, with "
        "kv_b_proj absorbed, or transformers' per-head keys and values, which openvino_genai's paged continuous "
        "batching and ONNX Runtime's fused attention (fuse-mla-attention) need  [default: latent; refused for "
        "models without MLA]"))
    # what DeepSeek-V4's cache holds (toolchain/export/deepseek_v4.py V4_CACHES): per-token state, or the compressed
    # layout (window, pooled entries, tail); None: per-token, the one every runner takes (the compressed one but
    # serve's speculation and gather layout). Refused for other models
    v4_cache: Literal["per-token", "compressed"] | None = Field(None, description=(
        "What DeepSeek-V4's cache holds: per-token state (K=V and compressor projections per position, the windows "
        "pooled again at each step), or compressed (a bounded sliding window, the pooled CSA/HCA entries and the "
        "incomplete window's tail: V4's own cache); every runner takes it (speculation rolls it back by replaying "
        "the accepted tokens) but speculation in serve's running batches (whose rejected drafts are holes in the "
        "cache) and serve's 'gather' layout, which refuse it in one line  [default: per-token; refused for other "
        "models]"))
    # how the weights are stored (toolchain/export/weights.py STORAGES): bf16 values as bf16 + Cast, or float32
    weights: Literal["auto", "float32", "bfloat16"] = Field("auto", description=(
        "Weight storage: bfloat16 keeps a bf16 or FP8 checkpoint's values as bf16 initializers widened by a Cast "
        "in the graph (the same float32 values, half the bytes); auto does so above 1 GiB of float32 weights."))
    # export the checkpoint's MTP layer (DeepSeek-V3, V3.2, V4) as mtp/model.onnx, carried into the artifact, and the
    # main graph's hidden-state output it reads (toolchain/export/mtp.py)
    mtp: bool = Field(False, description=(
        "Also export the checkpoint's multi-token-prediction layer (DeepSeek-V3, V3.2, V4) as mtp/model.onnx with"
        " its own KV cache, checked against its PyTorch reference, and give the main graph its hidden_states "
        "output; the artifact carries it for self-speculative drafts."))
    # the element type the KV cache is stored in, computed in float32 (toolchain/export/cache_precision.py)
    cache_dtype: Literal["float32", "float16"] = Field("float32", description=(
        "Element type the KV cache is stored in (computed in float32): float16 halves its bytes per token "
        "(docs/deepseek-generations.md \"Cache precision\"); refused for a per-head cache."))
    _parity_given: bool = PrivateAttr(False)

    @model_validator(mode="after")
    def _parity_runs_the_lowering(self) -> ExportSection:
        """Unless given, parity runs on every backend that runs the lowering's graph; a given one it cannot run
        on is an error."""
        self._parity_given = "parity" in self.model_fields_set
        try:
            # names from toolchain/export/moe.py's BACKENDS, which are the Backends
            self.parity = cast(list[Backend], list(parity_backends(self.moe, tuple(self.parity)
                                                                   if self._parity_given else None)))
        except InputError as e:
            raise ValueError(str(e)) from None
        return self

    @property
    def parity_given(self) -> bool:
        """Whether the recipe named the parity backends (else they follow the lowering)."""
        return self._parity_given


    def with_lowering(self, lowering: str) -> ExportSection:
        """This section with ``moe`` resolved to ``lowering`` (from auto), its parity default following it."""
        given = self.model_fields_set - {"moe"} - (set() if self._parity_given else {"parity"})
        return ExportSection(**{**self.model_dump(include=given), "moe": lowering})


class PassesSection(Section):
    target: Backend = Field(description=(
        "onnxruntime: fuse into ORT's contrib kernels; openvino: standard ops shaped for OpenVINO's fusions."))
    passes: list[str] | None = Field(None, description=(
        "Pass names to run instead of the target's pipeline (see `dstc passes list`; default: the target's)."))
    expect: dict[str, dict[str, int | str]] | None = Field(None, description=(
        "What each pass must do, by pass name: {min: N}, {max: N} or {count: N} rewrites, replacing the target's "
        "own expectations for the model (an empty mapping checks nothing); the stage fails on a miss."))


class CompressSection(Section):
    # shipped: the checkpoint's FP8 / FP4 weights kept as they ship (codes and scales), the rest as exported
    scheme: CompressionScheme = Field(description=(
        "INT4 in groups (NNCF), INT8 per output channel (NNCF), INT8 with one scale per attention head, or "
        "shipped: the checkpoint's FP8/FP4 weights kept as stored (codes and scales), the rest as exported."))
    group_size: Literal[32, 64, 128] = Field(128, description="Input channels per INT4 scale (int4-grouped).")
    sym: bool = Field(False, description="Symmetric (no zero point) or asymmetric.")
    ratio: float = Field(1.0, gt=0, le=1, description=(
        "Share of INT4 weights kept in INT4 (the rest in the backup precision); int4 only."))
    backup: Literal["int8", "none"] = Field("int8", description="Precision of the INT4 weights left out at ratio < 1.")
    awq: bool = Field(False, description="Activation-aware scaling (int4, needs calibration text).")
    scale_estimation: bool = Field(False, description="Scale estimation (int4, needs calibration text).")
    gptq: bool = Field(False, description="GPTQ (int4, openvino target only).")
    dataset: str = Field("embedded", description=(
        'Calibration text: \'embedded\' (the project\'s corpus), a JSONL file with a "text" field, a text file or a '
        "directory of them. Never downloaded."))
    ignore: list[str] = Field(default_factory=list, description="Keep matching weights/nodes in fp32 (name or regex).")
    int8: list[str] = Field(default_factory=list, description=(
        "Matching weights/nodes in INT8 per output channel (name or regex; ignore wins over it)."))
    accuracy_level: int | None = Field(4, ge=0, le=4, description=(
        "MatMulNBits compute precision on onnxruntime (4: int8 activations, fastest)."))
    # onnxruntime, int4-grouped: int8 copies of the 4-bit weights that prompts read (passes/quantize/prefill_int8.py);
    # None: on where the CPU building the artifact has an int8 dot product (VNNI, AMX), off elsewhere, decided by the
    # build's plan (toolchain/stages/choices.py prefill_int8)
    prefill_int8: bool | None = Field(None, description=(
        "onnxruntime, int4: also store each 4-bit weight in int8 per column for prompts of 8+ tokens "
        "(DynamicQuantizeMatMul on the int8 GEMM, AMX/VNNI): faster prefill, 3x the 4-bit weights' bytes. "
        "Default: on where this CPU has VNNI or AMX."))
    embeddings: Literal["int8", "int4", "fp32"] = Field("int8", description="Precision of the token embeddings.")
    lm_head: Literal["int8", "int4", "fp32"] = Field("int8", description="Precision of the output projection.")
    router: Literal["fp32", "int8", "scheme"] = Field("fp32", description=(
        "MoE router weights ('scheme': the scheme's precision)."))
    shared_experts: Literal["scheme", "int8", "fp32"] = Field("scheme", description="MoE shared experts' weights.")
    # one weight at a time (bounded memory): "auto" above 1 GiB of float weights (toolchain/stages/compress.py)
    streaming: Literal["auto", "always", "never"] = Field("auto", description=(
        "Compress one weight at a time in bounded memory (auto: above 1 GiB of float weights; data-free, or AWQ /"
        " scale estimation on statistics computed layer by layer), or with NNCF's whole-model call."))
    # the largest relative error ||W - Q(W)|| / ||W|| a compressed weight may have: above it the stage fails (exit
    # 6) rather than ship a weight that is lost (1.0 is a weight written as zeros). INT4 g128 measures ~0.1, INT8
    # ~0.005, so 0.5 only catches a lost weight; a recipe that means to keep such a weight raises it.
    max_weight_error: float = Field(0.5, gt=0, allow_inf_nan=False, description=(
        "Fail the stage (exit 6) when a compressed weight's relative error is above this (1.0: a weight of zeros;"
        " INT4 measures ~0.1)."))

    @property
    def data_aware(self) -> bool:
        """Options that need calibration activations, so the whole model run on calibration text."""
        return self.awq or self.scale_estimation or self.gptq or self.ratio < 1.0

    def problem(self, target: str) -> str | None:
        """What is wrong with these options together for ``target``, or None: rules that span fields, checked
        when a recipe loads and before a compress stage reads anything."""
        if self.ratio < 1.0 and self.scheme != "int4-grouped":
            return "ratio applies to int4-grouped (the share of weights in INT4, the rest in the backup)"
        if (self.awq or self.scale_estimation or self.gptq) and self.scheme != "int4-grouped":
            return "awq, scale_estimation and gptq apply to the int4-grouped scheme"
        if self.scheme == "shipped" and (self.ignore or self.int8 or self.embeddings != "int8" or
                                         self.lm_head != "int8" or self.router != "fp32" or
                                         self.shared_experts != "scheme"):
            return ("the shipped scheme keeps every weight the checkpoint does not quantize as exported: "
                    "ignore, int8, embeddings, lm_head, router and shared_experts do not apply")
        if self.gptq and target != "openvino":
            return "gptq runs on the openvino target only (NNCF's ONNX backend does not implement it)"
        if self.prefill_int8 and (target != "onnxruntime" or self.scheme != "int4-grouped"):
            return "prefill_int8 applies to the int4-grouped scheme on the onnxruntime target (4-bit MatMulNBits)"
        if target == "onnxruntime" and self.embeddings == "int4":
            # NNCF 3.4's ONNX backend replaces an INT4 Gather with a MatMulNBits fed the token ids, which ORT
            # rejects ("Type 'tensor(int64)' of input parameter (input_ids) of operator (MatMulNBits) ... invalid")
            return ("INT4 embeddings are not supported for onnxruntime (NNCF 3.4 writes an invalid graph for them); "
                    "use embeddings int8 or the openvino target")
        return None


class CompileSection(Section):
    backend: Backend = Field(description="The runtime the artifact is for.")
    verify: bool = Field(True, description=(
        "Check the artifact's greedy decoding against PyTorch (or the compressed input graph)."))
    # run the artifact at the runtime's deployment defaults (toolchain/verify/smoke.py); both checks are skipped,
    # with the reason recorded, for an artifact too large to run on the building machine (stages/compile.py)
    smoke: bool = Field(True, description=(
        "Run the artifact at its runtime's deployment defaults in a child process (crashes, NaNs)."))


# Bounds of free text: a recipe is a page of settings, not a place for a megabyte of prose (a name is a directory's,
# which file systems bound at 255 bytes; a model a path or hub id, which Linux bounds at 4096).
DESCRIPTION_CHARS, NAME_CHARS, PATH_CHARS = 2000, 200, 4096


class Recipe(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=NAME_CHARS, description=(
        "The artifact's name: its directory under artifacts/ unless -o, and the model id `dstc serve` answers to."))
    description: str = Field("", max_length=DESCRIPTION_CHARS, description="Free text, copied into manifest.json.")
    model: str = Field(max_length=PATH_CHARS, description=(
        "An embedded model's name (`dstc models list`), a local Hugging Face checkpoint directory, or a hub id in "
        "the local Hugging Face cache (nothing is downloaded); `dstc build --model` replaces it."))
    revision: str | None = Field(None, max_length=NAME_CHARS, description=(
        "A hub checkpoint's pinned commit, checked against the local copy."))
    export: ExportSection = Field(default_factory=ExportSection, description="ONNX export with the KV cache.")
    passes: PassesSection | None = Field(None, description="Graph rewrites for the backend (optional).")
    compress: CompressSection | None = Field(None, description="Weight compression through NNCF (optional).")
    compile: CompileSection = Field(description="The runtime artifact: its backend and checks.")
    eval: EvalSettings | None = Field(None, description=(
        "Evaluate the artifact after building it (report.json/.md/.html inside it), as `dstc eval`."))
    gates: GateLimits | None = Field(None, description=(
        "Fail the build (exit 1, the artifact and report kept) when a gate fails, as `dstc gate`; implies eval."))
    serve: ServeSection | None = Field(None, description="What `dstc serve` reads from the artifact.")

    @model_validator(mode="after")
    def _one_runtime(self) -> Recipe:
        """Every stage builds for the compile backend: a passes target or a MoE lowering for another runtime is
        refused when the recipe loads, not found by a stage that cannot convert the other's operators."""
        backend = self.compile.backend
        if self.passes and self.passes.target != backend:
            raise ValueError(f"passes.target is {self.passes.target} and compile.backend is {backend}: the stages "
                             "build for one runtime, set both to the same")
        if self.export.moe in RUNS_ON and backend not in RUNS_ON[self.export.moe]:
            raise ValueError(f"export.moe is {self.export.moe}, which runs on {', '.join(RUNS_ON[self.export.moe])} "
                             f"only, and compile.backend is {backend}: choose another lowering (or auto)")
        return self

    @model_validator(mode="after")
    def _narrow_cache_is_not_per_head(self) -> Recipe:
        """The export stage's refusal of a narrow per-head cache (stages/export.py PER_HEAD_NARROW_CACHE) when the
        recipe names the layout, as it loads; a model whose cache is per head by its architecture is refused there."""
        if self.export.cache_dtype != "float32" and self.export.mla_cache == "per-head":
            raise ValueError("a per-head KV cache stays float32 in the graph (OpenVINO keeps it in its "
                             "KV_CACHE_PRECISION already): use mla_cache latent, or cache_dtype float32")
        return self

    @model_validator(mode="after")
    def _compression_fits_the_backend(self) -> Recipe:
        problem = self.compress.problem(self.compile.backend) if self.compress else None
        if problem:
            raise ValueError(f"compress: {problem}")
        return self

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


_MERGE = "tag:yaml.org,2002:merge"
ANCHOR_PREFIX = "x-"


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last silently). Merge
    keys (``<<: *base``) are YAML's: the mapping's own keys override the merged ones, and are the ones checked."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:  # no object of its own: SafeLoader's construct_mapping merges it in
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base class reports it
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (line {key_node.start_mark.line + 1})", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_recipe(path: Path, model_override: str | None = None) -> Recipe:
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except OSError as e:
        raise RecipeError(f"cannot read recipe {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: not a text file") from None
    except yaml.YAMLError as e:
        lines = [line for line in str(e).splitlines() if line.strip()]
        detail = next((line for line in lines if "duplicate key" in line), lines[0] if lines else "")
        raise RecipeError(f"{path}: not valid YAML: {detail.strip()}") from None
    except RecursionError:
        raise RecipeError(f"{path}: nested too deeply to be a recipe") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of keys to values")
    # top-level x- keys hold what the recipe's anchors name (``x-base: &base {...}``, merged with ``<<: *base``),
    # as in Compose files: YAML only, no part of the recipe
    data = {k: v for k, v in data.items() if not (isinstance(k, str) and k.startswith(ANCHOR_PREFIX))}
    if model_override:
        data = {**data, "model": model_override, "revision": None}
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        # a misspelt key first: the "field required" beside it is usually the same mistake
        first = next((err for err in errors if err["type"] == "extra_forbidden"), errors[0])
        # a rule across sections names its keys itself
        key = ".".join(str(p) for p in first["loc"])
        problem = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            problem = "unknown key" + _suggestion(first["loc"])
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise RecipeError(f"{path}: {key + ': ' if key else ''}{problem}{more}") from None


# keys that `dstc gate` spelled differently before its options took the recipe's names
_FORMER_KEYS = {"max_ppl_increase": "max_perplexity_increase", "min_top1": "min_top1_agreement",
                "max_em_drop": "max_exact_match_drop", "max_kl": "max_kl_mean"}


def _suggestion(loc: tuple) -> str:
    """`` (did you mean X?)`` for an unknown key at ``loc`` close to one of its section's keys, else ''."""
    model: type[BaseModel] | None = Recipe
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if model else None
        model = next((t for t in (field.annotation, *typing.get_args(field.annotation))
                      if isinstance(t, type) and issubclass(t, BaseModel)), None) if field else None
    if model is None:
        return ""
    name = str(loc[-1])
    known = list(model.model_fields)
    close = [_FORMER_KEYS[name]] if _FORMER_KEYS.get(name) in known else difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""
