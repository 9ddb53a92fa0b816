"""The looped-model calls from Python: logit lens, trajectory, speculative generation, prefix
caches, resume handles and generation statistics. The model runs on the CPU, whose results do
not depend on how the work is split into steps, so the equalities are exact (as in the Rust
tests, tests/looped.rs). TINYLOOP_TEST_DEVICE=cuda runs the same tests on a GPU (the GPU
bundle's run-tests.sh does), where the equalities hold exactly as well on this model: each
compares runs of the same kernels on the same rows (tests/cuda_parity.rs explains when they
can part on other models: speculation after a near tie)."""

import ctypes
import os

import numpy as np
import pytest

import tinyloop_py
from tinyloop_py import _lib
from conftest import PROMPT

PREFIX = [84, 111, 32, 98, 101, 32, 111, 114, 32, 110, 111, 116, 32]  # "To be or not "
DEVICE = os.environ.get("TINYLOOP_TEST_DEVICE", "cpu")


@pytest.fixture
def model(model_path):
    m = tinyloop_py.Model(model_path, max_seq_len=256, device=DEVICE, log=False)
    yield m
    m.close()


def test_logit_lens_rows_are_score_last_at_each_depth(model):
    lens = model.score_logit_lens(PROMPT, loops=5)
    vocab = model.config()["vocab_size"]
    assert lens.shape == (5, vocab) and lens.dtype == np.float32
    for depth in range(1, 6):
        np.testing.assert_array_equal(lens[depth - 1], model.score_last(PROMPT, loops=depth))
    default = model.score_logit_lens(PROMPT)
    assert default.shape == (model.config()["default_loops"], vocab)


def test_trajectory_reads_the_lens(model):
    lens = model.score_logit_lens(PROMPT, loops=5).astype(np.float64)
    path = model.score_trajectory(PROMPT, loops=5)
    assert len(path) == 5
    previous = None
    for row, point in zip(lens, path):
        p = np.exp(row - row.max())
        p /= p.sum()
        entropy = -(p * np.log2(p)).sum()
        kl = 0.0 if previous is None else (p * np.log(p / previous)).sum()
        # The library sums the same f64 terms, in another order: 1e-9 relative.
        assert point["entropy"] == pytest.approx(entropy, rel=1e-9, abs=1e-9)
        assert point["kl_prev"] == pytest.approx(kl, rel=1e-9, abs=1e-9)
        assert point["argmax"] == int(np.argmax(row))
        assert point["hidden_norm"] > 0 and point["rel_change"] > 0
        previous = p
    assert path[0]["kl_prev"] == 0.0
    assert model.score_trajectory(PROMPT, loops=2) == path[:2]


@pytest.mark.parametrize("draft_loops,draft_len,reuse", [(1, 1, True), (3, 4, False), (2, 15, True)])
def test_greedy_speculation_equals_plain_generation(model, draft_loops, draft_len, reuse):
    plain = model.generate(PROMPT, max_tokens=24, loops=4)
    out = model.generate_speculative(
        PROMPT, draft_loops=draft_loops, draft_len=draft_len, reuse=reuse, max_tokens=24, loops=4
    )
    np.testing.assert_array_equal(out, plain)
    stats = model.last_generate_stats()
    assert stats["tokens"] == len(out)
    assert 0 < stats["drafted"] and stats["accepted"] <= stats["drafted"]
    assert stats["acceptance_rate"] == stats["accepted"] / stats["drafted"]


def test_speculative_no_cache_is_speculation_without_reuse(model):
    plain = model.generate(PROMPT, max_tokens=24, loops=4)
    with model.new_session() as s:
        for runner in (model, s):
            without_reuse = runner.generate_speculative(
                PROMPT, draft_loops=2, draft_len=4, reuse=False, max_tokens=24, loops=4
            )
            out = runner.generate_speculative_no_cache(
                PROMPT, draft_loops=2, draft_len=4, max_tokens=24, loops=4
            )
            np.testing.assert_array_equal(out, without_reuse)
            np.testing.assert_array_equal(out, plain)
            assert runner.last_generate_stats()["drafted"] > 0
    out = model.generate_speculative_no_cache(PROMPT, draft_loops=2, max_tokens=24, verify_loops=4)
    np.testing.assert_array_equal(out, plain)
    with pytest.raises(TypeError):
        model.generate_speculative_no_cache(PROMPT, draft_loops=2, reuse=True)
    with pytest.raises(ValueError, match="draft_loops"):
        model.generate_speculative_no_cache(PROMPT, draft_loops=4, max_tokens=4, loops=4)


