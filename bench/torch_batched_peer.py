#!/usr/bin/env python3
"""The PyTorch peer of docs/PERF.md "Continuous batching": batched greedy decode of B sequences
of a .tinyloop file's network, in the configuration a PyTorch user would pick for many requests
at once, timed on the same GPU as `tinyloop MODEL bench --concurrency B --engine`.

The network is torch_peer.py's (same weights dequantized to FP16, gate and up fused, every
config.architecture it takes). Batched decode:
  * all B sequences in lock-step: one prompt of --prompt tokens, prefilled once and copied into
    every sequence's rows of a static KV cache [block applications, B, kv_heads, max_len,
    head_dim] (so every sequence attends over the same number of positions, the peer's best
    case: no ragged lengths, no arrivals, no paging, no scheduler);
  * a token of all B sequences is one CUDA graph replay: the step (embedding, every block
    application, head on the B rows), the argmax into the static token tensor and pos += 1,
    captured once after warm-up; the block applications compiled with torch.compile (one graph
    per block and schedule flags, fullgraph, static shapes), attention through
    scaled_dot_product_attention over the static cache with a position mask;
  * tokens/s = B * steps / the median time of `steps` replays (CUDA events), after warm-up.

usage: torch_batched_peer.py MODEL.tinyloop [--batch 1,8,32,128,256] [--loops 8] [--prompt 128]
       [--steps 256] [--repeats 3] [--compile-mode default] [--json]
"""

import argparse
import functools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_peer import Net, allow_recompiles, cuda_graph, cuda_ms, dense_linears, log, read_tinyloop  # noqa: E402


class BatchedNet(Net):
    """Net with a decode step over B sequences in lock-step at one position."""

    def set_batch(self, batch, max_len):
        shape = (len(self.schedule), batch, self.hk, max_len, self.hd)
        self.kb = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.vb = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def fill_batch(self, n):
        """Every sequence's cache rows from the prompt prefilled into the batch-1 cache."""
        self.kb[:, :, :, :n] = self.k[:, None, :, :n]
        self.vb[:, :, :, :n] = self.v[:, None, :, :n]

    def batch_block(self, x, name, pos, mask, k_cache, v_cache, u=None, begin=False, enter=False, norm_after=False):
        """One block application to B rows at position `pos` (one element): K and V written into
        each sequence's cache rows (k_cache, v_cache: [B, kv_heads, max_len, head_dim] views),
        attention over them through `mask`."""
        b = x.shape[0]
        rows = pos.expand(b)
        if enter:
            x, u = self.enter_loop(x, u, rows, begin)
        q, k, v = self.qkv(x, name, rows)  # [heads, B, head_dim]
        k_cache.index_copy_(2, pos, k.transpose(0, 1).unsqueeze(2))
        v_cache.index_copy_(2, pos, v.transpose(0, 1).unsqueeze(2))
        q = q.transpose(0, 1).unsqueeze(2)  # [B, heads, 1, head_dim]
        a = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=self.hk != self.h)
        x = self.finish(x, a.reshape(b, -1), name)
        if norm_after:
            x = self.norm(x, "final_norm")
        return x, u

    def batch_step(self, tokens, pos, block):
        """Logits [B, vocab] of B tokens at position `pos`."""
        mask = (self.positions <= pos).view(1, 1, 1, -1)
        x, u = self.embed(tokens), None
        for slot, (name, begin, enter, norm_after) in enumerate(self.schedule):
            x, u = block(x, name, pos, mask, self.kb[slot], self.vb[slot], u, begin, enter, norm_after)
        return self.head(self.head_input(x))


def batch_token(step, tokens, pos):
    """One greedy token of every sequence, in place (a CUDA graph of it generates the next)."""
    logits = step(tokens, pos)
    tokens.copy_(logits.argmax(-1))
    pos.add_(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batch", default="1,8,32,128,256", help="batch sizes, comma-separated")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile-mode", default="default")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_batched_peer.py: no CUDA device visible to torch")
    config, tensors, _ = read_tinyloop(args.model, "cuda")
    max_len = args.prompt + args.steps + 8
    net = BatchedNet(config, tensors, dense_linears(tensors), torch.float16, args.loops, max_len)
    allow_recompiles(64 + 2 * len(set(net.plan(args.loops))))
    block = torch.compile(net.batch_block, mode=args.compile_mode, fullgraph=True, dynamic=False)
    step = functools.partial(net.batch_step, block=block)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config["vocab_size"], (args.prompt,), generator=gen).cuda()
    result = {"model": args.model, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
              "loops": args.loops, "prompt": args.prompt, "steps": args.steps, "decode": []}
    with torch.no_grad():
        first = net.prefill(prompt, net.prefill_block).argmax(-1)
        for b in [int(v) for v in args.batch.split(",")]:
            t0 = time.perf_counter()
            net.set_batch(b, max_len)
            tokens, pos = first.expand(b).clone(), torch.tensor([args.prompt], device="cuda")
            token = cuda_graph(functools.partial(batch_token, step, tokens, pos))
            setup = time.perf_counter() - t0
            # The prompt's entries; every run rewrites the positions after it.
            net.fill_batch(args.prompt)
            # The batched step must compute what the batch-1 decode step computes.
            at = torch.tensor([args.prompt], device="cuda")
            want = net.decode_step(first, at, net.decode_block).float()
            got = net.batch_step(first.expand(b), at, net.batch_block).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            if err > 1e-2:
                sys.exit(f"torch_batched_peer.py: batch {b} logits differ from batch 1 by {err:.2e}")

            def run():
                tokens.copy_(first.expand(b))
                pos.fill_(args.prompt)
                for _ in range(args.steps):
                    token()

            ms = cuda_ms(run, args.repeats, warmup=1)
            row = {"batch": b, "ms_per_step": ms / args.steps, "tokens_per_s": b * args.steps / ms * 1e3,
                   "compile_capture_s": setup, "check_rel_err": err}
            result["decode"].append(row)
            log(f"batched decode B {b:4}  {row['ms_per_step']:8.4f} ms/step  {row['tokens_per_s']:10.0f} tokens/s"
                f"  (compile + capture {setup:.1f} s)")
            del net.kb, net.vb
            torch.cuda.empty_cache()
    if args.json:
        print(json.dumps(result))
        return
    for r in result["decode"]:
        print(f"B {r['batch']:4}  {r['ms_per_step']:.4f} ms/step  {r['tokens_per_s']:.0f} tokens/s")


if __name__ == "__main__":
    main()
