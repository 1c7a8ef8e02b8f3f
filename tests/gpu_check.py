"""`make test-gpu`'s first step: exit non-zero, saying why, unless this Python's torch sees a CUDA device.

Runs without torch too (before the venv is built): then it looks for the NVIDIA driver's GPU list.
"""

from __future__ import annotations

import os
import sys


def problem() -> str | None:
    """Why the GPU tests cannot run here, or None."""
    try:
        import torch
    except ImportError:
        gpus = "/proc/driver/nvidia/gpus"
        if os.path.isdir(gpus) and os.listdir(gpus):
            return None  # the venv (with a CUDA build of torch) is built next and checked again
        return f"no NVIDIA GPU ({gpus} is missing or empty) and no torch in {sys.executable}"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} in {sys.executable} is a CPU-only build (torch.version.cuda is None)"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: torch.cuda.is_available() is False"
    return None


if __name__ == "__main__":
    why = problem()
    if why is not None:
        sys.exit(
            f"make test-gpu: cannot run here: {why}. Run it on a machine with a CUDA GPU and a CUDA build of torch."
        )
    import torch

    print(
        f"make test-gpu: {torch.cuda.device_count()} CUDA device(s): {torch.cuda.get_device_name(0)}, torch "
        f"{torch.__version__}"
        if "torch" in sys.modules
        else "make test-gpu: NVIDIA GPU present; torch is installed next"
    )
