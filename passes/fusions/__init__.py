"""LLM fusions: RMSNorm, residual RMSNorm, rotary embeddings, attention and SiLU, for ONNX Runtime's fused
kernels, and the rewrites that let OpenVINO's own compile-time fusions recognise the exported patterns.

Every public module registers one pass; importing the package registers the contrib op schemas with ``onnx``.
"""

from passes import contrib_ops

contrib_ops.register()
