"""A process's random generators as JSON, for checkpoints: each rank saves its own state and a
resumed run draws the same numbers (dropout masks, data shuffles) as an uninterrupted one."""

from __future__ import annotations

import base64
import random
import sys
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """This process's random generators (torch CPU, CUDA if initialised, Python, NumPy if
    imported) as JSON."""
    state: dict[str, Any] = {"torch_cpu": _b64(torch.get_rng_state()), "python": _jsonable(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    if "numpy" in sys.modules:
        name, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["torch_cuda"]])
    if "numpy" in state and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value
