"""`slogate bench` on a tiny sweep: two loads against a small simulator, the table and the
recommendation come out, and the light load is the feasible one for the tight class."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CONFIG = """
[auth]
mode = "open"
[[slo_classes]]
name = "interactive"
ttft_ms = 300
tpot_ms = 40
[[slo_classes]]
name = "batch"
ttft_ms = 20000
tpot_ms = 400
[slo]
default = "interactive"
[[backends]]
name = "sim"
base_url = "http://127.0.0.1:1/v1"
"""


def test_bench_prints_the_table_and_a_recommendation(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    proc = subprocess.run([sys.executable, "-m", "gateway", "bench", "--config", str(cfg),
                           "--sim-args", "--max-batch 8", "--loads", "0.5,3", "--seconds", "3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| load | offered req/s | class | goodput req/s |" in out
    assert out.count("| 0.5x |") == 2 and out.count("| 3x |") == 2
    assert "recommended:" in out
    assert "- interactive (TTFT 300 ms, TPOT 40 ms): feasible up to 0.5x" in out
    assert "max_concurrency = " in out
