"""Peak memory of one run's processes, per role and in total, sampled from /proc.

    python -m benchmarks.memory [--out FILE.json] [--sample_s 1] [--run_dir DIR]
        [--min_available_gib G] -- COMMAND [ARG ...]

runs COMMAND (e.g. ``python launch.py --run_dir DIR`` or ``python -m benchmarks.step
--preset peer-small --steps 3 --warmup 1 --no-baseline``) with ``RAY_ADDRESS`` empty (a
local Ray of its own) and a marker in its environment, samples every ``--sample_s`` the
memory of its processes, then prints a table (stderr) and the JSON (stdout's last line, and
``--out``). benchmarks/qwen3_preset_cpu.py uses the same sampler (MemoryWatch).

The run's processes: the command's process tree plus every process whose environment holds
``PPO_RAY_BENCH_RUN=<tag>`` (Ray's workers inherit it from the raylet the command starts, and
keep it when they reparent). Each is named by its role from its process title: Ray sets
``ray::<actor name>:<Class>.<method>`` while an actor runs a call and ``ray::<Class>`` between
calls (ROLE_OF_CLASS: GeneratorHost -> generator, ...), ``ray::<task name>`` for a task (the
SFT / RM stages: ``ppo/sft`` -> stage sft), ``ray::IDLE`` for a pooled worker; the command's
own process is the driver; gcs_server, raylet, the dashboard, the monitors and Ray's agents
are "ray system"; a child of a named process takes its parent's role with " child".

Per process, from ``/proc/<pid>/status`` and ``/proc/<pid>/smaps_rollup`` (kernel counters,
not estimates):

* ``hwm``: VmHWM, the kernel's own peak of the process's resident set (RSS) since it started,
  whatever the sampling period; read at every sample, so the value kept is the one of the
  last sample before the process ended (at most ``--sample_s`` early; the command's own
  process: its peak to the end, from wait4);
* ``pss``: the peak sampled proportional set size (shared pages, such as the object store's
  /dev/shm, mapped safetensors and the shared libraries, divided among the processes that
  map them): the part of the machine's memory the process accounts for;
* ``anon``: the peak sampled RssAnon, the private anonymous pages: the heap and the mmapped
  tensors, the part that glibc malloc's settings (PPOConfig.cpu_malloc_keep) change;
* ``minflt``: its minor page faults at the last sample (/proc/<pid>/stat): each is a page
  touched for the first time, such as one the process gave back and allocated again.

A role's row sums its processes (a restarted actor, the idle workers, Ray's system processes):
``hwm`` the sum of their VmHWM, ``pss`` / ``anon`` the peak of their sampled sum. Totals, per
stage (``--run_dir``: launch.py's run.json names each finished stage) and over the run:
``pss`` / ``rss`` / ``anon`` the peak of the sampled sum over all processes (``pss`` is the
number to set against a node's memory; ``rss`` counts shared pages in every process that maps
them), ``hwm_sum`` the peak over samples of the sum of the live processes' VmHWM (what the
run would hold if every live process sat at its own peak at once: the bound a node must hold
when no process gives memory back), and ``used`` the machine's MemTotal - MemAvailable above
its value before the command (page cache excluded; every other process on the machine
included: on a shared machine read ``pss``).

``--min_available_gib G``: SIGTERM the command (then SIGKILL its session after 120 s) when the
machine's MemAvailable falls below G GiB, before the kernel's OOM killer picks a process on a
shared machine; the JSON then says ``stopped_for_memory``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

MARKER = "PPO_RAY_BENCH_RUN"  # environment variable that tags a run's processes
GIB, MIB = 1024 ** 3, 1024 ** 2

# The actor host classes of ppo_ray.driver.hosts (and the run's ModelStore) -> the role in the table.
ROLE_OF_CLASS = {"GeneratorHost": "generator", "ReferenceHost": "reference", "RewardHost": "reward",
                 "LearnerHost": "learner", "ModelStore": "model store"}
RAY_SYSTEM = "ray system"  # gcs_server, raylet, dashboard, monitors, agents
RAY_SYSTEM_TITLES = ("DashboardAgent", "RuntimeEnvAgent")
RAY_SYSTEM_PROGRAMS = ("gcs_server", "raylet", "dashboard.py", "log_monitor.py", "monitor.py")
IDLE = "ray idle workers"
STAGE_TASK_PREFIX = "ppo/"  # ppo_ray.driver.stage_tasks.run_stage names its tasks ppo/<stage>


def read_text(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:  # the process ended, or is not ours
        return None


def kib_field(text: Optional[str], name: str) -> int:
    """The value in KiB of the line `name` ("VmHWM:") of a /proc status-like text; 0 if absent."""
    for line in (text or "").splitlines():
        if line.startswith(name):
            return int(line.split()[1])
    return 0


def used_bytes() -> int:
    """The machine's MemTotal - MemAvailable."""
    info = read_text("/proc/meminfo")
    return (kib_field(info, "MemTotal:") - kib_field(info, "MemAvailable:")) * 1024


