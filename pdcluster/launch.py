"""Starting and stopping what a cluster needs: embedded Redis, Ray, the named worker actors.

Life of a cluster started by `pdcluster serve`:
1. Redis: the configured URL, or an embedded redis-server this process starts (and stops);
2. Ray: a private local Ray (`ray.address: local`), or join a running one (`auto`, `host:port`);
3. one Ray actor per worker, named `{pool}-{i}` in the configured namespace, sized from the pool's YAML (a TP n
   worker: rank 0 of a placement group of n bundles on one node, which starts the other ranks' actors);
   each loads the model (and `lora.modules`) and answers `info()` when ready. The actors are detached: a router
   that crashes (or is killed) leaves them serving, and a later `serve` re-attaches to a running worker of that
   name (prefix cache and all) once it proves the same cluster token; one that cannot is replaced;
4. while serving, `start_worker(role)` / `stop_worker(name)` add and remove one worker (router/scaling.py drives
   them: `pdcluster scale`);
5. `stop()` closes the workers and kills the actors, TP workers' placement groups removed too (unless
   `ray.keep_workers`), shuts down a Ray it started and stops an embedded Redis.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import time
from typing import Any, cast

from cluster.messages import Role, WorkerInfo
from cluster.prefix_index import PrefixIndex, heartbeat_key
from cluster.process import pin_cpus
from pdcluster import security
from pdcluster.config import ClusterConfig
from pdcluster.config_pool import PoolConfig
from pdcluster.core_plan import CorePlan, plan_cores
from pdcluster.launch_actors import check_resources, check_room, remove_placement, start_actor, worker_spec
from pdcluster.redis_server import EmbeddedRedis, connect
from router.policy import WorkerView
from router.pools import WorkerHandle

log = logging.getLogger(__name__)
WORKER_START_TIMEOUT_S = 600.0


def use_ray_token() -> None:
    """Send this machine's Ray token when joining a cluster (call before importing ray)."""
    # NOTE: Ray 2.60 clusters require a token by default; a connecting driver only sends the token it finds
    # (~/.ray/auth_token, RAY_AUTH_TOKEN[_PATH]) when RAY_AUTH_MODE says so
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH", os.path.expanduser("~/.ray/auth_token"))
    if "RAY_AUTH_MODE" not in os.environ and ("RAY_AUTH_TOKEN" in os.environ or os.path.exists(token_file)):
        os.environ["RAY_AUTH_MODE"] = "token"


WORKER_NICENESS_ENV = "RAY_worker_niceness"  # Ray's own setting of its workers' nice value (15 unless set)


