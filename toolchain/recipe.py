"""Build recipes: YAML files validated with pydantic, so that a typo is an error naming the key and the file.

A recipe names a source model and the stages to run on it, in this order: export, passes (optional),
compress (optional), compile. Each stage's section is its configuration; its hash becomes part of the stage id.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal, cast

import yaml
from pydantic import Field, PrivateAttr, ValidationError, model_validator

from toolchain.errors import InputError, RecipeError
from toolchain.gates import GateLimits
from toolchain.hardware import has_int8_dot_product
from toolchain.interface.moe_lowerings import RUNS_ON, parity_backends
from toolchain.interface.reports import CompressionScheme
from toolchain.settings.evaluation import EvalSettings
from toolchain.settings.section import Section

Backend = Literal["openvino", "onnxruntime"]
_PARITY: tuple[Backend, ...] = ("onnxruntime", "openvino")


class ExportSection(Section):
    parity: list[Backend] = Field(default_factory=lambda: list(_PARITY))
    new_tokens: int = Field(16, ge=1)
    # how MoE layers' routed experts are lowered (toolchain/export/moe.py LOWERINGS); auto: chosen for the build's
    # backend, expert count and compression (moe.py auto_lowering), dispatch for an export alone
    moe: Literal["auto", "dispatch", "fused-onnxruntime", "fused-openvino"] = "auto"
    # what MLA's KV cache holds (toolchain/export/deepseek.py MLA_CACHES); None: the architecture's default
    # (latent; per-head for serving on OpenVINO). An MLA-free model refuses a layout at export, when its
    # architecture is known
    mla_cache: Literal["latent", "per-head"] | None = None
    # how the weights are stored (toolchain/export/weights.py STORAGES): bf16 values as bf16 + Cast, or float32
    weights: Literal["auto", "float32", "bfloat16"] = "auto"
    # export the checkpoint's MTP layer (DeepSeek-V3, V3.2, V4) as mtp/model.onnx, carried into the artifact, and the
    # main graph's hidden-state output it reads (toolchain/export/mtp.py)
    mtp: bool = False
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
    target: Backend
    passes: list[str] | None = None  # None: the target's default pipeline
    expect: dict[str, dict[str, int | str]] | None = None


class CompressSection(Section):
    # shipped: the checkpoint's FP8 / FP4 weights kept as they ship (codes and scales), the rest as exported
    scheme: CompressionScheme
    group_size: Literal[32, 64, 128] = 128
    sym: bool = False
    ratio: float = Field(1.0, gt=0, le=1)
    backup: Literal["int8", "none"] = "int8"
    awq: bool = False
    scale_estimation: bool = False
    gptq: bool = False
    dataset: str = "embedded"
    ignore: list[str] = Field(default_factory=list)
    int8: list[str] = Field(default_factory=list)
    accuracy_level: int | None = Field(4, ge=0, le=4)
    # onnxruntime, int4-grouped: int8 copies of the 4-bit weights that prompts read (passes/quantize/prefill_int8.py);
    # None: on where the CPU building the artifact has an int8 dot product (VNNI, AMX), off elsewhere
    prefill_int8: bool | None = None
    embeddings: Literal["int8", "int4", "fp32"] = "int8"
    lm_head: Literal["int8", "int4", "fp32"] = "int8"
    router: Literal["fp32", "int8", "scheme"] = "fp32"
    shared_experts: Literal["scheme", "int8", "fp32"] = "scheme"
    # one weight at a time (bounded memory): "auto" above 1 GiB of float weights (toolchain/stages/compress.py)
    streaming: Literal["auto", "always", "never"] = "auto"
    # the largest relative error ||W - Q(W)|| / ||W|| a compressed weight may have: above it the stage fails (exit
    # 6) rather than ship a weight that is lost (1.0 is a weight written as zeros). INT4 g128 measures ~0.1, INT8
    # ~0.005, so 0.5 only catches a lost weight; a recipe that means to keep such a weight raises it.
    max_weight_error: float = Field(0.5, gt=0, allow_inf_nan=False)

    @property
    def data_aware(self) -> bool:
        """Options that need calibration activations, so the whole model run on calibration text."""
        return self.awq or self.scale_estimation or self.gptq or self.ratio < 1.0

    def with_prefill_int8(self, target: str) -> CompressSection:
        """The section with prefill_int8 decided (None: on for int4-grouped on onnxruntime where this CPU has an
        int8 dot product; measured on one with AVX-512 VNNI: TTFT 0.6x, decode 1.0x the plain artifact's, 1.33x
        its bytes, README "Prefill on ONNX Runtime")."""
        if self.prefill_int8 is not None:
            return self
        wanted = target == "onnxruntime" and self.scheme == "int4-grouped" and has_int8_dot_product()
        return self.model_copy(update={"prefill_int8": wanted})

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
    backend: Backend
    verify: bool = True
    # run the artifact at the runtime's deployment defaults (toolchain/verify/smoke.py); both checks are skipped,
    # with the reason recorded, for an artifact too large to run on the building machine (stages/compile.py)
    smoke: bool = True


# The metrics /health judges against thresholds (toolchain/serve/health.py measures them); higher is worse.
LATENCY_METRICS = tuple(f"{kind}_p{q}_ms" for kind in ("ttft", "itl") for q in (50, 90, 99))
HEALTH_METRICS = (*LATENCY_METRICS, "queue_depth", "running_batch", "kv_cache_usage", "rejected_per_minute")


def check_threshold(metric: str, warn: float, ok: float | None, alert: float | None) -> None:
    """InputError unless ``metric`` is one /health judges and its limits are in order (ok <= warn <= alert), the
    rule of a recipe's thresholds and of ``dstc serve --threshold`` alike."""
    if metric not in HEALTH_METRICS:
        raise InputError(f"unknown health metric {metric!r} (one of {', '.join(HEALTH_METRICS)})")
    if ok is not None and ok > warn:
        raise InputError(f"{metric}: ok={ok:g} is above warn={warn:g}")
    if alert is not None and alert < warn:
        raise InputError(f"{metric}: alert={alert:g} is below warn={warn:g}")


