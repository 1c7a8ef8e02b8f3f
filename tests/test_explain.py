"""so.explain: planning only, for any mesh; its byte figures are what the runtime really sends."""

import json
import time

import pytest
import torch
import torch.nn.functional as F

import shardops as so
from shardops import Partial, Replicate, Shard
from shardops.dispatch import registry
from shardops.explain import explain, parse_mesh, parse_spec
from shardops.mesh import DeviceMesh

aten = torch.ops.aten
R, S0, S1 = Replicate(), Shard(0), Shard(1)


# ------------------------------------------------------------------ explain's bytes == CommDebugMode's bytes


def _needs(*ops):
    missing = [str(op) for op in ops if op not in registry.RULES]
    assert not missing, f"not registered: {missing}"


# name -> (callable, [(shape, dtype, placements)], kwargs, ops the case needs)
BYTE_CASES = {
    "add S0+S1 (all_to_all)": (torch.add, [((8, 6), torch.float32, [S0]), ((8, 6), torch.float32, [S1])], {}, []),
    "add uneven S0+S0 (local)": (torch.add, [((5, 3), torch.float32, [S0]), ((5, 3), torch.float32, [S0])], {}, []),
    "mul P(sum)*R (stays pending)": (
        torch.mul,
        [((8, 6), torch.float64, [Partial()]), ((8, 6), torch.float64, [R])],
        {},
        [],
    ),
    "exp P(sum) (resolve)": (torch.exp, [((6, 5), torch.float32, [Partial()])], {}, []),
    "maximum P(max),P(max)": (
        torch.maximum,
        [((6, 5), torch.float32, [Partial("max")]), ((6, 5), torch.float32, [Partial("max")])],
        {},
        [],
    ),
    "add P(max)+P(max) (resolve both)": (
        torch.add,
        [((6, 5), torch.float32, [Partial("max")]), ((6, 5), torch.float32, [Partial("max")])],
        {},
        [],
    ),
    "neg P(max)": (torch.neg, [((6, 5), torch.float32, [Partial("max")])], {}, []),
    "view S1 -> flat": (lambda x: x.view(-1), [((8, 6), torch.float32, [S1])], {}, []),
    "transpose S0": (lambda x: x.t(), [((8, 6), torch.float32, [S0])], {}, []),
    "where R,S0,S1": (
        torch.where,
        [((8, 6), torch.bool, [R]), ((8, 6), torch.float32, [S0]), ((8, 6), torch.float32, [S1])],
        {},
        [],
    ),
    "softmax over sharded dim": (torch.softmax, [((8, 12), torch.float32, [S1])], {"dim": 1}, [aten._softmax.default]),
    "softmax of P(sum)": (torch.softmax, [((8, 12), torch.float32, [Partial()])], {"dim": 0}, [aten._softmax.default]),
    "sum over sharded dim": (
        aten.sum.dim_IntList,
        [((8, 6), torch.float32, [S1])],
        {"dim": [1]},
        [aten.sum.dim_IntList],
    ),
    "var over sharded dim": (aten.var.correction, [((8, 6), torch.float64, [S1])], {"dim": [1]}, [aten.var.correction]),
    "logsumexp over sharded dim": (
        aten.logsumexp.default,
        [((8, 6), torch.float32, [S1])],
        {"dim": [1]},
        [aten.logsumexp.default],
    ),
    "cumsum over sharded dim": (
        aten.cumsum.default,
        [((8, 6), torch.float32, [S1])],
        {"dim": 1},
        [aten.cumsum.default],
    ),
    "cross_entropy vocab-parallel": (
        F.cross_entropy,
        [((8, 12), torch.float32, [S1]), ((8,), torch.int64, [R])],
        {},
        [aten._log_softmax.default, aten.nll_loss_forward.default],
    ),
}


def _full(shape, dtype, g):
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(0, 12, shape, generator=g)
    return torch.randn(shape, generator=g, dtype=dtype)


def _counted(fn, inputs, kwargs, mesh_shape=(4,)):
    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        g = torch.Generator().manual_seed(0)
        dts = [so.distribute_tensor(_full(shape, dtype, g), mesh, pl) for shape, dtype, pl in inputs]
        with so.CommDebugMode() as comm:
            fn(*dts, **kwargs)
        return comm.get_total_bytes(), comm.get_rounds()

    return so.run(body, 4)