class Cluster:
    """The Redis, Ray and worker actors of one config; `start()` then `handles()`, and `stop()` at the end."""

    def __init__(self, config: ClusterConfig, *, pin_router: bool = False) -> None:
        self.config = config
        # NOTE: `pdcluster serve` keeps its process (the router) and the Ray it starts off the decode workers' cores
        # under `cpu_affinity: auto`; an embedding process (a test, a notebook) keeps its own cores
        self.pin_router = pin_router
        self.core_plan = CorePlan()
        self._own_cores: set[int] | None = None  # this process's cores before the plan pinned it
        self.redis: EmbeddedRedis | None = None
        self.redis_url = config.redis.url
        self.redis_auth = security.redis_auth(config)
        self.cluster_token = security.cluster_token(config)
        self.heartbeat_key = heartbeat_key(self.cluster_token)  # what the router checks heartbeats with
        self.kv_tls = security.kv_tls(config)
        self.actors: dict[str, Any] = {}
        self.infos: dict[str, WorkerInfo] = {}
        self._started_ray = False
        self._attached = False
        self._started = 0  # actors started so far: worker i takes metrics.worker_port + i

    def start(self) -> Cluster:
        if self.config.ray.address != "local":
            use_ray_token()  # NOTE: before ray is imported: it reads RAY_AUTH_MODE once
        import ray

        cfg = self.config
        self.core_plan = plan_cores(cfg)
        if self.pin_router and self.core_plan.router and not ray.is_initialized():
            # NOTE: before Redis and Ray start: their processes inherit the router's cores
            self._own_cores = os.sched_getaffinity(0)
            pin_cpus(self.core_plan.router)
        if self.redis_url is None:
            # NOTE: supervised: restarted on the same port with the same password if it dies
            self.redis = EmbeddedRedis(password=self.redis_auth.password).start().supervise()
            # NOTE: the password (the configured one, or one made for this start) travels in RedisAuth (never
            # printed), not in the URL workers are given
            self.redis_auth = dataclasses.replace(self.redis_auth, password=self.redis.password)
            self.redis_url = f"redis://127.0.0.1:{self.redis.port}/0"
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"namespace": cfg.ray.namespace, "include_dashboard": False,
                                      "log_to_driver": True}
            if cfg.ray.address == "local":
                kwargs["num_cpus"] = cfg.ray.num_cpus
                if WORKER_NICENESS_ENV not in os.environ:
                    # NOTE: Ray starts its workers at nice 15, below the router, Redis and any client (nice 0): on
                    # shared cores those preempted the engines. At 0, as vLLM's processes run; a pool's `nice` still
                    # ranks the pools (raising it needs no privilege). A Ray the user started keeps its own setting.
                    kwargs["_system_config"] = {"worker_niceness": 0}
            ray.init(address=cfg.ray.address, **kwargs)
            self._started_ray = True
        self._check_resources(ray.cluster_resources())
        try:
            for role, pool in cfg.pools().items():
                for i in range(pool.replicas):
                    number = len(self.actors)
                    if not self._adopt(f"{role}-{i}"):
                        self._start_actor(role, i, pool, number)
            names = list(self.actors)
            infos = ray.get([self.actors[n].info.remote() for n in names], timeout=WORKER_START_TIMEOUT_S)
            self.infos = dict(zip(names, infos))
        except BaseException:
            self.stop()
            raise
        log.info("cluster up: %s", ", ".join(self.actors))
        return self

    def _adopt(self, name: str) -> bool:
        """Re-attach to a running worker `name` (a router crashed, or `keep_workers`) if it proves our cluster
        token; kill one that cannot (another cluster's, or dead), so a fresh one can take the name. True: adopted."""
        import ray

        namespace = self.config.ray.namespace
        try:
            actor = ray.get_actor(name, namespace=namespace)
        except ValueError:
            return False
        nonce = secrets.token_bytes(16)
        expected = hmac.new(self.cluster_token.encode(), b"pdcluster attach " + nonce, hashlib.sha256).digest()
        try:
            proof = cast(bytes, ray.get(actor.prove_token.remote(nonce), timeout=60))
        except Exception as e:  # noqa: BLE001 - dead, restarting for good, or an older version: replaced
            proof, why = b"", f"it does not answer ({type(e).__name__})"
        else:
            why = "it was started with another cluster token (security.cluster_token_env)"
        if hmac.compare_digest(proof, expected):
            self.actors[name] = actor
            self._started += 1
            log.warning("re-attached to the running worker %s (its prefix cache is kept)", name)
            return True
        log.warning("a worker named %s is running but %s: replacing it", name, why)
        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # NOTE: the name is free only once Ray has the actor dead
            try:
                ray.get_actor(name, namespace=namespace)
            except ValueError:
                break
            time.sleep(0.2)
        return False

    def attach(self) -> Cluster:
        """Join a cluster another process started (an extra router): find its named actors, ask each for info."""
        use_ray_token()
        import ray

        cfg = self.config
        if self.redis_url is None:
            raise ValueError("redis.url: an extra router needs the cluster's Redis URL (`serve` prints it)")
        if not ray.is_initialized():
            # NOTE: "local" in the YAML means the serving process's private Ray: join it as "auto"
            address = "auto" if cfg.ray.address == "local" else cfg.ray.address
            ray.init(address=address, namespace=cfg.ray.namespace, log_to_driver=False)
            self._started_ray = True  # only this process's connection: shutdown() leaves the cluster running
        names = [f"{role}-{i}" for role, pool in cfg.pools().items() for i in range(pool.replicas)]
        self.actors = {n: ray.get_actor(n, namespace=cfg.ray.namespace) for n in names}
        self.infos = dict(zip(names, ray.get([self.actors[n].info.remote() for n in names], timeout=60)))
        # NOTE: the workers' token may be a random one of the serving process: its heartbeat key comes from a
        # worker, over Ray (whoever can call the actors can run code in them anyway)
        self.heartbeat_key = ray.get(self.actors[names[0]].heartbeat_key.remote(), timeout=60)
        self._attached = True
        return self

    def resolve(self, name: str, current: Any) -> tuple[Any, WorkerInfo, bytes | None] | None:
        """The actor now running under `name` if it is not `current` (a restarted `serve` replaced it): the actor,
        its info and its heartbeat key; None while there is none or it is the same (router/reattach.py)."""
        import ray

        try:
            actor = ray.get_actor(name, namespace=self.config.ray.namespace)
        except ValueError:
            return None
        if current is not None and actor._actor_id == current._actor_id:
            return None
        info = cast(WorkerInfo, ray.get(actor.info.remote(), timeout=30))
        key = cast("bytes | None", ray.get(actor.heartbeat_key.remote(), timeout=30))
        self.actors[name], self.infos[name] = actor, info
        return actor, info, key

    def start_worker(self, role: Role) -> WorkerHandle:
        """One more worker of `role`'s pool while serving, named with the pool's lowest free index; blocks until it
        answers `info` (model loaded, registered with the prefix index)."""
        import ray

        pool = self.config.pools()[role]
        self._check_room(role, pool, ray.available_resources())
        index = next(i for i in range(len(self.actors) + 1) if f"{role}-{i}" not in self.actors)
        name = f"{role}-{index}"
        self._start_actor(role, index, pool, self._started)
        try:
            self.infos[name] = ray.get(self.actors[name].info.remote(), timeout=WORKER_START_TIMEOUT_S)
        except BaseException:
            self.stop_worker(name)
            raise
        log.info("worker started: %s", name)
        info = self.infos[name]
        return WorkerHandle(name, info.role, self.actors[name], info,
                            WorkerView(name, info.num_blocks, info.max_num_seqs))

    # NOTE: the checks live in pdcluster/launch_actors.py; the cluster runs them against its config
    _check_room = staticmethod(check_room)

    def _check_resources(self, available: dict[str, float]) -> None:
        check_resources(self.config, available)

    def stop_worker(self, name: str) -> None:
        """Close one worker (it unregisters from the prefix index) and kill its actor (a TP worker's whole group)."""
        import ray

        actor = self.actors.pop(name, None)
        self.infos.pop(name, None)
        if actor is None:
            return
        try:
            ray.get(actor.close.remote(), timeout=10)
        except Exception as e:  # noqa: BLE001 - a dead or stuck worker is killed anyway
            log.info("closing %s: %s", name, e)
        ray.kill(actor, no_restart=True)
        remove_placement(self.config, name)

    def _start_actor(self, role: Role, index: int, pool: PoolConfig, number: int = 0) -> None:
        cfg = self.config
        self._started += 1
        spec = worker_spec(cfg, role, index, pool, number, redis_url=self.redis_url, redis_auth=self.redis_auth,
                           cluster_token=self.cluster_token, kv_tls=self.kv_tls,
                           cpus=self.core_plan.cores(cfg, role, index))
        self.actors[spec.name] = start_actor(cfg, pool, spec)

    @property
    def attached(self) -> bool:
        """Whether this process joined workers another one started (an extra router)."""
        return self._attached

    @property
    def started_ray(self) -> bool:
        return self._started_ray and not self._attached

    @property
    def ray_address(self) -> str:
        """The GCS address of the Ray this cluster runs in (host:port)."""
        import ray

        return str(ray.get_runtime_context().gcs_address)

    def index(self) -> PrefixIndex:
        assert self.redis_url is not None
        return PrefixIndex(connect(self.redis_url, self.redis_auth), self.config.redis.key_prefix,
                           signing_key=self.heartbeat_key)

    def handles(self) -> list[WorkerHandle]:
        """One WorkerHandle per worker (fresh load views) for a Router."""
        return [WorkerHandle(n, info.role, self.actors[n], info, WorkerView(n, info.num_blocks, info.max_num_seqs))
                for n, info in self.infos.items()]

    def stop(self) -> None:
        """Close the workers, kill the actors, stop what this cluster started; safe to call twice."""
        import ray

        if ray.is_initialized() and self.actors and not self._attached and self.config.ray.keep_workers:
            log.warning("leaving the workers running (ray.keep_workers): %s", ", ".join(self.actors))
        elif ray.is_initialized() and self.actors and not self._attached:
            closing = [a.close.remote() for a in self.actors.values()]
            try:
                ray.get(closing, timeout=10)
            except Exception as e:  # noqa: BLE001 - a dead or stuck worker is killed below anyway
                log.info("closing workers: %s", e)
            for name, a in self.actors.items():
                ray.kill(a, no_restart=True)
                remove_placement(self.config, name)
        self.actors.clear()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._own_cores is not None:
            pin_cpus(tuple(self._own_cores))
            self._own_cores = None
