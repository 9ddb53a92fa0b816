#!/usr/bin/env bash
# CTX-TIER on a GPU host, from a GPU bundle (scripts/gpu-bundle): docs/PERF.md "CTX-TIER".
#   bench/ctx-tier-bench.sh BUNDLE OUT
# With the CLI's bench (medians of 5 runs of 200 generated tokens after a 128-token prompt,
# greedy) on tl-407m INT4 (seed 1) at loops 8:
#   * decode ms/token with the INT4 loop body, and forced LONG (short_t 1, long_t 2: the
#     prefill already reaches long_t, so every step runs the INT2 re-pack);
#   * the weights' device memory at load and after the switch;
#   * the time the re-pack took at the transition (the `[ctx_tier] apply:` line, in the log).
set -uo pipefail
bundle="$(cd "$1" && pwd)"
out="$2"
work="${BENCH_WORK:-/tmp/tinyloop-bench}"
mkdir -p "$work" "$out"
tl="$bundle/bin/tinyloop"
export TINYLOOP_KERNEL_CACHE="$work/kernel-cache"
unset TINYLOOP_CTX_TIER TINYLOOP_CTX_TIER_SHORT_T TINYLOOP_CTX_TIER_LONG_T \
    TINYLOOP_CTX_TIER_LONG_BITS TINYLOOP_CTX_TIER_VERBOSE TINYLOOP_CTX_TIER_FILE
big="$work/tl-407m-b4.tinyloop"
[ -f "$big" ] || "$tl" synth --preset tl-407m --seed 1 --bits 4 --out "$big" 2>>"$out/ctx-tier-bench.log"
bench() { # NAME ARGS...
    local name="$1"; shift
    timeout "${STEP_TIMEOUT:-300}" "$tl" "$big" bench --device cuda --json --repeats 5 \
        --loops 8 --prompt-len 128 --gen-len 200 "$@" 2>"$out/$name.stderr" \
        | tail -n 1 >"$out/$name.json"
    { echo "$name $(cat "$out/$name.json")"; cat "$out/$name.stderr"; } >>"$out/ctx-tier-bench.log"
}
bench int4
bench long --ctx-tier --ctx-tier-short-t 1 --ctx-tier-long-t 2
python3 - "$out" <<'PY'
import json, os, re, sys
out = sys.argv[1]
def load(name):
    try:
        return json.loads(open(os.path.join(out, name + ".json")).read())
    except Exception:
        return {}
nan = float("nan")
int4, long = load("int4"), load("long")
stderr = open(os.path.join(out, "long.stderr")).read() if os.path.exists(os.path.join(out, "long.stderr")) else ""
apply = re.search(r"\[ctx_tier\] apply: loop body, (\d+) weights re-packed \(INT4 → INT2, ([-\d.]+) MB freed\) in ([\d.]+) ms", stderr)
lines = [
    "| tl-407m INT4, L = 8 | decode ms/token | tok/s | weights MB |",
    "| --- | --- | --- | --- |",
    f"| INT4 loop body | {int4.get('decode_ms_per_token', nan):.4f} | {int4.get('decode_tokens_per_s', nan):.0f} | {int4.get('weight_mb', nan):.1f} |",
    f"| CTX-TIER forced LONG (short_t 1, long_t 2) | {long.get('decode_ms_per_token', nan):.4f} | {long.get('decode_tokens_per_s', nan):.0f} | {long.get('weight_mb', nan):.1f} (at load {long.get('weight_mb_at_load', nan):.1f}) |",
]
if apply:
    lines.append(f"re-pack at the transition: {apply.group(1)} weights, {apply.group(2)} MB freed, {apply.group(3)} ms")
else:
    lines.append("re-pack at the transition: no `[ctx_tier] apply:` line in long.stderr")
text = "\n".join(lines)
print(text)
open(os.path.join(out, "ctx-tier-table.md"), "w").write(text + "\n")
PY
