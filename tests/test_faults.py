"""Rank faults in both worlds: a rank that fails never leaves the others hanging.

Each scenario is one program, run once per rank in the threads world (`so.run`)
and once per process in the torch.distributed world (gloo, one process per rank):

    raise_before   a rank raises before a collective the others are waiting in
    raise_inside   a rank raises inside a sharded algorithm (an injected fault);
                   the others wait inside the same op's collective
    slow           a rank is slower than the timeout; when it comes back, its
                   next collective raises too
    gone           a process exits (gloo) / a rank returns without joining (threads)
    disagree       ranks pass different "replicated" operands (SHARDOPS_DEBUG=1)
    first use      a collective whose group is made on first use, a member gone

and, for the threads world only: a rank busy outside shardops when another fails (so.run
returns `timeout` after the failure), and Ctrl-C in the caller (the rank threads are released).

Every rank that waits in a shardops collective must end with a CollectiveError
(or ShardingError) that names the collective and its ranks, within the timeout
plus a few seconds; nothing hangs; no process or rank thread is left behind;
the threads world works again afterwards.

The gloo runs use `gloo_outcomes`, not `mp.run_gloo`: run_gloo stops at the
first failing rank (as a caller wants), but these tests must see what every
rank went through. Its processes fork from a forkserver with torch already
imported (a spawned process spends seconds importing torch). One test checks
run_gloo itself: it reports the failure and leaves no process behind.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import pytest
import torch
import torch.multiprocessing as torch_mp

import shardops as so
from mp import RankFailure, run_gloo  # tests/ is not a package: pytest put tests/ on sys.path
from shardops import Replicate, Shard, caches
from shardops.dispatch import core
from shardops.dispatch.registry import RULES, strategy
from shardops.mesh import DeviceMesh
from shardops.planner.rows import row

WORLD = 4
FAULT_RANK = 1
THREADS_TIMEOUT = 1.0  # so.run's collective timeout where a scenario waits for it
PG_TIMEOUT = 2.0  # gloo's collective timeout
GLOO_BOUND = PG_TIMEOUT + 5.0
THREADS_BOUND = THREADS_TIMEOUT + 3.0
SETUP_TIMEOUT = 60.0  # gloo: process groups and warm-up, before a scenario arms PG_TIMEOUT
_ARMED_TIMEOUT: float | None = None  # set in a gloo process: the collective timeout once armed


# ------------------------------------------------------------------ an op whose sharded algorithm can fail on one rank

_FAULT_OP: Any = None


def install_fault_op() -> Any:
    """`shardops_faults::total(x, fault_rank)`: column sums of a Shard(0) tensor, one all_reduce inside.

    Rank `fault_rank` raises inside the algorithm, before the all_reduce the others are waiting in.
    Idempotent; every gloo process installs it itself.
    """
    global _FAULT_OP
    if _FAULT_OP is None:

        @torch.library.custom_op("shardops_faults::total", mutates_args=())
        def total(x: torch.Tensor, fault_rank: int) -> torch.Tensor:
            return x.sum(0)

        @total.register_fake
        def _(x, fault_rank):
            return x.new_empty(x.shape[1:])

        _FAULT_OP = torch.ops.shardops_faults.total.default
    strategy(_FAULT_OP)(_fault_rule)
    return _FAULT_OP


def _fault_algorithm(ctx, x: torch.Tensor, fault_rank: int) -> torch.Tensor:
    comm = ctx.mesh.comm
    if comm.rank == fault_rank:
        raise RuntimeError(f"injected fault inside shardops_faults::total on rank {fault_rank}")
    return comm.all_reduce(x.sum(0), "sum", ctx.mesh.group(0))


def _fault_rule(schema) -> list:
    # No comm declared: the row must win over "gather, then sum locally".
    return [row(Replicate(), Shard(0), _fault_algorithm, label="test: sharded total with an injected fault")]


@pytest.fixture
def fault_op():
    op = install_fault_op()
    yield op
    RULES.pop(op, None)  # other test files iterate the registry: leave no test op in it
    caches.invalidate()


# ------------------------------------------------------------------ programs (each rank runs one; both worlds)


def _attempt(record: dict, rank: int, step: Callable[[], Any]) -> tuple[str, str, float]:
    """Run `step`; record (exception type or "ok", message, seconds it took) for this rank."""
    start = time.monotonic()
    try:
        step()
        outcome = ("ok", "", time.monotonic() - start)
    except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
        outcome = (type(e).__name__, str(e), time.monotonic() - start)
    record[rank] = outcome
    return outcome


def _sharded_input(mesh) -> so.DTensor:
    return so.distribute_tensor(torch.ones(8, 6), mesh, [Shard(0), Shard(1)], src_data_rank=None)


def _softmax_full(x: so.DTensor) -> torch.Tensor:
    y = torch.softmax(x, dim=1)
    assert isinstance(y, so.DTensor)
    return y.full_tensor()


def setup_done(mesh) -> None:
    """Every rank is past the setup; from here on, a gloo collective waits at most the scenario's timeout.

    The setup (process groups, the warm-up op) runs under a long timeout: four processes
    on two busy cores drift apart by seconds, and a short timeout there would fail a rank
    before the scenario starts. The barrier keeps a fault from landing in someone's setup.
    """
    mesh.comm.barrier(mesh.group(tuple(range(mesh.ndim))))
    if _ARMED_TIMEOUT is None:  # the threads world
        return
    import torch.distributed.distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=_ARMED_TIMEOUT)
    c10d.default_pg_timeout = timeout  # groups shardops makes later
    for pg in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timeout, pg)


def _in_threads_world() -> bool:
    from shardops.world import in_threads_world

    return in_threads_world()


# Programs run their op once before the fault: a first call plans (and may import) for seconds
# on a busy machine, which would count as waiting otherwise.


def prog_raise_before(record: dict) -> tuple:
    mesh = so.init_device_mesh("cpu", (2, 2))  # collective in gloo: the fault comes after it
    rank = mesh.get_rank()
    x = _sharded_input(mesh)
    _softmax_full(x)
    setup_done(mesh)
    if rank == FAULT_RANK:
        raise RuntimeError(f"injected fault on rank {rank}, before its collective")
    return _attempt(record, rank, lambda: _softmax_full(x))


def prog_raise_inside(record: dict) -> tuple:
    op = install_fault_op()
    mesh = so.init_device_mesh("cpu", (WORLD,))
    rank = mesh.get_rank()
    x = so.distribute_tensor(torch.arange(24.0).reshape(8, 3), mesh, [Shard(0)], src_data_rank=None)
    op(x, -1)  # no fault
    setup_done(mesh)
    if rank == FAULT_RANK:
        op(x, FAULT_RANK)  # raises inside the algorithm
    return _attempt(record, rank, lambda: op(x, FAULT_RANK))


def prog_slow(record: dict, delay: float) -> tuple:
    """The slow rank sleeps `delay` (> the timeout) before its collective, then tries another one."""
    mesh = so.init_device_mesh("cpu", (WORLD,))
    rank = mesh.get_rank()
    x = so.distribute_tensor(torch.ones(8), mesh, [Shard(0)], src_data_rank=None)
    x.full_tensor()
    setup_done(mesh)
    if rank == FAULT_RANK:
        time.sleep(delay)
    first = _attempt(record, rank, lambda: x.full_tensor())
    later: dict = {}
    second = _attempt(later, rank, lambda: x.redistribute(placements=[Replicate()]).to_local())
    record[rank] = (first, second)
    return first, second


def prog_gone(record: dict) -> tuple | str:
    mesh = so.init_device_mesh("cpu", (2, 2))
    rank = mesh.get_rank()
    x = _sharded_input(mesh)
    _softmax_full(x)
    setup_done(mesh)
    if rank == FAULT_RANK:
        time.sleep(0.2)  # the others are inside their collective by now
        if _in_threads_world():
            return "returned without joining"
        os._exit(3)
    return _attempt(record, rank, lambda: _softmax_full(x))


def prog_disagree(record: dict) -> tuple:
    """A plain tensor operand, taken as Replicate under implicit_replication(), that differs between
    ranks (SHARDOPS_DEBUG on)."""
    from shardops.experimental import implicit_replication

    mesh = so.init_device_mesh("cpu", (WORLD,))
    rank = mesh.get_rank()
    x = so.distribute_tensor(torch.ones(8), mesh, [Shard(0)], src_data_rank=None)
    with implicit_replication():
        y = x + torch.ones(8)
        assert isinstance(y, so.DTensor)
        y.full_tensor()
    setup_done(mesh)
    mine = torch.full((8,), float(rank == FAULT_RANK))

    def vouched_but_different():
        with implicit_replication():
            return (x + mine).full_tensor()

    return _attempt(record, rank, vouched_but_different)


def prog_group_made_on_first_use(record: dict):
    """Rank 0's first collective over ranks {0, 2} of a hand-built mesh, whose group is made on first use;
    rank 2 is gone."""
    world = so.init_device_mesh("cpu", (2, 2))
    by_hand = DeviceMesh("cpu", [[0, 1], [2, 3]])  # no torch DeviceMesh behind it: groups come from their members
    rank = world.get_rank()
    setup_done(world)
    if rank == 2:
        if _in_threads_world():
            return "returned without joining"
        os._exit(3)
    if rank != 0:
        return "idle"
    return _attempt(record, rank, lambda: by_hand.comm.all_reduce(torch.ones(2), "sum", by_hand.group(0)))


# ------------------------------------------------------------------ gloo harness: every rank's outcome


_FORKSERVER: Any = None


def _context() -> Any:
    global _FORKSERVER
    if _FORKSERVER is None:
        _FORKSERVER = torch_mp.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(["torch", "torch.distributed", "shardops"])
    return _FORKSERVER


def _gloo_child(
    fn, args, rank: int, world_size: int, port: int, pg_timeout: float, debug: bool, linger: bool, conn
) -> None:
    """One rank: join the gloo world, run `fn`, report; a rank that raised exits at once (as a crashed worker).

    With `linger`, a rank that returned stays alive with its connections open until
    released, so no exit of a healthy rank helps the others notice a fault sooner
    than their own timeouts; otherwise it exits at once too.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    global _ARMED_TIMEOUT
    torch.set_num_threads(1)
    so.set_debug(debug)
    _ARMED_TIMEOUT = pg_timeout
    setup = datetime.timedelta(seconds=SETUP_TIMEOUT)
    c10d.default_pg_timeout = setup  # groups made after init (torch's mesh dims) too, until armed
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=setup)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=setup)
        message = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - sent to the parent
        message = ("error", traceback.format_exc())
    conn.send_bytes(pickle.dumps(message))
    if linger and message[0] == "ok":
        try:
            conn.recv_bytes()
        except (EOFError, OSError):
            pass
    os._exit(0 if message[0] == "ok" else 1)


