#!/usr/bin/env python3
"""Build the quality table of docs/QUALITY.md.

Converts one safetensors checkpoint to FP16, INT4 and INT2 by round-to-nearest and GPTQ with
`tinyloop convert`, scores the held-out text at several loop depths with `tinyloop MODEL score`,
and prints a Markdown table plus the command behind every number.

    python3 tools/quality.py --safetensors .bundle/train/run/model.safetensors \\
        --config .bundle/train/run/config.json --out-dir .bundle/quality
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

VARIANTS = [
    ("FP16", 16, "rtn"),
    ("INT4-RTN", 4, "rtn"),
    ("INT4-GPTQ", 4, "gptq"),
    ("INT2-RTN", 2, "rtn"),
    ("INT2-GPTQ", 2, "gptq"),
]


def run(cmd):
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--safetensors", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--tinyloop", default="target/release/tinyloop")
    p.add_argument("--heldout", default="tests/data/heldout.txt")
    p.add_argument("--limit", type=int, default=8192, help="held-out bytes scored")
    p.add_argument("--calib", default="tests/data/train_excerpt.txt")
    p.add_argument("--calib-bytes", type=int, default=32768)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--loops", default="1,2,4,6,8,12")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    loops = [int(x) for x in args.loops.split(",")]
    rows = []
    commands = []
    for name, bits, method in VARIANTS:
        model = out / f"{name.lower()}.tinyloop"
        convert = [args.tinyloop, "convert", "--safetensors", args.safetensors, "--config", args.config,
                   "--out", str(model), "--bits", str(bits), "--group-size", str(args.group_size),
                   "--method", method]
        if method == "gptq":
            convert += ["--calib", args.calib, "--calib-bytes", str(args.calib_bytes)]
        run(convert)
        commands.append(" ".join(convert))
        scores = []
        for L in loops:
            score = [args.tinyloop, str(model), "score", "--file", args.heldout, "--limit", str(args.limit),
                     "--loops", str(L), "--device", args.device, "--json"]
            result = json.loads(run(score))
            scores.append(result)
        commands.append(" ".join(score[:2] + ["score", "--file", args.heldout, "--limit", str(args.limit),
                                             "--loops", "L", "--device", args.device, "--json"]))
        size = model.stat().st_size
        rows.append((name, size, scores))

    header = "| weights | file MB | " + " | ".join(f"L={L}" for L in loops) + " |"
    print(header)
    print("|" + " --- |" * (len(loops) + 2))
    for name, size, scores in rows:
        cells = " | ".join(f"{s['nll']:.4f} ({s['ppl']:.2f})" for s in scores)
        print(f"| {name} | {size / 1e6:.2f} | {cells} |")
    print()
    print(f"Cells: held-out NLL in nats/byte (perplexity), first {args.limit} bytes of {args.heldout}.")
    print()
    print("```")
    for c in commands:
        print(c)
    print("```")


if __name__ == "__main__":
    main()
