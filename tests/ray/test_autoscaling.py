"""Autoscaling on queue length: an application that starts with one engine replica grows to two
under a burst (Serve's target of ongoing requests per replica, which counts what each engine
is running and holding in its queue), and the new replica serves requests; every response still
equals what one engine gives."""

import pytest
from ray import serve

from conftest import config_app, deploy, metrics, per_replica, running_replicas, wait_for
from openai_checks import burst, client_for, request


@pytest.fixture(scope="module")
def app(cluster):
    args, _, _ = config_app(
        replicas=None, min_replicas=1, max_replicas=2, target_ongoing_requests=2,
        upscale_delay_s=0, look_back_period_s=1, metrics_interval_s=0.5, downscale_delay_s=600)
    name = "autoscaling"
    deploy(args, name, "/")
    yield cluster, name
    serve.delete(name)


def test_one_replica_grows_to_two_under_load(app, reference):
    url, name = app
    client = client_for(url)
    assert running_replicas(name) == 1
    prompts = [f"ROMEO {i}:" for i in range(8)]
    expected = [reference.completion(p, 200) for p in prompts]
    # The burst's requests ask for 200 tokens each: it keeps the one replica loaded beyond its
    # target (2 ongoing) while Serve scales up.
    first = [lambda p=p, s=i % 2: request(client, "completion", bool(s), 200, prompt=p)
             for i, p in enumerate(prompts)]

    def while_loaded():
        wait_for("a second replica", lambda: running_replicas(name) == 2, 120)
        # Requests sent now find the new replica idle; they go there.
        late = [f"JULIET {i}:" for i in range(4)]
        out = burst([lambda p=p: request(client, "completion", False, 24, prompt=p) for p in late],
                    120)
        assert out == [("ok", reference.completion(p, 24)) for p in late]
        return True

    results = burst(first + [while_loaded], 300)
    assert results == [("ok", e) for e in expected] + [("ok", True)]

    def both_worked():
        tokens = per_replica(metrics(url), "tinyloop_engine_tokens_total")
        return len(tokens) == 2 and all(v > 0 for v in tokens.values())
    wait_for("both replicas to report generated tokens", both_worked, 30)
