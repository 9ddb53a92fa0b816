"""Time the scoring calls from Python on a GPU host (docs/PERF.md "Prefill against an honest peer").

    TINYLOOP_LIB=BUNDLE/lib/libtinyloop.so PYTHONPATH=BUNDLE/python \
        python3 bench/score_bench.py MODEL [--tokens 2048] [--loops 8] [--no-fp16-body]

Prints the median of 3 timed calls (after one warm-up) of ``Model.score`` (all n x vocab logits)
and ``Model.logprobs`` (n - 1 values) on the same random tokens, and checks that the log-probs
equal a float64 log-softmax of the score call's logits.
"""
import argparse
import statistics
import time

import numpy as np
import tinyloop_py as tl


def median_ms(call, repeats=3):
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--no-fp16-body", action="store_true")
    args = ap.parse_args()
    n = args.tokens
    fp16_body = not args.no_fp16_body
    model = tl.Model(args.model, max_seq_len=n + 64, device="cuda", fp16_body=fp16_body)
    vocab = model.config()["vocab_size"]
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, vocab, n)]
    logprobs = model.logprobs(tokens, loops=args.loops)
    rows = model.score(tokens, loops=args.loops).reshape(n, -1).astype(np.float64)[:-1]
    peak = rows.max(axis=1)
    log_sum = np.log(np.exp(rows - peak[:, None]).sum(axis=1)) + peak
    reference = rows[np.arange(n - 1), tokens[1:]] - log_sum
    diff = np.abs(logprobs - reference).max()
    print(f"logprobs vs a log-softmax of score's logits: max abs diff {diff:.3g}")
    score_ms = median_ms(lambda: model.score(tokens, loops=args.loops))
    logprobs_ms = median_ms(lambda: model.logprobs(tokens, loops=args.loops))
    print(f"{n} tokens, L = {args.loops}: score {score_ms:.1f} ms, logprobs {logprobs_ms:.1f} ms")


if __name__ == "__main__":
    main()
