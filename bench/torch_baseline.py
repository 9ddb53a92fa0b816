#!/usr/bin/env python3
"""PyTorch baseline on the weights of a .tinyloop file: batch-1 decode ms/token (and prefill
tokens/s) in eager FP16 and with torch.compile(mode="reduce-overhead").

Quantized weights are dequantized (scale * q + zero) once, to FP16, so PyTorch runs the same
network densely: this is the "what does a straightforward framework implementation cost" line
of docs/PERF.md, not a quantized kernel comparison.

The decode step uses a static KV cache (one slot per block application, like TinyLoop) and a
position held in a device tensor, so the compiled step has static shapes and CUDA graphs apply.

It runs TinyLoop's own architecture (every version-1 file); a version-2 file of another family
(sandwich norms, a loop adapter, ...) is refused: bench/torch_peer.py runs those.

usage: torch_baseline.py MODEL.tinyloop [--loops 8] [--prompt 128] [--steps 128] [--json]
       [--no-compile] [--prefill 512]
"""

import argparse
import json
import math
import mmap
import struct
import sys
import time

import torch
import torch.nn.functional as F


# config.architecture of docs/FORMAT.md version 2 when absent: TinyLoop's own architecture.
ARCHITECTURE_DEFAULTS = {
    "block_norms": "pre",
    "qkv_bias": False,
    "embed_scale": 1.0,
    "loop_input": "none",
    "loop_state": "carry",
    "state_std": 0.0,
    "loop_norm": "none",
    "head_norm": True,
    "exit_gate": False,
    "exit_threshold": None,
}


