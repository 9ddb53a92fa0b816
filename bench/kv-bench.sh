#!/usr/bin/env bash
# KV cache modes on a GPU host, from a GPU bundle (scripts/gpu-bundle): docs/PERF.md "KV cache".
#   bench/kv-bench.sh BUNDLE OUT [MODE...]     (default: every mode)
# Synthesizes tl-407m INT4 (seed 1; max_position 32768) and measures, per KV mode, with the CLI
# (L = 8, medians of 3 runs): KV bytes allocated for 4096 and 32768 tokens, decode ms/token at a
# 128-token and at a 4096-token context, and prefill tokens/s at 2048 tokens.
set -uo pipefail
bundle="$(cd "$1" && pwd)"
out="$2"
shift 2
modes=("${@:-fp16 fp16-h int8-h int4-h int8 delta age}")
[ $# -eq 0 ] && modes=(fp16 fp16-h int8-h int4-h int8 delta age)
work="${BENCH_WORK:-/tmp/tinyloop-bench}"
mkdir -p "$work" "$out"
tl="$bundle/bin/tinyloop"
export TINYLOOP_KERNEL_CACHE="$work/kernel-cache"
model="$work/tl-407m-b4.tinyloop"
[ -f "$model" ] || "$tl" synth --preset tl-407m --seed 1 --bits 4 --out "$model" 2>>"$out/kv-bench.log"
bench() { # NAME ARGS...: one JSON line into OUT/NAME.json
    local name="$1"; shift
    timeout "${STEP_TIMEOUT:-300}" "$tl" "$model" bench --device cuda --json --loops 8 "$@" \
        2>>"$out/kv-bench.log" | tail -n 1 >"$out/$name.json"
    echo "$name $(cat "$out/$name.json")" >>"$out/kv-bench.log"
}
for mode in "${modes[@]}"; do
    bench "$mode-ctx128" --kv "$mode" --max-seq-len 4096 --prompt-len 128 --gen-len 128 --repeats 3
    bench "$mode-ctx4096" --kv "$mode" --max-seq-len 4160 --prompt-len 4096 --gen-len 32 --repeats 3
    bench "$mode-prefill2048" --kv "$mode" --max-seq-len 2056 --prompt-len 2048 --gen-len 4 --repeats 3
    bench "$mode-kv32k" --kv "$mode" --max-seq-len 32768 --prompt-len 16 --gen-len 4 --repeats 1
done
python3 - "$out" "${modes[@]}" <<'PY'
import json, os, sys
out, modes = sys.argv[1], sys.argv[2:]
def load(name):
    try:
        return json.loads(open(os.path.join(out, name + ".json")).read())
    except Exception:
        return {}
nan = float("nan")
rows = ["| mode | KV MB at 4096 | KV MB at 32768 | decode ms/token, ctx 128 | decode ms/token, ctx 4096 | prefill tok/s at 2048 |",
        "| --- | --- | --- | --- | --- | --- |"]
for m in modes:
    a, b, c, d = load(m + "-ctx128"), load(m + "-ctx4096"), load(m + "-prefill2048"), load(m + "-kv32k")
    rows.append(f"| {m} | {a.get('kv_mb', nan):.1f} | {d.get('kv_mb', nan):.1f} | {a.get('decode_ms_per_token', nan):.3f} "
                f"| {b.get('decode_ms_per_token', nan):.3f} | {c.get('prefill_tokens_per_s', nan):.0f} |")
text = "\n".join(rows)
print(text)
open(os.path.join(out, "kv-table.md"), "w").write(text + "\n")
PY
