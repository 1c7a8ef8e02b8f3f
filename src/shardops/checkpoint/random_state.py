"""`RandomState`: a rank's random state as a checkpointable object (resume bit-exactly).

Two generators feed a shardops run: torch's per-rank default generator (plain-tensor
random ops: dropout on local tensors, init) and shardops' counter-based generator for
DTensor random ops (a seed and a draw counter, `shardops.rng`). Both are per rank, so
the state dict is keyed by rank: each rank saves and loads its own entry (a resumed run
needs the same world size; any mesh shape over it).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import rng
from ..world import current_comm


class RandomState:
    """Pass it in the state of `shardops.checkpoint.save/load` (e.g. `{"rng": RandomState()}`)."""

    def _key(self) -> str:
        return f"rank{current_comm().rank}"

    def state_dict(self) -> dict[str, Any]:
        st = rng.current_state()
        return {
            self._key(): {"torch": torch.get_rng_state(), "seed": st.seed, "counter": st.counter, "epoch": st.epoch}
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = state_dict[self._key()]
        torch.set_rng_state(mine["torch"])
        st = rng.current_state()
        st.seed, st.counter, st.epoch = int(mine["seed"]), int(mine["counter"]), int(mine["epoch"])
