#!/usr/bin/env python3
"""The PyTorch peer of docs/PERF.md "Prefill against an honest peer": the network of a
.tinyloop file in the configuration a PyTorch user would pick, timed on the same GPU.

Prefill (what a user runs before sampling the first token):
  * the same weights, dequantized once (scale * q + zero in f32, rounded to FP16), dense cuBLAS
    GEMMs, gate and up fused into one GEMM;
  * flash attention through scaled_dot_product_attention(is_causal=True) over the prompt;
    the prompt's K and V are written to a static KV cache, as a prefill must;
  * the head on the last position only;
  * eager, and torch.compile (mode --compile-mode, default "default"; each block is one compiled
    graph, shared by every block application since they have the same shapes).
Decode (batch 1, static KV cache, the step captured as CUDA graphs by
torch.compile(mode="reduce-overhead")):
  * FP16 dense weights;
  * int4 weight-only through torch.ops.aten._weight_int4pack_mm (bf16 activations, the op's
    only CUDA input type), with the file's own codes repacked: the op computes
    (q - 8) * scale + zero', so zero' = zero + 8 * scale gives the file's scale * q + zero
    (up to the bf16 rounding of scale and zero'). INT2 codes are packed as int4 codes.

FLOPs (the same count as tinyloop::model::flops and the CLI's bench): a multiply-add is 2 FLOPs;
per block application, 2 * n * (params of QKV, out, gate, up, down) for the linear layers and
4 * dim * n * (n + 1) / 2 for causal attention over n prompt tokens (Q.K and P.V, every head);
plus the factorized embedding's projection and 2 * dim * vocab for the head on the last row.

usage: torch_peer.py MODEL.tinyloop [--prompts 512,2048] [--loops 1,4,8] [--repeats 10]
       [--compile-mode default] [--no-compile] [--no-decode] [--decode-loops 8]
       [--decode-prompt 128] [--steps 128] [--json]
Prints one line per measurement on stderr while running, and a table (or, with --json, one
JSON object) on stdout at the end.
"""

import argparse
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


class Net(torch.nn.Module):
    """The looped network in `dtype`, with block linears from `make_linear(name)`."""

    def __init__(self, config, tensors, make_linear, dtype, loops, max_len):
        super().__init__()
        c = self.c = config
        self.d, self.h, self.hk = c["dim"], c["n_heads"], c["n_kv_heads"]
        self.hd = self.d // self.h
        self.layer_norm = c["norm"] == "layernorm"
        self.eps = c["norm_eps"]
        self.dtype = dtype
        self.blocks = [f"pre.{i}" for i in range(c["n_pre_blocks"])]
        self.blocks += [f"loop.{j}" for j in range(c["n_loop_blocks"])]
        self.blocks += [f"post.{i}" for i in range(c["n_post_blocks"])]
        self.p = torch.nn.ParameterDict()
        self.lin = torch.nn.ModuleDict()
        for name, t in tensors.items():
            key = name.replace(".", "__")
            if name.split(".")[-1] in ("attn_qkv", "attn_out", "mlp_down"):
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
        self.register_buffer("cos", ang.cos().float().cuda())
        self.register_buffer("sin", ang.sin().float().cuda())
        self.register_buffer("positions", torch.arange(max_len, device="cuda"))
        self.set_loops(loops, max_len)

    def set_loops(self, loops, max_len):
        c = self.c
        body = [f"loop.{j}" for j in range(c["n_loop_blocks"])]
        self.schedule = self.blocks[: c["n_pre_blocks"]] + body * loops + self.blocks[len(self.blocks) - c["n_post_blocks"] :]
        shape = (len(self.schedule), self.hk, max_len, self.hd)
        self.register_buffer("k", torch.zeros(shape, dtype=self.dtype, device="cuda"))
        self.register_buffer("v", torch.zeros(shape, dtype=self.dtype, device="cuda"))

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
        return x

    def head(self, h):
        if self.c["head"] == "untied":
            return h @ self.weight("head").T
        if self.c["embed_factor_dim"]:
            h = h @ self.weight("embed_proj")
        return h @ self.weight("embed").T

    def qkv(self, x, name, pos):
        n, qd, kd = x.shape[0], self.h * self.hd, self.hk * self.hd
        qkv = self.linear(name + ".attn_qkv", self.norm(x, name + ".attn_norm"))
        q = self.rope(qkv[:, :qd].reshape(n, self.h, self.hd), pos).transpose(0, 1)
        k = self.rope(qkv[:, qd : qd + kd].reshape(n, self.hk, self.hd), pos).transpose(0, 1)
        v = qkv[:, qd + kd :].reshape(n, self.hk, self.hd).transpose(0, 1)
        return q, k, v

    def finish(self, x, a, name):
        """Output projection and the MLP after attention output `a` [n, heads * hd]."""
        x = x + self.linear(name + ".attn_out", a)
        gu = self.linear(name + ".mlp_gateup", self.norm(x, name + ".mlp_norm"))
        g, u = gu.chunk(2, dim=-1)
        return x + self.linear(name + ".mlp_down", F.silu(g) * u)

    def prefill_block(self, x, name, pos):
        """One block application over a whole prompt: flash attention, causal, no mask tensor.
        Returns the new residual and the prompt's K and V (for the cache)."""
        q, k, v = self.qkv(x, name, pos)
        a = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True, enable_gqa=self.hk != self.h)
        return self.finish(x, a.squeeze(0).transpose(0, 1).reshape(x.shape[0], -1), name), k, v

    def prefill(self, tokens, block):
        """Logits of the last prompt position; `block` is prefill_block, eager or compiled."""
        n = tokens.shape[0]
        pos = self.positions[:n]
        x = self.embed(tokens)
        for slot, name in enumerate(self.schedule):
            x, k, v = block(x, name, pos)
            self.k[slot, :, :n] = k
            self.v[slot, :, :n] = v
        return self.head(self.norm(x[-1:], "final_norm"))

    def decode_step(self, token, pos):
        """Logits [1, vocab] for one token at position `pos` (device tensors of one element),
        attending over the static cache through a mask (the usual static-cache decode)."""
        mask = (self.positions <= pos).view(1, 1, 1, -1)
        x = self.embed(token)
        for slot, name in enumerate(self.schedule):
            q, k, v = self.qkv(x, name, pos)
            self.k[slot].index_copy_(1, pos, k)
            self.v[slot].index_copy_(1, pos, v)
            a = F.scaled_dot_product_attention(q.unsqueeze(0), self.k[slot].unsqueeze(0), self.v[slot].unsqueeze(0), attn_mask=mask, enable_gqa=self.hk != self.h)
            x = self.finish(x, a.squeeze(0).transpose(0, 1).reshape(1, -1), name)
        return self.head(self.norm(x, "final_norm"))


