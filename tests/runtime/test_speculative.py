"""Speculative decoding (toolchain/runtime/speculative.py): the decoders' cache rollback, greedy output identical
to plain decoding with every drafter on both backends, speculative sampling's output distribution."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.stats import chisquare

from toolchain.models.corpus import task_examples
from toolchain.runtime.decoder import open_decoder
from toolchain.runtime.generate import greedy_generate
from toolchain.runtime.sampling import Sampling, distribution
from toolchain.runtime.speculative import (
    Acceptance,
    DraftModel,
    PromptLookup,
    speculative_steps,
    verify_sampled,
)
from toolchain.verify.parity import graph_decoder

BACKENDS = ("onnxruntime", "openvino")
LATENT, GQA = "deepseek-v3-tiny", "r1-distill-qwen-tiny"


def exact_decoder(art):
    """The artifact's decoder at exact numerics (fp32 compute and cache on both backends)."""
    return open_decoder(art, threads=2, openvino_f32=True)


def rolled_back_logits(decoder) -> tuple[np.ndarray, np.ndarray]:
    """Logits of positions 6-9 after positions 0-5, then again after a rollback to 6 (with other tokens fed and
    rolled back in between)."""
    ids = np.array([[5, 17, 3, 9, 40, 22, 8, 31, 12, 60]])
    ones = lambda n: np.ones((1, n), np.int64)  # noqa: E731
    decoder.reset()
    decoder.forward(ids[:, :6], ones(6), 0)
    first = decoder.forward(ids[:, 6:], ones(10), 0)
    decoder.rollback(6)
    decoder.forward(np.array([[50, 51, 52]]), ones(9), 0)
    decoder.rollback(6)
    return first, decoder.forward(ids[:, 6:], ones(10), 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", [LATENT, GQA])
def test_rollback_then_the_same_tokens_gives_the_same_logits(artifact, model, backend):
    first, again = rolled_back_logits(exact_decoder(artifact(model, backend)))
    assert first.shape == again.shape == (1, 4, first.shape[-1])
    np.testing.assert_array_equal(first, again)


def test_rollback_of_a_stateless_decoder_and_of_indexer_keys(artifact, tiny_checkpoints):
    """StatelessDecoder (the export's graph); DeepSeek-V3.2's indexer key cache beside its latent one, with 10
    positions crossing its index_topk (6), on both backends."""
    first, again = rolled_back_logits(graph_decoder(artifact(LATENT, "onnxruntime").path / "model.onnx",
                                                    "onnxruntime"))
    np.testing.assert_array_equal(first, again)
    for backend in BACKENDS:
        first, again = rolled_back_logits(exact_decoder(artifact(tiny_checkpoints["deepseek_v32"], backend)))
        np.testing.assert_array_equal(first, again)


def test_rollback_beyond_the_cache_is_refused(artifact):
    decoder = exact_decoder(artifact(GQA, "onnxruntime"))
    decoder.reset()
    decoder.forward(np.array([[5, 6, 7]]), np.ones((1, 3), np.int64), 1)
    with pytest.raises(ValueError, match="cannot keep 4 positions of a cache that holds 3"):
        decoder.rollback(4)


# -- greedy: identical tokens ---------------------------------------------------------------------------------


def prompts(art) -> list[list[int]]:
    """Held-out arithmetic problems after a solved one (a prompt where lookup finds n-grams), and a short one."""
    tokenizer = art.tokenizer()
    ex = task_examples("heldout", 3)
    return [tokenizer(ex[0][0] + ex[0][1] + "\n" + ex[1][0] + ex[1][1] + "\n" + ex[2][0])["input_ids"],
            tokenizer("12+345=")["input_ids"]]


def speculative(decoder, drafter, prompt, art, new_tokens: int, draft_tokens: int) -> tuple[list[int], Acceptance]:
    acceptance = Acceptance()
    tokens = [t for step in speculative_steps(decoder, drafter, prompt, max_new_tokens=new_tokens,
                                              stop_ids=set(art.eos_token_ids), draft_tokens=draft_tokens,
                                              acceptance=acceptance) for t in step]
    return tokens, acceptance


class Garbage:
    """Drafts tokens the model never chooses: the verify step rejects every one."""

    draft_probs = None

    def __init__(self, avoid: set[int]) -> None:
        self.avoid = avoid

    def reset(self) -> None:
        pass

    def propose(self, tokens, extras, k):
        return [next(t for t in range(3, 90) if t not in self.avoid)] * k

    def rollback(self, keep):
        pass


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", [LATENT, GQA])
def test_greedy_tokens_are_plain_decodings_with_every_drafter(artifact, model, backend):
    """Prompt lookup, a draft model (the other embedded model of the same tokenizer) and a drafter of garbage give
    plain greedy decoding's tokens, prompt by prompt, with draft lengths 1 and 4; garbage is never accepted."""
    art = artifact(model, backend)
    decoder = exact_decoder(art)
    other = artifact(GQA if model == LATENT else LATENT, backend)
    new_tokens = 24
    for prompt in prompts(art):
        plain = greedy_generate(decoder, [prompt], new_tokens, set(art.eos_token_ids), art.pad_token_id).tokens[0]
        assert plain
        draft_model = DraftModel(exact_decoder(other))
        for draft_tokens in (1, 4):
            for drafter in (PromptLookup(), draft_model, Garbage(set(plain))):
                tokens, acceptance = speculative(decoder, drafter, prompt, art, new_tokens, draft_tokens)
                assert tokens == plain, (type(drafter).__name__, draft_tokens)
                assert len(acceptance.proposed) <= draft_tokens
                if isinstance(drafter, Garbage):
                    assert sum(acceptance.proposed) > 0 and acceptance.rate == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", ["deepseek-v2-lite-tiny", "deepseek-v32-tiny", "deepseek-v4-tiny",
                                   "r1-distill-llama-tiny"])
