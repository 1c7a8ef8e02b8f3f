"""Counter-based random numbers whose values do not depend on the layout.

A random op on a DTensor draws element i of the GLOBAL tensor (its row-major
index) as a pure function of (seed, draw counter, i):

    key   = mix(seed, counter)                 one 64-bit key per op call
    bits  = splitmix64(i * GOLDEN + key)       64 random bits per element

so every rank computes only the elements its shard holds (no full-size draw,
no collective) and any mesh/placements give the same global tensor. Ranks issue
the same ops in the same order, so their counters agree.

State: (seed, counter). `torch.manual_seed(s)` (wrapped at import; torch's own
still runs) sets seed = s and restarts the counter, so re-seeding with the same
value restarts the sequence, as in torch. `torch.get_rng_state()` /
`set_rng_state()` (wrapped too) save and restore the counter with torch's state,
so activation checkpointing recomputes the same dropout masks. The epoch counts re-seeds: it is how a
rank thread tells that it has been seeded. Inside `shardops.run` every rank
thread keeps its own state (the threads share torch's generator, which therefore
cannot be the source); a rank thread starts from a copy of the process state.
Under torchrun the state is per process. A draw given an explicit
`torch.Generator` takes its key from that generator instead (one 64-bit draw),
so it follows the generator's own seeding.

Elements are produced in chunks of CHUNK, so a draw's temporaries stay small
whatever the shard size.
"""
from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from .placements import Placement, dim_positions
from .world import in_threads_world

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# Elements per generation step: int64 temporaries of 256 KiB stay in cache, and at torch's
# parallel grain size (32768) every op runs on the calling thread. Larger chunks let each op
# fork intra-op threads, which on a loaded machine (rank threads, other processes) costs
# 10x and more; the rank threads already keep the cores busy.
CHUNK = 1 << 15
DEVICE_CHUNK = 1 << 22  # on an accelerator a chunk is one kernel launch per step: make them big


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 torch multiplies with (same bits)."""
    c &= MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


def splitmix64(x: int) -> int:
    """The scalar splitmix64 finaliser (Python ints): the reference the tensor version must match."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & MASK64
    return z ^ (z >> 31)


# ------------------------------------------------------------------ state


@dataclass
class RngState:
    seed: int
    counter: int = 0
    epoch: int = 0


_process = RngState(torch.initial_seed() & MASK64)
_thread = threading.local()


def current_state() -> RngState:
    """This rank's state: per rank thread inside shardops.run, else per process."""
    if in_threads_world():
        st = getattr(_thread, "state", None)
        if st is None:
            st = _thread.state = RngState(_process.seed, _process.counter, _process.epoch)
        return st
    # Outside a threads world the process state follows torch's generator when it was
    # re-seeded by a path the wrapper does not see (default_generator.manual_seed, torch.seed).
    seed = torch.initial_seed() & MASK64
    if seed != _process.seed:
        _process.seed, _process.counter, _process.epoch = seed, 0, _process.epoch + 1
    return _process


def reseed(seed: int) -> None:
    seed = int(seed)
    if seed < 0:  # torch's mapping of negative seeds (torch.initial_seed() reports this value)
        seed += 0xFFFF_FFFF_FFFF_FFFF
    st = current_state()
    st.seed, st.counter, st.epoch = seed & MASK64, 0, st.epoch + 1


def next_key(generator: torch.Generator | None = None) -> int:
    """The 64-bit key of one draw (one op call); advances the counter or the given generator."""
    from .comm.traceable import refuse_while_tracing

    refuse_while_tracing("a random op on a DTensor (dropout, rand, normal_, ...)", "its draw counter would be frozen into the graph, so every step would draw the same values")
    if generator is not None:
        return int(torch.empty((), dtype=torch.int64, device=generator.device).random_(generator=generator)) & MASK64
    st = current_state()
    key = splitmix64(splitmix64(st.seed) ^ st.counter)
    st.counter += 1
    return key


def _wrap_manual_seed(original: Callable) -> Callable:
    def manual_seed(seed):  # noqa: ANN001 - torch's signature
        out = original(seed)  # torch validates the seed (and seeds every device) first
        reseed(int(seed))
        return out

    manual_seed.__doc__ = original.__doc__
    manual_seed.__wrapped__ = original  # type: ignore[attr-defined]
    manual_seed._shardops_wrapped = True  # type: ignore[attr-defined]
    return manual_seed


