"""The Ray Serve deployment of deploy/ray-serve.yaml (two CPU replicas of the demo model)
answers the official `openai` client as `tinyloop MODEL serve` does: every response of a
concurrent burst equals what one engine gives greedily, prompts that share a prefix stay on the
replica that holds it, /metrics reports every replica, and a replica killed mid-burst loses no
request (non-streamed ones are retried on the other replica; a stream that had returned text
ends with an error naming the failure, and the client's retry completes), and deleting the
application lets a running stream finish."""

import threading
import time
import urllib.request

import openai
import pytest
from ray import serve

import openai_checks
from conftest import (config_app, deploy, kill_replica, metrics, per_replica, running_replicas,
                      wait_for)
from openai_checks import burst, client_for, request, transcript

PROMPTS = ["ROMEO:", "JULIET:", "HAMLET:", "KING HENRY:"]


@pytest.fixture(scope="module")
def app(cluster):
    args, name, prefix = config_app()
    assert args["replicas"] == 2 and args["device"] == "cpu"
    deploy(args, name, prefix)
    yield cluster, name
    serve.delete(name)  # a no-op when the last test deleted it


@pytest.fixture(scope="module")
def client(app):
    return client_for(app[0])


def test_models_and_health(app, client):
    openai_checks.check_models(client)
    with urllib.request.urlopen(app[0] + "/health", timeout=30) as r:
        assert r.read() == b"ok"


def test_completions_equal_one_engine_streamed_or_not(client, reference):
    openai_checks.check_completions(client, reference.completion)


def test_chat_completions_equal_one_engine_streamed_or_not(client, reference):
    openai_checks.check_chat(client, reference.completion)


def test_choices_carry_their_token_ids_when_asked(client, reference):
    openai_checks.check_token_ids(client, reference.completion)


def test_stop_strings_end_the_text_before_them(client, reference):
    openai_checks.check_stop_strings(client, reference.completion)


def test_bad_requests_are_400_with_a_message(client):
    openai_checks.check_bad_requests(client)


def test_a_burst_of_concurrent_clients_all_complete_on_both_replicas(app, client, reference):
    url, _ = app
    ok = {kind: ("tinyloop_requests_total", f'endpoint="{kind}",status="200"')
          for kind in ("completions", "chat_completions")}
    before = metrics(url)
    cases = []  # (kind, stream, request fields, expected text)
    for i in range(16):
        prompt, stream = PROMPTS[i % len(PROMPTS)], bool(i % 2)
        if i % 4 < 2:
            cases.append(("completion", stream, dict(prompt=prompt),
                          reference.completion(prompt, 24)))
        else:
            messages = [{"role": "user", "content": prompt}]
            cases.append(("chat", stream, dict(messages=messages),
                          reference.completion(transcript(messages), 24)))
    results = burst([lambda c=c: request(client, c[0], c[1], 24, **c[2]) for c in cases], 300)
    assert results == [("ok", c[3]) for c in cases]
    tokens_before = per_replica(before, "tinyloop_engine_tokens_total")

    # The engine stats reach /metrics within a period of the replicas' reports (1 s).
    def both_worked():
        after = per_replica(metrics(url), "tinyloop_engine_tokens_total")
        grew = [r for r in after if after[r] > tokens_before.get(r, 0)]
        return len(after) == 2 and len(grew) == 2
    wait_for("both replicas to report tokens of the burst", both_worked, 30)
    after = metrics(url)
    # The ingress counts each response once: 8 completions and 8 chats, all 200.
    assert {k: after[key] - before.get(key, 0) for k, key in ok.items()} == {
        "completions": 8, "chat_completions": 8}
    assert after[("tinyloop_engine_replicas", None)] == 2
    assert all(v > 0 for v in per_replica(after, "tinyloop_kv_pool_pages").values())


