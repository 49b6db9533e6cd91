"""Model shipping: a model directory on the driver's node made readable by actors and tasks on
other nodes, either through Ray's object store (ShippedModel, held for a run by its ModelStore
actor) or, with model_transfer "path", at the same path after a check on every node
(prepare_models). ppo_ray.transfer holds the bytes-and-cache part, with no Ray.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ppo_ray.driver.cluster import ClusterError
from ppo_ray.config import PPOConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShippedModel:
    """A model directory on the driver's node, readable by actors and tasks on any node: its
    files in Ray's object store (one ObjectRef per file), named by a content digest. A task
    gets the ObjectRefs themselves; an actor gets the name of the run's ModelStore actor
    that holds them instead (`store`), because Ray does not keep an actor's constructor
    arguments alive for its restarts (ray-project/ray#53727): the store does, for the run."""

    path: str                # the directory on the driver's node
    node_id: str             # the driver's node
    digest: str              # ppo_ray.transfer.content_digest
    files: dict              # relative path -> ObjectRef[np.ndarray (uint8)]; {} for an actor
    store: Optional[tuple[str, str]] = None  # (name, namespace) of the ModelStore holding the files


class ModelStore:
    """A run's holder of shipped model files (ObjectRefs, by digest), on the driver's node:
    actors created or restarted on other nodes fetch the references from it."""

    def __init__(self):
        self.models: dict[str, dict] = {}

    def add(self, digest: str, files: dict) -> None:
        self.models[digest] = files  # nested ObjectRefs: borrowed, so kept alive while this actor lives

    def files(self, digest: str) -> dict:
        return self.models[digest]


def ship_model(path: str) -> ShippedModel:
    """Put a local model directory's files into the object store, a file at a time."""
    from ppo_ray.transfer import content_digest, list_files, read_file

    files = {name: ray.put(read_file(path, name)) for name in list_files(path)}
    return ShippedModel(str(path), ray.get_runtime_context().get_node_id(), content_digest(path), files)


def local_model_dir(model: "str | ShippedModel | None") -> "str | None":
    """In an actor or a task: where to load a model from. A hub id or a path is used as it is;
    a ShippedModel is its own path on the driver's node, and elsewhere this node's cache entry
    of its digest, written from the object store on first use (ppo_ray.transfer)."""
    if not isinstance(model, ShippedModel):
        return model
    if ray.get_runtime_context().get_node_id() == model.node_id and os.path.isdir(model.path):
        return model.path
    from ppo_ray.transfer import cached, write_cache_entry

    hit = cached(model.digest)
    if hit is None:
        files = model.files
        if not files:  # an actor: the references are held by the run's ModelStore
            name, namespace = model.store
            files = ray.get(ray.get_actor(name, namespace=namespace).files.remote(model.digest))
        names = list(files)
        t0 = time.perf_counter()
        hit = write_cache_entry(dict(zip(names, ray.get([files[n] for n in names]))), model.digest)
        log.info("model %s (digest %s) received from the driver's node into %s in %.1f s", model.path,
                 model.digest, hit, time.perf_counter() - t0)
    return str(hit)


def _probe_paths(paths: list[str]) -> list[str]:
    """On one node: the paths of `paths` whose config.json this node cannot read."""
    return [p for p in paths if not os.path.isfile(os.path.join(p, "config.json"))]


def group_nodes(pg: PlacementGroup) -> set[str]:
    """Node ids that hold a bundle of the (ready) placement group."""
    table = ray.util.placement_group_table(pg)
    return set(table.get("bundles_to_node_id", {}).values())


def prepare_models(config: PPOConfig, models: dict[str, Optional[str]], nodes: set[str]) -> dict:
    """What the actors / tasks get for each model of `models` (role -> resolved path or hub
    id), given the nodes they will run on. Local directories, when some node is not the
    driver's: with model_transfer "ray" a ShippedModel (one per directory, shared by the roles
    that name it); with "path" the path itself, after a check on every such node that it can
    read it (ClusterError naming the nodes and paths, before any actor starts). Hub ids and
    single-node runs: unchanged."""
    here = ray.get_runtime_context().get_node_id()
    remote = sorted(n for n in nodes if n != here)
    local = sorted({p for p in models.values() if p and os.path.isdir(p)})
    if not remote or not local:
        return dict(models)
    if config.model_transfer == "path":
        probes = [ray.remote(_probe_paths).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            node, soft=False)).remote(local) for node in remote]
        missing = {node: bad for node, bad in zip(remote, ray.get(probes)) if bad}
        if missing:
            where = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
            detail = "; ".join(f"node {where.get(node, '?')} ({node[:8]}) cannot read {', '.join(bad)}"
                               for node, bad in missing.items())
            raise ClusterError(
                "model_transfer: path needs every node that runs an actor or a stage to read the model directories "
                f"at the same path as the driver's node, but {detail}. Mount the run directory's storage at the "
                "same path on every node, or set model_transfer: ray (the files then go through Ray's object store)")
        return dict(models)
    shipped: dict[str, ShippedModel] = {}
    for path in local:
        t0 = time.perf_counter()
        shipped[path] = ship_model(path)
        log.info("model %s: %d files into Ray's object store for the actors on other nodes (%.1f s)", path,
                 len(shipped[path].files), time.perf_counter() - t0)
    return {role: shipped.get(p, p) if p else p for role, p in models.items()}
