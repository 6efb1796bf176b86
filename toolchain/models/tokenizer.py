"""The byte-level BPE tokenizer shared by the embedded models, trained on the corpus with DeepSeek's special tokens."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from toolchain.models import corpus

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT, "<think>", "</think>"]
VOCAB_SIZE = 640
TRAINING_TEXTS = 4000

# The shape of DeepSeek-R1's template, without tool calls: system prompt after BOS, turns marked by the role
# tokens, the reasoning before </think> dropped from past assistant turns, EOS closing each assistant turn.
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{% endif %}{% endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the tokenizer on train-split text and problems; deterministic for a given corpus."""
    tok = Tokenizer(models.BPE())
    # Digits are pre-split one by one so no merge can join them: arithmetic stays one token per digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus.text_samples("train", TRAINING_TEXTS) + ["".join(p) for p in corpus.task_examples("train", 500)]
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        add_bos_token=True,
        add_eos_token=False,
        additional_special_tokens=[USER, ASSISTANT, "<think>", "</think>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: Path) -> None:
    # The template goes into tokenizer_config.json, where DeepSeek's checkpoints (and most runtimes) keep it.
    tokenizer.save_pretrained(path, save_jinja_files=False)
