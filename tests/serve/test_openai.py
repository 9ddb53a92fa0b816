"""`tinyloop MODEL serve` answers the official `openai` client: models, completions and chat
completions (streamed and not), stop strings, bad requests, a bounded burst of concurrent
clients, /metrics and /health, and a graceful shutdown that lets a running stream finish.

Run by scripts/test-bindings.sh (step `serve`) with TINYLOOP_BIN and TINYLOOP_DEMO_MODEL set; the
server listens on 127.0.0.1 only and every request loop here is bounded."""

import json
import os
import signal
import subprocess
import threading
import urllib.request

import openai
import pytest

CLI = os.environ["TINYLOOP_BIN"]
MODEL = os.environ["TINYLOOP_DEMO_MODEL"]


def start_server(*args):
    """A server on a free port of 127.0.0.1; returns (process, base URL)."""
    proc = subprocess.Popen(
        [CLI, MODEL, "serve", "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "-q", *args],
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stderr.readline()  # "[tinyloop] serving NAME on http://127.0.0.1:PORT"
    assert "serving" in line, line
    return proc, line.strip().rsplit(" ", 1)[1]


@pytest.fixture(scope="module")
def server():
    proc, url = start_server()
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def generate(prompt, max_tokens):
    """What the CLI generates, greedily, for the same prompt."""
    out = subprocess.run(
        [CLI, MODEL, "generate", "--prompt", prompt, "--max-tokens", str(max_tokens), "--json", "-q"],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout)["text"]


def test_models_list_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["demo"]


def test_completions_equal_the_cli_streamed_or_not(client):
    expected = generate("ROMEO:", 40)
    r = client.completions.create(model="demo", prompt="ROMEO:", max_tokens=40, temperature=0)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, 40)
    chunks = list(client.completions.create(
        model="demo", prompt="ROMEO:", max_tokens=40, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_completions_streamed_or_not(client):
    messages = [{"role": "user", "content": "Speak, friend."}]
    r = client.chat.completions.create(model="demo", messages=messages, max_tokens=24, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and len(text) > 0
    # A byte-level model takes the messages as a transcript ending in "assistant:".
    assert text == generate("user: Speak, friend.\nassistant:", 24)
    streamed = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text


def test_stop_strings_end_the_text_before_them(client):
    full = generate("ROMEO:", 60)
    stop = full[10:14]
    r = client.completions.create(
        model="demo", prompt="ROMEO:", max_tokens=60, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_bad_requests_are_400_with_a_message(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="demo", prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="only n = 1"):
        client.completions.create(model="demo", prompt="x", max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="loops must be in"):
        client.completions.create(model="demo", prompt="x", max_tokens=2, extra_body={"loops": 0})


def test_a_burst_of_concurrent_clients_all_complete(client):
    expected = generate("ROMEO:", 24)
    results = [None] * 16

    def one(i):
        if i % 2:
            chunks = client.completions.create(
                model="demo", prompt="ROMEO:", max_tokens=24, temperature=0, stream=True)
            results[i] = "".join(c.choices[0].text for c in chunks)
        else:
            results[i] = client.completions.create(
                model="demo", prompt="ROMEO:", max_tokens=24, temperature=0).choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == [expected] * 16


def test_health_and_metrics(server, client):
    client.completions.create(model="demo", prompt="A", max_tokens=2, temperature=0)
    with urllib.request.urlopen(server + "/health") as r:
        assert r.read() == b"ok"
    with urllib.request.urlopen(server + "/metrics") as r:
        text = r.read().decode()
    for name in ["tinyloop_requests_total{endpoint=\"completions\",status=\"200\"}",
                 "tinyloop_generated_tokens_total", "tinyloop_kv_pool_pages_used",
                 "tinyloop_engine_step_seconds_bucket", "tinyloop_time_to_first_token_seconds_count"]:
        assert name in text, name


def test_sigterm_lets_a_running_stream_finish():
    proc, url = start_server()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.completions.create(
        model="demo", prompt="ROMEO:", max_tokens=64, temperature=0, stream=True)
    first = next(iter(stream))
    proc.send_signal(signal.SIGTERM)
    rest = list(stream)
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
    assert text == generate("ROMEO:", 64)
    assert rest[-1].choices[0].finish_reason == "length"
    assert proc.wait(timeout=60) == 0
