#!/usr/bin/env bash
# The looped-model calls on a GPU host, from a GPU bundle (scripts/gpu-bundle): docs/PERF.md
# "Looped-model calls".
#   bench/looped-bench.sh BUNDLE OUT [DEMO_MODEL]
# With the CLI's bench (medians of 3 runs of 128 generated tokens after a 128-token prompt,
# greedy), on the demo model and on tl-407m INT4 (seed 1), at verify loops 8:
#   * plain decoding, and self-speculative decoding for draft loops 1, 2, 4 and draft lengths
#     2, 4, 8 (tokens/s, acceptance, agreement), and the best of them without draft reuse;
#   * time to first token after a 1024-token prefix cache against the same 1088-token prompt
#     without one;
#   * resume_generate from a handle built at 8 loops, at 4, 8 and 12, against a fresh generate.
set -uo pipefail
bundle="$(cd "$1" && pwd)"
out="$2"
demo="${3:-models/demo.tinyloop}"
work="${BENCH_WORK:-/tmp/tinyloop-bench}"
mkdir -p "$work" "$out"
tl="$bundle/bin/tinyloop"
export TINYLOOP_KERNEL_CACHE="$work/kernel-cache"
big="$work/tl-407m-b4.tinyloop"
[ -f "$big" ] || "$tl" synth --preset tl-407m --seed 1 --bits 4 --out "$big" 2>>"$out/looped-bench.log"
bench() { # NAME MODEL ARGS...
    local name="$1" model="$2"; shift 2
    timeout "${STEP_TIMEOUT:-200}" "$tl" "$model" bench --device cuda --json --repeats 3 "$@" \
        2>>"$out/looped-bench.log" | tail -n 1 >"$out/$name.json"
    echo "$name $(cat "$out/$name.json")" >>"$out/looped-bench.log"
}
for m in demo big; do
    model=$([ $m = demo ] && echo "$demo" || echo "$big")
    common=(--loops 8 --prompt-len 128 --gen-len 128)
    bench "$m-plain" "$model" "${common[@]}"
    for d in 1 2 4; do
        for k in 2 4 8; do
            bench "$m-spec-d$d-k$k" "$model" "${common[@]}" --draft-loops "$d" --draft-len "$k"
        done
    done
    bench "$m-nocache-d2-k4" "$model" "${common[@]}" --draft-loops 2 --draft-len 4 --no-draft-reuse
    bench "$m-nocache-d1-k4" "$model" "${common[@]}" --draft-loops 1 --draft-len 4 --no-draft-reuse
    bench "$m-ttft-whole" "$model" --loops 8 --prompt-len 1088 --gen-len 8
    bench "$m-ttft-prefix" "$model" --loops 8 --prompt-len 1088 --gen-len 8 --prefix-cache 1024
    for l2 in 4 8 12; do
        bench "$m-fresh-l$l2" "$model" --loops "$l2" --prompt-len 512 --gen-len 8
        bench "$m-resume-l$l2" "$model" --loops "$l2" --prompt-len 512 --gen-len 8 --resume-from 8
    done
done
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return json.loads(open(os.path.join(out, name + ".json")).read())
    except Exception:
        return {}
nan = float("nan")
lines = []
for m in ("demo", "big"):
    plain = load(f"{m}-plain").get("decode_tokens_per_s", nan)
    lines.append(f"## {m}: plain decode {plain:.0f} tok/s ({load(m + '-plain').get('decode_ms_per_token', nan):.4f} ms/token)")
    lines.append("| draft loops | draft len | tok/s | speed-up | acceptance | agreement |")
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for d in (1, 2, 4):
        for k in (2, 4, 8):
            r = load(f"{m}-spec-d{d}-k{k}")
            s = r.get("stats", {})
            tps = r.get("decode_tokens_per_s", nan)
            lines.append(f"| {d} | {k} | {tps:.0f} | {tps / plain:.2f} | {s.get('acceptance_rate', nan):.3f} | {s.get('agreement', nan):.3f} |")
    for d in (2, 1):
        r = load(f"{m}-nocache-d{d}-k4")
        tps = r.get("decode_tokens_per_s", nan)
        lines.append(f"| {d} (no reuse) | 4 | {tps:.0f} | {tps / plain:.2f} | {r.get('stats', {}).get('acceptance_rate', nan):.3f} | |")
    w, p = load(f"{m}-ttft-whole"), load(f"{m}-ttft-prefix")
    lines.append(f"time to first token, 1088-token prompt: {w.get('prefill_ms', nan):.2f} ms; after a 1024-token prefix cache: {p.get('prefill_ms', nan):.2f} ms")
    for l2 in (4, 8, 12):
        f, r = load(f"{m}-fresh-l{l2}"), load(f"{m}-resume-l{l2}")
        lines.append(f"512-token prompt at L={l2}: fresh first token {f.get('prefill_ms', nan):.2f} ms, resumed from L=8 {r.get('prefill_ms', nan):.2f} ms")
text = "\n".join(lines)
print(text)
open(os.path.join(out, "looped-table.md"), "w").write(text + "\n")
PY