def available_bytes() -> int:
    return kib_field(read_text("/proc/meminfo"), "MemAvailable:") * 1024


def title_role(title: str) -> Optional[str]:
    """The role a process title names, or None when it names none (see the module docstring).

    >>> title_role("ray::ppo-2e9b5f73/generator-0:GeneratorHost.__init__"), title_role("ray::LearnerHost.update")
    ('generator-0', 'learner')
    >>> title_role("ray::ppo/sft"), title_role("ray::IDLE"), title_role("/x/ray/core/src/ray/gcs/gcs_server --a=1")
    ('stage sft', 'ray idle workers', 'ray system')
    >>> title_role("ray::FaultyGeneratorHost"), title_role("ray::Elsewhere.run")
    ('generator', 'Elsewhere')
    """
    words = title.split()
    if not words:
        return None
    if words[0].startswith("ray::"):
        body = words[0][len("ray::"):]
        if body == "IDLE":
            return IDLE
        if body in RAY_SYSTEM_TITLES:
            return RAY_SYSTEM
        name, _, call = body.rpartition(":")
        if name:  # a named actor's call: <run tag>/<role>
            return name.rsplit("/", 1)[-1]
        if call.startswith(STAGE_TASK_PREFIX):
            return "stage " + call[len(STAGE_TASK_PREFIX):]
        cls = call.split(".")[0]
        # a host class, or a subclass named after it (the tests' FaultyGeneratorHost)
        return next((role for host, role in ROLE_OF_CLASS.items() if cls.endswith(host)), cls or None)
    if {Path(w).name for w in words[:4]} & set(RAY_SYSTEM_PROGRAMS):
        return RAY_SYSTEM
    return None


def _rank(role: str) -> int:
    """How much a role says: a process keeps the highest-ranked role it was seen with (a Ray
    worker starts as a child of the raylet, idles, then hosts an actor or runs a task)."""
    if role == RAY_SYSTEM:
        return 1
    if role == IDLE:
        return 2
    return 0 if role.startswith("other: ") or role.endswith(" child") else 3


@dataclass
class ProcessPeak:
    """One process's peaks (bytes) and what named it."""
    pid: int
    role: str
    hwm: int = 0
    pss: int = 0
    anon: int = 0
    last_anon: int = 0
    minflt: int = 0  # minor page faults so far: pages the process touched for the first time
    first_s: float = 0.0
    last_s: float = 0.0
    titles: list = field(default_factory=list)  # the distinct titles seen (a worker's changes per call)


