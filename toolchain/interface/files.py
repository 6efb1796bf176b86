"""The file names of a stage's output directory and of a built artifact, as every stage writes them and every
runtime, verifier and report reads them."""

from __future__ import annotations

# The exported graph, and the ONNX Runtime artifact's (its weights in external data beside it).
ONNX_MODEL = "model.onnx"
ONNX_WEIGHTS = "model.onnx.data"
# DeepSeek's MTP layer's graph (toolchain/export/mtp.py), in this subdirectory of a stage's output and of an
# artifact, under the names above (mtp/model.onnx, mtp/openvino_model.xml).
MTP_DIR = "mtp"
# onnxruntime-genai's configuration, beside an ONNX Runtime artifact's graph where it can describe the model.
GENAI_CONFIG = "genai_config.json"
# The OpenVINO artifact: the stateful IR and the tokenizer's IRs from openvino-tokenizers (each .xml with its .bin).
MODEL_XML = "openvino_model.xml"
TOKENIZER_XML = "openvino_tokenizer.xml"
DETOKENIZER_XML = "openvino_detokenizer.xml"

# The checkpoint files that runtimes read beside the graph: the config (architecture, eos/bos ids), generation
# defaults, and the Hugging Face tokenizer with its chat template (transformers 5 keeps the template in
# chat_template.jinja, older checkpoints in tokenizer_config.json).
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER = "tokenizer.json"
CHECKPOINT_FILES = (CONFIG, GENERATION_CONFIG, TOKENIZER, "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "chat_template.json")

# What each stage writes about itself (reports.py), and the stage runner's record beside them.
EXPORT_REPORT = "export.json"
PASSES_REPORT = "passes.json"
COMPRESSION_REPORT = "compression.json"
COMPILE_REPORT = "compile.json"
STAGE_RECORD = "stage.json"

# A built artifact's manifest, its signature (`dstc sign`), and what `dstc eval` writes into it.
MANIFEST = "manifest.json"
SIGNATURE = "manifest.json.sig"
REPORT_FILES = ("report.json", "report.md", "report.html")


def weights_of(xml: str) -> str:
    """The weights file of an OpenVINO IR (``openvino_model.xml`` -> ``openvino_model.bin``)."""
    return xml.removesuffix(".xml") + ".bin"
