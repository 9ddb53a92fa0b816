"""Rust CPU logits (through the Python binding) against the independent NumPy reference
tools/reference.py, on the bundled demo model and on the GQA / LayerNorm / k=2 / post-block
variant with a factorized embedding and tied head."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tinyloop_py

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import reference  # noqa: E402

CLI = ROOT / "target" / "release" / "tinyloop"

# Relative L2 error allowed between the runtime (f32 accumulation) and the reference (f64, the
# same f16 rounding points). Where both round an activation to the same f16 value they agree to
# ~1e-6; where f32 and f64 straddle an f16 rounding boundary one activation differs by one f16
# ulp (2^-11 relative), moving that position's logits by ~1e-4. The worst measured over these
# cases is 4.3e-4 (tiny-gqa, loops 8; printed by `pytest -s`); a wrong op, index or scale moves
# logits by O(1).
TOLERANCE = 2e-3


def model_path(name, tmp_path_factory):
    if name == "demo":
        return ROOT / "models" / "demo.tinyloop"
    path = tmp_path_factory.mktemp("models") / f"{name}.tinyloop"
    subprocess.run([str(CLI), "synth", "--preset", name, "--seed", "7", "--bits", "4",
                    "--group-size", "32", "--out", str(path)], check=True, capture_output=True)
    return path


@pytest.mark.parametrize("name", ["demo", "tiny-gqa"])
@pytest.mark.parametrize("loops", [1, 3, 8])
def test_rust_cpu_logits_match_numpy_reference(name, loops, tmp_path_factory):
    path = model_path(name, tmp_path_factory)
    tokens = list(b"ROMEO:\nWhat light through yonder")
    with tinyloop_py.Model(str(path), device="cpu", max_seq_len=64) as model:
        got = model.score(tokens, loops=loops).astype(np.float64)
    want = np.asarray(reference.logits(str(path), tokens, loops), dtype=np.float64)
    assert got.shape == want.shape == (len(tokens), 256)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f"{name} loops={loops}: relative error {rel:.2e}")
    assert rel < TOLERANCE


@pytest.mark.parametrize("loops", [1, 4])
def test_decode_path_logprobs_match_numpy_reference(loops, tmp_path_factory):
    # Each token fed as its own decode step (as generation runs) against the reference's
    # log-softmax. A log-probability l[t] - logsumexp(l) moves by at most twice the largest change
    # of its row's logits, and the logits agree to TOLERANCE relative to the row's largest
    # magnitude (the argument above, per element); a wrong position, row or cache entry in the
    # decode path moves log-probabilities by O(1) nats.
    path = model_path("tiny-gqa", tmp_path_factory)
    tokens = list(b"ROMEO:\nWhat light through yonder")
    with tinyloop_py.Model(str(path), device="cpu", max_seq_len=64) as model:
        got = model.logprobs(tokens, loops=loops, decode_path=True).astype(np.float64)
    rows = np.asarray(reference.logits(str(path), tokens, loops), dtype=np.float64)[:-1]
    top = rows.max(axis=1, keepdims=True)
    want = rows - (top + np.log(np.exp(rows - top).sum(axis=1, keepdims=True)))
    want = want[np.arange(len(tokens) - 1), tokens[1:]]
    bound = 2 * TOLERANCE * np.abs(rows).max(axis=1)
    err = np.abs(got - want)
    print(f"tiny-gqa loops={loops}: decode-path logprob error {err.max():.2e} (worst ratio to "
          f"bound {(err / bound).max():.2e})")
    assert (err <= bound).all()


def test_logit_lens_matches_numpy_reference(tmp_path_factory):
    # tiny-gqa has a post block: each lens row runs it on a copy of the stream after that
    # iteration. The rows are logits, held to the logits' TOLERANCE.
    path = model_path("tiny-gqa", tmp_path_factory)
    tokens = list(b"ROMEO:\nWhat light")
    with tinyloop_py.Model(str(path), device="cpu", max_seq_len=64) as model:
        got = model.score_logit_lens(tokens, loops=4).astype(np.float64)
    want = np.asarray(reference.logit_lens(str(path), tokens, 4), dtype=np.float64)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f"tiny-gqa logit lens (4 loops): relative error {rel:.2e}")
    assert rel < TOLERANCE
