"""toolchain.evaluate.harness: lm-eval's standard tasks, with their data from local files in the tasks' own schemas
(made from the embedded held-out corpus), scored through dstc's adapter on the PyTorch reference and on an ONNX
Runtime fp32 artifact, against lm-eval's own HFLM (transformers, fp32, eager) on the same checkpoint; bad task
names, missing files and sampling are InputErrors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from toolchain import source as sources
from toolchain.build import build
from toolchain.errors import InputError
from toolchain.evaluate import harness
from toolchain.evaluate.harness import DecoderLM, evaluate_lm, score_tasks
from toolchain.models.corpus import _NAMES, _VERBS_OBJ, task_examples, text_samples
from toolchain.reference.whole import TorchDecoder
from toolchain.runtime.artifact import open_artifact
from toolchain.runtime.decoder import open_decoder
from toolchain.tokenizer_loading import load_tokenizer

MODEL = "r1-distill-qwen-tiny"
CONTEXT = 1024  # the model's max_position_embeddings
TRAINED = 64  # the length of its training rows: wikitext's rolling windows, several per page
LIMIT = 40
TASKS = ["arc_easy", "reversed_words"]  # multiple choice (loglikelihood), generate_until
ROLLING = ["wikitext"]  # loglikelihood_rolling


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> Path:
    """Held-out corpus items in three standard tasks' schemas:

    * arc_easy (allenai/ai2_arc): a held-out text less its last word; the choices are that word, the last word of
      another text (a fit the model cannot tell apart), a name and a verb (which no template puts there): the
      model is right about half the time, chance is a quarter;
    * reversed_words (EleutherAI/unscramble; a raw prompt, greedy until a newline, exact match): half arithmetic
      problems (the model solves them), half texts to finish with their last word (it often misses);
    * wikitext (EleutherAI/wikitext_document_level): pages of ten held-out texts.
    """
    root = tmp_path_factory.mktemp("tasks")
    rng = random.Random(0)
    texts = text_samples("heldout", 100)
    ends = [text.rsplit(" ", 1)[1] for text in texts]
    labels = ["A", "B", "C", "D"]
    questions = []
    for i, text in enumerate(texts):
        question, answer = text.rsplit(" ", 1)
        wrong = {rng.choice(ends), rng.choice(_NAMES) + ".", rng.choice(_VERBS_OBJ) + "."} - {answer}
        while len(wrong) < 3:
            wrong = (wrong | {rng.choice(ends)}) - {answer}
        choices = sorted([answer, *wrong])
        rng.shuffle(choices)
        questions.append({"id": f"heldout-{i}", "question": question,
                          "choices": {"text": choices, "label": labels},
                          "answerKey": labels[choices.index(answer)]})
    write_jsonl(root / "arc_easy" / "test.jsonl", questions)
    completions = [{"context": prompt, "completion": answer} for prompt, answer in task_examples("heldout", 50)]
    completions += [{"context": text.rsplit(" ", 1)[0], "completion": " " + text.rsplit(" ", 1)[1]}
                    for text in texts[:50]]
    rng.shuffle(completions)
    write_jsonl(root / "reversed_words" / "validation.jsonl", completions)
    write_jsonl(root / "wikitext" / "test.jsonl", [{"page": " ".join(texts[i:i + 10])} for i in range(0, 100, 10)])
    return root


def dstc_scores(decoder, tokenizer, task_data: Path) -> dict:
    return {**score_tasks(decoder, tokenizer, TASKS, task_data, max_length=CONTEXT, limit=LIMIT, num_fewshot=0),
            **score_tasks(decoder, tokenizer, ROLLING, task_data, max_length=TRAINED, limit=LIMIT)}


@pytest.fixture(scope="module")
def hflm():
    """lm-eval's own HFLM(max_length) on the embedded checkpoint: transformers, fp32, eager attention."""
    import torch
    from lm_eval.models.huggingface import HFLM

    def make(max_length: int):
        path = sources.resolve(MODEL).path
        # the tokenizer as the checkpoint ships it, as dstc loads it (AutoTokenizer gives a qwen2 model Qwen2's)
        lm = HFLM(pretrained=str(path), tokenizer=load_tokenizer(path), dtype="float32",
                  attn_implementation="eager", device="cpu", batch_size=8, max_length=max_length)
        assert lm.model.config._attn_implementation == "eager" and lm.model.dtype == torch.float32
        return lm

    return make


