#!/usr/bin/env bash
# Build and test the C ABI and every language binding of libtinyloop:
#
#   header     include/tinyloop.h equals the header this build generated
#   c-so       examples/c/example.c linked against libtinyloop.so, run
#   c-static   the same example linked against libtinyloop.a, run
#   c-abi      tests/c/abi_test.c (the bad-input table of docs/ABI.md, threads, cancellation)
#   c-seed     tests/c/seed_lifecycle.c: only the seed functions, tl_close without tl_model_free
#   valgrind   memcheck on the C example: no errors, no definite or indirect leaks
#   valgrind-seed  the same on seed_lifecycle (what tl_model_open allocates, tl_close releases)
#   valgrind-abi   the same on the C ABI test (~1 min)
#   asan       the C ABI test, seed_lifecycle and the example built with -fsanitize=address
#              (AddressSanitizer + LeakSanitizer; the library itself is not instrumented, but
#              every allocation it makes goes through the sanitizer's malloc)
#   install    scripts/install into a prefix outside the repository (the steps below use it)
#   python     the wheel (pip wheel bindings/python) installed into a fresh venv; its tests run
#              from a folder outside the repository, then the NumPy reference check
#   fresh-venv what a new user does: `pip install bindings/python` into a fresh venv with pip's
#              default build isolation and nothing prepared, then generate from
#              models/demo.tinyloop
#   serve      `tinyloop MODEL serve` on 127.0.0.1 answering the official `openai` client
#              (tests/serve, in a fresh venv with openai and pytest)
#   ray        the Ray Serve deployment (tinyloop_py.serve, docs/DEPLOY.md) on a local Ray
#              cluster on the CPU: `pip install "bindings/python[serve]"` (the pinned ray[serve])
#              with openai and pytest into a fresh venv, then tests/ray (2 cores: ~3-4 min, about
#              2.5 of them the tests; the install is bounded at 10 min, the tests at 8)
#   go         go vet + go test in bindings/go (through pkg-config and the installed prefix)
#   cpp        cmake + build + ctest in bindings/cpp (GoogleTest)
#   consumers  tests/consumers built outside the repository against the installed prefix: C with
#              pkg-config (shared, and --static: libtinyloop.a), C/C++ with find_package(tinyloop),
#              Go from a copy of the module, and C++ with add_subdirectory(bindings/cpp); each
#              generates text from models/demo.tinyloop
#
# Usage: scripts/test-bindings.sh [STEP...]     (default: all steps)
#
# Uses target/release/{libtinyloop.so,libtinyloop.a,tinyloop}; runs `cargo build --release`
# first when cargo is available (a no-op when up to date), else expects them to exist
# (TINYLOOP_TARGET_DIR overrides target/release for the C steps; CARGO_TARGET_DIR moves target/).
# Missing system tools are installed with apt-get only when running as root with CI=true; the
# python steps pip-install numpy and pytest into their venvs, and the NVRTC wheels
# (scripts/nvrtc-wheels) are fetched when the install and the wheels ship precompiled kernels
# (scripts/ship-kernels says when). Exits non-zero when any step fails; every step runs
# regardless, and a summary ends the output.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
REL="${TINYLOOP_TARGET_DIR:-${CARGO_TARGET_DIR:-$ROOT/target}/release}"
WORK="$ROOT/target/bindings-test"
mkdir -p "$WORK"
CC="${CC:-cc}"
# Installs, venvs and consumer projects live outside the repository, as a user's would.
OUTSIDE="$(mktemp -d "${TMPDIR:-/tmp}/tinyloop-bindings.XXXXXX")"
trap 'rm -rf "$OUTSIDE"' EXIT
PREFIX="$OUTSIDE/prefix"
# Go caches cgo link flags from pkg-config without noticing a new prefix: a cache shared with an
# earlier run links against that run's deleted prefix. Each run gets its own.
export GOCACHE="$OUTSIDE/go-cache"
# Kernels compiled for the install are reused by the wheel build.
export TINYLOOP_KERNEL_CACHE="${TINYLOOP_KERNEL_CACHE:-$WORK/kernel-cache}"

ALL_STEPS=(header c-so c-static c-abi c-seed valgrind valgrind-seed valgrind-abi asan install python fresh-venv
    serve ray go cpp consumers)
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=("${ALL_STEPS[@]}")
declare -A RESULT=()

