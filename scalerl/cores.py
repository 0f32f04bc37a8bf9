"""Which CPU cores the processes of `scalerl run` get, so that their torch threads never
outnumber the cores: two busy threads on one core each run at half speed and the learner,
the run's bottleneck on a small machine, waits for a worker's timeslice.

The rule (`plan_cores`), for the n cores this process may use:
- the learner takes half of them (at least one per rank, a whole number per rank), one
  torch thread per core, pinned to the first cores;
- the rollout workers take the rest: one thread each below 4 worker cores, 2 below 16,
  else 4, and as many workers as that fills; they share the worker cores;
- the curve service and Redis (mostly idle) are not pinned.
Explicit `rollout.workers`, `rollout.threads` and `learner.threads` win; workers that then
need more threads than their cores share those cores, never the learner's
(`CorePlan.oversubscribed` says so). On one core everything shares it.

2 cores: learner 1 thread on core 0, one worker with 1 thread on core 1. 4 cores: learner
2, two workers of 1. 16 cores: learner 8, four workers of 2.

With `learner.lend_idle: workers` the learner's cores also get lender workers, planned by
the worker rule over the learner's cores (2 cores: one of 1 thread on core 0; 16 cores:
four of 2 on cores 0-7), which generate only while the learner waits
(`scalerl.lending`): at any time the busy threads are the learner's or the lenders',
never both (`CorePlan.busy_threads`).

Torch-free: the launcher plans, `scalerl_cli.orphan_guard` pins a child to its cores
(`CPUS_ENV`) before it runs, each process sets its torch threads from its config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CPUS_ENV = "SCALERL_CPUS"  # comma-separated CPU ids a launcher child is pinned to
IDLE_ENV = "SCALERL_SCHED_IDLE"  # "1": the launcher child runs at SCHED_IDLE (a lender)


@dataclass(frozen=True)
class CorePlan:
    """Threads and cores of each process. cpus: the machine's usable CPU ids."""

    cpus: tuple[int, ...]
    learner_threads: int  # torch threads of each learner rank
    learner_cpus: tuple[int, ...]
    workers: int
    worker_threads: int
    worker_cpus: tuple[int, ...]  # shared by every worker
    world_size: int = 1
    lenders: int = 0  # lender workers on the learner's cores (`scalerl.lending`)
    lender_threads: int = 0  # torch threads of each

    @property
    def threads(self) -> int:
        """Torch threads of the processes that compute at once (`busy_threads`, the
        larger of its two states)."""
        return max(self.busy_threads(lent=False), self.busy_threads(lent=True))

    def busy_threads(self, lent: bool) -> int:
        """Torch threads computing at once while the learner lends its cores (`lent`: the
        lenders and the workers) or computes (the learner and the workers)."""
        workers = self.workers * self.worker_threads
        if lent:
            return workers + self.lenders * self.lender_threads
        return self.learner_threads * self.world_size + workers

    @property
    def oversubscribed(self) -> bool:
        """True when the planned threads outnumber the cores (explicit values asked it)."""
        return self.threads > len(self.cpus)


