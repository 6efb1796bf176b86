"""Running built artifacts: open one, decode greedily on OpenVINO or ONNX Runtime, find MoE router outputs."""
