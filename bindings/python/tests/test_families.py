"""The options of the public looped families from Python (docs/MODELS.md): Ouro's adaptive exit
(``exit_threshold``, ``exit``, ``exit_policy``, the exit statistics, and scoring with an exit
rule) on the `tiny-sandwich` preset, and Huginn's initial state (``state_init``) on
`tiny-recurrent`. The Rust tests (tests/hf.rs, src/generate/exit.rs) check the numerics; here the
binding's plumbing, and scores checked against generation and plain scoring: exactly on the CPU,
where the two paths run the same block applications in the same order."""

import os

import numpy as np
import pytest

import tinyloop_py
from conftest import PROMPT

DEVICE = os.environ.get("TINYLOOP_TEST_DEVICE", "cpu")


def _open(path, **kwargs):
    return tinyloop_py.Model(path, max_seq_len=256, device=DEVICE, log=False, **kwargs)


@pytest.fixture
def sandwich(sandwich_model_path):
    m = _open(sandwich_model_path)
    yield m
    m.close()


def _check_exit_stats(runner, n_tokens, default_loops):
    stats = runner.last_generate_stats()
    assert stats["tokens"] == n_tokens
    assert stats["exit_tokens"] == n_tokens
    assert 1 <= stats["exit_mean_steps"] <= default_loops


def test_an_exit_threshold_reports_every_token_s_exit_iteration(sandwich):
    default_loops = sandwich.config()["default_loops"]
    assert default_loops == 4
    sandwich.generate(PROMPT, max_tokens=12)
    stats = sandwich.last_generate_stats()
    assert (stats["exit_tokens"], stats["exit_mean_steps"]) == (0, 0.0), "no rule, no exits"
    out = sandwich.generate(PROMPT, max_tokens=12, exit_threshold=0.5)
    assert len(out) == 12
    _check_exit_stats(sandwich, len(out), default_loops)
    # "gate:T" is the same rule; streaming and a session give the same tokens.
    np.testing.assert_array_equal(sandwich.generate(PROMPT, max_tokens=12, exit="gate:0.5"), out)
    streamed = list(sandwich.generate_stream(PROMPT, max_tokens=12, exit_threshold=0.5))
    assert streamed == out.tolist()
    _check_exit_stats(sandwich, len(out), default_loops)
    with sandwich.new_session() as s:
        np.testing.assert_array_equal(s.generate(PROMPT, max_tokens=12, exit_threshold=0.5), out)
        _check_exit_stats(s, len(out), default_loops)


def test_the_skip_policy(sandwich):
    out = sandwich.generate(PROMPT, max_tokens=12, exit_threshold=0.5, exit_policy="skip")
    assert len(out) == 12
    _check_exit_stats(sandwich, len(out), 4)
    with sandwich.new_session() as s:
        streamed = s.generate_stream(
            PROMPT, max_tokens=12, exit="gate:0.5", exit_policy="skip"
        )
        assert list(streamed) == out.tolist()
        _check_exit_stats(s, len(out), 4)


def test_speculation_and_prefix_caches_take_the_exit_gate(sandwich):
    out = sandwich.generate(PROMPT, max_tokens=12, exit="gate:0.5")
    stats = sandwich.last_generate_stats()
    assert stats["exit_mean_steps"] < 4, "some tokens exit early"
    expected = (out.tolist(), stats["exit_tokens"], stats["exit_mean_steps"])
    for reuse in (True, False):
        drafted = sandwich.generate_speculative(
            PROMPT, draft_loops=2, draft_len=3, reuse=reuse, max_tokens=12, exit="gate:0.5"
        )
        s = sandwich.last_generate_stats()
        assert (drafted.tolist(), s["exit_tokens"], s["exit_mean_steps"]) == expected
        assert s["drafted"] > 0
    cache = sandwich.build_prefix_cache(PROMPT[:3])
    after = sandwich.generate(PROMPT[3:], max_tokens=12, exit="gate:0.5", prefix_cache=cache)
    s = sandwich.last_generate_stats()
    assert (after.tolist(), s["exit_tokens"], s["exit_mean_steps"]) == expected
    # A verify step checks several tokens at once: no criterion, no skip.
    refused = (
        ({"exit": "kl:0.5"}, "not a criterion"),
        ({"exit": "gate:0.5", "exit_policy": "skip"}, "exit_policy reference"),
    )
    for kwargs, match in refused:
        with pytest.raises(tinyloop_py.InvalidArgumentError, match=match):
            sandwich.generate_speculative(PROMPT, draft_loops=2, max_tokens=4, **kwargs)


