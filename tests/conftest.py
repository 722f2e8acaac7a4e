"""Shared fixtures: the ``../shared`` directory, seeding, a test-built OSCAR rotation pair, and the
server tests' live server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

SHARED_DIR = Path(__file__).resolve().parents[1].parent / "shared"

K_NAME = "k_rotation_qqt_r_h_pbr.pt"
V_NAME = "v_rotation_sst_r_h_pbr.pt"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--smollm2",
        default=str(SHARED_DIR / "models" / "smollm2-135m-instruct"),
        help="SmolLM2-135M-Instruct as a transformers folder (scripts/get_smollm2.sh DIR makes one)",
    )
    parser.addoption(
        "--qwen25-coder",
        default=str(SHARED_DIR / "models" / "qwen2.5-coder-1.5b-instruct"),
        help="Qwen2.5-Coder-1.5B-Instruct as a transformers folder (scripts/get_qwen25_coder.sh DIR makes one)",
    )


@pytest.fixture
def smollm2_dir(request: pytest.FixtureRequest) -> Path:
    """The real pretrained model of docs/real-model.md, or a skip saying how to get it."""
    path = Path(request.config.getoption("--smollm2"))
    if not (path / "config.json").is_file():
        pytest.skip(
            f"SmolLM2-135M-Instruct not found at {path}: run scripts/get_smollm2.sh DIR, pass --smollm2 DIR"
        )
    return path


@pytest.fixture
def qwen25_coder_dir(request: pytest.FixtureRequest) -> Path:
    """Qwen2.5-Coder-1.5B-Instruct (a real head_dim-128 model, docs/eval.md), or a skip saying how
    to get it."""
    path = Path(request.config.getoption("--qwen25-coder"))
    if not (path / "config.json").is_file():
        pytest.skip(
            f"Qwen2.5-Coder-1.5B-Instruct not found at {path}: "
            "run scripts/get_qwen25_coder.sh DIR, pass --qwen25-coder DIR"
        )
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SHARED_DIR.is_dir():
        return
    skip = pytest.mark.skip(reason=f"needs the shared directory {SHARED_DIR}")
    for item in items:
        if "shared" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def shared_dir() -> Path:
    """``<repo>/../shared`` (reference model, RotationZoo files, docs)."""
    if not SHARED_DIR.is_dir():
        pytest.skip(f"needs the shared directory {SHARED_DIR}")
    return SHARED_DIR


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory):
    """The server tests' live server, one per module: the demo model, bf16 KV on the CPU, the
    default chat template (``tests/server/serve_demo.py``; a module that needs another server
    defines its own ``srv``)."""
    from serve_demo import serve_with_template

    s = serve_with_template(tmp_path_factory.mktemp("tpl"))
    yield s
    s.stop()


def random_orthogonal(d: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """A random orthogonal float32 matrix (QR of a Gaussian matrix, computed in float64)."""
    q, r = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=gen))
    return (q * torch.sign(torch.diagonal(r))).float()


def random_rotation_set(layers: int, head_dim: int, spec=None, seed: int = 5):
    """A RotationSet of random orthogonal K/V rotations (unit eigenvalues) for ``layers`` layers."""
    from oscarkv.config import QuantSpec
    from oscarkv.rotation import LayerRotation, RotationSet

    g = torch.Generator().manual_seed(seed)
    d = head_dim

    def layer() -> LayerRotation:
        return LayerRotation(random_orthogonal(d, g), random_orthogonal(d, g), torch.ones(d), torch.ones(d))

    return RotationSet({i: layer() for i in range(layers)}, spec=spec or QuantSpec())


def oscar_decode_scores(model_dir, ids: list[int], rotations, spec) -> list[float]:
    """``log p(ids[p] | ids[:p])`` for ``p >= 1`` as decoding reads the history: ``OscarCache``
    prefilled with the first ``sink + recent`` tokens (all 16-bit), then fed one token at a
    time (the oracle of ``prompt_scoring="decode"``; fp32 on the CPU)."""
    from transformers import AutoModelForCausalLM

    from oscarkv import OscarCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache = OscarCache.from_rotations(model, rotations, spec=spec, backend="torch")
    n0 = min(len(ids), spec.sink_tokens + spec.recent_tokens)
    with torch.no_grad():
        rows = list(model(torch.tensor([ids[:n0]]), past_key_values=cache).logits[0].float().log_softmax(-1))
        for t in range(n0, len(ids) - 1):
            logits = model(torch.tensor([[ids[t]]]), past_key_values=cache).logits[0, -1]
            rows.append(logits.float().log_softmax(-1))
    return [float(rows[p - 1][ids[p]]) for p in range(1, len(ids))]


def tiny_lm_config(kind: str = "qwen3", *, vocab: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                   positions: int = 1024, bias: bool = False):  # fmt: skip
    """A small Qwen3 (q/k norms) or Llama config, hidden 64 and MLP 128, for random-weight models."""
    from transformers import LlamaConfig, Qwen3Config

    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
              max_position_embeddings=positions, attention_bias=bias)  # fmt: skip
    return Qwen3Config(**kw) if kind == "qwen3" else LlamaConfig(**kw)


def write_tiny_lm(config, out: Path) -> Path:
    """A random-weight model of ``config`` (seed 1; embeddings scaled so greedy choices are not
    near-ties) saved to ``out`` with the demo model's tokenizer."""
    import shutil

    from transformers import AutoModelForCausalLM

    from oscarkv.demo import demo_model_path

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(40)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_path() / f, out / f)
    return out


