"""The relay's pure core: whatever the upstream's chunking and line endings, the client gets
the upstream's bytes unchanged, less exactly the usage chunk the gateway asked for, and never
part of an unfinished event, however long."""
from __future__ import annotations

import itertools
from unittest import mock

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from gateway.apis import chat, messages
from gateway.exchange import Exchange
from gateway.request.relay import ERROR_HOLD_LIMIT, JOIN_LIMIT, Splicer, splice
from tests.support.stamps import StampedExchange

ROLE = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
TOKEN = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"%d"}}]}'
FINAL = b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}'
DONE = b"data: [DONE]"


@given(st.binary(max_size=200), st.data())
def test_splice_is_the_bytes_outside_the_drops_up_to_the_cut(buf: bytes,
                                                            data: st.DataObject) -> None:
    points = sorted(data.draw(st.lists(st.integers(0, len(buf)), max_size=8)))
    drops = list(zip(points[::2], points[1::2], strict=False))  # an odd point is left out
    cut = data.draw(st.integers(points[-1] if points else 0, len(buf)))
    keep = bytearray()
    for i in range(cut):
        if not any(a <= i < b for a, b in drops):
            keep.append(buf[i])
    assert splice(buf, drops, cut) == bytes(keep)


def _chunks(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c * 37 % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    return [stream[a:b] for a, b in itertools.pairwise(points)]


def _run(stream: bytes, cuts: list[int], injected: bool) -> tuple[bytes, Exchange]:
    ex = Exchange(chat.CHAT)
    ex.stream, ex.usage_injected = True, injected
    splicer = Splicer(ex, chat.API)
    out = b"".join(splicer.feed(chunk, t) for t, chunk in enumerate(_chunks(stream, cuts), 1))
    return out + splicer.held_back(), ex


@settings(max_examples=300, deadline=None)
@given(n_tokens=st.integers(0, 6), eol=st.sampled_from([b"\n", b"\r\n", b"\r"]),
       comments=st.booleans(), injected=st.booleans(), padded=st.sampled_from([0, 3 * JOIN_LIMIT]),
       cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_any_chunking_relays_the_stream_less_exactly_the_injected_usage_chunk(
        n_tokens: int, eol: bytes, comments: bool, injected: bool, padded: int,
        cuts: list[int]) -> None:
    """... with events of any size: `padded`, the role chunk and the usage chunk longer than
    JOIN_LIMIT (whitespace in their JSON), so that they are held as parts."""
    def event(line: bytes) -> bytes:
        return line + eol + eol

    def pad(line: bytes) -> bytes:
        return line[:-1] + b" " * padded + line[-1:]

    parts = [event(pad(ROLE))] + [event(TOKEN % i) for i in range(n_tokens)] + [event(FINAL)]
    if comments:
        parts.insert(1, b": ping" + eol + eol)
    usage = event(pad(USAGE))
    stream = b"".join(parts) + usage + event(DONE)
    out, ex = _run(stream, cuts, injected)
    assert out == (stream.replace(usage, b"") if injected else stream)
    assert ex.token_events == n_tokens and ex.done
    assert (ex.prompt_tokens, ex.completion_tokens) == (3, 4)


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_anthropic_event_lines_pass_untouched(cuts: list[int]) -> None:
    stream = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"m",'
              b'"model":"c","usage":{"input_tokens":5}}}\n\n'
              b'event: ping\ndata: {"type": "ping"}\n\n'
              b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
              b'"delta":{"type":"text_delta","text":"Hi"}}\n\n'
              b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    ex = Exchange("/v1/messages")
    splicer = Splicer(ex, messages.API)
    out = b"".join(splicer.feed(c, t) for t, c in enumerate(_chunks(stream, cuts), 1))
    assert out == stream and ex.token_events == 1 and ex.done and ex.prompt_tokens == 5


@pytest.mark.parametrize("injected", [False, True])
def test_an_unfinished_event_is_held_back_whole_however_long(injected: bool) -> None:
    """Past JOIN_LIMIT an unfinished event is held as its reads (no copy of it per read), and
    none of it goes out before it ends: then all of it, in one piece, with what followed it
    in that read — or none of it, when it is the usage chunk the gateway asked for."""
    ex = Exchange(chat.CHAT)
    ex.usage_injected = injected
    splicer = Splicer(ex, chat.API)
    event_start = USAGE[:-2]
    assert splicer.feed(event_start, 1) == b""
    assert splicer.pending == event_start
    pad = b" " * (JOIN_LIMIT // 3)
    for t in range(2, 6):  # past JOIN_LIMIT: the reads are kept as they came
        assert splicer.feed(pad, t) == b""
    assert splicer.pending == b"" and splicer.parts == [event_start + 3 * pad, pad]
    assert splicer.held_size == len(event_start) + 4 * len(pad)
    assert splicer.held_back() == event_start + 4 * pad
    out = splicer.feed(USAGE[-2:] + b"\n\n" + TOKEN % 1, 6)
    whole = event_start + 4 * pad + USAGE[-2:] + b"\n\n"
    assert out == (b"" if injected else whole)
    assert splicer.parts == [] and splicer.pending == TOKEN % 1  # the next event's start
    assert ex.completion_tokens == 4


_TEXTS = st.sampled_from(["x", " token", "", 'say "hi"', "a\\b", "é😀", "\n", "</s>"])


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(_TEXTS, max_size=12), reasoning=st.integers(0, 3),
       finish_with_text=st.booleans(), cuts=st.lists(st.integers(0, 10_000), max_size=4),
       per_read=st.integers(1, 3))
def test_the_token_shape_fast_path_stamps_what_parsing_every_event_would(
        texts: list[str], reasoning: int, finish_with_text: bool, cuts: list[int],
        per_read: int) -> None:
    """A stream of ordinary tokens (with reasoning first, empty and escaped texts, a last
    chunk that also carries text), one to three events per read or cut anywhere: the exchange
    is stamped exactly as when every event is parsed, and the bytes are the same."""
    head = b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":'

    def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return b"data: " + head + orjson.dumps([choice]) + b"}\n\n"

    parts = [chunk({"role": "assistant", "content": ""})]
    parts += [chunk({"reasoning_content": "r"}) for _ in range(reasoning)]
    parts += [chunk({"content": t}) for t in texts]
    parts.append(chunk({"content": "end"} if finish_with_text else {}, "stop"))
    parts.append(b"data: [DONE]\n\n")
    stream = b"".join(parts)
    runs = []
    for shapes in (True, False):
        ex = StampedExchange(chat.CHAT)
        ex.stream = True
        splicer = Splicer(ex, chat.API)
        if not shapes:
            splicer.shape_tries = 0
        reads = _chunks(stream, cuts) if cuts else [
            b"".join(parts[i:i + per_read]) for i in range(0, len(parts), per_read)]
        out = b"".join(splicer.feed(c, t) for t, c in enumerate(reads, 1)) + splicer.held_back()
        runs.append((out, ex.events, ex.token_events, ex.token_stamps, ex.t_first_token,
                     ex.t_first_visible, ex.t_last_token, ex.finish_reasons, ex.done,
                     ex.response_id))
        plain = len(texts) > 1 and all(t and not set(t) & set('"\\\n') for t in texts)
        if shapes and not cuts and plain:
            assert splicer.shape is not None  # the fast path was taken
    assert runs[0] == runs[1]
    assert runs[0][0] == stream


@pytest.mark.parametrize("after_write", [True, False])
def test_the_shape_is_taken_after_the_read_that_offers_it(after_write: bool) -> None:
    """The first token's read goes out before the stream's token shape is taken from it (the
    relay calls learn_shape after its write); a read that needs the shape takes it first, so
    the next token is on the fast path either way."""
    ex = Exchange(chat.CHAT)
    splicer = Splicer(ex, chat.API)
    shapes = []
    token_shape = chat.API.token_shape
    parsed = []
    observe = chat.API.observe
    with mock.patch.object(chat.API, "token_shape", lambda *a: shapes.append(a[0].data)
                           or token_shape(*a)):
        first = ROLE + b"\n\n" + TOKEN % 1 + b"\n\n"
        assert splicer.feed(first, 1) == first and ex.t_first_token == 1
        assert shapes == [] and splicer.shape is None
        if after_write:
            assert splicer.learn_shape() is not None and shapes == [TOKEN[6:] % 1]
        with mock.patch.object(chat.API, "observe", lambda ev, route: parsed.append(ev)
                               or observe(ev, route)):
            assert splicer.feed(TOKEN % 2 + b"\n\n", 2) == TOKEN % 2 + b"\n\n"
    assert parsed == [] and ex.token_events == 2  # the shape fitted: not parsed
    assert shapes == [TOKEN[6:] % 1]


def test_a_token_whose_text_has_escapes_keeps_the_shape() -> None:
    """Engines' text often has quotes and newlines (escaped in JSON): those tokens fit the
    shape too (their text is still one JSON string), so only the first token is parsed; a
    provider that pads every chunk differently stops being looked at after a few tries."""
    def chunk(text: str, pad: str = "") -> bytes:
        return (b'data: {"id":"c","choices":[{"index":0,"delta":{"content":'
                + orjson.dumps(text) + b'},"finish_reason":null}]' + pad.encode() + b"}\n\n")

    ex = Exchange(chat.CHAT)
    splicer = Splicer(ex, chat.API)
    parsed = []
    observe = chat.API.observe
    with mock.patch.object(chat.API, "observe", lambda ev, route: parsed.append(ev.data)
                           or observe(ev, route)):
        for t, text in enumerate(["a", 'say "hi"', "b", "line\n", "c", "d"], 1):
            splicer.feed(chunk(text), t)
        assert len(parsed) == 1 and ex.token_events == 6  # "a"
        for i in range(10):
            splicer.feed(chunk("x", f',"obfuscation":"{i}"'), 100 + i)
    assert ex.token_events == 16 and splicer.shape is None and len(parsed) == 11


@settings(max_examples=200, deadline=None)
@given(n_tokens=st.integers(1, 4), padded=st.sampled_from([0, 3 * JOIN_LIMIT]),
       flood=st.booleans(), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_a_backend_error_after_the_first_token_and_all_after_it_are_held_in_any_chunking(
        n_tokens: int, padded: int, flood: bool, cuts: list[int]) -> None:
    """A stream that may be continued: the client gets every byte before the error event,
    the error event and what follows are held (exactly), unless they flood past the bound."""
    tokens = b"".join(b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"t%d%s"}}]}\n\n'
                      % (i, b"x" * padded) for i in range(n_tokens))
    error = b'data: {"error":{"message":"boom","type":"internal_server_error"}}\n\n'
    after = b"data: [DONE]\n\n" + (b": " + b"f" * (ERROR_HOLD_LIMIT + 1) + b"\n\n" if flood
                                   else b"")
    ex = Exchange(chat.CHAT)
    ex.stream, ex.streamed_text = True, []
    splicer = Splicer(ex, chat.API, max_event_bytes=8 * JOIN_LIMIT)
    stream = tokens + error + after
    out = b"".join(splicer.feed(chunk, t) for t, chunk in enumerate(_chunks(stream, cuts), 1))
    assert out + splicer.held_back() == tokens
    assert splicer.held_error == (b"" if flood else error + after)
    assert splicer.held_flooded == flood and ex.done
