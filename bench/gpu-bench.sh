#!/usr/bin/env bash
# The CUDA numbers of docs/PERF.md, from a GPU bundle (scripts/gpu-bundle), on a GPU host:
#   bench/gpu-bench.sh BUNDLE OUT [BITS...]     (default BITS: 4)
# Synthesizes tl-407m (seed 1), then measures with the CLI: load with a cold kernel cache
# (NVRTC compile) and warm (disk cache hit, warm page cache), decode ms/token at L = 8 (prompt
# 128), prefill tokens/s at 512 and 2048 prompt tokens, decode with device-side sampling,
# without CUDA graphs and without programmatic dependent launch, and the PyTorch baseline
# (eager FP16, torch.compile reduce-overhead) on the same weights.
set -uo pipefail
bundle="$(cd "$1" && pwd)"
out="$2"
shift 2
bits_list=("${@:-4}")
[ ${#bits_list[@]} -eq 0 ] && bits_list=(4)
work="${BENCH_WORK:-/tmp/tinyloop-bench}"
mkdir -p "$work" "$out"
tl="$bundle/bin/tinyloop"
export TINYLOOP_KERNEL_CACHE="$work/kernel-cache"
step() { printf '\n=== %s\n' "$*" | tee -a "$out/bench.log"; }
run() { timeout "${STEP_TIMEOUT:-240}" "$@" 2>&1 | tee -a "$out/bench.log"; }
json() { timeout "${STEP_TIMEOUT:-240}" "$@" 2>>"$out/bench.log" | tail -n 1; }

for bits in "${bits_list[@]}"; do
    model="$work/tl-407m-b$bits.tinyloop"
    [ -f "$model" ] || { step "synth tl-407m bits=$bits"; run "$tl" synth --preset tl-407m --seed 1 --bits "$bits" --out "$model"; }
    if [ "$bits" = "${bits_list[0]}" ]; then
        rm -rf "$TINYLOOP_KERNEL_CACHE"
        step "cold load (empty kernel cache) bits=$bits"
        run "$tl" "$model" bench --device cuda --prompt-len 128 --gen-len 32 --repeats 1
    fi
    step "warm load bits=$bits"
    run "$tl" "$model" bench --device cuda --prompt-len 128 --gen-len 32 --repeats 1
    step "decode, prompt 128 bits=$bits"
    json "$tl" "$model" bench --device cuda --json --prompt-len 128 --gen-len 128 --repeats 3 >"$out/decode-b$bits.json"
    cat "$out/decode-b$bits.json"
    step "prefill 512 bits=$bits"
    json "$tl" "$model" bench --device cuda --json --prompt-len 512 --gen-len 8 --repeats 3 >"$out/prefill512-b$bits.json"
    cat "$out/prefill512-b$bits.json"
    step "prefill 2048 bits=$bits"
    json "$tl" "$model" bench --device cuda --json --max-seq-len 2304 --prompt-len 2048 --gen-len 8 --repeats 3 >"$out/prefill2048-b$bits.json"
    cat "$out/prefill2048-b$bits.json"
done
model="$work/tl-407m-b${bits_list[0]}.tinyloop"
step "decode without CUDA graphs"
json env TINYLOOP_CUDA_GRAPHS=0 "$tl" "$model" bench --device cuda --json --prompt-len 128 --gen-len 128 --repeats 3 >"$out/decode-nographs.json"
cat "$out/decode-nographs.json"
step "decode, sampled on the device (temperature 0.8, top-k 40, top-p 0.95)"
json "$tl" "$model" bench --device cuda --json --prompt-len 128 --gen-len 128 --repeats 3 --temperature 0.8 --top-k 40 --top-p 0.95 >"$out/decode-sampled.json"
cat "$out/decode-sampled.json"
step "decode without programmatic dependent launch"
json env TINYLOOP_CUDA_PDL=0 "$tl" "$model" bench --device cuda --json --prompt-len 128 --gen-len 128 --repeats 3 >"$out/decode-nopdl.json"
cat "$out/decode-nopdl.json"
step "load with plain (pageable) uploads"
run env TINYLOOP_CUDA_UPLOAD=plain "$tl" "$model" bench --device cuda --prompt-len 16 --gen-len 2 --repeats 1
if [ "${TORCH:-1}" = 1 ]; then
    step "PyTorch baseline"
    json python3 "$bundle/bench/torch_baseline.py" "$model" --loops 8 --json >"$out/torch.json"
    cat "$out/torch.json"
fi
python3 - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return json.loads(open(os.path.join(out, name)).read().strip().splitlines()[-1])
    except Exception:
        return {}
rows = []
for f in sorted(os.listdir(out)):
    if f.endswith(".json") and f != "torch.json":
        d = load(f)
        rows.append(f"{f:24} load {d.get('load_ms', float('nan')):8.1f} ms (again {d.get('reload_ms', float('nan')):6.1f})  prefill({d.get('prompt_len', '?')}) "
                    f"{d.get('prefill_tokens_per_s', float('nan')):9.0f} tok/s  decode {d.get('decode_ms_per_token', float('nan')):.4f} ms/tok")
t = load("torch.json")
if t:
    rows.append(f"torch eager decode {t.get('eager_decode_ms_per_token', float('nan')):.3f} ms/tok, compiled "
                f"{t.get('compile_decode_ms_per_token', float('nan')):.3f} ms/tok, eager prefill(512) "
                f"{t.get('eager_prefill_tokens_per_s', float('nan')):.0f} tok/s")
print("\n".join(rows))
open(os.path.join(out, "summary.txt"), "w").write("\n".join(rows) + "\n")
EOF
