"""What a registry entry is: a :class:`Family` (an architecture's parts and rules) and the
:class:`Build` context its MLP builders get."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...kernels import KernelOps
from .attention import AttnSpec
from .linear import LinearMethod
from .parallel import Comm

__all__ = ["Build", "Family"]


@dataclass(frozen=True)
class Build:
    """What a family's MLP builder gets: the text config, the weight method, the kernels, the
    tensor-parallel group and the parameters' dtype and device."""

    config: Any
    method: LinearMethod
    ops: KernelOps
    comm: Comm | None
    dtype: torch.dtype
    device: Any

    @property
    def kw(self) -> dict[str, Any]:
        return {"comm": self.comm, "dtype": self.dtype, "device": self.device}


def _no_check(config: Any, where: str) -> None:
    return None


def _skip_nothing(config: Any) -> Callable[[str], bool]:
    return lambda key: False


@dataclass(frozen=True)
class Family:
    """One architecture (or a few that share a layout).

    - ``attention(config) -> AttnSpec``; ``mlp(build, layer) -> (module, checkpoint name)``, the
      layer's MLP (:class:`~.moe.DenseMLP` or :class:`~.moe.SparseMoe`) and the name the
      checkpoint stores it under (``mlp``; MiniMax-M2: ``block_sparse_moe``).
    - ``check(config, where)``: family-specific refusals (one-line :class:`ModelError`).
    - ``skipped(config) -> (key -> bool)``: checkpoint tensors the engine does not use (GLM's
      multi-token-prediction layers), dropped at load with one log line.
    - ``split_sizes(config) -> {name: size}``: what ``tensor_parallel`` must divide.
    """

    model_types: tuple[str, ...]
    attention: Callable[[Any], AttnSpec]
    mlp: Callable[[Build, int], tuple[nn.Module, str]]
    split_sizes: Callable[[Any], dict[str, int]]
    check: Callable[[Any, str], None] = _no_check
    skipped: Callable[[Any], Callable[[str], bool]] = _skip_nothing
