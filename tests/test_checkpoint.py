"""Checkpoints in the threads world: torch.save/torch.load of DTensors, torch's DCP format through
`shardops.checkpoint.save/load`, resharding onto other meshes and plans, loud failures.

Every expected value is a global tensor made in the test with torch (seeded generators);
nothing is compared with a value copied from shardops' own output.
"""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

import shardops as so
import shardops.checkpoint as ckpt
from checkpoint_harness import (
    ARGS,
    full,
    shardops_model,
    shardops_step,
    train_and_checkpoint,
)  # tests/ is not a package
from shardops import Partial, Replicate, Shard, StridedShard
from shardops.checkpoint.blocksums import SUMS_FILE
from shardops.models import ModelArgs


def _global(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype in (torch.int64, torch.int32):
        return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)
    if dtype is torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    return torch.randn(shape, generator=gen).to(dtype)


# name -> (shape, dtype, placements on a (2, 2) mesh)
CASES: dict[str, tuple[tuple[int, ...], torch.dtype, list[so.Placement]]] = {
    "even": ((8, 6), torch.float32, [Shard(0), Shard(1)]),
    "uneven": ((7, 5), torch.float32, [Shard(0), Shard(1)]),
    "empty_shards": ((3, 2), torch.float32, [Shard(0), Shard(0)]),  # 3 rows over 4 ranks: one holds none
    "strided": ((4, 12), torch.float32, [Shard(0), StridedShard(1, 2)]),
    "strided_uneven": ((5, 11), torch.float32, [StridedShard(1, 3), Shard(1)]),
    "replicated": ((6, 4), torch.float32, [Replicate(), Replicate()]),
    "half_replicated": ((6, 4), torch.bfloat16, [Replicate(), Shard(0)]),
    "complex": ((4, 6), torch.complex64, [Shard(1), Replicate()]),
    "ints": ((9,), torch.int64, [Shard(0), Shard(0)]),
    "bools": ((5, 3), torch.bool, [Replicate(), Shard(0)]),
    "scalar": ((), torch.float32, [Replicate(), Replicate()]),
    "pending": ((6, 4), torch.float32, [Partial(), Shard(1)]),
}


def _make(mesh, name: str) -> so.DTensor:
    shape, dtype, placements = CASES[name]
    g = _global(name, shape, dtype)
    if any(p.is_partial() for p in placements):
        base = [Replicate() if p.is_partial() else p for p in placements]
        return so.distribute_tensor(g, mesh, base).redistribute(placements=placements)
    return so.distribute_tensor(g, mesh, placements)


def _saved_state(mesh) -> dict:
    return {"t": {name: _make(mesh, name) for name in CASES}, "step": 11, "note": "hello"}


def _empty_like_layout(mesh, name: str, placements) -> so.DTensor:
    shape, dtype, _ = CASES[name]
    return so.distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, placements)


def _other_placements(mesh, name: str) -> list:
    """A plan that differs from the saved one, for any mesh."""
    shape = CASES[name][0]
    if not shape:
        return [Replicate()] * mesh.ndim
    last = len(shape) - 1
    return [Shard(last) if i % 2 == 0 else Shard(0) for i in range(mesh.ndim)]


def _save(path: str) -> None:
    def main():
        mesh = so.init_device_mesh("cpu", (2, 2))
        ckpt.save(_saved_state(mesh), path)

    so.run(main, 4)


def _load_on(path: str, shape: tuple[int, ...]) -> list[dict]:
    def main():
        mesh = so.init_device_mesh("cpu", shape)
        state = {
            "t": {n: _empty_like_layout(mesh, n, _other_placements(mesh, n)) for n in CASES},
            "step": 0,
            "note": "",
        }
        ckpt.load(state, path)
        return {"t": {n: full(t) for n, t in state["t"].items()}, "step": state["step"], "note": state["note"]}

    import math

    return so.run(main, math.prod(shape))


