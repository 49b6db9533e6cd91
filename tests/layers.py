"""The product's layers, top to bottom: one definition for tests/test_layers.py (which imports
each layer may make) and tests/test_architecture_doc.py (docs/ARCHITECTURE.md lists them, and
each module under its own layer). Paths and module names only: nothing is imported.

    tasks (top)   ppo_ray/tasks/, ppo_ray/tldr_model.py, launch.py
    driver        ppo_ray/driver/ (the rollout pipeline, the sync guard, the actors' calls and hosts,
                  supervision, the cluster, checkpoints, the run directory, the step's numbers), and
                  ppo_ray/trainer.py and ppo_ray/placement.py at the package's top (the seeds' API; the
                  old home of the Ray plumbing); of these only driver/hosts and driver/stage_tasks import the roles
    roles         actors/, learner/          (plain classes: no Ray, no driver)
    bottom        every other ppo_ray/*.py   (the shared vocabulary)
    math          learner/algos.py, learner/losses.py (the PPO math and its registries)
"""

from __future__ import annotations


# The layers' names, top to bottom, as docs/ARCHITECTURE.md heads them.
LAYERS = ("tasks", "driver", "roles", "bottom", "math")

# The driver's modules at the package's top (the rest of the driver is ppo_ray/driver/).
DRIVER_TOP = {"trainer", "placement"}
# The driver's modules that import the roles (actors/, learner/): the actor hosts and the stages' Ray tasks.
ROLE_IMPORTERS = {"ppo_ray/driver/hosts.py", "ppo_ray/driver/stage_tasks.py"}
TOP_FILES = {"ppo_ray/tldr_model.py", "launch.py"}
ROLE_PACKAGES = ("actors", "learner")
MATH = {"learner.algos", "learner.losses"}


def layer_of_file(rel: str) -> str:
    """The layer of a source file, by its path relative to the repository root: "top", "driver",
    "bottom", "math", or the role package ("actors", "learner")."""
    if rel.removesuffix(".py").replace("/", ".") in MATH:
        return "math"
    if rel in TOP_FILES or rel.startswith("ppo_ray/tasks/"):
        return "top"
    if rel.split("/")[0] in ROLE_PACKAGES:
        return rel.split("/")[0]
    if rel.startswith("ppo_ray/driver/") or rel in {f"ppo_ray/{m}.py" for m in DRIVER_TOP}:
        return "driver"
    if rel.startswith("ppo_ray/"):
        return "bottom"
    raise ValueError(rel)


def layer_of_module(name: str) -> str | None:
    """The layer of an imported module (a dotted name), None for one outside the project."""
    parts = name.split(".")
    if ".".join(parts[:2]) in MATH:
        return "math"
    if parts[0] in ROLE_PACKAGES:
        return parts[0]
    if parts[0] == "launch":
        return "top"
    if parts[0] != "ppo_ray" or len(parts) == 1:
        return None
    if parts[1] in ("tasks", "tldr_model"):
        return "top"
    return "driver" if parts[1] == "driver" or parts[1] in DRIVER_TOP else "bottom"


def layer_name(rel: str) -> str:
    """The name of a source file's layer in LAYERS (the top is "tasks", actors/ and learner/ are
    the "roles")."""
    layer = layer_of_file(rel)
    return {"top": "tasks", **{pkg: "roles" for pkg in ROLE_PACKAGES}}.get(layer, layer)
