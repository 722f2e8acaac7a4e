"""The cached Triton launcher's keying and argument order, with a stand-in JIT function (CPU).

The GPU lane (tests/test_kernels_gpu.py) checks the real kernels through it.
"""

from __future__ import annotations

import pytest
import torch

from oscarkv.kernels.triton.launch import Launcher


class FakeCompiled:
    def __init__(self, calls: list):
        self.calls = calls

    def __getitem__(self, grid):
        def run(*args, stream=None):
            self.calls.append(("compiled", grid, args, stream))

        return run


class FakeJIT:
    """Records ordinary launches; ``fn`` carries the kernel's signature."""

    def __init__(self):
        self.calls: list = []

        def kernel(A, B, n, x, C: tl.constexpr, D: tl.constexpr = 5):  # noqa: F821 (a string annotation)
            pass

        self.fn = kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("jit", grid, args, kwargs))
            return None if self.no_handle else FakeCompiled(self.calls)

        return run

    no_handle = False


class FakeDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, dev):
        return 1234


def _launch(launcher, a, b, n, x=0.5, **kw):
    launcher.launch(FakeDriver(), (2, 1), (a, b, n, x), {"C": 3, "num_warps": 1, **kw})


def test_second_call_goes_to_the_compiled_kernel_with_all_parameters_in_order():
    fn = FakeJIT()
    launcher = Launcher(fn)
    a, b = torch.zeros(64, dtype=torch.uint8), torch.zeros(8)
    _launch(launcher, a, b, 7)
    _launch(launcher, a, b, 7, x=2.0)  # floats are not specialized: same kernel
    assert [c[0] for c in fn.calls] == ["jit", "compiled"]
    # the first call is the ordinary launch, with the arguments as given
    _, grid, args, kwargs = fn.calls[0]
    assert grid == (2, 1) and kwargs == {"C": 3, "num_warps": 1}
    assert args[0] is a and args[1] is b and args[2:] == (7, 0.5)
    _, grid, args, stream = fn.calls[1]
    assert grid == (2, 1, 1) and stream == 1234  # padded to the three dims the runner indexes
    assert args[:4] == (a, b, 7, 2.0) and args[4:] == (3, 5)  # C from the call, D its default


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"n": 7}, {"n": 1}),  # an int equal to 1
        ({"n": 7}, {"n": 32}),  # a multiple of 16
        ({"n": 7}, {"n": (1 << 33) + 7}),  # beyond 32 bits (and, like 7, neither 1 nor a multiple of 16)
        ({"n": (1 << 40) + 7}, {"n": (1 << 63) + 7}),  # beyond int64: unsigned
        ({"off": 0}, {"off": 1}),  # a tensor off a 16-byte boundary
        ({"dtype": torch.float32}, {"dtype": torch.float16}),
        ({"C": 3}, {"C": 4}),  # a constexpr
        ({"num_warps": 1}, {"num_warps": 4}),  # a launch option
    ],
)
def test_what_triton_specializes_on_gets_its_own_kernel(first, second):
    fn = FakeJIT()
    launcher = Launcher(fn)
    base = torch.zeros(128, dtype=torch.uint8)

    def call(n=7, off=0, dtype=torch.float32, **kw):
        _launch(launcher, base[off:], torch.zeros(8, dtype=dtype), n, **kw)

    call(**first)
    call(**second)
    assert [c[0] for c in fn.calls] == ["jit", "jit"] and launcher.cache_size() == 2
    call(**second)
    assert fn.calls[-1][0] == "compiled"


def test_unsupported_argument_types_are_refused():
    launcher = Launcher(FakeJIT())
    with pytest.raises(TypeError, match="unsupported kernel argument of type str"):
        _launch(launcher, torch.zeros(4), torch.zeros(4), "7")


def test_cpu_tensors_take_the_ordinary_launch():
    fn = FakeJIT()
    launcher = Launcher(fn)
    for _ in range(2):
        launcher((1,), torch.zeros(4), torch.zeros(4), 7, 0.5, C=3)
    assert [c[0] for c in fn.calls] == ["jit", "jit"] and launcher.cache_size() == 0


def test_constexprs_must_come_by_keyword_and_runtime_arguments_positionally():
    launcher = Launcher(FakeJIT())
    a = torch.zeros(4)
    with pytest.raises(TypeError, match=r"constexprs \['C'\] positionally"):
        launcher.launch(FakeDriver(), (1,), (a, a, 7, 0.5, 3), {})
    with pytest.raises(TypeError, match=r"runtime parameters \['x'\] by keyword"):
        launcher.launch(FakeDriver(), (1,), (a, a, 7), {"x": 0.5, "C": 3})


def test_a_launch_without_a_compiled_handle_is_not_cached():
    fn = FakeJIT()
    fn.no_handle = True
    launcher = Launcher(fn)
    for _ in range(2):
        _launch(launcher, torch.zeros(4), torch.zeros(4), 7)
    assert [c[0] for c in fn.calls] == ["jit", "jit"] and launcher.cache_size() == 0


def test_equal_keys_mean_equal_triton_specializations():
    """Against Triton's own specializer (callable on the CPU): two arguments that share a Launcher
    key must get the same type and specialization from Triton, so a cache hit never runs a binary
    specialized for other arguments."""
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from oscarkv.kernels.triton.launch import _spec

    buf = torch.zeros(64, dtype=torch.uint8)
    samples = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1,
               -(2**31) - 16, 2**40, 2**63 - 1, 2**63, 2**63 + 16, True, False, 0.5, -2.0,
               buf, buf[1:], buf[16:], buf.view(torch.int16)[1:], torch.zeros(4), torch.zeros(4)[1:]]  # fmt: skip
    keys = [(type(a), _spec(a)) for a in samples]
    specs = [native(BaseBackend, a, False, True, True) for a in samples]
    for i in range(len(samples)):
        for j in range(i):
            if keys[i] == keys[j]:
                assert specs[i] == specs[j], (samples[i], samples[j], specs[i], specs[j])