# torch.get_rng_state() / set_rng_state(): activation checkpointing and fork_rng save torch's
# state and restore it so that a recomputed forward draws the same dropout masks. The counter
# travels with the saved state object: each state tensor get_rng_state returns is remembered
# (by identity, while it lives) with this rank's (seed, counter), and restored with it.
_saved: dict[int, tuple[RngState, RngState]] = {}


def _wrap_get_rng_state(original: Callable) -> Callable:
    def get_rng_state() -> torch.Tensor:
        state = original()
        st = current_state()
        _saved[id(state)] = (st, RngState(st.seed, st.counter, st.epoch))
        weakref.finalize(state, _saved.pop, id(state), None)
        return state

    get_rng_state.__doc__ = original.__doc__
    get_rng_state.__wrapped__ = original  # type: ignore[attr-defined]
    return get_rng_state


def _wrap_set_rng_state(original: Callable) -> Callable:
    def set_rng_state(new_state: torch.Tensor) -> None:
        original(new_state)
        saved = _saved.get(id(new_state))
        if saved is not None and saved[0] is current_state():  # the same rank's state (a thread restores its own)
            st, snap = saved
            st.seed, st.counter, st.epoch = snap.seed, snap.counter, snap.epoch

    set_rng_state.__doc__ = original.__doc__
    set_rng_state.__wrapped__ = original  # type: ignore[attr-defined]
    return set_rng_state


def install_seed_hook() -> None:
    """Wrap torch.manual_seed, get_rng_state, set_rng_state (and their torch.random twins); idempotent."""
    if getattr(torch.manual_seed, "_shardops_wrapped", False):
        return
    seed, get, put = _wrap_manual_seed(torch.manual_seed), _wrap_get_rng_state(torch.get_rng_state), _wrap_set_rng_state(torch.set_rng_state)
    torch.manual_seed = torch.random.manual_seed = seed
    torch.get_rng_state = torch.random.get_rng_state = get
    torch.set_rng_state = torch.random.set_rng_state = put


# ------------------------------------------------------------------ global element indices


@dataclass(frozen=True)
class IndexLayout:
    """This rank's elements as global row-major indices: outer offsets + one contiguous run.

    index(local flat j) = run_start + j % run + sum_d outer[d][(j // run // inner_d) % len(outer[d])]
    """

    outer: tuple[torch.Tensor, ...]  # per outer dim: global offset (position * stride) of each local index
    run: int
    run_start: int

    @property
    def numel(self) -> int:
        return math.prod(len(o) for o in self.outer) * self.run


def index_layout(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int] = (),
    coordinate: Sequence[int] = (),
    placements: Sequence[Placement] = (),
) -> IndexLayout:
    """The global indices held at `coordinate` (Shard, StridedShard, uneven and empty shards)."""
    ndim = len(global_shape)
    strides = [math.prod(global_shape[d + 1 :]) for d in range(ndim)]
    positions = [dim_positions(global_shape[d], d, mesh_shape, coordinate, placements) for d in range(ndim)]
    # Trailing dims held whole merge into the run; the last partly held dim joins it if it is a range.
    k = ndim
    while k > 0 and len(positions[k - 1]) == global_shape[k - 1]:
        k -= 1
    run, run_start = math.prod(global_shape[k:]), 0
    if k > 0 and isinstance(positions[k - 1], range):
        pos = positions[k - 1]
        run_start = (pos.start if len(pos) else 0) * strides[k - 1]
        run *= len(pos)
        k -= 1
    outer = tuple(_as_tensor(positions[d]) * strides[d] for d in range(k))
    return IndexLayout(outer, run, run_start)


def _as_tensor(positions: range | list[int]) -> torch.Tensor:
    if isinstance(positions, range):
        return torch.arange(positions.start, positions.stop, dtype=torch.int64)
    return torch.tensor(positions, dtype=torch.int64)


