#!/usr/bin/env python3
"""Tiny Hugging Face checkpoints of Ouro and Huginn-0125, and the outputs of the models' own
reference PyTorch code on them (tests/data/hf/).

    python3 tools/hf_reference.py --huginn-src HUGINN --ouro-src OURO [--out tests/data/hf]
                                  [--tokenizer-dir tests/data/tokenizer]

HUGINN and OURO are the reference implementations, each given either as a git clone (bare or
not) of the public repository, from which the pinned commit's files are read with `git show`,
or as a folder that holds the files (under their repository paths or by their base names):

    Huginn-0125  https://github.com/seal-rg/recurrent-pretraining
                 commit 59e0b69b2d96a59cbbe79c9d5034d89ecb5ab6f6
                 recpre/raven_modeling_minimal.py, recpre/raven_config_minimal.py
    Ouro         https://github.com/LoopedLMs/ouro_rl
                 commit 531187ba2862d53c4cd9b2fe74fa5970d6c4e3f6
                 ouro_rl/modeling/modeling_ouro.py, ouro_rl/modeling/configuration_ouro.py
                 (a copy of the modeling_ouro.py published with ByteDance/Ouro-1.4B)

The files are checked against the SHA-256 sums below, written to a temporary folder, imported
from there and deleted at exit: none of their code is part of this repository. Nothing is
fetched from the network. The environment this was run with (any CPU machine):

    python3 -m venv /work/venv-ref
    /work/venv-ref/bin/pip install torch==2.9.1 transformers==4.57.6 safetensors numpy tokenizers

(transformers 4.57.6 is the version ouro_rl pins as its minimum; both reference files import
and run with it unmodified, so no shim is applied. torch 2.9.1 is the one ouro_rl pins.)

What it writes, for each of ouro-tiny/ and huginn-tiny/ (tests/data/hf/README.md has the full
list): a checkpoint folder in the model's published layout (config.json with the real model's
keys at tiny sizes, safetensors weights under the real tensor names, generation_config.json,
and tokenizer.json + tokenizer_config.json copied from --tokenizer-dir when that folder holds
them), and reference/ with reference.json and raw little-endian .f32 / .i32 arrays.

The weights are seeded random values (one NumPy generator per tensor, seeded by the tensor's
name), scaled so that activations stay healthy, and every stored value is exactly representable
in IEEE half precision (rounded to bf16 for Ouro's BF16 checkpoint, to f16 for Huginn's F32 one;
|w| < 2^-14 set to 0 so no f16 subnormal occurs). The checkpoints are written by the reference
classes' own save_pretrained, then loaded back with from_pretrained (checking that no tensor is
missing or unexpected and that every loaded value equals the generated one) before the
reference outputs are computed, in float32 on the CPU with one thread.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent

SOURCES = {
    "huginn": {
        "repository": "https://github.com/seal-rg/recurrent-pretraining",
        "commit": "59e0b69b2d96a59cbbe79c9d5034d89ecb5ab6f6",
        "package": "_hf_ref_huginn",
        "files": {
            # module name in the temporary package: (path in the repository, sha256)
            "raven_modeling_minimal.py": (
                "recpre/raven_modeling_minimal.py",
                "18fcacd53fb5696a76c0d3bda44480f2f3900aa9659c137a08962c593a9a9e42",
            ),
            "raven_config_minimal.py": (
                "recpre/raven_config_minimal.py",
                "36a39939e76dc9e8f7563187c6498e012ca7f64a3d86b32ff1daa7f4c41a4278",
            ),
        },
    },
    "ouro": {
        "repository": "https://github.com/LoopedLMs/ouro_rl",
        "commit": "531187ba2862d53c4cd9b2fe74fa5970d6c4e3f6",
        "package": "_hf_ref_ouro",
        "files": {
            "modeling_ouro.py": (
                "ouro_rl/modeling/modeling_ouro.py",
                "7978572418fbb2f7dd092a47366b751c434096aeebcc2ea214c4db8f9364d5d2",
            ),
            "configuration_ouro.py": (
                "ouro_rl/modeling/configuration_ouro.py",
                "61ebf88ccd9ab921717bb2509872d3e394796c0b5afb7c1f337872126d4f04b2",
            ),
        },
    },
}

SEED = 20250125
PROMPT_LEN = 24
GEN_PROMPT_LEN = 12
GEN_NEW_TOKENS = 16
PROMPT_ID_LIMIT = 381  # prompt ids are drawn below the tokenizer's special tokens (381..383)

# ---------------------------------------------------------------------------------------------
# Tiny configurations. Key sets: what the reference config classes' save_pretrained writes (the
# way the published config.json files were made), with "torch_dtype" as the published files
# spell it; values as the published models have them except for the sizes.
# ---------------------------------------------------------------------------------------------

OURO_HIDDEN = 64
OURO_CONFIG = {
    "architectures": ["OuroForCausalLM"],
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_ouro.OuroConfig",
        "AutoModel": "modeling_ouro.OuroModel",
        "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
    },
    "bos_token_id": 0,
    "early_exit_threshold": 1.0,
    "eos_token_id": 0,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": OURO_HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "layer_types": ["full_attention", "full_attention"],
    "max_position_embeddings": 256,
    "max_window_layers": 2,
    "model_type": "ouro",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "total_ut_steps": 4,
    "transformers_version": None,  # filled in with the version that wrote the checkpoint
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 512,
}

HUGINN_HIDDEN = 64
HUGINN_ARGS = dict(  # RavenConfig constructor arguments; the written keys come from the class
    n_embd=HUGINN_HIDDEN,
    n_heads=4,
    n_layers=6,  # prelude + recurrent block + coda, as the class documents
    block_size=256,
    vocab_size=512,
    padding_multiple=4096,
    tie_embeddings=True,
    intermediate_size=128,
    bias=False,
    norm_eps=1e-06,
    n_layers_in_recurrent_block=2,
    mean_recurrence=4,
    mean_backprop_depth=8,
    n_layers_in_prelude=2,
    n_layers_in_coda=2,
    qk_bias=True,
    rope_base=50000,
)

# Weight scales (standard deviations in units of 1/sqrt(fan_in) unless noted).
OURO_SCALES = dict(embed=1.0, qk=1.25, v=1.0, o=1.0, mlp_in=1.0, mlp_out=1.0, head=2.5,
                   norm_noise=0.1, gate=2.0, gate_bias=-3.4)
HUGINN_SCALES = dict(embed=0.3, qk=1.25, v=1.0, o=1.0, mlp_in=1.0, mlp_out=1.0,
                     adapter_state=0.5, adapter_embed=1.0, qk_bias=0.5, norm_noise=0.1)

HUGINN_STEPS = (1, 3, 8)
HUGINN_PER_STEP_MAX = 8
HUGINN_GEN_STEPS = 4
HUGINN_ADAPTIVE_MAX_STEPS = 32
OURO_STEPS = (1, 2, 4)
OURO_THRESHOLDS = (0.3, 0.5, 0.7, 0.9)
OURO_GEN_THRESHOLD = 0.5

# explicit thresholds for the adaptive-exit runs (besides each criterion's "auto" default)
HUGINN_EXPLICIT_THRESHOLDS = {
    "entropy-diff": 0.02,
    "latent-diff": 0.1,
    "cosine": 0.005,
    "kl": 0.005,
    "minp-kl": 0.001,
    "argmax-stability": 2,
}


# ---------------------------------------------------------------------------------------------
# Reference sources
# ---------------------------------------------------------------------------------------------


def _is_git_repo(path: Path, commit: str) -> bool:
    try:
        subprocess.run(["git", "-C", str(path), "cat-file", "-e", commit + "^{commit}"],
                       check=True, capture_output=True)
        return True
    except (subprocess.CalledProcessError, FileNotFoundError):
        return False


def read_sources(kind: str, src: Path) -> dict[str, bytes]:
    """The pinned files of one reference, as bytes, checked against their SHA-256 sums."""
    spec = SOURCES[kind]
    out = {}
    use_git = _is_git_repo(src, spec["commit"])
    for name, (repo_path, sha) in spec["files"].items():
        if use_git:
            data = subprocess.run(["git", "-C", str(src), "show", f"{spec['commit']}:{repo_path}"],
                                  check=True, capture_output=True).stdout
        else:
            for cand in (src / repo_path, src / name, src / Path(repo_path).name):
                if cand.is_file():
                    data = cand.read_bytes()
                    break
            else:
                raise SystemExit(f"{kind}: {repo_path} not found under {src} (and {src} is not a "
                                 f"git repository holding commit {spec['commit']})")
        got = hashlib.sha256(data).hexdigest()
        if got != sha:
            raise SystemExit(f"{kind}: {repo_path} has sha256 {got}, expected {sha} (the file at "
                             f"commit {spec['commit']} of {spec['repository']})")
        out[name] = data
    return out


def import_reference(kind: str, src: Path, tmp: Path):
    """Write the pinned files into a temporary package and import its modules."""
    spec = SOURCES[kind]
    pkg = tmp / spec["package"]
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, data in read_sources(kind, src).items():
        (pkg / name).write_bytes(data)
    if str(tmp) not in sys.path:
        sys.path.insert(0, str(tmp))
    if kind == "huginn":
        return importlib.import_module(spec["package"] + ".raven_modeling_minimal")
    cfg = importlib.import_module(spec["package"] + ".configuration_ouro")
    mod = importlib.import_module(spec["package"] + ".modeling_ouro")
    return mod, cfg


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def tensor_rng(name: str) -> np.random.Generator:
    return np.random.default_rng([SEED, zlib.crc32(name.encode())])


def half_exact(a: np.ndarray, via_bf16: bool) -> np.ndarray:
    """Round to bf16 (or f16), flush |w| < 2^-14 to zero; check f16 (and bf16) exactness."""
    import torch

    a = np.ascontiguousarray(a, dtype=np.float32)
    if via_bf16:
        a = torch.from_numpy(a).to(torch.bfloat16).to(torch.float32).numpy().copy()
    else:
        a = a.astype(np.float16).astype(np.float32)
    a[np.abs(a) < 2.0 ** -14] = 0.0
    assert np.array_equal(a.astype(np.float16).astype(np.float32), a), "not f16-exact"
    if via_bf16:
        b = torch.from_numpy(a).to(torch.bfloat16).to(torch.float32).numpy()
        assert np.array_equal(b, a), "not bf16-exact"
    return a


def normal(name: str, shape, std: float) -> np.ndarray:
    return tensor_rng(name).standard_normal(shape) * std


def ouro_weight(name: str, shape) -> np.ndarray:
    s = OURO_SCALES
    fan_in = shape[-1]
    if name.endswith("layernorm.weight") or "layernorm_2" in name or name == "model.norm.weight":
        return 1.0 + normal(name, shape, s["norm_noise"])
    if name == "model.embed_tokens.weight":
        return normal(name, shape, s["embed"])
    if name == "lm_head.weight":
        return normal(name, shape, s["head"] / np.sqrt(fan_in))
    if name == "model.early_exit_gate.weight":
        return normal(name, shape, s["gate"] / np.sqrt(fan_in))
    if name == "model.early_exit_gate.bias":
        return np.full(shape, s["gate_bias"]) + normal(name, shape, 0.05)
    for key, scale in (("q_proj", "qk"), ("k_proj", "qk"), ("v_proj", "v"), ("o_proj", "o"),
                       ("gate_proj", "mlp_in"), ("up_proj", "mlp_in"), ("down_proj", "mlp_out")):
        if name.endswith(key + ".weight"):
            return normal(name, shape, s[scale] / np.sqrt(fan_in))
    raise KeyError(f"no weight rule for Ouro tensor {name}")


def huginn_weight(name: str, shape) -> np.ndarray:
    s = HUGINN_SCALES
    d = HUGINN_HIDDEN
    if ".norm_" in name or name == "transformer.ln_f.weight":
        return 1.0 + normal(name, shape, s["norm_noise"])
    if name == "transformer.wte.weight":
        return normal(name, shape, s["embed"])
    if name.endswith("attn.qk_bias"):
        return normal(name, shape, s["qk_bias"])
    if name.endswith("attn.Wqkv.weight"):
        w = normal(name, shape, 1.0 / np.sqrt(d))
        w[: 2 * d] *= s["qk"]  # rows: q (n_embd), k (n_kv*head_dim = n_embd), v
        w[2 * d:] *= s["v"]
        return w
    if name.endswith("attn.proj.weight"):
        return normal(name, shape, s["o"] / np.sqrt(shape[1]))
    if name.endswith("mlp.fc.weight"):
        return normal(name, shape, s["mlp_in"] / np.sqrt(shape[1]))
    if name.endswith("mlp.proj.weight"):
        return normal(name, shape, s["mlp_out"] / np.sqrt(shape[1]))
    if name == "transformer.adapter.weight":
        w = normal(name, shape, 1.0 / np.sqrt(shape[1]))
        w[:, :d] *= s["adapter_state"]  # columns: [recurrent state, prelude output]
        w[:, d:] *= s["adapter_embed"]
        return w
    raise KeyError(f"no weight rule for Huginn tensor {name}")


def fill_model(model, rule, via_bf16: bool, skip=()) -> dict[str, np.ndarray]:
    import torch

    sd = model.state_dict()
    values = {}
    with torch.no_grad():
        for name, t in sd.items():
            if name in skip:
                continue
            values[name] = half_exact(rule(name, tuple(t.shape)), via_bf16)
            t.copy_(torch.from_numpy(values[name]))
    return values


def check_loaded(model, values: dict[str, np.ndarray], info: dict, allow_missing=()):
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        bad = [k for k in info.get(key, []) if k not in allow_missing]
        assert not bad, f"from_pretrained {key}: {bad}"
    sd = model.state_dict()
    for name, v in values.items():
        got = sd[name].detach().to("cpu").float().numpy()
        assert np.array_equal(got, v), f"loaded {name} differs from the generated values"


# ---------------------------------------------------------------------------------------------
# Output helpers
# ---------------------------------------------------------------------------------------------


class Arrays:
    def __init__(self, folder: Path):
        self.folder = folder
        self.index = {}
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, array, meaning: str, inline: bool = False):
        a = np.asarray(array)
        if a.dtype.kind in "iu" or a.dtype == bool:
            a, dtype, ext = a.astype("<i4"), "i32", ".i32"
        else:
            a, dtype, ext = a.astype("<f4"), "f32", ".f32"
        file = name + ext
        a.tofile(self.folder / file)
        entry = {"file": file, "dtype": dtype, "shape": list(a.shape), "meaning": meaning}
        if inline:
            entry["values"] = a.tolist()
        self.index[name] = entry


def versions() -> dict:
    import safetensors
    import torch
    import transformers

    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "safetensors": safetensors.__version__,
            "numpy": np.__version__}


def prompt_ids() -> list[int]:
    return [int(x) for x in np.random.default_rng([SEED, 1]).integers(0, PROMPT_ID_LIMIT, PROMPT_LEN)]


def tokenizer_specials(tok_dir: Path | None):
    """(bos, eos) ids from a tokenizer fixture folder, or None."""
    if tok_dir is None or not (tok_dir / "tokenizer.json").is_file():
        return None
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab = len(tok["model"]["vocab"]) + len([t for t in tok.get("added_tokens", [])
                                              if t["content"] not in tok["model"]["vocab"]])
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    return {"bos": ids[cfg["bos_token"]], "eos": ids[cfg["eos_token"]], "vocab": vocab}


def copy_tokenizer(tok_dir: Path | None, dest: Path) -> list[str]:
    copied = []
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if tok_dir is not None and (tok_dir / name).is_file():
            shutil.copyfile(tok_dir / name, dest / name)
            copied.append(name)
    return copied


def top2_gap(row) -> float:
    """Top-1 minus top-2 logit of one row (how far a greedy choice is from a tie)."""
    v = np.sort(np.asarray(row, dtype=np.float64))
    return float(v[-1] - v[-2])


def to_json(obj, indent: int = 0) -> str:
    """json.dumps(indent=2), except that a list of numbers or strings stays on one line."""
    pad = "  " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{pad}{json.dumps(str(k))}: {to_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * indent + "}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        items = [pad + to_json(v, indent + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + "  " * indent + "]"
    if isinstance(obj, list):
        return "[" + ", ".join(json.dumps(v) for v in obj) + "]"
    return json.dumps(obj)


def write_json(path: Path, obj, compact_lists: bool = False):
    text = to_json(obj) if compact_lists else json.dumps(obj, indent=2)
    path.write_text(text + "\n")


# ---------------------------------------------------------------------------------------------
# Ouro
# ---------------------------------------------------------------------------------------------


def ouro_exit_pdf(gates: np.ndarray) -> np.ndarray:
    """gates [S, T] (logits) -> exit pdf [S, T]: p_i = sigmoid(g_i) * prod_{j<i}(1 - sigmoid(g_j)),
    the last step taking the remaining probability (float32, in the reference's order)."""
    g = gates.astype(np.float32)
    lam = (1.0 / (1.0 + np.exp(-g.astype(np.float64)))).astype(np.float32)
    remaining = np.ones_like(lam[0])
    pdf = []
    for i in range(len(lam)):
        if i < len(lam) - 1:
            pdf.append(lam[i] * remaining)
            remaining = remaining * (np.float32(1.0) - lam[i])
        else:
            pdf.append(remaining)
    return np.stack(pdf).astype(np.float32)


def ouro_exit_steps(pdf: np.ndarray, threshold: float) -> np.ndarray:
    """First step whose cumulative exit probability reaches the threshold; the last if none."""
    cum = np.cumsum(pdf, axis=0, dtype=np.float32)
    hit = cum >= np.float32(threshold)
    return np.where(hit.any(axis=0), hit.argmax(axis=0), len(pdf) - 1).astype(np.int32)


def build_ouro(out: Path, src: Path, tok_dir: Path | None, tmp: Path) -> dict:
    import torch
    import transformers
    from transformers import GenerationConfig

    mod, cfgmod = import_reference("ouro", src, tmp)
    folder = out / "ouro-tiny"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)

    config_json = dict(OURO_CONFIG)
    config_json["transformers_version"] = transformers.__version__
    specials = tokenizer_specials(tok_dir)
    if specials is not None:
        assert specials["vocab"] <= config_json["vocab_size"]
        config_json["bos_token_id"], config_json["eos_token_id"] = specials["bos"], specials["eos"]
    gen_json = {"bos_token_id": config_json["bos_token_id"],
                "eos_token_id": config_json["eos_token_id"],
                "transformers_version": transformers.__version__}
    write_json(folder / "config.json", config_json)

    # build in f32, fill, save as BF16 in two shards with the reference class's save_pretrained
    config = cfgmod.OuroConfig.from_pretrained(folder)
    model = mod.OuroForCausalLM(config)
    values = fill_model(model, ouro_weight, via_bf16=True)
    model.to(torch.bfloat16)
    total = sum(v.size for v in values.values()) * 2
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=int(total * 0.6))
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], shards
    assert (folder / "model.safetensors.index.json").is_file()
    write_json(folder / "config.json", config_json)  # the published key set, not 4.57's rewrite
    write_json(folder / "generation_config.json", gen_json)
    copied = copy_tokenizer(tok_dir, folder)
    del model

    def load(steps: int):
        cfg = cfgmod.OuroConfig.from_pretrained(folder)
        cfg.total_ut_steps = steps
        m, info = mod.OuroForCausalLM.from_pretrained(
            folder, config=cfg, torch_dtype=torch.float32, attn_implementation="eager",
            output_loading_info=True)
        check_loaded(m, values, info)
        assert m.config._attn_implementation == "eager" and not m.training
        assert m.model.total_ut_steps == steps
        return m

    ids = prompt_ids()
    x = torch.tensor([ids])
    ref = Arrays(folder / "reference")
    T = len(ids)

    with torch.no_grad():
        for steps in OURO_STEPS:
            m = load(steps)
            logits = m(input_ids=x, use_cache=False, use_early_exit_gate=False).logits[0]
            ref.add(f"logits_steps{steps}", logits.numpy(),
                    f"[T, V] logits at every position, total_ut_steps={steps}, no cache, exit rule "
                    f"off (use_early_exit_gate=False): lm_head(norm(h)) after the last step")
            if steps == max(OURO_STEPS):
                m4, last = m, logits

        S = max(OURO_STEPS)
        outputs, hidden_list, gate_list = m4.model(input_ids=x, use_cache=False,
                                                   use_early_exit_gate=True)
        assert len(hidden_list) == S and len(gate_list) == S
        assert torch.equal(hidden_list[-1], outputs.last_hidden_state)
        per_step = torch.stack([m4.lm_head(h)[0] for h in hidden_list]).numpy()
        gates = torch.stack([g[0, :, 0] for g in gate_list]).numpy()
        assert np.array_equal(per_step[-1], last.numpy())
        pdf = ouro_exit_pdf(gates)
        ref.add("per_step_logits_steps4", per_step,
                "[4, T, V] lm_head of each step's hidden state (after model.norm), total_ut_steps=4;"
                " row 3 equals logits_steps4")
        ref.add("gate_logits_steps4", gates,
                "[4, T] early_exit_gate(h_step) before the sigmoid, h_step = the step's normed state")
        ref.add("exit_pdf_steps4", pdf,
                "[4, T] exit pdf: p_i = sigmoid(g_i) * prod_{j<i}(1 - sigmoid(g_j)), "
                "p_3 = prod_{j<3}(1 - sigmoid(g_j))")
        exit_steps = np.stack([ouro_exit_steps(pdf, t) for t in OURO_THRESHOLDS])
        for i, t in enumerate(OURO_THRESHOLDS):
            got = m4(input_ids=x, use_cache=False, exit_threshold=t).logits[0].numpy()
            # the reference's own gather must agree with the exit steps computed here
            want = per_step[exit_steps[i], np.arange(T)]
            assert np.array_equal(got, want), f"exit step mismatch at threshold {t}"
            if t == OURO_GEN_THRESHOLD:
                ref.add("logits_exit0.5_steps4", got,
                        "[T, V] logits the model returns with exit_threshold=0.5 (total_ut_steps=4, "
                        "no cache): row t = per_step_logits_steps4[exit_steps[1, t], t]")
        cum = np.cumsum(pdf, axis=0, dtype=np.float32)
        exit_margins = {str(t): float(np.abs(cum[:-1] - np.float32(t)).min())
                        for t in OURO_THRESHOLDS}
        ref.add("exit_steps_steps4", exit_steps,
                "[4, T] 0-based exit step per position for thresholds 0.3, 0.5, 0.7, 0.9: the "
                "first step whose cumulative pdf >= threshold, else the last step", inline=True)
        assert len(set(exit_steps[1].tolist())) >= 3, f"exit steps at 0.5 too uniform: {exit_steps[1]}"
        cfg_default = m4(input_ids=x, use_cache=False).logits[0].numpy()
        cfg_default_is_last = bool(np.array_equal(cfg_default, last.numpy()))

        # ---- greedy generation with the UniversalTransformerCache, step by step
        captured = {"norm": [], "gate": []}
        h1 = m4.model.norm.register_forward_hook(lambda _m, _i, o: captured["norm"].append(o))
        h2 = m4.model.early_exit_gate.register_forward_hook(
            lambda _m, _i, o: captured["gate"].append(o))

        def generate(threshold):
            cache = mod.UniversalTransformerCache(
                max_cache_size=config_json["num_hidden_layers"] * S)
            seq = ids[:GEN_PROMPT_LEN]
            feed, tokens, steps, gaps, margins = seq, [], [], [], []
            for _ in range(GEN_NEW_TOKENS):
                captured["norm"].clear()
                captured["gate"].clear()
                kw = ({"use_early_exit_gate": False} if threshold is None
                      else {"use_early_exit_gate": True, "exit_threshold": threshold})
                out_ = m4(input_ids=torch.tensor([feed]), past_key_values=cache, use_cache=True,
                          **kw)
                assert out_.past_key_values is cache
                row = out_.logits[0, -1]
                tok = int(torch.argmax(row))
                gaps.append(top2_gap(row.numpy()))
                if threshold is not None:
                    g = np.array([c[0, -1, 0].item() for c in captured["gate"]], np.float32)
                    step = int(ouro_exit_steps(ouro_exit_pdf(g[:, None]), threshold)[0])
                    cand = torch.stack([m4.lm_head(h[0, -1]) for h in captured["norm"]])
                    dist = (cand - row).abs().amax(-1)
                    assert int(dist.argmin()) == step and float(dist[step]) < 1e-5, dist
                    steps.append(step)
                    c = np.cumsum(ouro_exit_pdf(g[:, None])[:, 0], dtype=np.float32)
                    margins.append(float(np.abs(c[:-1] - np.float32(threshold)).min()))
                tokens.append(tok)
                feed = [tok]
            assert cache.get_seq_length() == GEN_PROMPT_LEN + GEN_NEW_TOKENS - 1
            assert len(cache.key_cache) == config_json["num_hidden_layers"] * S
            return tokens, steps, {"min_top2_logit_gap": min(gaps),
                                   **({"min_cumulative_exit_distance_to_threshold": min(margins)}
                                      if margins else {})}

        gen_plain, _, plain_margins = generate(None)
        gen_exit, gen_exit_steps, exit_gen_margins = generate(OURO_GEN_THRESHOLD)
        h1.remove()
        h2.remove()
        # cross-check: transformers' generate() (its own DynamicCache) gives the same tokens
        hf = m4.generate(torch.tensor([ids[:GEN_PROMPT_LEN]]), generation_config=GenerationConfig(
            max_new_tokens=GEN_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0),
            use_early_exit_gate=False)
        hf_same = hf[0, GEN_PROMPT_LEN:].tolist() == gen_plain

    ref.add("generate_steps4_greedy", np.array(gen_plain),
            "[16] greedy tokens after the first 12 prompt ids, total_ut_steps=4, exit rule off, "
            "step by step with UniversalTransformerCache (prefill of 12, then one token a call)",
            inline=True)
    ref.add("generate_steps4_exit0.5", np.array(gen_exit),
            "[16] greedy tokens as above with exit_threshold=0.5: all 4 steps computed and cached "
            "every call, the token taken from the exit step's logits (last position)", inline=True)
    ref.add("generate_steps4_exit0.5_exit_steps", np.array(gen_exit_steps),
            "[16] 0-based exit step of each generated token (at the position that produced it)",
            inline=True)

    reference = {
        "model": "ouro-tiny",
        "reference_code": reference_info("ouro"),
        "versions": versions(),
        "computation": {
            "dtype": "float32 (BF16 checkpoint upcast exactly)", "device": "cpu", "threads": 1,
            "attention": "eager (attn_implementation='eager'), no dropout (eval)",
            "loading": "OuroConfig.from_pretrained + total_ut_steps set before "
                       "OuroForCausalLM.from_pretrained(folder, torch_dtype=float32)",
            "shims": [],
            "exit_thresholds": list(OURO_THRESHOLDS),
            "config_default_exit_threshold_1.0_equals_last_step": cfg_default_is_last,
            "margins": {
                "min_top2_logit_gap_logits_steps4": min(top2_gap(r) for r in last.numpy()),
                "exit_steps_min_cumulative_distance_to_threshold": exit_margins,
                "generate_steps4_greedy": plain_margins,
                "generate_steps4_exit0.5": exit_gen_margins,
            },
            "special_ids_generated": sorted(set(gen_plain + gen_exit) & {
                config_json["bos_token_id"], config_json["eos_token_id"]}),
            "transformers_generate_matches_greedy": hf_same,
        },
        "prompt_ids": ids,
        "generation_prompt_ids": ids[:GEN_PROMPT_LEN],
        "arrays": ref.index,
    }
    write_json(ref.folder / "reference.json", reference, compact_lists=True)
    return {"folder": folder, "tokenizer": copied, "hf_generate_same": hf_same,
            "exit_steps": exit_steps, "gen": (gen_plain, gen_exit, gen_exit_steps)}


