"""One graph-replayed decode step's kernels on the GPU, as CUPTI sees them through torch.profiler.

    TINYLOOP_LIB=.../libtinyloop.so PYTHONPATH=bindings/python \
        python3 bench/decode_timeline.py MODEL [--loops 8]

Opens MODEL through the Python binding on CUDA, generates once untimed (which captures the decode
graph), then generates again under the profiler. Prints each kernel of one whole step (between two
embedding kernels): its start from the step's first kernel and its duration, in µs; then, per
kernel, the time from the end of everything before it to its own end (with programmatic
dependent launch a kernel starts before its predecessor ends, so durations overlap); then the
step's span.
"""

import argparse

import tinyloop_py
from kernel_trace import traced_kernels


def step_kernels(model, loops):
    prompt = list(range(5, 21))
    model.generate(prompt, max_tokens=16, loops=loops)
    kernels = traced_kernels(lambda: model.generate(prompt, max_tokens=8, loops=loops))
    embeds = [i for i, k in enumerate(kernels) if "embed" in k[2]]
    if len(embeds) < 3:
        raise SystemExit("fewer than three embedding kernels traced: no whole step between two")
    return kernels[embeds[-3] : embeds[-2]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--loops", type=int, default=8)
    args = ap.parse_args()
    model = tinyloop_py.Model(args.model, device="cuda", max_seq_len=256, log=False)
    step = step_kernels(model, args.loops)
    t0 = step[0][0]
    finished = t0
    print("start_us  dur_us  after_us  kernel")
    for start, dur, name in step:
        end = start + dur
        print(f"{start - t0:8.2f} {dur:7.2f} {end - finished:9.2f}  {name[:60]}")
        finished = max(finished, end)
    print(f"kernels {len(step)}  span {finished - t0:.1f} us")


if __name__ == "__main__":
    main()