def test_every_other_embedded_model_keeps_its_greedy_tokens(artifact, model, backend):
    """The other embedded models' caches (V2-Lite's latent, V3.2's indexer keys, V4's sliding window and
    compressors' per-token state, Llama's per-head keys) roll back exactly: prompt lookup and a drafter whose
    every draft is rejected give plain greedy decoding's tokens."""
    art = artifact(model, backend)
    decoder = exact_decoder(art)
    for prompt in prompts(art):
        plain = greedy_generate(decoder, [prompt], 24, set(art.eos_token_ids), art.pad_token_id).tokens[0]
        for draft_tokens in (1, 4):
            for drafter in (PromptLookup(), Garbage(set(plain))):
                tokens, acceptance = speculative(decoder, drafter, prompt, art, 24, draft_tokens)
                assert tokens == plain, (type(drafter).__name__, draft_tokens)
                assert sum(acceptance.proposed) > 0


@pytest.mark.parametrize("backend", [BACKENDS[0], pytest.param(BACKENDS[1], marks=pytest.mark.slow)])
def test_v4_s_compressed_cache_speculates_to_plain_greedy_tokens_with_its_mtp_block(artifact, backend):
    """deepseek-v4-tiny built with export.v4_cache: compressed and its trained MTP block: the main cache rolled back
    by replay (toolchain/runtime/cache_replay.py) gives plain greedy decoding's tokens with MTP drafts (1 and 3 a
    step, some accepted and some not), prompt lookup and drafts that are all rejected."""
    from toolchain.runtime.mtp_drafter import open_mtp_drafter

    art = artifact("deepseek-v4-tiny", backend, {"export": {"parity": [], "mtp": True, "v4_cache": "compressed"},
                                                 "compile": {"backend": backend, "verify": False}})
    decoder = open_decoder(art, threads=2, openvino_f32=True, extra_outputs=("hidden_states",))
    assert decoder.replays  # the compressed layout: no cut
    mtp = open_mtp_drafter(art, threads=2, openvino_f32=True)
    for prompt in prompts(art):
        plain = greedy_generate(decoder, [prompt], 24, set(art.eos_token_ids), art.pad_token_id).tokens[0]
        for draft_tokens, drafter in ((1, mtp), (3, mtp), (4, PromptLookup()), (4, Garbage(set(plain)))):
            tokens, acceptance = speculative(decoder, drafter, prompt, art, 24, draft_tokens)
            assert tokens == plain, (type(drafter).__name__, draft_tokens)
            assert acceptance.rate is not None and (acceptance.rate == 0) == isinstance(drafter, Garbage)
            if drafter is mtp:  # rejections beside acceptances: rollbacks that replay some positions
                assert 0 < acceptance.rate < 1


def test_prompt_lookup_drafts_what_followed_the_longest_suffix_match():
    lookup = PromptLookup(max_ngram=3)
    assert lookup.propose([1, 2, 3, 4, 5, 9, 2, 3, 7, 7, 2, 3], {}, 2) == [4, 5]  # "2 3": first occurrence
    assert lookup.propose([1, 2, 3, 8, 5, 6, 1, 2, 3, 4, 9, 1, 2, 3], {}, 3) == [8, 5, 6]  # "1 2 3"
    assert lookup.propose([4, 5, 6, 1, 2, 3, 6, 5, 3], {}, 4) == [6, 5, 3]  # "3" only; runs up to the end
    assert lookup.propose([1, 2, 3], {}, 4) == []


def test_acceptance_counts_per_position():
    acceptance = Acceptance()
    acceptance.add(3, 1)
    acceptance.add(2, 2)
    acceptance.add(0, 0)
    assert acceptance.proposed == [2, 2, 1] and acceptance.accepted == [2, 1, 0] and acceptance.steps == 3
    assert acceptance.rates == [1.0, 0.5, 0.0] and acceptance.rate == 3 / 5


# -- sampling: the target distribution ------------------------------------------------------------------------