# ---------------------------------------------------------------------------------------------
# Huginn
# ---------------------------------------------------------------------------------------------


def build_huginn(out: Path, src: Path, tok_dir: Path | None, tmp: Path) -> dict:
    import torch
    import transformers
    from transformers import GenerationConfig

    R = import_reference("huginn", src, tmp)
    folder = out / "huginn-tiny"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)

    specials = tokenizer_specials(tok_dir)
    extra = {}
    if specials is not None:
        assert specials["vocab"] <= HUGINN_ARGS["vocab_size"]
        extra = {"bos_token_id": specials["bos"], "eos_token_id": specials["eos"],
                 "pad_token_id": specials["bos"]}
    config = R.RavenConfig(**HUGINN_ARGS, **extra)
    config.architectures = ["RavenForCausalLM"]
    config.auto_map = {"AutoConfig": "raven_config_minimal.RavenConfig",
                       "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"}
    config_json = config.to_diff_dict()
    config_json.pop("dtype", None)
    config_json["torch_dtype"] = "float32"
    config_json = dict(sorted(config_json.items()))
    assert config_json["test_time_noise"] == 0
    write_json(folder / "config.json", config_json)

    config = R.RavenConfig.from_pretrained(folder)
    model = R.RavenForCausalLM(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    values = fill_model(model, huginn_weight, via_bf16=False, skip=("lm_head.weight", "freqs_cis"))
    model.save_pretrained(folder, safe_serialization=True)
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model.safetensors"]
    # save_pretrained also copies the reference's own .py files next to the weights (the class is
    # registered for the Auto classes); they are not ours to commit
    for py in folder.glob("*.py"):
        py.unlink()
    write_json(folder / "config.json", config_json)
    gen_json = {k: config_json[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                if k in config_json}
    gen_json["transformers_version"] = transformers.__version__
    write_json(folder / "generation_config.json", gen_json)
    copied = copy_tokenizer(tok_dir, folder)
    del model

    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        saved_names = sorted(f.keys())
    m, info = R.RavenForCausalLM.from_pretrained(folder, torch_dtype=torch.float32,
                                                 output_loading_info=True)
    check_loaded(m, values, info, allow_missing=("lm_head.weight",))
    assert m.lm_head.weight is m.transformer.wte.weight and not m.training

    ids = prompt_ids()
    x = torch.tensor([ids])
    ref = Arrays(folder / "reference")

    def fwd(steps, **kw):
        return m(x, num_steps=steps, init_scale=0.0, **kw).logits[0]

    with torch.no_grad():
        per_step = torch.stack([fwd(k) for k in range(1, HUGINN_PER_STEP_MAX + 1)]).numpy()
        for k in HUGINN_STEPS:
            logits = fwd(k).numpy()
            assert np.array_equal(logits, per_step[k - 1])
            ref.add(f"logits_steps{k}", logits,
                    f"[T, V] logits at every position, num_steps={k}, zero initial state "
                    f"(init_scale=0.0), no cache")
        ref.add("per_step_logits", per_step,
                "[8, T, V] row k-1 = logits with num_steps=k (each a separate forward from the "
                "zero state), k = 1..8")

        # ---- greedy generation at 4 steps with HuginnDynamicCache, step by step
        cache = R.HuginnDynamicCache()
        feed, pos, gen, gaps = ids[:GEN_PROMPT_LEN], 0, [], []
        for _ in range(GEN_NEW_TOKENS):
            out_ = m(torch.tensor([feed]), num_steps=HUGINN_GEN_STEPS, init_scale=0.0,
                     use_cache=True, past_key_values=cache,
                     cache_position=torch.arange(pos, pos + len(feed)))
            assert out_.past_key_values is cache
            pos += len(feed)
            gen.append(int(torch.argmax(out_.logits[0, -1])))
            gaps.append(top2_gap(out_.logits[0, -1].numpy()))
            feed = [gen[-1]]
        n_core = HUGINN_ARGS["n_layers_in_recurrent_block"] * HUGINN_GEN_STEPS
        assert sorted(cache.key_cache) == list(range(-HUGINN_ARGS["n_layers_in_coda"], 0)) + list(
            range(HUGINN_ARGS["n_layers_in_prelude"] + n_core))
        greedy_cfg = GenerationConfig(max_new_tokens=GEN_NEW_TOKENS, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
        prompt12 = torch.tensor([ids[:GEN_PROMPT_LEN]])
        hf = m.generate(prompt12, generation_config=greedy_cfg, num_steps=HUGINN_GEN_STEPS,
                        init_scale=0.0)
        mini = m.generate(prompt12, greedy_cfg, continuous_compute=False, init_scale=0.0,
                          num_steps=HUGINN_GEN_STEPS, max_new_tokens=GEN_NEW_TOKENS)
        hf_same = hf[0, GEN_PROMPT_LEN:].tolist() == gen
        mini_same = mini[0, GEN_PROMPT_LEN:].tolist() == gen
        ref.add("generate_steps4_greedy", np.array(gen),
                "[16] greedy tokens after the first 12 prompt ids, num_steps=4, zero initial "
                "state, step by step with HuginnDynamicCache (prefill of 12, then one token a "
                "call, cache_position given)", inline=True)

        # ---- the model's adaptive-exit generation
        adaptive = {}
        criteria = ["none", "entropy-diff", "latent-diff", "cosine", "kl", "minp-kl",
                    "argmax-stability"]
        for crit in criteria:
            thresholds = ["auto"] + ([HUGINN_EXPLICIT_THRESHOLDS[crit]] if crit != "none" else [])
            for thr in thresholds:
                evaluator = R.get_adaptive_exit_evaluator(m, crit, thr)
                rec = record_adaptive(m, evaluator)
                seq = m.generate_with_adaptive_compute(
                    prompt12, greedy_cfg, criterion=crit, exit_threshold=thr,
                    exit_evaluator=rec.evaluator, init_scale=0.0,
                    num_steps=HUGINN_ADAPTIVE_MAX_STEPS, max_new_tokens=GEN_NEW_TOKENS)
                rec.close()
                toks = seq[0, GEN_PROMPT_LEN:].tolist()
                assert len(toks) == GEN_NEW_TOKENS and len(rec.steps) == GEN_NEW_TOKENS
                tag = crit.replace("-", "_") + "_" + ("auto" if thr == "auto" else "explicit")
                thr_value = evaluator.exit_threshold if hasattr(evaluator, "exit_threshold") else None
                ref.add(f"adaptive_{tag}_tokens", np.array(toks),
                        f"[16] generate_with_adaptive_compute tokens, criterion={crit!r}, "
                        f"exit_threshold={thr!r} (= {thr_value}), max {HUGINN_ADAPTIVE_MAX_STEPS} "
                        f"steps, zero initial state, lookup 'full'", inline=True)
                ref.add(f"adaptive_{tag}_steps", np.array(rec.steps),
                        "[16] recurrent steps run for each generated token (token 0: the whole "
                        "12-token prompt in one call)", inline=True)
                vals = np.full((GEN_NEW_TOKENS, HUGINN_ADAPTIVE_MAX_STEPS), np.nan, np.float32)
                for i, v in enumerate(rec.values):
                    vals[i, : len(v)] = v
                if crit != "none":
                    ref.add(f"adaptive_{tag}_exit_values", vals,
                            f"[16, {HUGINN_ADAPTIVE_MAX_STEPS}] the criterion's exit value after "
                            "each step of each token (NaN past the exit step; for 'cosine' the "
                            "first value is NaN: zero previous state)")
                adaptive[tag] = {"criterion": crit, "exit_threshold_argument": thr,
                                 "exit_threshold": thr_value, "tokens": toks, "steps": rec.steps}

    reference = {
        "model": "huginn-tiny",
        "reference_code": reference_info("huginn"),
        "versions": versions(),
        "computation": {
            "dtype": "float32", "device": "cpu", "threads": 1,
            "attention": "the reference's only path: torch scaled_dot_product_attention (no "
                         "attention mask is built; prepared_attn_mask is None)",
            "initial_state": "zero: init_scale=0.0 passed to forward / generate / "
                             "generate_with_adaptive_compute (initialize_state returns zeros "
                             "when its std is 0); no monkeypatch",
            "num_steps": "passed as a Python int (forward: num_steps_no_grad=num_steps, "
                         "num_steps_with_grad=0)",
            "loading": "RavenForCausalLM.from_pretrained(folder, torch_dtype=float32); "
                       "lm_head.weight is not in the file, from_pretrained ties it to "
                       "transformer.wte.weight",
            "safetensors_tensor_names": saved_names,
            "shims": [],
            "margins": {
                "min_top2_logit_gap_logits_steps": {
                    str(k): min(top2_gap(r) for r in per_step[k - 1]) for k in HUGINN_STEPS},
                "generate_steps4_greedy_min_top2_logit_gap": min(gaps),
            },
            "special_ids_generated": sorted(
                set(gen + [t for r in adaptive.values() for t in r["tokens"]])
                & {config_json.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}),
            "generate_paths_match_greedy": {"transformers_generate": hf_same,
                                            "generate_minimal": mini_same},
            "adaptive": {
                "function": "RavenForCausalLM.generate_with_adaptive_compute",
                "cache": "HuginnDynamicCache(lookup_strategy='full') (the default "
                         "cache_lookup_strategy); a depth a token skipped has no entry, and "
                         "'full' then stacks only the entries that exist (tests/data/hf/README.md)",
                "max_steps": HUGINN_ADAPTIVE_MAX_STEPS,
                "max_new_tokens": "passed as a keyword: the function ignores "
                                  "GenerationConfig.max_new_tokens",
                "stop_tokens": "none reachable: the hard-coded {65504, 65505, 65508} are outside "
                               "the vocabulary and eos_token_id=None in the GenerationConfig",
                "min_steps": 0, "check_criterion_every_n_steps": 1,
                "do_not_exit_in_prefill": False, "continuous_compute": False,
                "runs": adaptive,
            },
        },
        "prompt_ids": ids,
        "generation_prompt_ids": ids[:GEN_PROMPT_LEN],
        "arrays": ref.index,
    }
    write_json(ref.folder / "reference.json", reference, compact_lists=True)
    return {"folder": folder, "tokenizer": copied, "saved_names": saved_names,
            "hf_same": hf_same, "mini_same": mini_same, "adaptive": adaptive, "gen": gen}


class record_adaptive:
    """Observes generate_with_adaptive_compute without changing it: wraps the exit evaluator
    (its init marks a new token; each check is one finished step and its exit value) and counts
    iterate_one_step calls per token."""

    def __init__(self, model, evaluator):
        self.model, self.inner = model, evaluator
        self.steps, self.values, self._count = [], [], None
        rec = self

        class Wrapped:
            def __getattr__(self, name):
                return getattr(rec.inner, name)

            def init(self, latents):
                rec._flush()
                rec._count, rec._vals, rec._exited = 0, [], False
                return rec.inner.init(latents)

            def check(self, model_, latents, aux):
                exits, outputs, vals = rec.inner.check(model_, latents, aux)
                if not rec._exited:
                    rec._vals.append(float(vals[0]))
                    rec._exited = bool(exits[0])
                return exits, outputs, vals

        self.evaluator = Wrapped()
        original = model.iterate_one_step

        def counting(*a, **k):
            rec._count += 1
            return original(*a, **k)

        model.iterate_one_step = counting
        self._original = original

    def _flush(self):
        if self._count is not None:
            self.steps.append(self._count)
            self.values.append(self._vals)

    def close(self):
        self._flush()
        self._count = None
        del self.model.iterate_one_step  # back to the class's method
        assert self.model.iterate_one_step.__func__ is type(self.model).iterate_one_step


def reference_info(kind: str) -> dict:
    spec = SOURCES[kind]
    return {"repository": spec["repository"], "commit": spec["commit"],
            "files": {p: {"sha256": s} for p, s in spec["files"].values()}}


# ---------------------------------------------------------------------------------------------


def verify_checkpoint(folder: Path, dtype: str, exempt=()) -> dict:
    """Read every tensor back from the written files: dtype as promised, every value exact in f16
    (the RoPE table Huginn's save_pretrained stores, freqs_cis, is exempt: it is not a weight)."""
    import torch
    from safetensors import safe_open

    names = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                names[name] = {"file": file.name, "dtype": str(t.dtype).replace("torch.", ""),
                               "shape": list(t.shape)}
                if name in exempt:
                    continue
                assert str(t.dtype) == "torch." + dtype, (name, t.dtype)
                a = t.to(torch.float32).numpy()
                assert np.array_equal(a.astype(np.float16).astype(np.float32), a), name
                assert not np.any((a != 0) & (np.abs(a) < 2.0 ** -14)), name
    return names


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--huginn-src", type=Path, required=True,
                    help="clone of github.com/seal-rg/recurrent-pretraining, or a folder with "
                         "the two raven_*_minimal.py files")
    ap.add_argument("--ouro-src", type=Path, required=True,
                    help="clone of github.com/LoopedLMs/ouro_rl, or a folder with "
                         "modeling_ouro.py and configuration_ouro.py")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "data" / "hf")
    ap.add_argument("--tokenizer-dir", type=Path, default=REPO_ROOT / "tests" / "data" / "tokenizer",
                    help="folder with tokenizer.json and tokenizer_config.json to copy into both "
                         "checkpoints (skipped when absent)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(SEED)  # nothing below draws from torch's generator; belt and braces
    tok_dir = args.tokenizer_dir if (args.tokenizer_dir / "tokenizer.json").is_file() else None
    with tempfile.TemporaryDirectory(prefix="hf_reference_") as tmp:
        o = build_ouro(args.out, args.ouro_src, tok_dir, Path(tmp))
        h = build_huginn(args.out, args.huginn_src, tok_dir, Path(tmp))
    print(f"ouro-tiny: {o['folder']}  tokenizer files: {o['tokenizer'] or 'none'}")
    print(f"  exit steps (thresholds {OURO_THRESHOLDS}):\n{o['exit_steps']}")
    print(f"  greedy {o['gen'][0]}\n  exit0.5 {o['gen'][1]}\n  steps {o['gen'][2]}")
    print(f"  transformers generate() agrees: {o['hf_generate_same']}")
    print(f"huginn-tiny: {h['folder']}  tokenizer files: {h['tokenizer'] or 'none'}")
    print(f"  tensors: {h['saved_names']}")
    print(f"  greedy {h['gen']}; generate() agrees: {h['hf_same']}, generate_minimal: {h['mini_same']}")
    for tag, r in h["adaptive"].items():
        print(f"  {tag:28s} thr={r['exit_threshold']!s:8s} steps={r['steps']} tokens={r['tokens']}")
    verify_checkpoint(args.out / "ouro-tiny", "bfloat16")
    verify_checkpoint(args.out / "huginn-tiny", "float32", exempt=("freqs_cis",))
    for name in ("ouro-tiny", "huginn-tiny"):
        assert not list((args.out / name).rglob("*.py")), "reference code in the output"
        size = sum(p.stat().st_size for p in (args.out / name).rglob("*") if p.is_file())
        print(f"{name}: {size} bytes")


if __name__ == "__main__":
    main()