def test_prompts_sharing_a_prefix_stay_on_its_replica(client):
    # Two system prompts of 200 characters: the first 12 whole KV pages (16 byte-tokens each,
    # 192 tokens) of every later request of a family are those its first request computed.
    families = {name: (f"{name}: " + "Speak the speech, I pray you, trippingly. " * 5)[:200]
                for name in ("CHORUS", "PROLOGUE")}
    seen = {}
    # Four later requests per family: power of two choices alone would keep all eight where
    # their family started with probability 1/256.
    for i in range(5):
        for name, system in families.items():
            raw = client.completions.with_raw_response.create(
                model="demo", prompt=f"{system}\nQuestion {i}:", max_tokens=4, temperature=0)
            r = raw.parse()
            replica = raw.headers["x-tinyloop-replica"]
            cached = r.usage.prompt_tokens_details.cached_tokens
            if i == 0:
                seen[name] = replica
                continue
            # The router sent it where its prefix is: its pages came from that engine's cache.
            assert replica == seen[name], (name, i)
            assert cached >= 192, (name, i, cached)


def test_killing_a_replica_mid_burst_loses_no_request(app, client, reference):
    url, name = app
    cases = []
    for i in range(12):
        prompt = f"{PROMPTS[i % len(PROMPTS)]} {i}"
        cases.append((bool(i % 2), prompt, reference.completion(prompt, 128)))
    jobs = [lambda c=c: request(client, "completion", c[0], 128, prompt=c[1]) for c in cases]
    retries_before = metrics(url)[("tinyloop_replica_retries_total", None)]

    def busy_replica():
        running = per_replica(metrics(url), "tinyloop_running_requests")
        if len(running) == 2 and all(v > 0 for v in running.values()):
            return max(running, key=running.get)
        return None

    victim = {}

    def kill_when_busy():
        victim["id"] = wait_for("both replicas to run requests", busy_replica, 60)
        kill_replica(name, victim["id"])

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    results = burst(jobs, 300)
    killer.join(60)
    assert "id" in victim, "the replica was not killed"

    failed = []
    for (stream, prompt, expected), (status, value) in zip(cases, results):
        if status == "ok":
            assert value == expected, prompt
            continue
        # Only a stream that had returned text fails, and the client sees why.
        assert stream, f"non-streamed request {prompt!r} failed: {value!r}"
        assert isinstance(value, openai.APIError), repr(value)
        assert "died" in str(value) and "send the request again" in str(value), str(value)
        failed.append((prompt, expected))
    # Each failed stream, sent again by the client, completes.
    for prompt, expected in failed:
        assert request(client, "completion", True, 128, prompt=prompt) == expected
    retried = metrics(url)[("tinyloop_replica_retries_total", None)] - retries_before
    assert failed or retried > 0, "the kill hit no request: nothing was tested"
    print(f"killed replica {victim['id']}: {retried:.0f} requests sent again by the ingress, "
          f"{len(failed)} streams ended with an error and were sent again by the client")

    # Serve replaces the killed replica.
    def replaced():
        running = per_replica(metrics(url), "tinyloop_running_requests")
        return running_replicas(name) == 2 and victim["id"] not in running
    wait_for("Serve to replace the killed replica", replaced, 120)


def test_deleting_the_application_lets_a_running_stream_finish(app, client, reference):
    """Serve stops the replicas, and each drains what it holds before its engine closes (an
    engine closed early would cut the stream with an error)."""
    _, name = app
    # 256 tokens: seconds of generation on one engine thread.
    stream = client.completions.create(
        model="demo", prompt="ROMEO:", max_tokens=256, temperature=0, stream=True)
    chunks, started = [], threading.Event()

    def read():  # each chunk with the time it arrived
        for c in stream:
            chunks.append((time.monotonic(), c))
            started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60), "no chunk within 60 s"
    deleting = threading.Thread(target=serve.delete, args=(name,))
    deleting.start()
    wait_for("the application to be deleting",
             lambda: serve.status().applications[name].status == "DELETING", 30)
    deleting_seen = time.monotonic()
    reader.join(120)
    assert not reader.is_alive(), "the stream did not end within 120 s"
    text = "".join(c.choices[0].text for _, c in chunks)
    assert text == reference.completion("ROMEO:", 256)
    assert chunks[-1][1].choices[0].finish_reason == "length"
    # The stream was still running when the deletion had begun: the replica drained it.
    late = sum(1 for t, c in chunks if t > deleting_seen and c.choices[0].text)
    assert late, "the stream had ended before the application was seen deleting: nothing was tested"
    print(f"{late} of {len(chunks)} chunks arrived after the application was seen deleting")
    deleting.join(120)
    assert not deleting.is_alive(), "serve.delete did not return"
    assert name not in serve.status().applications
