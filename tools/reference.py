#!/usr/bin/env python3
"""Independent NumPy reference for `.tinyloop` files (docs/FORMAT.md, version 1).

Written from docs/FORMAT.md alone; it shares no code with src/. Needs only numpy + stdlib.

    python3 tools/reference.py MODEL --tokens 1,2,3 --loops 4 --out logits.npy
    python3 tools/reference.py MODEL --text "ROMEO." --loops 6          # bytes tokenizer
    python3 tools/reference.py MODEL --info                              # header summary
    python3 tools/reference.py --convert RUN_DIR --write OUT.tinyloop [--quant int4 --group-size 128]
    python3 tools/reference.py --selftest

    >>> import reference; reference.logits("m.tinyloop", [1, 2, 3], 4)   # -> float32 [n, vocab]

`--out` writes the float32 logits of every position, shape [n_tokens, vocab_size].

Parsing validates like a strict reader: magic, version (1), flags (0), header length
(<= 64 MiB and inside the file), header JSON, the config (every key present, no unknown key,
types and divisibility), the tensor set (exactly the names the config implies), every tensor's
dtype/shape/group_size, 64-byte aligned offsets, lengths equal to the implied length, data inside
the file, and CRC-32 (zlib) of each tensor. Failures raise FormatError naming the failure point.

Numerics (docs/NUMERICS.md): every quantity the runtime keeps in f32 (residual stream, linear
outputs, attention scores, softmax, logits) is carried here in float64 instead, i.e. with *less*
rounding than a backend; the f16 rounding points are applied exactly where NUMERICS.md puts them:
  * the output of every norm (attn_norm, mlp_norm, final_norm)           -> f16
  * Q, K, V after the QKV projection and RoPE (RoPE applied to the unrounded projection) -> f16
  * the attention output (input of attn_out)                               -> f16
  * silu(gate) * up (input of mlp_down)                                    -> f16
  * embed_projᵀ · h for a factorized tied head                            -> f16
Quantized weights are dequantized as `scale * q + zero` in float32 (a multiply, then an add, both
rounded to f32: no fused multiply-add), then used in float64. RoPE angles are computed in float64,
their cos and sin rounded to float32. So a correct backend's logits should match these to about
the f32 accumulation error (relative ~1e-5 .. 1e-4 for small models); the dominant shared error,
the f16 activations, is identical.

`logit_lens` (docs/NUMERICS.md "Logit lens and trajectory"): after each loop iteration the state
is read out through the post blocks (on a copy: the next iteration continues from the loop's own
state), final_norm and the head, so row L is the last position's logits at L loops.
"""

import argparse
import json
import math
import os
import struct
import sys
import zlib

import numpy as np

MAGIC = b"TINYLOOP"
VERSION = 1
MAX_HEADER = 64 * 1024 * 1024
ALIGN = 64

CONFIG_SPEC = {
    "dim": int, "n_heads": int, "n_kv_heads": int, "ffn_dim": int, "vocab_size": int,
    "embed_factor_dim": int, "n_pre_blocks": int, "n_loop_blocks": int, "n_post_blocks": int,
    "default_loops": int, "norm": str, "norm_eps": float, "rope_theta": float,
    "max_position": int, "head": str,
}
DTYPES = ("f16", "f32", "int4", "int2")
BITS = {"int4": 4, "int2": 2}
LINEAR_SUFFIXES = ("attn_qkv", "attn_out", "mlp_gate", "mlp_up", "mlp_down")


class FormatError(ValueError):
    pass


def align64(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def f16r(x):
    """Round to the nearest f16 (ties to even, overflow -> inf) and back to float64."""
    return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)


# ----------------------------------------------------------------------------- parsing

