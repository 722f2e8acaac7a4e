"""Bad rotation artifacts and bad output paths: one-line errors, warnings, and no lost files.

Every case writes a tiny valid artifact (2 layers, head dim 8) with ``save_rotations`` and then
plants one defect by rewriting the safetensors header metadata.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from oscarkv.config import QuantSpec, SpecError
from oscarkv.errors import ArtifactMismatchWarning, OscarkvError, OscarkvWarning
from oscarkv.rotation import (
    ARTIFACT_NAME,
    LayerRotation,
    Provenance,
    RotationFileError,
    RotationSet,
    config_fingerprint,
    load_rotations,
    save_oscar_files,
    save_rotations,
)

D = 8
CFG = {
    "head_dim": D,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
}
OTHER_CFG = {**CFG, "rope_theta": 1_000_000.0}  # same shapes, different model
K_NAME, V_NAME = "k_rotation_qqt_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt"
V_HINT = (
    "pass a directory holding exactly one k_rotation*.pt and one v_rotation*.pt "
    "(or v_path= in Python; `oscarkv info` has --v-path)"
)


def _orth(d: int = D) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def _rs(config_hash: str | None = None, model_name: str = "tiny/model-a") -> RotationSet:
    eig = torch.arange(D, dtype=torch.float32)
    layers = {i: LayerRotation(_orth(), _orth(), eig.clone(), eig.clone()) for i in (0, 1)}
    layers[1].k_clip, layers[1].v_clip = 0.9, None
    h = config_fingerprint(CFG) if config_hash is None else config_hash
    return RotationSet(layers, provenance=Provenance(model_name=model_name, config_hash=h))


@pytest.fixture
def art(tmp_path: Path) -> Path:
    """A valid artifact file, recorded for ``CFG``."""
    return save_rotations(_rs(), tmp_path / "art")


def _plant(file: Path, mutate: Callable[[dict, dict], Any], *, header: Any = ...) -> None:
    """Rewrite ``file`` after ``mutate(meta, tensors)`` in place (or with ``header`` as the JSON)."""
    with safe_open(str(file), framework="pt") as f:
        meta = json.loads(f.metadata()["oscarkv"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    mutate(meta, tensors)
    save_file(tensors, str(file), metadata={"oscarkv": json.dumps(meta if header is ... else header)})


def _error(match: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> RotationFileError:
    with pytest.raises(RotationFileError, match=match) as ei:
        fn(*args, **kw)
    e = ei.value
    assert "\n" not in str(e) and "\n" not in e.hint
    return e


def _load_error(
    file: Path, match: str, mutate: Callable[[dict, dict], Any] | None = None
) -> RotationFileError:
    if mutate is not None:
        _plant(file, mutate)
    e = _error(match, load_rotations, file)
    assert str(file) in str(e)
    return e


def _load_quietly(path: Path, **kw: Any) -> RotationSet:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_rotations(path, **kw)


# ---- the error type -----------------------------------------------------------------------
def test_error_is_one_line_with_fix_as_hint() -> None:
    e = RotationFileError("f.safetensors", "bad\nthing", "x", "y\nz", fix="do this\nthen that")
    assert isinstance(e, OscarkvError) and isinstance(e, ValueError)
    assert str(e) == "f.safetensors: bad thing; expected x; found y z"
    assert e.hint == "do this then that"


def test_clean_artifact_loads_without_warnings(art: Path) -> None:
    rs = _load_quietly(art, model_config=CFG, strict=True)
    assert rs.layer_ids == [0, 1] and rs.clips(1)[0] == 0.9


# ---- the metadata, checked whole ----------------------------------------------------------
@pytest.mark.parametrize("key", ["layer_ids", "granularity", "provenance", "spec", "clips", "head_dim"])
def test_missing_field(art: Path, key: str) -> None:
    e = _load_error(art, f"metadata field '{key}' is missing", lambda m, t: m.pop(key))
    assert "expected the fields" in str(e) and "re-create" in e.hint


@pytest.mark.parametrize("header", [[1, 2], 7, "oscarkv", None])
def test_header_not_an_object(art: Path, header: Any) -> None:
    _plant(art, lambda m, t: None, header=header)
    _load_error(art, "metadata is not a JSON object; expected a JSON object; found")


def test_header_not_json(art: Path) -> None:
    with safe_open(str(art), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    save_file(tensors, str(art), metadata={"oscarkv": '{"format": "oscarkv.rotations",'})
    _load_error(art, "metadata is not valid JSON; found JSONDecodeError")


def test_no_oscarkv_metadata(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(2)}, str(file))
    _load_error(file, "no oscarkv metadata")


@pytest.mark.parametrize(
    ("ids", "found"),
    [([0, 0, 1], r"duplicates \[0\]"), ([-1, 0], r"found -1 \(an integer\)"), (["0", "1"], r"found '0' \(a string\)"),
     ([], r"found \[\] \(a JSON list\)"), ("0,1", "a string"), ([0, True], "a boolean"), ([0.0, 1.0], "a number")],
)  # fmt: skip
def test_bad_layer_ids(art: Path, ids: Any, found: str) -> None:
    e = _load_error(art, "metadata field 'layer_ids' is invalid", lambda m, t: m.update(layer_ids=ids))
    assert "non-empty list of unique layer ids" in str(e)
    assert re.search(found, str(e)), str(e)


@pytest.mark.parametrize("clip", [5.0, -1.0, math.nan, math.inf, "abc", True, [0.5]])
def test_bad_clip(art: Path, clip: Any) -> None:
    e = _load_error(
        art,
        r"metadata field 'clips\.1\.k_clip' is invalid",
        lambda m, t: m["clips"].update({"1": [clip, 0.9]}),
    )
    assert "null or a finite number in [0, 1]" in str(e)


@pytest.mark.parametrize("pair", [0.9, [0.9], [0.9, 0.8, 0.7], None])
def test_clip_not_a_pair(art: Path, pair: Any) -> None:
    _load_error(
        art,
        r"'clips.0' is invalid; expected a list \[k_clip, v_clip\]",
        lambda m, t: m["clips"].update({"0": pair}),
    )


def test_clips_not_an_object(art: Path) -> None:
    _load_error(art, "'clips' is invalid.*found .* JSON list", lambda m, t: m.update(clips=[[0.9, 0.9]]))


def test_clips_optional_per_layer(art: Path) -> None:
    _plant(art, lambda m, t: m.update(clips={"1": [0, 1]}))
    rs = _load_quietly(art)
    assert rs.layers[0].k_clip is None and rs.clips(1) == (0.0, 1.0)


@pytest.mark.parametrize("hd", [16, 4])
def test_head_dim_mismatch(art: Path, hd: int) -> None:
    e = _load_error(art, "'head_dim' does not match the tensors", lambda m, t: m.update(head_dim=hd))
    assert f"rotations of size {hd}" in str(e) and f"({D}, {D})" in str(e)


@pytest.mark.parametrize("hd", ["8", 0, -8, 8.0, None])
def test_head_dim_not_positive_int(art: Path, hd: Any) -> None:
    _load_error(art, "'head_dim' is invalid; expected a positive integer", lambda m, t: m.update(head_dim=hd))


@pytest.mark.parametrize("g", ["per_token", None, 1])
def test_bad_granularity(art: Path, g: Any) -> None:
    _load_error(
        art, "'granularity' is invalid; expected 'layer' or 'kv_head'", lambda m, t: m.update(granularity=g)
    )


def test_newer_format_version(art: Path) -> None:
    e = _load_error(art, "format version 3 is newer", lambda m, t: m.update(format_version=3))
    assert "upgrade oscarkv" in e.hint


@pytest.mark.parametrize(
    ("key", "value"), [("format", "other.format"), ("format_version", "1"), ("format_version", 0)]
)
def test_bad_format(art: Path, key: str, value: Any) -> None:
    _load_error(art, f"metadata field '{key}' is invalid", lambda m, t: m.update({key: value}))


def test_bad_spec_value(art: Path) -> None:
    e = _load_error(
        art, "'spec' is invalid; expected a valid QuantSpec", lambda m, t: m["spec"].update(key_bits=7)
    )
    assert "key_bits" in str(e)


@pytest.mark.parametrize(("key", "value"), [("model_name", 5), ("recipe", "qqt"), ("config_hash", None)])
def test_bad_provenance_type(art: Path, key: str, value: Any) -> None:
    _load_error(art, f"'provenance.{key}' is invalid", lambda m, t: m["provenance"].update({key: value}))


@pytest.mark.parametrize("prov", [[], "oscarkv", None])
def test_provenance_not_an_object(art: Path, prov: Any) -> None:
    _load_error(
        art, "'provenance' is invalid; expected a JSON object", lambda m, t: m.update(provenance=prov)
    )


def test_listed_layer_without_tensors(art: Path) -> None:
    _load_error(
        art, "layer 1 is missing tensor layers.1.v.rotation", lambda m, t: t.pop("layers.1.v.rotation")
    )


# ---- what a newer writer may add: dropped, with one warning -------------------------------
def test_unknown_provenance_key_warns_and_loads(art: Path) -> None:
    _plant(art, lambda m, t: m["provenance"].update(gpu="H200"))
    with pytest.warns(
        OscarkvWarning, match=r"newer oscarkv\? ignoring unknown metadata keys \['provenance.gpu'\]"
    ):
        rs = load_rotations(art)
    assert rs.provenance.model_name == "tiny/model-a" and not hasattr(rs.provenance, "gpu")


def test_all_unknown_keys_in_one_warning(art: Path) -> None:
    def mutate(m: dict, t: dict) -> None:
        m["calibrated_on"] = "gpqa"
        m["spec"]["value_codebook"] = "nf2"
        m["provenance"]["gpu"] = "H200"
        m["clips"]["7"] = [0.5, 0.5]
        t["layers.5.k.rotation"] = torch.eye(D)

    _plant(art, mutate)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        rs = load_rotations(art)
    msgs = [str(w.message) for w in rec if issubclass(w.category, OscarkvWarning)]
    assert len(msgs) == 1, msgs
    for part in (
        "'calibrated_on'",
        "'spec.value_codebook'",
        "'provenance.gpu'",
        "'clips.7'",
        "layers [5]",
    ):
        assert part in msgs[0], (part, msgs[0])
    assert rec[0].filename == __file__  # points at the caller's line
    assert rs.layer_ids == [0, 1] and rs.spec.key_bits == 2


# ---- missing vs corrupt files -------------------------------------------------------------
@pytest.mark.parametrize("name", ["nope.safetensors", "nope.pt", "nope"])
def test_missing_path_says_no_such_file(tmp_path: Path, name: str) -> None:
    e = _error("no such file or directory", load_rotations, tmp_path / name)
    assert "corrupt" not in str(e) and name in str(e)


def test_missing_v_path_says_no_such_file(tmp_path: Path) -> None:
    k, _ = save_oscar_files(_rs(), tmp_path)
    e = _error("no such file or directory", load_rotations, k, v_path=tmp_path / "v_missing.pt")
    assert "v_missing.pt" in str(e) and "corrupt" not in str(e)


@pytest.mark.parametrize("name", [ARTIFACT_NAME, K_NAME])
def test_unreadable_file_says_corrupt(tmp_path: Path, name: str) -> None:
    save_oscar_files(_rs(), tmp_path)
    (tmp_path / name).write_bytes(b"\x00garbage\nbytes" * 10)
    e = _error("corrupt", load_rotations, tmp_path / name)
    assert "no such file" not in str(e) and name in str(e)


def test_no_v_file_hint(tmp_path: Path) -> None:
    k, v = save_oscar_files(_rs(), tmp_path)
    v.unlink()
    assert _error("no V rotation file", load_rotations, k).hint == V_HINT
    (tmp_path / "v_rotation_a.pt").write_bytes(b"")
    (tmp_path / "v_rotation_b.pt").write_bytes(b"")
    assert V_HINT in _error("several files match", load_rotations, k).hint


# ---- the model fingerprint ----------------------------------------------------------------
def test_fingerprint_mismatch_warns(art: Path) -> None:
    other = config_fingerprint(OTHER_CFG)
    match = (
        rf"rotations were calibrated for tiny/model-a \(config hash {config_fingerprint(CFG)}\), not this model "
        rf"\(config hash {other}\); re-calibrate for this model, or pass --strict to make this an error"
    )
    with pytest.warns(ArtifactMismatchWarning, match=match) as rec:
        rs = load_rotations(art, model_config=OTHER_CFG)
    assert "\n" not in str(rec[0].message) and rec[0].filename == __file__
    assert rs.layer_ids == [0, 1]
    with pytest.warns(ArtifactMismatchWarning, match="re-calibrate"):
        _rs().validate(OTHER_CFG)


def test_fingerprint_mismatch_strict_raises(art: Path) -> None:
    e = _error(
        "calibrated for a different model .tiny/model-a.",
        load_rotations,
        art,
        model_config=OTHER_CFG,
        strict=True,
    )
    assert config_fingerprint(OTHER_CFG) in str(e) and config_fingerprint(CFG) in str(e)
    _error("different model", _rs().validate, OTHER_CFG, strict=True)


def test_shape_mismatch_stays_an_error(art: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _error("head_dim does not match the model", load_rotations, art, model_config={**CFG, "head_dim": 16})


def test_no_fingerprint_no_warning(tmp_path: Path) -> None:
    save_oscar_files(_rs(), tmp_path / "oscar")  # OSCAR files carry no hash
    assert _load_quietly(tmp_path / "oscar", model_config=OTHER_CFG, strict=True).provenance.config_hash == ""
    save_rotations(_rs(config_hash=""), tmp_path / "ours")
    _load_quietly(tmp_path / "ours", model_config=OTHER_CFG, strict=True)


# ---- per-layer clips of programmatic sets -------------------------------------------------
@pytest.mark.parametrize("clip", [5.0, -0.1, math.nan, "0.9", True, torch.tensor(0.9)])
def test_validate_rejects_bad_layer_clip(tmp_path: Path, clip: Any) -> None:
    rs = _rs()
    rs.layers[0].v_clip = clip
    _error("layer 0 v_clip is invalid; expected None or a finite number in", rs.validate)
    _error("layer 0 v_clip is invalid", save_rotations, rs, tmp_path)
    assert not any(tmp_path.iterdir())


def test_validate_accepts_edge_clips() -> None:
    rs = _rs()
    rs.layers[0].k_clip, rs.layers[0].v_clip = 0, 1.0
    assert rs.validate() is rs


# ---- writes never destroy inputs ----------------------------------------------------------
def test_existing_artifact_needs_overwrite(art: Path) -> None:
    before = art.read_bytes()
    e = _error(f"refusing to replace {art}: it already exists", save_rotations, _rs(), art.parent)
    assert "overwrite=True" in e.hint and "--overwrite" in e.hint
    assert art.read_bytes() == before
    save_rotations(_rs(model_name="tiny/model-b"), art, overwrite=True)
    assert art.read_bytes() != before
    assert load_rotations(art).provenance.model_name == "tiny/model-b"


@pytest.mark.parametrize("kind", ["model_weights", "garbage"])
def test_overwrite_never_replaces_a_foreign_file(tmp_path: Path, kind: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    target = model / "model.safetensors"
    if kind == "model_weights":
        save_file({"embed.weight": torch.randn(4, 4)}, str(target), metadata={"format": "pt"})
    else:
        target.write_bytes(b"not safetensors at all")
    before = target.read_bytes()
    e = _error(
        f"refusing to replace {target}: it is not an oscarkv rotation artifact",
        save_rotations, _rs(), target, overwrite=True,
    )  # fmt: skip
    assert str(model) in e.hint
    assert target.read_bytes() == before
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors"]


def test_existing_file_as_output_directory(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("notes")
    _error("is an existing file; expected a directory", save_rotations, _rs(), tmp_path / "out")
    assert (tmp_path / "out").read_text() == "notes"


def test_oscar_files_need_overwrite(tmp_path: Path) -> None:
    k, _ = save_oscar_files(_rs(), tmp_path)
    before = k.read_bytes()
    _error("refusing to replace .*it already exists", save_oscar_files, _rs(), tmp_path)
    assert k.read_bytes() == before
    k2, _ = save_oscar_files(_rs(), tmp_path, overwrite=True)
    assert k2 == k and k.read_bytes() != before


def test_oscar_overwrite_never_replaces_a_foreign_file(tmp_path: Path) -> None:
    torch.save({"weight": torch.ones(3)}, tmp_path / K_NAME)
    before = (tmp_path / K_NAME).read_bytes()
    e = _error("not an oscarkv rotation artifact; found a file that is not an OSCAR rotation dict",
               save_oscar_files, _rs(), tmp_path, overwrite=True)  # fmt: skip
    assert K_NAME in str(e)
    assert (tmp_path / K_NAME).read_bytes() == before
    assert not (tmp_path / V_NAME).exists()  # both targets checked before either is written


def test_written_files_are_0644(tmp_path: Path) -> None:
    old = os.umask(0o077)  # a tight umask must not leak into the artifact's mode
    try:
        files = [save_rotations(_rs(), tmp_path), *save_oscar_files(_rs(), tmp_path)]
    finally:
        os.umask(old)
    for f in files:
        assert oct(os.stat(f).st_mode & 0o777) == oct(0o644), f


def test_interrupted_artifact_write_keeps_old_file(art: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = art.read_bytes()

    def crash(fd: int) -> None:  # the new bytes are in the temporary file; the rename never happens
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", crash)
    e = _error(
        "cannot write the file; found OSError: .*No space left", save_rotations, _rs(), art, overwrite=True
    )
    assert str(art) in str(e)
    assert art.read_bytes() == before
    assert [p.name for p in art.parent.iterdir()] == [ARTIFACT_NAME]


def test_interrupted_oscar_write_keeps_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    k, _ = save_oscar_files(_rs(), tmp_path)
    before = k.read_bytes()
    real_save = torch.save

    def crash(obj: Any, f: Any, *a: Any, **kw: Any) -> None:
        real_save(obj, f, *a, **kw)
        f.truncate(10)  # half written, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_oscar_files(_rs(), tmp_path, overwrite=True)
    assert k.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [K_NAME, V_NAME]


# ---- bad arguments to the artifact API (each a one-line OscarkvError, never a raw exception) -----
def _one_line(
    exc: type[OscarkvError], match: str, fn: Callable[..., Any], *args: Any, **kw: Any
) -> OscarkvError:
    with pytest.raises(exc, match=match) as ei:
        fn(*args, **kw)
    assert "\n" not in str(ei.value) and "\n" not in ei.value.hint
    return ei.value


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({}, "model config lacks head_dim / hidden_size\\+num_attention_heads"),
        ({"num_hidden_layers": 2}, "model config lacks head_dim"),
        ({**CFG, "head_dim": "abc"}, "head_dim"),
        ({**CFG, "head_dim": None, "hidden_size": "x"}, "hidden_size"),
        ({k: v for k, v in CFG.items() if k != "num_hidden_layers"}, "model config lacks num_hidden_layers"),
        ({**CFG, "num_hidden_layers": "two"}, "num_hidden_layers"),
        ({**CFG, "layer_types": 7}, "layer_types"),
        ("qwen3", "model_config must be a transformers config or a dict; got str"),
        (5, "model_config must be a transformers config or a dict; got int"),
        ([CFG], "got list"),
    ],
)
def test_bad_model_config(art: Path, cfg: Any, match: str) -> None:
    e = _error(match, load_rotations, art, model_config=cfg)
    assert str(art) in str(e) and e.hint
    _error(match, _rs().validate, cfg)


def test_bad_kv_head_count_in_config(tmp_path: Path) -> None:
    eig = torch.ones(2, D)
    layers = {
        i: LayerRotation(torch.stack([_orth(), _orth()]), torch.stack([_orth(), _orth()]), eig, eig)
        for i in (0, 1)
    }
    rs = RotationSet(layers, granularity="kv_head")
    _error("num_key_value_heads", rs.validate, {**CFG, "num_key_value_heads": "2"})
    assert rs.validate({**CFG, "num_key_value_heads": 2}) is rs


def test_v_file_is_the_k_file(tmp_path: Path) -> None:
    k, _ = save_oscar_files(_rs(), tmp_path)
    e = _error("the V file is the K file", load_rotations, k, v_path=k)
    assert K_NAME in str(e) and "v_rotation" in e.hint
    _error("the V file is the K file", load_rotations, tmp_path, v_path=k)
    (tmp_path / "link.pt").symlink_to(k)
    _error("the V file is the K file", load_rotations, k, v_path=tmp_path / "link.pt")


@pytest.mark.parametrize("kind", ["k_eigenvalues", "v_eigenvalues"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_eigenvalues(tmp_path: Path, kind: str, bad: float) -> None:
    rs = _rs()
    getattr(rs.layers[1], kind)[3] = bad
    match = f"layer 1 {kind[0].upper()} eigenvalues contain NaN or inf"
    _error(match, rs.validate)
    _error(match, save_rotations, rs, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    art = save_rotations(_rs(), tmp_path / "art")
    _load_error(art, match, lambda m, t: t[f"layers.1.{kind[0]}.eigenvalues"].__setitem__(3, bad))
    k, v = save_oscar_files(_rs(), tmp_path / "oscar")
    obj = torch.load(k if kind[0] == "k" else v, weights_only=True)
    obj["layers"][1]["eigenvalues"][3] = bad
    torch.save(obj, k if kind[0] == "k" else v)
    _error(match, load_rotations, k)


def test_save_refuses_a_model_directory(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, str(model / "model.safetensors"))
    before = sorted(p.name for p in model.rglob("*"))
    for target in (model, model / "rotations", model / "sub" / "rot.safetensors"):
        e = _error("inside the model directory", save_rotations, _rs(), target)
        assert str(model) in str(e) and e.hint
    assert sorted(p.name for p in model.rglob("*")) == before


@pytest.mark.parametrize("name", ["foo.pt", "rot.v2", "rotations.json"])
def test_save_refuses_a_foreign_suffix(tmp_path: Path, name: str) -> None:
    e = _error(
        f"save_rotations writes a directory or a .safetensors file; got {re.escape(name)}",
        save_rotations, _rs(), tmp_path / name,
    )  # fmt: skip
    assert ".safetensors" in e.hint
    assert list(tmp_path.iterdir()) == []


def test_save_keeps_directories(tmp_path: Path) -> None:
    assert save_rotations(_rs(), tmp_path / "plain") == tmp_path / "plain" / ARTIFACT_NAME
    (tmp_path / "run.v2").mkdir()
    assert save_rotations(_rs(), tmp_path / "run.v2") == tmp_path / "run.v2" / ARTIFACT_NAME
    assert save_rotations(_rs(), tmp_path / "x.safetensors") == tmp_path / "x.safetensors"
    assert load_rotations(tmp_path / "run.v2").layer_ids == [0, 1]


def test_spec_must_be_a_quantspec(art: Path) -> None:
    e = _one_line(SpecError, "spec must be a QuantSpec; got dict", load_rotations, art, spec={"key_bits": 2})
    assert "QuantSpec" in e.hint
    _one_line(SpecError, "spec must be a QuantSpec; got dict", _rs().with_spec, {"key_bits": 2})
    assert load_rotations(art, spec=QuantSpec(key_bits=2)).spec.key_bits == 2
    rs = _rs()
    rs.spec = {"key_bits": 2}
    _error("spec must be a QuantSpec; found dict", rs.validate)


def _layers_bad(kind: str) -> Any:
    good = _rs().layers
    return {
        "list": list(good.values()),
        "str-key": {"0": good[0]},
        "neg-key": {-1: good[0]},
        "tuple": {0: (good[0].k, good[0].v)},
        "numpy": {
            0: LayerRotation(good[0].k.numpy(), good[0].v, good[0].k_eigenvalues, good[0].v_eigenvalues)
        },
        "scalar": {
            0: LayerRotation(torch.tensor(1.0), good[0].v, good[0].k_eigenvalues, good[0].v_eigenvalues)
        },
    }[kind]


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("list", "layers must be a dict of layer id -> LayerRotation; found list"),
        ("str-key", "layer id '0' is not an integer >= 0"),
        ("neg-key", "layer id -1 is not an integer >= 0"),
        ("tuple", "layer 0 is not a LayerRotation; found tuple"),
        ("numpy", "layer 0 k is not a torch.Tensor; found ndarray"),
        ("scalar", "layer 0 K rotation has the wrong shape"),
    ],
)
def test_validate_checks_types_first(tmp_path: Path, kind: str, match: str) -> None:
    rs = RotationSet(_layers_bad(kind))
    _error(match, rs.validate)
    _error(match, save_rotations, rs, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_empty_set(tmp_path: Path) -> None:
    rs = RotationSet(layers={})
    _error("no layers", rs.validate)
    _error("no layers", lambda: rs.head_dim)
    _error("no layers", save_rotations, rs, tmp_path / "out")
    rs = RotationSet(_rs().layers, provenance="me")  # type: ignore[arg-type]
    _error("provenance must be a Provenance; found str", rs.validate)


@pytest.mark.parametrize(
    ("path", "kind"), [(None, "NoneType"), (5, "int"), (b"rot", "bytes"), (["a"], "list")]
)
def test_path_must_be_a_path(tmp_path: Path, path: Any, kind: str) -> None:
    _error(f"path must be a str or os.PathLike; got {kind}", load_rotations, path)
    _error(f"path must be a str or os.PathLike; got {kind}", save_rotations, _rs(), path)
    k, _ = save_oscar_files(_rs(), tmp_path)
    if path is not None:  # v_path=None means "find it"
        _error(f"v_path must be a str or os.PathLike; got {kind}", load_rotations, k, v_path=path)
