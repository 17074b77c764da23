"""`pdcluster serve` and `pdcluster demo`: start a cluster from YAML and put the router's gRPC server in front.

Life of `serve`:
1. load and validate the YAML (errors name the field and the line);
2. start the cluster (embedded Redis, Ray, the worker actors) and the router's gRPC server;
3. print `pdcluster ready: grpc=HOST:PORT` once requests can be taken;
4. on SIGINT or SIGTERM: stop taking requests, let running ones finish for a moment, and stop everything started.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

from cluster import tracing
from engine import grammar
from pdcluster import event_loop, security
from pdcluster.config import ClusterConfig
from pdcluster.launch import Cluster
from router.core import Router
from router.metrics import RouterMetrics
from router.scaling import PoolScaler
from router.service import start_server

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 2.0


def make_router(cluster: Cluster) -> Router:
    """A router over the cluster's workers, sharing state with any other router through Redis.

    Its metrics carry the served model's name (`model_name`, as vLLM's); its spans go where `tracing` says.
    """
    cfg = cluster.config
    tracing.configure(cfg.tracing.settings(), "router")
    index, metrics = cluster.index(), RouterMetrics(model_name=cfg.served_model_name)
    index.breaker.client_name = "router"
    metrics.registry.register(index.breaker)  # NOTE: pdcluster_redis_breaker_open and the error counts by kind
    router = Router(cluster.handles(), index,
                    cfg.router.router_settings(cfg.model, cfg.mode, cfg.transfer.transport), metrics)
    router.adapters.sources.update(cfg.lora.modules)  # NOTE: an unload refused by one worker is undone from these
    router.adapters.base_names.update({cfg.model, cfg.served_model_name})  # NOTE: gRPC takes either for the base
    return router


def run(config: ClusterConfig, body: Callable[[str], Awaitable[None]] | None = None, *, attach: bool = False) -> int:
    """Start the cluster (or `attach` to a running one: an extra router) and the router; run `body(address)`
    (the demo) or serve until SIGINT/SIGTERM."""
    security.check_exposure(config)  # NOTE: before anything starts: a refusal costs no Ray or worker start
    loop_name = event_loop.resolve(config.router.event_loop)  # NOTE: "uvloop" without it: refused before starting
    missing = config.lora.missing_files() if config.ray.address == "local" and not attach else []
    if missing:  # NOTE: a private Ray's workers run here: their adapters must be here too
        raise security.SetupError("; ".join(missing))
    cluster = Cluster(config, pin_router=True)
    # NOTE: the library of the router's grammar checks (tools, response formats) pulls in torch and transformers:
    # 1-3 s of CPU that holds the GIL. Imported while the workers start (the router mostly waits for them then),
    # and waited for before the router serves: imported after "ready", it slowed the first requests' way through
    # the router by ~5-10 ms each for those seconds (`pdcluster bench path`: the first front measured).
    importing = grammar.preload()
    stop_requested = False

    def on_signal(signum: int, frame: object) -> None:  # before the event loop runs: unwind through finally
        nonlocal stop_requested
        stop_requested = True
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster.attach() if attach else cluster.start()
        importing.join()
        if not stop_requested:
            log.info("router event loop: %s (router.event_loop: %s)", loop_name, config.router.event_loop)
            event_loop.run(_serve(cluster, body), loop_name)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        for s in previous:
            signal.signal(s, signal.SIG_IGN)  # NOTE: a second signal must not interrupt the cleanup
        cluster.stop()
        print("pdcluster stopped", file=sys.stderr, flush=True)


async def _serve(cluster: Cluster, body: Callable[[str], Awaitable[None]] | None) -> None:
    cfg = cluster.config
    router = make_router(cluster)
    # NOTE: /live answers 503 (restart this process) once the embedded Redis cannot be restarted
    router.fatal_checks.append(lambda: cluster.redis.failure if cluster.redis is not None else None)
    keys, tls = security.api_keys(cfg), security.ssl_context(cfg)
    open_ok = cfg.security.allow_unauthenticated
    # NOTE: an extra router (attached) follows lost workers too, but only the process that started the workers
    # may start and stop them
    scaler = PoolScaler(router, None if cluster.attached else cluster)
    if cluster.attached:  # NOTE: a restarted `serve` may replace the workers: follow them by name
        from router.reattach import Reattacher

        router.pinger.listen(Reattacher(router.pools, cluster.resolve, router.index).on_pings)
    server, port = await start_server(router, cfg.router.host, cfg.router.port, api_keys=keys,
                                      credentials=security.grpc_credentials(cfg), allow_unauthenticated=open_ok,
                                      scaler=scaler, admin_keys=security.admin_api_keys(cfg))
    autoscaler = None
    if cfg.autoscaler.enabled and cluster.attached:
        log.warning("autoscaler.enabled: this router joined workers another process started; that process runs "
                    "the autoscaler (only the process that starts workers resizes pools)")
    elif cfg.autoscaler.enabled:
        from pdcluster.autoscale_loop import AutoscaleLoop

        autoscaler = AutoscaleLoop(cfg, router, scaler)  # NOTE: only the process that starts workers resizes pools
        autoscaler.start()
    endpoints = {"grpc": f"{cfg.router.host}:{port}"}
    runners = []
    try:
        if cfg.http.enabled:
            from router.openai_api import start_http

            runner, http_port = await start_http(router, host=cfg.http.host, port=cfg.http.port, api_keys=keys,
                                                 admin_keys=security.admin_api_keys(cfg),
                                                 model_name=cfg.served_model_name, ssl_context=tls,
                                                 allow_unauthenticated=open_ok)
            runners.append(runner)
            endpoints["http"] = f"{cfg.http.host}:{http_port}"
        if cfg.metrics.enabled:
            from router.metrics_http import start_metrics_server

            runner, metrics_port = await start_metrics_server(router.metrics, cfg.metrics.host, cfg.metrics.port, tls)
            runners.append(runner)
            endpoints["metrics"] = f"{cfg.metrics.host}:{metrics_port}"
        if body is not None:
            await body(endpoints["grpc"])
            return
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, stop.set)
        # NOTE: what an extra router (`pdcluster router`) needs to join: the private Ray and the embedded Redis
        if cluster.started_ray:
            endpoints["ray"] = cluster.ray_address
        if cluster.redis:
            endpoints["redis"] = f"127.0.0.1:{cluster.redis.port}"
        print("pdcluster ready: " + " ".join(f"{k}={v}" for k, v in endpoints.items()), flush=True)
        await stop.wait()
        print("pdcluster stopping ...", file=sys.stderr, flush=True)
    finally:
        await server.stop(grace=SHUTDOWN_GRACE_S)
        for runner in runners:
            await runner.cleanup()
        if autoscaler is not None:
            await autoscaler.close()
        await scaler.close()
        await router.close()
        tracing.shutdown()
