"""The seed Model surface from Python: construction, config, generation, scoring, errors,
close semantics, sessions and threads."""

import os
import random
import threading
import types
from pathlib import Path

import numpy as np
import pytest

import tinyloop_py
from tinyloop_py import _lib
from conftest import PROMPT

SEED_KEYS = {"dim", "n_heads", "ffn_dim", "vocab_size", "embed_factor_dim", "n_pre_blocks",
             "default_loops"}


def test_abi_version_checked_at_import():
    assert tinyloop_py.abi_version() == tinyloop_py.ABI_VERSION == 1
    assert Path(tinyloop_py.library_path()).is_file()


def test_library_search_order(tmp_path):
    lib = tmp_path / _lib.LIB_NAMES[0]
    paths = _lib.candidate_paths(env={"TINYLOOP_LIB": str(lib)}, cwd=tmp_path)
    assert paths[0] == lib
    package_dir = Path(_lib.__file__).resolve().parent
    assert paths[1] == package_dir / _lib.LIB_NAMES[0]
    assert paths[2] == tmp_path.resolve() / "target" / "release" / _lib.LIB_NAMES[0]
    assert paths[3] == tmp_path.resolve() / "target" / "debug" / _lib.LIB_NAMES[0]
    # A folder in TINYLOOP_LIB means the library file inside it.
    assert _lib.candidate_paths(env={"TINYLOOP_LIB": str(tmp_path)}, cwd=tmp_path)[0] == lib


def test_installed_package_uses_its_own_library():
    package_lib = Path(_lib.__file__).resolve().parent / _lib.LIB_NAMES[0]
    if not package_lib.is_file() or os.environ.get("TINYLOOP_LIB"):
        pytest.skip("no library inside the package (a source tree), or TINYLOOP_LIB overrides it")
    assert Path(tinyloop_py.library_path()).resolve() == package_lib


def test_load_library_refuses_another_abi_version(monkeypatch):
    monkeypatch.setattr(_lib, "ABI_VERSION", 999)
    with pytest.raises(ImportError, match="ABI version"):
        _lib.load_library()


def test_explicit_tinyloop_lib_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYLOOP_LIB", str(tmp_path / "nothing.so"))
    with pytest.raises(ImportError, match="TINYLOOP_LIB"):
        _lib.load_library()


# ---- construction ------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, 2**32, 4096])
def test_max_seq_len_must_be_in_range(model_path, bad):
    with pytest.raises(ValueError, match="max_seq_len"):
        tinyloop_py.Model(model_path, max_seq_len=bad, device="cpu", log=False)


def test_max_seq_len_defaults_to_the_model_s(model_path):
    with tinyloop_py.Model(model_path, device="cpu", log=False) as m:
        config = m.config()
        assert config["max_seq_len"] == min(2048, config["max_position"])


def test_max_seq_len_must_be_an_int(model_path):
    with pytest.raises(TypeError):
        tinyloop_py.Model(model_path, max_seq_len="2048")


def test_missing_file_names_the_failure_point(tmp_path):
    missing = tmp_path / "nope.tinyloop"
    with pytest.raises(RuntimeError) as info:
        tinyloop_py.Model(missing)
    assert str(missing) in str(info.value)
    assert info.value.status_name == "TL_ERR_IO"


def test_invalid_files_name_the_failure_point(tmp_path, model_path):
    garbage = tmp_path / "garbage.tinyloop"
    garbage.write_bytes(b"definitely not a model file" * 4)
    with pytest.raises(RuntimeError, match="bad magic") as info:
        tinyloop_py.Model(garbage, log=False)
    assert info.value.status_name == "TL_ERR_FORMAT"
    truncated = tmp_path / "truncated.tinyloop"
    truncated.write_bytes(Path(model_path).read_bytes()[:1000])
    with pytest.raises(RuntimeError, match="truncated"):
        tinyloop_py.Model(truncated, log=False)


def test_bad_device_is_a_value_error(model_path):
    with pytest.raises(ValueError, match="device"):
        tinyloop_py.Model(model_path, device="tpu", log=False)


@pytest.mark.parametrize("mode", ["fp16", "fp16-h", "int8-h", "int4-h", "int8", "delta", "age:64:128"])
def test_every_kv_mode_opens_and_generates(model_path, mode):
    with tinyloop_py.Model(model_path, max_seq_len=256, device="cpu", kv_mode=mode, log=False) as m:
        assert m.kv_mode == mode
        out = m.generate(list(range(1, 40)), max_tokens=8)
        assert len(out) == 8 and all(0 <= t < 256 for t in out)


