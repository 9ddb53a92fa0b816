#!/usr/bin/env python3
"""The "CTX-TIER: NLL by position" section of docs/QUALITY.md: held-out NLL of the demo model by
position inside 1024-byte windows, for its INT4 weights, for the loop body re-quantized to INT2,
and for CTX-TIER (INT4 before a threshold T, INT2 from T on), with a power-law fit of the NLL gap
against position, ΔNLL ∝ position^β.

* INT4: `models/demo.tinyloop` as shipped.
* INT2: the same file with its loop-block linears re-quantized by `tinyloop MODEL requantize
  --loop-body-bits 2` (round-to-nearest of the dequantized INT4 weights at the same group size:
  the runtime's CTX-TIER re-pack); the pre blocks, norms, embedding and head stay as they are.
* CTX-TIER at T: `score --ctx-tier --ctx-tier-short-t T+1 --ctx-tier-long-t T+1`, which runs
  positions below T at INT4 and positions from T on at INT2 (attending to the INT4 KV entries
  of earlier positions), prefilled in chunks that divide T. Each window is a new call whose
  first chunk is shorter than short_t, so the session's tier returns to SHORT (hysteresis would
  keep a lower short_t at LONG for every window after the first). A binary without `--ctx-tier` makes
  the tool say so and leave those rows out.

Every variant is scored with `score --window W --buckets E --json` at the model's default depth;
a token's position is its index inside its window, so [0, 128) holds positions 1..127. β is the
least-squares slope of log ΔNLL against log of the bucket's middle position ((start + end) / 2),
over the buckets whose ΔNLL is positive.

Results are kept per variant in --out-dir (with the command that produced them) and reused when
the command is the same, so CTX-TIER rows can be added to an earlier INT4/INT2 run.

The plot needs matplotlib, which the tests do not; install it into a virtual environment under
target/ and run the tool with that interpreter:

    python3 -m venv target/plot-venv && target/plot-venv/bin/pip install matplotlib
    target/plot-venv/bin/python tools/ctx_tier_quality.py --out-dir target/ctx-tier-quality \\
        --plot docs/ctx_tier_quality.png

Without matplotlib the table and the fits are still printed and the plot is skipped.
"""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_BETA = 0.3  # the CTX-TIER design's claim, ΔNLL(T) ∝ T^0.3


def run(cmd):
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    return subprocess.run(list(map(str, cmd)), check=True, capture_output=True, text=True).stdout


def has_ctx_tier(tinyloop):
    return "--ctx-tier" in run([tinyloop, "help", "score"])


def scored(out_dir, name, cmd):
    """The JSON report of `cmd`, from `out_dir` when the same command produced it before."""
    saved = out_dir / f"{name}.json"
    command = " ".join(map(str, cmd))
    if saved.exists():
        cached = json.loads(saved.read_text())
        if cached["command"] == command:
            return cached
    report = json.loads(run(cmd).strip().splitlines()[-1])
    result = {"command": command, "report": report}
    saved.write_text(json.dumps(result, indent=1))
    return result


def middle(bucket):
    return (bucket["start"] + bucket["end"]) / 2