def usable_cpus() -> tuple[int, ...]:
    """CPU ids this process may run on (its affinity mask; every CPU where the OS has
    none)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def _default_worker_threads(worker_cores: int) -> int:
    return 1 if worker_cores < 4 else 2 if worker_cores < 16 else 4


def plan_cores(
    cpus: tuple[int, ...],
    world_size: int = 1,
    workers: int = 0,
    worker_threads: int = 0,
    learner_threads: int = 0,
    lend: bool = False,
) -> CorePlan:
    """The plan for `cpus` (usable CPU ids); 0 for workers / worker_threads /
    learner_threads means "by the rule" (module doc); `lend`: lender workers on the
    learner's cores (none on one core, where nothing is left to lend). Raises ValueError
    for no CPU, a world_size < 1 or a negative count."""
    if not cpus:
        raise ValueError("cpus: at least one CPU is needed")
    if world_size < 1 or min(workers, worker_threads, learner_threads) < 0:
        raise ValueError(
            f"world_size must be >= 1 and counts >= 0, got {world_size}, "
            f"{workers}, {worker_threads}, {learner_threads}"
        )
    n = len(cpus)
    if n == 1:
        return CorePlan(
            cpus, learner_threads or 1, cpus, workers or 1, worker_threads or 1, cpus, world_size
        )
    per_rank = learner_threads or max(1, (n // 2) // world_size)
    learner_cores = min(n - 1, per_rank * world_size)  # leave the workers a core
    worker_cpus = cpus[learner_cores:]
    wc = len(worker_cpus)
    if workers and not worker_threads:
        worker_threads = max(1, wc // workers)
    worker_threads = worker_threads or _default_worker_threads(wc)
    workers = workers or max(1, wc // worker_threads)
    lender_threads = _default_worker_threads(learner_cores) if lend else 0
    return CorePlan(
        cpus=cpus,
        learner_threads=per_rank,
        learner_cpus=cpus[:learner_cores],
        workers=workers,
        worker_threads=worker_threads,
        worker_cpus=worker_cpus,
        world_size=world_size,
        lenders=learner_cores // lender_threads if lend else 0,
        lender_threads=lender_threads,
    )


def cpus_env(cpus: tuple[int, ...]) -> dict[str, str]:
    """The environment that pins a launcher child to `cpus` (`pin_from_env`)."""
    return {CPUS_ENV: ",".join(str(c) for c in cpus)}


def pin_from_env(environ: dict[str, str] | None = None) -> tuple[int, ...] | None:
    """Pin this process to the CPUs `SCALERL_CPUS` names (its threads and children
    inherit it); the CPUs pinned, or None when the variable is unset or the OS cannot
    pin. Raises ValueError for a malformed list."""
    value = (os.environ if environ is None else environ).get(CPUS_ENV, "").strip()
    if not value:
        return None
    try:
        cpus = tuple(int(c) for c in value.split(","))
    except ValueError:
        raise ValueError(f"{CPUS_ENV} must be comma-separated CPU ids, got {value!r}") from None
    if not hasattr(os, "sched_setaffinity"):
        return None
    os.sched_setaffinity(0, cpus)
    return cpus


def idle_priority_from_env(environ: dict[str, str] | None = None) -> bool:
    """Put this process at SCHED_IDLE when `SCALERL_SCHED_IDLE` is "1" (a lender worker:
    its threads and children inherit it, and any other thread on its cores runs first).
    True when set; False when unset or the OS has no SCHED_IDLE. Lowering one's own
    priority needs no privilege."""
    if (os.environ if environ is None else environ).get(IDLE_ENV) != "1":
        return False
    if not hasattr(os, "SCHED_IDLE"):
        return False
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    return True


def torch_threads(configured: int) -> int:
    """Torch threads for a process whose config says `configured` (0 = every usable
    core: a process started alone, e.g. in its own container)."""
    return configured or len(usable_cpus())


def planned_config(config, cpus: tuple[int, ...] | None = None):
    """(`config` with rollout.workers, rollout.threads and learner.threads set by the
    plan for `cpus` (default: `usable_cpus()`), the `CorePlan`). Values set in the config
    stay (`plan_cores`)."""
    plan = plan_cores(
        usable_cpus() if cpus is None else cpus,
        world_size=config.learner.world_size,
        workers=config.rollout.workers,
        worker_threads=config.rollout.threads,
        learner_threads=config.learner.threads,
        lend=config.learner.lend_idle == "workers",
    )
    rollout = config.rollout.model_copy(
        update={"workers": plan.workers, "threads": plan.worker_threads}
    )
    learner = config.learner.model_copy(update={"threads": plan.learner_threads})
    return config.model_copy(update={"rollout": rollout, "learner": learner}), plan


def describe(plan: CorePlan) -> str:
    """One line: who runs on which cores."""
    ranks = f"{plan.world_size} ranks x " if plan.world_size > 1 else ""
    line = (
        f"{len(plan.cpus)} cores: learner {ranks}{plan.learner_threads} thread(s) on "
        f"{_span(plan.learner_cpus)}, {plan.workers} rollout worker(s) x "
        f"{plan.worker_threads} thread(s) on {_span(plan.worker_cpus)}"
    )
    if plan.lenders:
        line += (
            f", {plan.lenders} lender worker(s) x {plan.lender_threads} thread(s) on "
            f"{_span(plan.learner_cpus)} while the learner waits"
        )
    if plan.oversubscribed:
        line += f" (oversubscribed: {plan.threads} threads on {len(plan.cpus)} cores)"
    return line


def _span(cpus: tuple[int, ...]) -> str:
    return f"core {cpus[0]}" if len(cpus) == 1 else f"cores {','.join(map(str, cpus))}"
