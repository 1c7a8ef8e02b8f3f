"""Counter-based random numbers whose values do not depend on the layout.

A random op on a DTensor draws element i of the GLOBAL tensor (its row-major
index) as a pure function of (seed, draw counter, i):

    key   = mix(seed, counter)                 one 64-bit key per op call
    bits  = splitmix64(i * GOLDEN + key)       64 random bits per element

so every rank computes only the elements its shard holds (no full-size draw,
no collective) and any mesh/placements give the same global tensor. Ranks issue
the same ops in the same order, so their counters agree.

State: (seed, counter), one per rank: per process under torchrun, per rank thread
inside `shardops.run` (each rank thread also has its own default torch generator,
interop/rank_random.py). `torch.manual_seed(s)` (wrapped by shardops._torch.install()) seeds the rank's
torch generator and sets seed = s, restarting the counter, so re-seeding with the
same value restarts the sequence, as in torch; a re-seed the wrapper does not see
(Generator.manual_seed, torch.seed) is followed at the next draw. `torch.get_rng_state()` /
`set_rng_state()` (wrapped too) save and restore the counter with torch's state, so
activation checkpointing recomputes the same dropout masks. A new process (and a rank
thread, like one) starts from a random seed, so a rank's first DTensor draw takes the
mesh's first rank's (seed, counter), as torch DTensor takes rank 0's RNG state at its
first random op. A draw given an explicit `torch.Generator` takes its key from that
generator instead (one 64-bit draw), so it follows the generator's own seeding; torch's default
generator given explicitly is, in a rank thread, that rank's generator.

Elements are produced in chunks of CHUNK, so a draw's temporaries stay small
whatever the shard size.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ._torch import random as torch_random
from .placements import Placement, dim_positions
from .world import rank_generator

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
    observed: int | None = None  # the torch generator's seed this state last followed
    synced: bool = False  # took the first rank's (seed, counter) at its first draw


_process = RngState(torch.default_generator.initial_seed() & MASK64)
_thread = threading.local()


def current_state() -> RngState:
    """This rank's state: per rank thread inside shardops.run, else per process.

    Either follows its torch generator (the rank thread's, or torch's default one) when that was
    re-seeded by a path the wrapper does not see (Generator.manual_seed, torch.seed): a new seed
    restarts the counter.
    """
    generator = rank_generator()
    st: RngState | None
    if generator is None:
        st = _process
        generator = torch.default_generator
    else:
        st = getattr(_thread, "state", None)
        if st is None or getattr(_thread, "generator", None) is not generator:  # a new run: a fresh rank
            st = _thread.state = RngState(generator.initial_seed() & MASK64)
            _thread.generator = generator
    seed = generator.initial_seed() & MASK64
    if seed != st.observed:
        st.seed, st.counter, st.epoch, st.observed = seed, 0, st.epoch + (st.observed is not None), seed
    return st


def sync_with_first_rank(mesh) -> None:  # noqa: ANN001 - a DeviceMesh (mesh.py imports this package's modules)
    """Before this rank's first draw on a DTensor: take the mesh's first rank's (seed, counter).

    A new process starts from a random seed, so unseeded ranks would draw shards that do not fit
    together; torch DTensor takes rank 0's RNG state at its first random op, and so does this
    (rank threads start from random seeds too, as processes). Ranks seeded alike lose nothing.
    Uncounted, as the debug checks: it is set-up, not the op's communication.
    """
    _refuse_while_tracing()  # before the collective: a traced draw must fail on every rank alike, at once
    st = current_state()
    if st.synced:
        return
    group = mesh.group(tuple(range(mesh.ndim)))
    if group.size > 1:
        mine = torch.tensor([_signed(st.seed), st.counter], dtype=torch.int64)
        first = mesh.comm._all_gather(mine, group, [(2,)] * group.size)[0]
        st.seed, st.counter = int(first[0]) & MASK64, int(first[1])
    st.synced = True


def reseed(seed: int) -> None:
    seed = int(seed)
    if seed < 0:  # torch's mapping of negative seeds (torch.initial_seed() reports this value)
        seed += 0xFFFF_FFFF_FFFF_FFFF
    st = current_state()
    st.seed, st.counter, st.epoch, st.observed = seed & MASK64, 0, st.epoch + 1, seed & MASK64


def _refuse_while_tracing() -> None:
    from .comm.traceable import refuse_while_tracing

    refuse_while_tracing(
        "a random op on a DTensor (dropout, rand, normal_, ...)",
        "its draw counter would be frozen into the graph, so every step would draw the same values",
    )


def next_key(generator: torch.Generator | None = None) -> int:
    """The 64-bit key of one draw (one op call); advances the counter or the given generator."""
    _refuse_while_tracing()
    if generator is not None:
        own = rank_generator()
        if own is not None and torch_random.is_process_default_generator(generator):
            generator = own  # a reference to torch's default taken before (random_split's default)
        return int(torch.empty((), dtype=torch.int64, device=generator.device).random_(generator=generator)) & MASK64
    st = current_state()
    key = splitmix64(splitmix64(st.seed) ^ st.counter)
    st.counter += 1
    return key


# torch's functions on "the" default random state. Inside a rank thread of shardops.run they act
# on that rank's generator (each rank is a process under torchrun); elsewhere they are torch's own.
# Either way this rank's counter-based state (seed, counter) follows them.


def _wrap(original: Callable, replacement: Callable) -> Callable:
    replacement.__doc__ = original.__doc__
    replacement.__name__ = original.__name__
    return replacement


def _wrap_manual_seed(original: Callable) -> Callable:
    def manual_seed(seed):  # noqa: ANN001 - torch's signature
        generator = rank_generator()
        # torch validates the seed (and, in a process, seeds every device) first
        out = original(seed) if generator is None else generator.manual_seed(int(seed))
        reseed(int(seed))
        return out

    return _wrap(original, manual_seed)


def _wrap_seed(original: Callable) -> Callable:
    def seed() -> int:
        generator = rank_generator()
        return original() if generator is None else generator.seed()  # current_state() follows the new seed

    return _wrap(original, seed)


def _wrap_initial_seed(original: Callable) -> Callable:
    def initial_seed() -> int:
        generator = rank_generator()
        return original() if generator is None else generator.initial_seed()

    return _wrap(original, initial_seed)


# torch.get_rng_state() / set_rng_state(): activation checkpointing and fork_rng save torch's
# state and restore it so that a recomputed forward draws the same dropout masks. The counter
# travels with the saved state object: each state tensor get_rng_state returns is remembered
# (by identity, while it lives) with this rank's (seed, counter), and restored with it.
_saved: dict[int, tuple[RngState, RngState]] = {}


def _wrap_get_rng_state(original: Callable) -> Callable:
    def get_rng_state() -> torch.Tensor:
        generator = rank_generator()
        state = original() if generator is None else generator.get_state()
        st = current_state()
        _saved[id(state)] = (st, RngState(st.seed, st.counter, st.epoch))
        weakref.finalize(state, _saved.pop, id(state), None)
        return state

    return _wrap(original, get_rng_state)


def _wrap_set_rng_state(original: Callable) -> Callable:
    def set_rng_state(new_state: torch.Tensor) -> None:
        generator = rank_generator()
        if generator is None:
            original(new_state)
        else:
            generator.set_state(new_state)
        saved = _saved.get(id(new_state))
        if saved is not None and saved[0] is current_state():  # the same rank's state (a thread restores its own)
            st, snap = saved
            st.seed, st.counter, st.epoch = snap.seed, snap.counter, snap.epoch

    return _wrap(original, set_rng_state)


_WRAPPERS = {
    "manual_seed": _wrap_manual_seed,
    "seed": _wrap_seed,
    "initial_seed": _wrap_initial_seed,
    "get_rng_state": _wrap_get_rng_state,
    "set_rng_state": _wrap_set_rng_state,
}


for _name, _wrapper in _WRAPPERS.items():  # put in place by shardops._torch.install(), not by this import
    torch_random.wrap_default_state_function(_name, _wrapper)


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
    pos = positions[k - 1] if k > 0 else None
    if isinstance(pos, range):
        run_start = (pos.start if len(pos) else 0) * strides[k - 1]
        run *= len(pos)
        k -= 1
    outer = tuple(_as_tensor(positions[d]) * strides[d] for d in range(k))
    return IndexLayout(outer, run, run_start)


def _as_tensor(positions: range | list[int]) -> torch.Tensor:
    if isinstance(positions, range):
        return torch.arange(positions.start, positions.stop, dtype=torch.int64)
    return torch.tensor(positions, dtype=torch.int64)


def index_chunks(
    layout: IndexLayout, chunk: int = CHUNK, device: torch.device | str = "cpu"
) -> Iterator[tuple[int, torch.Tensor]]:
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
