"""The keys of the exporter's facts in a graph's metadata (ONNX metadata_props) that the passes read to know what to
expect of a graph, spelled here once: the toolchain's exporter writes them and its readers read them through
toolchain/interface/graph.py, which takes them from here (passes never import the toolchain)."""

NUM_LAYERS = "dstc.num_layers"
ATTENTION = "dstc.attention"  # "gqa" or "mla" (ATTENTION_KINDS in passes/targets.py)
KV_CACHE = "dstc.kv_cache"  # "per-head" keys and values, or MLA's "latent" (toolchain/export/deepseek.py)
MOE_LAYERS = "dstc.moe_layers"  # JSON: the indices of the mixture-of-experts layers
# how the MoE layers' routed experts are lowered: "dispatch", "fused-onnxruntime" or "fused-openvino"
# (toolchain/export/moe.py); only in a graph with MoE layers
MOE_LOWERING = "dstc.moe_lowering"
ROTATIONS_PER_LAYER = "dstc.rotations_per_layer"  # tensors RoPE rotates in each layer (the passes' expectations)

LATENT = "latent"  # KV_CACHE's value for MLA's latent cache
