"""Fixtures: a synthetic byte-vocabulary model, made once per test session.

TINYLOOP_TEST_MODEL names an existing model to use instead; otherwise the `tinyloop` CLI
(TINYLOOP_BIN, or target/release|debug/tinyloop above this folder) synthesizes the `tiny` preset.
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


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    explicit = os.environ.get("TINYLOOP_TEST_MODEL")
    if explicit:
        return explicit
    cli = _find_cli()
    if cli is None:
        pytest.fail("no tinyloop CLI to synthesize a test model; set TINYLOOP_BIN or TINYLOOP_TEST_MODEL")
    path = tmp_path_factory.mktemp("models") / "tiny.tinyloop"
    subprocess.run(
        [cli, "synth", "--preset", "tiny", "--seed", "1", "--out", str(path)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return str(path)


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
    path = tmp_path_factory.mktemp("models") / "tiny-text.tinyloop"
    subprocess.run(
        [cli, "synth", "--preset", "tiny", "--seed", "1", "--tokenizer", str(tokenizer),
         "--out", str(path)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return str(path)


@pytest.fixture
def text_model(text_model_path):
    import tinyloop_py

    m = tinyloop_py.Model(text_model_path, max_seq_len=256, device="cpu", log=False)
    yield m
    m.close()
