"""`shardops demo`: the demos, on the tools side of the package (the library never imports them).

    training.py   `shardops demo`: train GPT-2/LLaMA with shardops beside torch DTensor, both
                  checked against single-device training
    ops.py        `shardops demo --ops`: a transformer step's sharded math ops, checked

`python -m shardops.demo` (and `torchrun ... -m shardops.demo`) runs `main`.
"""

from .training import main

__all__ = ["main"]
