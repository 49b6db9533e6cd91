"""The Ray cluster: connecting to it (init_ray, after a fast check of RAY_ADDRESS), keeping the
actors' own log lines off the driver's console, and reading what its nodes have (the resource
helpers that the capacity checks and the reward-worker pool name in their errors).

Part of the driver's Ray plumbing (ppo_ray.placement re-exports every old name): the cluster
here, model shipping in ppo_ray.driver.shipping, the actor hosts in ppo_ray.driver.hosts, the reward
workers in ppo_ray.driver.reward_pool, bundles and actor creation in ppo_ray.driver.creation, the SFT / RM
stages as Ray tasks in ppo_ray.driver.stage_tasks; the driver's calls to running actors are
ppo_ray.driver.roles.Roles' methods.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import ray

from ppo_ray.logs import ACTOR_MARK, level_number, log_off_console, ray_logging_level, without_actor_lines

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The Ray cluster cannot be reached or cannot host the requested actors."""


def init_ray(address: str | None = None, connect_timeout_s: float = 5.0, log_level: str = "info",
             metrics_report_interval_ms: int | None = None) -> None:
    """Attach to RAY_ADDRESS (or `address`) when set, else start a local Ray.

    `log_level` (config.log_level): Ray's own driver-side messages only at debug; one line
    of ours names the cluster, its dashboard and the metrics export interval.
    `metrics_report_interval_ms` (config.metrics_report_interval_ms): how often this
    process's metrics reach the node's Prometheus endpoint, set through Ray's
    RAY_metrics_report_interval_ms before ray.init (a local Ray started here inherits it);
    None leaves Ray's (10 s by default).
    The local default binds the dashboard to 127.0.0.1 only. Under `ray job submit` Ray
    sets RAY_ADDRESS for the entrypoint, so the same call attaches to the cluster. An
    address where nothing listens is a ClusterError naming it within `connect_timeout_s`
    (check_ray_address): ray.init itself retries such an address for minutes (measured:
    still waiting after 300 s for a closed port on 127.0.0.1, Ray 2.60).
    """
    if ray.is_initialized():
        keep_actor_lines_off_the_console(log_level)
        return
    if metrics_report_interval_ms is not None:
        os.environ["RAY_metrics_report_interval_ms"] = str(int(metrics_report_interval_ms))
    address = address or os.environ.get("RAY_ADDRESS") or None
    quiet = ray_logging_level(log_level)
    # ray.init replaces the process's SIGTERM handler with its own (sys.exit(15), after the core
    # worker prints a stack): a handler the caller installed is put back afterwards, SIGINT's
    # too (Ray 2.60 leaves it), so that launch.py's (ppo_ray.driver.interrupts: Ctrl-C and `ray job
    # stop` unwind: exit 130, actors shut down) still runs
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if address:
        check_ray_address(address, connect_timeout_s)
        try:
            context = ray.init(address=address, log_to_driver=True, logging_level=quiet)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ClusterError(f"cannot connect to the Ray cluster at RAY_ADDRESS={address!r}: {e}") from e
    else:
        context = ray.init(dashboard_host="127.0.0.1", log_to_driver=True, logging_level=quiet)
    if threading.current_thread() is threading.main_thread():
        for s, handler in handlers.items():
            if callable(handler) and signal.getsignal(s) is not handler:
                signal.signal(s, handler)
    keep_actor_lines_off_the_console(log_level)
    dashboard = getattr(context, "dashboard_url", None)
    log.info("Ray %s: %s%s; metrics exported every %s", ray.__version__,
             f"cluster at {address}" if address else "a local instance",
             f", dashboard http://{dashboard}" if dashboard else "", _metrics_interval())


def _metrics_interval() -> str:
    """The export interval this process's Ray runs with, as read back from Ray ("?" where it
    cannot be read)."""
    try:
        return f"{max(int(ray._config.metrics_report_interval_ms()), 1000) / 1000:g} s"
    except Exception:  # a Ray without ray._config
        return "?"