def test_bad_kv_mode_is_a_value_error_listing_the_modes(model_path):
    with pytest.raises(ValueError, match="fp16, fp16-h, int8-h, int4-h, int8, delta, age"):
        tinyloop_py.Model(model_path, kv_mode="int3", log=False)
    with pytest.raises(ValueError, match="out of order"):
        tinyloop_py.Model(model_path, kv_mode="age:4096:1024", log=False)


def test_fp16_body_is_a_bool_and_changes_nothing_on_the_cpu(model_path):
    with pytest.raises(TypeError, match="fp16_body"):
        tinyloop_py.Model(model_path, device="cpu", fp16_body=1, log=False)
    outputs = []
    for fp16_body in (None, False, True):
        with tinyloop_py.Model(model_path, max_seq_len=128, device="cpu", fp16_body=fp16_body, log=False) as m:
            outputs.append(list(m.generate(list(range(1, 20)), max_tokens=6)))
    assert outputs[0] == outputs[1] == outputs[2]


def test_load_is_an_alias(model_path):
    m = tinyloop_py.load(model_path, max_seq_len=64, device="cpu", log=False)
    try:
        assert isinstance(m, tinyloop_py.Model)
        assert m.config()["vocab_size"] == 256
    finally:
        m.close()


# ---- inspection --------------------------------------------------------------------------

def test_config_has_the_seed_keys(model):
    cfg = model.config()
    assert SEED_KEYS <= set(cfg)
    assert {"n_kv_heads", "n_loop_blocks", "n_post_blocks", "norm", "rope_theta",
            "max_position"} <= set(cfg)
    assert cfg["vocab_size"] == 256 and cfg["dim"] % cfg["n_heads"] == 0
    assert all(isinstance(cfg[k], int) for k in SEED_KEYS)
    assert cfg["norm"] in ("rmsnorm", "layernorm")


def test_vram_usage_is_a_positive_float(model):
    mb = model.vram_usage_mb()
    assert isinstance(mb, float) and mb > 0
    session = model.new_session()
    assert model.vram_usage_mb() > mb  # the new session's buffers are counted
    session.close()
    assert model.device.startswith("cpu")


# ---- generation --------------------------------------------------------------------------

def test_generate_returns_int32_and_is_deterministic(model):
    out = model.generate(PROMPT, max_tokens=12)
    assert isinstance(out, np.ndarray) and out.dtype == np.int32 and out.shape == (12,)
    assert ((out >= 0) & (out < 256)).all()
    again = model.generate(np.asarray(PROMPT, dtype=np.int32), max_tokens=12)
    np.testing.assert_array_equal(out, again)
    wide = model.generate(np.asarray(PROMPT, dtype=np.int64), max_tokens=12, top_k=50)
    np.testing.assert_array_equal(out, wide)  # greedy ignores top_k


def test_stop_tokens_end_generation(model):
    out = model.generate(PROMPT, max_tokens=12)
    stop = int(out[4])
    first = list(out).index(stop)
    stopped = model.generate(PROMPT, max_tokens=12, stop=[stop])
    np.testing.assert_array_equal(stopped, out[:first])


