"""Every row of docs/errors.md: the input fails with exit code 2 (or a typed exception), one
error line plus at most one hint line, no traceback, the message holds the row's words, and no
file under the test's directory changed. CLI rows other than ``gen-positions`` must fail before
any model weights load (``load_model`` is replaced by a trap)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import random_orthogonal
from oscarkv.cli import main
from oscarkv.demo import demo_model_path
from oscarkv.errors import OscarkvError

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
ROW = re.compile(r"^\| ([a-z0-9-]+) \| (.+) \| (.+) \|$")


def doc_rows() -> dict[str, list[str]]:
    """id -> the words its message must hold (the backticked parts of the last column)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m and m.group(1) != "id":
            rows[m.group(1)] = re.findall(r"`([^`]+)`", m.group(3))
    return rows


# ---- the test's world ---------------------------------------------------------------------
@dataclass
class World:
    root: Path
    model: Path  # a copy of the demo model (2,048 positions, head dim 128, 4 layers)
    rot: Path  # an artifact for it, with its config fingerprint
    other_rot: Path  # an artifact for another model (head dim 64)

    def snapshot(self) -> dict[str, str]:
        return {
            str(p.relative_to(self.root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file()
            else "dir"
            for p in sorted(self.root.rglob("*"))
        }


def _rotations(layers: int, d: int, config: dict | None, seed: int):
    from oscarkv.rotation import LayerRotation, Provenance, RotationSet, config_fingerprint

    g = torch.Generator().manual_seed(seed)
    rs = {
        i: LayerRotation(random_orthogonal(d, g), random_orthogonal(d, g), torch.ones(d), torch.ones(d))
        for i in range(layers)
    }
    prov = Provenance(model_name="test", config_hash=config_fingerprint(config) if config else "")
    return RotationSet(rs, provenance=prov)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    from oscarkv.rotation import save_rotations

    root = tmp_path_factory.mktemp("errors")
    model = root / "model"
    shutil.copytree(demo_model_path(), model)
    cfg = json.loads((model / "config.json").read_text())
    rot, other = root / "rot", root / "other_rot"
    save_rotations(_rotations(4, 128, cfg, 0), rot)
    save_rotations(_rotations(4, 64, None, 1), other)
    return World(root, model, rot, other)


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    import oscarkv.hf.loading as loading

    def trap(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(loading, "load_model", trap)


# ---- running a case -------------------------------------------------------------------------
@dataclass
class Failure:
    message: str  # the error line (CLI) or str(exception)
    hint: str


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str], after_load: bool = False) -> Failure:
    """Run the CLI in-process. Only a run that fails after the model loads (``after_load``) may
    print something (transformers' loading bar) before its error line."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse usage errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, f"exit code {rc}; stderr: {err}"
    assert "Traceback" not in err
    lines = err.strip("\n").splitlines()
    if after_load:
        lines = lines[next(i for i, x in enumerate(lines) if x.startswith("oscarkv ")) :]
    prefix = f"oscarkv {argv[0]}: error: " if argv else "oscarkv: error: "
    assert lines and lines[0].startswith(prefix), err
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("  hint: ")), err
    return Failure(lines[0], lines[1] if len(lines) > 1 else "")


def run_api(fn: Callable[[], object]) -> Failure:
    with pytest.raises(OscarkvError) as ei:
        fn()
    msg, hint = str(ei.value), getattr(ei.value, "hint", "")
    assert "\n" not in msg and "\n" not in hint, (msg, hint)
    return Failure(msg, hint)


def cli(
    argv: list[str], capsys: pytest.CaptureFixture[str], after_load: bool = False
) -> Callable[[], Failure]:
    """The CLI run of ``argv`` (its inputs already built), to call once the files are snapshot."""
    return lambda: run_cli(argv, capsys, after_load)


def api(fn: Callable[[], object]) -> Callable[[], Failure]:
    return lambda: run_api(fn)


def each(runs: list[Callable[[], Failure]], word: str) -> Callable[[], Failure]:
    """Several inputs of one row: each must fail and name ``word``; the last failure is returned."""

    def go() -> Failure:
        for run in runs:
            f = run()
            assert word in f.message, f
        return f

    return go


#: row id -> case(world, capsys): builds the inputs, returns the run to check
CASES: dict[str, Callable[[World, pytest.CaptureFixture[str]], Callable[[], Failure]]] = {}


def case(*ids: str):
    def deco(fn):
        for i in ids:
            CASES[i] = fn
        return fn

    return deco


def cal(w: World, *extra: str, model: Path | None = None, out: Path | None = None) -> list[str]:
    return ["calibrate", "--model", str(model or w.model), "--out", str(out or w.root / "cal-out"), *extra]


def gen(w: World, *extra: str, prompt: str = "def f():", rot: Path | None = None) -> list[str]:
    return ["generate", "--model", str(w.model), "--rotations", str(rot or w.rot), "--prompt", prompt, *extra]


def ev(w: World, *extra: str) -> list[str]:
    return ["eval", "--model", str(w.model), "--out", str(w.root / "eval-out"), "--methods", "bf16", *extra]


def fake_model(w: World, name: str, config: dict, weights: bool = True, tokenizer: bool = True) -> Path:
    d = w.root / "models" / name
    if not d.exists():
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(config))
        if weights:
            from safetensors.torch import save_file

            save_file({"w": torch.zeros(1)}, str(d / "model.safetensors"))
        if tokenizer:
            shutil.copy(w.model / "tokenizer.json", d / "tokenizer.json")
    return d


def hf_config(kind: str, **kw) -> dict:
    import transformers

    return getattr(transformers, kind)(**kw).to_dict()


def put(w: World, name: str, data: bytes) -> Path:
    p = w.root / "inputs" / name
    if not p.exists():
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(data)
    return p


def artifact_with(w: World, name: str, edit: Callable[[dict], object]) -> Path:
    """A copy of the world's artifact whose metadata JSON is ``edit(meta)`` (or meta edited in place)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    d = w.root / "artifacts" / name
    if not d.exists():
        src = str(w.rot / "rotations.safetensors")
        with safe_open(src, framework="pt") as f:
            meta = json.loads(f.metadata()["oscarkv"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        new = edit(meta)
        d.mkdir(parents=True)
        save_file(
            tensors,
            str(d / "rotations.safetensors"),
            metadata={"oscarkv": json.dumps(meta if new is None else new)},
        )
    return d


# ---- outputs ---------------------------------------------------------------------------------
@case("out-model-file")
def _(w, c):
    return cli(cal(w, out=w.model / "model.safetensors"), c)


@case("out-in-model")
def _(w, c):
    return cli(cal(w, out=w.model / "rotations"), c)


@case("out-taken")
def _(w, c):
    return cli(cal(w, out=w.rot), c)


@case("out-unwritable")
def _(w, c):
    return cli(cal(w, out=put(w, "plain.txt", b"x") / "sub"), c)


@case("eval-out-file")
def _(w, c):
    return cli(
        ["eval", "--model", str(w.model), "--out", str(put(w, "plain.txt", b"x")), "--methods", "bf16"], c
    )


@case("eval-out-taken")
def _(w, c):
    d = w.root / "old-eval"
    if not d.exists():
        d.mkdir()
        (d / "results.json").write_text("{}")
    return cli(["eval", "--model", str(w.model), "--out", str(d), "--methods", "bf16"], c)


# ---- model directories -------------------------------------------------------------------------
@case("model-missing")
def _(w, c):
    return cli(cal(w, model=w.root / "nope"), c)


@case("model-file")
def _(w, c):
    return cli(cal(w, model=w.model / "config.json"), c)


@case("model-empty")
def _(w, c):
    d = w.root / "models" / "empty"
    d.mkdir(parents=True, exist_ok=True)
    return cli(cal(w, model=d), c)


@case("model-bad-json")
def _(w, c):
    d = fake_model(w, "badjson", {})
    (d / "config.json").write_text("{not json")
    return cli(cal(w, model=d), c)


@case("model-no-weights")
def _(w, c):
    return cli(
        cal(
            w,
            model=fake_model(
                w, "noweights", json.loads((w.model / "config.json").read_text()), weights=False
            ),
        ),
        c,
    )


@case("model-no-tokenizer")
def _(w, c):
    return cli(
        cal(
            w,
            model=fake_model(w, "notok", json.loads((w.model / "config.json").read_text()), tokenizer=False),
        ),
        c,
    )


@case("model-unknown-type")
def _(w, c):
    return cli(cal(w, model=fake_model(w, "unknown", {"model_type": "qwen99-moe-turbo"})), c)


@case("model-mamba")
def _(w, c):
    return cli(cal(w, model=fake_model(w, "mamba", hf_config("MambaConfig", num_hidden_layers=2))), c)


@case("model-bert")
def _(w, c):
    return cli(cal(w, model=fake_model(w, "bert", hf_config("BertConfig", num_hidden_layers=2))), c)


@case("model-sliding")
def _(w, c):
    cfg = hf_config("MistralConfig", num_hidden_layers=2, sliding_window=4096)
    return cli(cal(w, model=fake_model(w, "mistral", cfg)), c)


# ---- calibration data and flags -------------------------------------------------------------------
@case("data-binary")
def _(w, c):
    return cli(cal(w, "--data", str(put(w, "blob.txt", b"\x7fELF\x00\x01\x02" * 50))), c)


@case("data-utf16")
def _(w, c):
    return cli(cal(w, "--data", str(put(w, "u16.txt", "def f(): pass\n".encode("utf-16")))), c)


@case("data-latin1")
def _(w, c):
    return cli(cal(w, "--data", str(put(w, "latin1.txt", "café = 1\n".encode("latin-1")))), c)


@case("data-empty")
def _(w, c):
    return cli(cal(w, "--data", str(put(w, "blank.txt", b"  \n\n"))), c)


@case("out-proc")
def _(w, c):
    if not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    return cli(cal(w, out=Path("/proc/oscarkv-test")), c)


@case("out-artifact-is-dir")
def _(w, c):
    d = w.root / "odd-out"
    (d / "rotations.safetensors").mkdir(parents=True, exist_ok=True)
    return cli(cal(w, out=d), c)


@case("data-missing")
def _(w, c):
    return cli(cal(w, "--data", str(w.root / "missing.txt")), c)


@case("spec-recent")
def _(w, c):
    return cli(cal(w, "--recent-tokens", "1000000000"), c)


@case("spec-demote")
def _(w, c):
    return cli(cal(w, "--demote-block", "1000000"), c)


@case("cal-seq-len")
def _(w, c):
    return cli(cal(w, "--seq-len", "4096"), c)


@case("cal-export-kv-head")
def _(w, c):
    return cli(cal(w, "--export-oscar", "--granularity", "kv_head"), c)


@case("cal-export-auto")
def _(w, c):
    return cli(cal(w, "--export-oscar"), c)


@case("device-cuda")
def _(w, c):
    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device")
    return cli(cal(w, "--device", "cuda"), c)


@case("device-bad")
def _(w, c):
    return cli(cal(w, "--device", "gpu0"), c)


# ---- info and artifacts ---------------------------------------------------------------------------
@case("info-missing")
def _(w, c):
    return cli(["info", str(w.root / "nope")], c)


@case("info-config-missing")
def _(w, c):
    return cli(["info", str(w.rot), "--model-config", str(w.root / "nope.json")], c)


@case("info-config-json")
def _(w, c):
    return cli(["info", str(w.rot), "--model-config", str(put(w, "bad.json", b"{oops"))], c)


@case("info-truncated")
def _(w, c):
    d = w.root / "artifacts" / "truncated"
    if not d.exists():
        d.mkdir(parents=True)
        data = (w.rot / "rotations.safetensors").read_bytes()
        (d / "rotations.safetensors").write_bytes(data[: len(data) // 2])
    return cli(["info", str(d)], c)


def _drop(key: str) -> Callable[[dict], None]:
    def edit(meta: dict) -> None:
        del meta[key]

    return edit


@case("info-no-layer-ids")
def _(w, c):
    return cli(["info", str(artifact_with(w, "no-layer-ids", _drop("layer_ids")))], c)


@case("info-no-granularity")
def _(w, c):
    return cli(["info", str(artifact_with(w, "no-granularity", _drop("granularity")))], c)


@case("info-no-provenance")
def _(w, c):
    return cli(["info", str(artifact_with(w, "no-provenance", _drop("provenance")))], c)


@case("info-meta-list")
def _(w, c):
    return cli(["info", str(artifact_with(w, "meta-list", lambda m: [m]))], c)


@case("info-clip-range")
def _(w, c):
    runs = []
    for bad in (5.0, -1.0, math.nan, "abc"):
        d = artifact_with(w, f"clip-{bad}", lambda m, bad=bad: m.__setitem__("clips", {"0": [bad, None]}))
        runs.append(cli(["info", str(d)], c))
    return each(runs, "clip")


@case("info-strict")
def _(w, c):
    cfg = json.loads((w.model / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}  # same shapes, another model
    other = put(w, "other-config.json", json.dumps(cfg).encode())
    return cli(["info", str(w.rot), "--model-config", str(other), "--strict"], c)


@case("info-pickle")
def _(w, c):
    import os

    d = w.root / "artifacts" / "pickle"
    if not d.exists():
        d.mkdir(parents=True)
        torch.save({"layers": {0: {"rotation": torch.eye(4)}}, "x": os.getcwd}, d / "k_rotation_x.pt")
        torch.save({"layers": {0: {"rotation": torch.eye(4)}}}, d / "v_rotation_x.pt")
    return cli(["info", str(d)], c)


# ---- generate ------------------------------------------------------------------------------
@case("gen-empty")
def _(w, c):
    return cli(gen(w, prompt=""), c)


@case("gen-at")
def _(w, c):
    return cli(gen(w, prompt="@"), c)


@case("gen-at-missing")
def _(w, c):
    return cli(gen(w, prompt=f"@{w.root / 'missing.txt'}"), c)


@case("gen-at-dir")
def _(w, c):
    return cli(gen(w, prompt=f"@{w.model}"), c)


@case("gen-at-latin1")
def _(w, c):
    return cli(gen(w, prompt=f"@{put(w, 'prompt-latin1.txt', 'résumé'.encode('latin-1'))}"), c)


@case("gen-temperature")
def _(w, c):
    return each([cli(gen(w, "--sample", "--temperature", t), c) for t in ("-1", "0", "nan")], "temperature")


@case("gen-top-p")
def _(w, c):
    return cli(gen(w, "--sample", "--top-p", "1.5"), c)


@case("gen-max-new")
def _(w, c):
    return each([cli(gen(w, "--max-new-tokens", n), c) for n in ("0", "-5")], "max_new_tokens")


@case("gen-no-sample")
def _(w, c):
    return cli(gen(w, "--temperature", "0.5"), c)


@case("gen-positions")
def _(w, c):
    return cli(gen(w, "--max-new-tokens", "5000", "--device", "cpu"), c, after_load=True)


@case("gen-rot-other-model")
def _(w, c):
    return cli(gen(w, rot=w.other_rot), c)


@case("gen-rot-missing")
def _(w, c):
    return cli(gen(w, rot=w.root / "nope"), c)


@case("gen-engine-only-flag")
def _(w, c):
    return cli(gen(w, "--kv-dtype", "bf16"), c)


@case("gen-engine-prompts")
def _(w, c):
    f = put(w, "reqs.jsonl", b'{"prompt": "a"}\n{"text": "b"}\n')
    return cli(
        ["generate", "--engine", "--model", str(w.model), "--rotations", str(w.rot), "--prompts", str(f)], c
    )


@case("gen-engine-out-exists")
def _(w, c):
    return cli([*gen(w, "--engine", "--out", str(put(w, "plain.txt", b"x")))], c)


@case("gen-engine-budget")
def _(w, c):
    return cli([*gen(w, "--engine", "--kv-budget-gb", "0.000001", "--device", "cpu")], c)


@case("gen-max-new-positions")
def _(w, c):
    return cli(gen(w, "--max-new-tokens", "2048"), c)


@case("gen-backend")
def _(w, c):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    return cli(gen(w, "--backend", "triton", "--device", "cpu"), c)


@case("cal-group-size")
def _(w, c):
    return cli(cal(w, "--group-size", "48"), c)


@case("cal-clip-per-layer")
def _(w, c):
    return cli(cal(w, "--clip-per-layer"), c)


def _model_copy(w: World, name: str) -> Path:
    d = w.root / "models" / name
    if not d.exists():
        shutil.copytree(w.model, d)
    return d


@case("model-truncated")
def _(w, c):
    d = _model_copy(w, "truncated")
    f = d / "model.safetensors"
    if f.stat().st_size > 1000:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return cli(cal(w, model=d), c)


@case("model-bad-tokenizer")
def _(w, c):
    d = _model_copy(w, "badtok")
    (d / "tokenizer.json").write_text("{bad")
    return cli(cal(w, model=d), c)


@case("model-bad-field")
def _(w, c):
    d = _model_copy(w, "badfield")
    cfg = json.loads((d / "config.json").read_text())
    cfg["head_dim"] = "abc"
    (d / "config.json").write_text(json.dumps(cfg))
    return cli(cal(w, model=d), c)


@case("no-command")
def _(w, c):
    return cli([], c)


@case("info-strict-alone")
def _(w, c):
    return cli(["info", str(w.rot), "--strict"], c)


@case("eval-rot-unused")
def _(w, c):
    return cli(ev(w, "--rotations", str(w.rot)), c)


@case("eval-tasks-twice")
def _(w, c):
    return cli(ev(w, "--tasks", "ppl,ppl"), c)


# ---- eval ------------------------------------------------------------------------------------
@case("eval-methods-unknown")
def _(w, c):
    return cli(ev(w, "--methods", "bf16,foo"), c)


@case("eval-methods-empty")
def _(w, c):
    return cli(ev(w, "--methods", ""), c)


@case("eval-passkey")
def _(w, c):
    return cli(ev(w, "--passkey-at-context", "-5"), c)


@case("eval-quick-context")
def _(w, c):
    return cli(ev(w, "--quick", "--context", "8192"), c)


@case("eval-context")
def _(w, c):
    return cli(ev(w, "--context", "4096"), c)


@case("eval-oscar-no-rot")
def _(w, c):
    return cli(ev(w, "--methods", "bf16,oscar"), c)


# ---- Python API --------------------------------------------------------------------------------
def _model(w: World):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(w.model, dtype=torch.float32).eval()


@case("api-absorb-other")
def _(w, c):
    from oscarkv import OscarCache, load_rotations

    m = _model(w)
    a = load_rotations(w.rot)
    b = _rotations(4, 128, None, 7)
    OscarCache.from_rotations(m, a, absorb_v=True)
    OscarCache.from_rotations(m, a)  # the same rotations again: allowed, nothing absorbed twice
    return api(lambda: OscarCache.from_rotations(m, b))


@case("api-absorb-twice")
def _(w, c):
    from oscarkv import load_rotations
    from oscarkv.hf.absorb import absorb_value_rotation

    m, a = _model(w), load_rotations(w.rot)
    absorb_value_rotation(m, a)
    return api(lambda: absorb_value_rotation(m, a))


@case("api-spec-recent")
def _(w, c):
    from oscarkv import QuantSpec

    return api(lambda: QuantSpec(recent_tokens=10**9))


def _forward_with_values(w: World, scale_v: float) -> Callable[[], object]:
    from oscarkv import OscarCache, QuantSpec, load_rotations

    m = _model(w)
    with torch.no_grad():
        m.model.layers[1].self_attn.v_proj.weight.mul_(scale_v)
    spec = QuantSpec(sink_tokens=4, recent_tokens=8, meta_dtype="fp16")
    cache = OscarCache.from_rotations(m, load_rotations(w.rot), spec=spec, backend="torch")
    ids = torch.randint(0, 2048, (1, 48))

    def go():
        with torch.no_grad():
            m(ids, past_key_values=cache)
        cache.memory_report()

    return go


@case("api-fp16-overflow")
def _(w, c):
    _forward_with_values(w, 1.0)()  # ordinary values: no error
    return api(_forward_with_values(w, 2e5))


@case("api-nan")
def _(w, c):
    return api(_forward_with_values(w, math.nan))


@case("api-save-over-model")
def _(w, c):
    from oscarkv import load_rotations, save_rotations

    rs = load_rotations(w.rot)
    return api(lambda: save_rotations(rs, w.model / "model.safetensors", overwrite=True))


# ---- the tests ---------------------------------------------------------------------------------
def test_every_documented_row_has_a_case() -> None:
    rows = doc_rows()
    assert len(rows) >= 60
    assert set(rows) == set(CASES), (sorted(set(rows) - set(CASES)), sorted(set(CASES) - set(rows)))


@pytest.mark.parametrize("row", sorted(doc_rows()))
def test_row(
    row: str, world: World, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    if not row.startswith(("api-", "gen-positions")):
        request.getfixturevalue("no_load")
    run = CASES[row](world, capsys)
    before = world.snapshot()
    failure = run()
    for words in doc_rows()[row]:
        assert words in failure.message + failure.hint, (words, failure)
    assert world.snapshot() == before, "an input file changed or an output was left behind"


# ---- what the checks leave working -----------------------------------------------------------------
def test_fingerprint_mismatch_is_one_warning_line_without_strict(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = json.loads((world.model / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
    other = put(world, "other-config.json", json.dumps(cfg).encode())
    assert main(["info", str(world.rot), "--model-config", str(other)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("oscarkv info: warning: ") and "--strict" in err[0], err
    assert main(["info", str(world.rot), "--model-config", str(world.model / "config.json")]) == 0
    assert capsys.readouterr().err == ""


def test_calibrate_refuses_then_overwrites_only_its_own_files(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cal"
    argv = [
        *cal(world, out=out),
        "--tokens",
        "256",
        "--seq-len",
        "128",
        "--holdout-tokens",
        "0",
        "--offsets",
        "none",
        "--max-ppl-increase",
        "none",
        "--granularity",
        "layer",
        "--quiet",
    ]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert "Token indices" not in first.err + first.out  # transformers' long-input warning is silenced
    art = out / "rotations.safetensors"
    assert art.stat().st_mode & 0o777 == 0o644
    (out / "notes.txt").write_text("mine")
    before = art.read_bytes()
    assert main(argv) == 2
    assert "already holds rotations.safetensors" in capsys.readouterr().err
    assert art.read_bytes() == before
    assert main([*argv, "--seed", "1", "--overwrite"]) == 0
    assert art.read_bytes() != before and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == [
        "notes.txt",
        "rotations.safetensors",
    ]  # no temp file left


def test_a_literal_at_prompt_and_a_file_prompt(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    f = put(world, "prompt.txt", b"def add(a, b):")
    for prompt in ("@@decorator", f"@{f}"):
        assert main(gen(world, "--max-new-tokens", "2", "--device", "cpu", prompt=prompt)) == 0
        assert "KV cache:" in capsys.readouterr().err


def test_debug_shows_the_traceback(world: World) -> None:
    from oscarkv.errors import InputError

    with pytest.raises(InputError, match="prompt is empty"):
        main([*gen(world, prompt=""), "--debug"])


def test_read_prompt_escapes(tmp_path: Path) -> None:
    from oscarkv.cli.preflight import read_prompt

    f = tmp_path / "p.txt"
    f.write_bytes("\ufeffhéllo".encode())  # a BOM is dropped
    assert read_prompt("@@x") == "@x"
    assert read_prompt(f"@{f}") == "héllo"
    assert read_prompt("plain @ text") == "plain @ text"


def test_the_cache_checks_work_with_autograd_on(world: World) -> None:
    """The K/V health flags are updated outside autograd: a plain forward (grad mode on) runs."""
    from oscarkv import OscarCache, load_rotations

    m = _model(world)
    cache = OscarCache.from_rotations(m, load_rotations(world.rot), backend="torch")
    ids = torch.randint(0, 2048, (1, 12))
    m(ids, past_key_values=cache)
    m(ids[:, :1], past_key_values=cache)
    assert cache.memory_report()["tokens_hp"] == 13
