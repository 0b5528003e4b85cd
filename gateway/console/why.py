"""Why a request was refused or slow, in one line a person can read, from its decision record
(gateway/telemetry/decisions.py): for a refusal, the reason and what admission predicted on
each replica against the target; for a request that missed its SLO, where it waited (admission
queue against the predicted wait), on which replica, and the largest stage of its TTFT."""
from __future__ import annotations

from typing import Any


def _ms(v: float) -> str:
    return f"{v:.0f} ms" if v < 10_000 else f"{v / 1e3:.1f} s"


def _refusal(rec: dict[str, Any], adm: dict[str, Any]) -> list[str]:
    parts = [f"refused: {adm.get('reason')}"]
    cands = adm.get("candidates") or []
    target = rec.get("target_ttft_ms")
    against = f" against a {_ms(target)} target" if target else ""
    predicted = [c for c in cands if c.get("predicted_ttft_ms") is not None]
    if predicted:
        best = min(predicted, key=lambda c: c["predicted_ttft_ms"])
        parts.append(f"best predicted TTFT {_ms(best['predicted_ttft_ms'])} on {best['replica']}"
                     + against)
    if adm.get("predicted_ttft_ms") is not None:
        parts.append(f"its best case a TTFT of {_ms(adm['predicted_ttft_ms'])} from arrival "
                     "(its turn at a slot and the stated error included)" + against)
    for c in cands:
        if c.get("why") == "concurrency_cap":
            parts.append(f"{c['replica']} at its limit ({c['in_flight']}/{c['limit']})")
        elif c.get("why") == "unavailable":
            parts.append(f"{c['replica']} unavailable")
        elif c.get("why") == "tpot_wait":
            parts.append(f"{c['replica']} would slow its decoding streams past their TPOT")
    if adm.get("queue_wait_ms"):
        parts.append(f"after {_ms(adm['queue_wait_ms'])} in the admission queue")
    return parts


def _slow(rec: dict[str, Any], adm: dict[str, Any]) -> list[str]:
    parts = [str(rec.get("verdict"))]
    wait, predicted = adm.get("queue_wait_ms"), adm.get("predicted_wait_ms")
    if wait:
        parts.append(f"waited {_ms(wait)} in the admission queue"
                     + (f" (predicted {_ms(predicted)})" if predicted is not None else ""))
    chosen = adm.get("chosen")
    if chosen:
        pred = next((c.get("predicted_ttft_ms") for c in adm.get("candidates") or ()
                     if c.get("replica") == chosen), None)
        parts.append(f"on {chosen}"
                     + (f" (predicted TTFT {_ms(pred)})" if pred is not None else ""))
    ttft, target = rec.get("ttft_ms"), rec.get("target_ttft_ms")
    if ttft is not None:
        parts.append(f"TTFT {_ms(ttft)}" + (f" of a {_ms(target)} target" if target else ""))
    stage = rec.get("ttft_largest_stage")
    if stage:
        ms = (rec.get("ttft_stages_ms") or {}).get(stage)
        parts.append(f"largest stage {stage}" + (f" ({_ms(ms)})" if ms is not None else ""))
    attempts = rec.get("attempts") or ()
    paused = sum(a.get("result") == "preempted" for a in attempts)
    if paused:
        parts.append("its stream paused " + ("once" if paused == 1 else f"{paused} times")
                     + " to give its slot to a less served class (preempted), then continued")
    if len(attempts) > 1:
        parts.append(f"{len(attempts)} attempts")
    return parts


def explain(rec: dict[str, Any]) -> dict[str, Any]:
    """The console's row for one refused or slow request: the facts and a `why` sentence."""
    adm = rec.get("admission") or {}
    refused = adm.get("decision") == "rejected"
    stage = rec.get("ttft_largest_stage")
    return {
        "request_id": rec.get("request_id"), "t": rec.get("t"),
        "slo_class": rec.get("slo_class"), "tenant": rec.get("tenant"),
        "status": rec.get("status"), "outcome": rec.get("outcome"),
        "verdict": rec.get("verdict"), "decision": adm.get("decision"),
        "reason": adm.get("reason"), "replica": adm.get("chosen"),
        "queue_wait_ms": adm.get("queue_wait_ms"),
        "predicted_wait_ms": adm.get("predicted_wait_ms"),
        "ttft_ms": rec.get("ttft_ms"), "largest_stage": stage,
        "largest_stage_ms": (rec.get("ttft_stages_ms") or {}).get(stage) if stage else None,
        "candidates": adm.get("candidates") or [],
        "why": "; ".join(_refusal(rec, adm) if refused else _slow(rec, adm)),
    }
