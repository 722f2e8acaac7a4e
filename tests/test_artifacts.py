"""Rotation artifacts: our safetensors format, OSCAR RotationZoo .pt files, validation errors."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import oscarkv
from oscarkv import QuantSpec, RotationFileError, RotationSet, load_rotations, save_rotations
from oscarkv.rotation import (
    ARTIFACT_NAME,
    ORTHO_TOL,
    LayerRotation,
    Provenance,
    load_oscar_files,
    save_oscar_files,
)

K_NAME = "k_rotation_qqt_r_h_pbr.pt"
V_NAME = "v_rotation_sst_r_h_pbr.pt"

QWEN35_CONFIG = {
    "head_dim": 256,
    "hidden_size": 2560,
    "num_attention_heads": 16,
    "num_hidden_layers": 32,
    "num_key_value_heads": 4,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
}


def _eig(*shape: int) -> torch.Tensor:
    return torch.sort(torch.rand(*shape) * 10, dim=-1).values


def _layer_set(make_orthogonal: Callable[..., torch.Tensor], d: int = 64) -> RotationSet:
    layers = {i: LayerRotation(make_orthogonal(d), make_orthogonal(d), _eig(d), _eig(d)) for i in (0, 2, 5)}
    layers[2].k_clip, layers[2].v_clip = 0.9, 0.85
    prov = Provenance(
        source="oscarkv",
        model_name="tiny/test-model",
        config_hash="0123456789abcdef",
        recipe={"method": "qqt_sst", "tokens": 4096, "dataset": ["gpqa"]},
        library_version=oscarkv.__version__,
        created="2025-01-01T00:00:00Z",
    )
    spec = QuantSpec(group_size=32, k_clip=0.95, meta_dtype="bf16")
    return RotationSet(layers, spec, "layer", prov)


def _assert_same_tensors(a: RotationSet, b: RotationSet) -> None:
    assert a.layer_ids == b.layer_ids
    for i in a.layer_ids:
        la, lb = a.layers[i], b.layers[i]
        for name in ("k", "v", "k_eigenvalues", "v_eigenvalues"):
            ta, tb = getattr(la, name), getattr(lb, name)
            assert tb.dtype == torch.float32
            assert torch.equal(ta.float(), tb), (i, name)


# ---- our format ---------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path: Path, make_orthogonal) -> None:
    rs = _layer_set(make_orthogonal)
    file = save_rotations(rs, tmp_path / "art")
    assert file == tmp_path / "art" / ARTIFACT_NAME and file.is_file()
    back = load_rotations(tmp_path / "art")
    _assert_same_tensors(rs, back)
    assert back.spec == rs.spec
    assert back.granularity == "layer" and back.num_kv_heads is None
    assert back.provenance == rs.provenance
    assert back.clips(2) == (0.9, 0.85)
    assert back.clips(0) == (0.95, 0.92)  # the spec's
    assert back.layers[0].k_clip is None
    assert back.head_dim == 64
    # also loadable by file path
    _assert_same_tensors(rs, load_rotations(file))


def test_save_layers_sharing_tensors(tmp_path: Path, make_orthogonal) -> None:
    """Layers built from one tensor (unit eigenvalues shared by all) save and load back."""
    one, r = torch.ones(16), make_orthogonal(16)
    rs = RotationSet({i: LayerRotation(r, r, one, one) for i in range(3)}, spec=QuantSpec())
    back = load_rotations(save_rotations(rs, tmp_path / "art"))
    _assert_same_tensors(rs, back)


def test_load_with_spec_override(tmp_path: Path, make_orthogonal) -> None:
    save_rotations(_layer_set(make_orthogonal), tmp_path)
    spec = QuantSpec(key_bits=4, value_bits=4)
    assert load_rotations(tmp_path, spec=spec).spec == spec


def test_kv_head_round_trip(tmp_path: Path, make_orthogonal) -> None:
    h, d = 4, 32
    layers = {
        i: LayerRotation(
            torch.stack([make_orthogonal(d) for _ in range(h)]),
            torch.stack([make_orthogonal(d) for _ in range(h)]),
            _eig(h, d),
            _eig(h, d),
        )
        for i in (1, 3)
    }
    rs = RotationSet(layers, QuantSpec(), "kv_head")
    assert rs.num_kv_heads == 4
    save_rotations(rs, tmp_path / "rotations.safetensors")
    back = load_rotations(tmp_path / "rotations.safetensors")
    assert back.granularity == "kv_head"
    assert back.num_kv_heads == 4
    assert back.head_dim == d
    assert back.layers[1].k.shape == (h, d, d)
    _assert_same_tensors(rs, back)
    cfg = {
        "head_dim": d,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "layer_types": ["linear_attention", "full_attention"] * 2,
    }
    back.validate(cfg)
    with pytest.raises(RotationFileError, match="KV head"):
        back.validate({**cfg, "num_key_value_heads": 2})


def test_orthogonality_errors_small(make_orthogonal) -> None:
    errs = _layer_set(make_orthogonal).orthogonality_errors()
    assert sorted(errs) == [0, 2, 5]
    assert all(0 <= e < 1e-5 for e in errs.values())


def test_orthogonality_errors_detects_bad_layer(make_orthogonal) -> None:
    rs = _layer_set(make_orthogonal)
    rs.layers[5].v = rs.layers[5].v * 1.01
    errs = rs.orthogonality_errors()
    assert errs[5] > 0.01 and errs[0] < 1e-5


# ---- OSCAR format -------------------------------------------------------------------------
def test_oscar_pair_by_directory(tmp_path: Path, write_oscar_pair) -> None:
    data = write_oscar_pair(tmp_path, d=64, layer_ids=(3, 7, 11))
    rs = load_rotations(tmp_path)
    assert rs.layer_ids == [3, 7, 11]
    assert rs.head_dim == 64
    assert rs.granularity == "layer"
    assert rs.spec == QuantSpec()
    assert rs.provenance.source == "oscar-rotationzoo"
    assert rs.provenance.recipe["k_file"] == K_NAME
    assert rs.provenance.recipe["k_objective"] == "qqt_r_h_pbr"
    assert rs.provenance.recipe["v_objective"] == "sst_r_h_pbr"
    for i in (3, 7, 11):
        assert torch.equal(rs.layers[i].k, data["k"][i])
        assert torch.equal(rs.layers[i].v, data["v"][i])
        assert torch.equal(rs.layers[i].k_eigenvalues, data["k_eig"][i])
        assert torch.equal(rs.layers[i].v_eigenvalues, data["v_eig"][i])


def test_oscar_pair_by_k_file(tmp_path: Path, write_oscar_pair) -> None:
    data = write_oscar_pair(tmp_path, d=32, layer_ids=(0, 1))
    rs = load_rotations(tmp_path / K_NAME)
    assert rs.layer_ids == [0, 1]
    assert torch.equal(rs.layers[1].v, data["v"][1])
    rs2 = load_rotations(tmp_path / K_NAME, v_path=tmp_path / V_NAME)
    assert torch.equal(rs2.layers[0].k, data["k"][0])


def test_oscar_pair_str_keys(tmp_path: Path, write_oscar_pair) -> None:
    data = write_oscar_pair(tmp_path, d=32, layer_ids=(3, 7), str_keys=True)
    raw = torch.load(tmp_path / K_NAME, weights_only=True)
    assert sorted(raw["layers"]) == ["3", "7"]
    rs = load_rotations(tmp_path)
    assert rs.layer_ids == [3, 7]
    assert torch.equal(rs.layers[7].k, data["k"][7])


def test_save_oscar_files_round_trip(tmp_path: Path, write_oscar_pair) -> None:
    write_oscar_pair(tmp_path / "a", d=64, layer_ids=(3, 7))
    rs = load_rotations(tmp_path / "a")
    kp, vp = save_oscar_files(rs, tmp_path / "b")
    assert (kp.name, vp.name) == (K_NAME, V_NAME)
    raw = torch.load(kp, weights_only=True)
    assert raw["format_version"] == 1 and raw["source_grouping"] == "layer"
    assert raw["objective"] == "qqt_r_h_pbr"
    assert sorted(raw["layers"]) == [3, 7]
    assert raw["layers"][3]["layer_id"] == 3
    assert raw["layers"][3]["rotation"].dtype == torch.float32
    back = load_rotations(tmp_path / "b")
    _assert_same_tensors(rs, back)
    assert back.provenance.source == "oscar-rotationzoo"


def test_save_oscar_files_rejects_kv_head(tmp_path: Path, make_orthogonal) -> None:
    layers = {0: LayerRotation(make_orthogonal(8)[None], make_orthogonal(8)[None], _eig(1, 8), _eig(1, 8))}
    with pytest.raises(ValueError, match="kv_head"):
        save_oscar_files(RotationSet(layers, granularity="kv_head"), tmp_path)


@pytest.mark.shared
def test_real_zoo_loads(shared_dir: Path) -> None:
    zoo = shared_dir / "zoo/qwen3.5-4B"
    rs = load_rotations(zoo)
    assert rs.layer_ids == list(range(3, 32, 4))
    assert rs.head_dim == 256
    assert max(rs.orthogonality_errors().values()) < 1e-5
    load_rotations(zoo, model_config=QWEN35_CONFIG)
    with pytest.raises(RotationFileError, match="head_dim"):
        load_rotations(zoo, model_config={**QWEN35_CONFIG, "head_dim": 128})


# ---- error paths --------------------------------------------------------------------------
def _rewrite(path: Path, mutate: Callable[[dict], None]) -> None:
    obj = torch.load(path, weights_only=True)
    mutate(obj)
    torch.save(obj, path)


def _load_error(path: Path, match: str, **kw) -> str:
    with pytest.raises(RotationFileError, match=match) as ei:
        load_rotations(path, **kw)
    return str(ei.value)


def test_not_orthogonal(tmp_path: Path, write_oscar_pair) -> None:
    write_oscar_pair(tmp_path, d=32, layer_ids=(3, 7))
    _rewrite(tmp_path / K_NAME, lambda o: o["layers"][7].update(rotation=o["layers"][7]["rotation"] * 1.1))
    msg = _load_error(tmp_path / K_NAME, "orthogonal")
    assert K_NAME in msg and "orthogonal" in msg and "layer 7" in msg


def test_slightly_off_orthogonal_is_accepted(tmp_path: Path, write_oscar_pair) -> None:
    write_oscar_pair(tmp_path, d=32, layer_ids=(3,))
    _rewrite(tmp_path / K_NAME, lambda o: o["layers"][3].update(rotation=o["layers"][3]["rotation"] * 1.0001))
    assert ORTHO_TOL > 1e-4
    load_rotations(tmp_path / K_NAME)


def test_validation_errors_name_the_file_when_loading_a_directory(tmp_path: Path, write_oscar_pair) -> None:
    # Loading an OSCAR pair by directory must still name the offending file (not just the folder).
    write_oscar_pair(tmp_path, d=32, layer_ids=(3, 7))
    _rewrite(tmp_path / K_NAME, lambda o: o["layers"][7].update(rotation=o["layers"][7]["rotation"] * 1.1))
    msg = _load_error(tmp_path, "orthogonal")
    assert "orthogonal" in msg
    assert K_NAME in msg


@pytest.mark.parametrize("kind", ["wrong_d", "non_square"])
def test_wrong_shape(tmp_path: Path, write_oscar_pair, make_orthogonal, kind: str) -> None:
    write_oscar_pair(tmp_path, d=32, layer_ids=(3, 7))

    def mutate(o: dict) -> None:
        if kind == "wrong_d":
            o["layers"][7] = {"layer_id": 7, "rotation": make_orthogonal(16), "eigenvalues": _eig(16)}
        else:
            o["layers"][3]["rotation"] = make_orthogonal(32)[:, :16].contiguous()

    _rewrite(tmp_path / K_NAME, mutate)
    msg = _load_error(tmp_path / K_NAME, "shape")
    assert K_NAME in msg and "shape" in msg


def test_k_and_v_cover_different_layers(tmp_path: Path, write_oscar_pair) -> None:
    write_oscar_pair(tmp_path, d=32, layer_ids=(3, 7, 11))
    _rewrite(tmp_path / V_NAME, lambda o: o["layers"].pop(11))
    msg = _load_error(tmp_path, "different layers")
    assert K_NAME in msg and V_NAME in msg and "different layers" in msg and "11" in msg


def test_model_config_with_more_layers(tmp_path: Path, write_oscar_pair) -> None:
    write_oscar_pair(tmp_path, d=256, layer_ids=(3, 7))
    msg = _load_error(tmp_path / K_NAME, "missing", model_config=QWEN35_CONFIG)
    assert K_NAME in msg and "missing" in msg and "11" in msg


def test_truncated_pt(tmp_path: Path, write_oscar_pair) -> None:
    write_oscar_pair(tmp_path, d=32, layer_ids=(3,))
    raw = (tmp_path / K_NAME).read_bytes()
    (tmp_path / K_NAME).write_bytes(raw[: len(raw) // 2])
    msg = _load_error(tmp_path, "truncated")
    assert K_NAME in msg and "truncated" in msg


def test_truncated_safetensors(tmp_path: Path, make_orthogonal) -> None:
    file = save_rotations(_layer_set(make_orthogonal), tmp_path)
    raw = file.read_bytes()
    file.write_bytes(raw[: len(raw) // 2])
    msg = _load_error(tmp_path, "truncated")
    assert ARTIFACT_NAME in msg and "truncated" in msg


def test_safetensors_without_metadata(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"x": torch.eye(4)}, str(tmp_path / ARTIFACT_NAME))
    msg = _load_error(tmp_path, "metadata")
    assert ARTIFACT_NAME in msg and "metadata" in msg


class _Custom:
    def __init__(self) -> None:
        self.value = 1


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.mark.parametrize("payload", ["custom", "reduce"])
def test_malicious_pickle_refused(tmp_path: Path, write_oscar_pair, payload: str) -> None:
    write_oscar_pair(tmp_path, d=32, layer_ids=(3,))
    marker = tmp_path / "pwned"
    obj = torch.load(tmp_path / K_NAME, weights_only=True)
    obj["extra"] = _Custom() if payload == "custom" else _Evil(marker)
    torch.save(obj, tmp_path / K_NAME, pickle_protocol=2)
    assert not marker.exists()
    msg = _load_error(tmp_path, "refusing")
    assert K_NAME in msg and "refusing" in msg
    assert not marker.exists()


def test_nan_rotation(tmp_path: Path, write_oscar_pair) -> None:
    write_oscar_pair(tmp_path, d=32, layer_ids=(3, 7))

    def mutate(o: dict) -> None:
        o["layers"][3]["rotation"][5, 9] = float("nan")

    _rewrite(tmp_path / V_NAME, mutate)
    msg = _load_error(tmp_path / K_NAME, "NaN")
    assert V_NAME in msg and "NaN" in msg


def test_directory_without_rotation_files(tmp_path: Path) -> None:
    (tmp_path / "readme.txt").write_text("nothing here")
    msg = _load_error(tmp_path, "no rotation files")
    assert str(tmp_path) in msg and "no rotation files" in msg and "readme.txt" in msg


def test_only_k_file_in_directory(tmp_path: Path, write_oscar_pair) -> None:
    write_oscar_pair(tmp_path, d=32, layer_ids=(3,))
    (tmp_path / V_NAME).unlink()
    _load_error(tmp_path, "no rotation files")
    msg = _load_error(tmp_path / K_NAME, "no V rotation file")
    assert K_NAME in msg and "no V rotation file" in msg


def test_several_k_files(tmp_path: Path, write_oscar_pair) -> None:
    write_oscar_pair(tmp_path, d=32, layer_ids=(3,))
    (tmp_path / "k_rotation_hadamard.pt").write_bytes((tmp_path / K_NAME).read_bytes())
    msg = _load_error(tmp_path, "several")
    assert str(tmp_path) in msg and "several" in msg
    assert K_NAME in msg and "k_rotation_hadamard.pt" in msg


def test_missing_path_and_unknown_suffix(tmp_path: Path) -> None:
    assert "nope.bin" in _load_error(tmp_path / "nope.bin", "no such file")
    (tmp_path / "rot.npz").write_bytes(b"xx")
    msg = _load_error(tmp_path / "rot.npz", "unknown rotation file type")
    assert "rot.npz" in msg and "unknown rotation file type" in msg


def test_not_an_oscar_dict(tmp_path: Path, write_oscar_pair) -> None:
    write_oscar_pair(tmp_path, d=32, layer_ids=(3,))
    torch.save({"rotations": torch.eye(32)}, tmp_path / V_NAME)
    msg = _load_error(tmp_path / K_NAME, "not an OSCAR rotation file")
    assert V_NAME in msg and "not an OSCAR rotation file" in msg


def test_load_oscar_files_directly(tmp_path: Path, write_oscar_pair) -> None:
    write_oscar_pair(tmp_path, d=16, layer_ids=(0,))
    rs = load_oscar_files(tmp_path / K_NAME, tmp_path / V_NAME, spec=QuantSpec(k_clip=0.5))
    assert rs.spec.k_clip == 0.5 and rs.layer_ids == [0]