def test_stats_of_plain_generation_and_of_a_session(model):
    model.generate(PROMPT, max_tokens=5)
    stats = model.last_generate_stats()
    assert stats["tokens"] == 5 and stats["drafted"] == 0 and stats["decode_ms"] >= 0
    with model.new_session() as s:
        assert s.last_generate_stats()["tokens"] == 0, "all zero before the first call"
        out = s.generate_speculative(PROMPT, draft_loops=2, max_tokens=8, loops=4)
        assert s.last_generate_stats()["tokens"] == len(out)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"draft_loops": 4}, "draft_loops"),
        ({"draft_loops": 0}, "draft_loops"),
        ({"draft_loops": 2, "draft_len": 0}, "draft_len"),
        ({"draft_loops": 2, "draft_len": 16}, "draft_len"),
    ],
)
def test_bad_speculative_arguments_are_value_errors(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        model.generate_speculative(PROMPT, max_tokens=4, loops=4, **kwargs)


def test_prefix_cache_equals_generating_from_the_whole_text(model):
    expected = model.generate(PREFIX + PROMPT, max_tokens=12, loops=3)
    before = model.vram_usage_mb()
    with model.build_prefix_cache(PREFIX, loops=3) as cache:
        assert cache.memory_mb() > 0
        # Both are byte counts / 1e6 in double: equal to well below one byte.
        assert model.vram_usage_mb() - before == pytest.approx(cache.memory_mb(), abs=1e-6)
        np.testing.assert_array_equal(
            model.generate(PROMPT, max_tokens=12, loops=3, prefix_cache=cache), expected
        )
        streamed = list(model.generate_stream(PROMPT, max_tokens=12, loops=3, prefix_cache=cache))
        assert streamed == expected.tolist()
        with model.new_session() as s:
            np.testing.assert_array_equal(
                s.generate(PROMPT, max_tokens=12, loops=3, prefix_cache=cache), expected
            )
        with pytest.raises(ValueError, match="built at loops 3"):
            model.generate(PROMPT, max_tokens=12, loops=4, prefix_cache=cache)
    assert cache.closed
    with pytest.raises(tinyloop_py.ClosedError, match=r"^generate\(\) called with a prefix cache"):
        model.generate(PROMPT, prefix_cache=cache)
    with pytest.raises(TypeError, match="PrefixCache"):
        model.generate(PROMPT, prefix_cache=object())


@pytest.mark.parametrize("depth", [1, 2, 4, 6])
def test_resume_equals_a_fresh_generation_at_any_depth(model, depth):
    with model.build_resume_handle(PROMPT, loops=4) as handle:
        assert handle.memory_mb() > 0
        fresh = model.generate(PROMPT, max_tokens=16, loops=depth)
        np.testing.assert_array_equal(
            model.resume_generate(handle, max_tokens=16, loops=depth), fresh
        )
        with model.new_session() as s:
            np.testing.assert_array_equal(
                s.resume_generate(handle, max_tokens=16, loops=depth), fresh
            )


def test_bound_handles_are_released_with_their_model(model_path):
    m = tinyloop_py.Model(model_path, max_seq_len=256, device=DEVICE, log=False)
    s = m.new_session()
    cache = m.build_prefix_cache(PREFIX)
    handle = s.build_resume_handle(PROMPT)
    m.close()
    with pytest.raises(tinyloop_py.ClosedError, match="whose model was closed"):
        s.generate(PROMPT, max_tokens=4, prefix_cache=cache)
    with pytest.raises(tinyloop_py.ClosedError, match=r"^generate_stream\(\) called with a prefix"):
        list(s.generate_stream(PROMPT, max_tokens=4, prefix_cache=cache))
    with pytest.raises(tinyloop_py.ClosedError, match="resume handle"):
        s.resume_generate(handle, max_tokens=4)
    with pytest.raises(tinyloop_py.ClosedError):
        cache.memory_mb()
    assert s.generate(PROMPT, max_tokens=4).shape == (4,), "the session itself keeps working"
    cache.close()
    handle.close()
    handle.close()  # idempotent
    with pytest.raises(tinyloop_py.ClosedError, match=r"^resume_generate\(\) called with a resume"):
        s.resume_generate(handle)
    s.close()


def test_looped_calls_after_close_name_the_method(model_path):
    m = tinyloop_py.Model(model_path, max_seq_len=64, device=DEVICE, log=False)
    m.close()
    for method, call in [
        ("score_logit_lens", lambda: m.score_logit_lens(PROMPT)),
        ("score_trajectory", lambda: m.score_trajectory(PROMPT)),
        ("generate_speculative", lambda: m.generate_speculative(PROMPT, draft_loops=1)),
        (
            "generate_speculative_no_cache",
            lambda: m.generate_speculative_no_cache(PROMPT, draft_loops=1),
        ),
        ("build_prefix_cache", lambda: m.build_prefix_cache(PROMPT)),
        ("last_generate_stats", lambda: m.last_generate_stats()),
    ]:
        with pytest.raises(tinyloop_py.ClosedError, match=rf"^{method}\(\) called on a closed model"):
            call()


def test_param_structs_have_the_library_size():
    # The library writes sizeof its struct into struct_size (and the whole struct): a ctypes
    # declaration that falls behind the header would be overrun.
    dll = _lib.load_library()
    for struct, fill in [
        (_lib.ModelParams, dll.tl_model_default_params),
        (_lib.GenerateParams, dll.tl_generate_default_params),
        (_lib.SpeculativeParams, dll.tl_speculative_default_params),
        (_lib.CtxTierParams, dll.tl_ctx_tier_default_params),
    ]:
        p = struct()
        assert fill(ctypes.byref(p)) == 0
        assert p.struct_size == ctypes.sizeof(struct), struct.__name__


def test_loops_is_also_n_loops_and_verify_loops(model):
    np.testing.assert_array_equal(
        model.score_last(PROMPT, n_loops=2), model.score_last(PROMPT, loops=2)
    )
    np.testing.assert_array_equal(
        model.generate(PROMPT, max_tokens=6, n_loops=3), model.generate(PROMPT, max_tokens=6, loops=3)
    )
    assert model.score_logit_lens(PROMPT, n_loops=3).shape[0] == 3
    plain = model.generate(PROMPT, max_tokens=8, loops=4)
    for alias in ("n_loops", "verify_loops"):
        out = model.generate_speculative(PROMPT, draft_loops=2, max_tokens=8, **{alias: 4})
        np.testing.assert_array_equal(out, plain)
    with pytest.raises(TypeError, match="both loops and n_loops"):
        model.generate(PROMPT, loops=2, n_loops=2)
    with pytest.raises(TypeError):
        model.score_last(PROMPT, loops_count=2)
