#!/usr/bin/env bash
# Prefill against the PyTorch peer (docs/PERF.md "Prefill against an honest peer"), on a GPU host:
#   bench/prefill-bench.sh BUNDLE OUT
# Synthesizes tl-407m INT4 and INT2 (seed 1, as bench/gpu-bench.sh), then measures with the CLI
# the time to the first token (prefill + head on the last row) at 512 and 2048 prompt tokens and
# L = 1, 4, 8, with and without the FP16 body cache (--fp16-body), the score call (logits for
# every position) at 2048 tokens and L = 8, decode ms/token at L = 8 (prompt 128), and
# bench/torch_peer.py on the INT4 weights (eager and torch.compile prefill, FP16 and int4
# weight-only decode). Logs and JSON go to OUT; a side-by-side table is printed last and written
# to OUT/prefill-summary.txt.
#   PROMPTS="512 2048" LOOPS="1 4 8" BITS="4 2" REPEATS=5 COMPILE_MODE=default TORCH=1
# Expected time on an H200: about 3 minutes for TinyLoop (24 prefill and 4 decode runs, two
# synths) and 3 to 5 for the peer (torch.compile of the block and of two decode steps); each
# step is cut off after STEP_TIMEOUT seconds (300), the peer after PEER_TIMEOUT (420).
set -uo pipefail
bundle="$(cd "$1" && pwd)"
out="$2"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="${BENCH_WORK:-/tmp/tinyloop-bench}"
mkdir -p "$work"
tl="$bundle/bin/tinyloop"
export TINYLOOP_KERNEL_CACHE="$work/kernel-cache"
prompts=(${PROMPTS:-512 2048})
loops=(${LOOPS:-1 4 8})
bits_list=(${BITS:-4 2})
repeats="${REPEATS:-5}"
log="$out/prefill-bench.log"
step() { printf '\n=== %s\n' "$*" | tee -a "$log"; }
# The last line of a command's stdout (its JSON), stderr to the log; failures are logged, not fatal.
json() {
    local dest="$1" limit="$2"
    shift 2
    if ! timeout "$limit" "$@" 2>>"$log" | tail -n 1 >"$dest"; then
        echo "FAILED: $*" | tee -a "$log"
    fi
    cat "$dest" >>"$log"
}

for bits in "${bits_list[@]}"; do
    model="$work/tl-407m-b$bits.tinyloop"
    if [ ! -f "$model" ]; then
        step "synth tl-407m bits=$bits"
        timeout 300 "$tl" synth --preset tl-407m --seed 1 --bits "$bits" --out "$model" 2>&1 | tee -a "$log"
    fi
    for body in "" "--fp16-body"; do
        tag="b$bits${body:+-fp16body}"
        for n in "${prompts[@]}"; do
            for l in "${loops[@]}"; do
                step "prefill $tag n=$n L=$l"
                extra=()
                [ "$n" = 2048 ] && [ "$l" = 8 ] && extra=(--score)
                json "$out/prefill-$tag-n$n-L$l.json" "${STEP_TIMEOUT:-300}" "$tl" "$model" bench --device cuda --json -q \
                    --loops "$l" --prompt-len "$n" --gen-len 2 --repeats "$repeats" \
                    --max-seq-len $((n + 64)) $body "${extra[@]}"
            done
        done
        step "decode $tag prompt 128 L=8"
        json "$out/decode-$tag.json" "${STEP_TIMEOUT:-300}" "$tl" "$model" bench --device cuda --json -q --loops 8 \
            --prompt-len 128 --gen-len 128 --repeats 3 $body
    done
done

if [ "${TORCH:-1}" = 1 ]; then
    step "PyTorch peer (tl-407m INT4)"
    csv() { local IFS=,; echo "$*"; }
    json "$out/torch-peer.json" "${PEER_TIMEOUT:-420}" python3 "$bundle/bench/torch_peer.py" "$work/tl-407m-b${bits_list[0]}.tinyloop" \
        --json --prompts "$(csv "${prompts[@]}")" --loops "$(csv "${loops[@]}")" \
        --compile-mode "${COMPILE_MODE:-default}" --decode-loops 8 --decode-prompt 128
fi

python3 - "$out" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
def load(path):
    try:
        return json.loads(open(path).read().strip().splitlines()[-1])
    except Exception:
        return None
nan = float("nan")
peer = load(os.path.join(out, "torch-peer.json")) or {}
def peer_row(impl_prefix, n, l):
    for r in peer.get("prefill", []):
        if r["impl"].startswith(impl_prefix) and r["prompt"] == n and r["loops"] == l:
            return r
    return {}
rows = ["prefill: ms to the first token (TFLOP/s); peer = PyTorch on the same weights in FP16, "
        f"torch {peer.get('torch', '?')}, compile mode {peer.get('compile_mode', '?')}",
        f"{'bits':>4} {'fp16 body':>9} {'n':>5} {'L':>2} | {'TinyLoop':>18} | {'torch eager':>18} | {'torch.compile':>18}"]
def cell(ms, tf):
    return f"{ms:8.2f} ({tf:6.1f})" if ms == ms else f"{'-':>8} {'':8}"
for path in sorted(glob.glob(os.path.join(out, "prefill-b*-n*-L*.json")),
                   key=lambda p: (p.split("prefill-")[1].split("-n")[0], int(p.split("-n")[1].split("-")[0]), int(p.split("-L")[1].split(".")[0]))):
    d = load(path)
    tag = os.path.basename(path)[len("prefill-"):].split("-n")[0]
    bits = tag[1]
    body = "on" if "fp16body" in tag else "off"
    n = int(path.split("-n")[1].split("-")[0])
    l = int(path.split("-L")[1].split(".")[0])
    ours = cell(d["prefill_ms"], d["prefill_tflops_per_s"]) if d else cell(nan, nan)
    e, c = peer_row("eager", n, l), peer_row("compiled", n, l)
    rows.append(f"{bits:>4} {body:>9} {n:>5} {l:>2} | {ours} | {cell(e.get('ms', nan), e.get('tflops_per_s', nan))} | "
                f"{cell(c.get('ms', nan), c.get('tflops_per_s', nan))}")
    if d and d.get("score_ms"):
        rows.append(f"{'':>4} {'':>9} {'':>5} {'':>2}   score call (all {n} rows of logits): {d['score_ms']:.2f} ms "
                    f"({d['score_tflops_per_s']:.1f} TFLOP/s), memory {d['memory_mb']:.0f} MB")
rows.append("decode ms/token, prompt 128, L = 8:")
for path in sorted(glob.glob(os.path.join(out, "decode-b*.json"))):
    d = load(path)
    tag = os.path.basename(path)[len("decode-"):-len(".json")]
    rows.append(f"  TinyLoop {tag:14} {d['decode_ms_per_token']:.4f}  (memory {d['memory_mb']:.0f} MB)" if d else f"  TinyLoop {tag:14} failed")
for r in peer.get("decode", []):
    rows.append(f"  torch {r['impl']:44} {r['ms_per_token']:.4f}")
if peer.get("int4_skipped"):
    rows.append(f"  torch int4 weight-only skipped: {peer['int4_skipped']}")
text = "\n".join(rows)
print(text)
open(os.path.join(out, "prefill-summary.txt"), "w").write(text + "\n")
EOF