class MemoryWatch:
    """The memory of one run's processes: call sample() every period, then report().

    The run's processes are the descendants of `root` plus every process whose environment
    holds ``MARKER=tag`` (module docstring)."""

    def __init__(self, root: int, tag: Optional[str]):
        self.root = root
        self.needle = f"{MARKER}={tag}".encode() if tag else None
        self.tagged: dict[tuple[int, int], bool] = {}  # (pid, start time) -> carries the marker
        self.procs: dict[tuple[int, int], ProcessPeak] = {}
        self.totals: dict[str, dict[str, int]] = {}  # stage -> peak sums
        self.series: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # key -> [(sample, pss, anon)]
        self.samples = 0
        self.most_processes = 0
        self.base_used = used_bytes()
        self.t0 = time.monotonic()

    def _scan(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(pid, start time) -> (parent pid, minor faults so far), for the run's processes now."""
        parent: dict[int, int] = {}
        start: dict[int, int] = {}
        minflt: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = read_text(f"/proc/{entry}/stat")
                if stat:
                    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) " (man 5 proc)
                    pid = int(entry)
                    parent[pid], minflt[pid], start[pid] = int(fields[1]), int(fields[7]), int(fields[19])
        tree, frontier = {self.root}, [self.root]
        while frontier:
            p = frontier.pop()
            kids = [c for c, pp in parent.items() if pp == p and c not in tree]
            tree.update(kids)
            frontier.extend(kids)
        if self.needle is not None:
            for pid in parent:
                key = (pid, start[pid])
                if key not in self.tagged:
                    try:
                        with open(f"/proc/{pid}/environ", "rb") as f:
                            self.tagged[key] = self.needle in f.read().split(b"\0")
                    except OSError:
                        self.tagged[key] = False
                if self.tagged[key]:
                    tree.add(pid)
        return {(p, start[p]): (parent[p], minflt[p]) for p in tree if p in parent}

    def _role(self, pid: int, title: str, parent: int, roles_now: dict[int, str]) -> str:
        if pid == self.root:
            return "driver"
        named = title_role(title)
        if named is not None:
            return named
        above = roles_now.get(parent)
        if above == RAY_SYSTEM:
            return RAY_SYSTEM
        if above is not None and above != "driver":
            return above.removesuffix(" child") + " child"
        return f"other: {Path(title.split()[0]).name}"

    def sample(self, stage: str = "all") -> dict[str, int]:
        """Read every process of the run once; update the peaks of `stage` and of "all".
        Returns this sample's sums (bytes) and its process count."""
        found = self._scan()
        now = time.monotonic() - self.t0
        sums = {"pss": 0, "rss": 0, "anon": 0, "hwm_sum": 0}
        roles_now: dict[int, str] = {}
        for key in sorted(found, key=lambda k: k[1]):  # by start time: a parent before its children
            pid = key[0]
            status = read_text(f"/proc/{pid}/status")
            rollup = read_text(f"/proc/{pid}/smaps_rollup")
            raw = read_text(f"/proc/{pid}/cmdline")
            if not status or not rollup or not raw:
                continue  # it ended between the scan and the read, or has no memory (a zombie)
            title = " ".join(raw.replace("\0", " ").split())
            role = self._role(pid, title, found[key][0], roles_now)
            peak = self.procs.get(key)
            if peak is None:
                peak = self.procs[key] = ProcessPeak(pid=pid, role=role, first_s=now)
            elif _rank(role) > _rank(peak.role) or (role != peak.role and role.startswith(peak.role)):
                peak.role = role  # a pooled worker that became an actor; generator-0 over generator
            roles_now[pid] = peak.role
            if title not in peak.titles and len(peak.titles) < 8:
                peak.titles.append(title)
            hwm, rss = kib_field(status, "VmHWM:") * 1024, kib_field(rollup, "Rss:") * 1024
            pss, anon = kib_field(rollup, "Pss:") * 1024, kib_field(status, "RssAnon:") * 1024
            peak.hwm, peak.pss, peak.anon = max(peak.hwm, hwm), max(peak.pss, pss), max(peak.anon, anon)
            peak.last_anon, peak.last_s, peak.minflt = anon, now, found[key][1]
            sums["pss"] += pss
            sums["rss"] += rss
            sums["anon"] += anon
            sums["hwm_sum"] += hwm
            self.series.setdefault(key, []).append((self.samples, pss, anon))
        sums["used"] = max(0, used_bytes() - self.base_used)
        for name in {stage, "all"}:
            total = self.totals.setdefault(name, {k: 0 for k in sums})
            for k, v in sums.items():
                total[k] = max(total[k], v)
        self.samples += 1
        self.most_processes = max(self.most_processes, len(roles_now))
        return {**sums, "processes": len(roles_now)}

    def exited(self, pid: int, maxrss: int) -> None:
        """`pid` (a child of the sampling process) exited with peak RSS `maxrss` bytes (wait4's
        ru_maxrss): its VmHWM to the end, where sampling saw it up to the last sample."""
        for key, peak in self.procs.items():
            if key[0] == pid:
                peak.hwm = max(peak.hwm, maxrss)

    def roles(self) -> dict[str, dict]:
        """role -> {processes, hwm_mib, pss_mib, anon_mib, minflt, pids} (module docstring): the
        driver first, the roles by name, then other processes, Ray's own and its idle workers."""
        out: dict[str, dict] = {}
        sums: dict[str, dict[int, list[int]]] = {}  # role -> sample -> [its processes' PSS, RssAnon]
        for key, p in self.procs.items():
            row = out.setdefault(p.role, {"processes": 0, "hwm_mib": 0.0, "minflt": 0, "pids": []})
            row["processes"] += 1
            row["hwm_mib"] += p.hwm / MIB
            row["minflt"] += p.minflt
            row["pids"].append(p.pid)
            for i, pss, anon in self.series.get(key, []):  # under the role the process ended with
                acc = sums.setdefault(p.role, {}).setdefault(i, [0, 0])
                acc[0] += pss
                acc[1] += anon
        for role, row in out.items():
            pss = max((v[0] for v in sums.get(role, {}).values()), default=0)
            anon = max((v[1] for v in sums.get(role, {}).values()), default=0)
            row.update(hwm_mib=round(row["hwm_mib"], 1), pss_mib=round(pss / MIB, 1), anon_mib=round(anon / MIB, 1))
        order = {"driver": 0, RAY_SYSTEM: 90, IDLE: 91}
        return dict(sorted(out.items(), key=lambda kv: (order.get(kv[0], 80 if kv[0].startswith("other: ") else 10),
                                                        kv[0])))

    def report(self) -> dict:
        """The JSON-able result: per role, per process (MiB), and the totals per stage (GiB)."""
        return {"samples": self.samples, "most_processes": self.most_processes, "roles": self.roles(),
                "totals_gib": {stage: {k: round(v / GIB, 2) for k, v in t.items()} for stage, t in self.totals.items()},
                "processes": [{"pid": p.pid, "role": p.role, "titles": p.titles, "hwm_mib": round(p.hwm / MIB, 1),
                               "pss_mib": round(p.pss / MIB, 1), "anon_mib": round(p.anon / MIB, 1),
                               "last_anon_mib": round(p.last_anon / MIB, 1), "minflt": p.minflt,
                               "seen_s": [round(p.first_s, 1), round(p.last_s, 1)]} for p in self.procs.values()]}