class GlooRun:
    def __init__(self, outcomes: list, pids: list[int], exitcodes: list, seconds: float) -> None:
        self.outcomes, self.pids, self.exitcodes, self.seconds = outcomes, pids, exitcodes, seconds


def gloo_outcomes(
    fn,
    world_size: int,
    *args,
    pg_timeout: float = PG_TIMEOUT,
    deadline: float = 60,
    debug: bool = False,
    linger: bool = True,
) -> GlooRun:
    """Run `fn(*args)` on `world_size` gloo processes; each rank's outcome, never raising for a rank's failure.

    Outcomes: ("ok", result), ("error", traceback), ("exited", exit code), ("running",) if still
    running at `deadline`. Every process is gone when this returns. The rendezvous store lives
    here, as torchrun's agent holds it: a rank that exits early takes no store down with it.
    """
    import torch.distributed as dist

    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    procs, conns = [], []
    start = time.monotonic()
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_gloo_child,
                args=(fn, args, rank, world_size, port, pg_timeout, debug, linger, child_end),
                daemon=True,
            )
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        outcomes: list[Any] = [("running",)] * world_size
        waiting = dict(enumerate(conns))
        end = time.monotonic() + deadline
        while waiting and time.monotonic() < end:
            for conn in wait(list(waiting.values()), timeout=max(0.0, end - time.monotonic())):
                rank = conns.index(conn)
                try:
                    outcomes[rank] = pickle.loads(conn.recv_bytes())  # type: ignore[union-attr]  # our Connections
                except EOFError:
                    procs[rank].join(5)
                    outcomes[rank] = ("exited", procs[rank].exitcode)
                del waiting[rank]
        seconds = time.monotonic() - start
    finally:
        for conn in conns:
            conn.close()  # releases the lingering ranks
        for proc in procs:
            proc.join(5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        del store
    return GlooRun(outcomes, [p.pid for p in procs], [p.exitcode for p in procs], seconds)


def assert_processes_gone(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"process {pid} is still alive")


def _rank_results(run: GlooRun) -> dict[int, Any]:
    """The returned values of the ranks that returned."""
    return {r: o[1] for r, o in enumerate(run.outcomes) if o[0] == "ok"}


# ------------------------------------------------------------------ threads-world helpers


def rank_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shardops-rank")]


def assert_threads_world_healthy() -> None:
    """No rank thread left, and a fresh so.run computes again."""
    assert rank_threads() == [], rank_threads()

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        x = so.distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0), Shard(1)])
        return torch.equal(x.full_tensor(), torch.arange(12.0).reshape(4, 3))

    assert so.run(body, 4) == [True] * 4


