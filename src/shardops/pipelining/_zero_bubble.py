"""The zero-bubble schedules' order: every rank's program of forwards (F), input-gradient backwards (I)
and weight-gradient backwards (W), from one simulation of the whole pipeline that every rank runs
alike, so no rank needs to ask another.

Each action takes one slot (the zero-bubble paper's T_F = T_I = T_W). At each slot every rank runs,
of what is ready:

1. an I (the previous stage waits for its gradient),
2. else an F, its latest stage's first (it reaches the loss sooner); a new micro-batch enters the
   rank's first stage only while fewer than `max_in_flight` are live there (F run, W not yet), which
   bounds the activations held as 1F1B's warm-up does,
3. else the oldest W it owes: a W crosses no boundary, so it fills what would be an idle slot,
4. else it idles.

An I depends on the next stage's I of the same micro-batch (and its own F), an F on the previous
stage's F, a W on its own I. Every action of the programs comes after what it depends on in the
simulation, so the executor's order (blocking receives, non-blocking sends) cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Callable

Step = tuple[int, str, int]  # (stage, "F" | "I" | "W", micro-batch)


def greedy_programs(
    group_size: int, num_stages: int, n_microbatches: int, place: Callable[[int], int], max_in_flight: int
) -> list[list[Step]]:
    """Each group member's program, from one slot-by-slot simulation of every rank."""
    sim = _Simulation(group_size, num_stages, n_microbatches, place, max_in_flight)
    while sim.remaining:
        if not sim.run_slot():
            raise RuntimeError(
                f"zero-bubble order: no rank can progress at slot {sim.clock} (p={group_size}, stages={num_stages}, "
                f"m={n_microbatches})"
            )
    return sim.programs


class _Simulation:
    def __init__(self, p: int, num_stages: int, m: int, place: Callable[[int], int], max_in_flight: int) -> None:
        self.m, self.last, self.max_in_flight = m, num_stages - 1, max_in_flight
        self.local = [
            sorted((s for s in range(num_stages) if place(s) == r), reverse=True) for r in range(p)
        ]  # latest stage first
        self.first = [min(stages) for stages in self.local]
        self.finished: dict[Step, int] = {}  # the slot after which each action's result is there
        self.next_mb = {
            (s, kind): 0 for s in range(num_stages) for kind in "FI"
        }  # each stage runs F and I in micro-batch order
        self.owed: list[list[tuple[int, str, int]]] = [[] for _ in range(p)]  # W's owed, oldest first
        self.live = [0] * p  # micro-batches live in each rank's first stage
        self.programs: list[list[Step]] = [[] for _ in range(p)]
        self.remaining = 3 * num_stages * m
        self.clock = 0

    def run_slot(self) -> bool:
        picked = [self._pick(r) for r in range(len(self.local))]
        for r, step in enumerate(picked):
            if step is not None:
                self._record(r, step)
        self.clock += 1
        return any(step is not None for step in picked)

    def _done(self, step: Step) -> bool:
        return self.finished.get(step, self.clock + 1) <= self.clock

    def _pick(self, r: int) -> Step | None:
        inputs = [
            (s, "I", mb)
            for s, mb in self._next(r, "I")
            if self._done((s, "F", mb)) and (s == self.last or self._done((s + 1, "I", mb)))
        ]
        if inputs:
            return min(inputs, key=lambda a: (a[2], -a[0]))
        forwards = [
            (s, "F", mb)
            for s, mb in self._next(r, "F")
            if (s == 0 or self._done((s - 1, "F", mb))) and (s != self.first[r] or self.live[r] < self.max_in_flight)
        ]
        if forwards:
            return min(forwards, key=lambda a: (a[2], -a[0]))
        return self.owed[r][0] if self.owed[r] else None

    def _next(self, r: int, kind: str) -> list[tuple[int, int]]:
        return [(s, self.next_mb[(s, kind)]) for s in self.local[r] if self.next_mb[(s, kind)] < self.m]

    def _record(self, r: int, step: Step) -> None:
        s, kind, mb = step
        self.finished[step] = self.clock + 1
        self.programs[r].append(step)
        self.remaining -= 1
        if kind == "W":
            self.owed[r].pop(0)
            self.live[r] -= s == self.first[r]
            return
        self.next_mb[(s, kind)] += 1
        if kind == "I":
            self.owed[r].append((s, "W", mb))
        elif s == self.first[r]:
            self.live[r] += 1
