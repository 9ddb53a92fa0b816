"""The application builder's arguments: a bad one is an error that names it, from Python and
from `serve run` (which builds the application before it starts a cluster); `import
tinyloop_py` does not import Ray."""

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from conftest import MODEL
from tinyloop_py.serve import Options, app
from tinyloop_py.serve.app import ENGINE_ARGS, MODEL_ARGS


@pytest.mark.parametrize("args, message", [
    ({"model": MODEL, "kv_mod": "fp16"}, "unknown option 'kv_mod'"),
    ({"replicas": "2"}, "model"),
    ({"model": MODEL + ".missing"}, "is not a file"),
    ({"model": MODEL, "device": "tpu"}, "device"),
    ({"model": MODEL, "replicas": "two"}, "replicas"),
    ({"model": MODEL, "replicas": 2, "max_replicas": 3}, "not both"),
    ({"model": MODEL, "min_replicas": 3, "max_replicas": 2}, "below min_replicas"),
    ({"model": MODEL, "routing": "random"}, "routing"),
])
def test_a_bad_argument_is_an_error_naming_it(args, message):
    with pytest.raises(ValidationError, match=message):
        app(args)


def test_command_line_strings_become_the_options():
    o = Options(**{"model": MODEL, "replicas": "2", "loops": "4", "device": "cpu"})
    assert (o.replicas, o.loops, o.served_name) == (2, 4, "demo")
    # The model and engine take only the options given; the rest keep the binding's defaults.
    assert (o.args(MODEL_ARGS), o.args(ENGINE_ARGS)) == ({"device": "cpu"}, {})
    set_ = Options(**{"model": MODEL, "kv_mode": "int8", "max_running": "8"})
    assert set_.args(MODEL_ARGS) == {"device": "cpu", "kv_mode": "int8"}
    assert set_.args(ENGINE_ARGS) == {"max_running": 8}
    engine = o.engine_deployment()
    assert engine["num_replicas"] == 2 and "autoscaling_config" not in engine
    assert engine["ray_actor_options"]["num_cpus"] == 1
    assert "num_gpus" not in engine["ray_actor_options"]
    gpu = Options(model=MODEL, device="cuda", min_replicas=1, max_replicas=4).engine_deployment()
    assert gpu["ray_actor_options"]["num_gpus"] == 1
    scaling = gpu["autoscaling_config"]
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 4)


def test_serve_run_names_an_unknown_argument():
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    command = [serve_cli, "run", "tinyloop_py.serve:app", f"model={MODEL}", "kv_mod=fp16"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "unknown option 'kv_mod'" in out.stderr


def test_importing_the_core_package_does_not_import_ray():
    code = ("import sys, tinyloop_py\n"
            "print(sorted(m for m in ('ray', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.strip() == "[]"
