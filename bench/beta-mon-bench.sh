#!/usr/bin/env bash
# BETA-MON's decode cost on a GPU host, from a GPU bundle (scripts/gpu-bundle):
#   bench/beta-mon-bench.sh BUNDLE OUT [DEMO_MODEL]
# With the CLI's bench (medians of 5 runs of 128 tokens after a 128-token prompt, loops 8), on
# the demo model and on tl-407m INT4 (seed 1): decode ms/token with BETA-MON off and on
# (`--beta-monitor`) for greedy, sampled (temperature 0.8, top-k 40) and self-speculative
# (draft loops 2, draft length 4) decoding. Off and on alternate, three times each, and the
# table takes the median of the three medians, so that clock drift hits both alike.
set -uo pipefail
bundle="$(cd "$1" && pwd)"
out="$2"
demo="${3:-models/demo.tinyloop}"
work="${BENCH_WORK:-/tmp/tinyloop-bench}"
mkdir -p "$work" "$out"
tl="$bundle/bin/tinyloop"
export TINYLOOP_KERNEL_CACHE="$work/kernel-cache"
unset TINYLOOP_BETA_MONITOR TINYLOOP_BETA_MON_VERBOSE TINYLOOP_BETA_MON_FILE
big="$work/tl-407m-b4.tinyloop"
[ -f "$big" ] || "$tl" synth --preset tl-407m --seed 1 --bits 4 --out "$big" 2>>"$out/beta-mon-bench.log"
bench() { # NAME MODEL ARGS...
    local name="$1" model="$2"; shift 2
    timeout "${STEP_TIMEOUT:-200}" "$tl" "$model" bench --device cuda --json --repeats 5 \
        --loops 8 --prompt-len 128 --gen-len 128 "$@" \
        2>>"$out/beta-mon-bench.log" | tail -n 1 >"$out/$name.json"
    echo "$name $(cat "$out/$name.json")" >>"$out/beta-mon-bench.log"
}
for m in demo big; do
    model=$([ $m = demo ] && echo "$demo" || echo "$big")
    for mode in greedy sampled speculative; do
        case $mode in
            greedy) args=() ;;
            sampled) args=(--temperature 0.8 --top-k 40 --seed 1) ;;
            speculative) args=(--draft-loops 2 --draft-len 4) ;;
        esac
        for i in 1 2 3; do
            bench "$m-$mode-off-$i" "$model" "${args[@]}"
            bench "$m-$mode-on-$i" "$model" "${args[@]}" --beta-monitor
        done
    done
done
python3 - "$out" <<'PY'
import json, os, statistics, sys
out = sys.argv[1]
nan = float("nan")
def load(name):
    try:
        return json.loads(open(os.path.join(out, name + ".json")).read())
    except Exception:
        return {}
def ms(name):
    values = [load(f"{name}-{i}").get("decode_ms_per_token", nan) for i in (1, 2, 3)]
    return statistics.median(values)
lines = ["| model | decoding | BETA-MON off ms/token | on ms/token | overhead |",
         "| --- | --- | --- | --- | --- |"]
for m, label in (("demo", "demo"), ("big", "tl-407m INT4")):
    for mode in ("greedy", "sampled", "speculative"):
        off, on = ms(f"{m}-{mode}-off"), ms(f"{m}-{mode}-on")
        lines.append(f"| {label} L=8 | {mode} | {off:.4f} | {on:.4f} | {100 * (on / off - 1):+.2f} % |")
    summary = load(f"{m}-speculative-on-1").get("stats", {}).get("beta_mon", {})
    if summary:
        lines.append(f"<!-- {m} speculative summary: {json.dumps(summary)} -->")
text = "\n".join(lines)
print(text)
open(os.path.join(out, "beta-mon-table.md"), "w").write(text + "\n")
PY
