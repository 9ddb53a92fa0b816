"""The Ray Serve deployment of deploy/ray-serve.yaml (two CPU replicas of the demo model)
answers the official `openai` client as `tinyloop MODEL serve` does: every response of a
concurrent burst equals what one engine gives greedily, prompts that share a prefix stay on the
replica that holds it, /metrics reports every replica, and a replica killed mid-burst loses no
request (non-streamed ones are retried on the other replica; a stream that had returned text
ends with an error naming the failure, and the client's retry completes), and deleting the
application lets a running stream finish."""

import threading
import urllib.request

import openai
import pytest
from ray import serve

from conftest import (burst, client_for, config_app, deploy, kill_replica, metrics, per_replica,
                      request, running_replicas, wait_for)

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


def test_models_health_and_response_shapes(app, client, reference):
    url, _ = app
    assert [m.id for m in client.models.list().data] == ["demo"]
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        assert r.read() == b"ok"
    r = client.completions.create(model="demo", prompt="ROMEO:", max_tokens=40, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "demo"
    assert r.choices[0].text == reference.completion("ROMEO:", 40)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 40, 46)
    chunks = list(client.completions.create(
        model="demo", prompt="ROMEO:", max_tokens=40, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "Speak, friend."}]
    c = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=24, temperature=0)
    assert c.id.startswith("chatcmpl-") and c.object == "chat.completion"
    assert c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == reference.chat(messages, 24)
    streamed = list(client.chat.completions.create(
        model="demo", messages=messages, max_tokens=24, temperature=0, stream=True))
    assert streamed[0].object == "chat.completion.chunk"
    assert streamed[0].choices[0].delta.role == "assistant"
    text = "".join(s.choices[0].delta.content or "" for s in streamed)
    assert text == reference.chat(messages, 24)


def test_stop_strings_end_the_text_before_them(client, reference):
    full = reference.completion("ROMEO:", 60)
    stop = full[10:14]
    r = client.completions.create(
        model="demo", prompt="ROMEO:", max_tokens=60, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].text == reference.completion("ROMEO:", 60, stop=[stop])
    assert r.choices[0].finish_reason == "stop"


def test_bad_requests_are_400_with_a_message(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="demo", prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="only n = 1"):
        client.completions.create(model="demo", prompt="x", max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="loops must be in"):
        client.completions.create(model="demo", prompt="x", max_tokens=2, extra_body={"loops": 0})
    with pytest.raises(openai.BadRequestError, match="below vocab_size 256"):
        client.completions.create(model="demo", prompt=[1, 2, 300], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content must be a string"):
        client.chat.completions.create(model="demo", messages=[{"role": "user"}], max_tokens=2)


def test_a_burst_of_concurrent_clients_all_complete_on_both_replicas(app, client, reference):
    url, _ = app
    before = per_replica(metrics(url), "tinyloop_engine_tokens_total")
    cases = []
    for i in range(16):
        prompt = PROMPTS[i % len(PROMPTS)]
        kind, stream = ("completion", "chat")[i % 4 >= 2], bool(i % 2)
        if kind == "completion":
            cases.append((dict(prompt=prompt), reference.completion(prompt, 24)))
        else:
            messages = [{"role": "user", "content": prompt}]
            cases.append((dict(messages=messages), reference.chat(messages, 24)))
        cases[-1] = (kind, stream) + cases[-1]
    results = burst([lambda c=c: request(client, c[0], c[1], 24, **c[2]) for c in cases], 300)
    assert results == [("ok", c[3]) for c in cases]
    # The engine stats reach /metrics within a period of the replicas' reports (1 s).
    def both_worked():
        after = per_replica(metrics(url), "tinyloop_engine_tokens_total")
        grew = [r for r in after if after[r] > before.get(r, 0)]
        return len(after) == 2 and len(grew) == 2
    wait_for("both replicas to report tokens of the burst", both_worked, 30)
    values = metrics(url)
    assert values[("tinyloop_requests_total", 'endpoint="completions",status="200"')] >= 8
    assert values[("tinyloop_requests_total", 'endpoint="chat_completions",status="200"')] >= 8
    assert values[("tinyloop_engine_replicas", None)] == 2
    assert sum(per_replica(values, "tinyloop_kv_pool_pages").values()) > 0


def test_prompts_sharing_a_prefix_stay_on_its_replica(client):
    # Two system prompts of 200 characters (12 whole KV pages of 16 byte-tokens each).
    families = {name: f"{name}: " + "Speak the speech, I pray you, trippingly. " * 5
                for name in ("CHORUS", "PROLOGUE")}
    families = {k: v[:200] for k, v in families.items()}
    seen = {}
    for i in range(3):
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
    """Serve stops the replicas, and each drains what it holds before its engine closes."""
    _, name = app
    stream = iter(client.completions.create(
        model="demo", prompt="ROMEO:", max_tokens=96, temperature=0, stream=True))
    first = next(stream)
    deleting = threading.Thread(target=serve.delete, args=(name,))
    deleting.start()
    rest = list(stream)
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
    assert text == reference.completion("ROMEO:", 96)
    assert rest[-1].choices[0].finish_reason == "length"
    deleting.join(120)
    assert not deleting.is_alive(), "serve.delete did not return"
    assert name not in serve.status().applications
