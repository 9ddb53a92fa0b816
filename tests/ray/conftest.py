"""A local Ray cluster on the CPU for the Ray Serve deployment's tests (scripts/test-bindings.sh,
step `ray`). Every wait here is bounded; the cluster listens on 127.0.0.1 only. The replicas'
logs stay in Ray's session folder (/tmp/ray/session_latest/logs/serve)."""

import os
import pathlib
import re
import socket
import threading
import time
import urllib.request

import pytest
import ray
import yaml
from ray import serve
from ray.serve.schema import ServeDeploySchema

import tinyloop_py
from tinyloop_py.serve import app as build_app

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = os.environ.get("TINYLOOP_DEMO_MODEL", str(ROOT / "models" / "demo.tinyloop"))
CONFIG = ROOT / "deploy" / "ray-serve.yaml"
ENGINE = "TinyLoopEngine"


def wait_for(what, check, timeout_s, period_s=0.2):
    """Poll ``check`` until it returns a true value (returned) or ``timeout_s`` passes (fail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(period_s)


@pytest.fixture(scope="session")
def cluster():
    """The cluster's HTTP address. Four logical CPUs on two cores: each engine replica takes one
    (one thread), and a killed replica's successor needs one while the others run."""
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning", log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def config_app(**overrides):
    """The application of deploy/ray-serve.yaml (checked against Serve's config schema) with
    ``overrides`` in its args: (builder args, name, route prefix)."""
    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (application,) = config.applications
    assert application.import_path == "tinyloop_py.serve:app"
    args = dict(application.args, model=MODEL, **overrides)
    return args, application.name, application.route_prefix


def deploy(args, name, route_prefix, timeout_s=180):
    """serve.run the application, failing the test if it is not running within ``timeout_s``."""
    done = {}

    def run():
        try:
            serve.run(build_app(args), name=name, route_prefix=route_prefix)
            done["ok"] = True
        except BaseException as e:  # reported below, on the test's thread
            done["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "error" in done:
        raise done["error"]
    assert done.get("ok"), f"application {name} was not running after {timeout_s} s"


def running_replicas(app_name):
    """How many engine replicas of ``app_name`` Serve reports RUNNING."""
    status = serve.status().applications.get(app_name)
    if status is None or ENGINE not in status.deployments:
        return 0
    return status.deployments[ENGINE].replica_states.get("RUNNING", 0)


def metrics(url):
    """/metrics as {(name, labels or None): value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+)(?:\{([^}]*)\})?\s+(\S+)", line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def per_replica(values, name):
    """The values of metric ``name`` by replica."""
    out = {}
    for (n, labels), v in values.items():
        m = re.fullmatch(r'replica="([^"]+)"', labels or "")
        if n == name and m:
            out[m.group(1)] = v
    return out


def kill_replica(app_name, replica):
    """ray.kill the engine replica whose Serve id is ``replica`` (found among the cluster's
    named actors: a replica actor's name ends in its id)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if ENGINE in a["name"] and a["name"].startswith(f"SERVE_REPLICA::{app_name}#")]
    (name,) = [n for n in names if n.endswith("#" + replica)]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


class Reference:
    """What one engine gives, greedily, for a text prompt: the model's own text generation in
    this process (tokenizer and end-of-sequence tokens on the Rust side)."""

    def __init__(self):
        self.model = tinyloop_py.Model(MODEL, device="cpu", log=False)
        self._lock = threading.Lock()
        self._memo = {}

    def completion(self, prompt, max_tokens):
        with self._lock:
            if (prompt, max_tokens) not in self._memo:
                self._memo[prompt, max_tokens] = self.model.generate(
                    text=prompt, max_tokens=max_tokens)
            return self._memo[prompt, max_tokens]


@pytest.fixture(scope="session")
def reference():
    ref = Reference()
    yield ref
    ref.model.close()