def format_table(report: dict) -> str:
    """role -> peak RSS (VmHWM), peak PSS, peak private anonymous; then the totals per stage."""
    rows = [f"{'role':<22} {'procs':>5} {'peak RSS MiB':>13} {'peak PSS MiB':>13} {'peak anon MiB':>14} "
            f"{'minor faults':>13}"]
    for role, r in report["roles"].items():
        rows.append(f"{role:<22} {r['processes']:>5} {r['hwm_mib']:>13.0f} {r['pss_mib']:>13.0f} "
                    f"{r['anon_mib']:>14.0f} {r['minflt']:>13}")
    rows += ["", f"{'total (peak of the sum)':<24} {'PSS GiB':>8} {'RSS GiB':>8} {'anon GiB':>9} {'sum VmHWM GiB':>14}"
                 f" {'used GiB':>9}"]
    for stage, t in report["totals_gib"].items():
        rows.append(f"{stage:<24} {t['pss']:>8.2f} {t['rss']:>8.2f} {t['anon']:>9.2f} {t['hwm_sum']:>14.2f} "
                    f"{t['used']:>9.2f}")
    return "\n".join(rows)


def stage_of_run(run_dir: Path, stages: Sequence[str] = ("sft", "rm", "ppo")) -> Callable[[], str]:
    """A function -> the stage launch.py is in: the first of `stages` that run_dir/run.json
    does not list as done (the last one once all are)."""
    from ppo_ray.driver.rundir import STAGES_DONE

    def current() -> str:
        try:
            done = json.loads(read_text(str(run_dir / "run.json")) or "{}").get(STAGES_DONE, {})  # written atomically
        except ValueError:
            done = {}
        return next((s for s in stages if s not in done), stages[-1])

    return current


