"""`tinyloop MODEL serve` answers the official `openai` client: models, completions and chat
completions (streamed and not), token ids, stop strings, bad requests, a bounded burst of
concurrent clients, /metrics and /health, a graceful shutdown that lets a running stream finish,
a model without a tokenizer served by token ids, and the KV pool sized by --pool-positions.

Run by scripts/test-bindings.sh (step `serve`) with TINYLOOP_BIN and TINYLOOP_DEMO_MODEL set; the
server listens on 127.0.0.1 only and every request loop here is bounded. The checks shared with
the Ray Serve deployment's tests are in tests/openai_checks.py."""

import json
import os
import signal
import subprocess
import urllib.request

import openai
import pytest

import openai_checks

CLI = os.environ["TINYLOOP_BIN"]
MODEL = os.environ["TINYLOOP_DEMO_MODEL"]


def start_server(*args, model=MODEL):
    """A server on a free port of 127.0.0.1; returns (process, base URL)."""
    proc = subprocess.Popen(
        [CLI, model, "serve", "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "-q", *args],
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
    return openai_checks.client_for(server)


def generate(prompt, max_tokens):
    """What the CLI generates, greedily, for the same prompt."""
    out = subprocess.run(
        [CLI, MODEL, "generate", "--prompt", prompt, "--max-tokens", str(max_tokens), "--json", "-q"],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout)["text"]


def test_models_list_the_served_model(client):
    openai_checks.check_models(client)


def test_completions_equal_the_cli_streamed_or_not(client):
    openai_checks.check_completions(client, generate)


def test_chat_completions_equal_the_cli_streamed_or_not(client):
    openai_checks.check_chat(client, generate)


def test_choices_carry_their_token_ids_when_asked(client):
    openai_checks.check_token_ids(client, generate)


def test_stop_strings_end_the_text_before_them(client):
    openai_checks.check_stop_strings(client, generate)


def test_bad_requests_are_400_with_a_message(client):
    openai_checks.check_bad_requests(client)


def test_a_burst_of_concurrent_clients_all_complete(client):
    expected = generate("ROMEO:", 24)
    jobs = [lambda s=bool(i % 2): openai_checks.request(client, "completion", s, 24,
                                                        prompt="ROMEO:")
            for i in range(16)]
    assert openai_checks.burst(jobs, 300) == [("ok", expected)] * 16


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
    client = openai_checks.client_for(url)
    stream = client.completions.create(
        model="demo", prompt="ROMEO:", max_tokens=64, temperature=0, stream=True)
    first = next(iter(stream))
    proc.send_signal(signal.SIGTERM)
    rest = list(stream)
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
    assert text == generate("ROMEO:", 64)
    assert rest[-1].choices[0].finish_reason == "length"
    assert proc.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    """A model of 384 token ids and no tokenizer, and a client of a server over it."""
    path = str(tmp_path_factory.mktemp("models") / "no-tokenizer.tinyloop")
    subprocess.run([CLI, "synth", "--preset", "tiny", "--vocab-size", "384", "--seed", "3",
                    "--out", path], check=True, capture_output=True)
    proc, url = start_server("--pool-positions", "1000", model=path)
    yield path, url, openai_checks.client_for(url)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


def test_a_model_without_a_tokenizer_serves_token_ids(no_tokenizer):
    path, _, client = no_tokenizer
    out = subprocess.run([CLI, path, "generate", "--tokens", "5,300,7", "--max-tokens", "12",
                          "--json", "-q"], check=True, capture_output=True, text=True)
    expected = json.loads(out.stdout)["tokens"]
    r = client.completions.create(model="m", prompt=[5, 300, 7], max_tokens=12, temperature=0)
    assert r.choices[0].token_ids == expected and r.choices[0].text == ""
    assert r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="m", prompt=[5, 300, 7], max_tokens=12,
                                            temperature=0, stream=True))
    assert [c.choices[0].token_ids for c in chunks] == [[t] for t in expected] + [[]]
    assert all(c.choices[0].text == "" for c in chunks)
    for call, message in [
        (lambda: client.completions.create(model="m", prompt="text", max_tokens=2),
         "the model has no tokenizer"),
        (lambda: client.completions.create(model="m", prompt=[1], max_tokens=2, stop=["x"]),
         "no tokenizer to find stop strings"),
        (lambda: client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2),
         "chat completions need a tokenizer"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message):
            call()


def test_pool_positions_size_the_kv_pool(no_tokenizer):
    with urllib.request.urlopen(no_tokenizer[1] + "/metrics") as r:
        lines = r.read().decode().splitlines()
    # 1000 positions in pages of 16: 63 pages.
    assert "tinyloop_kv_pool_pages 63" in lines
