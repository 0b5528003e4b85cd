"""`slogate check` warns about SLO targets no engine can meet: a TTFT target below the
simulator's unloaded TTFT plus one decode step."""
from __future__ import annotations

from pathlib import Path

import pytest

from gateway import config
from gateway.ops import check

KNOBS = {"decode_base_ms": 10.0, "decode_per_seq_ms": 0.5, "prefill_tokens_per_s": 20000.0,
         "stall_ms": 0.0}
TOML = """
[auth]
mode = "open"
[[slo_classes]]
name = "instant"
ttft_ms = 15
tpot_ms = 50
[[slo_classes]]
name = "chat"
ttft_ms = 500
tpot_ms = 50
[slo]
default = "chat"
[[backends]]
name = "sim"
base_url = "http://127.0.0.1:1/v1"
[[backends]]
name = "hosted"
type = "groq"
base_url = "http://127.0.0.1:2/openai/v1"
[[backends]]
name = "paid"
base_url = "https://api.openai.invalid/v1"
models = ["gpt-x"]
"""


def _cfg(tmp_path: Path) -> config.Config:
    path = tmp_path / "c.toml"
    path.write_text(TOML)
    from gateway.apis import PROVIDERS

    return config.load(str(path), env={}, providers=PROVIDERS)


def test_floor_is_stall_prefill_and_two_steps() -> None:
    assert check.sim_floor_ms(KNOBS) == pytest.approx(0.05 + 21.0)
    assert check.sim_floor_ms({**KNOBS, "stall_ms": 100}, 2000) == pytest.approx(100 + 100 + 21)


def test_only_the_class_below_the_floor_is_warned_about(tmp_path: Path) -> None:
    lines = check.infeasible_targets(_cfg(tmp_path), {"sim": KNOBS, "hosted": None})
    assert len(lines) == 2
    assert "'instant'" in lines[0] and "ttft_ms = 15" in lines[0] and "21.1 ms" in lines[0]
    assert "'chat'" not in "".join(lines)
    assert "hosted" in lines[1] and "not known" in lines[1]


def test_nothing_known_nothing_warned(tmp_path: Path) -> None:
    assert check.infeasible_targets(_cfg(tmp_path), {"sim": None, "hosted": None}) == []
    assert check.infeasible_targets(_cfg(tmp_path), {"sim": {**KNOBS, "decode_base_ms": 1},
                                                     "hosted": None}) == []


def test_only_a_possible_simulator_is_asked_never_a_hosted_api(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    monkeypatch.setattr(check, "engine_physics", lambda url: asked.append(url) or KNOBS)
    assert check.probe_backends(_cfg(tmp_path)) == {"sim": KNOBS, "hosted": None,
                                                     "paid": None}
    assert asked == ["http://127.0.0.1:1/v1"]


def test_unreachable_engine_is_not_the_simulator() -> None:
    assert check.engine_physics("http://127.0.0.1:1/v1") is None


def test_check_prints_the_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text(TOML)
    monkeypatch.setattr(check, "engine_physics",
                        lambda url: KNOBS if ":1/" in url else None)
    assert check.run(str(path)) == 0
    err = capsys.readouterr().err
    assert "slogate: warning: SLO class 'instant'" in err
    assert "config OK" in err
