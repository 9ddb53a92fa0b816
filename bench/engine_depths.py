"""Requests of mixed loop depths in one engine, against the same requests grouped by depth.

    python3 bench/engine_depths.py MODEL [--device cpu] [--requests 32] [--depths 2,4,8,16]
                                   [--prompt-len 32] [--tokens 64] [--repeats 3] [--json]

Both runs submit the same requests (prompts cut from the bench's pseudo-random byte sequence,
loop counts cycling through --depths): `mixed` submits all of them at once, so a step carries
rows of every depth (loop iteration i runs the rows that reach it); `grouped` submits the
requests of one depth at a time and waits for them before the next depth. Prints the wall time
and the aggregate generated tokens/s of each (medians of --repeats, the two interleaved), and
checks that every request produced the same tokens both ways. Uses the Python binding
(PYTHONPATH=bindings/python, or an installed tinyloop_py).
"""

import argparse
import json
import statistics
import time

import tinyloop_py


def prompts(n, length, vocab):
    """Deterministic pseudo-random prompts (a linear congruential sequence)."""
    state, out = 12345, []
    for _ in range(n):
        p = []
        for _ in range(length):
            state = (state * 1103515245 + 12345) % 2**31
            p.append(state % vocab)
        out.append(p)
    return out


def run(engine, requests, tokens, grouped):
    """Wall seconds and the tokens of every request (in request order)."""
    results = [None] * len(requests)
    start = time.perf_counter()
    if grouped:
        for depth in sorted({loops for _, loops in requests}):
            batch = [(i, engine.submit(p, max_tokens=tokens, loops=loops, temperature=0))
                     for i, (p, loops) in enumerate(requests) if loops == depth]
            for i, r in batch:
                results[i] = list(r)
    else:
        batch = [engine.submit(p, max_tokens=tokens, loops=loops, temperature=0)
                 for p, loops in requests]
        for i, r in enumerate(batch):
            results[i] = list(r)
    return time.perf_counter() - start, results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--depths", default="2,4,8,16")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    model = tinyloop_py.Model(args.model, device=args.device, max_loops=max(depths), log=False)
    vocab = model.config()["vocab_size"]
    requests = [(p, depths[i % len(depths)])
                for i, p in enumerate(prompts(args.requests, args.prompt_len, vocab))]
    times = {"mixed": [], "grouped": []}
    outputs = {}
    with tinyloop_py.Engine(model, max_running=args.requests) as engine:
        run(engine, requests[: len(depths)], 2, grouped=False)  # warm-up
        for _ in range(args.repeats):
            for name in ("mixed", "grouped"):
                seconds, out = run(engine, requests, args.tokens, grouped=name == "grouped")
                times[name].append(seconds)
                outputs.setdefault(name, out)
    same = outputs["mixed"] == outputs["grouped"]
    generated = args.requests * args.tokens
    report = {
        name: {"wall_s": statistics.median(t), "tokens_per_s": generated / statistics.median(t)}
        for name, t in times.items()
    }
    report["mixed_over_grouped"] = report["mixed"]["tokens_per_s"] / report["grouped"]["tokens_per_s"]
    report["same_tokens"] = same
    report["requests"], report["depths"], report["tokens"] = args.requests, depths, args.tokens
    if args.json:
        print(json.dumps(report))
    else:
        for name in ("mixed", "grouped"):
            r = report[name]
            print(f"{name:8} {r['wall_s']:8.2f} s  {r['tokens_per_s']:8.1f} tokens/s")
        print(f"mixed / grouped: {report['mixed_over_grouped']:.2f}x; same tokens: {same}")
    if not same:
        raise SystemExit("the two runs produced different tokens")


if __name__ == "__main__":
    main()