def test_sampling_is_reproducible_with_a_seed(model):
    a = model.generate(PROMPT, max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    b = model.generate(PROMPT, max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    np.testing.assert_array_equal(a, b)
    random.seed(3)
    c = model.generate(PROMPT, max_tokens=20, temperature=1.0)
    random.seed(3)
    d = model.generate(PROMPT, max_tokens=20, temperature=1.0)
    np.testing.assert_array_equal(c, d)


def test_loops_change_the_output_of_score(model):
    default = model.score_last(PROMPT)
    explicit = model.score_last(PROMPT, loops=model.config()["default_loops"])
    np.testing.assert_array_equal(default, explicit)
    assert not np.array_equal(model.score_last(PROMPT, loops=1), default)


def test_generate_stream_is_a_generator_matching_generate(model):
    stream = model.generate_stream(PROMPT, max_tokens=10)
    assert isinstance(stream, types.GeneratorType)
    tokens = list(stream)
    assert all(isinstance(t, int) for t in tokens)
    np.testing.assert_array_equal(np.asarray(tokens, np.int32), model.generate(PROMPT, max_tokens=10))


def test_leaving_a_stream_early_frees_the_model(model):
    for i, _ in enumerate(model.generate_stream(PROMPT, max_tokens=100)):
        if i == 2:
            break
    assert model.generate(PROMPT, max_tokens=3).shape == (3,)


def test_score_last_and_score(model):
    last = model.score_last(PROMPT)
    assert last.dtype == np.float32 and last.shape == (256,)
    full = model.score(PROMPT)
    assert full.shape == (len(PROMPT), 256)
    np.testing.assert_array_equal(full[-1], last)  # same code path on the same device: bitwise
    lp = model.logprobs(PROMPT)
    assert lp.shape == (len(PROMPT) - 1,) and (lp <= 0).all()
    # logprobs are the log-softmax of score rows at the next token (f64 vs f32 reductions:
    # 1e-4 absolute is far above their rounding difference on 256 logits).
    rows = full[:-1].astype(np.float64)
    ref = rows - np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - rows.max(1, keepdims=True)
    np.testing.assert_allclose(lp, ref[np.arange(len(PROMPT) - 1), PROMPT[1:]], atol=1e-4)


def test_logprobs_through_the_decode_path(model):
    # On the CPU a row is computed alike in a one-row decode step and in a one-step score
    # (docs/NUMERICS.md "Scoring through the decode path"), so the two agree bit for bit.
    tokens = PROMPT * 3
    for loops in (1, 4):
        decoded = model.logprobs(tokens, loops=loops, decode_path=True)
        assert decoded.shape == (len(tokens) - 1,)
        np.testing.assert_array_equal(decoded, model.logprobs(tokens, loops=loops))
    with model.new_session() as session:
        np.testing.assert_array_equal(
            session.logprobs(tokens, decode_path=True), model.logprobs(tokens)
        )
    with pytest.raises(ValueError, match="at least 2 tokens"):
        model.logprobs(PROMPT[:1], decode_path=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tokens=[]), "empty"),
        (dict(tokens=[1, 256]), "vocab"),
        (dict(tokens=[1, -1]), "negative"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0, temperature=1.0), "top_p"),
        (dict(top_p=1.5, temperature=1.0), "top_p"),
        (dict(loops=0), "loops"),
        (dict(loops=65), "loops"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(tokens=[1] * 256), "max_seq_len"),
        (dict(tokens=[[1, 2]]), "1-D"),
        (dict(stop=[999]), "stop"),
    ],
)
def test_invalid_arguments_raise_value_error(model, kwargs, match):
    kwargs = dict(kwargs)
    tokens = kwargs.pop("tokens", PROMPT)
    kwargs.setdefault("max_tokens", 4)
    with pytest.raises(ValueError, match=match) as info:
        model.generate(tokens, **kwargs)
    assert isinstance(info.value, RuntimeError)  # also a TinyLoopError
    with pytest.raises(ValueError):
        list(model.generate_stream(tokens, **kwargs))


def test_float_tokens_are_a_type_error(model):
    with pytest.raises(TypeError):
        model.generate([1.5, 2.0], max_tokens=2)


def test_generation_stops_at_max_seq_len(model_path):
    with tinyloop_py.Model(model_path, max_seq_len=16, device="cpu", log=False) as m:
        assert len(m.generate(PROMPT, max_tokens=300)) == 16 - len(PROMPT)


def test_prompt_longer_than_max_seq_len(model):
    with pytest.raises(ValueError, match="max_seq_len"):
        model.score_last(list(range(200)) + list(range(100)))


def test_prefill_chunk_gates_score_calls(model_path):
    with tinyloop_py.Model(model_path, max_seq_len=64, prefill_chunk=4, device="cpu",
                           log=False) as m:
        with pytest.raises(ValueError, match="prefill_chunk"):
            m.score_last(PROMPT)
        assert m.generate(PROMPT, max_tokens=4).shape == (4,)


