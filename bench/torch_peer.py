#!/usr/bin/env python3
"""The PyTorch peer of docs/PERF.md "Prefill against an honest peer": the network of a
.tinyloop file in the configuration a PyTorch user would pick, timed on the same GPU.

Files of format version 1 and 2 (docs/FORMAT.md), every config.architecture: pre, sandwich
(Ouro) and sandwich_residual (Huginn) block norms, a QKV bias, the embedding scale, a loop
adapter, a random initial loop state (TinyLoop's state_init "model" draw, per position), the loop
norm after every iteration or after the loop, and a head with or without the final norm. The
exit gate is not evaluated: the peer runs a fixed depth, like a forward pass at L loops. The
loop's entry and the loop norm run inside the block application next to them, so every norm is
in the compiled graphs. A random initial state needs numpy (its draw is TinyLoop's, on the host).

Prefill (what a user runs before sampling the first token):
  * the same weights, dequantized once (scale * q + zero in f32, rounded to FP16), dense cuBLAS
    GEMMs, gate and up fused into one GEMM;
  * flash attention through scaled_dot_product_attention(is_causal=True) over the prompt;
    the prompt's K and V are written to a static KV cache, as a prefill must;
  * the head on the last position only;
  * eager, and torch.compile (mode --compile-mode, default "default"; a block application is one
    compiled graph, compiled once per block, schedule position (loop entry, loop norm) and prompt
    length, and shared by that block's applications in every iteration).
Decode (batch 1, static KV cache, greedy; the method is in each row's "impl" and fields):
  * a token is one CUDA graph replay (--decode-graphs manual, the default): decode_token, the
    step and then the argmax into the static token tensor and pos += 1, captured once with
    torch.cuda.CUDAGraph after warm-up calls on a side stream; the token and position tensors
    and the KV cache are static. --decode-graphs reduce-overhead leaves the graphs to
    torch.compile(mode="reduce-overhead") of the whole step, none times the Python dispatch;
  * the step compiled with torch.compile (fullgraph, static shapes, mode --decode-compile-mode:
    "default" or "max-autotune-no-cudagraphs", no CUDA graphs of inductor's inside the manual
    one), per block application (--decode-compile block, the default: one graph per block and
    schedule flags, shared by its applications in every iteration, the loop over them inside
    the captured graph) or whole (step: one graph of every block application, whose compile
    time grows with their number). On an H200, ouro-1.4b shape, FP16, L 4, compile and capture
    then ms a token: block "default" 20 s, 6.0; block "max-autotune-no-cudagraphs" 63 s, 6.3;
    step "default" 139 s, 8.5;
  * the compile and capture time is reported apart from the timed median;
  * FP16 dense weights;
  * int4 weight-only through torch.ops.aten._weight_int4pack_mm (bf16 activations, the op's
    only CUDA input type), with the file's own codes repacked: the op computes
    (q - 8) * scale + zero', so zero' = zero + 8 * scale gives the file's scale * q + zero
    (up to the bf16 rounding of scale and zero'). INT2 codes are packed as int4 codes.

FLOPs (the same count as tinyloop::model::flops and the CLI's bench): a multiply-add is 2 FLOPs;
per block application, 2 * n * (params of QKV, out, gate, up, down) for the linear layers and
4 * dim * n * (n + 1) / 2 for causal attention over n prompt tokens (Q.K and P.V, every head);
plus the factorized embedding's projection and 2 * dim * vocab for the head on the last row.
Norms, biases and a loop adapter are not counted.

usage: torch_peer.py MODEL.tinyloop [--prompts 512,2048] [--loops 1,4,8] [--repeats 10]
       [--compile-mode default] [--no-compile] [--no-decode] [--decode-loops 8]
       [--decode-prompt 128] [--steps 128] [--decode-graphs manual|reduce-overhead|none]
       [--decode-compile block|step] [--decode-compile-mode default|max-autotune-no-cudagraphs] [--json]
Prints one line per measurement on stderr while running, and a table (or, with --json, one
JSON object) on stdout at the end. An Ouro-1.4B-shaped model:
  tinyloop synth --preset ouro-1.4b --bits 4 --out ouro.tinyloop
  torch_peer.py ouro.tinyloop --prompts 2048 --loops 4 --decode-loops 4 --json

Check (no GPU needed): the peer's network on the CPU against TinyLoop's CPU reference:
  torch_peer.py MODEL.tinyloop --check-logits 5,17,200,3 [--loops 1,2,4] [--decode-loops 4]
       [--check-steps 8] [--check-dtype float16|bfloat16|float32] [--check-tol T]
       [--check-compile] [--tinyloop target/release/tinyloop] [--json]
compares the last prompt position's logits after a prefill at each --loops (with
`tinyloop MODEL lens`), then feeds TinyLoop's greedy tokens (`tinyloop MODEL generate`) through
the peer's decode step from the static cache at --decode-loops and compares each step's logits
and argmax. It reports the max relative difference (max |peer - TinyLoop| / max |TinyLoop| per
row) and exits non-zero past the tolerance (see CHECK_TOLERANCE). Decode steps go through
decode_token, the function the GPU run captures. --check-compile also runs the compiled prefill
block and the decode compiled per block and whole (mode --decode-compile-mode), all but the CUDA
graph around decode_token (none on the CPU).
"""

