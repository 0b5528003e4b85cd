"""Which headers cross the gateway (RFC 9110 §7.6.1 hop-by-hop rules, both directions)."""
from __future__ import annotations

from collections.abc import Iterable

from multidict import CIMultiDict, CIMultiDictProxy

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "transfer-encoding", "upgrade",
    "proxy-authenticate", "proxy-authorization", "trailer", "trailers",
})

# Never forwarded upstream: framing we redo, the client's credentials (the backend's own key is
# injected instead), and the gateway's own control headers.
_NOT_UPSTREAM = HOP_BY_HOP | {
    "host", "content-length", "accept-encoding", "authorization", "x-api-key", "cookie",
}
_CONTROL_PREFIXES = ("x-slogate-", "x-slo-")

# Never forwarded to the client: framing and encoding we redo, and headers aiohttp sets itself.
_NOT_DOWNSTREAM = HOP_BY_HOP | {"content-length", "content-encoding", "server", "date"}


def _connection_listed(headers: CIMultiDictProxy[str]) -> set[str]:
    """Headers named in `Connection` are hop-by-hop too."""
    listed: set[str] = set()
    for value in headers.getall("connection", ()):
        listed.update(t.strip().lower() for t in value.split(",") if t.strip())
    return listed


def upstream_request_headers(client: CIMultiDictProxy[str], *,
                             forward_auth: bool) -> CIMultiDict[str]:
    drop = _connection_listed(client)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in client.items():
        low = name.lower()
        if low in drop or low.startswith(_CONTROL_PREFIXES):
            continue
        if low in _NOT_UPSTREAM and not (forward_auth and low in ("authorization", "x-api-key")):
            continue
        out.add(name, value)
    out["Accept-Encoding"] = "identity"  # a compressing upstream would hold tokens back
    return out


def client_response_headers(upstream: CIMultiDictProxy[str], *, event_stream: bool,
                            extra: Iterable[tuple[str, str]] = ()) -> CIMultiDict[str]:
    drop = _connection_listed(upstream)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream.items():
        low = name.lower()
        if low in _NOT_DOWNSTREAM or low in drop:
            continue
        out.add(name, value)
    if event_stream:
        # no-transform: intermediaries must not re-encode (compress) the stream (RFC 9111).
        out["Cache-Control"] = "no-cache, no-transform"
        out["X-Accel-Buffering"] = "no"
    for name, value in extra:
        out[name] = value
    return out
