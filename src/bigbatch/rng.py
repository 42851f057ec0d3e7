"""Random-number-generator state as tensors and plain values (``weights_only``-safe), and back."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when present) every CUDA device's generator state."""
    version, py_state, gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python_version": int(version),
        "python_state": torch.tensor(py_state, dtype=torch.int64),  # 625 words
        "python_gauss": gauss,
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),  # 624 words
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate((state["python_version"], tuple(int(x) for x in state["python_state"].tolist()), state["python_gauss"]))
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