import argparse
import functools
import json
import sys
import time

import torch
import torch.nn.functional as F

from torch_baseline import read_tinyloop  # the same reader as the decode baseline


def forward_flops(c, n, past, loops, head_rows):
    """FLOPs of a forward pass over n tokens after `past` cached ones (see the module doc)."""
    d, f, hd = c["dim"], c["ffn_dim"], c["dim"] // c["n_heads"]
    qkv = (c["n_heads"] + 2 * c["n_kv_heads"]) * hd
    block_params = d * qkv + d * d + 3 * d * f
    per_app = 2 * n * block_params + 4 * d * (n * past + n * (n + 1) / 2)
    apps = c["n_pre_blocks"] + c["n_loop_blocks"] * loops + c["n_post_blocks"]
    r, vocab = c["embed_factor_dim"], c["vocab_size"]
    head = 2 * d * r + 2 * r * vocab if (c["head"] == "tied" and r) else 2 * d * vocab
    return apps * per_app + 2 * n * r * d + head_rows * head


def frozen(t):
    """A tensor as a frozen parameter: a static input for CUDA graphs (no per-replay copies)."""
    return torch.nn.Parameter(t, requires_grad=False)


class Dense(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = frozen(w.contiguous())

    def forward(self, x):
        return F.linear(x, self.w)


class Int4(torch.nn.Module):
    """int4 weight-only linear through the tinygemm kernel of torch (bf16 activations)."""

    INNER_K_TILES = 8

    def __init__(self, q, scales, zeros, group):
        super().__init__()
        rows, cols = q.shape
        packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous()
        self.packed = frozen(torch._convert_weight_to_int4pack(packed, self.INNER_K_TILES))
        sz = torch.stack([scales, zeros + 8 * scales], -1)  # [rows, groups, 2]
        self.sz = frozen(sz.transpose(0, 1).contiguous().to(torch.bfloat16))
        self.group = group

    @classmethod
    def unsupported(cls, q, group):
        """Why the op cannot take this weight, or None."""
        rows, cols = q.shape
        if group not in (32, 64, 128, 256):
            return f"group size {group} (the op takes 32, 64, 128 or 256)"
        if rows % 8 or cols % (cls.INNER_K_TILES * 16):
            return f"shape {rows}x{cols} (rows must be a multiple of 8, columns of 128)"
        return None

    def forward(self, x):
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group, self.sz)


def int4_missing():
    """Why this torch has no int4 weight-only path, or None."""
    for op in ("_weight_int4pack_mm", "_convert_weight_to_int4pack"):
        if not hasattr(torch.ops.aten, op):
            return f"torch {torch.__version__} has no torch.ops.aten.{op}"
    return None


# The values of config.architecture this peer runs (docs/FORMAT.md version 2): all of them.
KNOWN_ARCHITECTURE = {
    "block_norms": ("pre", "sandwich", "sandwich_residual"),
    "loop_input": ("none", "adapter"),
    "loop_state": ("carry", "random"),
    "loop_norm": ("none", "each_iteration", "after_loop"),
}


def unsupported_architecture(arch):
    """Why this peer cannot run a model of `arch` (config.architecture), or None."""
    for key, values in KNOWN_ARCHITECTURE.items():
        if arch[key] not in values:
            return f"config.architecture.{key} {arch[key]!r} (this peer runs {', '.join(values)})"
    return None