@pytest.mark.parametrize("name", list(BYTE_CASES))
def test_explain_bytes_match_comm_debug_mode(name):
    fn, inputs, kwargs, needs = BYTE_CASES[name]
    _needs(*needs)
    mesh = parse_mesh(4)
    short = {torch.float32: "f32", torch.float64: "f64", torch.bool: "bool", torch.int64: "i64"}
    specs = [f"{short[dt]}{list(shape)}:{','.join(map(repr, pl))}" for shape, dt, pl in inputs]
    e = explain(fn, *specs, mesh=mesh, **kwargs)
    counted = _counted(fn, inputs, kwargs)
    planned = [(e.bytes_at(mesh.coordinate_of(r)), e.rounds) for r in range(4)]
    assert planned == counted, str(e)


MESH_2D_CASES = {
    "add S0,R + R,S1": (torch.add, [((8, 12), torch.float32, [S0, R]), ((8, 12), torch.float32, [R, S1])], {}, []),
    "softmax S0,S1": (torch.softmax, [((8, 12), torch.float32, [S0, S1])], {"dim": 1}, [aten._softmax.default]),
    # the dim is sharded over both mesh dims: the algorithm sends ONE collective over the 4-rank group
    "softmax S1,S1": (torch.softmax, [((16, 4096), torch.float32, [S1, S1])], {"dim": 1}, [aten._softmax.default]),
    "var S1,S1": (aten.var.correction, [((16, 4096), torch.float32, [S1, S1])], {"dim": [1]}, [aten.var.correction]),
    "exp P(sum),S0": (torch.exp, [((8, 12), torch.float32, [Partial(), S0])], {}, []),
}


@pytest.mark.parametrize("name", list(MESH_2D_CASES))
def test_explain_bytes_match_on_a_2x2_mesh(name):
    fn, inputs, kwargs, needs = MESH_2D_CASES[name]
    _needs(*needs)
    mesh = parse_mesh((2, 2))
    specs = [f"f32{list(shape)}:{','.join(map(repr, pl))}" for shape, _, pl in inputs]
    e = explain(fn, *specs, mesh=mesh, **kwargs)
    counted = _counted(fn, inputs, kwargs, (2, 2))
    assert [(e.bytes_at(mesh.coordinate_of(r)), e.rounds) for r in range(4)] == counted, str(e)


def test_at_least_ten_byte_cases_run():
    runnable = [n for n, (_, _, _, needs) in BYTE_CASES.items() if all(op in registry.RULES for op in needs)]
    assert len(runnable) >= 10


# ------------------------------------------------------------------ any mesh, planning only


@pytest.mark.parametrize("mesh", [(4,), (2, 2), (8, 8, 16), (4096,)], ids=lambda m: "x".join(map(str, m)))
def test_explain_any_mesh(mesh):
    placements = ",".join(["R"] * (len(mesh) - 1) + ["S(1)"])
    e = explain("softmax(x, dim=1)", mesh=mesh, x=f"f32[8,4096]:{placements}")
    step = e.steps[0]
    assert step.op == "aten._softmax.default" and step.chosen is step.options[0] and step.chosen.chosen
    assert step.total >= len(step.options) >= 2
    assert "chosen: #1" in str(e)
    assert e.outputs[0].shape == (8, 4096)


def test_4096_ranks_plan_in_under_a_second():
    explain("x + 1", mesh=4, x="f32[4]:R")  # warm-up (torch's first meta call) is paid and reported separately
    t0 = time.perf_counter()
    e = explain("F.cross_entropy(x, t)", mesh=4096, links="ib", x="f32[64,50304]:S(1)", t="i64[64]:R")
    assert time.perf_counter() - t0 < 1.0
    assert e.timings["warmup_s"] == 0.0 and len(e.steps) == 2


