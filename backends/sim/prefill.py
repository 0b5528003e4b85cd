"""Assistant-prefill continuation (vLLM's `continue_final_message`, Anthropic's prefill).

An answer is a plan: token ids from a PRNG seeded by the prompt *without* the prefill (or by the
request's `seed`). The prefill's text stands for the plan's first K tokens, found by matching it
against the plan's words; the answer is the plan from token K on. So a request whose prefill is
the first K tokens of an earlier answer gets exactly the rest of that answer.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from .formats import WORDS


@dataclass(frozen=True, slots=True)
class Prefill:
    """The final assistant message a request asks to continue."""

    text: str  # its content
    thinking: str = ""  # its reasoning (chat `reasoning` / `reasoning_content`, thinking blocks)
    prompt_bytes: int = 0  # its content's bytes (a prefill that is not continued still counts)


class Plan:
    """The token ids of one answer, as many as asked: whole 32-bit PRNG words, so a longer plan
    extends a shorter one (random.randbytes(n) is not prefix-stable for n not a multiple of 4)."""

    __slots__ = ("state",)

    def __init__(self, rng: random.Random) -> None:
        self.state = rng.getstate()

    def tokens(self, n: int) -> bytes:
        rng = random.Random()
        rng.setstate(self.state)
        return rng.randbytes(-(-n // 4) * 4)[:n]


def match(plan: Plan, start: int, limit: int, text: str, bytes_per_token: int) -> tuple[int, bool]:
    """(K, exact): the plan position `text` reaches when it follows plan token `start`. Exact when
    the text is the plan's words start..K-1; else the unmatched rest counts as its bytes /
    bytes_per_token tokens (someone else's text, or a token cut in the middle)."""
    toks = plan.tokens(min(limit, start + len(text)))  # every word is at least one character
    i, pos = start, 0
    while i < len(toks) and text.startswith(WORDS[toks[i]], pos):
        pos += len(WORDS[toks[i]])
        i += 1
    rest = len(text[pos:].encode())
    return i + -(-rest // bytes_per_token), rest == 0


def start_of(plan: Plan, reasoning: int, pf: Prefill, bytes_per_token: int) -> tuple[int, bool]:
    """(K, exact) for a prefill: text means the reasoning is over (K counts from the plan's first
    text token); a prefill of reasoning alone continues the reasoning."""
    if pf.text:
        return match(plan, reasoning, 1 << 62, pf.text, bytes_per_token)
    if pf.thinking and reasoning:
        k, exact = match(plan, 0, reasoning, pf.thinking, bytes_per_token)
        return min(k, reasoning), exact and k <= reasoning
    return 0, not pf.thinking
