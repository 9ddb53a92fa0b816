"""CTX-TIER from Python: the per-call policy (``ctx_tier=`` as a CtxTier or a dict), its
statistics in ``last_generate_stats()["ctx_tier"]``, and bad values as ValueError. The Rust
tests (tests/ctx_tier.rs) check the numerics; here the binding's plumbing."""

import json
import os

import pytest

import tinyloop_py
from conftest import PROMPT

DEVICE = os.environ.get("TINYLOOP_TEST_DEVICE", "cpu")


@pytest.fixture
def model(model_path):
    m = tinyloop_py.Model(model_path, max_seq_len=256, device=DEVICE, log=False)
    yield m
    m.close()


def test_a_transition_in_the_middle_of_generation(model, tmp_path):
    plain = model.generate(PROMPT, max_tokens=10, loops=3)
    assert model.last_generate_stats()["ctx_tier"] is None
    summary = tmp_path / "tier.json"
    tier = tinyloop_py.CtxTier(short_t=4, long_t=9, file=summary)
    out = model.generate(PROMPT, max_tokens=10, loops=3, ctx_tier=tier)
    stats = model.last_generate_stats()["ctx_tier"]
    # 6 prompt tokens: observations at seq_len 6, 7, 8 run at INT4, from 9 on at INT2.
    assert stats["observations"] == 10
    assert (stats["short_steps"], stats["long_steps"]) == (3, 7)
    assert stats["transitions"] == 1 and stats["tier"] == "LONG"
    assert stats["last_seq_len"] == 15
    assert list(out[:3]) == list(plain[:3])
    assert json.loads(summary.read_text())["n_obs"] == 10


@pytest.mark.parametrize("log", [True, False])
def test_tier_lines_follow_the_log_option(model_path, capfd, log):
    tier = tinyloop_py.CtxTier(short_t=4, long_t=9, verbose=True)
    with tinyloop_py.Model(model_path, max_seq_len=256, device=DEVICE, log=log) as m:
        capfd.readouterr()
        m.generate(PROMPT, max_tokens=6, loops=2, ctx_tier=tier)
        assert m.last_generate_stats()["ctx_tier"]["transitions"] == 1
    err = capfd.readouterr().err
    if log:
        assert "[ctx_tier] transition at observation 4 (seq_len=9): SHORT -> LONG" in err, err
    else:
        assert err == "", "log=False: the library prints nothing"


def test_a_dict_and_a_session(model):
    with model.new_session() as s:
        out = s.generate(PROMPT, max_tokens=4, loops=2, ctx_tier={"short_t": 1, "long_t": 2})
        stats = s.last_generate_stats()["ctx_tier"]
        # Position 0 (seq_len 1) runs at SHORT, positions 1.. at LONG: the prefill is cut in two
        # steps, then three decode steps.
        assert (stats["short_steps"], stats["long_steps"], stats["observations"]) == (1, 4, 5)
        assert len(out) == 4
        # Back to the INT4 body without a policy: the model's own output.
        assert list(s.generate(PROMPT, max_tokens=4, loops=2)) == list(
            model.generate(PROMPT, max_tokens=4, loops=2)
        )


@pytest.mark.parametrize(
    "tier,match",
    [
        ({"short_t": 9, "long_t": 8}, "short_t"),
        ({"long_bits": 3}, "long_bits"),
        ({"short_t": 0}, "short_t"),
        ({"shortt": 4}, "unknown keys"),
    ],
)
def test_bad_policies_are_value_errors(model, tier, match):
    with pytest.raises(ValueError, match=match):
        model.generate(PROMPT, max_tokens=2, ctx_tier=tier)