def test_links_change_the_estimate():
    slow = explain("softmax(x, dim=1)", mesh=(8, 8, 16), links="ethernet", x="f32[8,4096]:R,R,S(1)")
    fast = explain("softmax(x, dim=1)", mesh=(8, 8, 16), links="nvlink,ib,ib", x="f32[8,4096]:R,R,S(1)")
    assert fast.links == ["nvlink", "ib", "ib"] and slow.time > fast.time


def test_top_n_and_total_count():
    e = explain("x + y", mesh=(8, 8, 16), top=3, x="f32[64,64]:S(0),S(1),R", y="f32[64,64]:R,S(0),S(1)")
    step = e.steps[0]
    assert len(step.options) == 3 and step.total > 3
    assert f"{step.total} candidate(s), best 3 shown" in str(e)


def test_python_api_with_tensor_spec():
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    x = parse_spec("f32[8,4096]:R,S(1)", mesh)
    a = explain(torch.softmax, x, dim=1)
    b = explain("softmax(x, dim=1)", mesh=mesh, x="f32[8,4096]:R,S(1)")
    assert [o.label for o in a.steps[0].options] == [o.label for o in b.steps[0].options]
    assert a.bytes == b.bytes and a.rounds == b.rounds


def test_so_explain_is_exported():
    assert so.explain is explain


def test_multi_op_expression_shows_each_step():
    _needs(aten._log_softmax.default, aten.nll_loss_forward.default)
    e = explain("F.cross_entropy(x, t)", mesh=4, x="f32[8,1000]:S(1)", t="i64[8]:R")
    assert [s.op for s in e.steps] == ["aten._log_softmax.default", "aten.nll_loss_forward.default"]
    assert e.steps[1].in_specs[0] == e.steps[0].out_specs[0]  # the chosen layout flows into the next op
    assert "%1" in e.steps[1].call


def test_replicate_fallback_is_visible():
    e = explain("torch.cdist(x, y)", mesh=4, x="f32[8,6]:S(0)", y="f32[5,6]:R")
    step = e.steps[0]
    assert step.fallback and not step.replicate_only
    assert "no sharded strategy" in str(e)
    assert registry.REPLICATE_ONLY, "no op is registered as replicate-only"
    e = explain("torch.linalg.svd(x)", mesh=4, x="f32[6,6]:S(0)")
    assert any(s.replicate_only for s in e.steps) and "replicated on purpose" in str(e)


def test_torch_function_interception_is_said():
    assert torch.Tensor.sum in registry.TORCH_FUNCTIONS, "Tensor.sum is not intercepted"
    e = explain("x.sum(1)", mesh=4, x="f32[8,6]:S(1)")
    assert any("Tensor.sum is intercepted" in n for n in e.notes)


def test_to_dict_is_json():
    e = explain("x * 2", mesh=(2, 2), x="f32[8,6]:S(0),P(sum)")
    d = json.loads(json.dumps(e.to_dict()))
    assert d["mesh"] == [2, 2] and d["steps"][0]["candidates"][0]["chosen"] is True
    assert d["inputs"] == {"x": "f32[8,6]:S(0),P(sum)"}


# ------------------------------------------------------------------ clear errors


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"x": "f99[8]:R"}, "unknown dtype"),
        ({"x": "f32[8]:R,R"}, "2 placements"),
        ({"x": "f32[8]:S(3)"}, "shards dim 3"),
        ({"x": "f32[8]:Q"}, "not understood"),
        ({"x": "eight floats"}, "not a tensor spec"),
    ],
    ids=["dtype", "count", "dim", "placement", "garbage"],
)
def test_bad_specs(kwargs, match):
    with pytest.raises(so.ShardingError, match=match):
        explain("x + 1", mesh=4, **kwargs)


def test_bad_expressions():
    with pytest.raises(so.ShardingError, match="unknown name"):
        explain("softmax(z, dim=1)", mesh=4, x="f32[8,6]:R")
    with pytest.raises(so.ShardingError, match="not a Python expression"):
        explain("softmax(x, dim=", mesh=4, x="f32[8,6]:R")
    with pytest.raises(so.ShardingError, match="torch rejects"):
        explain("x + y", mesh=4, x="f32[8,6]:R", y="f32[5]:R")
    with pytest.raises(so.ShardingError, match="give mesh"):
        explain(torch.exp, "f32[8]:R")
