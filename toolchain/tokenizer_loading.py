"""A checkpoint's (or artifact's) Hugging Face tokenizer, loaded as its files describe it."""

from __future__ import annotations

import json
from pathlib import Path

# The class names under which a tokenizer_config.json asks for tokenizer.json as it is, with no model's own class
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
# transformers' key of its "Token indices sequence length is longer than the specified maximum" warning
LONG_TEXT_WARNING = "sequence-length-is-longer-than-the-specified-maximum"


def load_tokenizer(path: Path):
    """The Hugging Face tokenizer of the checkpoint (or artifact) at ``path``. One that names the generic class
    (GENERIC_TOKENIZERS: the embedded models', and the stand-in of the shape-faithful ones) is loaded by it, so that
    tokenizer.json runs as written: transformers 5.24's AutoTokenizer gives every qwen2 checkpoint Qwen2Tokenizer,
    which puts Qwen2's own pre-tokenizer in place of the file's and adds <|endoftext|> beyond the model's
    vocabulary. Any other goes through AutoTokenizer, which picks its class."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_file = Path(path) / "tokenizer_config.json"
    declared = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    if declared in GENERIC_TOKENIZERS and (Path(path) / "tokenizer.json").is_file():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    # dstc measures a text against the model's context itself (a prompt: one line, exit 2; eval's data: cut into
    # windows): transformers' warning of a text longer than model_max_length, printed before that line, is marked as
    # given, as transformers does after printing it once
    tokenizer.deprecation_warnings[LONG_TEXT_WARNING] = True
    return tokenizer