def dense_linears(tensors):
    def make(name):
        if isinstance(name, tuple):
            return Dense(torch.cat([tensors[n] for n in name]))
        return Dense(tensors[name])

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


def time_decode(net, step, prompt, steps, repeats):
    """Median ms/token of `steps` greedy decode steps after a `prompt`-token prefill."""
    with torch.no_grad():
        logits = net.prefill(prompt, net.prefill_block)
    first = logits.argmax(-1)
    pos = torch.tensor([prompt.shape[0]], device="cuda")

    def run():
        tok = first.clone()
        pos.fill_(prompt.shape[0])
        for _ in range(steps):
            tok = step(tok, pos).argmax(-1)
            pos.add_(1)

    with torch.no_grad():
        return cuda_ms(run, repeats, warmup=2) / steps


def log(line):
    """Progress, on stderr (stdout carries the table, or the JSON with --json)."""
    print(line, file=sys.stderr, flush=True)


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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    prompts = [int(p) for p in args.prompts.split(",")]
    loop_counts = [int(l) for l in args.loops.split(",")]
    if not torch.cuda.is_available():
        sys.exit("torch_peer.py: no CUDA device visible to torch")
    torch._dynamo.config.cache_size_limit = 64
    config, tensors, quant = read_tinyloop(args.model, "cuda")
    max_len = max(prompts + [args.decode_prompt + args.steps + 8])
    gen = torch.Generator().manual_seed(0)
    vocab = config["vocab_size"]
    result = {"model": args.model, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
              "compile_mode": args.compile_mode, "prefill": [], "decode": []}

    net = Net(config, tensors, dense_linears(tensors), torch.float16, loop_counts[0], max_len)
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
        peers = [("fp16 compiled (reduce-overhead)", net)]
        why = int4_missing() or next((Int4.unsupported(q, g) for (q, _, _, g) in quant.values() if Int4.unsupported(q, g)), None)
        if not quant:
            why = "the model has no quantized weights"
        if why:
            log(f"int4 weight-only peer skipped: {why}")
            result["int4_skipped"] = why
        else:
            int4 = Net(config, tensors, int4_linears(tensors, quant), torch.bfloat16, args.decode_loops, max_len)
            peers.append(("int4 weight-only compiled (reduce-overhead)", int4))
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
        for label, model in peers:
            model.set_loops(args.decode_loops, max_len)
            step = torch.compile(model.decode_step, mode="reduce-overhead", fullgraph=True)
            t0 = time.perf_counter()
            ms = time_decode(model, step, prompt, args.steps, 3)
            row = {"impl": label, "prompt": args.decode_prompt, "loops": args.decode_loops, "ms_per_token": ms,
                   "wall_s": time.perf_counter() - t0}
            result["decode"].append(row)
            log(f"decode  {label:44} L {args.decode_loops:2}  {ms:8.4f} ms/token")

    if args.json:
        print(json.dumps(result))
        return
    print("\nprefill (ms, TFLOP/s):")
    for r in result["prefill"]:
        print(f"  {r['impl']:32} prompt {r['prompt']:5}  L {r['loops']:2}  {r['ms']:9.3f} ms  {r['tflops_per_s']:7.1f} TFLOP/s")
    if result["decode"]:
        print("decode (ms/token):")
        for r in result["decode"]:
            print(f"  {r['impl']:44} L {r['loops']:2}  {r['ms_per_token']:.4f}")


if __name__ == "__main__":
    main()
