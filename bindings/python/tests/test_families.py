"""The options of the public looped families from Python (docs/MODELS.md): Ouro's adaptive exit
(``exit_threshold``, ``exit``, ``exit_policy`` and the exit statistics) on the `tiny-sandwich`
preset, and Huginn's initial state (``state_init``) on `tiny-recurrent`. The Rust tests
(tests/hf.rs, src/generate/exit.rs) check the numerics; here the binding's plumbing."""

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
