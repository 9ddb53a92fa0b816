"""Where an engine's steps spend their time on the GPU, as CUPTI sees it through torch.profiler.

    TINYLOOP_LIB=.../libtinyloop.so PYTHONPATH=bindings/python \
        python3 bench/engine_timeline.py MODEL [--clients 256] [--prompt-len 128] [--tokens 64]

Opens MODEL through the Python binding on CUDA, runs one untimed round of --clients requests
(pseudo-random token-id prompts of --prompt-len, --tokens greedy tokens each), then the same
round under the profiler. A step is the kernels from one embedding kernel to the next.
Prints the window's span, the GPU's busy time in it (the union of the kernels' intervals: the
rest is time the GPU waited for the host) and the generated tokens/s; then the steps grouped by
the product kernels they ran (which tell their row tiling), with the median span (first kernel's
start to the next step's) and busy time of each group; then, for the group that takes the most
time, each kernel's median busy time per step.
"""

import argparse
import collections
import statistics

import tinyloop_py
from engine_depths import prompts
from kernel_trace import traced_kernels


def run_round(engine, requests, tokens):
    """Submit every request at once and wait for all; returns the tokens generated."""
    handles = [engine.submit(p, max_tokens=tokens, temperature=0) for p in requests]
    return sum(len(list(h)) for h in handles)


def busy(intervals):
    """Length of the union of (start, end) intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def steps_of(kernels):
    """The whole steps (kernels from one embedding kernel to the next) and the next step's start."""
    starts = [i for i, k in enumerate(kernels) if "embed" in k[2]]
    steps = [(kernels[a:b], kernels[b][0]) for a, b in zip(starts, starts[1:])]
    if not steps:
        raise SystemExit("fewer than two embedding kernels traced: no whole step")
    return steps


def kind_of(step):
    """A step's kind: the product kernels it ran (their names tell the row tiling)."""
    return " ".join(sorted({k[2].split("(")[0] for k in step if k[2].startswith("gemm_")}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--max-step-rows", type=int, default=256)
    args = ap.parse_args()
    seq = args.prompt_len + args.tokens
    model = tinyloop_py.Model(args.model, device="cuda", max_seq_len=seq, log=False)
    requests = prompts(args.clients, args.prompt_len, model.config()["vocab_size"])
    pool = args.clients * (seq + 64)
    with tinyloop_py.Engine(model, max_step_rows=args.max_step_rows, max_running=args.clients,
                            pool_positions=pool) as engine:
        run_round(engine, requests, args.tokens)
        kernels = traced_kernels(lambda: run_round(engine, requests, args.tokens))
    window = kernels[-1][0] + kernels[-1][1] - kernels[0][0]
    print(f"window {window / 1e3:.1f} ms, GPU busy {busy((k[0], k[0] + k[1]) for k in kernels) / 1e3:.1f} ms,"
          f" {args.clients * args.tokens / window * 1e6:.0f} generated tokens/s")
    by_kind = collections.defaultdict(list)
    for step, nxt in steps_of(kernels):
        by_kind[kind_of(step)].append((step, nxt))
    print("steps  span_us  busy_us  product kernels")
    for kind, steps in sorted(by_kind.items(), key=lambda x: -len(x[1])):
        spans = [nxt - s[0][0] for s, nxt in steps]
        busies = [busy((k[0], k[0] + k[1]) for k in s) for s, _ in steps]
        print(f"{len(steps):5d} {statistics.median(spans):8.1f} {statistics.median(busies):8.1f}  {kind}")
    steps = max(by_kind.values(), key=lambda v: sum(nxt - s[0][0] for s, nxt in v))
    per_name = collections.defaultdict(list)
    for s, _ in steps:
        step_names = collections.defaultdict(list)
        for start, dur, name in s:
            step_names[name.split("(")[0]].append((start, start + dur))
        for name, iv in step_names.items():
            per_name[name].append((busy(iv), len(iv)))
    print(f"the kind that takes the most time: {len(steps)} steps; per step, median busy time of each kernel"
          " (kernels launched early wait inside their time, so these overlap)")
    print("busy_us  calls  kernel")
    rows = [(statistics.median(b for b, _ in v), v[0][1], n) for n, v in per_name.items()]
    for b, calls, name in sorted(rows, reverse=True):
        print(f"{b:8.1f} {calls:6d}  {name[:70]}")


if __name__ == "__main__":
    main()
