"""What shardops reads of torch's private names, through the seam, still says what torch means.

- callable_name names torch's C builtins as users call them (torch.linalg.vector_norm, not the
  private module its builtin lives in), checked against torch's public namespaces.
- interop maps StridedShard and NormPartial to torch DTensor's private placements and back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor.placement_types import _StridedShard

import shardops as so
from shardops.interop import _our_placement, _torch_placement
from shardops.notation import callable_name


def test_callable_name_names_c_builtins_by_their_public_namespace():
    for fn in (torch.linalg.vector_norm, torch.special.erf, torch.fft.fft):
        name = callable_name(fn)
        namespace, _, short = name.removeprefix("torch.").partition(".")
        assert getattr(getattr(torch, namespace), short) is fn, name
    assert F.gelu.__module__ != "torch.nn.functional"  # a builtin of torch's C nn module, with no public namespace
    assert callable_name(F.gelu) == f"{F.gelu.__module__}.gelu"
    assert callable_name(torch.cumsum) == "torch.cumsum" and callable_name(torch.Tensor.cumsum) == "Tensor.cumsum"


def test_private_placements_convert_both_ways():
    cases = [
        (so.StridedShard(1, 2), _StridedShard(1, split_factor=2)),
        (so.NormPartial(3.0), _NormPartial(norm_type=3.0)),
        (so.Shard(0), torch.distributed.tensor.Shard(0)),
    ]
    for ours, theirs in cases:
        converted = _torch_placement(ours)
        assert type(converted) is type(theirs) and converted == theirs, (ours, converted)
        assert _our_placement(theirs) == ours