def initial_states(positions, dim, std, seed=0):
    """The random initial loop state (loop_state "random") of positions 0..positions-1, f32
    [positions, dim]: docs/FORMAT.md "The computation", the state_init "model" (seed 0) that
    TinyLoop uses by default, drawn on the host in f64 like TinyLoop's."""
    import numpy as np

    # splitmix64's finalizer, on uint64 arrays (wrapping).
    def mix(z):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    with np.errstate(over="ignore"):
        p = np.arange(positions, dtype=np.uint64).repeat(dim)
        i = np.tile(np.arange(dim, dtype=np.uint64), positions)
        key = mix(mix(np.uint64(seed) ^ mix(p)) ^ i)
        z = np.zeros(key.shape)
        todo = np.arange(key.size)
        draw = 0
        while todo.size:  # rejection: the first draw within 3 standard deviations
            k = key[todo]
            u = [((mix(k ^ mix(np.full(k.shape, 2 * draw + j, np.uint64))) >> np.uint64(11)).astype(np.float64) + 0.5)
                 / float(1 << 53) for j in (0, 1)]
            v = np.sqrt(-2.0 * np.log(u[0])) * np.cos(2.0 * np.pi * u[1])
            ok = np.abs(v) <= 3.0
            z[todo[ok]] = v[ok]
            todo = todo[~ok]
            draw += 1
    return torch.from_numpy((std * z).astype(np.float32).reshape(positions, dim))


