"""The peers' side of benchmarks/peer_fidelity.py: run by the peer environment's python (benchmarks/peer_env.sh),
never imported by dstc's, so that the peers' transformers, optimum-intel and llama.cpp stay in their own process.

    ENV/bin/python benchmarks/peer_worker.py COMMAND ARGS...

Commands (paths are arguments; JSON in files, arrays out as .npy):

* ``optimum-awq SRC OUT CALIBRATION_JSON``: optimum-intel's data-aware INT4 (``--awq --scale-estimation`` with its
  CLI defaults otherwise: asymmetric, group 128, ratio 1.0) through its Python API, the calibration texts given as a
  list of strings; the IR is saved in OUT.
* ``convert-gguf CONVERTER SRC OUT``: llama.cpp's convert_hf_to_gguf.py to an f32 GGUF (see ``convert_gguf``).
* ``tokenize-gguf GGUF TEXT_FILE HF_DIR``: llama.cpp's token ids of the file beside transformers' (JSON to stdout).
* ``ov-logits IR_DIR SEQUENCES_JSON OUT_NPY``: an OpenVINO IR's logits at every position of each sequence.
* ``gguf-logits GGUF SEQUENCES_JSON OUT_NPY THREADS``: llama.cpp's logits at every position.
* ``hf-logits SRC SEQUENCES_JSON OUT_NPY``: transformers' fp32 logits (of this environment's transformers), to check
  that the checkpoint as rewritten for it is the model dstc's reference runs.
* ``gguf-tensors GGUF``: each tensor's name, type, shape, element count and bytes (JSON to stdout).

Logits of one sequence are [len, vocab] float32; all sequences are concatenated along the first axis.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

# The embedded models share one stand-in tokenizer (toolchain/models/tokenizer.py): its pre-tokenizer splits digits
# one by one and then applies the GPT-2 byte-level regex, which llama.cpp's "qwen2" pre-tokenizer does as well
# (checked per build: ``tokenize-gguf``). The converter does not know the tokenizer by its hash.
PRE_TOKENIZER = "qwen2"


def optimum_awq(src: str, out: str, calibration: str) -> None:
    from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig

    texts = json.loads(Path(calibration).read_text())
    config = OVWeightQuantizationConfig(bits=4, sym=False, group_size=128, ratio=1.0, quant_method="awq",
                                        scale_estimation=True, dataset=texts, tokenizer=src, num_samples=len(texts))
    model = OVModelForCausalLM.from_pretrained(src, export=True, quantization_config=config, compile=False)
    model.save_pretrained(out)


def convert_gguf(converter: str, src: str, out: str) -> None:
    """f32 output: the checkpoint is fp32, and Q4_K_M is then quantized from the exact weights."""
    import runpy

    sys.path.insert(0, str(Path(converter).parent))
    from conversion import base  # llama.cpp's converter package, beside the script

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            print(f"tokenizer hash unknown to llama.cpp: pre-tokenizer {PRE_TOKENIZER!r} written", file=sys.stderr)
            return PRE_TOKENIZER
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [converter, src, "--outtype", "f32", "--outfile", out]
    runpy.run_path(converter, run_name="__main__")


_log_callbacks: list = []  # llama.cpp keeps calling the one given: it must outlive the model


def _llama_model(path: str, n_ctx: int, threads: int):
    import llama_cpp.llama_cpp as lc

    @lc.llama_log_callback
    def errors_only(level: int, text: bytes, user_data) -> None:
        if level == 4:  # GGML_LOG_LEVEL_ERROR
            sys.stderr.write(text.decode(errors="replace"))
    _log_callbacks.append(errors_only)
    lc.llama_log_set(errors_only, None)
    lc.llama_backend_init()
    params = lc.llama_model_default_params()
    params.use_extra_bufts = False  # no repacked (AMX / AVX-512) weight buffers: one crashed on this kind of machine
    model = lc.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    ctx_params = lc.llama_context_default_params()
    ctx_params.n_ctx = ctx_params.n_batch = ctx_params.n_ubatch = n_ctx
    ctx_params.n_threads = ctx_params.n_threads_batch = threads
    # f32 throughout: an f32 KV cache (f16 by default) and no flash attention (f16 internally on CPU)
    ctx_params.type_k = ctx_params.type_v = lc.GGML_TYPE_F32
    ctx_params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = lc.llama_init_from_model(model, ctx_params)
    if not ctx:
        raise SystemExit(f"llama.cpp could not create a context for {path}")
    return lc, model, ctx


def gguf_logits(path: str, sequences: str, out: str, threads: str) -> None:
    seqs = json.loads(Path(sequences).read_text())
    lc, model, ctx = _llama_model(path, max(len(s) for s in seqs), int(threads))
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    rows = []
    for seq in seqs:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        batch = lc.llama_batch_init(len(seq), 0, 1)
        for i, token in enumerate(seq):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(seq)
        status = lc.llama_decode(ctx, batch)
        if status != 0:
            raise SystemExit(f"llama_decode returned {status}")
        rows.append(np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(len(seq) * vocab,))
                     .reshape(len(seq), vocab).copy())
        lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    np.save(out, np.concatenate(rows).astype(np.float32))


def tokenize_gguf(path: str, text_file: str, hf_dir: str) -> None:
    from transformers import AutoTokenizer

    text = Path(text_file).read_text()
    lc, model, _ctx = _llama_model(path, 64, 1)
    vocab = lc.llama_model_get_vocab(model)
    data = text.encode()
    buffer = (lc.llama_token * (len(data) + 8))()
    n = lc.llama_tokenize(vocab, data, len(data), buffer, len(buffer), True, False)
    theirs = AutoTokenizer.from_pretrained(hf_dir)(text)["input_ids"]
    print(json.dumps({"llamacpp": list(buffer[:n]), "transformers": theirs}))


def ov_logits(ir_dir: str, sequences: str, out: str) -> None:
    """Plain OpenVINO on optimum's stateful IR: f32 compute, an f32 KV cache, no dynamic activation quantization
    (dstc's "exact" numerics, toolchain/runtime/engines.py), the whole sequence in one request."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(Path(ir_dir) / "openvino_model.xml"))
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
                                                 "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"})
    request = compiled.create_infer_request()
    names = {port.get_any_name() for port in compiled.inputs}
    rows = []
    for seq in json.loads(Path(sequences).read_text()):
        request.reset_state()
        ids = np.asarray([seq], dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        if "position_ids" in names:
            feed["position_ids"] = np.arange(len(seq), dtype=np.int64)[None]
        if "beam_idx" in names:
            feed["beam_idx"] = np.zeros(1, dtype=np.int32)
        request.infer(feed)
        rows.append(np.array(request.get_tensor("logits").data[0], dtype=np.float32))
    np.save(out, np.concatenate(rows))


def hf_logits(src: str, sequences: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32, attn_implementation="eager").eval()
    rows = []
    with torch.no_grad():
        for seq in json.loads(Path(sequences).read_text()):
            rows.append(model(torch.tensor([seq])).logits[0].float().numpy())
    np.save(out, np.concatenate(rows))


def gguf_tensors(path: str) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    print(json.dumps([{"name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in t.shape],
                       "elements": int(t.n_elements), "bytes": int(t.n_bytes)} for t in reader.tensors]))


COMMANDS = {"optimum-awq": optimum_awq, "convert-gguf": convert_gguf, "tokenize-gguf": tokenize_gguf,
            "ov-logits": ov_logits, "gguf-logits": gguf_logits, "hf-logits": hf_logits, "gguf-tensors": gguf_tensors}

if __name__ == "__main__":
    COMMANDS[sys.argv[1]](*sys.argv[2:])
