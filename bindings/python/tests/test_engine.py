"""The engine from Python: many requests at once (from threads and from asyncio), each with the
tokens ``Model.generate`` gives it alone; cancellation, closing and bad arguments. The engine
runs on the CPU (docs/ABI.md "Engines")."""

import asyncio
import threading

import numpy as np
import pytest

import tinyloop_py
from conftest import PROMPT


@pytest.fixture
def model(model_path):
    m = tinyloop_py.Model(model_path, max_seq_len=256, device="cpu", log=False)
    yield m
    m.close()


def requests():
    """Prompts, lengths and loop counts that differ from request to request."""
    return [
        (np.array(PROMPT[: 3 + i], dtype=np.int32), 5 + 2 * i, [1, 3, 2, 4][i % 4])
        for i in range(6)
    ]


def test_concurrent_requests_equal_generation_alone(model):
    with tinyloop_py.Engine(model, max_step_rows=8, page_size=4) as engine:
        submitted = [engine.submit(p, max_tokens=n, loops=l) for p, n, l in requests()]
        assert [r.id for r in submitted] == list(range(6))
        for request, (prompt, n, loops) in zip(submitted, requests()):
            alone = model.generate(prompt, max_tokens=n, loops=loops)
            np.testing.assert_array_equal(request.tokens(), alone)
            assert request.stats["tokens"] == n
            assert request.stats["finish"] == "length"
            assert request.stats["prompt_tokens"] == prompt.size
            assert 0 <= request.stats["first_token_ms"] <= request.stats["total_ms"]
        stats = engine.stats()
        assert stats["running"] == stats["queued"] == stats["pages_used"] == 0
        assert stats["tokens"] == sum(n for _, n, _ in requests())


def test_submit_from_threads_and_sampling_with_a_seed(model):
    prompt = np.array(PROMPT, dtype=np.int32)
    sampled = dict(max_tokens=12, loops=2, temperature=0.8, top_k=20, seed=5)
    expected = model.generate(prompt, **sampled)
    with tinyloop_py.Engine(model) as engine:
        results = [None] * 4

        def client(i):
            results[i] = engine.submit(prompt, **sampled).tokens()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for got in results:
            np.testing.assert_array_equal(got, expected)


def test_asyncio_clients_stream_concurrently(model):
    async def main(engine):
        async def collect(prompt, n, loops):
            return [t async for t in engine.submit(prompt, max_tokens=n, loops=loops)]

        return await asyncio.gather(*(collect(*r) for r in requests()))

    with tinyloop_py.Engine(model, max_step_rows=8) as engine:
        streamed = asyncio.run(main(engine))
    for got, (prompt, n, loops) in zip(streamed, requests()):
        assert got == list(model.generate(prompt, max_tokens=n, loops=loops))


def test_stop_tokens_end_a_request(model):
    prompt = np.array(PROMPT, dtype=np.int32)
    free = model.generate(prompt, max_tokens=10, loops=2)
    with tinyloop_py.Engine(model) as engine:
        request = engine.submit(prompt, max_tokens=10, loops=2, stop=[int(free[3])])
        got = request.tokens()
    cut = list(free).index(free[3])
    np.testing.assert_array_equal(got, free[:cut])
    assert request.stats["finish"] == "stop"


def test_cancel_and_close_end_requests_with_cancelled(model):
    prompt = np.array(PROMPT, dtype=np.int32)
    engine = tinyloop_py.Engine(model, max_running=1)
    running = engine.submit(prompt, max_tokens=200, loops=6)
    queued = engine.submit(prompt, max_tokens=200, loops=6)
    tokens = iter(running)
    next(tokens)
    running.cancel()
    with pytest.raises(tinyloop_py.CancelledError):
        list(tokens)
    with pytest.raises(ValueError, match="request 0 has already ended"):
        running.cancel()
    next(iter(queued))  # admitted once the first was cancelled
    engine.close()
    with pytest.raises(tinyloop_py.CancelledError):
        list(queued)
    with pytest.raises(tinyloop_py.ClosedError, match=r"submit\(\) called on a closed engine"):
        engine.submit(prompt)
    engine.close()  # idempotent
    assert engine.closed


def test_bad_arguments_are_value_errors(model):
    with pytest.raises(ValueError, match="engine option max_step_rows must be at least 1"):
        tinyloop_py.Engine(model, max_step_rows=0)
    with pytest.raises(ValueError, match="max_running"):
        tinyloop_py.Engine(model, max_running=-1)
    with tinyloop_py.Engine(model) as engine:
        with pytest.raises(ValueError, match="empty token sequence"):
            engine.submit([])
        with pytest.raises(ValueError, match="out of range for vocab_size"):
            engine.submit([1, 999])
        with pytest.raises(ValueError, match="loops must be in"):
            engine.submit([1, 2], loops=0)
    model.close()
    with pytest.raises(tinyloop_py.ClosedError):
        tinyloop_py.Engine(model)
