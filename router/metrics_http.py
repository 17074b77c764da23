"""The small HTTP server that exposes a router's metrics (router/metrics.py) at GET /metrics: the Prometheus text
format, or OpenMetrics (which shows the exemplars) when the scraper asks for it."""

from __future__ import annotations

import ssl

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics import exposition as openmetrics

from router.metrics import RouterMetrics


async def start_metrics_server(metrics: RouterMetrics, host: str, port: int,
                               ssl_context: ssl.SSLContext | None = None) -> tuple[web.AppRunner, int]:
    """Serve GET /metrics on host:port (0 = a free port); returns the runner (call `cleanup()`) and the bound port."""

    async def handle(request: web.Request) -> web.Response:
        # NOTE: set the header whole: aiohttp's `content_type=` argument refuses a value with parameters.
        if "application/openmetrics-text" in request.headers.get("Accept", ""):
            return web.Response(body=metrics.render(True), headers={"Content-Type": openmetrics.CONTENT_TYPE_LATEST})
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1]
    return runner, int(bound)