@pytest.mark.parametrize("deterministic", [False, True])
def test_speculative_sampling_follows_the_target_distribution(deterministic):
    """Over 20000 seeded draws of one step with two drafts, the first token (the first draft if accepted, else
    the residual's draw) follows the target p, not the draft q; so does the second token when the first draft was
    accepted. Chi-square against p; the same test against q fails. A deterministic drafter has q one-hot."""
    rng = np.random.default_rng(0)
    sampling = Sampling(temperature=0.8)
    target = distribution(np.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5]), sampling)
    draft = distribution(np.array([0.0, 1.5, 2.0, 0.5, 0.0, -1.0]), sampling)
    targets = np.stack([target, target[::-1], target])
    draws = 20000
    first, second = np.zeros(6), np.zeros(6)
    for _ in range(draws):
        drafts = [int(rng.choice(6, p=draft)) for _ in range(2)]
        if deterministic:
            drafts = [2, 1]
        accepted, token = verify_sampled(drafts, None if deterministic else [draft, draft], targets, rng)
        emitted = [*drafts[:accepted], token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    assert chisquare(first, target * draws).pvalue > 1e-3
    assert chisquare(second, target[::-1] * second.sum()).pvalue > 1e-3
    assert chisquare(first, draft * draws).pvalue < 1e-12


def test_sampling_with_the_main_model_as_its_own_draft_accepts_every_draft(artifact):
    """q = p at every position (the same model drafts, up to the float difference of one position per forward
    against five): speculative sampling accepts all but a negligible fraction; with a fixed seed the answer is
    reproduced."""
    art = artifact(LATENT, "onnxruntime")
    sampling = Sampling(temperature=1.0, seed=7)
    runs = []
    for _ in range(2):
        acceptance = Acceptance()
        drafter = DraftModel(exact_decoder(art), sampling, np.random.default_rng(8))
        runs.append([t for step in speculative_steps(exact_decoder(art), drafter, prompts(art)[0], max_new_tokens=40,
                                                     stop_ids=set(), draft_tokens=4, acceptance=acceptance,
                                                     sampling=sampling) for t in step])
        assert len(runs[-1]) == 40 and sum(acceptance.proposed) >= 20
        assert acceptance.rate is not None and acceptance.rate >= 0.95, acceptance.summary()
    assert runs[0] == runs[1]


# -- dstc generate --------------------------------------------------------------------------------------------


def test_generate_speculates_to_the_same_text_and_reports_acceptance(artifact, monkeypatch, capsys, tiny_checkpoints):
    from tests.conftest import run_cli

    art = artifact(GQA, "onnxruntime")
    draft = artifact(LATENT, "openvino")
    prompt = art.tokenizer().decode(prompts(art)[0], skip_special_tokens=True)
    common = [art.path, prompt, "--raw", "--new-tokens", "20"]
    code, plain, _ = run_cli(monkeypatch, capsys, "generate", *common)
    assert code == 0 and plain.strip()
    for method in ("prompt-lookup", f"draft:{draft.path}"):
        code, out, err = run_cli(monkeypatch, capsys, "generate", *common, "--speculate", method, "--draft-tokens", 3)
        assert (code, out) == (0, plain)
        assert "acceptance per draft position" in err
        code, out, _ = run_cli(monkeypatch, capsys, "generate", *common, "--speculate", method, "--json")
        record = json.loads(out)
        assert code == 0 and record["text"] + "\n" == plain
        spec = record["speculation"]
        assert spec["method"] == method and spec["draft_tokens"] == 4 and len(spec["proposed_per_position"]) <= 4
        assert spec["acceptance_per_position"] == pytest.approx(
            [a / p for a, p in zip(spec["accepted_per_position"], spec["proposed_per_position"])], abs=1e-6)
    code, out, _ = run_cli(monkeypatch, capsys, "generate", *common, "--json")
    assert code == 0 and json.loads(out)["speculation"] is None and json.loads(out)["text"] + "\n" == plain
    no_tokenizer = artifact(tiny_checkpoints["deepseek_v32"], "onnxruntime")
    for bad, message in (("bogus", "--speculate: 'bogus' is not"), (f"draft:{no_tokenizer.path}", "tokenizer")):
        code, out, err = run_cli(monkeypatch, capsys, "generate", *common, "--speculate", bad)
        assert code == 2 and out == "" and message in err and err.count("\n") == 1


def test_a_rejection_where_p_and_q_differ_only_by_rounding_draws_from_p():
    """q above p at the draft by rounding alone and the uniform draw at its top: rejected, and the residual
    (zero everywhere) falls back to p instead of dividing by zero."""

    class Top:
        def __init__(self) -> None:
            self.rng = np.random.default_rng(0)

        def random(self) -> float:
            return 1 - 1e-16

        def choice(self, n, p):
            return self.rng.choice(n, p=p)

    p = np.array([0.5, 0.5 - 1e-12, 0.0])  # p <= q everywhere: max(p - q, 0) is zero
    q = np.array([0.5 + 1e-12, 0.5 - 1e-12, 0.0])
    rng = Top()
    draws = [verify_sampled([0], [q], np.stack([p, p]), rng) for _ in range(200)]  # type: ignore[arg-type]
    assert all(accepted == 0 for accepted, _ in draws)
    assert {token for _, token in draws} == {0, 1}
