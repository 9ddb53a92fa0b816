"""Fixtures: synthetic byte-vocabulary models, made once per test session.

TINYLOOP_TEST_MODEL names an existing model to use instead of the `tiny` preset; otherwise the
`tinyloop` CLI (TINYLOOP_BIN, or target/release|debug/tinyloop above this folder) synthesizes
it. The looped families' presets (`tiny-sandwich`, `tiny-recurrent`) are always synthesized.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def _find_cli():
    explicit = os.environ.get("TINYLOOP_BIN")
    if explicit:
        return explicit
    here = Path(__file__).resolve().parent
    for folder in [here, *here.parents]:
        for profile in ("release", "debug"):
            candidate = folder / "target" / profile / "tinyloop"
            if candidate.is_file():
                return str(candidate)
    return shutil.which("tinyloop")


def _synth(tmp_path_factory, preset, *args, cli=None):
    """The path of a model of ``preset`` (seed 1) the CLI synthesizes, with extra ``args``."""
    cli = cli or _find_cli()
    if cli is None:
        pytest.fail(f"no tinyloop CLI to synthesize the {preset} model; set TINYLOOP_BIN")
    path = tmp_path_factory.mktemp("models") / f"{preset}.tinyloop"
    subprocess.run(
        [cli, "synth", "--preset", preset, "--seed", "1", *args, "--out", str(path)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return str(path)


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    return os.environ.get("TINYLOOP_TEST_MODEL") or _synth(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def sandwich_model_path(tmp_path_factory):
    """Ouro's architecture: sandwich norms and an exit gate (no default exit threshold)."""
    return _synth(tmp_path_factory, "tiny-sandwich")


@pytest.fixture(scope="session")
def recurrent_model_path(tmp_path_factory):
    """Huginn's architecture: the loop starts from a random state."""
    return _synth(tmp_path_factory, "tiny-recurrent")


@pytest.fixture
def model(model_path):
    import tinyloop_py

    m = tinyloop_py.Model(model_path, max_seq_len=256, device="cpu", log=False)
    yield m
    m.close()


PROMPT = [82, 79, 77, 69, 79, 58]  # "ROMEO:"


@pytest.fixture(scope="session")
def text_model_path(tmp_path_factory):
    """A model with a stored Hugging Face tokenizer (the repository's tests/data/tokenizer:
    byte-level BPE, 384 tokens, ChatML template): TINYLOOP_TEST_TEXT_MODEL, or synthesized by
    the CLI from the repository it was built in."""
    explicit = os.environ.get("TINYLOOP_TEST_TEXT_MODEL")
    if explicit:
        return explicit
    cli = _find_cli()
    if cli is None:
        pytest.fail("no tinyloop CLI to synthesize a test model; set TINYLOOP_TEST_TEXT_MODEL")
    # target/<profile>/tinyloop in a checkout.
    tokenizer = Path(cli).resolve().parents[2] / "tests" / "data" / "tokenizer"
    return _synth(tmp_path_factory, "tiny", "--tokenizer", str(tokenizer), cli=cli)


@pytest.fixture
def text_model(text_model_path):
    import tinyloop_py

    m = tinyloop_py.Model(text_model_path, max_seq_len=256, device="cpu", log=False)
    yield m
    m.close()
