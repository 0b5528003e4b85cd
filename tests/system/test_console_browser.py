"""The live console in a real browser: Debian's chromium, headless, driven by Selenium through
Debian's matching chromium-driver (Playwright would need its own browser build, which cannot be
downloaded here). The simulator runs a load through the gateway while the page is open.

Proves: the page works with no build step and no CDN (everything from the gateway); the empty
state says what to do; the numbers change while a load runs (pushed, no reload); a request
stalled on purpose shows in the waterfall with its request id and trace id, the stall in the
"first token" stage and not in the provider-reported engine queue or prefill.
Set SLOGATE_CONSOLE_SCREENSHOT=docs/console.png to refresh README's screenshot.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

from openai import AsyncOpenAI
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.ops.server import build_app
from gateway.telemetry.tracing import Tracing
from tests.support.servers import serve_app

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
MODEL = "sim-llama-8b"
STALL_MS = 1500
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def browser() -> webdriver.Chrome:
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1500,1900", "--hide-scrollbars"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # CSP violations land there
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


async def until(check, timeout: float = 20.0, what: str = "condition"):
    """Poll `check` (a blocking call, run off the loop) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await asyncio.to_thread(check)
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def text(driver: webdriver.Chrome, css: str) -> str:
    found = driver.find_elements(By.CSS_SELECTOR, css)
    return found[0].text if found else ""


async def test_console_live_under_load_shows_a_stalled_request_in_the_right_stage(
        tmp_path: Path) -> None:
    assert Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists(), \
        "chromium and chromium-driver come from `make system-deps`"
    sim = build_sim(SimConfig(provider="groq", decode_base_ms=4, served_model_names=[MODEL]))
    async with serve_app(sim) as sim_url:
        cfg = config.parse({
            "auth": {"mode": "open"}, "server": {"access_log": False},
            "slo_classes": [{"name": "interactive", "ttft_ms": 500, "tpot_ms": 50},
                            {"name": "batch", "ttft_ms": 20000, "tpot_ms": 200}],
            "slo": {"default": "interactive"},
            "backends": [{"name": "sim", "base_url": sim_url + "/v1", "models": [MODEL],
                          "forward_headers": ["x-sim-*"]}]},
            env={})
        app = build_app(cfg, tracing=Tracing(cfg.telemetry, exporter=InMemorySpanExporter()))
        async with serve_app(app) as gw:
            driver = await asyncio.to_thread(browser)
            try:
                await run_checks(driver, gw, tmp_path)
            finally:
                await asyncio.to_thread(driver.quit)


async def run_checks(driver: webdriver.Chrome, gw: str, tmp_path: Path) -> None:
    await asyncio.to_thread(driver.get, gw + "/console")
    # Empty state: nothing yet, and it says what to do (with this gateway's URL and model).
    await until(lambda: text(driver, "#conn") == "live", what="the live connection")
    assert text(driver, "#total") == "0"
    empty = text(driver, "#empty")
    assert "No requests yet" in empty and f"{gw}/v1/chat/completions" in empty and MODEL in empty

    client = AsyncOpenAI(base_url=gw + "/v1", api_key="k", max_retries=0)
    stop = asyncio.Event()

    async def worker(i: int) -> None:
        while not stop.is_set():
            stream = await client.chat.completions.create(
                model=MODEL, stream=True, max_tokens=8 + 8 * (i % 3),
                messages=[{"role": "user", "content": f"load {i} " * (20 + 50 * i)}])
            async for _ in stream:
                pass

    load = [asyncio.create_task(worker(i)) for i in range(6)]
    try:
        # Numbers arrive and keep changing while the load runs, without a reload.
        first = int(await until(lambda: text(driver, "#total") if text(driver, "#total")
                                not in ("", "0", "–") else None, what="a first count"))
        await until(lambda: int(text(driver, "#total")) > first + 5, what="the count to grow")
        card = '[data-class="interactive"]'
        ttft = await until(lambda: text(driver, f'{card} [data-metric="ttft_p50"]')
                           not in ("", "–") and text(driver, f'{card} [data-metric="ttft_p50"]'),
                           what="a TTFT p50")
        assert float(ttft) > 0
        assert text(driver, f'{card} [data-metric="goodput"]').endswith("%")
        assert not driver.find_element(By.ID, "empty").is_displayed()
        updates = int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-updates"))
        await until(lambda: int(driver.find_element(By.TAG_NAME, "body")
                                .get_attribute("data-updates")) >= updates + 2,
                    timeout=5, what="two more pushes (at least one a second)")
        assert text(driver, '#backends tr[data-backend="sim"]').startswith("sim")

        # One request stalled on purpose before its first token, in the caller's trace.
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, stream=True, max_tokens=8,
            messages=[{"role": "user", "content": "stalled"}],
            extra_headers={"x-sim-stall-ms": str(STALL_MS),
                           "traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"})
        request_id = raw.headers["x-slogate-request-id"]
        async for _ in raw.parse():
            pass
        row = f'.wf-row[data-request-id="{request_id}"]'
        await until(lambda: driver.find_elements(By.CSS_SELECTOR, row), what="its waterfall row")
        row_el = driver.find_element(By.CSS_SELECTOR, row)
        assert row_el.get_attribute("data-trace-id") == TRACE_ID
        assert request_id in row_el.text and TRACE_ID in row_el.text
        bars = {b.get_attribute("data-stage"): float(b.get_attribute("data-ms"))
                for b in row_el.find_elements(By.CSS_SELECTOR, ".bar")}
        assert bars["first_token"] >= STALL_MS * 0.95, bars
        # The bars are placed through CSSOM (the page's CSP allows no inline style attribute).
        bar = row_el.find_elements(By.CSS_SELECTOR, ".bar")[0]
        assert bar.value_of_css_property("width") not in ("", "0px", "auto")
        assert max(bars, key=bars.get) == "first_token", bars
        # Groq-style timings split the engine's queue and prefill out: the stall is in neither.
        assert bars.get("engine_queue", 0) < 200 and bars.get("prefill", 0) < 200, bars
        assert "decode" in bars and "gateway_queue" in bars, bars
        # The stalled request is the slowest: first in the waterfall.
        top = driver.find_elements(By.CSS_SELECTOR, ".wf-row")[0]
        assert top.get_attribute("data-request-id") == request_id

        # Everything the page loads and does is allowed by its own Content-Security-Policy.
        logs = await asyncio.to_thread(driver.get_log, "browser")
        violations = [e["message"] for e in logs if "Content Security Policy" in e["message"]]
        assert not violations, violations
        shot = Path(os.environ.get("SLOGATE_CONSOLE_SCREENSHOT") or tmp_path / "console.png")
        assert await asyncio.to_thread(driver.save_screenshot, str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        stop.set()
        for t in load:
            t.cancel()
        await asyncio.gather(*load, return_exceptions=True)
        await client.close()
