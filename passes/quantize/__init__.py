"""Weight quantization passes: int8 with per-head scales, and the rewrites into ONNX Runtime's quantized-weight
kernels. Every public module registers one pass."""
