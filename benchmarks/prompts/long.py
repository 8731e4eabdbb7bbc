"""A small task scheduler: jobs with dependencies, priorities and retry budgets."""

import heapq
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field


class CycleError(ValueError):
    """Raised when the dependency graph of the submitted jobs has a cycle."""


@dataclass(order=True)
class Job:
    priority: int
    name: str = field(compare=False)
    action: object = field(compare=False, default=None)
    depends_on: tuple = field(compare=False, default=())
    retries: int = field(compare=False, default=0)


@dataclass
class Outcome:
    name: str
    ok: bool
    attempts: int
    seconds: float
    error: str = ""


def topological_order(jobs):
    """Return job names so that every job comes after the jobs it depends on."""
    indegree = {job.name: 0 for job in jobs}
    children = defaultdict(list)
    for job in jobs:
        for parent in job.depends_on:
            if parent not in indegree:
                raise KeyError(f"job {job.name!r} depends on unknown job {parent!r}")
            children[parent].append(job.name)
            indegree[job.name] += 1
    ready = deque(name for name, degree in indegree.items() if degree == 0)
    order = []
    while ready:
        name = ready.popleft()
        order.append(name)
        for child in children[name]:
            indegree[child] -= 1
            if indegree[child] == 0:
                ready.append(child)
    if len(order) != len(indegree):
        stuck = sorted(name for name, degree in indegree.items() if degree > 0)
        raise CycleError(f"dependency cycle among {stuck}")
    return order


class Scheduler:
    """Runs jobs whose dependencies succeeded, highest priority first."""

    def __init__(self, clock=time.monotonic, sleep=time.sleep):
        self._jobs = {}
        self._clock = clock
        self._sleep = sleep
        self.outcomes = {}

    def _attempt(self, job):
        start = self._clock()
        try:
            job.action()
        except Exception as exc:  # a failing job must not stop the others
            return False, self._clock() - start, f"{type(exc).__name__}: {exc}"
        elapsed = self._clock() - start
        return True, elapsed, ""

    def _run_one(self, job):
        attempts, total, error = 0, 0.0, ""
        while attempts <= job.retries:
            attempts += 1
            ok, seconds, error = self._attempt(job)
            total += seconds
            if ok:
                return Outcome(job.name, True, attempts, total)
            self._sleep(min(2.0 ** (attempts - 1) * 0.01, 1.0))
        return Outcome(job.name, False, attempts, total, error)

    def run(self):
        """Run every submitted job once its parents succeeded; skip the rest."""
        topological_order(self._jobs.values())  # raises on cycles and unknown parents
        waiting = {name: set(job.depends_on) for name, job in self._jobs.items()}
        heap = [job for job in self._jobs.values() if not job.depends_on]
        heapq.heapify(heap)
        done = set()
        while heap:
            job = heapq.heappop(heap)
            outcome = self._run_one(job)
            self.outcomes[job.name] = outcome
            if not outcome.ok:
                continue
            done.add(job.name)
            for name, parents in waiting.items():
                if name in done or name in self.outcomes:
                    continue
                if job.name in parents and parents <= done:
                    heapq.heappush(heap, self._jobs[name])
        for name in self._jobs:
            if name not in self.outcomes:
                failed = sorted(p for p in waiting[name] if p not in done)
                reason = f"skipped: parent(s) {failed} did not succeed"
                self.outcomes[name] = Outcome(name, False, 0, 0.0, reason)
        return self.outcomes

    def summary(self):
        """One line per job, failures first, then by name."""
