"""Launch a ``@triton.jit`` kernel with less host time: the compiled kernel is looked up once per
specialization and then launched directly.

``fn[grid](*args, **kwargs)`` runs Triton's binder, builds a string cache key and looks the
kernel up on every call: about 40-60 µs of Python per launch on the H200 machine, more than
many decode kernels take on the GPU. A
:class:`Launcher` keys its own dict on what Triton specializes a kernel on (device; per tensor
its dtype and 16-byte alignment; per int whether it is 1, a multiple of 16, and its i32/i64/u64 range;
the keyword arguments, i.e. constexprs and launch options), gets the ``CompiledKernel`` from one
ordinary launch, and afterwards calls it with all parameters in signature order, as Triton's own
launch does. The key is at least as fine as Triton's (ints are keyed on 1 / 16 / 32 bits even
where Triton does not specialize), so a hit never runs a kernel compiled for other arguments.

Tensors off the GPU (the CPU interpreter) take the ordinary launch. Cached launches skip what
Triton re-checks per call for debugging (changed globals, pre-run hooks, the debug knobs); launch
hooks (profilers) still run.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from triton.runtime import driver

__all__ = ["Launcher", "device_facts"]

_I32 = 1 << 31


def _spec(a: Any) -> Any:
    """What Triton may specialize on for one runtime argument."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15 == 0
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):  # Triton: 1 -> constexpr; multiple of 16; i32 / i64 / u64 by range
        return a == 1, a & 15 == 0, -_I32 <= a < _I32, a >= 1 << 63
    if isinstance(a, float):
        return float
    raise TypeError(f"Launcher: unsupported kernel argument of type {type(a).__name__}")


@functools.cache
def device_facts(device: torch.device) -> tuple[int, bool]:
    """``(SM count, programmatic dependent launches possible)`` of ``device``; ``(0, False)`` off
    CUDA (the interpreter). Dependent launches (``launch_pdl``, with ``griddepcontrol`` in the
    kernel) need compute capability 9.0 (Hopper) or newer, and not ROCm."""
    if device.type != "cuda":
        return 0, False
    cc = torch.cuda.get_device_capability(device)
    return torch.cuda.get_device_properties(device).multi_processor_count, torch.version.hip is None and cc[
        0
    ] >= 9


class Launcher:
    """``Launcher(fn)(grid, *args, **kwargs)`` launches ``fn[grid](*args, **kwargs)``.

    ``args``: the runtime parameters, positionally, in signature order; ``kwargs``: constexprs
    and launch options (``num_warps``, ``num_stages``, ``maxnreg``, ``launch_pdl``), the same on
    every call of one specialization (they are part of the key; Triton compiles the options into
    the kernel, whose own launcher applies them on every cached launch).
    """

    def __init__(self, fn: Any):
        self.fn = fn
        params = inspect.signature(getattr(fn, "fn", fn)).parameters
        self._names = list(params)
        self._defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
        self._constexpr = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
        self._cache: dict[tuple, tuple[Any, tuple]] = {}

    def _check_call(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """The key assumes runtime parameters come positionally and constexprs by keyword."""
        positional = set(self._names[: len(args)]) & self._constexpr
        runtime_kw = [k for k in kwargs if k in self._names and k not in self._constexpr]
        if positional or runtime_kw:
            raise TypeError(
                f"Launcher: pass runtime parameters positionally and constexprs by keyword; got constexprs "
                f"{sorted(positional)} positionally and runtime parameters {runtime_kw} by keyword"
            )

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if not args[0].is_cuda:  # the CPU interpreter
            self.fn[grid](*args, **kwargs)
            return
        self.launch(driver.active, grid, args, kwargs)

    def launch(self, drv: Any, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        """The cached launch on ``drv`` (Triton's active driver: current device and stream)."""
        dev = drv.get_current_device()
        key = (dev, tuple(map(_spec, args)), tuple(kwargs.items()))
        hit = self._cache.get(key)
        if hit is None:
            self._check_call(args, kwargs)
            compiled = self.fn[grid](*args, **kwargs)
            if compiled is None:  # nothing to cache (e.g. a compile hook took over): launched already
                return
            # the ordinary launch bound every parameter: the rest are keyword arguments or defaults
            tail = tuple(kwargs[n] if n in kwargs else self._defaults[n] for n in self._names[len(args) :])
            self._cache[key] = (compiled, tail)
            return
        compiled, tail = hit
        # the compiled kernel's runner indexes three grid dims (Triton's own launch pads them)
        compiled[(*grid, 1, 1)[:3]](*args, *tail, stream=drv.get_current_stream(dev))

    def cache_size(self) -> int:
        """Specializations seen (for tests)."""
        return len(self._cache)
