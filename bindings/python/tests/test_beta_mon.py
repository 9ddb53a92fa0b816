"""BETA-MON from Python: ``beta_monitor=True`` (or a dict of thresholds) on every generation
call, the summary in ``last_generate_stats()["beta_mon"]``, bad thresholds as ValueError. The
entropies are compared with an f64 NumPy recomputation from ``score_last`` on the CPU, whose
logits are bit-identical between the decode and score paths; TINYLOOP_TEST_DEVICE=cuda runs the
other tests on a GPU (tests/cuda_beta_mon.rs checks the GPU's entropies)."""

import os

import numpy as np
import pytest

import tinyloop_py
from conftest import PROMPT

DEVICE = os.environ.get("TINYLOOP_TEST_DEVICE", "cpu")
KEYS = {
    "n_tokens",
    "entropy_mean_bits",
    "entropy_std_bits",
    "entropy_min_bits",
    "entropy_max_bits",
    "low_rate",
    "high_rate",
    "agreement_rate",
    "low_entropy_bits",
    "high_entropy_bits",
    "agreement_floor",
    "agreement_below_floor",
}


@pytest.fixture
def model(model_path):
    m = tinyloop_py.Model(model_path, max_seq_len=256, device=DEVICE, log=False)
    yield m
    m.close()


@pytest.fixture
def cpu_model(model_path):
    m = tinyloop_py.Model(model_path, max_seq_len=256, device="cpu", log=False)
    yield m
    m.close()


def entropy_bits(logits):
    z = logits.astype(np.float64) - logits.max()
    e = np.exp(z)
    s = e.sum()
    return (np.log(s) - (z * e).sum() / s) / np.log(2.0)


def test_summary_equals_a_recomputation_from_score_last(cpu_model):
    tokens = cpu_model.generate(PROMPT, max_tokens=32, loops=4, beta_monitor=True)
    reference = np.array(
        [
            entropy_bits(cpu_model.score_last(PROMPT + tokens[:i].tolist(), loops=4))
            for i in range(len(tokens))
        ]
    )
    # Thresholds between the reference values (so that no count depends on rounding).
    ordered = np.sort(reference)
    low = (ordered[7] + ordered[8]) / 2
    high = (ordered[23] + ordered[24]) / 2
    assert ordered[8] - ordered[7] > 1e-4 and ordered[24] - ordered[23] > 1e-4
    again = cpu_model.generate(
        PROMPT, max_tokens=32, loops=4,
        beta_monitor={"low_entropy_bits": low, "high_entropy_bits": high},
    )
    np.testing.assert_array_equal(again, tokens)
    b = cpu_model.last_generate_stats()["beta_mon"]
    assert set(b) == KEYS
    assert b["n_tokens"] == 32
    # The CPU stores each f64 entropy as f32 (2^-24 relative): 1e-6 (1 + H) bits is ample.
    tol = 1e-6 * (1 + reference.max())
    assert b["entropy_mean_bits"] == pytest.approx(reference.mean(), abs=tol)
    assert b["entropy_std_bits"] == pytest.approx(reference.std(), abs=tol)
    assert b["entropy_min_bits"] == pytest.approx(reference.min(), abs=tol)
    assert b["entropy_max_bits"] == pytest.approx(reference.max(), abs=tol)
    assert b["low_rate"] == np.mean(reference < low)
    assert b["high_rate"] == np.mean(reference > high)
    assert b["low_entropy_bits"] == low and b["high_entropy_bits"] == high
    assert b["agreement_floor"] == 0.95
    assert b["agreement_rate"] is None and b["agreement_below_floor"] is False


def test_monitoring_changes_no_token_and_is_none_when_off(model):
    plain = model.generate(PROMPT, max_tokens=16, loops=3, temperature=0.8, seed=5)
    assert model.last_generate_stats()["beta_mon"] is None
    watched = model.generate(PROMPT, max_tokens=16, loops=3, temperature=0.8, seed=5,
                             beta_monitor=True)
    np.testing.assert_array_equal(watched, plain)
    assert model.last_generate_stats()["beta_mon"]["n_tokens"] == 16
    streamed = list(model.generate_stream(PROMPT, max_tokens=16, loops=3, temperature=0.8,
                                          seed=5, beta_monitor=True))
    assert streamed == plain.tolist()
    assert model.last_generate_stats()["beta_mon"]["n_tokens"] == 16


def test_speculative_calls_report_the_agreement(model):
    model.generate_speculative(PROMPT, draft_loops=1, draft_len=4, max_tokens=24, loops=4,
                               beta_monitor={"agreement_floor": 1.0})
    stats = model.last_generate_stats()
    b = stats["beta_mon"]
    assert stats["drafted"] > 0
    assert b["agreement_rate"] == stats["agreement"]
    assert b["agreement_below_floor"] == (stats["agreement"] < 1.0)
    assert b["n_tokens"] == stats["tokens"] == 24


def test_resume_and_sessions_take_the_parameter(model):
    with model.build_resume_handle(PROMPT, loops=2) as handle:
        model.resume_generate(handle, max_tokens=8, loops=4, beta_monitor=True)
    assert model.last_generate_stats()["beta_mon"]["n_tokens"] == 8
    with model.new_session() as session:
        session.generate(PROMPT, max_tokens=5, beta_monitor=True)
        assert session.last_generate_stats()["beta_mon"]["n_tokens"] == 5


@pytest.mark.parametrize(
    "monitor,message",
    [
        ({"low_entropy_bits": -1.0}, "beta_monitor.low_entropy_bits must be a finite number"),
        ({"high_entropy_bits": float("nan")}, "beta_monitor.high_entropy_bits"),
        ({"low_entropy_bits": 3.0, "high_entropy_bits": 2.0}, "must not exceed"),
        ({"agreement_floor": 1.5}, "beta_monitor.agreement_floor must be in [0, 1]"),
        ({"floor": 0.5}, "unknown key 'floor'"),
    ],
)
def test_bad_thresholds_are_value_errors(model, monitor, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        model.generate(PROMPT, max_tokens=2, beta_monitor=monitor)
    assert len(model.generate(PROMPT, max_tokens=2)) == 2


def test_a_threshold_must_be_a_number(model):
    with pytest.raises(TypeError, match="must be a number"):
        model.generate(PROMPT, max_tokens=2, beta_monitor={"agreement_floor": "high"})
    with pytest.raises(TypeError, match="bool or a dict"):
        model.generate(PROMPT, max_tokens=2, beta_monitor=0.5)