log() { printf '\n=== %s\n' "$*"; }
wants() { local s; for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

# ---- system dependencies -----------------------------------------------------------------
missing_pkgs=()
need() { # need COMMAND DEBIAN_PACKAGE...
    command -v "$1" >/dev/null 2>&1 || missing_pkgs+=("${@:2}")
}
need "$CC" gcc libc6-dev
need make make
if wants cpp; then
    need g++ g++
    need cmake cmake
    if [ ! -e /usr/include/gtest/gtest.h ] && [ ! -e /usr/src/googletest/CMakeLists.txt ]; then
        missing_pkgs+=(googletest libgtest-dev)
    fi
fi
{ wants valgrind || wants valgrind-seed || wants valgrind-abi; } && need valgrind valgrind
{ wants go || wants consumers; } && need go golang-go
{ wants install || wants go || wants consumers; } && need pkg-config pkg-config
wants consumers && need cmake cmake && need g++ g++
if wants python || wants fresh-venv || wants ray; then
    need python3 python3
    python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing_pkgs+=(python3-venv python3-pip)
fi
if [ ${#missing_pkgs[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && [ "${CI:-}" = true ] && command -v apt-get >/dev/null; then
        log "apt-get install ${missing_pkgs[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq "${missing_pkgs[@]}" >/dev/null \
            || echo "apt-get install failed; the steps that need these packages will fail"
    else
        echo "missing packages: ${missing_pkgs[*]} (install them, or run as root with CI=true)"
    fi
fi

# ---- the library -------------------------------------------------------------------------
if command -v cargo >/dev/null 2>&1 && [ -z "${TINYLOOP_TARGET_DIR:-}" ]; then
    log "cargo build --release"
    cargo build --release || { echo "cargo build failed"; exit 1; }
fi
for f in libtinyloop.so libtinyloop.a tinyloop; do
    [ -e "$REL/$f" ] || { echo "missing $REL/$f: run cargo build --release"; exit 1; }
done
export TINYLOOP_TEST_MODEL="$WORK/tiny.tinyloop"
"$REL/tinyloop" synth --preset tiny --seed 1 --out "$TINYLOOP_TEST_MODEL" >/dev/null \
    || { echo "tinyloop synth failed"; exit 1; }
# A model that carries the tokenizer fixture (tests/data/tokenizer), for the text calls.
export TINYLOOP_TEST_TEXT_MODEL="$WORK/tiny-text.tinyloop"
"$REL/tinyloop" synth --preset tiny --seed 1 --tokenizer "$ROOT/tests/data/tokenizer" \
    --out "$TINYLOOP_TEST_TEXT_MODEL" >/dev/null || { echo "tinyloop synth --tokenizer failed"; exit 1; }
export TINYLOOP_BIN="$REL/tinyloop"
CFLAGS=(-std=c11 -D_DEFAULT_SOURCE -O1 -g -Wall -Wextra -Werror -I"$ROOT/include")
SO_LINK=(-L"$REL" -ltinyloop -Wl,-rpath,"$REL")
STATIC_LIBS=(-lpthread -ldl -lm -lrt)

# ---- steps -------------------------------------------------------------------------------
step_header() {
    # The newest generated header of the release build.
    local generated
    generated="$(ls -t "$REL"/build/tinyloop-*/out/tinyloop.h 2>/dev/null | head -1)"
    if [ -z "$generated" ]; then
        echo "no generated header under $REL/build (bundle without a build tree?): skipped"
        return 0
    fi
    if cmp -s "$generated" include/tinyloop.h; then
        echo "include/tinyloop.h is fresh"
    else
        diff -u include/tinyloop.h "$generated" | head -40
        echo "include/tinyloop.h is stale: TINYLOOP_BLESS=1 cargo test --test header"
        return 1
    fi
}

step_c_so() {
    "$CC" "${CFLAGS[@]}" examples/c/example.c "${SO_LINK[@]}" -o "$WORK/example_so" &&
        "$WORK/example_so" "$TINYLOOP_TEST_MODEL"
}

step_c_static() {
    "$CC" "${CFLAGS[@]}" examples/c/example.c "$REL/libtinyloop.a" "${STATIC_LIBS[@]}" \
        -o "$WORK/example_static" || return 1
    if grep -q libtinyloop <<<"$(ldd "$WORK/example_static")"; then
        echo "example_static links libtinyloop dynamically"
        return 1
    fi
    "$WORK/example_static" "$TINYLOOP_TEST_MODEL"
}

step_c_abi() {
    "$CC" "${CFLAGS[@]}" -pthread tests/c/abi_test.c "${SO_LINK[@]}" -lm -o "$WORK/abi_test" &&
        "$WORK/abi_test" "$TINYLOOP_TEST_MODEL" | grep -v '^ok '
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || return "$rc"
    # The same test against the static library.
    "$CC" "${CFLAGS[@]}" -pthread tests/c/abi_test.c "$REL/libtinyloop.a" "${STATIC_LIBS[@]}" \
        -o "$WORK/abi_test_static" && "$WORK/abi_test_static" "$TINYLOOP_TEST_MODEL" | tail -1
    return "${PIPESTATUS[0]}"
}

step_c_seed() {
    "$CC" "${CFLAGS[@]}" tests/c/seed_lifecycle.c "${SO_LINK[@]}" -o "$WORK/seed_lifecycle" &&
        TINYLOOP_DEVICE=cpu "$WORK/seed_lifecycle" "$TINYLOOP_TEST_MODEL" 2>/dev/null
}

# memcheck NAME PROGRAM: run PROGRAM on the test model under valgrind. Errors and "definitely" or
# "indirectly lost" blocks fail; "possibly lost" blocks of the CPU thread pool (its threads live
# until exit) do not. On the CPU: the device is not what is being checked.
memcheck() {
    local name="$1" program="$2"
    TINYLOOP_DEVICE=cpu valgrind --error-exitcode=99 --leak-check=full \
        --errors-for-leak-kinds=definite,indirect --log-file="$WORK/$name.log" \
        "$program" "$TINYLOOP_TEST_MODEL" 2>/dev/null | tail -1
    local rc=${PIPESTATUS[0]}
    grep -E "ERROR SUMMARY|definitely lost|indirectly lost|possibly lost" "$WORK/$name.log"
    [ "$rc" -eq 0 ] || { echo "valgrind failed (exit $rc), see $WORK/$name.log"; return 1; }
}

step_valgrind() {
    [ -x "$WORK/example_so" ] || step_c_so >/dev/null || return 1
    memcheck valgrind "$WORK/example_so"
}

step_valgrind_seed() {
    [ -x "$WORK/seed_lifecycle" ] || step_c_seed >/dev/null || return 1
    memcheck valgrind-seed "$WORK/seed_lifecycle"
}

step_valgrind_abi() {
    [ -x "$WORK/abi_test" ] || step_c_abi >/dev/null || return 1
    memcheck valgrind-abi "$WORK/abi_test"
}

step_asan() {
    local asan=(-fsanitize=address -fno-omit-frame-pointer) src name rc=0
    for src in tests/c/abi_test.c tests/c/seed_lifecycle.c examples/c/example.c; do
        name="$(basename "$src" .c)_asan"
        "$CC" "${CFLAGS[@]}" "${asan[@]}" -pthread "$src" "${SO_LINK[@]}" -lm -o "$WORK/$name" ||
            return 1
        # No suppressions: LeakSanitizer reports any block unreachable at exit.
        ASAN_OPTIONS=detect_leaks=1 TINYLOOP_DEVICE=cpu "$WORK/$name" "$TINYLOOP_TEST_MODEL" \
            >"$WORK/$name.log" 2>&1
        local status=$?
        echo "$name: exit $status, $(tail -1 "$WORK/$name.log")"
        if [ "$status" -ne 0 ]; then
            grep -A12 -E "ERROR: (Address|Leak)Sanitizer" "$WORK/$name.log" | head -40
            rc=1
        fi
    done
    return "$rc"
}

step_install() {
    rm -rf "$PREFIX" && scripts/install "$PREFIX"
}

# The prefix of the install step, made now when that step did not run.
installed() {
    [ -f "$PREFIX/lib/pkgconfig/tinyloop.pc" ] || step_install >/dev/null
}

step_python() {
    local wheels="$WORK/wheels" venv="$OUTSIDE/venv" tests="$OUTSIDE/python-tests" wheel listing
    local pipflags=(-q --disable-pip-version-check)
    rm -rf "$wheels"
    python3 -m pip wheel "${pipflags[@]}" --no-deps -w "$wheels" bindings/python || return 1
    wheel="$(ls "$wheels"/tinyloop_py-*.whl)"
    echo "built $(basename "$wheel")"
    case "$wheel" in
        *-py3-none-linux_*.whl) ;;
        *) echo "not a platform wheel: $wheel"; return 1 ;;
    esac
    # The listing is read whole before it is searched: `grep -q` closing a pipe early would fail
    # the lister with SIGPIPE, and pipefail would report that as a missing file.
    listing="$(python3 -m zipfile -l "$wheel")" || { echo "cannot list $wheel"; return 1; }
    grep -q ' *tinyloop_py/libtinyloop.so ' <<<"$listing" \
        || { echo "no libtinyloop.so in the wheel"; return 1; }
    local kernels
    kernels="$(grep -cE 'tinyloop_py/tinyloop/kernels/tinyloop-sm_(80|90a)-' <<<"$listing")"
    if scripts/ship-kernels --wanted; then
        [ "$kernels" = 2 ] || { echo "the wheel lacks the sm_80 and sm_90a kernels"; return 1; }
    else
        [ "$kernels" = 0 ] || { echo "the wheel ships kernels it was not asked for"; return 1; }
    fi
    python3 -m venv "$venv" && "$venv/bin/python" -m pip install "${pipflags[@]}" "$wheel" pytest \
        || return 1
    # The binding's tests from a folder outside the repository, with no TINYLOOP_LIB: the
    # package must load the library it ships.
    cp -r bindings/python/tests "$tests" || return 1
    (
        cd "$tests" && unset TINYLOOP_LIB && export PYTHONDONTWRITEBYTECODE=1 &&
            "$venv/bin/python" -c 'import tinyloop_py; print("loaded", tinyloop_py.library_path())' &&
            "$venv/bin/python" -m pytest -q -p no:cacheprovider .
    ) || return 1
    # tests/python checks the runtime against the NumPy reference (tools/reference.py).
    PYTHONDONTWRITEBYTECODE=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/python
}

step_fresh_venv() {
    # NVRTC, when kernels are shipped, is fetched inside the isolated build into a folder of its
    # own: a folder fetched by an earlier step must not hide a failure to fetch it there.
    local venv="$OUTSIDE/fresh-venv" expected=0
    scripts/ship-kernels --wanted && expected=2
    python3 -m venv "$venv" &&
        TINYLOOP_NVRTC_SITE="$OUTSIDE/fresh-venv-nvrtc" "$venv/bin/python" -m pip install -q \
            --disable-pip-version-check "$ROOT/bindings/python" || return 1
    (
        cd "$OUTSIDE" && unset TINYLOOP_LIB && export PYTHONDONTWRITEBYTECODE=1 &&
            "$venv/bin/python" - "$ROOT/models/demo.tinyloop" "$expected" <<'EOF'
import pathlib
import sys

import tinyloop_py

package = pathlib.Path(tinyloop_py.__file__).parent
assert pathlib.Path(tinyloop_py.library_path()).resolve().parent == package.resolve()
kernels = list((package / "tinyloop" / "kernels").glob("tinyloop-sm_*"))
assert len(kernels) == int(sys.argv[2]), f"expected {sys.argv[2]} kernel files, found {kernels}"
with tinyloop_py.Model(sys.argv[1]) as model:
    tokens = model.generate(list(b"ROMEO:"), max_tokens=24)
assert len(tokens) == 24, tokens
print("generated:", bytes(tokens.tolist()).decode(errors="replace"))
EOF
    )
}

step_serve() {
    local venv="$OUTSIDE/serve-venv"
    python3 -m venv "$venv" && "$venv/bin/python" -m pip install -q openai pytest || return 1
    TINYLOOP_BIN="$REL/tinyloop" TINYLOOP_DEMO_MODEL="$ROOT/models/demo.tinyloop" \
        PYTHONDONTWRITEBYTECODE=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/serve
}

step_ray() {
    # The package with its `serve` extra, as a user installs it; no precompiled kernels (the
    # tests run on the CPU). The tests run from outside the repository, against the package
    # in the venv. Both the install and the tests are bounded in time.
    local venv="$OUTSIDE/ray-venv"
    python3 -m venv "$venv" &&
        TINYLOOP_SHIP_KERNELS=0 timeout 600 "$venv/bin/python" -m pip install -q \
            --disable-pip-version-check "$ROOT/bindings/python[serve]" openai pytest || return 1
    (
        cd "$OUTSIDE" && unset TINYLOOP_LIB && export PYTHONDONTWRITEBYTECODE=1 \
            TINYLOOP_DEMO_MODEL="$ROOT/models/demo.tinyloop" RAY_USAGE_STATS_ENABLED=0 &&
            timeout 480 "$venv/bin/python" -m pytest -q -rP -p no:cacheprovider "$ROOT/tests/ray"
    )
}

step_go() {
    installed || return 1
    (
        export PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig"
        cd bindings/go && go vet ./... && go test -count=1 ./...
    )
}

step_cpp() {
    local build="$WORK/cpp-build"
    cmake -S bindings/cpp -B "$build" -DCMAKE_BUILD_TYPE=Release \
        -DTINYLOOP_LIB_DIR="$REL" -DTINYLOOP_TEST_MODEL="$TINYLOOP_TEST_MODEL" >/dev/null \
        && cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" >/dev/null \
        && ctest --test-dir "$build" --output-on-failure
}

step_consumers() {
    installed || return 1
    local src="$OUTSIDE/consumers" demo="$ROOT/models/demo.tinyloop"
    rm -rf "$src" && cp -r tests/consumers "$src" || return 1
    (
        export PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig"
        set -e
        echo "-- C, pkg-config"
        cd "$src/c"
        "$CC" -std=c11 -Wall -Wextra -Werror generate.c $(pkg-config --cflags --libs tinyloop) \
            -o generate
        ./generate "$demo"
        echo "-- C, pkg-config --static: libtinyloop.a"
        "$CC" -std=c11 -Wall -Wextra -Werror generate.c \
            $(pkg-config --cflags --static --libs tinyloop) -o generate_static
        if grep -q libtinyloop <<<"$(ldd generate_static)"; then
            echo "generate_static links libtinyloop dynamically"
            exit 1
        fi
        ./generate_static "$demo"
        echo "-- C and C++, find_package(tinyloop): shared, static, tinyloop.hpp"
        cmake -S "$src/cmake" -B "$src/cmake/build" -DCMAKE_PREFIX_PATH="$PREFIX" \
            -DCMAKE_BUILD_TYPE=Release >/dev/null
        cmake --build "$src/cmake/build" >/dev/null
        if grep -q libtinyloop <<<"$(ldd "$src/cmake/build/generate_c_static")"; then
            echo "generate_c_static links libtinyloop dynamically"
            exit 1
        fi
        for program in generate_c generate_c_static generate_cpp; do
            "$src/cmake/build/$program" "$demo"
        done
        echo "-- C++, add_subdirectory(bindings/cpp) of this checkout: no GoogleTest"
        cmake -S "$src/subdirectory" -B "$src/subdirectory/build" -DTINYLOOP_SOURCE_DIR="$ROOT" \
            -DCMAKE_BUILD_TYPE=Release >/dev/null
        if grep -qi gtest "$src/subdirectory/build/CMakeCache.txt"; then
            echo "add_subdirectory(bindings/cpp) configured GoogleTest"
            exit 1
        fi
        cmake --build "$src/subdirectory/build" >/dev/null
        "$src/subdirectory/build/generate_cpp" "$demo"
        echo "-- Go, a module outside the repository using a copy of bindings/go"
        cp -r "$ROOT/bindings/go" "$src/tinyloop-go"
        cd "$src/go"
        go mod init example.com/generate 2>/dev/null
        go mod edit -replace github.com/tinyloop/tinyloop/bindings/go="$src/tinyloop-go"
        go mod tidy
        go build -o generate .
        ./generate "$demo"
    )
}

for step in "${STEPS[@]}"; do
    fn="step_${step//-/_}"
    if ! declare -F "$fn" >/dev/null; then
        echo "unknown step $step (known: ${ALL_STEPS[*]})"
        RESULT[$step]=FAIL
        continue
    fi
    log "$step"
    if "$fn"; then RESULT[$step]=ok; else RESULT[$step]=FAIL; fi
done

log "summary"
status=0
for step in "${STEPS[@]}"; do
    printf '  %-14s %s\n' "$step" "${RESULT[$step]}"
    [ "${RESULT[$step]}" = ok ] || status=1
done
exit "$status"