def keep_actor_lines_off_the_console(log_level: str = "info") -> None:
    """Ray forwards every line an actor writes to the driver, which prints it; the actors'
    own line per call (ppo_ray.logs.actor_logger) is for their logs (the dashboard's
    Actors page), so the driver leaves those lines out of what it prints (they go to the
    launch log: logs.log_off_console), and its console stays one line per step. At `debug`
    they are printed too. Uses Ray's stream dispatcher (Ray
    2.60's ray._private.ray_logging): where a Ray version has none, the lines are printed,
    nothing else changes. Idempotent."""
    if level_number(log_level) <= logging.DEBUG:
        return
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return
    handlers = getattr(dispatcher, "handlers", None)
    if not isinstance(handlers, list):
        return

    def filtered(handle):
        def handler(data):
            lines = data.get("lines") if isinstance(data, dict) else None
            if lines is None:
                return handle(data)
            kept = without_actor_lines(lines)
            if len(kept) < len(lines):
                log_off_console(data, [line for line in lines if ACTOR_MARK in line])
            if kept:
                handle(data if len(kept) == len(lines) else {**data, "lines": kept})
        handler._ppo_ray = True  # type: ignore[attr-defined]
        return handler

    # one assignment: emit() iterates the list it read under its lock
    dispatcher.handlers = [(name, h if name != "ray_print_logs" or getattr(h, "_ppo_ray", False) else filtered(h))
                           for name, h in handlers]


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """ClusterError, naming the address, unless something accepts a TCP connection at the
    host:port of a Ray address ("host:port" or "ray://host:port"). "auto" and "local" are
    left to ray.init (it finds the local cluster or says there is none). An http(s):// address
    is the dashboard's (for `ray job submit`), not one ray.init can attach to. Only that a
    port is open is checked: a port held by something that is not Ray is not caught here."""
    import socket
    from urllib.parse import urlsplit

    if address in ("auto", "local"):
        return
    if address.startswith(("http://", "https://")):
        raise ClusterError(
            f"RAY_ADDRESS={address!r} is a dashboard / job-submission address; ray.init needs the cluster's "
            "address (host:6379 or ray://host:10001). To run on that cluster use deploy/submit.sh "
            "(ray job submit), which sets RAY_ADDRESS for the job itself")
    client = address.startswith("ray://")
    parts = urlsplit(address if client else f"//{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as e:  # a port that is not a number
        raise ClusterError(f"RAY_ADDRESS={address!r} is not a host:port address: {e}") from e
    if client and port is None:
        port = 10001  # the Ray client server's default port
    if not host or port is None:
        raise ClusterError(f"RAY_ADDRESS={address!r} is not a host:port address (e.g. 10.0.0.1:6379)")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:  # refused, unreachable, no such host, or no answer within timeout_s
        raise ClusterError(
            f"no Ray cluster at RAY_ADDRESS={address!r}: cannot connect to {host}:{port} ({e or 'timed out'}); "
            "start one there (ray start --head) or unset RAY_ADDRESS to start a local Ray") from e


# ----------------------------------------------------------------------------- what the nodes have
def user_resources(resources: dict[str, float]) -> dict[str, float]:
    """CPU, GPU and custom resources; Ray's own bookkeeping (node:<ip>, memory, the
    CPU_group_<pg>... resources that placement groups create) left out."""
    return {k: v for k, v in resources.items()
            if not k.startswith("node:") and k not in ("memory", "object_store_memory") and "_group_" not in k}


def alive_nodes() -> list[tuple[str, dict[str, float]]]:
    """(ip and short node id, total CPU/GPU/custom resources) of every alive node."""
    return [(f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})", user_resources(n["Resources"]))
            for n in ray.nodes() if n.get("Alive")]


def format_resources(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"