def test_text_generation_takes_the_exit_options(sandwich):
    # A byte-level model (vocab 256, no stored tokenizer) takes text too.
    text = sandwich.generate(text="ROMEO:", max_tokens=8, exit_threshold=0.5)
    assert isinstance(text, str)
    stats = sandwich.last_generate_stats()
    assert stats["exit_tokens"] == stats["tokens"] > 0
    pieces = sandwich.generate_stream(
        text="ROMEO:", max_tokens=8, exit_threshold=0.5, exit_policy="skip"
    )
    assert isinstance("".join(pieces), str)
    assert sandwich.last_generate_stats()["exit_tokens"] > 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"exit_threshold": 1.5}, "exit_threshold"),
        ({"exit_threshold": -0.5}, "exit_threshold"),
        ({"exit_threshold": float("nan")}, "exit_threshold"),
        ({"exit": "kl:x"}, "exit rule"),
        ({"exit_threshold": 0.5, "exit": "gate:0.5"}, "exit_threshold or exit, not both"),
        ({"exit_policy": "skip"}, "exit_policy is set without an exit rule"),
        ({"exit": "gate:0.5", "exit_policy": "fast"}, "exit_policy"),
        # The preset names no default threshold.
        ({"exit": "gate"}, "no default threshold"),
    ],
)
def test_bad_exit_options_are_value_errors(sandwich, kwargs, match):
    with pytest.raises(tinyloop_py.InvalidArgumentError, match=match):
        sandwich.generate(PROMPT, max_tokens=4, **kwargs)
    with pytest.raises(ValueError, match=match):
        list(sandwich.generate_stream(PROMPT, max_tokens=4, **kwargs))


def test_an_exit_rule_needs_an_exit_gate(model_path):
    with _open(model_path) as m:
        for kwargs in ({"exit_threshold": 0.5}, {"exit": "gate:0.5"}):
            with pytest.raises(tinyloop_py.InvalidArgumentError, match="no exit gate"):
                m.generate(PROMPT, max_tokens=4, **kwargs)


def test_exit_option_types(sandwich):
    with pytest.raises(TypeError, match="exit_threshold"):
        sandwich.generate(PROMPT, exit_threshold="0.5")
    with pytest.raises(TypeError, match="exit"):
        sandwich.generate(PROMPT, exit=1)
    with pytest.raises(TypeError, match="exit_policy"):
        sandwich.generate(PROMPT, exit="gate:0.5", exit_policy=b"skip")


RULES = [
    {"exit_threshold": 0.5},
    {"exit": "gate:0.7", "exit_policy": "skip"},
    {"exit": "argmax:1"},
    {"exit": "argmax:1", "exit_policy": "skip"},
]


@pytest.mark.parametrize("rule", RULES)
def test_scoring_a_generation_with_its_rule_gives_its_tokens_and_exits(sandwich, rule):
    out = sandwich.generate(PROMPT, max_tokens=12, loops=4, **rule)
    stats = sandwich.last_generate_stats()
    tokens = PROMPT + out[:-1].tolist()
    n = len(PROMPT)
    logits, steps = sandwich.score_exit(tokens, loops=4, prompt_len=n, **rule)
    assert logits.shape == (len(tokens), 256) and steps.shape == (len(tokens),)
    assert steps.dtype == np.int32 and ((1 <= steps) & (steps <= 4)).all(), steps
    assert (steps[n - 1 :] < 4).any(), steps
    # Row n - 1 on holds what generation chose each token from.
    np.testing.assert_array_equal(logits[n - 1 :].argmax(axis=1), out)
    assert stats["exit_tokens"] == len(out)
    # Sums of at most 12 small integers are exact in float64: the means are equal, not near.
    assert steps[n - 1 :].mean() == stats["exit_mean_steps"]
    np.testing.assert_array_equal(
        sandwich.score(tokens, loops=4, prompt_len=n, **rule), logits
    )
    with sandwich.new_session() as s:
        session_logits, session_steps = s.score_exit(tokens, n_loops=4, prompt_len=n, **rule)
        np.testing.assert_array_equal(session_logits, logits)
        np.testing.assert_array_equal(session_steps, steps)