def index_chunks(layout: IndexLayout, chunk: int = CHUNK, device: torch.device | str = "cpu") -> Iterator[tuple[int, torch.Tensor]]:
    """(local flat start, int64 global indices on `device`) for consecutive pieces of about `chunk` elements.

    The outer offsets stay on the CPU (one entry per local index of an outer dim: small).
    """
    n_outer = math.prod(len(o) for o in layout.outer)
    if layout.run == 0 or n_outer == 0:
        return
    inner = [math.prod(len(o) for o in layout.outer[d + 1 :]) for d in range(len(layout.outer))]

    def outer_offsets(o0: int, o1: int) -> torch.Tensor:
        flat = torch.arange(o0, o1, dtype=torch.int64)
        acc = torch.full((o1 - o0,), layout.run_start, dtype=torch.int64)
        for offs, step in zip(layout.outer, inner):
            acc += offs[(flat // step) % len(offs)]
        return acc

    if layout.run >= chunk:
        for o in range(n_outer):
            base = int(outer_offsets(o, o + 1)) if layout.outer else layout.run_start
            for a in range(0, layout.run, chunk):
                b = min(a + chunk, layout.run)
                yield o * layout.run + a, torch.arange(base + a, base + b, dtype=torch.int64, device=device)
        return
    group = max(chunk // layout.run, 1)
    run = torch.arange(layout.run, dtype=torch.int64, device=device)
    for o0 in range(0, n_outer, group):
        o1 = min(o0 + group, n_outer)
        yield o0 * layout.run, (outer_offsets(o0, o1).to(device)[:, None] + run).reshape(-1)


# ------------------------------------------------------------------ bits and distributions


def random_bits(index: torch.Tensor, key: int) -> torch.Tensor:
    """splitmix64(index * GOLDEN + key), in place on `index` (int64 with the 64 bits)."""
    z = index.mul_(_signed(GOLDEN)).add_(_signed(key + GOLDEN))
    t = torch.empty_like(z)
    for shift, mult in ((30, _MIX1), (27, _MIX2)):
        torch.bitwise_right_shift(z, shift, out=t)
        t.bitwise_and_((1 << (64 - shift)) - 1)  # logical shift: clear the copied sign bits
        z.bitwise_xor_(t).mul_(_signed(mult))
    torch.bitwise_right_shift(z, 31, out=t)
    t.bitwise_and_((1 << 33) - 1)
    return z.bitwise_xor_(t)


def high_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """The top n (< 64) bits as a non-negative int64, in place."""
    return bits.bitwise_right_shift_(64 - n).bitwise_and_((1 << n) - 1)


def uniform_open_closed(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(0, 1]: safe under log. float64 gets 53 random bits, other dtypes 24 (computed in float32)."""
    n, work = (53, torch.float64) if dtype == torch.float64 else (24, torch.float32)
    return high_bits(bits, n).add_(1).to(work).mul_(2.0**-n)


def uniform_closed_open(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[0, 1), as torch's uniform_."""
    n, work = (53, torch.float64) if dtype == torch.float64 else (24, torch.float32)
    return high_bits(bits, n).to(work).mul_(2.0**-n)


def two_uniforms(bits: torch.Tensor, work: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent uniforms in (0, 1] from the two 32-bit halves of each element's bits."""
    lo = (bits & 0xFFFFFFFF).add_(1).to(work).mul_(2.0**-32)
    hi = high_bits(bits, 32).add_(1).to(work).mul_(2.0**-32)
    return lo, hi


Transform = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (bits, global index) -> values


def fill(
    local: torch.Tensor,
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    key: int,
    transform: Callable[[torch.Tensor, int, int], torch.Tensor],
) -> torch.Tensor:
    """Write `transform(bits, j0, j1)` for this rank's elements into `local` (row-major order), chunk by chunk.

    `transform` gets the bits of local flat elements [j0, j1) (it may use them in place)
    and returns their values; they are cast to local's dtype on the write.
    """
    layout = index_layout(global_shape, mesh_shape, coordinate, placements)
    if layout.numel != local.numel():
        raise RuntimeError(f"rng.fill: layout holds {layout.numel} elements, the local tensor {local.numel()}")
    target = local if local.is_contiguous() else torch.empty(local.shape, dtype=local.dtype, device=local.device)
    flat = target.view(-1)
    chunk = CHUNK if local.device.type == "cpu" else DEVICE_CHUNK
    for j0, index in index_chunks(layout, chunk, local.device):
        j1 = j0 + index.numel()
        flat[j0:j1] = transform(random_bits(index, key), j0, j1)
    if target is not local:
        local.copy_(target)
    return local


install_seed_hook()
