"""Tests for gateway/apis/sse.py: the incremental SSE parser used as a tap on relayed bytes.

A plain whole-input reference parser (WHATWG HTML §9.2.6, see
shared/reference/wire-and-telemetry.md §7.1) is checked against SSEParser fed the same bytes in
arbitrary chunkings, including the offsets the relay relies on (`SSEEvent.start/end`,
`hold_from`, `skip_lf`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gateway.apis.sse import SSEParser

BOM = b"\xef\xbb\xbf"


# --------------------------------------------------------------------------------------------
# Reference parser (whole input, straight from the spec)
# --------------------------------------------------------------------------------------------

@dataclass
class Line:
    start: int  # byte offset of the first byte of the line (0 for the first line, BOM included)
    term_start: int  # byte offset of its terminator (len(raw) for the unterminated tail)
    term_end: int  # byte offset just past its terminator
    text: str | None  # decoded content (BOM stripped); None for the unterminated tail
    terminated: bool


@dataclass
class RefEvent:
    event: str
    data: str
    start: int  # absolute byte offset of the event's first field line
    blank: Line  # the blank line that dispatched it


def split_lines(raw: bytes) -> list[Line]:
    """Decode the whole stream (UTF-8, one leading BOM stripped) and split it into lines ending
    in CRLF, LF or CR. Byte offsets refer to `raw`."""
    text = raw.decode("utf-8")
    bom = text.startswith("\ufeff")
    if bom:
        text = text[1:]
    # byte offset of each character of `text` (and of its end)
    offs = [3 if bom else 0]
    for ch in text:
        offs.append(offs[-1] + len(ch.encode("utf-8")))
    lines: list[Line] = []
    n = len(text)
    i = line_start = 0

    def byte_start(ci: int) -> int:
        return 0 if ci == 0 else offs[ci]

    while i < n:
        c = text[i]
        if c == "\n" or c == "\r":
            t_end = i + 2 if c == "\r" and i + 1 < n and text[i + 1] == "\n" else i + 1
            lines.append(Line(byte_start(line_start), offs[i], offs[t_end], text[line_start:i],
                              True))
            i = line_start = t_end
        else:
            i += 1
    if line_start < n or (bom and n == 0):  # unterminated tail (a lone BOM counts): never processed
        lines.append(Line(byte_start(line_start), len(raw), len(raw), None, False))
    return lines


def reference_parse(raw: bytes) -> tuple[list[RefEvent], int, list[Line]]:
    """Return (dispatched events, number of comment lines, lines)."""
    lines = split_lines(raw)
    events: list[RefEvent] = []
    comments = 0
    data_buf = ""
    event_type = ""
    first_field: int | None = None
    for line in lines:
        if not line.terminated:
            break  # an unterminated event at EOF is discarded
        s = line.text
        if s == "":
            if data_buf == "":
                data_buf = event_type = ""
            else:
                events.append(RefEvent(event_type or "message", data_buf[:-1], first_field, line))
                data_buf = event_type = ""
            first_field = None
            continue
        if s.startswith(":"):
            comments += 1
            continue
        if first_field is None:
            first_field = line.start
        if ":" in s:
            name, value = s.split(":", 1)
            if value.startswith(" "):
                value = value[1:]
        else:
            name, value = s, ""
        if name == "data":
            data_buf += value + "\n"
        elif name == "event":
            event_type = value
        # id, retry, anything else: no effect on (event, data)
    return events, comments, lines


def norm_event(name: bytes | None) -> str:
    return (name or b"").decode("utf-8") or "message"


# --------------------------------------------------------------------------------------------
# Expected offsets for a given chunking
# --------------------------------------------------------------------------------------------

def chunk_bounds(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    pts = [0, *sorted(set(c for c in cuts if 0 < c < n)), n]
    return list(zip(pts, pts[1:], strict=False))


def expected_hold(lines: list[Line], bounds: list[tuple[int, int]]) -> list[int | None]:
    """hold_from expected after each chunk: where the bytes of a field line of an event not yet
    dispatched, or of an unterminated line, begin (-1: in an earlier chunk; None: there are
    none)."""
    out: list[int | None] = []
    k = 0
    pending_field: int | None = None
    for s, e in bounds:
        # consume every line whose terminator starts before e (a CR at e-1 ends its line)
        while k < len(lines) and lines[k].terminated and lines[k].term_start < e:
            ln = lines[k]
            if ln.text == "":
                pending_field = None
            elif not ln.text.startswith(":") and pending_field is None:
                pending_field = ln.start
            k += 1
        p = pending_field
        if p is None and k < len(lines) and lines[k].start < e:
            p = lines[k].start  # unterminated line
        out.append(None if p is None else (p - s if p >= s else -1))
    return out


def expected_events(ref: list[RefEvent], bounds: list[tuple[int, int]]):
    """(event, data, chunk index, start-in-chunk or -1, end-in-chunk) for each dispatch."""
    out = []
    j = 0
    for ev in ref:
        b = ev.blank
        while not (bounds[j][0] <= b.term_start < bounds[j][1]):
            j += 1
        s, e = bounds[j]
        # CRLF split across reads: the parser dispatches at the CR.
        crlf_split = b.term_end - b.term_start == 2 and b.term_start == e - 1
        end = b.term_start + 1 if crlf_split else b.term_end
        start = ev.start - s if ev.start >= s else -1
        out.append((ev.event, ev.data, j, start, end - s))
    return out


def run_parser(raw: bytes, bounds: list[tuple[int, int]]):
    p = SSEParser()
    events, holds, skips = [], [], []
    for j, (s, e) in enumerate(bounds):
        chunk = raw[s:e]
        for ev in p.feed(chunk):
            events.append((norm_event(ev.event), ev.data.decode("utf-8"), j, ev.start, ev.end))
        holds.append(p.hold_from)
        skips.append(p.skip_lf)
    return p, events, holds, skips


def check(raw: bytes, cuts: list[int]) -> None:
    ref, comments, lines = reference_parse(raw)
    bounds = chunk_bounds(len(raw), cuts) if raw else []
    p, events, holds, skips = run_parser(raw, bounds)
    # 1. same (event, data) sequence as the whole-input reference
    assert [(a, b) for a, b, *_ in events] == [(r.event, r.data) for r in ref]
    # 2. offsets of each dispatched event
    assert events == expected_events(ref, bounds)
    # 3. what is held after each read
    assert holds == expected_hold(lines, bounds)
    # 4. skip_lf: the read ended with CR
    assert skips == [raw[s:e].endswith(b"\r") for s, e in bounds]
    assert p.comments == comments


# --------------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------------

# No CR/LF inside a line; include ':' and ' ' (splitting), characters str.splitlines() would treat
# as line ends, NUL, a BOM, and non-ASCII of every UTF-8 length.
_special = st.sampled_from(
    [":", " ", "  ", "\x00", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\ufeff", "é", "€", "😀",
     "data", "event", "\t"]
)
_chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n")
value_text = st.lists(st.one_of(_chars, _special), max_size=12).map("".join)
_spaces = st.sampled_from(["", " ", " ", "  "])


@st.composite
def field_line(draw) -> str:
    kind = draw(st.sampled_from(
        ["data", "data", "data", "data_empty", "data_bare", "event", "event_empty", "id", "retry",
         "comment", "unknown", "nocolon", "long"]
    ))
    if kind == "data":
        return "data:" + draw(_spaces) + draw(value_text)
    if kind == "data_empty":
        return draw(st.sampled_from(["data:", "data: "]))
    if kind == "data_bare":
        return "data"
    if kind == "event":
        return "event:" + draw(_spaces) + draw(value_text)
    if kind == "event_empty":
        return draw(st.sampled_from(["event:", "event: ", "event"]))
    if kind == "id":
        return "id:" + draw(_spaces) + draw(value_text)
    if kind == "retry":
        return "retry:" + draw(_spaces) + draw(st.sampled_from(["3000", "x1", ""]))
    if kind == "comment":
        return ":" + draw(value_text)
    if kind == "unknown":
        name = draw(st.sampled_from(["foo", "Data", "DATA", " data", "data ", "ev"]))
        return name + ":" + draw(value_text)
    if kind == "nocolon":
        return draw(st.sampled_from(["x", "dat", "eventx", "id", "retry", "é"]))
    # occasionally a very long line
    return "data: " + draw(st.sampled_from(["x", "é", "€😀"])) * draw(st.integers(2000, 20000))


_term = st.sampled_from(["\n", "\r", "\r\n"])


@st.composite
def sse_stream(draw) -> bytes:
    parts: list[str] = []
    for _ in range(draw(st.integers(0, 6))):  # events
        for _ in range(draw(st.integers(0, 4))):
            parts.append(draw(field_line()) + draw(_term))
        for _ in range(draw(st.integers(1, 2))):  # one or two blank lines
            parts.append(draw(_term))
    if draw(st.booleans()):  # an unterminated tail (discarded at EOF)
        parts.append(draw(st.one_of(field_line(), st.just(""))))
    raw = "".join(parts).encode("utf-8")
    if draw(st.integers(0, 5)) == 0:
        raw = BOM + raw
    return raw


@st.composite
def cuts_for(draw, raw: bytes) -> list[int]:
    n = len(raw)
    if n < 2:
        return []
    mode = draw(st.sampled_from(["random", "random", "bytes", "crlf", "none"]))
    if mode == "bytes" and n <= 4096:
        return list(range(1, n))
    cuts = draw(st.lists(st.integers(1, n - 1), max_size=40))
    if mode == "crlf":  # split every CRLF between CR and LF
        cuts += [i + 1 for i in range(n - 1) if raw[i] == 13 and raw[i + 1] == 10]
    elif mode == "none":
        cuts = []
    return cuts


FAST = settings(max_examples=250, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --------------------------------------------------------------------------------------------
# Property tests
# --------------------------------------------------------------------------------------------

@FAST
@given(st.data())
def test_incremental_matches_reference(data):
    raw = data.draw(sse_stream(), label="raw")
    cuts = data.draw(cuts_for(raw), label="cuts")
    check(raw, cuts)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["data: a", "data:", ": c", "event: e", "id: 1", "x",
                                           ""]),
                          _term), max_size=12),
       st.data())
def test_small_streams_every_byte(lines, data):
    """Small streams fed one byte at a time and in random pieces (dense CR/LF interplay)."""
    raw = "".join(a + t for a, t in lines).encode()
    check(raw, list(range(1, len(raw))))
    if len(raw) > 1:
        check(raw, data.draw(st.lists(st.integers(1, len(raw) - 1), max_size=8)))


_STATE = [s for s in SSEParser.__slots__ if s != "hold_from"]


def _state(p: SSEParser) -> list[object]:
    return [getattr(p, s) for s in _STATE]


@FAST
@given(st.data())
def test_whole_event_fast_path_agrees_with_feed(data):
    """`whole_event` (the relay's fast path) claims a read only when `feed` would dispatch
    exactly that one event from it and end in the same state; every other read goes to
    `feed`, so the two parsers stay in step over any stream and any chunking."""
    raw = data.draw(st.one_of(sse_stream(), st.lists(st.sampled_from(
        [b"data: {\"a\":1}\n\n", b"data: x\n\n", b"data: \n\n", b"data:x\n\n",
         b": ping\n\n", b"data: a\r\n\r\n", b"event: e\ndata: x\n\n", b"data: a\n",
         b"\n", b"data: a\nb\n\n", b"event: e\n", b"id: 1\n", b"data: a\r"]),
        max_size=12).map(b"".join)), label="raw")
    cuts = data.draw(cuts_for(raw), label="cuts")
    fast, slow = SSEParser(), SSEParser()
    for start, end in (chunk_bounds(len(raw), cuts) if raw else []):
        piece = raw[start:end]
        got = fast.whole_event(piece)
        events = slow.feed(piece)
        if got is None:
            fast_events = fast.feed(piece)
            assert [(e.event, e.data, e.start, e.end) for e in fast_events] == \
                [(e.event, e.data, e.start, e.end) for e in events]
        else:
            assert [(e.event, e.data, e.start, e.end) for e in events] == \
                [(None, got, 0, len(piece))]
        assert fast.hold_from == slow.hold_from
        assert _state(fast) == _state(slow)


def test_whole_event_claims_the_common_read():
    p = SSEParser()
    assert p.whole_event(b"data: x\n\n") is None  # nothing seen yet (a BOM may come)
    p.feed(b"data: x\n\n")
    assert p.whole_event(b"data: {\"a\": 1}\n\n") == b'{"a": 1}'
    assert p.whole_event(b"data: a\n\ndata: b\n\n") is None  # two events: feed
    assert p.whole_event(b"data: a\r\n\r\n") is None
    p.feed(b"event: e\n")  # this event began in an earlier read: feed
    assert p.whole_event(b"data: x\n\n") is None


# --------------------------------------------------------------------------------------------
# Reference parser sanity (so a bug in it cannot hide one in SSEParser)
# --------------------------------------------------------------------------------------------

def ref_pairs(raw: bytes) -> list[tuple[str, str]]:
    return [(e.event, e.data) for e in reference_parse(raw)[0]]


def test_reference_parser_spec_examples():
    # WHATWG §9.2.6 examples
    assert ref_pairs(b"data: YHOO\ndata: +2\ndata: 10\n\n") == [("message", "YHOO\n+2\n10")]
    assert ref_pairs(b": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\n"
                     b"data:  third event\n\n") == [
        ("message", "first event"), ("message", "second event"), ("message", " third event")]
    assert ref_pairs(b"data\n\ndata\ndata\n\ndata:") == [("message", ""), ("message", "\n")]
    assert ref_pairs(b"data:test\n\ndata: test\n\n") == [("message", "test")] * 2
    assert ref_pairs(b"event: add\ndata: 73857293\n\nevent: remove\ndata: 2153\n\n") == [
        ("add", "73857293"), ("remove", "2153")]
    assert ref_pairs(b"event: x\n\ndata: y\n\n") == [("message", "y")]
    assert ref_pairs(b"\xef\xbb\xbfdata: a\r\rdata: b\r\n\r\n") == [("message", "a"),
                                                                ("message", "b")]
    assert ref_pairs(b"data: a\x0bb\xc2\x85c\n\n") == [("message", "a\x0bb\x85c")]


# --------------------------------------------------------------------------------------------
# Edge cases
# --------------------------------------------------------------------------------------------

def feed_all(chunks: list[bytes]):
    p = SSEParser()
    out = []
    for c in chunks:
        out += [(ev.event, ev.data) for ev in p.feed(c)]
    return p, out


def test_bom_at_start():
    p, out = feed_all([BOM + b"data: a\n\n"])
    assert out == [(None, b"a")]
    check(BOM + b"data: a\n\n", [])


@pytest.mark.parametrize("cut", [1, 2, 3, 4])
def test_bom_split_across_chunks(cut):
    raw = BOM + b"event: e\ndata: a\n\n"
    p, out = feed_all([raw[:cut], raw[cut:]])
    assert out == [(b"e", b"a")]
    p, out = feed_all([bytes([b]) for b in raw])
    assert out == [(b"e", b"a")]
    check(raw, [cut])


def test_only_one_leading_bom_and_only_at_start():
    # a second BOM is part of the field name: "\ufeffdata" is an unknown field
    assert feed_all([BOM + BOM + b"data: a\n\n"])[1] == []
    assert feed_all([b"data: a\n\n" + BOM + b"data: b\n\n"])[1] == [(None, b"a")]
    check(BOM + BOM + b"data: a\n\n", [2, 4])


def test_data_without_colon():
    assert feed_all([b"data\n\n"])[1] == [(None, b"")]
    assert feed_all([b"data\ndata\n\n"])[1] == [(None, b"\n")]
    assert feed_all([b"data:\n\n"])[1] == [(None, b"")]


def test_data_without_space_and_two_spaces():
    assert feed_all([b"data:x\n\n"])[1] == [(None, b"x")]
    assert feed_all([b"data:  x\n\n"])[1] == [(None, b" x")]
    assert feed_all([b"data: x \n\n"])[1] == [(None, b"x ")]
    assert feed_all([b"data::x\n\n"])[1] == [(None, b":x")]
    assert feed_all([b"event:  e\ndata: x\n\n"])[1] == [(b" e", b"x")]


def test_blank_line_without_data_dispatches_nothing_and_resets_event():
    assert feed_all([b"event: e\n\ndata: x\n\n"])[1] == [(None, b"x")]
    assert feed_all([b"id: 1\n\n\n\n"])[1] == []


def test_unterminated_event_discarded():
    p, out = feed_all([b"data: a\n\ndata: b\n"])
    assert out == [(None, b"a")]
    assert p.hold_from is not None


@pytest.mark.parametrize("raw", [
    b"data: a\r\n\r\ndata: b\r\n\r\n",
    b"data: a\r\rdata: b\n\n",
    b"data: a\r\n\rdata: b\n\r\n",
])
def test_crlf_split_at_every_point(raw):
    for cut in range(1, len(raw)):
        p, out = feed_all([raw[:cut], raw[cut:]])
        assert out == [(None, b"a"), (None, b"b")], cut
        check(raw, [cut])


def test_crlf_split_dispatches_at_cr():
    p = SSEParser()
    evs = p.feed(b"data: a\r\n\r")
    assert [(e.data, e.start, e.end) for e in evs] == [(b"a", 0, 10)]
    assert p.skip_lf and p.hold_from is None
    assert p.feed(b"\ndata: b\r\n\r\n")[0].start == 1  # the LF belongs to the previous line end
    assert not p.skip_lf


def test_comments_counted():
    p, out = feed_all([b": ping\n\n:\r", b"\n: keep-alive\rdata: x\n: mid\n\n: tail"])
    assert out == [(None, b"x")]
    assert p.comments == 4  # the unterminated ": tail" is not a line yet
    p.feed(b"\n")
    assert p.comments == 5


def test_split_comment_is_not_held():
    # A keep-alive comment split across reads must not stay held once its line is complete.
    check(b": ping\n", [3])
    p = SSEParser()
    p.feed(b": pi")
    assert p.hold_from == 0
    p.feed(b"ng\n")
    assert p.hold_from is None


def test_event_start_includes_earlier_field_lines():
    # id/retry/unknown field lines belong to the event they open: start must say so.
    check(b"id: 1\ndata: x\n\n", [6])
    p = SSEParser()
    p.feed(b"id: 1\n")
    assert p.hold_from == 0
    [ev] = p.feed(b"data: x\n\n")
    assert ev.start == -1


def test_empty_read_keeps_pending_lf():
    # feed(b"") must not forget that the previous read ended in CR
    p = SSEParser()
    assert p.feed(b"data: a\r") == []
    assert p.feed(b"") == []
    assert p.feed(b"\n") == []  # the LF completes the CRLF; it is not a blank line
    assert [(e.data) for e in p.feed(b"data: b\n\n")] == [b"a\nb"]


def test_long_line_linear_time():
    line = b"data: " + b"x" * (1 << 20) + b"\n\n"
    chunks = [line[i:i + 1024] for i in range(0, len(line), 1024)]
    p = SSEParser()
    t0 = time.perf_counter()
    out = []
    for c in chunks:
        out += p.feed(c)
        if len(out) == 0:
            assert p.hold_from in (0, -1)
    dt = time.perf_counter() - t0
    assert ([(e.data == b"x" * (1 << 20), e.start, e.end) for e in out]
            == [(True, -1, len(chunks[-1]))])
    assert p.hold_from is None
    assert dt < 0.5, dt


def test_long_line_crlf_linear_time():
    line = b"data: " + b"y" * (1 << 20) + b"\r\n\r\n"
    chunks = [line[i:i + 1024] for i in range(0, len(line), 1024)]
    t0 = time.perf_counter()
    p, out = feed_all(chunks)
    assert time.perf_counter() - t0 < 0.5
    assert out == [(None, b"y" * (1 << 20))]


def test_many_lines_in_one_read_with_cr_is_linear():
    # One big read of LF-terminated events that also contains a CR near its end: looking up the
    # next CR must not rescan the rest of the read for every line.
    n = 20_000
    chunk = (b"data: " + b"x" * 400 + b"\n\n") * n + b"data: y\r\r"  # 8 MB
    p = SSEParser()
    t0 = time.perf_counter()
    evs = p.feed(chunk)
    dt = time.perf_counter() - t0
    assert len(evs) == n + 1 and evs[-1].data == b"y"
    assert dt < 1.0, dt  # ~0.1 s linear; ~3 s when every line rescans the read for a CR
