"""The built-in live console: `GET /console` in a browser, no Grafana needed.

`ConsoleRecorder` keeps a bounded window of finished requests (fed by `Finisher.finish`);
`Console` serves the page (assets in `static/`, shipped in the package: no build step, no CDN)
and pushes a snapshot once a second over SSE.
"""
from gateway.console.recorder import ConsoleRecorder, stages
from gateway.console.web import Console, Live, live_state

__all__ = ["Console", "ConsoleRecorder", "Live", "live_state", "stages"]
