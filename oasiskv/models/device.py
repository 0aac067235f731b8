"""Which torch device a process runs its model on, checked before anything is loaded there.

A Ray actor that asked for no GPU sees none (Ray empties CUDA_VISIBLE_DEVICES), and a CPU-only
torch build has no CUDA at all; both would otherwise fail deep inside the first `.to("cuda")`.
"""

from __future__ import annotations

import os

import torch


def parse_device(device: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:N` as a torch.device; anything else is a ValueError naming it."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a device name: use cpu, cuda or cuda:N") from error
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: only cpu and cuda (cuda:N) are supported")
    return parsed


def require_device(device: str) -> torch.device:
    """`parse_device`, and for CUDA a check that this process can use that GPU."""
    parsed = parse_device(device)
    if parsed.type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}), CUDA_VISIBLE_DEVICES={visible!r}"
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available to this process: {where}")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} requested but this process sees {torch.cuda.device_count()} GPU(s): {where}")
    return parsed