@pytest.fixture(scope="module")
def hflm_scores(hflm, task_data) -> dict:
    return {**evaluate_lm(hflm(CONTEXT), TASKS, task_data, limit=LIMIT, num_fewshot=0),
            **evaluate_lm(hflm(TRAINED), ROLLING, task_data, limit=LIMIT)}


@pytest.fixture(scope="module")
def reference():
    """The fp32 PyTorch reference as a Decoder, and the checkpoint's tokenizer."""
    source = sources.resolve(MODEL)
    return TorchDecoder(source), load_tokenizer(source.path)


@pytest.fixture(scope="module")
def reference_scores(reference, task_data) -> dict:
    return dstc_scores(*reference, task_data)


@pytest.fixture(scope="module")
def ort_artifact(tmp_path_factory, stage_cache):
    root = tmp_path_factory.mktemp("harness")
    recipe = root / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "t", "model": MODEL, "export": {"parity": []},
                                      "compile": {"backend": "onnxruntime", "verify": False}}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSTC_CACHE_DIR", str(stage_cache))
        build(recipe, root / "art")
    return open_artifact(root / "art")


def table(title: str, ours: dict, theirs: dict, against: str) -> None:
    print(f"\n{title}")
    for task, scores in ours.items():
        for key, value in scores["metrics"].items():
            error = theirs[task]["stderr"][key]
            print(f"  {task:15s} {key:28s} dstc {value:.6f}  {against} {theirs[task]['metrics'][key]:.6f}"
                  + (f"  stderr {error:.4f}" if error is not None else "") + f"  (n={scores['samples']})")


def assert_agree(ours: dict, theirs: dict) -> None:
    """Every metric within lm-eval's standard error of the other side's; perplexities (no standard error) within
    1e-4 relative."""
    assert ours.keys() == theirs.keys()
    for task in ours:
        assert ours[task]["samples"] == theirs[task]["samples"] == min(LIMIT, ours[task]["samples_total"])
        assert ours[task]["metrics"].keys() == theirs[task]["metrics"].keys()
        for key, value in ours[task]["metrics"].items():
            expected, error = theirs[task]["metrics"][key], theirs[task]["stderr"][key]
            if error is None:
                assert value == pytest.approx(expected, rel=1e-4), (task, key)
            else:
                assert abs(value - expected) <= error, (task, key, value, expected, error)


def test_reference_through_dstc_scores_as_lm_evals_own_hflm(reference_scores, hflm_scores):
    table("dstc (TorchDecoder) vs lm-eval HFLM", reference_scores, hflm_scores, "hflm")
    assert_agree(reference_scores, hflm_scores)
    # Well above chance (a quarter on four choices; no exact match), so that the agreement is not that of two
    # models guessing.
    arc, words = hflm_scores["arc_easy"], hflm_scores["reversed_words"]
    assert arc["metrics"]["acc,none"] > 0.25 + 2 * arc["stderr"]["acc,none"]
    assert 0.2 < words["metrics"]["exact_match,none"] < 0.9
    assert 1.5 < hflm_scores["wikitext"]["metrics"]["word_perplexity,none"] < 100


