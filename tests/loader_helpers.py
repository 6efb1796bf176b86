"""The runtimes' own loaders and generation loops over an artifact (openvino_genai.LLMPipeline, optimum-intel's
OVModelForCausalLM in its own environment, onnxruntime-genai) and PyTorch's greedy tokens to compare them with, for
tests/compile/ and tests/export/test_mla_cache.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from toolchain.reference.whole import TorchDecoder
from toolchain.runtime.engines import NUMERICS
from toolchain.runtime.generate import greedy_logits
from toolchain.tokenizer_loading import load_tokenizer

F32 = NUMERICS["exact"]
NEW_TOKENS = 8
MESSAGES = [{"role": "user", "content": "12+345="}]


def reference_chat_tokens(source: Path, new_tokens: int = NEW_TOKENS) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids) of PyTorch fp32 on the chat-templated MESSAGES."""
    tok = load_tokenizer(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    tokens, _ = greedy_logits(TorchDecoder.over(model), [prompt], new_tokens, model.config.pad_token_id or 0)
    return prompt, tokens[0].tolist()


def genai_greedy(artifact: Path, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens from onnxruntime-genai's own generation loop over the artifact."""
    import onnxruntime_genai as og

    model = og.Model(str(artifact))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens,
                              min_length=len(prompt) + new_tokens)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array(prompt, np.int32))
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens


def llm_pipeline(artifact: Path, new_tokens: int = NEW_TOKENS, **properties):
    """openvino_genai's LLMPipeline on the artifact and a greedy generation config of exactly new_tokens."""
    import openvino_genai

    pipe = openvino_genai.LLMPipeline(str(artifact), "CPU", **properties)
    config = pipe.get_generation_config()
    config.max_new_tokens = config.min_new_tokens = new_tokens
    config.do_sample = False
    return pipe, config


# optimum-intel runs in an environment of its own (install.sh, requirements-optimum-intel.txt): it requires
# transformers<5.6 and does not import beside dstc's. DSTC_OPTIMUM_INTEL_PYTHON names another interpreter.
OPTIMUM_INTEL_PYTHON = Path(os.environ.get("DSTC_OPTIMUM_INTEL_PYTHON")
                            or Path(__file__).resolve().parents[1] / ".venv-optimum-intel" / "bin" / "python")
OPTIMUM_INTEL_GREEDY = """
import json, sys
sys.modules["openvino_telemetry"] = None  # as tests/conftest.py: its forks can stop OpenBLAS's threads
import torch
from optimum.intel import OVModelForCausalLM

artifact, prompt, new_tokens, ov_config = json.loads(sys.argv[1])
model = OVModelForCausalLM.from_pretrained(artifact, ov_config=ov_config)
ids = torch.tensor([prompt])
generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False)
print(json.dumps({"stateful": model.stateful, "tokens": generated[0, len(prompt):].tolist()}))
"""


def optimum_intel_python() -> str:
    """The interpreter that has optimum-intel: its own environment, or this one where it imports here (an
    environment with transformers<5.6); a skip that says so where neither has it."""
    if OPTIMUM_INTEL_PYTHON.is_file():
        return str(OPTIMUM_INTEL_PYTHON)
    try:
        from optimum.intel import OVModelForCausalLM  # noqa: F401
    except ImportError as e:  # not installed, or beside a transformers it does not import with
        pytest.skip(f"optimum-intel's environment {OPTIMUM_INTEL_PYTHON} is missing (./install.sh makes it), and "
                    f"optimum-intel does not import here: {str(e).splitlines()[0]}")
    return sys.executable


def optimum_intel_greedy(artifact: Path, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens from optimum-intel's OVModelForCausalLM.generate on the stateful IR, in optimum-intel's
    environment."""
    proc = subprocess.run([optimum_intel_python(), "-c", OPTIMUM_INTEL_GREEDY,
                           json.dumps([str(artifact), prompt, new_tokens, F32])], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["stateful"]
    return result["tokens"]


def pipeline_greedy(pipe, config, prompt: list[int]) -> list[int]:
    import openvino as ov
    import openvino_genai

    ids = np.array([prompt], np.int64)
    inputs = openvino_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
    return list(pipe.generate(inputs, config).tokens[0])
