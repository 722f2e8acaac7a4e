"""``OscarCache`` with tiny random transformers models (CPU, torch reference kernels).

Small windows (sink 4, recent 16, demotion blocks of 8) make 40-100 token prompts exercise every
tier: sink, quantized history, recent window and demotion.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    DynamicCache,
    LlamaForCausalLM,
    Qwen3ForCausalLM,
)

import oscarkv
from conftest import random_orthogonal, tiny_lm_config
from oscarkv import QuantSpec, RotationFileError
from oscarkv.hf import OscarCache, absorb_value_rotation
from oscarkv.quant import RowFormat, clip_rows, dequantize_rows
from oscarkv.rotation import LayerRotation, RotationSet

SPEC = QuantSpec(sink_tokens=4, recent_tokens=16, demote_block=8)
VOCAB, LAYERS, HQ, HKV, D = 256, 2, 4, 2, 32


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- builders -----------------------------------------------------------------------------------
def _config(kind: str, bias: bool = False):
    return tiny_lm_config(kind, vocab=VOCAB, layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=D, bias=bias)


def make_model(kind: str = "qwen3", seed: int = 0, dtype: torch.dtype = torch.float32, bias: bool = False):
    torch.manual_seed(seed)
    cls = Qwen3ForCausalLM if kind == "qwen3" else LlamaForCausalLM
    model = cls(_config(kind, bias)).eval().to(dtype)
    if bias:  # random (not zero) biases, so that absorbing them is actually tested
        with torch.no_grad():
            for name, prm in model.named_parameters():
                if name.endswith("proj.bias"):
                    prm.normal_(0.0, 0.5)
    return model


def make_rotations(
    spec: QuantSpec = SPEC,
    seed: int = 1,
    d: int = D,
    granularity: str = "layer",
    layers: int = LAYERS,
    heads: int = HKV,
) -> RotationSet:
    gen = torch.Generator().manual_seed(seed)

    def rot():
        if granularity == "layer":
            return random_orthogonal(d, gen)
        return torch.stack([random_orthogonal(d, gen) for _ in range(heads)])

    out = {}
    for i in range(layers):
        rk, rv = rot(), rot()
        out[i] = LayerRotation(rk, rv, torch.ones(rk.shape[:-1]), torch.ones(rv.shape[:-1]))
    return RotationSet(out, spec, granularity)


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids: torch.Tensor, cache, new: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy generation; returns only the new tokens ``[B, new]``."""
    ids = ids if ids.dim() == 2 else ids[None]
    mask = torch.ones_like(ids) if mask is None else mask
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        past_key_values=cache,
    )
    return out[:, ids.shape[1] :]


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, n - len(p) :] = p
        mask[i, n - len(p) :] = 1
    return ids, mask


def counts(cache: OscarCache, b: int = 0) -> tuple[int, int, int]:
    st = cache.table.seqs[b]
    return st.n_sink, st.n_q, st.n_recent


@pytest.fixture(scope="module")
def qwen3():
    return make_model("qwen3")


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


@pytest.fixture(scope="module")
def rotations():
    return make_rotations()


# ---- 1. passthrough ------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["layer", "kv_head"])
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_passthrough_generates_exactly_like_dynamic_cache(kind, granularity, qwen3, llama):
    model = qwen3 if kind == "qwen3" else llama
    rs = make_rotations(granularity=granularity)
    ids = prompt(60, seed=10)
    expected = greedy(model, ids, DynamicCache(), 30)

    cache = OscarCache.from_rotations(model, rs, quantize=False)
    got = greedy(model, ids, cache, 30)

    assert model.config._attn_implementation == "oscarkv"
    assert torch.equal(got, expected), (got.tolist(), expected.tolist())
    # everything stays in 16 bits, in order, with no sink/quantized split
    assert counts(cache) == (0, 0, 60 + 30 - 1)
    rep = cache.memory_report()
    assert rep["quantized_bytes"] == 0 and rep["tokens_quantized"] == 0
    assert rep["bits_per_element"] == pytest.approx(32.0)  # fp32 model


def test_passthrough_left_padded_batch_matches_dynamic_cache(qwen3, rotations):
    ids, mask = left_pad([prompt(70, seed=16), prompt(45, seed=17)])
    expected = greedy(qwen3, ids, DynamicCache(), 25, mask)
    cache = OscarCache.from_rotations(qwen3, rotations, quantize=False)
    got = greedy(qwen3, ids, cache, 25, mask)
    assert torch.equal(got, expected), (got.tolist(), expected.tolist())
    assert counts(cache, 0) == (0, 0, 70 + 24) and counts(cache, 1) == (0, 0, 45 + 24)