def _run_threads(fn, *args, timeout: float) -> tuple[BaseException | None, dict, float]:
    record: dict = {}
    start = time.monotonic()
    try:
        so.run(fn, WORLD, record, *args, timeout=timeout)
        error = None
    except BaseException as e:  # noqa: BLE001 - checked by the caller
        error = e
    return error, record, time.monotonic() - start


def _assert_collective_error(outcome: tuple, bound: float, *fragments: str) -> None:
    kind, message, seconds = outcome
    assert kind == "CollectiveError", outcome
    assert "over ranks [" in message, message  # names the collective's ranks
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert seconds < bound, outcome


# ------------------------------------------------------------------ raise_before


def test_raise_before_collective_threads():
    error, record, seconds = _run_threads(prog_raise_before, timeout=30)
    assert isinstance(error, RuntimeError) and "injected fault on rank 1" in str(error)
    assert seconds < 10  # released at once, not after the 30 s timeout
    assert sorted(record) == [0, 2, 3]
    for rank in (0, 2, 3):
        _assert_collective_error(record[rank], 10, "aborted", "rank 1 raised RuntimeError: injected fault")
    assert_threads_world_healthy()


def test_raise_before_collective_gloo():
    run = gloo_outcomes(prog_raise_before, WORLD, {})
    assert run.outcomes[FAULT_RANK][0] == "error" and "injected fault on rank 1" in run.outcomes[FAULT_RANK][1]
    results = _rank_results(run)
    assert sorted(results) == [0, 2, 3], run.outcomes
    for rank in (0, 2, 3):
        _assert_collective_error(results[rank], GLOO_BOUND, "failed in torch.distributed")
    assert_processes_gone(run.pids)