@pytest.mark.parametrize("shape", [(4,), (1,), (2, 2, 2)])
def test_save_then_load_onto_any_mesh_and_plan(tmp_path, shape):
    path = str(tmp_path / "ckpt")
    _save(path)
    for result in _load_on(path, shape):
        assert result["step"] == 11 and result["note"] == "hello"
        for name, (gshape, dtype, _) in CASES.items():
            got = result["t"][name]
            assert got.dtype == dtype and tuple(got.shape) == gshape, name
            assert torch.equal(got, _global(name, gshape, dtype)), name


def test_each_rank_writes_only_its_own_shards_and_replicas_once(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    path = str(tmp_path / "ckpt")
    _save(path)
    md = FileSystemReader(path).read_metadata()
    chunks = {fqn: v.chunks for fqn, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}
    assert len(chunks["t.even"]) == 4 and len(chunks["t.uneven"]) == 4
    assert len(chunks["t.replicated"]) == 1 and len(chunks["t.scalar"]) == 1 and len(chunks["t.pending"]) == 2
    assert len(chunks["t.empty_shards"]) == 3  # the empty shard writes nothing
    assert len(chunks["t.strided"]) == 4 * 2  # two runs per rank
    # every element stored exactly once
    for fqn, cs in chunks.items():
        size = md.state_dict_metadata[fqn].size
        assert sum(torch.Size(c.sizes).numel() for c in cs) == torch.Size(size).numel(), fqn
    # rank r's file holds only boxes of rank r's shard (even: rank r = coordinate (r // 2, r % 2))
    for index, info in md.storage_data.items():
        if index.fqn == "t.even":
            r = int(info.relative_path.split("_")[2])
            assert tuple(index.offset) == ((r // 2) * 4, (r % 2) * 3)


def test_torch_save_and_load_of_dtensors_weights_only(tmp_path):
    def main():
        mesh = so.init_device_mesh("cpu", (2, 2))
        state = {n: _make(mesh, n) for n in CASES}
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        loaded = torch.load(buf)  # weights_only=True by default
        out = {}
        for n, t in loaded.items():
            assert isinstance(t, so.DTensor) and t.placements == state[n].placements and t.device_mesh == mesh, n
            assert torch.equal(t.to_local(), state[n].to_local()), n
            out[n] = full(t)
        (loaded["even"] + state["even"]).full_tensor()  # usable with tensors of the live mesh
        return out

    for result in so.run(main, 4):
        for name, (shape, dtype, _placements) in CASES.items():
            expected = _global(name, shape, dtype)
            assert torch.equal(result[name], expected), name


def test_pickled_dtensor_attaches_to_the_world_that_loads_it(tmp_path):
    def save():
        mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.save({"w": _make(mesh, "uneven")}, tmp_path / f"rank{mesh.get_rank()}.pt")

    def load():
        rank = so.init_device_mesh("cpu", (4,)).get_rank()
        w = torch.load(tmp_path / f"rank{rank}.pt")["w"]
        return w.full_tensor(), w.device_mesh.mesh_dim_names

    so.run(save, 4)
    for got, names in so.run(load, 4):  # a new world: the mesh is rebuilt from its description
        assert names == ("dp", "tp")
        assert torch.equal(got, _global("uneven", (7, 5), torch.float32))


def test_load_state_dict_across_meshes_and_plans():
    def main():
        src, _, _ = shardops_model((4,), seed=1)
        dst, _, _ = shardops_model((2, 2), seed=2)
        dst.load_state_dict(src.state_dict())
        return {n: full(t) for n, t in dst.state_dict().items()}

    from shardops.models import Llama

    expected = Llama(ARGS, seed=1).state_dict()
    for result in so.run(main, 4):
        for name, value in expected.items():
            assert torch.equal(result[name], value), name


def test_copy_across_meshes_moves_only_the_pieces_needed():
    g = _global("copy", (8, 8), torch.float32)

    def main():
        m4 = so.init_device_mesh("cpu", (4,))
        m22 = so.init_device_mesh("cpu", (2, 2))
        src = so.distribute_tensor(g, m4, [Shard(0)])
        dst = so.distribute_tensor(torch.zeros(8, 8), m22, [Shard(0), Shard(1)])
        with so.CommDebugMode() as comm:
            dst.copy_(src)
        return dst.full_tensor(), comm.get_comm_counts(), comm.get_total_bytes()

    for got, counts, nbytes in so.run(main, 4):
        assert torch.equal(got, g)
        assert counts == {"all_to_all": 1}
        assert nbytes <= 16 * 4  # the 16 elements of this rank's destination at most, minus its own


def test_torch_dcp_load_with_no_dist_reads_a_shardops_checkpoint_into_shardops(tmp_path):
    """torch's own dcp.load (each rank alone: no process group in the threads world) goes through
    the subclass hooks: every rank fills its own shard, none is left at its initial value."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    _save(path)

    def main():
        mesh = so.init_device_mesh("cpu", (4,))
        sd = {f"t.{n}": _empty_like_layout(mesh, n, _other_placements(mesh, n)) for n in CASES}
        dcp.load(sd, checkpoint_id=path, no_dist=True)
        return {n: full(t) for n, t in sd.items()}

    for result in so.run(main, 4):
        for name, (shape, dtype, _) in CASES.items():
            assert torch.equal(result[f"t.{name}"], _global(name, shape, dtype)), name


def test_a_checkpoint_missing_shards_fails_loudly(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    path = str(tmp_path / "ckpt")
    _save(path)
    md = FileSystemReader(path).read_metadata()
    md.state_dict_metadata["t.even"].chunks.pop(2)  # as if a rank's shard had never been written
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(so.ShardingError, match=r"\.metadata fail their CRC-32 block check"):
        _load_on(path, (4,))  # an edited .metadata no longer matches its block checksums
    os.remove(os.path.join(path, SUMS_FILE))  # as a checkpoint without them (torch's own): the coverage check
    with pytest.raises(so.ShardingError, match=r"'t\.even'.*covers"):
        _load_on(path, (4,))


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda s, mesh: s["t"].__setitem__("even", so.distribute_tensor(torch.zeros(8, 7), mesh, [Shard(0)])),
            r"'t\.even' mismatches: checkpoint float32\[8, 6\], destination float32\[8, 7\]",
        ),
        (
            lambda s, mesh: s["t"].__setitem__(
                "even", so.distribute_tensor(torch.zeros(8, 6, dtype=torch.float64), mesh, [Shard(0)])
            ),
            r"'t\.even' mismatches: checkpoint float32\[8, 6\], destination float64\[8, 6\]",
        ),
        (
            lambda s, mesh: s["t"].__setitem__("extra", so.distribute_tensor(torch.zeros(2), mesh, [Shard(0)])),
            r"'t\.extra' is not in the checkpoint",
        ),
    ],
)
def test_mismatches_name_the_key_and_both_sides(tmp_path, change, message):
    path = str(tmp_path / "ckpt")
    _save(path)

    def main():
        mesh = so.init_device_mesh("cpu", (4,))
        state = {
            "t": {n: _empty_like_layout(mesh, n, _other_placements(mesh, n)) for n in CASES},
            "step": 0,
            "note": "",
        }
        change(state, mesh)
        ckpt.load(state, path)

    with pytest.raises(so.ShardingError, match=message):
        so.run(main, 4)


def test_a_truncated_storage_file_is_a_clear_error(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path)
    name = os.path.join(path, "__1_0.distcp")
    size = os.path.getsize(name)
    with open(name, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(so.ShardingError, match="truncated|corrupted"):
        _load_on(path, (4,))


def _flip_first_data_byte(path: str, fqn: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from shardops.checkpoint.blob import read_saved_tensor

    md = FileSystemReader(path).read_metadata()
    index, info = next((i, v) for i, v in md.storage_data.items() if i.fqn == fqn)
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        start = read_saved_tensor(f, info.offset, info.length).data_start
        f.seek(start)
        byte = f.read(1)
        f.seek(start)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("shape, verify", [((2, 2), "read"), ((4,), True)])
def test_a_corrupted_storage_file_fails_its_checksum(tmp_path, shape, verify):
    """Same layout: every box is read whole and checked by default. Another layout reads parts
    of boxes: verify=True checks those too."""
    path = str(tmp_path / "ckpt")
    _save(path)
    _flip_first_data_byte(path, "t.uneven")

    def main():
        mesh = so.init_device_mesh("cpu", shape)
        placements = CASES["uneven"][2] if shape == (2, 2) else [Shard(1)]
        ckpt.load({"t": {"uneven": _empty_like_layout(mesh, "uneven", placements)}}, path, verify=verify)

    with pytest.raises(so.ShardingError, match="CRC-32"):
        so.run(main, 4)


def _load_uneven_on_three_columns(path: str, **kwargs) -> torch.Tensor:
    def main():
        mesh = so.init_device_mesh("cpu", (3,))
        w = _empty_like_layout(mesh, "uneven", [Shard(1)])
        ckpt.load({"t": {"uneven": w}}, path, **kwargs)
        return w.full_tensor()

    return so.run(main, 3)[0]


def test_a_corrupted_byte_fails_a_load_onto_another_layout_that_reads_part_of_its_box(tmp_path):
    """(3,) Shard(1) reads two columns of the (2, 2) shard holding the flipped element: a part
    of the saved box, which its archive's whole-box CRC cannot check; the block sums do."""
    path = str(tmp_path / "ckpt")
    _save(path)
    assert torch.equal(_load_uneven_on_three_columns(path), _global("uneven", (7, 5), torch.float32))
    _flip_first_data_byte(path, "t.uneven")
    with pytest.raises(so.ShardingError, match="CRC-32"):
        _load_uneven_on_three_columns(path)


def test_a_checkpoint_without_block_sums_loads_and_checks_each_box_it_reads_from(tmp_path):
    """torch's dcp.save (or an older shardops) writes no block sums: the default load checks
    the archive CRC-32 of every box it reads from, whole or in part."""
    path = str(tmp_path / "ckpt")
    _save(path)
    os.remove(os.path.join(path, SUMS_FILE))
    assert torch.equal(_load_uneven_on_three_columns(path), _global("uneven", (7, 5), torch.float32))
    _flip_first_data_byte(path, "t.uneven")
    with pytest.raises(so.ShardingError, match="CRC-32"):
        _load_uneven_on_three_columns(path)
    _load_uneven_on_three_columns(path, verify="read")  # parts of boxes unchecked, as asked (no raise)


# The fuzz's checkpoint: an uneven tensor, a replicated one and a Python value, saved on (2, 2)
# with small blocks (64 B: a read leaves the blocks of the archive entries it skips unchecked);
# loaded onto three layouts: the saved one, (3,) Shard(1), and (4,) Shard(0) without "rep" (whose
# bytes that load never reads, so flips there must leave its values exact).
FUZZ_LAYOUTS = [((2, 2), [Shard(0), Shard(1)], True), ((3,), [Shard(1)], True), ((4,), [Shard(0)], False)]


def _fuzz_expected() -> dict:
    return {"uneven": _global("uneven", (7, 5), torch.float32), "rep": _global("rep", (3,), torch.float64)}


def _fuzz_save(path: str, monkeypatch) -> None:
    from shardops.checkpoint import blocksums

    monkeypatch.setattr(blocksums, "BLOCK_BYTES", 64)
    expected = _fuzz_expected()

    def main():
        mesh = so.init_device_mesh("cpu", (2, 2))
        state = {
            "uneven": so.distribute_tensor(expected["uneven"], mesh, [Shard(0), Shard(1)]),
            "rep": so.distribute_tensor(expected["rep"], mesh, [Replicate(), Replicate()]),
            "step": 11,
        }
        ckpt.save(state, path)

    so.run(main, 4)


def _fuzz_load(path: str, mesh_shape: tuple[int, ...], placements: list, with_rep: bool) -> list[dict]:
    import math

    def main():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        state = {"uneven": so.distribute_tensor(torch.zeros(7, 5), mesh, placements), "step": 0}
        if with_rep:
            state["rep"] = so.distribute_tensor(torch.zeros(3, dtype=torch.float64), mesh, [Replicate()] * mesh.ndim)
        ckpt.load(state, path)
        return {k: v.full_tensor() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    return so.run(main, math.prod(mesh_shape), timeout=30)


def _fuzz(path: str, every: int) -> tuple[int, int]:
    """Flip every `every`-th byte of every file, one at a time; each load raises or is exact."""
    expected = _fuzz_expected()
    raised = exact = 0
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        for offset in range(0, os.path.getsize(file), every):
            with open(file, "r+b") as f:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0xFF]))
            try:
                for shape, placements, with_rep in FUZZ_LAYOUTS:
                    try:
                        results = _fuzz_load(path, shape, placements, with_rep)
                    except so.ShardingError:
                        raised += 1
                        continue
                    for r in results:
                        assert r["step"] == 11, (name, offset, shape)
                        for key in r.keys() - {"step"}:
                            assert torch.equal(r[key], expected[key]), (name, offset, shape, key)
                    exact += 1
            finally:
                with open(file, "r+b") as f:
                    f.seek(offset)
                    f.write(byte)
    return raised, exact


def test_corrupted_byte_fuzz_subset_every_load_raises_or_is_exact(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    _fuzz_save(path, monkeypatch)
    raised, exact = _fuzz(path, 97 * 7)
    assert raised > 0 and exact > 0


@pytest.mark.slow
def test_corrupted_byte_fuzz_every_97th_byte_every_load_raises_or_is_exact(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    _fuzz_save(path, monkeypatch)
    raised, exact = _fuzz(path, 97)
    print(f"fuzz: {raised} loads raised, {exact} exact")
    assert raised > 0 and exact > 0


@pytest.mark.slow
def test_corrupted_byte_fuzz_without_block_sums_raises_sharding_errors_or_is_exact(tmp_path, monkeypatch):
    """A checkpoint without block sums (torch's dcp.save, older shardops) has the archives' whole-box
    CRC-32s and their structure: the default load raises a ShardingError or is exact at every one of
    these offsets (147 raised, 192 exact when written). Its saved Python objects carry no checksum
    there, so a flip inside one can go unnoticed in general; none of these offsets lands in one."""
    path = str(tmp_path / "ckpt")
    _fuzz_save(path, monkeypatch)
    os.remove(os.path.join(path, SUMS_FILE))
    raised, exact = _fuzz(path, 97)
    print(f"fuzz without block sums: {raised} loads raised, {exact} exact")
    assert raised > 0 and exact > 0


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    path = str(tmp_path / "ckpt")
    _save(path)
    original = FileSystemWriter.write_data

    def dies_on_rank_2(self, plan, planner):
        if so.init_device_mesh("cpu", (4,)).get_rank() == 2:
            raise OSError("disk gone (injected)")
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", dies_on_rank_2)

    def overwrite():
        mesh = so.init_device_mesh("cpu", (2, 2))
        state = _saved_state(mesh)
        state["step"] = 99
        ckpt.save(state, path)

    with pytest.raises((OSError, so.ShardingError), match="injected"):
        so.run(overwrite, 4)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no half-written directory left behind
    for result in _load_on(path, (4,)):
        assert result["step"] == 11


def test_resume_is_bitwise_on_the_same_mesh_and_close_on_another(tmp_path):
    """Model, optimizer (an unstepped one: its state is created to load into), extra values and
    random state: steps 4-6 of a resumed run (a new world) equal the uninterrupted run's bit for
    bit on the same mesh, and within 1e-6 on another mesh. Dropout off here: see the next test
    and tests/test_checkpoint_gloo.py for dropout on."""
    path = str(tmp_path / "ckpt")
    no_dropout = ModelArgs(**{**ARGS.__dict__, "dropout": 0.0})
    whole = so.run(lambda: train_and_checkpoint(path, range(6), False, 2, args=no_dropout), 4)
    resumed = so.run(lambda: train_and_checkpoint(path, range(3, 6), True, None, args=no_dropout), 4)
    for (w, _), (r, loaded_step) in zip(whole, resumed):
        assert loaded_step == 3
        assert r == w[3:]  # bitwise
    other = so.run(lambda: train_and_checkpoint(path, range(3, 6), True, None, mesh_shape=(4,), args=no_dropout), 4)
    assert other[0][0] == pytest.approx(whole[0][0][3:], rel=1e-6, abs=1e-6)


def test_resume_with_dropout_is_bitwise_in_the_threads_world(tmp_path):
    path = str(tmp_path / "ckpt")
    whole = so.run(lambda: train_and_checkpoint(path, range(5), False, 2), 4)
    resumed = so.run(lambda: train_and_checkpoint(path, range(3, 5), True, None), 4)
    assert resumed[0][0] == whole[0][0][3:]


def test_safetensors_weights_load_into_a_parallel_model_reading_only_each_ranks_slices(tmp_path):
    from safetensors.torch import save_file

    from shardops.models import GPT2

    reference = GPT2(ARGS, seed=3)
    weights = {
        k: v.clone().contiguous() for k, v in reference.state_dict().items()
    }  # tied weights saved twice, as files hold them
    save_file(weights, str(tmp_path / "model.safetensors"))

    def main():
        model, mesh, _ = shardops_model((2, 2), seed=0, kind="gpt2")
        report = ckpt.load_safetensors(model, tmp_path)
        local_bytes = sum(
            (t.to_local() if isinstance(t, so.DTensor) else t).nbytes for t in model.state_dict().values()
        )
        return {n: full(t) for n, t in model.state_dict().items()}, report.bytes_read, local_bytes, report.missing

    for params, bytes_read, local_bytes, missing in so.run(main, 4):
        assert not missing
        assert bytes_read == local_bytes  # this rank's slices only
        for name, value in weights.items():
            assert torch.equal(params[name], value), name


def test_safetensors_shape_mismatch_names_the_key(tmp_path):
    from safetensors.torch import save_file

    from shardops.models import GPT2

    weights = {k: v.clone().contiguous() for k, v in GPT2(ARGS, seed=3).state_dict().items()}
    weights["wpe.weight"] = torch.zeros(3, 3)
    save_file(weights, str(tmp_path / "model.safetensors"))

    def main():
        model, _, _ = shardops_model((4,), seed=0, kind="gpt2")
        ckpt.load_safetensors(model, tmp_path / "model.safetensors")

    with pytest.raises(so.ShardingError, match=r"'wpe\.weight' is \[3, 3\] in the file"):
        so.run(main, 4)


def test_tensor_parallel_checkpoint_loads_into_a_fully_sharded_model_and_back(tmp_path):
    """TP on (4,) -> TP on mesh["tp"] + fully_shard per block on mesh["dp"] of (2, 2) -> TP on (4,)."""
    from shardops.models import Llama

    tp_path, dp_path = str(tmp_path / "tp"), str(tmp_path / "dp")

    def main():
        tp_model, _, _ = shardops_model((4,), seed=1)
        ckpt.save({"model": tp_model}, tp_path)
        dp_model, _, _ = shardops_model((2, 2), seed=2, dp_mode="shard")
        ckpt.load({"model": dp_model}, tp_path)
        sharded_over_dp = any(isinstance(p, so.DTensor) and p.placements[0].is_shard() for p in dp_model.parameters())
        loaded = {n: full(t) for n, t in dp_model.state_dict().items()}
        ckpt.save({"model": dp_model}, dp_path)
        back, _, _ = shardops_model((4,), seed=3)
        ckpt.load({"model": back}, dp_path)
        return sharded_over_dp, loaded, {n: full(t) for n, t in back.state_dict().items()}

    expected = Llama(ARGS, seed=1).state_dict()
    for sharded_over_dp, loaded, back in so.run(main, 4):
        assert sharded_over_dp
        for name, value in expected.items():
            assert torch.equal(loaded[name], value) and torch.equal(back[name], value), name


def test_torch_save_of_parameters_and_optimizer_state():
    """nn.Parameter-ness survives (torch marks a subclass parameter with _is_param), and an
    optimizer state dict of DTensors round-trips through torch.save/torch.load(weights_only=True)."""

    def main():
        model, mesh, dp_rank = shardops_model((2, 2), seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        shardops_step(model, opt, 0, dp=2, dp_rank=dp_rank)
        buf = io.BytesIO()
        torch.save({"params": list(model.parameters()), "opt": opt.state_dict()}, buf)
        buf.seek(0)
        loaded = torch.load(buf)
        same_params = all(
            isinstance(q, torch.nn.Parameter) and q.requires_grad and torch.equal(full(q.detach()), full(p.detach()))
            for p, q in zip(model.parameters(), loaded["params"])
        )
        state = opt.state_dict()["state"]
        same_state = all(
            torch.equal(full(loaded["opt"]["state"][i][k]), full(v)) for i, s in state.items() for k, v in s.items()
        )
        return same_params, same_state

    for same_params, same_state in so.run(main, 4):
        assert same_params and same_state


# ------------------------------------------------------------------ edges users hit first (issue 42 items 5-7)


def test_save_to_a_path_with_a_trailing_slash(tmp_path):
    g = _global("slash", (7, 5), torch.float32)
    path = str(tmp_path / "ck") + os.sep

    def main():
        mesh = so.init_device_mesh("cpu", (2,))
        ckpt.save({"w": so.distribute_tensor(g, mesh, [Shard(0)])}, path)
        ckpt.save({"w": so.distribute_tensor(g + 1, mesh, [Shard(0)])}, path)  # replaces the first
        w = so.distribute_tensor(torch.zeros(7, 5), mesh, [Shard(1)])
        ckpt.load({"w": w}, path)
        return w.full_tensor()

    for got in so.run(main, 2):
        assert torch.equal(got, g + 1)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no staging or set-aside directory left behind
    assert not [n for n in os.listdir(tmp_path / "ck") if n.startswith(".") and n not in (".metadata", SUMS_FILE)]


def test_torch_dcp_save_inside_so_run_raises_on_every_rank_and_points_to_shardops(tmp_path):
    """torch's dcp.save sees no process group in the threads world: each rank thread would write
    as a lone rank 0 over the others' files. Every rank raises before anything is written."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ck")

    def main():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(torch.arange(40.0).reshape(10, 4), mesh, [Shard(0)])
        try:
            dcp.save({"x": x}, checkpoint_id=path)
        except BaseException as e:  # torch wraps it in its CheckpointException (a BaseException)
            return str(e)
        return None

    messages = so.run(main, 4)
    assert all(m is not None and "shardops.checkpoint.save" in m and "so.run" in m for m in messages), messages
    assert not os.path.exists(os.path.join(path, ".metadata"))


def test_torch_dcp_load_inside_so_run_reads_what_shardops_saved(tmp_path):
    """torch's dcp.load (no process group: each rank reads alone) works in the threads world."""
    import torch.distributed.checkpoint as dcp

    g = _global("dcp_load", (10, 4), torch.float32)
    path = str(tmp_path / "ck")

    def main():
        mesh = so.init_device_mesh("cpu", (4,))
        ckpt.save({"x": so.distribute_tensor(g, mesh, [Shard(0)])}, path)
        y = so.distribute_tensor(torch.zeros(10, 4), mesh, [Shard(1)])
        dcp.load({"x": y}, checkpoint_id=path)
        return y.full_tensor()

    for got in so.run(main, 4):
        assert torch.equal(got, g)


def test_torch_load_of_a_file_saved_on_a_larger_world_raises_at_once(tmp_path):
    import time

    def save():
        mesh = so.init_device_mesh("cpu", (4,))
        w = so.distribute_tensor(_global("uneven", (7, 5), torch.float32), mesh, [Shard(0)])
        torch.save({"w": w}, tmp_path / f"rank{mesh.get_rank()}.pt")

    def load():
        rank = so.init_device_mesh("cpu", (2,)).get_rank()
        torch.load(tmp_path / f"rank{rank}.pt")["w"].full_tensor()

    so.run(save, 4)
    start = time.monotonic()
    with pytest.raises(so.ShardingError, match=r"DeviceMesh\('cpu', \[0, 1, 2, 3\]\).*world of 2 ranks.*\[2, 3\]"):
        so.run(load, 2, timeout=20)
    assert time.monotonic() - start < 5


# ----------------------------------------------------- load_state_dict across meshes over other ranks (issue 42 item 9)


def _tp_model(mesh) -> torch.nn.Module:
    """Two linears (uneven sizes: 10 rows over 4 ranks, 7 columns over 2 or 4) with a TP plan on `mesh`,
    or plain if None."""
    from shardops.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 10), torch.nn.ReLU(), torch.nn.Linear(10, 7))
    if mesh is not None:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def _zeroed(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


@pytest.mark.parametrize("direction", ["world_to_tp_submesh", "tp_submesh_to_world", "tp_submesh_to_dp_submesh"])
def test_load_state_dict_between_meshes_over_different_ranks(direction):
    """A TP model on (4,) into one on mesh["tp"] of (2, 2) and back, and from the tp sub-meshes
    ({0,1} and {2,3}) to the dp ones ({0,2} and {1,3}): every value equals the single-device model's."""
    expected = _tp_model(None).state_dict()

    def main():
        flat = so.init_device_mesh("cpu", (4,))
        grid = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        src_mesh, dst_mesh = {
            "world_to_tp_submesh": (flat, grid["tp"]),
            "tp_submesh_to_world": (grid["tp"], flat),
            "tp_submesh_to_dp_submesh": (grid["tp"], grid["dp"]),
        }[direction]
        src, dst = _tp_model(src_mesh), _zeroed(_tp_model(dst_mesh))
        with so.CommDebugMode() as comm:
            dst.load_state_dict(src.state_dict())
        return {n: full(t) for n, t in dst.state_dict().items()}, comm.get_comm_counts()

    for result, counts in so.run(main, 4):
        for name, value in expected.items():
            assert torch.equal(result[name], value), name
        assert counts.get("all_to_all") == len(expected)  # the pieces move in one all_to_all per tensor


def test_copy_between_meshes_over_different_ranks_with_pending_and_replicated_sources():
    g = _global("cross", (9, 5), torch.float32)

    def main():
        grid = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        flat = so.init_device_mesh("cpu", (4,))
        rank = flat.get_rank()
        # a pending sum on the tp sub-mesh: each of its two ranks holds a part of g
        part = g * 0.25 if grid["tp"].get_local_rank() == 0 else g * 0.75
        pending = so.DTensor.from_local(part, grid["tp"], [Partial()])
        dst = so.distribute_tensor(torch.zeros(9, 5), flat, [Shard(1)])
        dst.copy_(pending)
        rep = so.distribute_tensor(g, grid["dp"], [Replicate()])
        dst2 = so.distribute_tensor(torch.zeros(9, 5), flat, [Shard(0)])
        dst2.copy_(rep)
        return rank, dst.full_tensor(), dst2.full_tensor()

    for rank, got, got2 in so.run(main, 4):
        assert torch.allclose(got, g, rtol=0, atol=1e-6), rank
        assert torch.equal(got2, g), rank
