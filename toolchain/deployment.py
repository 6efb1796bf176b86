"""Which runtimes load an artifact, from what it holds: the manifest records it (``loads_with``), the build summary
prints it, docs/serve.md "Which runtimes load an artifact" explains it.

Each entry was checked by loading a built artifact of the embedded models in that runtime (docs/serve.md): the
OpenVINO artifact (stateful IR with openvino-tokenizers' IRs) in openvino_genai's LLMPipeline and optimum-intel's
OVModelForCausalLM, whatever the model; the ONNX Runtime artifact in onnxruntime-genai only where genai_config.json
was written, which compile leaves out for a cache genai cannot describe (MLA: toolchain/compile/
onnxruntime_artifact.py), so an MLA model's ONNX Runtime artifact runs in dstc's runtime alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from toolchain.interface.files import GENAI_CONFIG, MODEL_XML, ONNX_MODEL

DSTC = "dstc"
OPENVINO_GENAI = "openvino_genai"
OPTIMUM_INTEL = "optimum-intel"
ORT_GENAI = "onnxruntime-genai"


def loads_with(files: Iterable[str]) -> list[str]:
    """The runtimes that load an artifact of these files (paths relative to the artifact), dstc's first."""
    names = set(files)
    if MODEL_XML in names:
        return [DSTC, OPENVINO_GENAI, OPTIMUM_INTEL]
    if ONNX_MODEL in names:
        return [DSTC, ORT_GENAI] if GENAI_CONFIG in names else [DSTC]
    return []