# ------------------------------------------------------------------ raise_inside


def test_raise_inside_op_threads(fault_op):
    error, record, seconds = _run_threads(prog_raise_inside, timeout=30)
    assert isinstance(error, RuntimeError) and "injected fault inside shardops_faults::total on rank 1" in str(error)
    assert seconds < 10
    for rank in (0, 2, 3):
        _assert_collective_error(
            record[rank], 10, "all_reduce over ranks [0, 1, 2, 3] aborted", "rank 1 raised RuntimeError"
        )
    assert_threads_world_healthy()


def test_raise_inside_op_gloo():
    run = gloo_outcomes(prog_raise_inside, WORLD, {})
    assert "injected fault inside shardops_faults::total on rank 1" in run.outcomes[FAULT_RANK][1]
    results = _rank_results(run)
    assert sorted(results) == [0, 2, 3], run.outcomes
    for rank in (0, 2, 3):
        _assert_collective_error(
            results[rank], GLOO_BOUND, "all_reduce over ranks [0, 1, 2, 3] failed in torch.distributed"
        )
    assert_processes_gone(run.pids)


# ------------------------------------------------------------------ slow


def test_slow_rank_threads():
    delay = THREADS_TIMEOUT * 1.5  # past the others' timeout, inside so.run's grace period after the failure
    error, record, seconds = _run_threads(prog_slow, delay, timeout=THREADS_TIMEOUT)
    assert error is None  # every rank caught its error and returned
    for rank in (0, 2, 3):
        first, _ = record[rank]
        _assert_collective_error(first, THREADS_BOUND, "rank(s) [1] did not arrive within the timeout of 1s")
    first, second = record[FAULT_RANK]
    _assert_collective_error(first, 1.0, "aborted", "did not arrive within the timeout")  # at once: the world failed
    _assert_collective_error(second, 1.0, "aborted")
    assert seconds < delay + 3
    assert_threads_world_healthy()