def run_command(argv: Sequence[str], *, sample_s: float = 1.0, stage: Optional[Callable[[], str]] = None,
                min_available_gib: Optional[float] = None, timeout_s: Optional[float] = None,
                env: Optional[dict] = None, cwd: Optional[str] = None, stdout=None, stderr=None) -> dict:
    """Run `argv` in a session of its own (this environment plus `env`, RAY_ADDRESS empty
    unless `env` sets it, and the marker), sampling its processes every `sample_s` until it
    exits; `stage()` names the current stage at each sample. Returns {returncode, seconds,
    timed_out, stopped_for_memory, memory: MemoryWatch.report()}. Interrupted here (Ctrl-C),
    it stops the command the way a timeout does."""
    tag = uuid.uuid4().hex
    full_env = {**os.environ, "RAY_ADDRESS": "", **(env or {}), MARKER: tag}
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(argv), env=full_env, cwd=cwd, stdout=stdout, stderr=stderr, start_new_session=True)
    watch = MemoryWatch(proc.pid, tag)
    timed_out = low_memory = False
    stop_at: Optional[float] = None
    try:
        while True:
            watch.sample(stage() if stage else "all")
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:  # it exited: the kernel's own peak RSS of the command's process, to the last page
                proc.returncode = os.waitstatus_to_exitcode(status)
                watch.exited(proc.pid, usage.ru_maxrss * 1024)
                break
            if stop_at is None:
                if timeout_s is not None and time.perf_counter() - t0 > timeout_s:
                    timed_out = True
                elif min_available_gib is not None and available_bytes() < min_available_gib * GIB:
                    low_memory = True
                    print(f"[memory] MemAvailable {available_bytes() / GIB:.2f} GiB < {min_available_gib} GiB: "
                          "stopping the command", file=sys.stderr, flush=True)
                if timed_out or low_memory:
                    proc.send_signal(signal.SIGTERM)  # as `ray job stop` does: launch.py unwinds like Ctrl-C
                    stop_at = time.perf_counter() + 120
            elif time.perf_counter() > stop_at:
                os.killpg(proc.pid, signal.SIGKILL)  # its session: the Ray it started
            time.sleep(sample_s)
    except BaseException:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        raise
    return {"returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 1), "timed_out": timed_out,
            "stopped_for_memory": low_memory, "memory": watch.report()}


def main(argv: Optional[Sequence[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m benchmarks.memory [options] -- COMMAND [ARG ...]")
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--sample_s", type=float, default=1.0, help="sampling period, seconds")
    p.add_argument("--run_dir", default=None, help="launch.py's run directory: totals per stage from its run.json")
    p.add_argument("--min_available_gib", type=float, default=None,
                   help="stop the command when the machine's MemAvailable falls below this")
    p.add_argument("--label", default="", help="a free text kept in the JSON (e.g. the setting measured)")
    args = p.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        p.error("no command after --")
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    result = {"benchmark": "memory", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "label": args.label, "command": " ".join(command), "malloc_env_of_driver": malloc,
              "load_before": [round(x, 2) for x in os.getloadavg()]}
    stage = stage_of_run(Path(args.run_dir)) if args.run_dir else None
    result.update(run_command(command, sample_s=args.sample_s, stage=stage, min_available_gib=args.min_available_gib))
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(format_table(result["memory"]), file=sys.stderr)
    line = json.dumps(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    print(line)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["returncode"] == 0 else 1)