def fit_beta(points):
    """Least-squares slope and intercept of log y against log x, over the points with y > 0."""
    pts = [(math.log(x), math.log(y)) for x, y in points if y > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return slope, my - slope * mx


def deltas(variant, base):
    return [b["nll"] - a["nll"] for a, b in zip(base["buckets"], variant["buckets"])]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--tinyloop", default=str(ROOT / "target/release/tinyloop"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--demo", default=str(ROOT / "models/demo.tinyloop"))
    p.add_argument("--heldout", default=str(ROOT / "tests/data/heldout.txt"))
    p.add_argument("--limit", type=int, default=4096, help="bytes of the held-out text scored")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--buckets", default="128,256,512,1024")
    p.add_argument("--thresholds", type=int, nargs="*", default=[128, 256, 512])
    p.add_argument("--prefill-chunk", type=int, default=64, help="CTX-TIER runs; divides every T")
    p.add_argument("--trained-context", type=int, default=512, help="the demo's training window")
    p.add_argument("--plot", help="write the log-log plot here (PNG)")
    args = p.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    edges = [int(e) for e in args.buckets.split(",")]
    if edges[-1] != args.window:
        sys.exit(f"the last bucket edge ({edges[-1]}) must be the window ({args.window})")
    if any(t not in edges[:-1] for t in args.thresholds):
        sys.exit(f"every threshold must be a bucket edge below the window: {args.thresholds}")
    if any(t % args.prefill_chunk for t in args.thresholds):
        sys.exit(f"--prefill-chunk {args.prefill_chunk} must divide every threshold")

    score = [args.tinyloop, None, "score", "--file", args.heldout, "--window", args.window,
             "--limit", args.limit, "--buckets", args.buckets, "--device", args.device,
             "--json", "-q"]
    int2_path = out / "int2.tinyloop"
    if not int2_path.exists():
        run([args.tinyloop, args.demo, "requantize", "--loop-body-bits", 2, "--out", int2_path])
    variants = {
        "INT4": scored(out, "int4", [*score[:1], args.demo, *score[2:]]),
        "INT2": scored(out, "int2", [*score[:1], int2_path, *score[2:]]),
    }
    if has_ctx_tier(args.tinyloop):
        for t in args.thresholds:
            cmd = [*score[:1], args.demo, *score[2:], "--prefill-chunk", args.prefill_chunk,
                   "--ctx-tier", "--ctx-tier-short-t", t + 1, "--ctx-tier-long-t", t + 1]
            variants[f"CTX-TIER T={t}"] = scored(out, f"ctx-tier-{t}", cmd)
    else:
        print(f"note: {args.tinyloop} has no --ctx-tier option (`tinyloop help score` lists none); "
              "the CTX-TIER rows are left out. Build a binary with CTX-TIER and run again.",
              file=sys.stderr)

    base = variants["INT4"]["report"]
    buckets = base["buckets"]
    heads = [f"{b['start']}–{b['end']}" for b in buckets]
    lines = ["| variant | " + " | ".join(heads) + " | all |",
             "| --- | " + " | ".join("---" for _ in heads) + " | --- |",
             "| tokens | " + " | ".join(str(b["tokens"]) for b in buckets) + f" | {base['tokens']} |"]
    for name, v in variants.items():
        r = v["report"]
        lines.append(f"| {name} | " + " | ".join(f"{b['nll']:.4f}" for b in r["buckets"])
                     + f" | {r['nll']:.4f} |")
    for name, v in variants.items():
        if name == "INT4":
            continue
        r = v["report"]
        lines.append(f"| Δ {name} − INT4 | " + " | ".join(f"{d:+.4f}" for d in deltas(r, base))
                     + f" | {r['nll'] - base['nll']:+.4f} |")
    print("\n".join(lines))

    print()
    mids = [middle(b) for b in buckets]
    int2_delta = deltas(variants["INT2"]["report"], base)
    fits = {}
    for label, upto in [("all buckets", math.inf), (f"positions < {args.trained_context}",
                                                     args.trained_context)]:
        points = [(m, d) for b, m, d in zip(buckets, mids, int2_delta) if b["end"] <= upto]
        fit = fit_beta(points)
        fits[label] = fit
        used = sum(1 for _, d in points if d > 0)
        text = f"β = {fit[0]:.3f}" if fit else "no fit (fewer than 2 positive ΔNLL)"
        print(f"INT2 − INT4, {label} ({used} buckets): {text}  (reference β ≈ {REFERENCE_BETA})")
    for t in args.thresholds:
        name = f"CTX-TIER T={t}"
        if name not in variants:
            continue
        d = deltas(variants[name]["report"], base)
        before = [x for b, x in zip(buckets, d) if b["end"] <= t]
        after = [(b["tokens"], x, y) for b, x, y in zip(buckets, d, int2_delta) if b["start"] >= t]
        n = sum(k for k, _, _ in after)
        tier = sum(k * x for k, x, _ in after) / n
        full = sum(k * y for k, _, y in after) / n
        print(f"{name}: ΔNLL before T max |{max(map(abs, before)):.2e}|; from T on "
              f"{tier:+.4f} nats/token vs INT2's {full:+.4f} there ({tier / full:.0%} of the gap)")
    print()
    for v in variants.values():
        print(v["command"])

    if args.plot:
        plot(args, variants, buckets, mids, int2_delta, fits)


def plot(args, variants, buckets, mids, int2_delta, fits):
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed; the plot is skipped (see the docstring)",
              file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    points = [(m, d) for m, d in zip(mids, int2_delta) if d > 0]
    ax.plot(*zip(*points), "o", color="C0", label="INT2 − INT4")
    xs = [min(mids) * 0.8, max(mids) * 1.25]
    for (label, fit), style in zip(fits.items(), ["-", "-."]):
        if fit:
            slope, icept = fit
            ax.plot(xs, [math.exp(icept) * x ** slope for x in xs], style, color="C0",
                    label=f"fit over {label}: β = {slope:.2f}")
    # The reference slope, drawn through the geometric mean of the INT2 points inside the
    # training context (all points when none is).
    inside = [(m, d) for m, d in points if m < args.trained_context] or points
    gx = math.exp(sum(math.log(m) for m, _ in inside) / len(inside))
    gy = math.exp(sum(math.log(d) for _, d in inside) / len(inside))
    ax.plot(xs, [gy * (x / gx) ** REFERENCE_BETA for x in xs], "--", color="gray",
            label=f"slope {REFERENCE_BETA} (reference)")
    base = variants["INT4"]["report"]
    for i, (name, v) in enumerate(n for n in variants.items() if n[0].startswith("CTX")):
        d = deltas(v["report"], base)
        pts = [(m, x) for b, m, x in zip(buckets, mids, d) if x > 0]
        if pts:
            ax.plot(*zip(*pts), "s", color=f"C{i + 1}", label=f"{name} − INT4")
    ax.axvline(args.trained_context, color="k", lw=0.8, ls=":",
               label=f"training context ({args.trained_context})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("position in the window (bucket middle)")
    ax.set_ylabel("ΔNLL vs INT4 (nats/byte)")
    ax.set_title("Demo model, loop body INT2 vs INT4, by position")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot)
    print(f"wrote {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
