"""The SSE parser's bound: an event (its data, or an unterminated line) may not grow past
max_event_bytes, however it is chunked; events within the bound parse exactly as before."""
from __future__ import annotations

import pytest

from gateway.apis.sse import DEFAULT_MAX_EVENT_BYTES, SSEParser
from gateway.errors import EventTooLarge

LIMIT = 4096


def feed_all(parser: SSEParser, data: bytes, step: int) -> list[bytes]:
    out = []
    for i in range(0, len(data), step):
        out += [ev.data for ev in parser.feed(data[i:i + step])]
    return out


@pytest.mark.parametrize("step", [1, 7, 100, 4096, 1 << 20])
def test_line_without_newline_raises_once_past_the_limit(step: int) -> None:
    p = SSEParser(LIMIT)
    with pytest.raises(EventTooLarge) as e:
        feed_all(p, b"data: " + b"x" * (LIMIT * 4), step)
    assert e.value.limit == LIMIT
    # it stopped within one read of the limit: the parser never held much more
    assert e.value.size <= LIMIT + step + 6


@pytest.mark.parametrize("step", [1, 13, 512, 1 << 20])
def test_many_data_lines_of_one_event_raise(step: int) -> None:
    line = b"data: " + b"y" * 100 + b"\n"
    with pytest.raises(EventTooLarge):
        feed_all(SSEParser(LIMIT), line * 100, step)


@pytest.mark.parametrize("step", [1, 64, 1 << 20])
def test_events_within_the_bound_are_untouched(step: int) -> None:
    event = b"data: " + b"z" * (LIMIT - 100) + b"\n\n"
    stream = (event + b": ping\n\nevent: e\ndata: a\ndata: b\n\n") * 5
    got = feed_all(SSEParser(LIMIT), stream, step)
    assert got == [b"z" * (LIMIT - 100), b"a\nb"] * 5


def test_one_read_holding_an_oversize_whole_event_raises() -> None:
    with pytest.raises(EventTooLarge):
        SSEParser(LIMIT).feed(b"data: " + b"w" * (LIMIT + 1) + b"\n\n")


def test_the_count_restarts_with_every_event() -> None:
    p = SSEParser(LIMIT)
    event = b"data: " + b"v" * (LIMIT // 2) + b"\n\n"
    assert len(feed_all(p, event * 50, 333)) == 50


def test_default_bound() -> None:
    assert SSEParser().max_event_bytes == DEFAULT_MAX_EVENT_BYTES == 8 * 1024 * 1024