class Net(torch.nn.Module):
    """The looped network in `dtype`, with block linears from `make_linear(name)`.

    config["architecture"] (docs/FORMAT.md version 2) chooses the block norms (pre, sandwich,
    sandwich_residual), a QKV bias, the embedding scale, the loop's input (an adapter) and
    initial state (carried or random), the loop norm and whether the head reads the final norm.
    What happens between block applications (the loop's entry, the loop norm) is folded into the
    block application next to it, so it lies inside the compiled graphs."""

    def __init__(self, config, tensors, make_linear, dtype, loops, max_len, device="cuda"):
        super().__init__()
        c = self.c = config
        a = self.arch = config["architecture"]
        why = unsupported_architecture(a)
        if why:
            raise ValueError(f"torch_peer.py does not run {why}")
        self.d, self.h, self.hk = c["dim"], c["n_heads"], c["n_kv_heads"]
        self.hd = self.d // self.h
        self.layer_norm = c["norm"] == "layernorm"
        self.eps = c["norm_eps"]
        self.dtype = dtype
        self.device = device
        self.block_norms = a["block_norms"]
        self.qkv_bias = a["qkv_bias"]
        self.embed_scale = float(a["embed_scale"])
        self.adapter = a["loop_input"] == "adapter"
        self.blocks = [f"pre.{i}" for i in range(c["n_pre_blocks"])]
        self.blocks += [f"loop.{j}" for j in range(c["n_loop_blocks"])]
        self.blocks += [f"post.{i}" for i in range(c["n_post_blocks"])]
        self.p = torch.nn.ParameterDict()
        self.lin = torch.nn.ModuleDict()
        for name, t in tensors.items():
            key = name.replace(".", "__")
            if name.split(".")[-1] in ("attn_qkv", "attn_out", "mlp_down") or name in ("adapter.state", "adapter.input"):
                self.lin[key] = make_linear(name)
            elif name.endswith("mlp_gate") or name.endswith("mlp_up"):
                continue
            else:
                self.p[key] = frozen(t.to(dtype))
        for b in self.blocks:  # gate and up as one product of twice the width
            self.lin[f"{b}.mlp_gateup".replace(".", "__")] = make_linear((f"{b}.mlp_gate", f"{b}.mlp_up"))
        half = self.hd // 2
        freq = torch.tensor([c["rope_theta"] ** (-2.0 * i / self.hd) for i in range(half)], dtype=torch.float64)
        ang = torch.arange(max_len, dtype=torch.float64).unsqueeze(1) * freq
        self.register_buffer("cos", ang.cos().float().to(device))
        self.register_buffer("sin", ang.sin().float().to(device))
        self.register_buffer("positions", torch.arange(max_len, device=device))
        if a["loop_state"] == "random":  # each position's initial state, looked up by position
            self.register_buffer("state0", initial_states(max_len, self.d, a["state_std"]).to(device, dtype))
        self.set_loops(loops, max_len)

    def plan(self, loops):
        """The block applications of `loops` iterations: one (block, begin, enter, norm_after)
        each, where `enter` marks the first block of an iteration with a loop adapter (`begin`:
        of iteration 1, which also computes the loop input and draws the initial state) and
        `norm_after` a block after which the loop norm applies."""
        c, a = self.c, self.arch
        k = c["n_loop_blocks"]
        apps = [(f"pre.{i}", False, False, False) for i in range(c["n_pre_blocks"])]
        for it in range(1, loops + 1):
            norm = a["loop_norm"] == "each_iteration" or (a["loop_norm"] == "after_loop" and it == loops)
            for j in range(k):
                first = self.adapter and j == 0
                apps.append((f"loop.{j}", first and it == 1, first, norm and j == k - 1))
        return apps + [(f"post.{i}", False, False, False) for i in range(c["n_post_blocks"])]

    def set_loops(self, loops, max_len):
        self.schedule = self.plan(loops)
        shape = (len(self.schedule), self.hk, max_len, self.hd)
        self.register_buffer("k", torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.register_buffer("v", torch.zeros(shape, dtype=self.dtype, device=self.device))

    def weight(self, name):
        return self.p[name.replace(".", "__")]

    def linear(self, name, x):
        return self.lin[name.replace(".", "__")](x)

    def norm(self, x, name):
        w = self.weight(name)
        if self.layer_norm:
            return F.layer_norm(x.float(), (self.d,), w.float(), self.weight(name + ".bias").float(), self.eps).to(self.dtype)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(self.dtype) * w

    def rope(self, x, pos):  # x [n, heads, hd], pos [n]
        half = self.hd // 2
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        a, b = x[..., :half].float(), x[..., half:].float()
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(self.dtype)

    def embed(self, tokens):
        x = self.weight("embed")[tokens]
        if self.c["embed_factor_dim"]:
            x = x @ self.weight("embed_proj").T
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        return x

    def head_input(self, x):
        """The final norm, unless the loop norm already normed the state (head_norm false)."""
        return self.norm(x, "final_norm") if self.arch["head_norm"] else x

    def enter_loop(self, x, u, pos, begin):
        """The loop adapter before an iteration: x = adapter.state · x + u, where u =
        adapter.input · e is computed from the pre blocks' output e when the loop begins (which
        also replaces the state by the initial state of a random loop state)."""
        if begin:
            u = self.linear("adapter.input", x)
            if self.arch["loop_state"] == "random":
                x = self.state0[pos]
        return self.linear("adapter.state", x) + u, u

    def update(self, x, f, out_norm):
        """The residual update of a sublayer's output f, by the block norms."""
        if self.block_norms == "pre":
            return x + f
        if self.block_norms == "sandwich":
            return x + self.norm(f, out_norm)
        return self.norm(x + f, out_norm)

    def head(self, h):
        if self.c["head"] == "untied":
            return h @ self.weight("head").T
        if self.c["embed_factor_dim"]:
            h = h @ self.weight("embed_proj")
        return h @ self.weight("embed").T

    def qkv(self, x, name, pos):
        n, qd, kd = x.shape[0], self.h * self.hd, self.hk * self.hd
        qkv = self.linear(name + ".attn_qkv", self.norm(x, name + ".attn_norm"))
        if self.qkv_bias:
            qkv = qkv + self.weight(name + ".attn_qkv.bias")
        q = self.rope(qkv[:, :qd].reshape(n, self.h, self.hd), pos).transpose(0, 1)
        k = self.rope(qkv[:, qd : qd + kd].reshape(n, self.hk, self.hd), pos).transpose(0, 1)
        v = qkv[:, qd + kd :].reshape(n, self.hk, self.hd).transpose(0, 1)
        return q, k, v

    def finish(self, x, a, name):
        """Output projection and the MLP after attention output `a` [n, heads * hd]."""
        x = self.update(x, self.linear(name + ".attn_out", a), name + ".attn_out_norm")
        gu = self.linear(name + ".mlp_gateup", self.norm(x, name + ".mlp_norm"))
        g, u = gu.chunk(2, dim=-1)
        return self.update(x, self.linear(name + ".mlp_down", F.silu(g) * u), name + ".mlp_out_norm")

    def prefill_block(self, x, name, pos, u=None, begin=False, enter=False, norm_after=False):
        """One block application over a whole prompt: flash attention, causal, no mask tensor,
        with the loop's entry before it and the loop norm after it as the schedule says.
        Returns the new residual, the loop input u and the prompt's K and V (for the cache)."""
        if enter:
            x, u = self.enter_loop(x, u, pos, begin)
        q, k, v = self.qkv(x, name, pos)
        a = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True, enable_gqa=self.hk != self.h)
        x = self.finish(x, a.squeeze(0).transpose(0, 1).reshape(x.shape[0], -1), name)
        if norm_after:
            x = self.norm(x, "final_norm")
        return x, u, k, v

    def prefill(self, tokens, block):
        """Logits of the last prompt position; `block` is prefill_block, eager or compiled."""
        n = tokens.shape[0]
        pos = self.positions[:n]
        x, u = self.embed(tokens), None
        for slot, (name, begin, enter, norm_after) in enumerate(self.schedule):
            x, u, k, v = block(x, name, pos, u, begin, enter, norm_after)
            self.k[slot, :, :n] = k
            self.v[slot, :, :n] = v
        return self.head(self.head_input(x[-1:]))

    def decode_block(self, x, name, pos, mask, k_cache, v_cache, u=None, begin=False, enter=False, norm_after=False):
        """One block application to the token at `pos`: its K and V written into the
        application's cache slot (k_cache, v_cache: [kv_heads, max_len, head_dim] views), attention
        over the slot through `mask`, the loop's entry and the loop norm as in prefill_block. The
        slot comes as tensors, not an index, so a block's applications share one compiled graph."""
        if enter:
            x, u = self.enter_loop(x, u, pos, begin)
        q, k, v = self.qkv(x, name, pos)
        k_cache.index_copy_(1, pos, k)
        v_cache.index_copy_(1, pos, v)
        a = F.scaled_dot_product_attention(q.unsqueeze(0), k_cache.unsqueeze(0), v_cache.unsqueeze(0), attn_mask=mask, enable_gqa=self.hk != self.h)
        x = self.finish(x, a.squeeze(0).transpose(0, 1).reshape(1, -1), name)
        if norm_after:
            x = self.norm(x, "final_norm")
        return x, u

    def decode_step(self, token, pos, block):
        """Logits [1, vocab] for one token at position `pos` (device tensors of one element),
        attending over the static cache through a mask (the usual static-cache decode); `block`
        is decode_block, eager or compiled."""
        mask = (self.positions <= pos).view(1, 1, 1, -1)
        x, u = self.embed(token), None
        for slot, (name, begin, enter, norm_after) in enumerate(self.schedule):
            x, u = block(x, name, pos, mask, self.k[slot], self.v[slot], u, begin, enter, norm_after)
        return self.head(self.head_input(x))


