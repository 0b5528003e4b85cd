"""Which headers cross the gateway, in both directions: one explicit policy (README, "Headers
across the boundary").

Going up (client -> upstream), dropped:
- hop-by-hop headers (RFC 9110 §7.6.1) and any named in `Connection`; framing we redo;
- the client's credentials (the backend's own key is injected instead, unless
  `forward_client_auth`) and cookies;
- the gateway's own control headers (x-slogate-*, x-slo-*);
- `OpenAI-Organization` / `OpenAI-Project`: next to the gateway's upstream key they would bill
  another organisation or project of that key's owner; `Forwarded`, `X-Forwarded-*`,
  `X-Real-IP`: a client must not speak for the gateway about where a request came from.
  A backend may forward these explicitly (`forward_headers`).
Provider feature headers (`anthropic-version`, `anthropic-beta`, `openai-beta`) and every other
header are forwarded, unless the backend denies them (`deny_headers`).

Coming down (upstream -> client), dropped: hop-by-hop, framing and encoding we redo, `Server`,
`Date`, and what identifies or binds the upstream account: `Set-Cookie`, `Set-Cookie2`,
`openai-organization`, `openai-project`. A whole (non-stream) answer is served from the
gateway's origin, which is the console's too: it is never a document a browser would run there.
It gets `X-Content-Type-Options: nosniff` and a sandboxing CSP, and a type other than JSON or
plain text (an upstream's HTML error page, say) is relabelled `text/plain`.
"""
from __future__ import annotations

import functools
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
# Dropped going up unless the backend lists them in forward_headers.
ACCOUNT_HEADERS = frozenset({"openai-organization", "openai-project"})
_FORWARDING = frozenset({"forwarded", "x-real-ip"})
_FORWARDING_PREFIX = "x-forwarded-"
# What engines (and the simulator) obey as instructions rather than metadata: dropped unless
# the backend lists them in forward_headers.
ENGINE_CONTROL = frozenset({
    "x-data-parallel-rank",  # vLLM, SGLang: run on this data-parallel rank
    "x-prefiller-host-port",  # llm-d's P/D sidecar: prefill on this host
    "x-worker-instance-id",  # NVIDIA Dynamo: run on this worker
})
ENGINE_CONTROL_PREFIXES = (
    "x-sim-",  # the simulator: faults (status, stall, cut, error), provider flavour, lengths
    "x-gateway-",  # Gateway API Inference Extension: destination endpoint, objective, fairness id
    "x-llm-d-",  # llm-d: inference objective (priority)
    "x-dynamo-",  # NVIDIA Dynamo: routing mode
)

# Never forwarded to the client: framing and encoding we redo, headers aiohttp sets itself, and
# the upstream account's cookies and identity.
_NOT_DOWNSTREAM = HOP_BY_HOP | {"content-length", "content-encoding", "server", "date",
                                "set-cookie", "set-cookie2", "openai-organization",
                                "openai-project"}


def _connection_listed(headers: CIMultiDictProxy[str]) -> set[str]:
    """Headers named in `Connection` are hop-by-hop too."""
    listed: set[str] = set()
    for value in headers.getall("connection", ()):
        listed.update(t.strip().lower() for t in value.split(",") if t.strip())
    return listed


def _policy_dropped(low: str) -> bool:
    return (low in ACCOUNT_HEADERS or low in _FORWARDING or low.startswith(_FORWARDING_PREFIX)
            or low in ENGINE_CONTROL or low.startswith(ENGINE_CONTROL_PREFIXES))


def listed(low: str, names: tuple[str, ...]) -> bool:
    """Is the (lower-case) header in a forward/deny list? A name ending in `*` is a prefix."""
    return any(low.startswith(n[:-1]) if n.endswith("*") else low == n for n in names)


def upstream_request_headers(client: CIMultiDictProxy[str], *, forward_auth: bool,
                             forward: Iterable[str] = (), deny: Iterable[str] = ()
                             ) -> CIMultiDict[str]:
    """`forward`: headers this policy drops that the backend wants anyway (lower-case, a
    trailing `*` for a prefix); `deny`: headers it forwards that the backend must not get."""
    keeps = _upstream_policy(forward_auth, tuple(forward), tuple(deny))
    drop = _connection_listed(client) if "connection" in client else None
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in client.items():
        keep = keeps.get(name)
        if keep is None:
            keep = _keeps_upstream(name.lower(), forward_auth, tuple(forward), tuple(deny))
            if len(keeps) < _MAX_REMEMBERED:  # header names are the client's: bounded
                keeps[name] = keep
        if keep and not (drop and name.lower() in drop):
            out.add(name, value)
    out["Accept-Encoding"] = "identity"  # a compressing upstream would hold tokens back
    return out


# Per backend policy, each header name's fate (as the client spelled it), decided once.
_MAX_REMEMBERED = 256


@functools.cache
def _upstream_policy(forward_auth: bool, forward: tuple[str, ...],
                     deny: tuple[str, ...]) -> dict[str, bool]:
    return {}


def _keeps_upstream(low: str, forward_auth: bool, forward: tuple[str, ...],
                    deny: tuple[str, ...]) -> bool:
    if low.startswith(_CONTROL_PREFIXES) or listed(low, deny):
        return False
    if low in _NOT_UPSTREAM and not (forward_auth and low in ("authorization", "x-api-key")):
        return False
    return not _policy_dropped(low) or listed(low, forward)


# Whole answers: a browser that opens one renders it as inert text in an opaque origin.
INERT_TYPES = frozenset({"application/json", "text/plain", "application/x-ndjson",
                         "text/event-stream"})
WHOLE_ANSWER_HEADERS = {"X-Content-Type-Options": "nosniff",
                        "Content-Security-Policy": "default-src 'none'; sandbox"}


def inert_type(content_type: str) -> bool:
    base = content_type.partition(";")[0].strip().lower()
    return base in INERT_TYPES or (base.startswith("application/") and base.endswith("+json"))


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
    else:
        if not inert_type(out.get("Content-Type", "")):
            out["Content-Type"] = "text/plain; charset=utf-8"
        out.update(WHOLE_ANSWER_HEADERS)
    for name, value in extra:
        out[name] = value
    return out