class ServeThreshold(Section):
    warn: float
    ok: float | None = None  # back to ok below this (default: warn)
    alert: float | None = None


class ServeSection(Section):
    """What ``dstc serve`` reads from the artifact's manifest: /health thresholds by metric (HEALTH_METRICS);
    ``--threshold`` replaces one at serve time. Not part of any stage id."""

    thresholds: dict[str, ServeThreshold] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_metrics(self) -> ServeSection:
        for metric, limits in self.thresholds.items():
            try:
                check_threshold(metric, limits.warn, limits.ok, limits.alert)
            except InputError as e:
                raise ValueError(str(e)) from None
        return self


# Bounds of free text: a recipe is a page of settings, not a place for a megabyte of prose (a name is a directory's,
# which file systems bound at 255 bytes; a model a path or hub id, which Linux bounds at 4096).
DESCRIPTION_CHARS, NAME_CHARS, PATH_CHARS = 2000, 200, 4096


class Recipe(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=NAME_CHARS)
    description: str = Field("", max_length=DESCRIPTION_CHARS)
    model: str = Field(max_length=PATH_CHARS)
    # a real checkpoint's pinned commit, checked against the local copy
    revision: str | None = Field(None, max_length=NAME_CHARS)
    export: ExportSection = Field(default_factory=ExportSection)
    passes: PassesSection | None = None
    compress: CompressSection | None = None
    compile: CompileSection
    eval: EvalSettings | None = None  # evaluate the artifact after building it (report files inside it)
    gates: GateLimits | None = None  # fail the build (exit 1, report kept) when a gate fails; implies eval
    serve: ServeSection | None = None

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
        first = e.errors()[0]
        # a rule across sections names its keys itself
        key = ".".join(str(p) for p in first["loc"])
        problem = "unknown key" if first["type"] == "extra_forbidden" else first["msg"].removeprefix("Value error, ")
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise RecipeError(f"{path}: {key + ': ' if key else ''}{problem}{more}") from None