def check_config(cfg):
    if not isinstance(cfg, dict):
        raise FormatError("header: config is not an object")
    missing = [k for k in CONFIG_SPEC if k not in cfg]
    unknown = [k for k in cfg if k not in CONFIG_SPEC]
    if missing:
        raise FormatError(f"config: missing key(s) {missing}")
    if unknown:
        raise FormatError(f"config: unknown key(s) {unknown}")
    for k, t in CONFIG_SPEC.items():
        v = cfg[k]
        if t is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise FormatError(f"config: {k} must be an integer, got {v!r}")
        if t is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise FormatError(f"config: {k} must be a number, got {v!r}")
        if t is str and not isinstance(v, str):
            raise FormatError(f"config: {k} must be a string, got {v!r}")
    for k in ("dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "n_loop_blocks", "max_position"):
        if cfg[k] < 1:
            raise FormatError(f"config: {k} must be >= 1, got {cfg[k]}")
    for k in ("embed_factor_dim", "n_pre_blocks", "n_post_blocks", "default_loops"):
        if cfg[k] < 0:
            raise FormatError(f"config: {k} must be >= 0, got {cfg[k]}")
    if cfg["dim"] % cfg["n_heads"] or (cfg["dim"] // cfg["n_heads"]) % 2:
        raise FormatError("config: dim / n_heads must be an even integer")
    if cfg["n_heads"] % cfg["n_kv_heads"]:
        raise FormatError("config: n_kv_heads must divide n_heads")
    if cfg["norm"] not in ("rmsnorm", "layernorm"):
        raise FormatError(f"config: norm must be rmsnorm or layernorm, got {cfg['norm']!r}")
    if cfg["head"] not in ("untied", "tied"):
        raise FormatError(f"config: head must be untied or tied, got {cfg['head']!r}")
    if not (cfg["norm_eps"] >= 0 and math.isfinite(cfg["norm_eps"])):
        raise FormatError("config: norm_eps must be finite and >= 0")
    if not (cfg["rope_theta"] > 0 and math.isfinite(cfg["rope_theta"])):
        raise FormatError("config: rope_theta must be finite and > 0")


def expected_tensors(cfg):
    """name -> shape, exactly the set FORMAT.md's 'Tensor names' implies."""
    D, H, Hkv, F, V, r = (cfg[k] for k in ("dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "embed_factor_dim"))
    hd = D // H
    ln = cfg["norm"] == "layernorm"
    out = {"embed": [V, r] if r > 0 else [V, D]}
    if r > 0:
        out["embed_proj"] = [D, r]
    blocks = ([f"pre.{i}" for i in range(cfg["n_pre_blocks"])] + [f"loop.{j}" for j in range(cfg["n_loop_blocks"])]
              + [f"post.{i}" for i in range(cfg["n_post_blocks"])])
    for b in blocks:
        out[f"{b}.attn_norm"] = [D]
        if ln:
            out[f"{b}.attn_norm.bias"] = [D]
        out[f"{b}.attn_qkv"] = [(H + 2 * Hkv) * hd, D]
        out[f"{b}.attn_out"] = [D, D]
        out[f"{b}.mlp_norm"] = [D]
        if ln:
            out[f"{b}.mlp_norm.bias"] = [D]
        out[f"{b}.mlp_gate"] = [F, D]
        out[f"{b}.mlp_up"] = [F, D]
        out[f"{b}.mlp_down"] = [D, F]
    out["final_norm"] = [D]
    if ln:
        out["final_norm.bias"] = [D]
    if cfg["head"] == "untied":
        out["head"] = [V, D]
    return out


def is_linear(name):
    return name in ("embed_proj", "head") or name.rsplit(".", 1)[-1] in LINEAR_SUFFIXES


def implied_length(dtype, shape, group_size):
    n = 1
    for s in shape:
        n *= s
    if dtype == "f16":
        return 2 * n
    if dtype == "f32":
        return 4 * n
    rows, cols = shape
    return rows * cols * BITS[dtype] // 8 + 2 * 2 * rows * (cols // group_size)


def dequant(dtype, shape, group_size, buf):
    """Tensor bytes -> float32 array (quantized: scale * q + zero in float32)."""
    if dtype == "f16":
        return np.frombuffer(buf, dtype="<f2").astype(np.float32).reshape(shape)
    if dtype == "f32":
        return np.frombuffer(buf, dtype="<f4").astype(np.float32).reshape(shape)
    bits = BITS[dtype]
    rows, cols = shape
    per_byte = 8 // bits
    code_bytes = rows * cols // per_byte
    groups = cols // group_size
    codes = np.frombuffer(buf, dtype=np.uint8, count=code_bytes).reshape(rows, cols // per_byte)
    shifts = (bits * np.arange(per_byte)).astype(np.uint8)
    q = ((codes[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)).reshape(rows, cols)
    sz = np.frombuffer(buf, dtype="<f2", offset=code_bytes, count=2 * rows * groups).astype(np.float32)
    scale = np.repeat(sz[: rows * groups].reshape(rows, groups), group_size, axis=1)
    zero = np.repeat(sz[rows * groups:].reshape(rows, groups), group_size, axis=1)
    return (scale * q.astype(np.float32)).astype(np.float32) + zero


class TinyLoopFile:
    """A parsed, validated .tinyloop file: .config, .metadata, .tensors (table), .weights (float32)."""

    def __init__(self, path, verify_crc=True):
        with open(path, "rb") as f:
            blob = f.read()
        self.path = path
        if len(blob) < 24:
            raise FormatError(f"truncated file: {len(blob)} bytes, the fixed prefix needs 24")
        if blob[:8] != MAGIC:
            raise FormatError(f"bad magic: {blob[:8]!r}, expected {MAGIC!r}")
        version, flags, hlen = struct.unpack_from("<IIQ", blob, 8)
        if version != VERSION:
            raise FormatError(f"unsupported version {version} (this reader knows version {VERSION})")
        if flags != 0:
            raise FormatError(f"unsupported flags {flags:#x} (version 1 defines none)")
        if hlen > MAX_HEADER:
            raise FormatError(f"header length {hlen} exceeds 64 MiB")
        if 24 + hlen > len(blob):
            raise FormatError(f"truncated file: header needs {24 + hlen} bytes, file has {len(blob)}")
        try:
            header = json.loads(blob[24:24 + hlen].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"header is not valid UTF-8 JSON: {e}") from None
        if not isinstance(header, dict):
            raise FormatError("header is not a JSON object")
        for k in ("config", "tensors"):
            if k not in header:
                raise FormatError(f"header: missing {k!r}")
        self.config = header["config"]
        check_config(self.config)
        self.metadata = header.get("metadata", {})
        table = header["tensors"]
        if not isinstance(table, list):
            raise FormatError("header: tensors is not a list")
        data_start = align64(24 + hlen)
        if any(blob[24 + hlen:min(data_start, len(blob))]):
            raise FormatError("non-zero padding between header and data section")
        data_len = max(0, len(blob) - data_start)
        want = expected_tensors(self.config)
        self.tensors = {}
        for t in table:
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise FormatError(f"tensor table: malformed entry {t!r}")
            name = t["name"]
            if name in self.tensors:
                raise FormatError(f"tensor {name}: listed twice")
            if name not in want:
                raise FormatError(f"tensor {name}: not implied by the config (unexpected tensor)")
            dtype, shape = t.get("dtype"), t.get("shape")
            if dtype not in DTYPES:
                raise FormatError(f"tensor {name}: unknown dtype {dtype!r}")
            if shape != want[name]:
                raise FormatError(f"tensor {name}: shape {shape}, expected {want[name]}")
            if dtype in BITS:
                if not is_linear(name):
                    raise FormatError(f"tensor {name}: dtype {dtype} allowed only for linear weights")
                g = t.get("group_size")
                if not isinstance(g, int) or isinstance(g, bool) or g < 1 or shape[1] % g:
                    raise FormatError(f"tensor {name}: group_size {g!r} must divide cols {shape[1]}")
                if (shape[1] * BITS[dtype]) % 8:
                    raise FormatError(f"tensor {name}: cols {shape[1]} not a whole number of bytes at {dtype}")
            else:
                g = None
            off, length, crc = t.get("offset"), t.get("length"), t.get("crc32")
            for k, v in (("offset", off), ("length", length), ("crc32", crc)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise FormatError(f"tensor {name}: {k} must be a non-negative integer, got {v!r}")
            if off % ALIGN:
                raise FormatError(f"tensor {name}: offset {off} is not 64-byte aligned")
            if length != implied_length(dtype, shape, g):
                raise FormatError(f"tensor {name}: length {length}, implied {implied_length(dtype, shape, g)}")
            if off + length > data_len:
                raise FormatError(f"tensor {name}: offset out of range ({off}+{length} > data section {data_len}; truncated file?)")
            buf = blob[data_start + off:data_start + off + length]
            if verify_crc and (zlib.crc32(buf) & 0xFFFFFFFF) != crc:
                raise FormatError(f"tensor {name}: checksum mismatch (crc32 {zlib.crc32(buf):#010x}, header says {crc:#010x})")
            self.tensors[name] = dict(dtype=dtype, shape=shape, group_size=g, offset=off, length=length, crc32=crc, data=buf)
        missing = [n for n in want if n not in self.tensors]
        if missing:
            raise FormatError(f"missing tensor(s): {missing}")
        self._w = {}

    def weight(self, name):
        """float32 ndarray of a tensor (dequantized)."""
        if name not in self._w:
            t = self.tensors[name]
            self._w[name] = dequant(t["dtype"], t["shape"], t["group_size"], t["data"])
        return self._w[name]


# ----------------------------------------------------------------------------- forward

class Reference:
    """Float64 forward pass with FORMAT.md's f16 rounding points."""

    def __init__(self, path_or_file):
        self.f = path_or_file if isinstance(path_or_file, TinyLoopFile) else TinyLoopFile(path_or_file)
        self.cfg = self.f.config
        self._w64 = {}

    def w(self, name):
        if name not in self._w64:
            self._w64[name] = self.f.weight(name).astype(np.float64)
        return self._w64[name]

    def norm(self, x, name):
        eps = self.cfg["norm_eps"]
        if self.cfg["norm"] == "rmsnorm":
            y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * self.w(name)
        else:
            mu = np.mean(x, axis=-1, keepdims=True)
            var = np.mean((x - mu) ** 2, axis=-1, keepdims=True)
            y = (x - mu) / np.sqrt(var + eps) * self.w(name) + self.w(name + ".bias")
        return f16r(y)

    def rope_tables(self, n):
        hd = self.cfg["dim"] // self.cfg["n_heads"]
        i = np.arange(hd // 2, dtype=np.float64)
        ang = np.arange(n, dtype=np.float64)[:, None] * (float(self.cfg["rope_theta"]) ** (-2.0 * i / hd))[None, :]
        return (np.cos(ang).astype(np.float32).astype(np.float64),
                np.sin(ang).astype(np.float32).astype(np.float64))

    @staticmethod
    def rope(x, cos, sin):
        """x [n, heads, hd]; pairs (x[i], x[i + hd/2])."""
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)

    def block(self, x, b, cos, sin):
        cfg = self.cfg
        n = x.shape[0]
        H, Hkv = cfg["n_heads"], cfg["n_kv_heads"]
        hd = cfg["dim"] // H
        h = self.norm(x, f"{b}.attn_norm")
        qkv = h @ self.w(f"{b}.attn_qkv").T
        q = qkv[:, :H * hd].reshape(n, H, hd)
        k = qkv[:, H * hd:(H + Hkv) * hd].reshape(n, Hkv, hd)
        v = qkv[:, (H + Hkv) * hd:].reshape(n, Hkv, hd)
        q = f16r(self.rope(q, cos, sin))
        k = f16r(self.rope(k, cos, sin))
        v = f16r(v)
        group = H // Hkv
        kh = np.repeat(k, group, axis=1)  # head h uses kv head h // group
        vh = np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, kh) / math.sqrt(hd)
        mask = np.triu(np.ones((n, n), dtype=bool), 1)
        scores[:, mask] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        a = f16r(np.einsum("hqk,khd->qhd", p, vh).reshape(n, H * hd))
        x = x + a @ self.w(f"{b}.attn_out").T
        h = self.norm(x, f"{b}.mlp_norm")
        g = h @ self.w(f"{b}.mlp_gate").T
        u = h @ self.w(f"{b}.mlp_up").T
        m = f16r(g / (1.0 + np.exp(-g)) * u)
        return x + m @ self.w(f"{b}.mlp_down").T

    def embed(self, tokens):
        V = self.cfg["vocab_size"]
        t = np.asarray(tokens, dtype=np.int64)
        if t.ndim != 1 or t.size == 0:
            raise ValueError("tokens must be a non-empty 1-D list")
        if (t < 0).any() or (t >= V).any():
            raise ValueError(f"token id out of range [0, {V})")
        if t.size > self.cfg["max_position"]:
            raise ValueError(f"{t.size} tokens exceed max_position {self.cfg['max_position']}")
        e = self.w("embed")[t]
        if self.cfg["embed_factor_dim"] > 0:
            e = e @ self.w("embed_proj").T
        return e

    def readout(self, x):
        h = self.norm(x, "final_norm")
        if self.cfg["head"] == "untied":
            return h @ self.w("head").T
        if self.cfg["embed_factor_dim"] > 0:
            h = f16r(h @ self.w("embed_proj"))  # embed_projᵀ · h, rounded: it feeds embed
        return h @ self.w("embed").T

    def forward(self, tokens, loops=None, lens=False):
        """Logits [n, vocab] (float64). With lens=True also [L, vocab]: last position after each iteration."""
        cfg = self.cfg
        L = cfg["default_loops"] if loops is None else int(loops)
        if L < 0:
            raise ValueError("loops must be >= 0")
        x = self.embed(tokens)
        cos, sin = self.rope_tables(x.shape[0])
        for i in range(cfg["n_pre_blocks"]):
            x = self.block(x, f"pre.{i}", cos, sin)
        lens_rows = []
        for _ in range(L):
            for j in range(cfg["n_loop_blocks"]):
                x = self.block(x, f"loop.{j}", cos, sin)
            if lens:
                y = x
                for i in range(cfg["n_post_blocks"]):
                    y = self.block(y, f"post.{i}", cos, sin)
                lens_rows.append(self.readout(y[-1:])[0])
        for i in range(cfg["n_post_blocks"]):
            x = self.block(x, f"post.{i}", cos, sin)
        out = self.readout(x)
        if lens:
            return out, np.array(lens_rows).reshape(L, cfg["vocab_size"])
        return out


_CACHE = {}


def _ref(path):
    key = os.path.abspath(path)
    st = os.stat(key)
    if key not in _CACHE or _CACHE[key][0] != (st.st_mtime_ns, st.st_size):
        _CACHE[key] = ((st.st_mtime_ns, st.st_size), Reference(path))
    return _CACHE[key][1]


def logits(path, tokens, loops=None):
    """float32 logits [len(tokens), vocab] of every position at `loops` iterations (default: the file's)."""
    return _ref(path).forward(tokens, loops).astype(np.float32)


def logit_lens(path, tokens, loops=None):
    """float32 [L, vocab]: last-position logits (post blocks, final_norm, head) after each loop
    iteration."""
    return _ref(path).forward(tokens, loops, lens=True)[1].astype(np.float32)


# ----------------------------------------------------------------------------- writing (test tooling)

def quantize(w, bits, group_size):
    """Asymmetric round-to-nearest group quantization of float [rows, cols] -> the tensor's bytes.

    Per group: zero = min, scale = (max - min) / (2^bits - 1), both rounded to f16 first; codes chosen
    against the rounded values. (Any encoder is valid; readers only need the decoding rule.)"""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    assert cols % group_size == 0 and (cols * bits) % 8 == 0
    qmax = (1 << bits) - 1
    g = w.reshape(rows, cols // group_size, group_size)
    lo, hi = g.min(axis=2), g.max(axis=2)
    scale = ((hi - lo) / qmax).astype(np.float16)
    scale = np.where(scale.astype(np.float32) == 0, np.float16(1.0), scale).astype(np.float16)
    zero = lo.astype(np.float16)
    q = np.rint((g - zero.astype(np.float32)[..., None]) / scale.astype(np.float32)[..., None])
    q = np.clip(q, 0, qmax).astype(np.uint8).reshape(rows, cols)
    per_byte = 8 // bits
    q = q.reshape(rows, cols // per_byte, per_byte)
    packed = np.zeros((rows, cols // per_byte), dtype=np.uint8)
    for j in range(per_byte):
        packed |= (q[:, :, j] << (bits * j)).astype(np.uint8)
    return packed.tobytes() + scale.astype("<f2").tobytes() + zero.astype("<f2").tobytes()


def write_tinyloop(path, config, tensors, metadata=None, quant=None, group_size=128):
    """Write a .tinyloop file.

    tensors: name -> float array (any float dtype; stored as f16) or (dtype, bytes, group_size) for a
    pre-encoded tensor. quant: None, "int4" or "int2" to quantize every block linear weight
    (attn_qkv, attn_out, mlp_gate, mlp_up, mlp_down); group_size is clamped to cols when larger."""
    check_config(config)
    want = expected_tensors(config)
    if set(want) != set(tensors):
        raise FormatError(f"tensor set mismatch: missing {sorted(set(want) - set(tensors))}, extra {sorted(set(tensors) - set(want))}")
    entries, chunks, off = [], [], 0
    for name in want:  # canonical order
        v = tensors[name]
        g = None
        if isinstance(v, tuple):
            dtype, buf, g = v
        else:
            arr = np.asarray(v, dtype=np.float32)
            if list(arr.shape) != want[name]:
                raise FormatError(f"{name}: shape {list(arr.shape)}, expected {want[name]}")
            if quant and name.rsplit(".", 1)[-1] in LINEAR_SUFFIXES:
                g = min(group_size, arr.shape[1])
                dtype, buf = quant, quantize(arr, BITS[quant], g)
            else:
                dtype, buf = "f16", arr.astype("<f2").tobytes()
        e = {"name": name, "dtype": dtype, "shape": want[name]}
        if g is not None:
            e["group_size"] = g
        e.update(offset=off, length=len(buf), crc32=zlib.crc32(buf) & 0xFFFFFFFF)
        entries.append(e)
        chunks.append(buf + b"\0" * (align64(len(buf)) - len(buf)))
        off += align64(len(buf))
    header = json.dumps({"config": config, "tensors": entries, "metadata": metadata or {"tokenizer": "bytes"}},
                        separators=(",", ":")).encode("utf-8")
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<IIQ", VERSION, 0, len(header)) + header)
        f.write(b"\0" * (align64(24 + len(header)) - 24 - len(header)))
        for c in chunks:
            f.write(c)


def read_safetensors(path):
    """Minimal safetensors reader (numpy only): name -> float32 array."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack_from("<Q", blob, 0)
    hdr = json.loads(blob[8:8 + n])
    base = 8 + n
    kinds = {"F16": "<f2", "F32": "<f4", "BF16": None}
    out = {}
    for name, t in hdr.items():
        if name == "__metadata__":
            continue
        s, e = t["data_offsets"]
        raw = blob[base + s:base + e]
        if t["dtype"] == "BF16":
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            a = np.frombuffer(raw, dtype=kinds[t["dtype"]]).astype(np.float32)
        out[name] = a.reshape(t["shape"])
    return out


def random_model(config, seed=0, scale=0.05):
    """Random weights for a config (norm weights ~1, biases small), as float32 arrays."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_tensors(config).items():
        if name.endswith(".bias"):
            out[name] = rng.normal(0, 0.05, shape)
        elif len(shape) == 1:
            out[name] = 1.0 + rng.normal(0, 0.1, shape)
        else:
            out[name] = rng.normal(0, scale if name != "embed" else 1.0, shape)
    return out


# ----------------------------------------------------------------------------- self-test

def selftest():
    import tempfile
    base = dict(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=96, embed_factor_dim=0,
                n_pre_blocks=2, n_loop_blocks=1, n_post_blocks=0, default_loops=3, norm="rmsnorm",
                norm_eps=1e-5, rope_theta=10000.0, max_position=64, head="untied")
    variants = [
        ({}, None), ({}, "int4"), ({}, "int2"),
        (dict(n_kv_heads=2), "int4"), (dict(n_kv_heads=1, n_heads=2), None),
        (dict(norm="layernorm"), "int4"),
        (dict(embed_factor_dim=16), None), (dict(embed_factor_dim=16, head="tied"), "int4"),
        (dict(head="tied"), None),
        (dict(n_pre_blocks=0, n_loop_blocks=2, n_post_blocks=2), "int2"),
    ]
    toks = [3, 17, 5, 90, 0, 42, 42, 7]
    d = tempfile.mkdtemp()
    for i, (over, quant) in enumerate(variants):
        cfg = dict(base, **over)
        w = random_model(cfg, seed=i)
        p = os.path.join(d, f"m{i}.tinyloop")
        write_tinyloop(p, cfg, w, quant=quant, group_size=32)
        r = Reference(p)
        out, lens = r.forward(toks, 3, lens=True)
        assert out.shape == (len(toks), cfg["vocab_size"]) and np.isfinite(out).all()
        assert np.allclose(lens[-1], out[-1]), "logit lens last row == final logits"
        # causality: a prefix gives the same logits on its positions
        assert np.array_equal(r.forward(toks[:5], 3), out[:5]), "prefix invariance"
        # quantization round-trip: the dequantized weights are within half a step of the originals
        if quant:
            name = "loop.0.attn_qkv"
            t = r.f.tensors[name]
            deq = r.f.weight(name)
            assert np.abs(deq - w[name]).max() < 0.6 * (np.ptp(w[name]) / ((1 << BITS[quant]) - 1)) + 1e-3
        # an unrounded float64 pass stays close (the f16 points are small perturbations)
        exact = unrounded_forward(r, toks, 3)
        rel = np.abs(exact - out).max() / np.abs(exact).max()
        assert rel < 2e-2, f"variant {i}: f16 rounding moved logits by {rel}"
        print(f"variant {i} {over or 'base'} {quant or 'f16'}: ok (max rel diff vs unrounded {rel:.1e})")
    # the validation paths
    p = os.path.join(d, "m0.tinyloop")
    blob = bytearray(open(p, "rb").read())
    cases = {
        "bad magic": lambda b: b.__setitem__(slice(0, 8), b"TINYLOOX"),
        "unsupported version": lambda b: b.__setitem__(slice(8, 12), struct.pack("<I", 2)),
        "unsupported flags": lambda b: b.__setitem__(slice(12, 16), struct.pack("<I", 1)),
        "checksum mismatch": lambda b: b.__setitem__(len(b) - 1, b[-1] ^ 0xFF),
        "truncated": lambda b: b.__delitem__(slice(len(b) - 100, len(b))),
    }
    for what, mutate in cases.items():
        b = bytearray(blob)
        mutate(b)
        q = os.path.join(d, "bad.tinyloop")
        open(q, "wb").write(bytes(b))
        try:
            TinyLoopFile(q)
        except FormatError as e:
            key = what.split()[0] if what != "truncated" else "offset out of range"
            assert key in str(e) or what in str(e), f"{what}: got {e}"
            print(f"rejects {what}: {e}")
        else:
            raise AssertionError(f"{what} not rejected")
    print("selftest ok")


def unrounded_forward(r, tokens, loops):
    """The same pass with every f16 rounding point disabled (for the self-test)."""
    global f16r
    saved = f16r
    f16r = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    try:
        return r.forward(tokens, loops)
    finally:
        f16r = saved


# ----------------------------------------------------------------------------- CLI

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help=".tinyloop file")
    ap.add_argument("--tokens", help="comma-separated token ids")
    ap.add_argument("--text", help="UTF-8 text, tokenized as raw bytes")
    ap.add_argument("--loops", type=int, default=None, help="loop iterations (default: config default_loops)")
    ap.add_argument("--out", help="write float32 logits [n, vocab] here (.npy)")
    ap.add_argument("--lens-out", help="write float32 logit-lens [L, vocab] here (.npy)")
    ap.add_argument("--info", action="store_true", help="print config, metadata and tensor table")
    ap.add_argument("--no-crc", action="store_true", help="skip CRC verification")
    ap.add_argument("--convert", metavar="RUN_DIR", help="folder with model.safetensors + config.json")
    ap.add_argument("--write", metavar="OUT", help="with --convert: .tinyloop to write")
    ap.add_argument("--quant", choices=["int4", "int2"], help="with --convert: quantize block linears (RTN)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--selftest", action="store_true")
    a = ap.parse_args()

    if a.selftest:
        selftest()
        return
    if a.convert:
        if not a.write:
            ap.error("--convert needs --write")
        with open(os.path.join(a.convert, "config.json")) as f:
            cfg = json.load(f)
        w = read_safetensors(os.path.join(a.convert, "model.safetensors"))
        meta = {"tokenizer": "bytes", "source": "tools/train_demo.py via tools/reference.py --convert",
                "quantization": f"{a.quant} g{a.group_size} rtn" if a.quant else "f16"}
        write_tinyloop(a.write, cfg, w, metadata=meta, quant=a.quant, group_size=a.group_size)
        print(f"wrote {a.write}")
        return
    if not a.model:
        ap.error("MODEL is required")
    try:
        f = TinyLoopFile(a.model, verify_crc=not a.no_crc)
    except FormatError as e:
        sys.exit(f"reference: {a.model}: {e}")
    if a.info:
        print(json.dumps({"config": f.config, "metadata": f.metadata}, indent=1))
        for n, t in f.tensors.items():
            print(f"  {n:24s} {t['dtype']:5s} {str(t['shape']):14s} g={t['group_size']} off={t['offset']} len={t['length']}")
        if not (a.tokens or a.text):
            return
    if a.tokens:
        toks = [int(s) for s in a.tokens.split(",") if s.strip()]
    elif a.text is not None:
        toks = list(a.text.encode("utf-8"))
    else:
        ap.error("give --tokens or --text")
    r = Reference(f)
    out, lens = r.forward(toks, a.loops, lens=True)
    out = out.astype(np.float32)
    if a.out:
        np.save(a.out, out)
    if a.lens_out:
        np.save(a.lens_out, lens.astype(np.float32))
    last = out[-1]
    top = np.argsort(-last)[:5]
    L = f.config["default_loops"] if a.loops is None else a.loops
    print(f"{len(toks)} tokens, L={L}: logits {out.shape}; last position top-5 {top.tolist()} "
          f"({', '.join(f'{v:.4f}' for v in last[top])})" + (f"; wrote {a.out}" if a.out else ""))


if __name__ == "__main__":
    main()
