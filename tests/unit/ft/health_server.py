"""A real aiohttp server answering SGLang's health routes, for fault-injection tests of the prober.

    python health_server.py --port P [--status 200] [--delay 0] [--unhealthy-for 0]

GET /health and /health_generate answer ``--status`` after ``--delay`` seconds. Tests make it hang
with SIGSTOP and die with SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from aiohttp import web


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--status", type=int, default=200)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--paused", action="store_true", help="503 on /health_generate, 200 on /health (as while paused)")
    p.add_argument("--unhealthy-for", type=float, default=0.0, help="answer 503 for this many seconds (cold start)")
    args = p.parse_args()
    started = time.monotonic()

    async def health(request: web.Request) -> web.Response:
        if args.delay:
            await asyncio.sleep(args.delay)
        if args.paused and request.path == "/health_generate":
            return web.Response(status=503, text="generation is paused")
        if time.monotonic() - started < args.unhealthy_for:
            return web.Response(status=503, text="starting")
        return web.Response(status=args.status, text="ok" if args.status == 200 else "unhealthy")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, handle_signals=True)


if __name__ == "__main__":
    main()