def read_tinyloop(path, device):
    """Config and tensors of a .tinyloop file (docs/FORMAT.md, versions 1 and 2), on `device`.

    Returns (config, tensors, quant): config["architecture"] is always present (the defaults for
    a version-1 file); tensors maps every name to its FP16 value (quantized weights dequantized in
    f32, then rounded); quant maps each quantized weight to (codes uint8 [rows, cols], scales f32
    [rows, groups], zeros f32 [rows, groups], group size)."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if mm[:8] != b"TINYLOOP":
        sys.exit(f"{path}: not a .tinyloop file")
    version, flags, header_len = struct.unpack_from("<IIQ", mm, 8)
    if version not in (1, 2) or flags != 0:
        sys.exit(f"{path}: unsupported version {version} / flags {flags}")
    header = json.loads(mm[24 : 24 + header_len])
    config = header["config"]
    if version == 1 and "architecture" in config:
        sys.exit(f"{path}: a version-1 file with config.architecture (a version-2 key)")
    arch = config.get("architecture", {})
    unknown = set(arch) - set(ARCHITECTURE_DEFAULTS)
    if unknown:
        sys.exit(f"{path}: unknown config.architecture keys {sorted(unknown)}")
    config["architecture"] = {**ARCHITECTURE_DEFAULTS, **arch}
    data_start = (24 + header_len + 63) // 64 * 64
    tensors, quant = {}, {}
    for t in header["tensors"]:
        start = data_start + t["offset"]
        raw = torch.frombuffer(bytearray(mm[start : start + t["length"]]), dtype=torch.uint8).to(device)
        name, shape = t["name"], t["shape"]
        if t["dtype"] == "f16":
            tensors[name] = raw.view(torch.float16).reshape(shape)
        elif t["dtype"] == "f32":
            tensors[name] = raw.view(torch.float32).reshape(shape).half()
        else:
            bits = 4 if t["dtype"] == "int4" else 2
            rows, cols = shape
            g = t["group_size"]
            per = 8 // bits
            ncode = rows * cols // per
            codes = raw[:ncode].reshape(rows, cols // per)
            shifts = torch.arange(per, device=device, dtype=torch.uint8) * bits
            q = ((codes.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(rows, cols)
            nparam = rows * (cols // g)
            params = raw[ncode:].view(torch.float16).float()
            scales = params[:nparam].reshape(rows, cols // g)
            zeros = params[nparam : 2 * nparam].reshape(rows, cols // g)
            w = q.float().reshape(rows, cols // g, g) * scales.unsqueeze(-1) + zeros.unsqueeze(-1)
            tensors[name] = w.reshape(rows, cols).half()
            quant[name] = (q, scales, zeros, g)
    return config, tensors, quant


class Weights(torch.nn.Module):
    """The tensors as frozen parameters: static inputs for CUDA graphs (no per-replay copies)."""

    def __init__(self, tensors):
        super().__init__()
        self.p = torch.nn.ParameterDict(
            {k.replace(".", "__"): torch.nn.Parameter(v, requires_grad=False) for k, v in tensors.items()}
        )

    def __getitem__(self, name):
        return self.p[name.replace(".", "__")]

    def __contains__(self, name):
        return name.replace(".", "__") in self.p


class Net(torch.nn.Module):
    def __init__(self, config, tensors, max_len, loops, device):
        super().__init__()
        c = config
        self.c, self.loops = c, loops
        self.t = Weights(tensors)
        self.d, self.h, self.hk = c["dim"], c["n_heads"], c["n_kv_heads"]
        self.hd = self.d // self.h
        self.layer_norm = c["norm"] == "layernorm"
        self.eps = c["norm_eps"]
        names = [f"pre.{i}" for i in range(c["n_pre_blocks"])]
        body = [f"loop.{j}" for j in range(c["n_loop_blocks"])]
        names += body * loops
        names += [f"post.{i}" for i in range(c["n_post_blocks"])]
        self.schedule = names
        self.max_len = max_len
        cache = torch.zeros(len(names), self.hk, max_len, self.hd, dtype=torch.float16, device=device)
        self.register_buffer("k", cache)
        self.register_buffer("v", cache.clone())
        half = self.hd // 2
        freq = torch.tensor(
            [c["rope_theta"] ** (-2.0 * i / self.hd) for i in range(half)], dtype=torch.float64
        )
        ang = torch.arange(max_len, dtype=torch.float64).unsqueeze(1) * freq
        self.register_buffer("cos", ang.cos().float().to(device))
        self.register_buffer("sin", ang.sin().float().to(device))
        self.register_buffer("positions", torch.arange(max_len, device=device))

    def norm(self, x, name):
        w = self.t[name]
        if self.layer_norm:
            return F.layer_norm(x, (self.d,), w, self.t[name + ".bias"], self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).half() * w

    def rope(self, x, pos):  # x [n, heads, hd], pos [n]
        half = self.hd // 2
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        a, b = x[..., :half].float(), x[..., half:].float()
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).half()

    def embed(self, tokens):
        x = self.t["embed"][tokens]
        if self.c["embed_factor_dim"]:
            x = x @ self.t["embed_proj"].T
        return x

    def head(self, h):
        if self.c["head"] == "untied":
            return h @ self.t["head"].T
        if self.c["embed_factor_dim"]:
            h = h @ self.t["embed_proj"]
        return h @ self.t["embed"].T

    def block(self, x, name, slot, pos, mask):
        t, n = self.t, x.shape[0]
        h = self.norm(x, name + ".attn_norm")
        qkv = h @ t[name + ".attn_qkv"].T
        qd, kd = self.h * self.hd, self.hk * self.hd
        q = self.rope(qkv[:, :qd].reshape(n, self.h, self.hd), pos)
        k = self.rope(qkv[:, qd : qd + kd].reshape(n, self.hk, self.hd), pos)
        v = qkv[:, qd + kd :].reshape(n, self.hk, self.hd)
        self.k[slot].index_copy_(1, pos, k.transpose(0, 1))
        self.v[slot].index_copy_(1, pos, v.transpose(0, 1))
        kc, vc = self.k[slot], self.v[slot]
        if self.hk != self.h:
            kc = kc.repeat_interleave(self.h // self.hk, 0)
            vc = vc.repeat_interleave(self.h // self.hk, 0)
        a = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kc.unsqueeze(0), vc.unsqueeze(0), attn_mask=mask)
        x = x + a.squeeze(0).transpose(0, 1).reshape(n, qd) @ t[name + ".attn_out"].T
        h = self.norm(x, name + ".mlp_norm")
        act = F.silu(h @ t[name + ".mlp_gate"].T) * (h @ t[name + ".mlp_up"].T)
        return x + act @ t[name + ".mlp_down"].T

    def forward(self, tokens, pos):
        """tokens [n], pos [n] (device tensors) -> logits [n, vocab]."""
        mask = (self.positions.unsqueeze(0) <= pos.unsqueeze(1)).unsqueeze(0).unsqueeze(0)
        x = self.embed(tokens)
        for slot, name in enumerate(self.schedule):
            x = self.block(x, name, slot, pos, mask)
        return self.head(self.norm(x, "final_norm"))


def time_decode(step, first_token, start_pos, steps, device):
    tok = first_token.clone()
    pos = torch.tensor([start_pos], device=device)
    for _ in range(3):  # warm-up (and, compiled, capture)
        logits = step(tok, pos)
        tok = logits.argmax(-1)
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        pos.fill_(start_pos)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            logits = step(tok, pos)
            tok = logits.argmax(-1)
            pos += 1
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return sorted(times)[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--loops", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    device = "cuda"
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
    config, tensors, _ = read_tinyloop(args.model, device)
    if config["architecture"] != ARCHITECTURE_DEFAULTS:
        sys.exit(f"{args.model}: config.architecture {config['architecture']} is not TinyLoop's own; "
                 "this baseline runs only that (bench/torch_peer.py runs the other families)")
    loops = args.loops or config["default_loops"]
    max_len = max(args.prompt + 4 * args.steps + 8, args.prefill)
    net = Net(config, tensors, max_len, loops, device)
    vocab = config["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (args.prompt,), generator=gen).to(device)
    result = {"model": args.model, "loops": loops, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name()}

    with torch.no_grad():
        # Prefill (eager): tokens/s for `--prefill` tokens.
        ptoks = torch.randint(0, vocab, (args.prefill,), generator=gen).to(device)
        ppos = torch.arange(args.prefill, device=device)
        for _ in range(2):
            net.forward(ptoks, ppos)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            net.forward(ptoks, ppos)
        torch.cuda.synchronize()
        result["eager_prefill_tokens_per_s"] = args.prefill * 3 / (time.perf_counter() - t0)

        logits = net.forward(prompt, torch.arange(args.prompt, device=device))
        first = logits[-1:].argmax(-1)
        result["eager_decode_ms_per_token"] = time_decode(net.forward, first, args.prompt, args.steps, device)

    if not args.no_compile:
        step = torch.compile(net.forward, mode="reduce-overhead", fullgraph=True)
        t0 = time.perf_counter()
        with torch.no_grad():
            result["compile_decode_ms_per_token"] = time_decode(step, first, args.prompt, args.steps, device)
        result["compile_seconds_including_timing"] = time.perf_counter() - t0

    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:36} {v:.4f}" if isinstance(v, float) else f"{k:36} {v}")


if __name__ == "__main__":
    main()
