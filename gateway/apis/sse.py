"""Incremental `text/event-stream` parser used as a tap on the relayed bytes.

It never changes what is forwarded: it is fed each upstream read as it arrives and reports the
events completed by that read, with the offset (within the read) just past the blank line that
ended each event, so the relay can drop an event's bytes when it must (the injected usage chunk).

Parsing follows WHATWG HTML §9.2.6: lines end with CRLF, LF or CR (a CRLF split across reads is
one line end); `:` starts a comment; a field's value loses one leading space; `data` lines are
joined with LF; a blank line dispatches the event if it has data; an unterminated event at EOF is
discarded. A leading UTF-8 BOM is skipped.

Bounded: an event whose data (or an unterminated line) grows past `max_event_bytes` raises
EventTooLarge instead of growing the parser's buffers (an upstream that never sends a newline).
"""
from __future__ import annotations

from gateway.errors import EventTooLarge

DEFAULT_MAX_EVENT_BYTES = 8 * 1024 * 1024

_LF = 10
_CR = 13
_BOM = b"\xef\xbb\xbf"


class SSEEvent:
    """One dispatched event. `end` is the offset in the read that completed it, just past the
    line terminator of its closing blank line; `start` is the offset in that read where the
    event's first line began, or -1 when it began in an earlier read."""

    __slots__ = ("event", "data", "start", "end")

    def __init__(self, event: bytes | None, data: bytes, start: int, end: int) -> None:
        self.event = event
        self.data = data
        self.start = start
        self.end = end

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"SSEEvent(event={self.event!r}, data={self.data[:60]!r}, end={self.end})"


class SSEParser:
    __slots__ = ("_parts", "_skip_lf", "_data", "_event", "_fields", "_started", "comments",
                 "hold_from", "max_event_bytes", "_part_size", "_data_size")

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self._part_size = 0  # bytes in _parts
        self._data_size = 0  # bytes in _data
        self._parts: list[bytes] = []  # pieces of an unterminated line
        self._skip_lf = False  # the previous read ended with CR: a leading LF belongs to it
        self._data: list[bytes] = []
        self._event: bytes | None = None
        self._fields = False  # a field line (any, not only data/event) since the last blank line
        self._started = False  # first line seen (a BOM is stripped from it)
        self.comments = 0  # comment lines seen (keep-alive pings)
        # After feed(): offset in that read where bytes of a not yet dispatched event (or an
        # unterminated line) begin, -1 if they began in an earlier read, None if there are none.
        self.hold_from: int | None = None

    @property
    def skip_lf(self) -> bool:
        """True when the last read ended in CR, so an LF starting the next read is part of
        the previous line terminator."""
        return self._skip_lf

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        pos = 0
        if self._skip_lf and chunk:  # an empty read does not settle the pending LF
            self._skip_lf = False
            if chunk[:1] == b"\n":
                pos = 1
        return self._scan(chunk, pos, len(chunk), events)

    def between_events(self) -> bool:
        """Nothing of an event (or a line) is pending and no LF is owed to the last read."""
        return self._started and not (self._parts or self._fields or self._skip_lf)

    def whole_event(self, chunk: bytes) -> bytes | None:
        """The data of `chunk` when it is exactly one whole `data: <one line>\n\n` event and
        the parser stands between events (what engines send, one token per read): the
        relay's fast path, with no event list, no line loop and no state to update (after
        such an event the state is what it was). None: use `feed`."""
        n = len(chunk)
        if (not self.between_events() or not chunk.startswith(b"data: ")
                or chunk.find(b"\n") != n - 2
                or chunk[n - 1] != _LF or n - 2 > self.max_event_bytes or b"\r" in chunk):
            return None
        self.hold_from = None
        return chunk[6:n - 2]

    def _scan(self, chunk: bytes, pos: int, n: int, events: list[SSEEvent]) -> list[SSEEvent]:
        has_cr = b"\r" in chunk
        find = chunk.find
        if not has_cr and self._started and not self._fields and not self._parts:
            # Fast path for what engines send: whole `data: <one line>\n\n` events.
            startswith = chunk.startswith
            limit = self.max_event_bytes
            while pos < n and startswith(b"data: ", pos):
                i = find(b"\n", pos)
                if i < 0 or i + 1 >= n or chunk[i + 1] != _LF or i - pos > limit:
                    break
                events.append(SSEEvent(None, chunk[pos + 6:i], pos, i + 2))
                pos = i + 2
            if pos >= n:
                self.hold_from = None
                return events
        # Start of the event's first field line (or of an unterminated line) not yet dispatched:
        # -1 = it began in an earlier read; None = none.
        start: int | None = -1 if self._fields else None
        # Next LF / CR at or after pos (-1: none left), each searched again only once passed,
        # so a read of many LF lines with a CR near its end is not rescanned per line.
        i_lf = i_cr = -2
        while pos < n:
            if has_cr:
                if i_lf != -1 and i_lf < pos:
                    i_lf = find(b"\n", pos)
                if i_cr != -1 and i_cr < pos:
                    i_cr = find(b"\r", pos)
                if i_cr < 0:
                    i = i_lf
                elif i_lf < 0 or i_cr < i_lf:
                    i = i_cr
                else:
                    i = i_lf
            else:
                i = find(b"\n", pos)
            if i < 0:
                if start is None:
                    start = -1 if self._parts else pos
                self._parts.append(chunk[pos:] if pos else chunk)
                self._part_size += n - pos
                if self._part_size + self._data_size > self.max_event_bytes:
                    raise EventTooLarge(self._part_size + self._data_size, self.max_event_bytes)
                break
            line_start = -1 if self._parts else pos
            if self._parts:
                self._parts.append(chunk[pos:i])
                line = b"".join(self._parts)
                self._parts.clear()
                self._part_size = 0
            else:
                line = chunk[pos:i]
            if chunk[i] == _CR:
                if i + 1 < n:
                    nxt = i + 2 if chunk[i + 1] == _LF else i + 1
                else:
                    nxt = i + 1
                    self._skip_lf = True
            else:
                nxt = i + 1
            pos = nxt
            if not self._started:
                self._started = True
                if line.startswith(_BOM):
                    line = line[3:]
            if line:
                if self._line(line):
                    self._fields = True
                    if start is None:
                        start = line_start
            elif self._data:
                data = b"\n".join(self._data)
                events.append(SSEEvent(self._event, data, -1 if start is None else start, nxt))
                self._data = []
                self._data_size = 0
                self._event = None
                self._fields = False
                start = None
            else:
                self._event = None
                self._fields = False
                start = None
        self.hold_from = start
        return events

    def _line(self, line: bytes) -> bool:
        """Process one non-empty line; True if it is a field line (part of an event)."""
        if line[0] == 58:  # ":" comment
            self.comments += 1
            return False
        colon = line.find(b":")
        if colon < 0:
            name, value = line, b""
        else:
            name = line[:colon]
            value = line[colon + 2 :] if line[colon + 1 : colon + 2] == b" " else line[colon + 1 :]
        if name == b"data":
            self._data.append(value)
            self._data_size += len(value) + 1
            if self._data_size > self.max_event_bytes:
                raise EventTooLarge(self._data_size, self.max_event_bytes)
        elif name == b"event":
            self._event = value
        # id / retry / unknown fields: nothing to observe; their bytes pass through untouched.
        return True