def oscar_dict(rotations: dict, eigenvalues: dict, objective: str) -> dict:
    """A plain dict exactly as OSCAR's compute_kv_rotation.py writes it (spec §2.9)."""
    return {
        "format_version": 1,
        "objective": objective,
        "source_grouping": "layer",
        "layers": {
            lid: {"layer_id": int(lid), "rotation": rotations[lid], "eigenvalues": eigenvalues[lid]}
            for lid in rotations
        },
    }


def write_oscar_pair_files(
    out_dir: Path,
    d: int = 64,
    layer_ids: tuple[int, ...] = (3, 7),
    str_keys: bool = False,
) -> dict:
    """Write k_rotation_qqt_r_h_pbr.pt / v_rotation_sst_r_h_pbr.pt into ``out_dir``.

    Returns the tensors written: ``{"k": {id: R}, "v": {id: R}, "k_eig": ..., "v_eig": ...}``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    data: dict = {"k": {}, "v": {}, "k_eig": {}, "v_eig": {}}
    for lid in layer_ids:
        for kind in ("k", "v"):
            data[kind][lid] = random_orthogonal(d).contiguous()
            data[kind + "_eig"][lid] = torch.sort(torch.rand(d) * 10).values
    for kind, name, objective in (("k", K_NAME, "qqt_r_h_pbr"), ("v", V_NAME, "sst_r_h_pbr")):
        rot = {(str(i) if str_keys else i): data[kind][i] for i in layer_ids}
        eig = {(str(i) if str_keys else i): data[kind + "_eig"][i] for i in layer_ids}
        torch.save(oscar_dict(rot, eig, objective), out_dir / name)
    return data


@pytest.fixture
def write_oscar_pair() -> Callable[..., dict]:
    """Factory: ``write_oscar_pair(dir, d=64, layer_ids=(3, 7), str_keys=False) -> tensors``."""
    return write_oscar_pair_files


@pytest.fixture
def oscar_dir(tmp_path: Path) -> Path:
    """A directory holding a valid test-built OSCAR pair (head_dim 128, layers 3 and 7)."""
    out = tmp_path / "oscar"
    write_oscar_pair_files(out, d=128, layer_ids=(3, 7))
    return out


@pytest.fixture
def make_orthogonal() -> Callable[..., torch.Tensor]:
    """Factory: ``make_orthogonal(d) -> float32 [d, d]`` random orthogonal matrix."""
    return random_orthogonal


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add overhead (and stall badly on a loaded CI box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _close_rotations(got: torch.Tensor, want: torch.Tensor) -> None:
    """Rotated rows one rounding step apart: fp32 sums in another order, and Triton's interpreter
    truncates to bf16 where the GPU rounds (relative 2^-7 = one bf16 step at the bottom of a
    binade); the absolute slack covers outputs near 0, where the fp32 sums' own error dominates."""
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def close_rotations() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The tolerance of a Triton rotation against its torch twin (``kernels/ref/rotate.py``)."""
    return _close_rotations


def run_under_the_interpreter(test_file: str, *args: str, timeout: float = 1200) -> None:
    """Run ``test_file`` (with pytest ``args``) in a fresh process with ``TRITON_INTERPRET=1`` (the
    switch must be set before any kernel is defined) and fail unless it passed and skipped nothing."""
    import os
    import subprocess
    import sys

    import triton  # noqa: F401  (a dev install has triton: its absence is a failure here, not a skip)

    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, test_file]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=Path(__file__).parent.parent
    )
    out = res.stdout + res.stderr
    last = out.strip().splitlines()[-1] if out.strip() else ""
    assert res.returncode == 0 and " passed" in last and "skipped" not in last, out[-4000:]


#: a minimal chat template for the demo tokenizer (it ships none): the chat-prompt tasks' tests
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tok():
    """The demo model's tokenizer with :data:`CHAT_TEMPLATE`."""
    from transformers import AutoTokenizer

    from oscarkv.demo import demo_model_path

    tok = AutoTokenizer.from_pretrained(str(demo_model_path()))
    tok.chat_template = CHAT_TEMPLATE
    return tok
