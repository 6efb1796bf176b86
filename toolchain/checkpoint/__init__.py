"""Reading real checkpoints at real size: a lazy, tensor-by-tensor reader (FP8, DeepSeek-V4's FP4 experts and
ue8m0 scales, DeepSeek's own names, sharded, fused experts), the PyTorch reference built from it one decoder layer
at a time, and writers of DeepSeek-V3's FP8 and DeepSeek-V4's hub layouts."""
