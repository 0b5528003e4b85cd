"""The access log's text line: the fields a person reads, bounded and printable whatever the
client named its model."""
from __future__ import annotations

import time

from gateway.exchange import Exchange
from gateway.telemetry.access_log import text_line

MS = 1_000_000


def finished(model: str, backend: str | None, outcome: str, status: int) -> Exchange:
    ex = Exchange("/openai/v1/chat/completions")
    ex.model, ex.backend, ex.status, ex.stream = model, backend, status, True
    ex.t_first_token = ex.t_received + 41 * MS
    ex.t_end = ex.t_received + 655 * MS
    ex.outcome = outcome
    return ex


def test_a_streamed_answer_in_one_short_line() -> None:
    ex = finished("sim-llama-8b", "sim", "ok", 200)
    ex.prompt_tokens, ex.completion_tokens, ex.verdict = 21, 64, "met"
    now = time.mktime((2025, 1, 2, 14, 2, 7, 0, 0, -1))
    assert text_line(ex, now) == ("14:02:07 200 ok /openai/v1/chat/completions sim-llama-8b@sim "
                                  "ttft=41ms e2e=655ms 21+64 tok")
    ex.verdict = "ttft_missed"
    assert text_line(ex, now).endswith(" 21+64 tok slo=ttft_missed")


def test_a_long_model_name_on_the_longest_route_fits_in_140() -> None:
    ex = finished("meta-llama/Llama-3.1-70B-Instruct", "vllm-gpu-07", "timeout", 504)
    ex.error_type = "first_token_timeout"
    ex.prompt_tokens, ex.completion_tokens, ex.verdict = 12800, 2048, "failed"
    ex.t_first_token = ex.t_received + 9_876 * MS
    ex.t_end = ex.t_received + 612_345 * MS
    line = text_line(ex)
    assert line.endswith(" 504 first_token_timeout /openai/v1/chat/completions "
                         "meta-llama/Llama-3.1-70…@vllm-gpu-07 ttft=9876ms e2e=612.3s "
                         "12800+2048 tok")
    assert len(line) <= 140


def test_the_line_stays_short_and_printable_whatever_the_names() -> None:
    ex = finished("m\x1b[2J\n" + "x" * 250, "a-backend-with-a-very-long-name", "upstream_error",
                  502)
    ex.error_type = "upstream_unreachable_with_a_long_code"
    ex.prompt_tokens, ex.completion_tokens, ex.verdict = 123456, 654321, "both_missed"
    ex.t_first_token = ex.t_received + 123_456 * MS
    ex.t_end = ex.t_received + 654_321 * MS
    line = text_line(ex)
    assert len(line) <= 160 and line.isprintable() and "\x1b" not in line
    assert " m?[2J?xxx" in line and "…@a-backend-w…" in line
    assert " upstream_unreachable_… " in line and line.endswith(" slo=both_missed")


def test_what_is_not_known_is_left_out() -> None:
    ex = Exchange("/v1/chat/completions")
    ex.status, ex.outcome, ex.error_type = 400, "rejected", "invalid_json"
    ex.t_end = ex.t_received + MS
    assert text_line(ex).endswith(" 400 invalid_json /v1/chat/completions -@- e2e=1ms")
    ex.error_type = "502"  # an upstream's error answer passed through: its outcome says more
    ex.outcome = "upstream_error"
    assert " 400 upstream_error /v1/" in text_line(ex)