def test_slow_rank_gloo():
    delay = PG_TIMEOUT + 1.5
    run = gloo_outcomes(prog_slow, WORLD, {}, delay)
    results = _rank_results(run)
    assert sorted(results) == list(range(WORLD)), run.outcomes
    for rank in (0, 2, 3):
        first, _ = results[rank]
        _assert_collective_error(first, GLOO_BOUND, "failed in torch.distributed")
    # The peers timed out and closed their connections: the late rank's next collectives fail too.
    first, second = results[FAULT_RANK]
    _assert_collective_error(first, GLOO_BOUND, "failed in torch.distributed")
    _assert_collective_error(second, GLOO_BOUND, "failed in torch.distributed")
    assert_processes_gone(run.pids)


# ------------------------------------------------------------------ gone: a process exits / a rank returns early


def test_rank_returns_without_joining_threads():
    error, record, seconds = _run_threads(prog_gone, timeout=30)
    assert error is None  # the waiting ranks caught their errors
    assert seconds < 10  # no wait for the 30 s timeout: a rank that returned will never arrive
    # The ranks that shared a collective with rank 1 see it gone; the rest see the world fail.
    messages = [record[r][1] for r in (0, 2, 3)]
    assert any("rank(s) [1] returned from their function without joining this collective" in m for m in messages), (
        messages
    )
    for rank in (0, 2, 3):
        _assert_collective_error(record[rank], 10)
    assert_threads_world_healthy()


def test_process_exits_gloo():
    run = gloo_outcomes(prog_gone, WORLD, {})
    assert run.outcomes[FAULT_RANK] == ("exited", 3), run.outcomes[FAULT_RANK]
    results = _rank_results(run)
    assert sorted(results) == [0, 2, 3], run.outcomes
    for rank in (0, 2, 3):
        _assert_collective_error(results[rank], GLOO_BOUND, "failed in torch.distributed")
    assert_processes_gone(run.pids)


# ------------------------------------------------------------------ disagree (SHARDOPS_DEBUG)


@pytest.fixture
def debug_checks():
    before = core._state["debug"]  # SHARDOPS_DEBUG=1 runs keep it on afterwards
    so.set_debug(True)
    yield
    so.set_debug(before)


def test_ranks_disagree_on_replicated_operand_threads(debug_checks):
    error, record, _ = _run_threads(prog_disagree, timeout=30)
    assert error is None
    for rank in range(WORLD):
        kind, message, _ = record[rank]
        assert kind == "ShardingError" and "plain tensor operand #1 is taken as Replicate but differs" in message, (
            record[rank]
        )
    assert_threads_world_healthy()


def test_ranks_disagree_on_replicated_operand_gloo():
    run = gloo_outcomes(prog_disagree, WORLD, {}, debug=True)
    results = _rank_results(run)
    assert sorted(results) == list(range(WORLD)), run.outcomes
    for rank in range(WORLD):
        kind, message, _ = results[rank]
        assert kind == "ShardingError" and "plain tensor operand #1 is taken as Replicate but differs" in message, (
            results[rank]
        )
    assert_processes_gone(run.pids)