def test_passthrough_logits_match_dynamic_cache(qwen3, rotations):
    ids = prompt(50, seed=11)[None]
    with torch.no_grad():
        ref = qwen3(input_ids=ids, past_key_values=DynamicCache(), use_cache=True).logits
        cache = OscarCache.from_rotations(qwen3, rotations, quantize=False)
        got = torch.cat(
            [qwen3(input_ids=ids[:, :30], past_key_values=cache, use_cache=True).logits]
            + [
                qwen3(input_ids=ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits
                for i in range(30, 50)
            ],
            dim=1,
        )
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


# ---- 2. quantized storage and memory report -------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_cache_tiers_and_memory_report(dtype, rotations):
    model = make_model("qwen3", dtype=dtype)
    ids = prompt(60, seed=12)
    cache = OscarCache.from_rotations(model, rotations, spec=SPEC)
    out = greedy(model, ids, cache, 30)
    assert out.shape == (1, 30)

    n_sink, n_q, n_recent = counts(cache)
    assert n_sink == 4 and n_q > 0
    assert SPEC.recent_tokens <= n_recent <= SPEC.recent_tokens + SPEC.demote_block - 1
    assert n_sink + n_q + n_recent == 60 + 30 - 1
    assert cache.get_seq_length() == 60 + 30 - 1

    groups = 1  # group_size None = the head dim
    rep = cache.memory_report()
    esize = torch.empty(0, dtype=dtype).element_size()
    n_hp = n_sink + n_recent
    q_bytes = LAYERS * n_q * HKV * (2 * (D // 4) + 2 * 2 * groups * 2)
    hp_bytes = LAYERS * n_hp * HKV * D * 2 * esize
    assert rep["tokens_quantized"] == n_q and rep["tokens_hp"] == n_hp
    assert rep["quantized_bytes"] == q_bytes
    assert rep["hp_bytes"] == hp_bytes
    assert rep["total_bytes"] == q_bytes + hp_bytes
    assert rep["bits_per_element"] == pytest.approx(
        8 * (q_bytes + hp_bytes) / (2 * LAYERS * (n_q + n_hp) * HKV * D)
    )
    assert rep["allocated_bytes"] >= rep["total_bytes"]

    for layer in cache.layers:
        p = layer.pools
        assert p.k_codes.dtype == torch.uint8 and p.k_codes.shape[1:] == (HKV, D // 4)
        assert p.k_meta.dtype == torch.float16 and p.k_meta.shape[1:] == (HKV, groups, 2)
        assert p.hp_k.dtype == dtype and p.hp_k.shape[1:] == (HKV, D)


def test_stored_rows_are_rotated_and_quantized(qwen3, rotations):
    """Sink rows hold ``k·R_K`` in 16 bits; prompt-middle rows are the packed quantized
    ``k·R_K`` / ``v·R_V`` (the prompt's K/V equal those of a DynamicCache run)."""
    ids = prompt(60, seed=13)[None]
    with torch.no_grad():
        dyn = DynamicCache()
        qwen3(input_ids=ids, past_key_values=dyn, use_cache=True)
        cache = OscarCache.from_rotations(qwen3, rotations, spec=SPEC)
        qwen3(input_ids=ids, past_key_values=cache, use_cache=True)
    assert counts(cache) == (4, 60 - 4 - 16, 16)
    for i, layer in enumerate(cache.layers):
        rk, rv = rotations.layers[i].k, rotations.layers[i].v
        k = dyn.layers[i].keys[0].transpose(0, 1)  # [T, Hkv, d]
        v = dyn.layers[i].values[0].transpose(0, 1)
        k_rot, v_rot = k @ rk, v @ rv
        p = layer.pools
        torch.testing.assert_close(p.hp_k[:4], k_rot[:4], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(p.hp_v[:4], v_rot[:4], atol=1e-4, rtol=1e-4)
        # quantized tier: tokens 4..43 in slots 0..39, within half a step of the clipped rows
        for codes, meta, fmt, rows, clip in (
            (p.k_codes, p.k_meta, layer.k_fmt, k_rot, SPEC.k_clip),
            (p.v_codes, p.v_meta, layer.v_fmt, v_rot, SPEC.v_clip),
        ):
            assert fmt == RowFormat(head_dim=D, bits=2, group=D, clip=clip)
            deq = dequantize_rows(codes[:40], meta[:40], fmt)
            target = clip_rows(rows[4:44], clip)
            step = meta[:40, :, :, 0].float().repeat_interleave(D, dim=-1)
            assert ((deq - target).abs() <= 0.51 * step + 1e-4).all()
        # the recent window (tokens 44..59) is kept exactly, after the sink
        ring0 = 4
        torch.testing.assert_close(p.hp_k[ring0 : ring0 + 16], k_rot[44:], atol=1e-4, rtol=1e-4)


# ---- 3. demotion window ----------------------------------------------------------------------------
def test_demotion_keeps_recent_window_between_r_and_r_plus_block(qwen3, rotations):
    ids = prompt(70, seed=14)[None]
    cache = OscarCache.from_rotations(qwen3, rotations, spec=SPEC)
    r, blk = SPEC.recent_tokens, SPEC.demote_block
    with torch.no_grad():
        logits = qwen3(input_ids=ids[:, :40], past_key_values=cache, use_cache=True).logits
        assert counts(cache) == (4, 40 - 4 - r, min(r, 40 - 4))
        seen = []
        for step in range(30):
            tok = ids[:, 40 + step : 41 + step]
            logits = qwen3(input_ids=tok, past_key_values=cache, use_cache=True).logits
            n_sink, n_q, n_recent = counts(cache)
            total = 40 + step + 1
            assert r <= n_recent <= r + blk - 1, (step, n_recent)
            assert n_sink == 4 and n_sink + n_q + n_recent == total
            assert cache.get_seq_length() == total
            seen.append(n_recent)
            assert torch.isfinite(logits).all()
    # demotions happen in whole blocks: the window cycles r, r+1, ..., r+blk-1, r, ...
    assert seen[:9] == [17, 18, 19, 20, 21, 22, 23, 16, 17]
    assert set(seen) == set(range(r, r + blk))


def test_tiers_hold_the_right_tokens_under_mixed_prefill_and_decode(qwen3, rotations):
    """After every forward of a schedule mixing chunks and single tokens, the 16-bit CSR lists the
    sink then the last ``n_recent`` tokens (``k·R_K`` exactly) and the quantized CSR the tokens in
    between (within half a quantization step). Layer 0's K/V depend only on token and position,
    so a DynamicCache run over the whole sequence gives the expected rows."""
    schedule = [30, *[1] * 10, 12, *[1] * 9, 5, *[1] * 20, 40, 3]
    total = sum(schedule)
    ids = prompt(total, seed=28)[None]
    rk, rv = rotations.layers[0].k, rotations.layers[0].v
    with torch.no_grad():
        dyn = DynamicCache()
        qwen3(input_ids=ids, past_key_values=dyn, use_cache=True)
        k_rot = dyn.layers[0].keys[0].transpose(0, 1) @ rk
        v_rot = dyn.layers[0].values[0].transpose(0, 1) @ rv
        cache = OscarCache.from_rotations(qwen3, rotations, spec=SPEC)
        pos = 0
        for n in schedule:
            qwen3(input_ids=ids[:, pos : pos + n], past_key_values=cache, use_cache=True)
            pos += n
            n_sink, n_q, n_recent = counts(cache)
            assert n_sink == 4 and n_sink + n_q + n_recent == pos
            assert SPEC.recent_tokens <= n_recent <= SPEC.recent_tokens + SPEC.demote_block - 1
            _, q_idx, _, h_idx = (t.long() for t in cache.table.csr(torch.device("cpu")))
            assert q_idx.numel() == n_q and h_idx.numel() == n_sink + n_recent
            layer = cache.layers[0]
            p = layer.pools
            hp_rows = torch.cat([k_rot[:n_sink], k_rot[pos - n_recent : pos]])
            torch.testing.assert_close(p.hp_k[h_idx], hp_rows, atol=1e-5, rtol=1e-5)
            hp_rows = torch.cat([v_rot[:n_sink], v_rot[pos - n_recent : pos]])
            torch.testing.assert_close(p.hp_v[h_idx], hp_rows, atol=1e-5, rtol=1e-5)
            for codes, meta, fmt, rows in (
                (p.k_codes, p.k_meta, layer.k_fmt, k_rot),
                (p.v_codes, p.v_meta, layer.v_fmt, v_rot),
            ):
                deq = dequantize_rows(codes[q_idx], meta[q_idx], fmt)
                target = clip_rows(rows[n_sink : pos - n_recent], fmt.clip)
                step = meta[q_idx][..., 0].float().repeat_interleave(fmt.group, dim=-1)
                assert ((deq - target).abs() <= 0.51 * step + 1e-5).all(), pos


def test_per_layer_clips_come_from_the_rotations_unless_a_spec_is_given(qwen3):
    rs = make_rotations()
    rs.layers[1].k_clip, rs.layers[1].v_clip = 0.5, 0.75
    cache = OscarCache.from_rotations(qwen3, rs)
    assert (cache.layers[0].k_fmt.clip, cache.layers[0].v_fmt.clip) == (SPEC.k_clip, SPEC.v_clip)
    assert (cache.layers[1].k_fmt.clip, cache.layers[1].v_fmt.clip) == (0.5, 0.75)
    spec = QuantSpec(sink_tokens=4, recent_tokens=16, k_clip=0.9, v_clip=0.0)
    cache = OscarCache.from_rotations(qwen3, rs, spec=spec)
    assert all((layer.k_fmt.clip, layer.v_fmt.clip) == (0.9, 0.0) for layer in cache.layers)


def test_prefill_shorter_than_window_keeps_everything_after_sink_in_16_bits(qwen3, rotations):
    cache = OscarCache.from_rotations(qwen3, rotations, spec=SPEC)
    with torch.no_grad():
        qwen3(input_ids=prompt(15, seed=15)[None], past_key_values=cache, use_cache=True)
    assert counts(cache) == (4, 0, 11)


# ---- 4. padded batches --------------------------------------------------------------------------
def test_left_padded_batch_matches_single_runs(qwen3, rotations):
    a, b = prompt(70, seed=16), prompt(45, seed=17)
    ids, mask = left_pad([a, b])
    batch_cache = OscarCache.from_rotations(qwen3, rotations, spec=SPEC)
    got = greedy(qwen3, ids, batch_cache, 25, mask)

    single = []
    for i, p in enumerate((a, b)):
        cache = OscarCache.from_rotations(qwen3, rotations, spec=SPEC)
        single.append(greedy(qwen3, p, cache, 25)[0])
        # pads are stored nowhere: per-sequence tier counts equal the single run's
        assert counts(batch_cache, i) == counts(cache, 0)
    assert torch.equal(got[0], single[0]), (got[0].tolist(), single[0].tolist())
    assert torch.equal(got[1], single[1]), (got[1].tolist(), single[1].tolist())
    assert counts(batch_cache, 1)[0] == 4 and sum(counts(batch_cache, 1)) == 45 + 25 - 1
    assert counts(batch_cache, 1)[1] > 0


def test_left_padded_batch_with_prompt_shorter_than_sink(qwen3, rotations):
    a, b = prompt(40, seed=18), prompt(2, seed=19)
    ids, mask = left_pad([a, b])
    cache = OscarCache.from_rotations(qwen3, rotations, spec=SPEC)
    got = greedy(qwen3, ids, cache, 20, mask)
    alone = OscarCache.from_rotations(qwen3, rotations, spec=SPEC)
    ref = greedy(qwen3, b, alone, 20)
    assert counts(cache, 1) == counts(alone, 0)
    assert counts(cache, 1)[0] == 2
    assert torch.equal(got[1], ref[0])


# ---- 5. sink semantics ------------------------------------------------------------------------------
@pytest.mark.parametrize("n_prompt", [1, 3])
def test_short_prompt_sink_never_grows(qwen3, rotations, n_prompt):
    ids = prompt(n_prompt + 40, seed=20)[None]
    cache = OscarCache.from_rotations(qwen3, rotations, spec=SPEC)
    with torch.no_grad():
        qwen3(input_ids=ids[:, :n_prompt], past_key_values=cache, use_cache=True)
        assert counts(cache) == (n_prompt, 0, 0)
        for i in range(n_prompt, n_prompt + 40):
            qwen3(input_ids=ids[:, i : i + 1], past_key_values=cache, use_cache=True)
            n_sink, n_q, n_recent = counts(cache)
            assert n_sink == n_prompt, i  # generated tokens never join the sink
            assert n_sink + n_q + n_recent == i + 1
    assert n_q > 0  # ... they are demoted to the quantized tier instead


def test_short_prompt_generate(qwen3, rotations):
    cache = OscarCache.from_rotations(qwen3, rotations, spec=SPEC)
    out = greedy(qwen3, prompt(3, seed=21), cache, 30)
    assert out.shape == (1, 30)
    n_sink, n_q, n_recent = counts(cache)
    assert n_sink == 3 and n_q > 0 and n_sink + n_q + n_recent == 3 + 29


# ---- 6. chunked prefill ------------------------------------------------------------------------------
@pytest.mark.parametrize(("bits", "tol"), [(4, 0.05), (2, 0.15)])
def test_chunked_prefill_close_to_single_prefill(qwen3, rotations, bits, tol):
    spec = QuantSpec(sink_tokens=4, recent_tokens=16, demote_block=8, key_bits=bits, value_bits=bits)
    ids = prompt(104, seed=22)[None]
    chunked = OscarCache.from_rotations(qwen3, rotations, spec=spec)
    single = OscarCache.from_rotations(qwen3, rotations, spec=spec)
    with torch.no_grad():
        for s in range(0, 100, 30):
            qwen3(input_ids=ids[:, s : min(s + 30, 100)], past_key_values=chunked, use_cache=True)
        assert counts(chunked) == (4, 100 - 4 - 16, 16)
        qwen3(input_ids=ids[:, :100], past_key_values=single, use_cache=True)
        assert counts(single) == counts(chunked)
        for i in range(100, 104):
            lc = qwen3(input_ids=ids[:, i : i + 1], past_key_values=chunked, use_cache=True).logits
            ls = qwen3(input_ids=ids[:, i : i + 1], past_key_values=single, use_cache=True).logits
    assert counts(single) == counts(chunked)
    # later chunks read the earlier ones back quantized, so they differ a little
    rel = float((lc - ls).norm() / ls.norm())
    assert rel < tol, rel


# ---- 7. absorbed value rotation ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "granularity", "bias"),
    [("qwen3", "layer", False), ("qwen3", "kv_head", False), ("llama", "kv_head", True)],
)
def test_absorb_v_generates_like_explicit_value_rotation(kind, granularity, bias):
    model = make_model(kind, seed=3, bias=bias)
    absorbed = copy.deepcopy(model)
    rs = make_rotations(granularity=granularity, seed=5)
    ids = prompt(60, seed=23)

    plain = greedy(model, ids, OscarCache.from_rotations(model, rs, spec=SPEC), 30)
    cache = OscarCache.from_rotations(absorbed, rs, spec=SPEC, absorb_v=True)
    assert cache.values_prerotated
    got = greedy(absorbed, ids, cache, 30)

    agree = float((got == plain).float().mean())
    assert agree >= 0.9, (got.tolist(), plain.tolist())
    # the absorbed projection emits v·R_V per head
    x = torch.randn(5, 64)
    for i in range(LAYERS):
        v0 = model.model.layers[i].self_attn.v_proj(x).view(5, HKV, D)
        v1 = absorbed.model.layers[i].self_attn.v_proj(x).view(5, HKV, D)
        r = rs.layers[i].v
        want = v0 @ r if r.dim() == 2 else torch.einsum("nhd,hde->nhe", v0, r)
        torch.testing.assert_close(v1, want, atol=1e-5, rtol=1e-5)


def test_absorb_twice_raises_and_flag_is_remembered(rotations):
    model = make_model("qwen3", seed=4)
    OscarCache.from_rotations(model, rotations, absorb_v=True)
    w = model.model.layers[0].self_attn.v_proj.weight.clone()
    with pytest.raises(ValueError, match="already absorbed"):
        absorb_value_rotation(model, rotations)
    # a second cache asking for absorption reuses the absorbed weights instead of rotating twice
    OscarCache.from_rotations(model, rotations, absorb_v=True)
    assert torch.equal(model.model.layers[0].self_attn.v_proj.weight, w)
    # a later cache for the same model knows its values come out rotated
    assert OscarCache.from_rotations(model, rotations).values_prerotated


# ---- 8. errors and isolation -------------------------------------------------------------------------
def test_rotations_with_wrong_head_dim_are_rejected(qwen3):
    with pytest.raises(RotationFileError, match="head_dim"):
        OscarCache.from_rotations(qwen3, make_rotations(d=16))


def test_per_head_rotations_with_wrong_head_count_are_rejected(qwen3):
    with pytest.raises(RotationFileError, match="KV head count"):
        OscarCache.from_rotations(qwen3, make_rotations(granularity="kv_head", heads=HKV + 1))


def test_rotations_missing_a_layer_are_rejected(qwen3):
    with pytest.raises(RotationFileError, match="layer"):
        OscarCache.from_rotations(qwen3, make_rotations(layers=1))


def test_beam_search_is_refused(qwen3, rotations):
    cache = OscarCache.from_rotations(qwen3, rotations, spec=SPEC)
    ids = prompt(20, seed=24)[None]
    with pytest.raises(NotImplementedError, match="beam"):
        qwen3.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            num_beams=2,
            do_sample=False,
            pad_token_id=0,
            past_key_values=cache,
        )


def test_other_caches_are_unaffected_after_switch(rotations):
    model = make_model("llama", seed=6)
    ids = prompt(50, seed=25)
    before = greedy(model, ids, DynamicCache(), 20)
    with torch.no_grad():
        before_logits = model(input_ids=ids[None]).logits

    greedy(model, ids, OscarCache.from_rotations(model, rotations, spec=SPEC), 20)
    assert model.config._attn_implementation == "oscarkv"

    after = greedy(model, ids, DynamicCache(), 20)
    assert torch.equal(after, before)
    with torch.no_grad():
        after_logits = model(input_ids=ids[None]).logits  # no cache at all
    torch.testing.assert_close(after_logits, before_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("how", ["attn_switched_away", "constructor_without_from_rotations"])
def test_cache_used_without_oscarkv_attention_fails_loudly(rotations, how):
    """If the model's attention does not go through ``oscarkv`` (attn_implementation changed after
    ``from_rotations``, or ``OscarCache(...)`` built directly), ``update`` hands back only the new
    K/V, nothing is stored and every step attends to itself alone: generation must not silently
    continue. Nor may the unconsumed state break later runs of the model with other caches."""
    from oscarkv.hf import attention as oscar_attention

    model = make_model("qwen3", seed=7)
    ids = prompt(20, seed=29)
    if how == "attn_switched_away":
        cache = OscarCache.from_rotations(model, rotations, spec=SPEC)
        model.set_attn_implementation("sdpa")
    else:
        cache = OscarCache(rotations, LAYERS, spec=SPEC)
    try:
        with pytest.raises(RuntimeError, match="OscarCache was updated but its attention never ran"):
            greedy(model, ids, cache, 5)
        OscarCache.from_rotations(model, rotations, spec=SPEC)  # route attention through oscarkv
        expected = greedy(make_model("qwen3", seed=7), ids, DynamicCache(), 5)
        assert torch.equal(greedy(model, ids, DynamicCache(), 5), expected)
    finally:
        oscar_attention.PENDING.clear()  # never leak stale state into other tests


def test_batch_size_change_is_refused(qwen3, rotations):
    cache = OscarCache.from_rotations(qwen3, rotations, spec=SPEC)
    with torch.no_grad():
        qwen3(input_ids=prompt(10, seed=26)[None], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="batch"):
            qwen3(input_ids=prompt(2, seed=27).view(2, 1), past_key_values=cache, use_cache=True)


# ---- 9. lazy import ----------------------------------------------------------------------------------
def test_oscarcache_is_a_lazy_attribute():
    # (that ``import oscarkv`` alone does not import the hf layer is checked in test_imports.py)
    assert "OscarCache" in oscarkv.__all__
    assert oscarkv.OscarCache is OscarCache
    from oscarkv import OscarCache as via_from_import

    assert via_from_import is OscarCache
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = oscarkv.NoSuchThing


def test_ranges_to_csr_expands_ranges_in_order() -> None:
    from oscarkv.kernels.pool_ops import ranges_to_csr

    ranges = [[(100, 3), (7, 0), (40, 2)], [], [(0, 1)], [(5, 0)], [(300, 4), (200, 1)]]
    indptr, idx = ranges_to_csr(ranges, torch.device("cpu"))
    want = [s + i for r in ranges for s, n in r for i in range(n)]
    assert indptr.tolist() == [0, 5, 5, 6, 6, 11]
    assert idx.dtype == torch.int32 and idx.tolist() == want
    indptr, idx = ranges_to_csr([[], [(3, 0)]], torch.device("cpu"))
    assert indptr.tolist() == [0, 0, 0] and idx.numel() == 0
