"""Replaying a workload through the real scheduler in virtual time: what-if answers for policies.

``Replay`` drives the same decide phase a live cycle runs — the same profile, the same plugins,
the same cache bookkeeping (``assume``, releases, learned run-time ratios, nominations) — over a
simulated fleet held in memory, with a virtual clock: jobs arrive at their submission times,
run for their run times (never past their limits), and a preempted job stops at the end of its
grace period and waits again. No database, no adapters, no agents, so an hour of fleet time
takes seconds.

A cycle runs whenever something happened (an arrival, an end), at most one per
``cycle_s`` of virtual time, as the live scheduler's wake-ups do, and every ``idle_s`` while
jobs wait (the live scheduler's beat). Utilisation is measured after a warm-up (the first
``warmup`` of the trace's span), once the fleet has filled.

It reports what an operator compares policies by: GPU utilisation, waits by job size, the
wait of given jobs (a big gang), preemptions and the GPU-time they threw away, how far predicted
starts were from actual ones, and when a queue got its lent quota back.

A fleet may also say what energy and placement cost (``Fleet``): per model its TDP and relative
throughput (a job's run time is its trace run time ÷ the throughput of the model it lands on),
per cluster its energy price and carbon intensity, and hot spots — nodes whose telemetry reads
hot, where jobs run ``hot_slowdown`` × slower. Then the figures add the energy the fleet's GPUs
drew (busy at TDP, idle at ``idle_power`` × TDP, nothing on a node with no allocation when
``sleep_idle_nodes``), idle-node hours, the work completed (GPU-hours at a throughput of 1.0)
and energy, cost and CO₂ per completed GPU-hour.

    trace = synthetic_trace(Fleet(), hours=2, seed=1)
    result = Replay(Fleet(), profile, policies={...}).run(trace)
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle.decide import decide
from scheduling.engine.framework import ANY_MODEL, NEVER, NO_GPU, JobView, Placement
from scheduling.engine.policies import DEFAULT_PROFILE, Profile, build_profile
from scheduling.engine.queue import PendingQueue
from scheduling.engine.snapshot import QuotaBook, Snapshot

SIZE_CLASSES = ("1gpu", "2-8gpu", "multinode")


@dataclass(frozen=True)
class Fleet:
    """A simulated fleet: ``clusters`` × ``nodes`` nodes of ``gpus`` GPUs; node models alternate
    over ``models`` within each cluster.

    Energy (all optional; left out, run times are the trace's and no energy is counted):
    ``tdp_watts`` and ``throughput`` per model (relative to an A100-80G, as the catalog's
    ``relative_throughput``), ``price`` (per kWh) and ``carbon`` (g CO₂ per kWh) per cluster.
    A GPU draws its TDP while allocated and ``idle_power`` × TDP otherwise; with
    ``sleep_idle_nodes`` a node with nothing allocated draws nothing (power saving, at once —
    an upper bound on what sleeping idle nodes saves).

    Hot spots: ``hot`` of the nodes (a share, picked at random with ``seed``) read hot in their
    telemetry — GPUs at 92 °C, 95 % busy, 90 % of memory in use — and every other node reads
    cool (55 °C, 30 %, 30 %). The readings are static (a cooling fault, not the scheduler's own
    load) and fresh at every cycle. A job with a node on a hot spot runs ``hot_slowdown`` × its
    run time there (its GPUs throttle); a run that then passes its time limit is cut there and
    its work is lost."""

    clusters: tuple[str, ...] = ("sim-a", "sim-b")
    nodes: int = 64
    gpus: int = 8
    models: tuple[str, ...] = ("h100-80g", "a100-80g")
    tdp_watts: tuple[float, ...] = ()
    throughput: tuple[float, ...] = ()
    idle_power: float = 0.15
    sleep_idle_nodes: bool = False
    price: tuple[float, ...] = ()
    carbon: tuple[float, ...] = ()
    hot: float = 0.0
    hot_slowdown: float = 1.5
    seed: int = 1

    @property
    def total_gpus(self) -> int:
        return len(self.clusters) * self.nodes * self.gpus

    @property
    def rows(self) -> int:
        return len(self.clusters) * self.nodes

    def hot_rows(self) -> np.ndarray:
        """A bool per row: a hot spot."""
        hot = np.zeros(self.rows, dtype=bool)
        hot[random.Random(self.seed).sample(range(self.rows), round(self.hot * self.rows))] = True
        return hot

    def speed(self, model: int) -> float:
        """Relative throughput of ``model`` (1.0 when the fleet does not say)."""
        return self.throughput[model] if self.throughput else 1.0

    def snapshot(self) -> Snapshot:
        n = len(self.clusters) * self.nodes
        full = (1 << self.gpus) - 1
        snap = Snapshot(
            node_id=np.arange(1, n + 1, dtype=np.int64),
            cluster=np.repeat(np.arange(len(self.clusters), dtype=np.int32), self.nodes),
            model=np.array([i % len(self.models) for i in range(n)], dtype=np.int32),
            ready=np.ones(n, dtype=bool),
            gpu_total=np.full(n, self.gpus, dtype=np.int32),
            gpu_free=np.full(n, self.gpus, dtype=np.int32),
            free_bits=np.full(n, full, dtype=np.uint64),
            cpu_free=np.full(n, 256_000, dtype=np.int64),
            mem_free=np.full(n, 2**41, dtype=np.int64),
            cluster_ids=list(range(1, len(self.clusters) + 1)),
            cluster_names=list(self.clusters),
            model_ids=list(range(1, len(self.models) + 1)),
            model_names=list(self.models),
            gpu_ids=[{i: r * 64 + i for i in range(self.gpus)} for r in range(n)],
            groups=[{} for _ in range(n)],
            labels=[{} for _ in range(n)],
            names=[f"{self.clusters[r // self.nodes]}-n{r % self.nodes:03d}" for r in range(n)],
        )
        if self.tdp_watts:
            per_watt = np.array([self.speed(m) / w for m, w in enumerate(self.tdp_watts)], dtype=np.float32)
            snap.perf_per_watt = per_watt[snap.model]
        if self.price:
            snap.price = np.array(self.price, dtype=np.float32)[snap.cluster]
        if self.carbon:
            snap.carbon = np.array(self.carbon, dtype=np.float32)[snap.cluster]
        if self.hot:
            hot = self.hot_rows()
            snap.util = np.where(hot, 95.0, 30.0).astype(np.float32)
            snap.mem_used = np.where(hot, 0.9, 0.3).astype(np.float32)
            snap.temp = np.where(hot, 92.0, 55.0).astype(np.float32)
        return snap


@dataclass(frozen=True)
class QueueSpec:
    """A queue of the replay: priority, project, cohort, nominal quota per model index (empty:
    unlimited) and its preemption rules."""

    id: int
    priority: int = 0
    project: int = 1
    cohort: str = ""
    quota: dict[int, int] = field(default_factory=dict)
    within: str = "never"
    reclaim: str = "never"
    grace_s: int = 30


@dataclass(frozen=True)
class TraceJob:
    id: int
    submit: float
    queue: int
    nodes: int
    gpus: int  # per node
    model: int  # model index, or ANY_MODEL
    runtime: float
    limit: float
    priority: int = 0
    preemptible: bool = True
    models: tuple[int, ...] = ()

    @property
    def size_class(self) -> str:
        if self.nodes > 1:
            return "multinode"
        return "1gpu" if self.gpus == 1 else "2-8gpu"


@dataclass
class _Life:
    """What happened to one job during the replay."""

    job: TraceJob
    first_start: float | None = None
    started: float | None = None  # current attempt
    attempt: int = 0
    preempted: int = 0
    predicted: tuple[float, float] | None = None  # (when predicted, predicted start)
    done: float | None = None
    rate: float = 1.0  # current attempt: trace run time per second (model throughput, hot spots)
    timed_out: bool = False  # it ran past its limit (slowed down) and was cut there


@dataclass
class _Meter:
    """Energy, idle nodes and completed work over the measured window ``[lo, hi]``. Between two
    events the fleet does not change, so each interval adds its length × what the snapshot
    holds then."""

    fleet: Fleet
    window: tuple[float, float]
    energy_wh: float = 0.0
    cost: float = 0.0
    co2_g: float = 0.0
    idle_node_s: float = 0.0
    work_gpu_s: float = 0.0  # GPU-seconds at a throughput of 1.0, of runs that completed
    timed_out: int = 0

    def __post_init__(self) -> None:
        snap = self.fleet.snapshot()
        tdp = np.array(self.fleet.tdp_watts or [np.nan], dtype=np.float64)
        self.tdp = tdp[snap.model] if self.fleet.tdp_watts else None
        self.price = np.nan_to_num(snap.price.astype(np.float64))  # unknown: not counted
        self.carbon = np.nan_to_num(snap.carbon.astype(np.float64))

    def span(self, start: float, end: float) -> float:
        lo, hi = self.window
        return max(min(end, hi) - max(start, lo), 0.0)

    def add(self, snap: Snapshot, start: float, end: float) -> None:
        seconds = self.span(start, end)
        if not seconds:
            return
        held = snap.gpu_total - snap.gpu_free
        idle = held == 0
        self.idle_node_s += int(np.count_nonzero(idle)) * seconds
        if self.tdp is None:
            return
        watts = self.tdp * (held + self.fleet.idle_power * snap.gpu_free)
        if self.fleet.sleep_idle_nodes:
            watts[idle] = 0.0
        wh = watts * seconds / 3600
        self.energy_wh += float(wh.sum())
        self.cost += float((wh * self.price).sum()) / 1000
        self.co2_g += float((wh * self.carbon).sum()) / 1000

    def completed(self, gpus: int, rate: float, start: float, end: float) -> None:
        self.work_gpu_s += gpus * rate * self.span(start, end)

    def figures(self) -> dict[str, Any]:
        work_h = self.work_gpu_s / 3600
        figures: dict[str, Any] = {
            "idle_node_h": round(self.idle_node_s / 3600, 1),
            "completed_gpu_h": round(work_h, 1),
            "timed_out": self.timed_out,
        }
        if self.tdp is not None:
            figures |= {
                "energy_kwh": round(self.energy_wh / 1000, 1),
                "energy_wh_per_gpu_h": round(self.energy_wh / work_h, 1) if work_h else None,
                "cost_per_gpu_h": round(self.cost / work_h, 5) if work_h else None,
                "co2_g_per_gpu_h": round(self.co2_g / work_h, 1) if work_h else None,
            }
        return figures


class Replay:
    def __init__(
        self,
        fleet: Fleet,
        profile: Profile,
        queues: Iterable[QueueSpec],
        *,
        cycle_s: float = 1.0,
        idle_s: float = 1.0,
        per_cycle: int = 20_000,
    ) -> None:
        self.fleet, self.profile, self.cycle_s, self.per_cycle = fleet, profile, cycle_s, per_cycle
        self.idle_s = idle_s
        self.queues = {q.id: q for q in queues}
        self.cache = SchedulerCache()
        snap = fleet.snapshot()
        snap.quota = _quota_book(self.queues.values())
        snap.queue_names = {q: f"p{spec.project}/q{q}" for q, spec in self.queues.items()}
        snap.queue_models = {q: tuple(range(len(fleet.models))) for q in self.queues}
        self.cache.snap = snap
        self.cache.queue = PendingQueue()
        self.lives: dict[int, _Life] = {}
        self.busy_gpu_s = 0.0
        self.preempted_gpu_s = 0.0
        self.preemptions = 0
        self.cycles = 0
        self.holding: dict[int, dict[int, int]] = {}  # queue → model → GPUs held (for reclaim)
        self.watch: list[tuple[int, int, int, float]] = []  # (queue, model, GPUs, since)
        self.reclaimed: dict[tuple[int, int], float] = {}
        self.hot = fleet.hot_rows() if fleet.hot else None
        self.meter = _Meter(fleet, (0.0, 0.0))

    # --- the run ------------------------------------------------------------------------------
    def run(
        self,
        trace: list[TraceJob],
        *,
        until: float | None = None,
        warmup: float = 0.25,
        window: tuple[float, float] | None = None,
    ) -> dict[str, Any]:
        """Replay ``trace`` until every job has finished (or ``until``); returns the figures.
        Utilisation, energy and work are measured over ``window`` (virtual seconds), by default
        from ``warmup`` of the trace's span to its last arrival."""
        arrivals = sorted(trace, key=lambda j: (j.submit, j.id))
        horizon = max((j.submit for j in trace), default=0.0)
        self.window = window or (warmup * horizon, horizon)
        self.meter = _Meter(self.fleet, self.window)
        stop_at = until if until is not None else math.inf
        ends: list[tuple[float, int, int, str]] = []  # (when, job, attempt, how)
        queues = {q: (spec.priority, 1.0, spec.project) for q, spec in self.queues.items()}
        policies = {q: (s.within, s.reclaim, s.grace_s) for q, s in self.queues.items()}
        now, k, busy, last = 0.0, 0, 0, 0.0
        while k < len(arrivals) or ends or len(self.cache.queue):
            pending_next = arrivals[k].submit if k < len(arrivals) else math.inf
            end_next = ends[0][0] if ends else math.inf
            nxt = min(pending_next, end_next)
            if len(self.cache.queue):
                nxt = min(nxt, now + self.idle_s)  # jobs wait: the live scheduler cycles every second
            now = max(nxt, now + self.cycle_s) if self.cycles else nxt
            if now > stop_at:
                break
            lo, hi = self.window
            self.busy_gpu_s += busy * max(min(now, hi) - max(last, lo), 0.0)
            self.meter.add(self.cache.snap, last, now)
            last = now
            while k < len(arrivals) and arrivals[k].submit <= now:
                self._arrive(arrivals[k])
                k += 1
            while ends and ends[0][0] <= now:
                when, job_id, attempt, how = heapq.heappop(ends)
                life = self.lives[job_id]
                if attempt != life.attempt or life.started is None:
                    continue  # an end of an attempt already preempted
                busy -= life.job.nodes * life.job.gpus
                self._end(life, when, how)
            if self.hot is not None:
                self.cache.snap.telemetry_at.fill(now)  # the readings arrive fresh every cycle
            decided = decide(
                self.profile, self.cache, self.cache.snap, self.cycles + 1, self.per_cycle,
                queues=queues, now=now, policies=policies,
            )  # fmt: skip
            self.cycles += 1
            for placement in decided.placements:
                life = self.lives[placement.job.id]
                life.started = now
                life.first_start = now if life.first_start is None else life.first_start
                busy += life.job.nodes * life.job.gpus
                self._hold(life.job.queue, placement.job.model, life.job.nodes * life.job.gpus)
                life.rate = self._rate(placement)
                needs = life.job.runtime / life.rate
                how = "end" if needs <= life.job.limit else "timeout"  # cut at its limit
                heapq.heappush(ends, (now + min(needs, life.job.limit), life.job.id, life.attempt, how))
            for decision in decided.preemptions:
                for victim in decision.victims:
                    life = self.lives[victim]
                    if life.started is None:
                        continue
                    self.preemptions += 1
                    grace = (
                        self.queues[self.cache.runs[victim].queue].grace_s
                        if victim in self.cache.runs
                        else 30
                    )
                    heapq.heappush(ends, (now + grace, victim, life.attempt, "preempted"))
            for job_id, (start, _, _) in decided.estimates.items():
                life = self.lives[job_id]
                if life.predicted is None and life.first_start is None:
                    life.predicted = (now, start)
            self._check_reclaim(now)
        self.meter.add(self.cache.snap, last, min(self.window[1], stop_at))  # quiet after the last event
        return self._figures(horizon)

    def _rate(self, placement: Placement) -> float:
        """Trace run time done per second: the model's throughput, less on a hot spot (a gang
        goes at the pace of its slowest node)."""
        model = placement.job.model
        rate = self.fleet.speed(model) if model >= 0 else 1.0
        if self.hot is not None and any(self.hot[n.row] for n in placement.nodes):
            rate /= self.fleet.hot_slowdown
        return rate

    def _arrive(self, job: TraceJob) -> None:
        self.lives[job.id] = _Life(job)
        self.cache.queue.upsert(_view(job, 0))

    def _end(self, life: _Life, when: float, how: str) -> None:
        job = life.job
        run = self.cache.runs.get(job.id)
        model = run.model if run is not None else job.model
        if how in ("end", "timeout"):
            self.cache.note_end(job.id, when)
            self.cache._release(job.id)
            if how == "end":
                self.meter.completed(job.nodes * job.gpus, life.rate, life.started or when, when)
            else:
                life.timed_out = True
                self.meter.timed_out += 1
            life.done, life.started = when, None
        else:  # preempted: its work since it started is lost; it waits again
            self.preempted_gpu_s += job.nodes * job.gpus * (when - (life.started or when))
            self.cache._release(job.id)
            life.started = None
            life.attempt += 1
            life.preempted += 1
            self.cache.queue.upsert(_view(job, life.attempt))
        self._hold(job.queue, model, -job.nodes * job.gpus)

    # --- reclaim ------------------------------------------------------------------------------
    def watch_reclaim(self, queue: int, model: int, gpus: int, since: float) -> None:
        """Measure when ``queue`` holds ``gpus`` GPUs of ``model`` (its lent quota back)."""
        self.watch.append((queue, model, gpus, since))

    def _hold(self, queue: int, model: int, gpus: int) -> None:
        per = self.holding.setdefault(queue, {})
        per[model] = per.get(model, 0) + gpus

    def _check_reclaim(self, now: float) -> None:
        for queue, model, gpus, since in self.watch:
            key = (queue, model)
            if (
                key not in self.reclaimed
                and now >= since
                and self.holding.get(queue, {}).get(model, 0) >= gpus
            ):
                self.reclaimed[key] = now - since

    # --- figures ------------------------------------------------------------------------------
    def _figures(self, horizon: float) -> dict[str, Any]:
        waits: dict[str, list[float]] = {c: [] for c in SIZE_CLASSES}
        errors = []
        unstarted = 0
        end = max((life.done or 0.0 for life in self.lives.values()), default=0.0)
        span = self.window[1] - self.window[0]
        for life in self.lives.values():
            if life.first_start is None:
                unstarted += 1
                waits[life.job.size_class].append(max(end - life.job.submit, 0.0))
                continue
            wait = life.first_start - life.job.submit
            waits[life.job.size_class].append(wait)
            if life.predicted is not None:
                said_at, said = life.predicted
                ahead = life.first_start - said_at
                if ahead >= 60.0:  # a start a minute or more away when it was predicted
                    errors.append(abs(said - life.first_start) / ahead)
        figures: dict[str, Any] = {
            "utilisation": round(self.busy_gpu_s / (self.fleet.total_gpus * span), 4) if span > 0 else None,
            "jobs": len(self.lives),
            "unstarted": unstarted,
            "cycles": self.cycles,
            "preemptions": self.preemptions,
            "preempted_gpu_s": round(self.preempted_gpu_s),
            "start_error_median": round(statistics.median(errors), 4) if errors else None,
            "start_error_p90": round(_quantile(errors, 0.9), 4) if errors else None,
            "predicted_jobs": len(errors),
        }
        for size, values in waits.items():
            figures[f"wait_mean_s_{size}"] = round(statistics.fmean(values), 1) if values else None
            figures[f"wait_p95_s_{size}"] = round(_quantile(values, 0.95), 1) if values else None
        every = [w for values in waits.values() for w in values]
        figures["wait_mean_s"] = round(statistics.fmean(every), 1) if every else None
        turnaround = [life.done - life.job.submit for life in self.lives.values() if life.done is not None]
        figures["turnaround_mean_s"] = round(statistics.fmean(turnaround), 1) if turnaround else None
        return figures | self.meter.figures()

    def wait_of(self, job_id: int) -> float | None:
        life = self.lives.get(job_id)
        if life is None or life.first_start is None:
            return None
        return life.first_start - life.job.submit


# --- the policies compared -----------------------------------------------------------------
POLICIES = ("fifo", "backfill", "backfill_preemption")


def policy_profile(policy: str) -> Profile:
    """The default profile as ``policy``: ``fifo`` (no reservations: backfill with depth 0,
    predicted starts kept), ``backfill`` (no preemption) or ``backfill_preemption``."""
    plugins = list(DEFAULT_PROFILE["plugins"])
    args: dict[str, Any] = {}
    if policy != "backfill_preemption":
        plugins.remove("preemption")
    if policy == "fifo":
        args["backfill"] = {"depth": 0}
    return build_profile({"plugins": plugins, "weights": DEFAULT_PROFILE["weights"], "args": args})


def policy_queues(
    policy: str, quota: dict[int, int], ids: Iterable[int] = (1, 2), grace_s: int = 30
) -> list[QueueSpec]:
    """Queues of one cohort with ``quota`` each; under ``backfill_preemption`` they preempt lower
    priorities and reclaim lent quota from jobs of any priority up to their own."""
    preempt = policy == "backfill_preemption"
    return [
        QueueSpec(
            id=q,
            project=q,
            cohort="lab",
            quota=dict(quota),
            within="lower_priority" if preempt else "never",
            reclaim="any" if preempt else "never",
            grace_s=grace_s,
        )
        for q in ids
    ]


def _view(job: TraceJob, attempt: int) -> JobView:
    return JobView(
        id=job.id,
        queue_id=job.queue,
        project_id=job.queue,
        priority=job.priority,
        submitted_at=job.submit,
        nodes=job.nodes,
        gpus=job.gpus,
        model=job.model if job.gpus else NO_GPU,
        cpu=0,
        memory=0,
        attempts=attempt,
        time_limit=job.limit,
        preemptible=job.preemptible,
        models=job.models if job.model == ANY_MODEL else (),
    )


def _quota_book(queues: Iterable[QueueSpec]) -> QuotaBook:
    book = QuotaBook()
    for q in queues:
        if q.cohort:
            book.cohort_of[q.id] = q.cohort
            book.members.setdefault(q.cohort, []).append(q.id)
        if q.quota:
            book.limited.add(q.id)
            for model, gpus in q.quota.items():
                book.nominal[(q.id, model)] = gpus
                book.borrowing_limit[(q.id, model)] = None
    return book


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


# --- workloads ---------------------------------------------------------------------------------
def synthetic_trace(
    fleet: Fleet,
    *,
    hours: float = 2.0,
    load: float = 0.95,
    seed: int = 1,
    queues: tuple[int, ...] = (1, 2),
    any_model: float = 0.2,
    urgent: float = 0.1,
    first_id: int = 1,
) -> list[TraceJob]:
    """Jobs shaped like the published traces of shared GPU clusters: most ask for one GPU, a
    tail for 2–8 and a few for several whole nodes; run times are heavy-tailed (log-normal,
    median 20 minutes, capped at 12 hours) and time limits are longer than run times (users
    over-ask: the run takes 30–90 % of its limit; limits round up to 15 minutes). Arrivals are
    Poisson, at the rate that offers ``load`` × the fleet's GPU-hours."""
    rnd = random.Random(seed)
    shapes = [((1, 1), 0.68), ((1, 2), 0.10), ((1, 4), 0.09), ((1, 8), 0.08), ((2, 8), 0.03), ((4, 8), 0.02)]
    weights = [w for _, w in shapes]

    def runtime() -> float:
        return min(math.exp(rnd.gauss(math.log(1200), 1.3)), 12 * 3600)

    mean_gpu_s = sum(w * n * g for ((n, g), w) in shapes) * statistics.fmean(runtime() for _ in range(4000))
    rate = load * fleet.total_gpus / mean_gpu_s
    jobs, at, n = [], 0.0, first_id
    while True:
        at += rnd.expovariate(rate)
        if at > hours * 3600:
            return jobs
        (nodes, gpus) = rnd.choices([s for s, _ in shapes], weights)[0]
        run = runtime()
        limit = math.ceil(run / rnd.uniform(0.3, 0.9) / 900) * 900
        anyone = rnd.random() < any_model
        jobs.append(
            TraceJob(
                id=n,
                submit=at,
                queue=rnd.choice(queues),
                nodes=nodes,
                gpus=gpus,
                model=ANY_MODEL if anyone else rnd.randrange(len(fleet.models)),
                models=tuple(range(len(fleet.models))) if anyone else (),
                runtime=run,
                limit=float(limit),
                priority=50 if rnd.random() < urgent else 0,
            )
        )
        n += 1


def shifted(jobs: list[TraceJob], **changes: Any) -> list[TraceJob]:
    return [replace(j, **changes) for j in jobs]


__all__ = [
    "NEVER",
    "POLICIES",
    "Fleet",
    "QueueSpec",
    "Replay",
    "TraceJob",
    "policy_profile",
    "policy_queues",
    "shifted",
    "synthetic_trace",
]
