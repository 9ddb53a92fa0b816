#!/usr/bin/env python3
"""The KV-cache table of docs/QUALITY.md: for every KV mode, the bytes per token per slot, the
relative L2 error of the logits against the fp16 mode, and the NLL of the held-out text.

* Logits: `score` over a fixed pseudo-random prompt on synthetic models (tiny, small and
  tl-407m INT4, written with `tinyloop synth`), at loops 1, 4 and 8, through the Python binding;
  the error is ||logits(mode) - logits(fp16)|| / ||logits(fp16)|| over every position.
* NLL: `tinyloop MODEL score --kv MODE` on the first --limit bytes of the held-out text with the
  demo model at its default depth (windows of 512 bytes, as in the table above it).
* `age` with its default boundaries (1024, 4096) holds these short sequences in its INT8 tier;
  `age:64:128` moves most of them into the INT4 tiers.

    python3 tools/kv_quality.py --out-dir target/kv-quality [--device cpu] [--presets tiny small]

Results are saved per preset in the output folder and reused, so a table can combine presets
measured on different machines (the same numbers come out of either backend, within the parity
tolerances of tests/cuda_parity.rs).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ["fp16", "fp16-h", "int8-h", "int4-h", "int8", "delta", "age", "age:64:128"]


def run(cmd):
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--tinyloop", default=str(ROOT / "target/release/tinyloop"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--presets", nargs="+", default=["tiny", "small", "tl-407m"])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--demo", default=str(ROOT / "models/demo.tinyloop"))
    p.add_argument("--heldout", default=str(ROOT / "tests/data/heldout.txt"))
    p.add_argument("--limit", type=int, default=4096)
    args = p.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TINYLOOP_LIB", str(ROOT / "target/release/libtinyloop.so"))
    sys.path.insert(0, str(ROOT / "bindings/python"))
    import numpy as np
    import tinyloop_py

    # Results are kept per preset (and for the NLL) in the output folder, so that parts measured
    # elsewhere (tl-407m on a GPU host) join the same table.
    rows = {}
    for preset in args.presets:
        saved = out / f"logits-{preset}.json"
        if saved.exists():
            for mode, cells in json.loads(saved.read_text()).items():
                rows.setdefault(mode, {}).update(cells)
            continue
        path = out / f"{preset}-b4.tinyloop"
        if not path.exists():
            run([args.tinyloop, "synth", "--preset", preset, "--seed", "1", "--bits", "4", "--out", path])
        reference, these = {}, {}
        for mode in MODES:
            model = tinyloop_py.Model(path, max_seq_len=args.prompt_len, device=args.device,
                                      kv_mode=mode, log=False)
            with model:
                vocab = model.config()["vocab_size"]
                prompt = [(i * 2654435761 >> 9) % vocab for i in range(args.prompt_len)]
                for loops in (1, 4, 8):
                    logits = np.asarray(model.score(prompt, loops=loops), dtype=np.float64)
                    if mode == "fp16":
                        reference[loops] = logits
                    ref = reference[loops]
                    err = float(np.linalg.norm(logits - ref) / np.linalg.norm(ref))
                    these.setdefault(mode, {})[f"{preset} L={loops}"] = err
                    print(f"{preset} {mode} L={loops}: {err:.3e}", file=sys.stderr, flush=True)
        saved.write_text(json.dumps(these, indent=1))
        for mode, cells in these.items():
            rows.setdefault(mode, {}).update(cells)

    saved = out / "nll.json"
    nll = json.loads(saved.read_text()) if saved.exists() else {}
    for mode in MODES:
        if mode in nll:
            continue
        text = run([args.tinyloop, args.demo, "score", "--file", args.heldout, "--limit", str(args.limit),
                    "--kv", mode, "--device", args.device, "--json", "-q"])
        nll[mode] = json.loads(text.strip().splitlines()[-1])["nll"]
        saved.write_text(json.dumps(nll, indent=1))

    columns = [f"{preset} L={loops}" for preset in args.presets for loops in (1, 4, 8)]
    lines = ["| mode | " + " | ".join(columns) + " | demo NLL (nats/byte) | vs fp16 |",
             "| --- | " + " | ".join("---" for _ in columns) + " | --- | --- |"]
    for mode in MODES:
        cells = [f"{rows[mode][c]:.1e}" if rows[mode][c] > 0 else "0" for c in columns]
        delta = nll[mode] - nll["fp16"]
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {nll[mode]:.4f} | {delta:+.4f} |")
    table = "\n".join(lines)
    print(table)
    (out / "kv-quality.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