# ------------------------------------------------------------------ a group made on first use, with a member gone


def test_group_made_on_first_use_with_a_member_gone_threads():
    error, record, seconds = _run_threads(prog_group_made_on_first_use, timeout=30)
    assert error is None and seconds < 10
    _assert_collective_error(record[0], 10, "rank(s) [2] returned from their function")
    assert_threads_world_healthy()


def test_group_made_on_first_use_with_a_member_gone_gloo():
    run = gloo_outcomes(prog_group_made_on_first_use, WORLD, {})
    assert run.outcomes[2] == ("exited", 3)
    outcome = run.outcomes[0]
    assert outcome[0] == "ok", outcome
    assert_processes_gone(run.pids)
    _assert_collective_error(outcome[1], GLOO_BOUND, "over ranks [0, 2]")


# ------------------------------------------------------------------ threads world only: the caller is never stuck


def test_rank_busy_after_a_failure_is_left_behind_threads() -> None:
    """A rank busy outside shardops when another fails: so.run returns `timeout` after the failure."""
    late: dict = {}

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        rank = mesh.get_rank()
        if rank == 0:
            raise RuntimeError("rank 0 fails")
        time.sleep(3 * THREADS_TIMEOUT)  # busy far longer than the grace period
        _attempt(late, rank, lambda: mesh.comm.barrier(mesh.group(0)))

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 fails") as info:
        so.run(body, 2, timeout=THREADS_TIMEOUT)
    assert time.monotonic() - start < THREADS_TIMEOUT + 1.5
    assert any("rank(s) [1] were still running" in note for note in getattr(info.value, "__notes__", []))
    for t in rank_threads():
        t.join(10)
    _assert_collective_error(late[1], 1.0, "aborted", "rank 0 raised RuntimeError")  # its next collective raised
    assert_threads_world_healthy()


@pytest.fixture
def sigint_raises_keyboard_interrupt():
    """Python's own SIGINT handler for the test, whatever the shell set: a job started in the
    background by a script (`make test &`) inherits SIGINT ignored, and `_thread.interrupt_main`
    then does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_interrupted_caller_releases_rank_threads(sigint_raises_keyboard_interrupt) -> None:
    """Ctrl-C in the caller of so.run: the rank threads waiting in a collective are released."""
    import _thread

    record: dict = {}
    started = threading.Barrier(3)  # every rank thread runs before the interrupt

    def body():
        mesh = so.init_device_mesh("cpu", (3,))
        rank = mesh.get_rank()
        started.wait(10)
        if rank == 2:
            time.sleep(1.0)  # never joins before the others are released
            return None
        if rank == 0:
            _thread.interrupt_main()
        _attempt(record, rank, lambda: mesh.comm.all_reduce(torch.ones(2), "sum", mesh.group(0)))

    with pytest.raises(KeyboardInterrupt):
        so.run(body, 3, timeout=30)
    for t in rank_threads():
        t.join(10)
    for rank in (0, 1):
        _assert_collective_error(
            record[rank], 5, "aborted", "the caller of shardops.run stopped waiting (KeyboardInterrupt)"
        )
    assert_threads_world_healthy()


# ------------------------------------------------------------------ run_gloo itself


def prog_raise_or_hang(pid_dir: str) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 0:
        raise ValueError("rank 0 gives up")
    time.sleep(600)  # a hung rank: run_gloo must kill it


def test_run_gloo_reports_failure_and_kills_every_rank(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)rank 0 raised:.*ValueError: rank 0 gives up"):
        run_gloo(prog_raise_or_hang, 2, str(tmp_path), timeout=120, pg_timeout=PG_TIMEOUT)
    assert time.monotonic() - start < 120
    # a rank killed before it wrote its pid file never ran user code; every one that did must be gone
    pids = [int(f.read_text()) for f in sorted(tmp_path.glob("rank*.pid")) if f.read_text().strip()]
    assert (tmp_path / "rank0.pid").exists() and pids
    assert_processes_gone(pids)
