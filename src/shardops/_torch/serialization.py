"""The records torch.save writes for a tensor, as checkpoint/blob.py reads them without torch.load.

A tensor in torch.save's data.pkl is a call of a private rebuild function, named in the file by
module and name: `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
hooks)`, and `_rebuild_tensor_v3(..., dtype)` for dtypes without a typed storage. These are
names in a file format (files written by older torch keep them), not a call into the running
torch; known for the files of torch 2.13, 2.14 and 2.15.
"""

from __future__ import annotations

REBUILD_MODULE = "torch._utils"
REBUILD_TENSOR_V2 = "_rebuild_tensor_v2"
REBUILD_TENSOR_V3 = "_rebuild_tensor_v3"