def dense_linears(tensors, dtype=torch.float16):
    def make(name):
        if isinstance(name, tuple):
            return Dense(torch.cat([tensors[n] for n in name]).to(dtype))
        return Dense(tensors[name].to(dtype))

    return make


def int4_linears(tensors, quant):
    def make(name):
        names = name if isinstance(name, tuple) else (name,)
        if not all(n in quant for n in names):
            return Dense(torch.cat([tensors[n] for n in names]).to(torch.bfloat16))
        q = torch.cat([quant[n][0] for n in names])
        scales = torch.cat([quant[n][1] for n in names])
        zeros = torch.cat([quant[n][2] for n in names])
        return Int4(q, scales, zeros, quant[names[0]][3])

    return make


def cuda_ms(fn, repeats, warmup=3):
    """Median milliseconds of fn() by CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def decode_fn(net, compile, mode):
    """The decode step (token, pos) -> logits of `net`: eager (compile None), compiled as one
    graph ("step"), or an eager loop over compiled block applications ("block": one graph per
    block and schedule flags, shared by the block's applications in every iteration, so the
    compile time does not grow with the loop count). Either way a CUDA graph of the whole token
    removes the Python dispatch."""
    opts = {"mode": mode, "fullgraph": True, "dynamic": False}
    if compile == "step":
        return torch.compile(functools.partial(net.decode_step, block=net.decode_block), **opts)
    block = torch.compile(net.decode_block, **opts) if compile == "block" else net.decode_block
    return functools.partial(net.decode_step, block=block)


def decode_token(step, tok, pos):
    """One greedy token, in place: the logits of token `tok` at position `pos` (tensors of one
    element), then tok <- their argmax and pos += 1, so that a CUDA graph of this call, replayed,
    generates the next token."""
    logits = step(tok, pos)
    tok.copy_(logits.argmax(-1))
    pos.add_(1)
    return logits


def cuda_graph(fn, warmup=3):
    """fn() captured as one CUDA graph; returns its replay. The warm-up calls (compilation,
    autotuning, cuBLAS handles and workspaces) run on a side stream, the capture on the same one
    (the torch.cuda.graphs recipe)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph.replay


def time_decode(net, step, prompt, steps, repeats, graphs):
    """Median ms/token of `steps` greedy tokens after a `prompt`-token prefill, and the seconds
    its first tokens took: compilation, and with graphs "manual" the capture of one token
    (decode_token: step, argmax, pos += 1) as one CUDA graph, which each timed token replays."""
    n = prompt.shape[0]
    with torch.no_grad():
        first = net.prefill(prompt, net.prefill_block).argmax(-1)
        tok, pos = first.clone(), torch.tensor([n], device="cuda")  # the static inputs
        token = functools.partial(decode_token, step, tok, pos)
        t0 = time.perf_counter()
        if graphs == "manual":
            token = cuda_graph(token)
        else:
            for _ in range(3):  # compilation; reduce-overhead records its graphs by the second call
                token()
        torch.cuda.synchronize()
        setup = time.perf_counter() - t0

        def run():
            tok.copy_(first)
            pos.fill_(n)
            for _ in range(steps):
                token()

        return cuda_ms(run, repeats, warmup=2) / steps, setup