# ---- close -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "method, call",
    [
        ("generate", lambda m: m.generate(PROMPT, max_tokens=2)),
        ("generate_stream", lambda m: m.generate_stream(PROMPT, max_tokens=2)),
        ("score_last", lambda m: m.score_last(PROMPT)),
        ("score", lambda m: m.score(PROMPT)),
        ("logprobs", lambda m: m.logprobs(PROMPT)),
        ("config", lambda m: m.config()),
        ("vram_usage_mb", lambda m: m.vram_usage_mb()),
        ("new_session", lambda m: m.new_session()),
        ("cancel", lambda m: m.cancel()),
        ("device", lambda m: m.device),
    ],
)
def test_every_method_raises_after_close_naming_it(model_path, method, call):
    m = tinyloop_py.Model(model_path, max_seq_len=64, device="cpu", log=False)
    m.close()
    m.close()  # idempotent
    with pytest.raises(RuntimeError, match=rf"^{method}\(\) called on a closed model"):
        call(m)


def test_context_manager_closes_and_does_not_swallow(model_path):
    with pytest.raises(KeyError):
        with tinyloop_py.Model(model_path, max_seq_len=64, device="cpu", log=False) as m:
            assert m.generate(PROMPT, max_tokens=2).shape == (2,)
            raise KeyError("body")
    assert m.closed
    with pytest.raises(RuntimeError, match="closed"):
        m.generate(PROMPT)


def test_close_during_a_stream_in_another_thread(model_path):
    m = tinyloop_py.Model(model_path, max_seq_len=256, device="cpu", log=False)
    stream = m.generate_stream(PROMPT, max_tokens=200)
    assert isinstance(next(stream), int)
    closer = threading.Thread(target=m.close)
    closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive(), "close() waited forever for the stream"
    with pytest.raises(RuntimeError, match="closed"):
        list(stream)


# ---- busy, cancel, sessions, threads -----------------------------------------------------

def test_second_call_on_a_busy_model_raises_busy(model):
    stream = model.generate_stream(PROMPT, max_tokens=50)
    next(stream)  # the stream now holds the default session until it is consumed or closed
    with pytest.raises(tinyloop_py.BusyError) as info:
        model.generate(PROMPT, max_tokens=2)
    assert info.value.status_name == "TL_ERR_BUSY"
    assert model.vram_usage_mb() > 0  # inspection does not wait
    session = model.new_session()  # other sessions are independent
    assert session.generate(PROMPT, max_tokens=2).shape == (2,)
    stream.close()
    assert model.generate(PROMPT, max_tokens=2).shape == (2,)
    session.close()


def test_cancel_stops_a_stream(model):
    session = model.new_session()
    stream = session.generate_stream(PROMPT, max_tokens=100)
    got = [next(stream)]
    session.cancel()
    with pytest.raises(tinyloop_py.CancelledError):
        for token in stream:
            got.append(token)
    assert len(got) < 100
    # The next call is not affected.
    assert session.generate(PROMPT, max_tokens=3).shape == (3,)
    session.close()
    session.close()
    with pytest.raises(RuntimeError, match=r"^generate\(\) called on a closed session"):
        session.generate(PROMPT)


def test_sessions_outlive_a_closed_model(model_path):
    m = tinyloop_py.Model(model_path, max_seq_len=64, device="cpu", log=False)
    session = m.new_session()
    expected = m.generate(PROMPT, max_tokens=5)
    m.close()
    np.testing.assert_array_equal(session.generate(PROMPT, max_tokens=5), expected)
    session.close()


def test_two_threads_with_own_sessions_match_sequential(model):
    prompts = [[72, 101, 108, 108, 111], [84, 111, 32, 98, 101]]
    kwargs = [dict(max_tokens=40), dict(max_tokens=40, temperature=0.8, seed=11)]
    sessions = [model.new_session(), model.new_session()]
    sequential = [s.generate(p, **k) for s, p, k in zip(sessions, prompts, kwargs)]
    results = [None, None]

    def run(i):
        results[i] = [sessions[i].generate(prompts[i], **kwargs[i]) for _ in range(3)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        for r in results[i]:
            np.testing.assert_array_equal(r, sequential[i])
    for s in sessions:
        s.close()


def test_calls_release_the_gil(model):
    spins = 0
    worker = threading.Thread(target=lambda: model.generate(PROMPT, max_tokens=200))
    worker.start()
    while worker.is_alive():
        spins += 1
    worker.join()
    # With the GIL held for the whole C call this loop could not run meanwhile; with it
    # released it spins freely (typically millions of times). 1000 is a generous floor.
    assert spins > 1000
