"""The one count of a model's parameters that dstc gives everywhere."""

from __future__ import annotations


def parameter_count(model) -> int:
    """What dstc calls a model's parameters wherever it gives them (README, training.json, `dstc models list`, the
    export's log and export.json): the module's parameters, a tied table once. Buffers are not counted:
    DeepSeek-V3's e_score_correction_bias (n_routed_experts per MoE layer) is in its checkpoint but is set by the
    load balancing, not trained (the embedded deepseek-v3-tiny's checkpoint holds 32 such values besides its
    1,241,248 parameters)."""
    return sum(p.numel() for p in model.parameters())