@pytest.mark.parametrize("rule", [{"exit": "gate:0.5"}, {"exit": "kl:0.5"}])
def test_a_prompt_s_exit_rows_are_plain_scores_at_their_exit_iteration(sandwich, rule):
    # prompt_len None: every token in the prompt, where every position runs every iteration
    # (the gate, reference policy) or every position shares its call's exit (a criterion): the
    # logits of a position that exits at e are those of a plain score at e loops. The same
    # block applications on the same rows, so the same bits.
    tokens = PROMPT + [32, 87, 104, 101, 114, 101]
    logits, steps = sandwich.score_exit(tokens, loops=4, **rule)
    np.testing.assert_array_equal(
        sandwich.score_exit(tokens, loops=4, prompt_len=len(tokens), **rule)[1], steps
    )
    assert (steps < 4).any(), steps
    for e in np.unique(steps):
        rows = steps == e
        np.testing.assert_array_equal(logits[rows], sandwich.score(tokens, loops=int(e))[rows])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"exit_threshold": 0.5, "prompt_len": 0}, "prompt_len 0 must be in 1..=6"),
        ({"exit_threshold": 0.5, "prompt_len": 7}, "prompt_len 7 must be in 1..=6"),
        ({"exit_threshold": 0.5, "prompt_len": -1}, "prompt_len"),
        ({}, "no exit rule"),
        ({"prompt_len": 3}, "no exit rule"),
        ({"exit_policy": "skip"}, "exit_policy is set without an exit rule"),
        ({"exit": "kl:x"}, "exit rule"),
        ({"exit_threshold": 1.5}, "exit_threshold"),
        ({"exit_threshold": 0.5, "loops": 0}, "loops"),
    ],
)
def test_bad_score_exit_arguments_are_value_errors(sandwich, kwargs, match):
    with pytest.raises(tinyloop_py.InvalidArgumentError, match=match):
        sandwich.score_exit(PROMPT, **kwargs)
    if kwargs:
        with pytest.raises(ValueError, match=match):
            sandwich.score(PROMPT, **kwargs)


def test_score_exit_argument_types_and_models_without_a_gate(sandwich, model_path):
    with pytest.raises(TypeError, match="prompt_len"):
        sandwich.score_exit(PROMPT, exit_threshold=0.5, prompt_len="3")
    with pytest.raises(TypeError, match="exit_threshold"):
        sandwich.score(PROMPT, exit_threshold="0.5")
    with _open(model_path) as m:
        with pytest.raises(tinyloop_py.InvalidArgumentError, match="no exit gate"):
            m.score_exit(PROMPT, exit_threshold=0.5)
        logits, steps = m.score_exit(PROMPT, exit="argmax:1")
        assert logits.shape == (len(PROMPT), 256) and len(steps) == len(PROMPT)
        # Without exit arguments, score is the plain call.
        np.testing.assert_array_equal(m.score(PROMPT, loops=4), m.score(PROMPT, 4))


def _greedy(path, state_init):
    with _open(path, state_init=state_init) as m:
        return m.generate(PROMPT, max_tokens=12)


def test_state_init_draws_the_initial_state(recurrent_model_path):
    zeros = _greedy(recurrent_model_path, "zeros")
    seeded = _greedy(recurrent_model_path, "seed:3")
    assert len(zeros) == len(seeded) == 12
    np.testing.assert_array_equal(_greedy(recurrent_model_path, "seed:3"), seeded)
    # "model" (also None) is the model's own rule from seed 0.
    default = _greedy(recurrent_model_path, None)
    np.testing.assert_array_equal(_greedy(recurrent_model_path, "model"), default)
    np.testing.assert_array_equal(_greedy(recurrent_model_path, "seed:0"), default)


def test_bad_state_init(model_path, recurrent_model_path):
    with pytest.raises(tinyloop_py.InvalidArgumentError, match="state_init"):
        _open(recurrent_model_path, state_init="seed:x")
    # A loop that carries its state from the pre blocks has no initial state to draw.
    with pytest.raises(tinyloop_py.InvalidArgumentError, match="state_init"):
        _open(model_path, state_init="zeros")
    _open(model_path, state_init="model").close()
    with pytest.raises(TypeError, match="state_init"):
        _open(recurrent_model_path, state_init=3)
