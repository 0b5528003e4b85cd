#!/usr/bin/env bash
# Install kustomize for tests/system/test_deploy.py, which renders deploy/ with it.
#
# No kustomize, kubectl or helm binary is packaged in Debian, and nothing but PyPI, npm and
# Debian can be reached. PyPI's `pykustomize` ships kustomize's own Go code (sigs.k8s.io/
# kustomize/api, the code behind `kubectl kustomize`) compiled into a C shared library,
# libpykustomize.so (kustomize/api v0.21.3, as its Go build info says), with a small C API
# (build a kustomization to YAML). Its wheel is
# pure-Python otherwise and declares Requires-Python >= 3.14 (for its cffi wrapper), so we do not
# pip-install it into the venv: we download the pinned wheel (hash-checked), take out the shared
# library and its licence, and tests/support/kustomize.py calls it through ctypes.
#
# Usage: scripts/install-kustomize.sh [PATH_TO_VENV_PYTHON]   (default .venv/bin/python)
# Installs into ${SLOGATE_KUSTOMIZE_DIR:-${XDG_CACHE_HOME:-~/.cache}/slogate/kustomize/<version>};
# a re-run with the library there exits at once, without network.
set -euo pipefail

VERSION=0.1.4
SHA256=f8da6be12fb35b56158d2f9043a67d39c1ce84eae9c8f344c7ed934709192467

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${1:-$REPO_ROOT/.venv/bin/python}
DEST=${SLOGATE_KUSTOMIZE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/slogate/kustomize/$VERSION}
if [[ -f $DEST/libpykustomize.so ]]; then
    exit 0
fi
case "$(uname -m)" in
    x86_64) ARCH=amd64 ;;
    aarch64) ARCH=arm64 ;;
    *) echo "install-kustomize: no libpykustomize for $(uname -m)" >&2; exit 2 ;;
esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.14 \
    "pykustomize==$VERSION" -d "$tmp"
whl=$tmp/pykustomize-$VERSION-py3-none-any.whl
echo "$SHA256  $whl" | sha256sum -c --quiet -
mkdir -p "$DEST"
"$PY" - "$whl" "$DEST" "$ARCH" <<'PYEOF'
import sys, zipfile
whl, dest, arch = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    for src, name in ((f"pykustomize/_lib/linux-{arch}/libpykustomize.so", "libpykustomize.so"),
                      ("pykustomize-0.1.4.dist-info/licenses/LICENSE", "LICENSE")):
        with z.open(src) as f, open(f"{dest}/{name}.part", "wb") as out:
            out.write(f.read())
PYEOF
mv "$DEST/LICENSE.part" "$DEST/LICENSE"
mv "$DEST/libpykustomize.so.part" "$DEST/libpykustomize.so"
echo "install-kustomize: kustomize (pykustomize $VERSION) in $DEST" >&2
