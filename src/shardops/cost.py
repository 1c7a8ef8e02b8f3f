"""The link model: latency, bandwidth and compute rate per mesh dim.

The numbers come from fixed presets (or the user's), never from run-time measurement,
so every rank computes the same costs and picks the same plan. What they price is in
planner/pricing.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from . import caches
from .errors import ShardingError


@dataclass(frozen=True)
class Link:
    latency: float  # seconds per message step (alpha)
    bandwidth: float  # bytes per second (beta)
    compute: float = 2e9  # bytes per second a rank's local kernels stream (CPU-class by default)

    def __repr__(self) -> str:
        return f"Link({self.latency * 1e6:g}us, {self.bandwidth / 1e9:g}GB/s)"


# NOTE: rough public figures. threads: a memcpy-bound in-process rendezvous;
# gloo/ethernet: TCP on a 10-25 Gb/s NIC; nvlink: H100-class NVLink with NCCL
# start-up latency; ib: 200-400 Gb/s InfiniBand between nodes. `compute` is the
# device behind the link: ~2 GB/s for CPU kernels such as histc or topk, ~1 TB/s
# for GPU memory. It prices the redundant work of "gather, then every rank
# computes the whole thing", which is what makes gathering lose on CPUs even
# when it saves a round.
# gloo-localhost: gloo between processes on one host (127.0.0.1), fitted by
# shardops.training.fit_timing.fit() on the 2-core development machine, idle (4 processes, one torch
# thread each, all_reduce of 4 B to 4 MiB, least squares of the ring model): alpha 375 us, beta
# 0.399 GB/s (docs/autoparallel.md, "Predicted against measured", run 3). Refit on another machine with
# `shardops autoplan --fit` (its compute twin is timing.COMPUTE_PRESETS["gloo-localhost"]).
PRESETS: dict[str, Link] = {
    "threads": Link(20e-6, 5e9, 2e9),
    "gloo-localhost": Link(375e-6, 0.399e9, 15.2e9),
    "gloo": Link(50e-6, 1.25e9, 2e9),
    "ethernet": Link(50e-6, 1.25e9, 2e9),
    "nvlink": Link(10e-6, 300e9, 1e12),
    "ib": Link(20e-6, 25e9, 1e12),
}

_default_links: str | Link | tuple = "threads"


def resolve_links(links: str | Link | Sequence[str | Link] | None, mesh_ndim: int) -> tuple[Link, ...]:
    """Per-mesh-dim links from a preset name, a Link, or one of those per mesh dim."""
    if links is None:
        links = _default_links
    if isinstance(links, (str, Link)):
        links = [links] * mesh_ndim
    links = list(links)
    if len(links) != mesh_ndim:
        raise ShardingError(f"link model: {len(links)} links for a {mesh_ndim}-d mesh; give one per mesh dim")
    out = []
    for link in links:
        if isinstance(link, str):
            if link not in PRESETS:
                raise ShardingError(
                    f"unknown link preset {link!r}; use one of {sorted(PRESETS)} or Link(latency, bandwidth)"
                )
            link = PRESETS[link]
        out.append(link)
    return tuple(out)


def set_links(links: str | Link | Sequence[str | Link]) -> None:
    """Set the link model used for planning: a preset, a Link, or one per mesh dim."""
    global _default_links
    resolve_links(links, len(links) if isinstance(links, (list, tuple)) else 1)  # validate now
    _default_links = links if isinstance(links, (str, Link)) else tuple(links)
    caches.invalidate()  # every plan so far was priced under the old model


# ------------------------ collectives on links (ring model): used by the planner's pricing and by redistribute's search


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Ring-model time of one collective over n ranks; `nbytes` is the full (gathered/reduced) size."""
    if n <= 1:
        return 0.0
    steps = n - 1
    wire = (n - 1) / n * nbytes / link.bandwidth
    if kind == "all_reduce":
        return 2 * (steps * link.latency + wire)
    if kind == "broadcast":
        return steps * link.latency + wire
    return steps * link.latency + wire  # all_gather, reduce_scatter, all_to_all


def joint_collective_time(kind: str, nbytes: float, sizes: Sequence[int], links: Sequence[Link]) -> float:
    """One collective over the group spanning several mesh dims (sizes n_i, links l_i).

    Model: the collective runs hierarchically, mesh dim by mesh dim, so it takes the
    per-dim steps, sum(alpha_i (n_i - 1)), but it is ONE round: every byte crosses the
    group once, (N-1)/N * B with N = prod(n_i), and that traffic is priced on the
    slowest link of the group. For one mesh dim this is exactly `collective_time`.
    Against the per-dim sequence (what a redistribution of one mesh dim at a time
    pays) it has the same latency and, on equal links, fewer bytes on the wire:
    1 - prod(1/n_i) <= sum(1 - 1/n_i). `nbytes` is the full (gathered/reduced) size.
    """
    used = [(n, link) for n, link in zip(sizes, links) if n > 1]
    if not used:
        return 0.0
    if len(used) == 1:
        return collective_time(kind, nbytes, used[0][0], used[0][1])
    group = 1
    for n, _ in used:
        group *= n
    steps = sum((n - 1) * link.latency for n, link in used)
    wire = (group - 1) / group * nbytes / min(link.bandwidth for _, link in used)
    return 2 * (steps + wire) if kind == "all_reduce" else steps + wire


def step_time(kind: str, local: float, n: int, link: Link) -> float:
    """One redistribution step on one mesh dim, from the source's local bytes (slices are free)."""
    if kind == "all_gather":
        return collective_time(kind, local * n, n, link)
    if kind in ("all_reduce", "reduce_scatter", "all_to_all"):
        return collective_time(kind, local, n, link)
    return 0.0