def log(line):
    """Progress, on stderr (stdout carries the table, or the JSON with --json)."""
    print(line, file=sys.stderr, flush=True)


def allow_recompiles(n):
    """Let dynamo keep n compiled versions of a function: prefill_block is compiled once per
    distinct (block, schedule flags, prompt length), and past the limit dynamo would silently
    run the rest eagerly."""
    config = torch._dynamo.config
    for key in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(config, key):
            setattr(config, key, max(getattr(config, key), n))


# The check's default tolerances on the max relative logit difference (max |peer - TinyLoop| /
# max |TinyLoop| over a row). TinyLoop keeps the residual stream, linear outputs and logits in
# f32 and rounds the inputs of linears, Q, K and V to f16; the peer keeps everything in the
# check's dtype. Measured (random weights, 16 and 4 bits, prompts of 8-12 tokens, L up to 4):
# the tiny presets float16 <= 4e-3, float32 <= 3e-3, bfloat16 <= 5e-2 (8 mantissa bits against
# f16's 11); the ouro-1.4b shape at 4 bits, whose 96 block applications amplify any rounding
# difference about 2x per iteration, float16 2.1e-2 and float32 8.7e-3 at L 4. A wrong
# architecture choice on tiny-sandwich gives 7e-2 (the final norm again before the head) to 1.
CHECK_TOLERANCE = {"float16": 3e-2, "float32": 3e-2, "bfloat16": 1e-1}


