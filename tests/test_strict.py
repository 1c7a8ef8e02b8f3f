"""Strict mode means nothing gathered (issue 21): a test per category.

- an op replicated on purpose (linalg, sort over a sharded dim) raises unless so.allow_replicate allows it;
- a plan that gathers a sharded input to run replicated (a rule's implicit all-Replicate row) raises;
- inputs that are all Replicate already run locally: 0 bytes, no warning, in either mode.
"""

import warnings

import pytest
import torch

import shardops as so
from parallel_harness import strict
from shardops import Replicate, Shard

A = torch.randn(8, 8, generator=torch.Generator().manual_seed(51))


def _on_four_ranks(fn, placements, mode=True):
    """fn(x) on x = A laid out in `placements`, strict mode `mode`:
    each rank's (result or error, comm counts, bytes)."""

    def main():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(A, mesh, placements)
        with so.CommDebugMode() as comm:
            try:
                out = fn(x)
            except so.ShardingError as e:
                out = e
        if isinstance(out, so.DTensor):
            out = out.full_tensor()
        elif isinstance(out, tuple):
            out = tuple(o.full_tensor() for o in out)
        return out, comm.get_comm_counts(), comm.get_total_bytes()

    with strict(mode), warnings.catch_warnings():
        warnings.simplefilter("error")  # FallbackWarning included
        return so.run(main, 4)


REPLICATED_ON_PURPOSE = {
    "svd": (lambda x: torch.linalg.svdvals(x), lambda a: torch.linalg.svdvals(a), "_linalg_svd"),
    "qr": (lambda x: torch.linalg.qr(x).R.abs(), lambda a: torch.linalg.qr(a).R.abs(), "linalg_qr"),
    "eigh": (lambda x: torch.linalg.eigvalsh(x), lambda a: torch.linalg.eigvalsh(a), "_linalg_eigh"),
    "solve_triangular": (
        lambda x: torch.linalg.solve_triangular(
            x.triu() + so.from_local(8 * torch.eye(8), x.device_mesh, [Replicate()]), x, upper=True
        ),
        lambda a: torch.linalg.solve_triangular(a.triu() + 8 * torch.eye(8), a, upper=True),
        "linalg_solve_triangular",
    ),
    "diag_embed": (lambda x: torch.diag_embed(x), lambda a: torch.diag_embed(a), "diag_embed"),
    "sort": (lambda x: torch.sort(x, dim=0).values, lambda a: torch.sort(a, dim=0).values, "sort"),
    "argsort": (lambda x: torch.argsort(x, dim=0), lambda a: torch.argsort(a, dim=0), "sort"),
}


@pytest.mark.parametrize("name", list(REPLICATED_ON_PURPOSE))
def test_replicated_on_purpose_raises_unless_allowed(name):
    fn, ref, op = REPLICATED_ON_PURPOSE[name]
    for err, comm, _nbytes in _on_four_ranks(fn, [Shard(0)]):
        assert isinstance(err, so.ShardingError), err
        assert op in str(err) and "bytes" in str(err) and "allow_replicate" in str(err)
        assert comm == {}  # refused before anything moved
    with so.allow_replicate(op):  # the name the error gives
        results = _on_four_ranks(fn, [Shard(0)])
    for out, _comm, nbytes in results:
        torch.testing.assert_close(out, ref(A))
        assert nbytes > 0
    # the block ended: refused again
    assert all(isinstance(r[0], so.ShardingError) for r in _on_four_ranks(fn, [Shard(0)]))


