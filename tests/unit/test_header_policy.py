"""The upstream header policy: headers an engine obeys as instructions (the simulator's faults,
a data-parallel rank, a prefill host, a routing destination) reach a backend only when it lists
them in forward_headers, by name or by prefix."""
from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.edge.headers import upstream_request_headers

CLIENT = CIMultiDictProxy(CIMultiDict({
    "X-Sim-Status": "500", "x-sim-stall-ms": "3000", "X-Data-Parallel-Rank": "1",
    "x-prefiller-host-port": "10.0.0.9:8000", "x-gateway-destination-endpoint": "10.0.0.9:80",
    "x-gateway-inference-objective": "critical", "x-llm-d-inference-objective": "critical",
    "x-worker-instance-id": "7", "x-dynamo-routing-mode": "aggregated",
    "x-request-id": "r1", "anthropic-beta": "tools", "x-simple": "kept",
}))
CONTROL = {"x-sim-status", "x-sim-stall-ms", "x-data-parallel-rank", "x-prefiller-host-port",
           "x-gateway-destination-endpoint", "x-gateway-inference-objective",
           "x-llm-d-inference-objective", "x-worker-instance-id", "x-dynamo-routing-mode"}


def sent(forward: tuple[str, ...] = (), deny: tuple[str, ...] = ()) -> set[str]:
    return {k.lower() for k in upstream_request_headers(CLIENT, forward_auth=False,
                                                        forward=forward, deny=deny)}


def test_engine_control_headers_are_dropped_by_default() -> None:
    out = sent()
    assert not out & CONTROL
    assert {"x-request-id", "anthropic-beta", "x-simple"} <= out  # metadata still goes up


def test_a_backend_lists_what_it_wants_by_name_or_prefix() -> None:
    out = sent(forward=("x-sim-*", "x-data-parallel-rank"))
    assert {"x-sim-status", "x-sim-stall-ms", "x-data-parallel-rank"} <= out
    assert not out & (CONTROL - {"x-sim-status", "x-sim-stall-ms", "x-data-parallel-rank"})
    assert "x-sim-stall-ms" not in sent(forward=("x-sim-status",))  # a name is not a prefix


def test_deny_takes_prefixes_too() -> None:
    out = sent(forward=("x-sim-*",), deny=("x-sim-stall-*", "x-simple"))
    assert "x-sim-status" in out and "x-sim-stall-ms" not in out and "x-simple" not in out