def check(args):
    """--check-logits: this network against TinyLoop's CPU reference, on the CPU (see the module
    doc). Returns the process's exit status."""
    import pathlib
    import subprocess

    if args.check_tol is None:
        args.check_tol = CHECK_TOLERANCE[args.check_dtype]
    binary = args.tinyloop or str(pathlib.Path(__file__).resolve().parent.parent / "target/release/tinyloop")
    dtype = getattr(torch, args.check_dtype)
    config, tensors, _ = read_tinyloop(args.model, "cpu")
    prompt = [int(t) for t in args.check_logits.split(",")]
    loop_counts = [int(l) for l in args.loops.split(",")]
    steps, dl = args.check_steps, args.decode_loops
    max_len = len(prompt) + steps + 8

    def tinyloop(command, tokens, loops, *extra):
        argv = [binary, args.model, command, "--device", "cpu", "--json", "--loops", str(loops),
                "--tokens", ",".join(map(str, tokens)), *extra]
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    def lens(tokens, loops):
        """TinyLoop's logits at the last position after 1..loops iterations, [loops, vocab]."""
        return torch.tensor(tinyloop("lens", tokens, loops)["logits"], dtype=torch.float64)

    def rel(got, want):
        """max |got - want| / max |want| over the row."""
        return ((got.double() - want).abs().max() / want.abs().max()).item()

    net = Net(config, tensors, dense_linears(tensors, dtype), dtype, loop_counts[0], max_len, device="cpu")
    prefills = [("eager", net.prefill_block)]
    # (label, prefill block, decode step): the compiled steps are the GPU run's, less the CUDA
    # graph around decode_token (none on the CPU), and decode from the compiled prefill's cache.
    decoders = [("eager", net.prefill_block, decode_fn(net, None, None))]
    if args.check_compile:
        allow_recompiles(64)
        block = torch.compile(net.prefill_block, dynamic=False)
        prefills.append(("compiled", block))
        decoders += [(f"compiled {what}", block, decode_fn(net, what, args.decode_compile_mode)) for what in ("step", "block")]
    result = {"model": args.model, "torch": torch.__version__, "dtype": args.check_dtype,
              "architecture": config["architecture"], "prompt": prompt, "tolerance": args.check_tol}
    worst = 0.0

    # Prefill: the last position's logits at every loop count (one lens call gives them all).
    ref = lens(prompt, max(loop_counts))
    tokens = torch.tensor(prompt)
    result["prefill"] = []
    for loops in loop_counts:
        net.set_loops(loops, max_len)
        for label, block in prefills:
            with torch.no_grad():
                got = net.prefill(tokens, block)[0]
            d = rel(got, ref[loops - 1])
            worst = max(worst, d)
            same = int(got.float().argmax()) == int(ref[loops - 1].argmax())
            result["prefill"].append({"impl": label, "loops": loops, "max_rel_diff": d, "argmax_equal": same})
            log(f"check prefill {label:14} L {loops:2}  max rel diff {d:.2e}  argmax {'equal' if same else 'DIFFERS'}")

    # Decode from the static cache: TinyLoop's greedy tokens, fed back (teacher forcing), each
    # step's logits against TinyLoop's at that prefix; equal argmaxes mean equal greedy output.
    gen = tinyloop("generate", prompt, dl, "--max-tokens", str(steps))["tokens"]
    refs = [lens(prompt + gen[:i], dl)[dl - 1] for i in range(len(gen))]
    result["decode"] = {"loops": dl, "tinyloop_tokens": gen}
    net.set_loops(dl, max_len)
    for label, block, step in decoders:
        with torch.no_grad():
            logits = [net.prefill(tokens, block)[0]]
            mine = [int(logits[0].float().argmax())]
            tok, pos = torch.tensor([0]), torch.tensor([len(prompt)])
            for t in gen[:-1]:
                tok.fill_(t)  # TinyLoop's token; decode_token replaces it by the peer's argmax
                logits.append(decode_token(step, tok, pos)[0].clone())
                mine.append(int(tok))
        diffs = [rel(got, want) for got, want in zip(logits, refs)]
        worst = max(worst, max(diffs))
        result["decode"][label] = {"max_rel_diff": max(diffs), "tokens": mine, "tokens_equal": mine == gen}
        log(f"check decode  {label:14} L {dl:2}  {len(gen)} tokens, max rel diff {max(diffs):.2e}  "
            f"greedy tokens {'equal' if mine == gen else f'DIFFER: {mine} vs {gen}'}")
    result["max_rel_diff"] = worst
    result["pass"] = worst <= args.check_tol
    if args.json:
        print(json.dumps(result))
    else:
        print(f"max relative difference {worst:.3e} (tolerance {args.check_tol:g}): {'pass' if result['pass'] else 'FAIL'}")
    return 0 if result["pass"] else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", default="512,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--loops", default="1,4,8", help="loop counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--compile-mode", default="default", help="torch.compile mode of the prefill")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--decode-loops", type=int, default=8)
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--decode-graphs", default="manual", choices=("manual", "reduce-overhead", "none"),
                    help="CUDA graphs of the decode: one torch.cuda.CUDAGraph per token (manual), inductor's "
                    "(torch.compile mode reduce-overhead, the whole step compiled), or none")
    ap.add_argument("--decode-compile", choices=("block", "step"), help="what torch.compile compiles in the "
                    "decode: each block application, or the whole step (default: block; step with reduce-overhead)")
    ap.add_argument("--decode-compile-mode", default="default", choices=("default", "max-autotune-no-cudagraphs"),
                    help="torch.compile mode of the decode, unless --decode-graphs reduce-overhead")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--check-logits", metavar="TOKENS", help="comma-separated prompt token ids: check the "
                    "network against TinyLoop on the CPU (no timing) and exit")
    ap.add_argument("--check-steps", type=int, default=8, help="greedy decode steps the check compares")
    ap.add_argument("--check-dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--check-tol", type=float, help="largest max relative logit difference the check accepts "
                    "(default: 3e-2 for float16 and float32, 1e-1 for bfloat16)")
    ap.add_argument("--check-compile", action="store_true", help="also check the torch.compile'd prefill block and decode (per block and whole step)")
    ap.add_argument("--tinyloop", metavar="BIN", help="the tinyloop binary of the check (default: target/release/tinyloop)")
    args = ap.parse_args()
    if args.decode_graphs == "reduce-overhead":
        if args.decode_compile == "block":  # each block application mutates its cache slot, an input
            ap.error("--decode-graphs reduce-overhead: CUDA graph trees skip functions that mutate their "
                     "inputs, as a compiled block does; use --decode-compile step")
        args.decode_compile = "step"
    args.decode_compile = args.decode_compile or "block"
    if args.check_logits:
        sys.exit(check(args))
    prompts = [int(p) for p in args.prompts.split(",")]
    loop_counts = [int(l) for l in args.loops.split(",")]
    if not torch.cuda.is_available():
        sys.exit("torch_peer.py: no CUDA device visible to torch")
    config, tensors, quant = read_tinyloop(args.model, "cuda")
    why = unsupported_architecture(config["architecture"])
    if why:
        sys.exit(f"torch_peer.py: {args.model}: cannot run {why}")
    max_len = max(prompts + [args.decode_prompt + args.steps + 8])
    gen = torch.Generator().manual_seed(0)
    vocab = config["vocab_size"]
    decode_mode = "reduce-overhead" if args.decode_graphs == "reduce-overhead" else args.decode_compile_mode
    result = {"model": args.model, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
              "compile_mode": args.compile_mode, "decode_graphs": args.decode_graphs,
              "decode_compile": args.decode_compile, "decode_compile_mode": decode_mode, "prefill": [], "decode": []}

    net = Net(config, tensors, dense_linears(tensors), torch.float16, loop_counts[0], max_len)
    # Distinct block applications (block and schedule flags) over the loop counts, per prompt
    # length, and those of the decode, per decode peer.
    apps = {app for loops in loop_counts for app in net.plan(loops)}
    allow_recompiles(max(64, (len(apps) + 2) * len(prompts) + 2 * len(set(net.plan(args.decode_loops))) + 8))
    variants = [("eager", net.prefill_block)]
    if not args.no_compile:
        variants.append((f"compiled ({args.compile_mode})", torch.compile(net.prefill_block, mode=args.compile_mode, dynamic=False)))
    for n in prompts:
        tokens = torch.randint(0, vocab, (n,), generator=gen).cuda()
        for loops in loop_counts:
            net.set_loops(loops, max_len)
            flops = forward_flops(config, n, 0, loops, 1)
            for label, block in variants:
                t0 = time.perf_counter()
                with torch.no_grad():
                    ms = cuda_ms(lambda: net.prefill(tokens, block), args.repeats)
                row = {"impl": label, "prompt": n, "loops": loops, "ms": ms, "flops": flops,
                       "tflops_per_s": flops / ms / 1e9, "wall_s": time.perf_counter() - t0}
                result["prefill"].append(row)
                log(f"prefill {label:32} n {n:5} L {loops:2}  {ms:8.3f} ms  {row['tflops_per_s']:6.1f} TFLOP/s")

    if not args.no_decode:
        prompt = torch.randint(0, vocab, (args.decode_prompt,), generator=gen).cuda()
        graphs = {"manual": "one CUDA graph per token", "reduce-overhead": "inductor CUDA graphs", "none": "no CUDA graphs"}
        method = f"compiled {args.decode_compile} ({decode_mode}), {graphs[args.decode_graphs]}"
        peers = [("fp16", net)]
        why = int4_missing() or next((Int4.unsupported(q, g) for (q, _, _, g) in quant.values() if Int4.unsupported(q, g)), None)
        if not quant:
            why = "the model has no quantized weights"
        if why:
            log(f"int4 weight-only peer skipped: {why}")
            result["int4_skipped"] = why
        else:
            int4 = Net(config, tensors, int4_linears(tensors, quant), torch.bfloat16, args.decode_loops, max_len)
            peers.append(("int4 weight-only", int4))
            # The repacking must reproduce the file's weights (up to bf16 scales): check one.
            name = next(iter(quant))
            x = torch.randn(4, tensors[name].shape[1], generator=gen).cuda()
            lin = int4_linears(tensors, quant)(name)
            got = lin(x.bfloat16()).float()
            want = x @ tensors[name].float().T
            err = ((got - want).norm() / want.norm()).item()
            result["int4_check_rel_err"] = err
            log(f"int4 repacking check on {name}: relative error {err:.2e} (bf16 activations and scales: expect < 2e-2)")
            if err > 2e-2:
                log("int4 weight-only peer dropped: its repacked weights do not match the file's")
                peers.pop()
        for weights, model in peers:
            model.set_loops(args.decode_loops, max_len)
            t0 = time.perf_counter()
            step = decode_fn(model, args.decode_compile, decode_mode)
            ms, setup = time_decode(model, step, prompt, args.steps, 3, args.decode_graphs)
            row = {"impl": f"{weights} {method}", "weights": weights, "decode_graphs": args.decode_graphs,
                   "decode_compile": args.decode_compile, "decode_compile_mode": decode_mode,
                   "prompt": args.decode_prompt, "loops": args.decode_loops, "ms_per_token": ms,
                   "compile_capture_s": setup, "wall_s": time.perf_counter() - t0}
            result["decode"].append(row)
            log(f"decode  {row['impl']}  L {args.decode_loops:2}  {ms:8.4f} ms/token  (compile + capture {setup:.1f} s)")

    if args.json:
        print(json.dumps(result))
        return
    print("\nprefill (ms, TFLOP/s):")
    for r in result["prefill"]:
        print(f"  {r['impl']:32} prompt {r['prompt']:5}  L {r['loops']:2}  {r['ms']:9.3f} ms  {r['tflops_per_s']:7.1f} TFLOP/s")
    if result["decode"]:
        print("decode (ms/token; compile + capture s):")
        width = max(len(r["impl"]) for r in result["decode"])
        for r in result["decode"]:
            print(f"  {r['impl']:{width}}  L {r['loops']:2}  {r['ms_per_token']:.4f}  {r['compile_capture_s']:7.1f}")


if __name__ == "__main__":
    main()