def test_loglikelihoods_equal_hflms_request_by_request(reference, hflm):
    """Raw requests, as a task would send them: an empty context (the prefix token instead), continuations that
    share all but their last token (one forward answers them), a context cut to fit the model's length."""
    from lm_eval.api.instance import Instance

    pairs = [("", "Alice found the red book."), ("Bruno walked to", " the market."), ("Bruno walked to", " the"),
             ("Bruno walked to the", " market."), ("321+654=", "9750"), ("321+654=", "9751"),
             ("Chen gave Dana three apples. " * 20, "Alice found the red book.")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    ours = DecoderLM(*reference, max_length=TRAINED, batch=3).loglikelihood(requests)
    lm = hflm(TRAINED)
    # HFLM is asked for the fourth request alone: beside the second (the same tokens, split one token later) its
    # logits cache scores it on the second's first positions instead of its last ones (lm-eval 0.4.13 gathers the
    # continuation's log-probabilities without the trailing slice it applies to the greedy check).
    theirs = lm.loglikelihood(requests[:3] + requests[4:])
    theirs.insert(3, lm.loglikelihood(requests[3:4])[0])
    for (value, greedy), (expected, expected_greedy) in zip(ours, theirs):
        assert value == pytest.approx(expected, rel=1e-5, abs=1e-4) and greedy == expected_greedy
    assert [greedy for _, greedy in ours[4:6]] == [True, False]  # the model adds; its sum is the greedy one


def test_generations_equal_hflms_text_for_text(reference, hflm):
    """generate_until as gsm8k asks it (its prompt and stop strings; cut at max_gen_toks), until a newline, and
    until the first of two stop strings: HFLM's texts, in batches of requests of different lengths."""
    from lm_eval.api.instance import Instance

    gsm8k = {"until": ["Question:", "</s>", "<|im_end|>"], "do_sample": False, "temperature": 0.0, "max_gen_toks": 48}
    problems = task_examples("heldout", 6)
    requests = [Instance("generate_until", {}, (f"Question: {q}\nAnswer:", gsm8k), i) for i, (q, _) in
                enumerate(problems)]
    requests += [Instance("generate_until", {}, (q, {"until": ["\n"]}), 10 + i) for i, (q, _) in enumerate(problems)]
    requests.append(Instance("generate_until", {}, ("Alice walked to", {"until": [".", "market"], "max_gen_toks": 16}),
                             20))
    ours = DecoderLM(*reference, max_length=CONTEXT, batch=4).generate_until(requests)
    assert ours == hflm(CONTEXT).generate_until(requests)
    assert ours[6:12] == [answer for _, answer in problems]
    assert all(len(reference[1](text)["input_ids"]) > 30 for text in ours[:6])  # no stop string: up to 48 tokens


def test_onnxruntime_artifact_scores_as_the_reference(ort_artifact, task_data, reference_scores, monkeypatch):
    """The fp32 artifact's scores within the standard error of the reference's; with a few positions' logits per
    forward (LOGIT_ROWS), its rolling windows go through the KV cache in pieces, to the same perplexities."""
    monkeypatch.setattr(harness, "LOGIT_ROWS", 16)
    ours = dstc_scores(open_decoder(ort_artifact), ort_artifact.tokenizer(), task_data)
    table("dstc (ONNX Runtime fp32 artifact) vs dstc (TorchDecoder)", ours, reference_scores, "reference")
    assert_agree(ours, reference_scores)


def test_fewshot_examples_come_from_the_train_split(tmp_path, task_data, reference, hflm):
    """arc_easy with two examples before each question, drawn from train.jsonl (train-split texts) by lm-eval's
    seeded sampler: the same prompts, so the same scores, through dstc and HFLM."""
    (tmp_path / "arc_easy").mkdir()
    (tmp_path / "arc_easy" / "test.jsonl").write_text((task_data / "arc_easy" / "test.jsonl").read_text())
    write_jsonl(tmp_path / "arc_easy" / "train.jsonl", [
        {"id": f"train-{i}", "question": text.rsplit(" ", 1)[0],
         "choices": {"text": [text.rsplit(" ", 1)[1], "Alice."], "label": ["A", "B"]}, "answerKey": "A"}
        for i, text in enumerate(text_samples("train", 20))])
    ours = score_tasks(*reference, ["arc_easy"], tmp_path, max_length=CONTEXT, limit=12, num_fewshot=2)
    theirs = evaluate_lm(hflm(CONTEXT), ["arc_easy"], tmp_path, limit=12, num_fewshot=2)
    table("arc_easy 2-shot: dstc (TorchDecoder) vs lm-eval HFLM", ours, theirs, "hflm")
    assert ours["arc_easy"]["num_fewshot"] == theirs["arc_easy"]["num_fewshot"] == 2
    assert ours["arc_easy"]["metrics"] == theirs["arc_easy"]["metrics"]


def test_parquet_task_data_scores_as_jsonl(tmp_path, task_data, reference):
    import pandas as pd

    rows = pd.read_json(task_data / "arc_easy" / "test.jsonl", lines=True)
    (tmp_path / "arc_easy").mkdir()
    rows.to_parquet(tmp_path / "arc_easy" / "test.parquet")
    parquet = score_tasks(*reference, ["arc_easy"], tmp_path, max_length=CONTEXT, limit=8)
    jsonl = score_tasks(*reference, ["arc_easy"], task_data, max_length=CONTEXT, limit=8)
    assert parquet["arc_easy"]["metrics"] == jsonl["arc_easy"]["metrics"]
    assert parquet["arc_easy"]["samples_total"] == jsonl["arc_easy"]["samples_total"] == 100
    # One format per task: its splits are read by one builder.
    rows.head(10).to_json(tmp_path / "arc_easy" / "train.jsonl", orient="records", lines=True)
    with pytest.raises(InputError, match="its splits mix JSON and Parquet files"):
        score_tasks(*reference, ["arc_easy"], tmp_path, max_length=CONTEXT, num_fewshot=1)


def test_missing_task_data_names_the_file_expected(tmp_path, reference):
    (tmp_path / "arc_easy").mkdir()
    with pytest.raises(InputError, match=r"task arc_easy: no test split: expected .*/arc_easy/test\.jsonl .*"
                                         r"in the schema of allenai/ai2_arc \(ARC-Easy\)"):
        score_tasks(*reference, ["arc_easy"], tmp_path, max_length=CONTEXT)
    # gsm8k shows 5 examples by default: from its train split, which then has to be there too.
    write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": "1+1=", "answer": "2\n#### 2"}])
    with pytest.raises(InputError, match=r"task gsm8k: no train split \(its 5-shot examples\): expected "
                                         r".*/gsm8k/train\.jsonl"):
        score_tasks(*reference, ["gsm8k"], tmp_path, max_length=CONTEXT)
    with pytest.raises(InputError, match="is not a directory"):
        score_tasks(*reference, ["gsm8k"], tmp_path / "nowhere", max_length=CONTEXT)


def test_task_data_not_in_the_tasks_schema_is_an_input_error(tmp_path, reference):
    write_jsonl(tmp_path / "arc_easy" / "test.jsonl", [{"text": "Alice found the red book."}])
    with pytest.raises(InputError, match=r"task arc_easy: its data \(.*/arc_easy/test\.jsonl\) does not load: "
                                         r"'question' is undefined"):
        score_tasks(*reference, ["arc_easy"], tmp_path, max_length=CONTEXT)
    (tmp_path / "arc_easy" / "test.jsonl").write_text('{"question": "Where was the book?", \n')
    with pytest.raises(InputError, match=r"test\.jsonl\) does not load: JSON parse error"):
        score_tasks(*reference, ["arc_easy"], tmp_path, max_length=CONTEXT)


def test_unknown_task_is_an_input_error(tmp_path, reference):
    with pytest.raises(InputError, match=r"unknown lm-eval task 'arc_eazy'; close: arc_easy"):
        score_tasks(*reference, ["arc_eazy"], tmp_path, max_length=CONTEXT)


def test_sampling_is_refused(reference):
    from lm_eval.api.instance import Instance

    lm = DecoderLM(*reference, max_length=CONTEXT)
    for settings, refused in [({"until": ["\n"], "do_sample": True, "temperature": 0.7}, "sampling"),
                              ({"until": ["\n"], "temperature": 0.7}, "sampling"),
                              ({"until": ["\n"], "num_beams": 4}, "beam search"),
                              ({"until": ["\n"], "repetition_penalty": 1.3}, "repetition_penalty")]:
        with pytest.raises(InputError, match=refused):
            lm.generate_until([Instance("generate_until", {}, ("321+654=", settings), 0)])
    greedy = {"until": ["\n"], "do_sample": False, "temperature": 0.0, "top_p": 1.0, "max_gen_toks": 8}
    assert lm.generate_until([Instance("generate_until", {}, ("321+654=", greedy), 0)]) == ["9750"]