def test_allow_replicate_takes_torch_functions_and_a_global_call():
    allowance = so.allow_replicate(torch.linalg.svd, torch.sort)
    try:
        for out, _, _ in _on_four_ranks(lambda x: torch.linalg.svdvals(x), [Shard(0)]):
            torch.testing.assert_close(out, torch.linalg.svdvals(A))
        for out, _, _ in _on_four_ranks(lambda x: torch.sort(x, dim=0).values, [Shard(0)]):
            torch.testing.assert_close(out, torch.sort(A, dim=0).values)
        assert "so.allow_replicate lets these ops replicate in strict mode: _linalg_svd, sort" in str(
            so.explain("torch.linalg.svd(x)", mesh=(4,), x="f32[8,8]:S(0)")
        )
    finally:
        allowance.__exit__(None, None, None)
    assert all(
        isinstance(r[0], so.ShardingError) for r in _on_four_ranks(lambda x: torch.linalg.svdvals(x), [Shard(0)])
    )
    with pytest.raises(so.ShardingError, match="not an op"):
        so.allow_replicate(3)


def test_explain_says_strict_mode_would_raise():
    text = str(so.explain("torch.linalg.svd(x)", mesh=(4,), x="f32[8,8]:S(0)"))
    assert "strict mode raises unless so.allow_replicate('_linalg_svd')" in text
    assert "allow_replicate" not in str(so.explain("torch.linalg.svd(x)", mesh=(4,), x="f32[8,8]:R"))


GATHERING_ROWS = {  # ops with rules whose only plan for this layout gathers a sharded input and runs replicated
    "einsum_ii": (lambda x: torch.einsum("ii->", x), lambda a: torch.einsum("ii->", a), "diagonal"),
    "diag": (lambda x: torch.diag(x), lambda a: torch.diag(a), "diagonal_copy"),
    "cat_1d": (
        lambda x: torch.cat([x.flatten()[:3], x.flatten()]),
        lambda a: torch.cat([a.flatten()[:3], a.flatten()]),
        "cat",
    ),
}


@pytest.mark.parametrize("name", list(GATHERING_ROWS))
def test_replicating_row_raises_in_strict_mode(name):
    fn, ref, op = GATHERING_ROWS[name]
    for err, _comm, _ in _on_four_ranks(fn, [Shard(0)]):
        assert isinstance(err, so.ShardingError) and op in str(err) and "bytes" in str(err), err
    with so.allow_replicate(op):
        for out, _, _ in _on_four_ranks(fn, [Shard(0)]):
            torch.testing.assert_close(out, ref(A))
    for out, _, _ in _on_four_ranks(fn, [Shard(0)], mode=False):  # non-strict: the gather runs
        torch.testing.assert_close(out, ref(A))


def test_strict_mode_prefers_a_sharded_candidate_to_a_replicating_gather():
    """cat over a sharded dim of 2-d tensors: strict mode moves the shards to another dim (all_to_all),
    never gathers."""
    for out, comm, _ in _on_four_ranks(lambda x: torch.cat([x, x], dim=0), [Shard(0)]):
        torch.testing.assert_close(out, torch.cat([A, A]))
        assert "all_gather" not in comm


ALL_REPLICATE = {
    "floor_divide_int64 (no strategy)": (
        lambda x: torch.floor_divide((x * 10).to(torch.int64), 3),
        lambda a: torch.floor_divide((a * 10).to(torch.int64), 3),
    ),
    "svd (replicated on purpose)": (lambda x: torch.linalg.svdvals(x), lambda a: torch.linalg.svdvals(a)),
    "sort": (lambda x: torch.sort(x, dim=0).values, lambda a: torch.sort(a, dim=0).values),
    "einsum_ii": (lambda x: torch.einsum("ii->", x), lambda a: torch.einsum("ii->", a)),
}


@pytest.mark.parametrize("mode", [True, False], ids=["strict", "default"])
@pytest.mark.parametrize("name", list(ALL_REPLICATE))
def test_all_replicate_inputs_run_locally_without_warning(name, mode):
    fn, ref = ALL_REPLICATE[name]
    for out, comm, nbytes in _on_four_ranks(fn, [Replicate()], mode=mode):
        assert not isinstance(out, Exception), out
        assert comm == {} and nbytes == 0
        torch.testing.assert_close(out, ref(A))
