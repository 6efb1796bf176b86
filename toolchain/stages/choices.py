"""Every choice a build leaves open, taken once, here, into its plan (toolchain/build_plan.py BuildPlan): the MoE
lowering (``moe: auto``), prefill_int8 (None: this CPU's int8 dot product), the runtime every stage builds for, and
whether the export writes its weights. `dstc build` plans a recipe (``plan_recipe``); each single-stage command plans
its one stage (``plan_export``, ``plan_passes``, ``plan_compress``, ``plan_compile``) with the same rules. No stage
takes any of these decisions again (tests/stages/test_choices.py holds it so).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from toolchain.build_plan import BuildPlan
from toolchain.errors import InputError
from toolchain.hardware import has_int8_dot_product
from toolchain.interface.moe_lowerings import AUTO
from toolchain.recipe import CompileSection, CompressSection, ExportSection, PassesSection, Recipe

TARGETS = ("onnxruntime", "openvino")


def routed_experts(source: Path) -> int:
    """The routed experts of each MoE layer of the checkpoint at ``source`` (0: a dense model)."""
    # the exporter's modules (transformers) load when a build plans its stages, not when the CLI starts
    from toolchain.export.architectures import architecture_for
    from toolchain.export.moe_layer import MoeArchitecture
    from toolchain.export.reference import reference_config

    config = reference_config(source)
    arch = architecture_for(config.model_type)
    return arch.routed_experts(config) if isinstance(arch, MoeArchitecture) else 0


def moe_lowering(section: ExportSection, source: Path | None, backend: str | None,
                 compress: CompressSection | None) -> tuple[ExportSection, str | None]:
    """The export section with ``moe: auto`` resolved (toolchain/export/moe.py auto_lowering) for a build on
    ``backend`` whose weights ``compress`` compresses, and why (None for a dense model or a lowering the recipe
    names). Without a backend (an export alone), dispatch, the form every runtime runs."""
    if section.moe != AUTO:
        return section, None
    # the exporter's modules (transformers) load when a build plans its stages, not when the CLI starts
    from toolchain.checkpoint.reader import open_checkpoint
    from toolchain.export import moe
    from toolchain.export.architectures import architecture_for
    from toolchain.export.moe_layer import MoeArchitecture
    from toolchain.export.reference import reference_config
    from toolchain.export.weights import storage_for

    if backend is None or source is None:
        return section.with_lowering(moe.auto_lowering(None, 0, None, False)[0]), None
    arch = architecture_for(reference_config(source).model_type)
    experts = routed_experts(source)
    with open_checkpoint(source) as reader:  # the tensors' headers only
        storage = storage_for(section.weights, reader)
    lowering, why = moe.auto_lowering(
        backend, experts, compress.scheme if compress else None,
        bool(compress and (compress.gptq or compress.ratio < 1.0)),
        tuple(section.parity) if section.parity_given else None, storage,
        arch.lowerings if isinstance(arch, MoeArchitecture) else moe.LOWERINGS)
    # a dense model resolves to dispatch, so its stage id is what it was before auto existed
    return section.with_lowering(lowering), why if experts else None


def prefill_int8(section: CompressSection, target: str, dispatched_experts: bool) -> tuple[CompressSection, str | None]:
    """The compress section with prefill_int8 decided, and why when it was left open (None): on for int4-grouped
    on onnxruntime where this CPU has an int8 dot product (measured on one with AVX-512 VNNI: TTFT 0.6x, decode 1.0x
    the plain artifact's, 1.33x its bytes, README "Prefill on ONNX Runtime"), except where the MoE layers' routed
    experts are separate MatMuls (``dispatched_experts``)."""
    if section.prefill_int8 is not None:
        return section, None
    if dispatched_experts:
        # its int8 copies would be made of every routed expert's 4-bit weights too: 3x their bytes on disk and in
        # memory (a DeepSeek-V3 INT4 artifact of ~370 GB would grow to ~1 TB), for prompts' expert products
        return section.model_copy(update={"prefill_int8": False}), (
            "off: the MoE layers' routed experts are separate MatMuls (dispatch), each would get an int8 copy "
            "(set compress.prefill_int8 to choose)")
    wanted = target == "onnxruntime" and section.scheme == "int4-grouped" and has_int8_dot_product()
    why = "this CPU has an int8 dot product (VNNI/AMX)" if wanted else \
        "for int4-grouped on onnxruntime on a CPU with an int8 dot product only"
    return section.model_copy(update={"prefill_int8": wanted}), f"{'on' if wanted else 'off'}: {why}"


def plan_recipe(recipe: Recipe, source: Path, log: Callable[[str], None] = lambda _: None) -> BuildPlan:
    """A recipe's plan on the checkpoint this build resolved (``source``). The recipe's own rules (its sections'
    cross-field checks, one backend for every stage) held when it loaded (toolchain/recipe.py)."""
    backend = recipe.compile.backend
    decisions = {}
    export, why = moe_lowering(recipe.export, source, backend, recipe.compress)
    if why:
        decisions["export.moe"] = f"{export.moe} ({why})"
        log(f"MoE lowering: {export.moe} ({why})")
    compress = recipe.compress
    if compress is not None:
        dispatched = compress.prefill_int8 is None and export.moe == "dispatch" and bool(routed_experts(source))
        compress, why = prefill_int8(compress, backend, dispatched)
        if why:
            decisions["compress.prefill_int8"] = why
        if dispatched:
            log(f"prefill_int8 {why}")
    # a streamed compression reads each weight from the checkpoint itself (the export's weights file, 30 GB at
    # DeepSeek-V3's widths x 4 layers, is then not written); the passes stage rewrites the graph with its weights
    streamed = recipe.compress is not None and recipe.compress.streaming != "never"
    return BuildPlan(model=recipe.model, revision=recipe.revision, backend=backend, export=export,
                     defer_weights=streamed and not recipe.passes,
                     weights_read_by="the passes stage rewrites the graph with them" if streamed and recipe.passes
                     else None,
                     passes=recipe.passes, compress=compress, compile=recipe.compile, decisions=decisions)


def plan_export(model: str, section: ExportSection, revision: str | None = None) -> BuildPlan:
    """`dstc export`: an export for no runtime in particular."""
    export, _ = moe_lowering(section, None, None, None)
    return BuildPlan(model=model, revision=revision, export=export)


def plan_passes(section: PassesSection, parity: bool = True) -> BuildPlan:
    """`dstc optimize`: the passes for their target."""
    return BuildPlan(backend=section.target, passes=section, passes_parity=parity)


def plan_compress(section: CompressSection, target: str) -> BuildPlan:
    """`dstc compress`: the section's cross-field rules for ``target`` (a recipe's are checked when it loads), an
    InputError before anything is read; then prefill_int8 for this CPU."""
    if target not in TARGETS:
        raise InputError(f"unknown target {target!r}; targets: {', '.join(TARGETS)}")
    problem = section.problem(target)
    if problem:
        raise InputError(problem)
    compress, why = prefill_int8(section, target, dispatched_experts=False)
    return BuildPlan(backend=target, compress=compress,
                     decisions={"compress.prefill_int8": why} if why else {})


def plan_compile(section: CompileSection) -> BuildPlan:
    """`dstc compile`: the artifact for its backend."""
    return BuildPlan(backend=section.backend, compile=section)
