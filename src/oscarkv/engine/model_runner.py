"""`ModelRunner`: the decoder, the KV pools and the per-layer attention of one engine, and one
step of it: plan the batch's slots, run the forward, sample.

Built from an :class:`~oscarkv.config.EngineConfig`: the rotations are loaded and checked
against the model's config, ``R_V`` is folded into ``v_proj`` and ``R_Vᵀ`` into ``o_proj`` at load
(``absorb_v``: no output rotation runs in a step), the pools
take the KV budget, and the kernels are resolved once (the torch reference on CPU).

Under tensor parallelism (``comm``) every rank builds one with its shard of the weights, its
KV heads' pools and rotations; rank 0 (``publish`` set) plans each step and publishes it as a
:class:`StepMsg`, the other ranks :meth:`ModelRunner.execute` it (``engine/distributed.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import EngineConfig, QuantSpec
from ..errors import InputError, OscarkvWarning
from ..kernels import resolve
from ..kernels.devices import resolve_device
from ..quant import RowFormat
from ..rotation import LayerShift, RotationSet, load_rotations
from ..store import DecodeTensors, PageTables, PrefillTensors, TierAttention
from ..store.windows import GATHER_ROWS_PER_TOKEN
from .decode_buffers import DecodeStaging, HostDecode
from .graphs import DecodeGraphs, batch_bucket, len_bucket
from .kv_budget import kv_budget
from .kv_pool import KVPool, hp_dtype, longest_request, plan_pools
from .launched import Launched, Scored, pinned
from .models import load_decoder
from .models.parallel import Comm
from .penalties import PenaltyCounts
from .planner import fill_lists, plan_decode_host, plan_prefill
from .prefix_cache import tokens_between
from .request import Batch, SamplingParams
from .sampler import make_generator, sample, to_device, token_logprobs
from .tokenizer import load_tokenizer
from .tp_step import StepMsg, prefill_to, rank_rotation

__all__ = ["ModelRunner"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: bytes of fp32 logits that exist at once when scoring a prompt (``score_rows`` rows of the vocab)
SCORE_BYTES = 64 << 20


def _config_dict(model_dir: str) -> dict[str, Any]:
    p = Path(model_dir) / "config.json"
    if not p.is_file():
        raise InputError(f"model {model_dir}: no config.json", "pass a model directory")
    return json.loads(p.read_text(encoding="utf-8"))


class ModelRunner:
    """Loads everything one engine needs and runs its steps (one process, one device; under
    tensor parallelism, one rank: ``comm``, and ``publish`` on rank 0)."""

    def __init__(
        self, cfg: EngineConfig, comm: Comm | None = None, publish: Callable[[StepMsg], None] | None = None
    ):
        self.cfg = cfg
        self.comm, self.publish = comm, publish
        tp, rank = (1, 0) if comm is None else (comm.world, comm.rank)
        self.tp = tp
        self.device = torch.device(resolve_device(cfg.device))
        dt = cfg.dtype if cfg.dtype != "auto" else ("bf16" if self.device.type == "cuda" else "fp32")
        self.dtype = _DTYPES[dt]
        config = _config_dict(cfg.model)
        self.rotations = self._rotations(config)
        self.spec = cfg.spec or (self.rotations.spec if self.rotations is not None else QuantSpec())
        if cfg.window_dtype is not None:  # the artifact's formats and clips stay; only the windows change
            self.spec = dataclasses.replace(self.spec, window_dtype=cfg.window_dtype)
        absorb = self.rotations is not None and cfg.absorb_v
        r_v = {i: lr.v for i, lr in self.rotations.layers.items()} if absorb else None
        self.ops = resolve(cfg.backend, self.device)
        if self.rotations is not None:  # before the weights load: a format the kernels lack fails now
            rs = self.rotations
            self.ops.require_formats(
                [rs.formats(i, cfg.spec) for i in rs.layer_ids],
                "use backend='torch', or calibrate with --high-key-bits 4",
            )
            self.ops.require_windows(self.spec.window_dtype, self.device, "use --window-dtype model")
        self.model, self.shape = load_decoder(
            cfg.model,
            self.dtype,
            self.device,
            r_v=r_v,
            load_format=cfg.load_format,
            seed=cfg.seed,
            ops=self.ops,
            comm=comm,
        )
        self.tokenizer = load_tokenizer(cfg.model)
        s = self.shape
        self.score_rows = max(1, SCORE_BYTES // (4 * s.vocab))  # prompt rows scored per LM-head call
        if cfg.max_model_len is not None and cfg.max_model_len > s.max_positions:
            raise InputError(
                f"max_model_len={cfg.max_model_len} is more than the {s.max_positions} positions of model "
                f"{cfg.model} (max_position_embeddings)",
                f"lower --max-model-len to at most {s.max_positions}, or leave it unset",
            )
        self.max_model_len = cfg.max_model_len or s.max_positions
        fmts = self._formats() if self.rotations is not None else None
        self.activation_peak = (
            self._profile_prefill() if cfg.kv_budget_gb is None and self.device.type == "cuda" else 0
        )
        self.budget = kv_budget(cfg, self.device, reserve=self.activation_peak, ranks=tp)
        budget = self.budget.bytes
        if comm is not None:  # the budget is per rank; every rank must plan the same page counts
            budget = comm.min_int(budget, self.device)
        kv_heads = s.num_kv_heads // tp
        pools = (
            cfg,
            self.spec if fmts else None,
            s.num_layers,
            kv_heads,
            s.head_dim,
            self.dtype,
            budget,
            fmts,
        )
        if cfg.max_model_len is None and cfg.max_running is None:  # every rank lowers it alike
            fit = longest_request(*pools, self.max_model_len)
            if fit < self.max_model_len and rank == 0:
                warnings.warn(
                    OscarkvWarning(
                        f"max_model_len lowered to {fit} from the model's {self.max_model_len} positions: "
                        f"the longest request a KV budget of {budget / (1 << 30):.3g} GiB holds (--kv-budget-gb "
                        "raises it, --max-model-len sets it)"
                    ),
                    stacklevel=2,
                )
            self.max_model_len = fit
        self.plan = plan_pools(*pools, self.max_model_len)
        self.slots_chosen = cfg.max_running is None
        if self.slots_chosen:  # every later reader (scheduler, buckets) sees the slots chosen
            self.cfg = cfg = dataclasses.replace(cfg, max_running=self.plan.max_running)
        self.pool = KVPool(self.plan, s.num_layers, kv_heads, s.head_dim, self.dtype, fmts, self.device,
                           hp_dtype(cfg, self.spec if fmts else None, self.dtype))  # fmt: skip
        scale = s.head_dim**-0.5
        self.attn = []
        for i in range(s.num_layers):
            kf, vf = fmts[i] if fmts else self.pool.fmts[i]
            r_k = r_vv = shift = None
            if self.rotations is not None:
                lr = self.rotations.layers[i]
                if tp > 1:
                    lr = rank_rotation(lr, tp, rank)
                r_k, r_vv = lr.k.to(self.device, torch.float32), lr.v.to(self.device, torch.float32)
                shift = LayerShift.build(lr, s.num_heads // tp, absorb, self.device, self.dtype, absorb)
            self.attn.append(TierAttention(i, r_k, r_vv, kf, vf, self.ops, scale, values_prerotated=absorb,
                                           shift=shift, outputs_rotated=absorb))  # fmt: skip
        self.generators: dict[str, torch.Generator] = {}
        self.penalties: PenaltyCounts | None = None  # per-slot counts, made for the first penalized request
        # each request slot's page ids (host and device) and the last token sampled for it
        self.tables = PageTables.for_plan(self.plan, self.max_model_len, self.device)
        self.last_tok = torch.zeros(self.plan.max_running, dtype=torch.long, device=self.device)
        self.fingerprint = self._fingerprint(config)
        # on CUDA decode steps are padded and bucketed, so eager and graph steps run the same plans
        self.pad_decode = self.device.type == "cuda"
        self.staging = DecodeStaging(self.device, pinned=rank == 0)
        self.graphs = self._graphs()
        if self.graphs is not None and cfg.graph_capture == "startup":
            self.graphs.capture_all(self.plan.max_running, self.max_model_len)

    @torch.inference_mode()
    def _profile_prefill(self) -> int:
        """Bytes the largest prefill step allocates beyond what is resident: ``max_batched_tokens``
        new tokens of one sequence whose prefix fills ``max_model_len``, with that prefix gathered
        and dequantized (in fp32, then the model dtype) as the varlen prefill gathers it (under
        ``prefill_attention="invariant"`` or ``prompt_scoring="decode"`` also its key bank and one
        call's gather), then the LM
        head over ``score_rows`` rows (prompt scoring)."""
        dev, s = self.device, self.shape
        # the invariant and decode rules (store/windows.py) gather a key bank
        inv = self.cfg.kv_dtype == "int2" and (
            self.cfg.prefill_attention == "invariant" or self.cfg.prompt_scoring == "decode"
        )
        t = min(self.cfg.max_batched_tokens, self.max_model_len)
        p = self.max_model_len - t
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        cu = torch.tensor([[0, t], [0, p + t]], dtype=torch.int32, device=dev)

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            deq = torch.zeros(p, s.num_kv_heads, s.head_dim, dtype=torch.float32, device=dev)
            pk, pv = deq.to(self.dtype), deq.to(self.dtype)
            k_all, v_all = torch.cat([pk, k]), torch.cat([pv, v])
            q_rot = q.float().to(q.dtype)  # the rotation's fp32 round trip
            rows = (2 + GATHER_ROWS_PER_TOKEN) * (p + t) if inv else 0  # bank + gather, K and V
            held = torch.empty(2 * rows, s.num_kv_heads, s.head_dim, dtype=self.dtype, device=dev)
            out = self.ops.prefill_attention_varlen(
                q_rot, k_all, v_all, cu[0], cu[1], t, p + t, s.head_dim**-0.5
            )
            del held
            return out

        ids = torch.zeros(t, dtype=torch.long, device=dev)
        self.model(ids, torch.arange(t, device=dev), attn, torch.tensor([t - 1], device=dev))
        h = torch.zeros(self.score_rows, s.hidden, dtype=self.dtype, device=dev)
        token_logprobs(self.model.logits(h), torch.zeros(self.score_rows, dtype=torch.long, device=dev), 20)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        torch.cuda.empty_cache()
        return peak

    def startup_report(self) -> str:
        """One line on the pools: budget, pages per tier and tokens they hold."""
        plan, ps = self.plan, self.plan.page_tokens
        gib = 1 << 30
        if plan.int2:
            tiers = (
                f"{plan.q_pages - 1} INT2 pages ({(plan.q_pages - 1) * ps} tokens), "
                f"{'fp8' if self.spec.window_dtype == 'fp8_e4m3' else '16-bit'} sinks and rings "
                f"for {plan.max_running} requests"
            )
        else:
            tiers = f"{plan.hp_pages - 1} 16-bit pages ({(plan.hp_pages - 1) * ps} tokens)"
        peak = f", prefill peak {self.activation_peak / gib:.2f} GiB reserved" if self.activation_peak else ""
        g = self.graphs
        graphs = (
            "off"
            if g is None
            else f"on ({len(g.graphs)} captured in {g.capture_s:.1f} s)"
            if g.graphs
            else "on"
        )
        tp = f"; tensor parallel {self.tp} (pools per rank)" if self.tp > 1 else ""
        chosen = (
            f" (requests of max_model_len {self.max_model_len} the budget holds; --max-running sets it)"
            if self.slots_chosen
            else ""
        )
        if self.rotations is not None:  # what the artifact costs: the quality it was measured at
            rs = self.rotations.with_spec(self.spec)
            raised = sorted({rs.key_bits(i) for i in rs.layer_ids} - {rs.spec.key_bits})
            widths = f", {'/'.join(map(str, raised))}-bit keys in some layers" if raised else ""
            tiers += f"; {rs.bits_per_element(131072):.2f} bits per K/V element at 128K{widths}"
        if plan.window_block:  # store/windows.py: a gather over the varlen prefill, any backend
            tiers += (
                f"; prefill attention invariant (16-bit in the sink and {plan.window_block}-token window "
                "blocks, INT2 before; key lists gathered per block; prefix hits end on a block)"
            )
        if plan.score_window[1]:
            tiers += "; prompt scores read the INT2 history as decoding does (--prompt-scoring)"
        return (
            f"KV pools {plan.total_bytes / gib:.2f} GiB ({self.cfg.kv_dtype}; budget: {self.budget.source}): "
            f"{tiers}; max_running "
            f"{plan.max_running}{chosen}{peak}; CUDA graphs {graphs}; kernels {self.ops.backend.value}{tp}"
        )

    def _graphs(self) -> DecodeGraphs | None:
        mode, why = self.cfg.cuda_graphs, None
        if self.device.type != "cuda":
            why = f"the device is {self.device}"
        elif self.ops.backend.value != "triton":
            why = f"the kernel backend is {self.ops.backend.value} (graphs need triton)"
        elif self.tp > 1 and mode == "auto":  # NCCL inside captured graphs is untested here
            return None
        if why is None and mode != "off":
            plan = self.plan  # an INT2 sequence's 16-bit rows: its sink pages and its ring slab
            window = plan.sink_pages * plan.page_tokens + plan.ring_cap if plan.int2 else 0
            return DecodeGraphs(self._decode_hidden, self.device, self.spec.demote_block, window)
        if mode == "on" and why is not None:
            raise InputError(
                f"cuda_graphs on cannot run: {why}", "use cuda_graphs auto or off (--cuda-graphs)"
            )
        return None

    # ---- set-up ---------------------------------------------------------------------------
    def _rotations(self, config: dict[str, Any]) -> RotationSet | None:
        cfg = self.cfg
        if cfg.kv_dtype == "bf16":
            if cfg.rotations is not None:
                raise InputError(
                    "kv_dtype bf16 keeps every token in 16 bits and uses no rotations; got rotations="
                    f"{cfg.rotations}",
                    "drop rotations, or use kv_dtype int2",
                )
            return None
        if cfg.rotations is None:
            raise InputError(
                "kv_dtype int2 needs rotations (a directory from `oscarkv calibrate`)",
                "pass rotations=DIR (--rotations), or kv_dtype bf16 for the 16-bit baseline",
            )
        rs = load_rotations(cfg.rotations, model_config=config)
        if rs.layer_ids != list(range(int(config.get("num_hidden_layers", 0)))):
            raise InputError(
                f"rotations {cfg.rotations}: cover layers {rs.layer_ids}, not every layer of the model"
            )
        return rs

    def _formats(self) -> list[tuple[RowFormat, RowFormat]]:
        """Every layer's formats: the artifact's clips and key bits, or ``cfg.spec``'s everywhere."""
        assert self.rotations is not None
        return [self.rotations.formats(i, self.cfg.spec) for i in range(self.shape.num_layers)]

    def _fingerprint(self, config: dict[str, Any]) -> bytes:
        """Seeds the prefix cache's page hashes: the model config, the rotations and the dtype."""
        h = hashlib.blake2b(json.dumps(config, sort_keys=True, default=str).encode(), digest_size=16)
        h.update(
            str(
                (self.dtype, self.cfg.load_format, self.cfg.seed if self.cfg.load_format == "dummy" else 0)
            ).encode()
        )
        if self.rotations is not None:
            for i in self.rotations.layer_ids:
                lr = self.rotations.layers[i]
                h.update(lr.k.float().cpu().numpy().tobytes())
                h.update(lr.v.float().cpu().numpy().tobytes())
                for off in (lr.k_offset, lr.v_offset):
                    h.update(b"-" if off is None else off.float().cpu().numpy().tobytes())
        return h.digest()

    # ---- one step -------------------------------------------------------------------------
    def generator(self, rid: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        if rid not in self.generators:
            self.generators[rid] = make_generator(params.seed, self.device)
        return self.generators[rid]

    def release(self, rid: str) -> None:
        self.generators.pop(rid, None)

    def _decode_hidden(self, p: DecodeTensors) -> torch.Tensor:
        """The decode forward over tensors ``p`` up to the final hidden states (eager, or under a
        graph capture; the LM head runs outside graphs, so no graph holds a logits buffer): the
        row lists from the page tables, the input ids (the host's, or the token last sampled for
        the row's slot), then the layers."""
        pool = self.pool
        fill_lists(p, self.tables, self.plan)
        ids = torch.where(p.ids >= 0, p.ids, self.last_tok[p.slots.long()])

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.attn[layer].decode(q, k, v, pool.layer(layer), p)

        return self.model.hidden_states(ids, p.positions, attn)

    def plan_decode(self, batch: Batch) -> HostDecode:
        """The host part of a decode step (page-table changes and per-row fields)."""
        n, staging = len(batch.items), self.staging
        if not self.pad_decode:
            return plan_decode_host(batch, self.plan, alloc=staging.alloc, tables=self.tables)
        b = batch_bucket(n, self.cfg.max_running)
        return plan_decode_host(batch, self.plan, b, self.spec.demote_block, bucket=len_bucket,
                                alloc=staging.alloc, tables=self.tables,
                                host_lists=self.device.type == "cpu")  # fmt: skip

    def _decode(self, batch: Batch, h: HostDecode) -> torch.Tensor:
        n = len(batch.items)
        if self.publish is not None:  # a copy of just the step (h may view a reused staging buffer)
            self.publish(StepMsg(n, decode=h.wire()))
        return self._decode_logits(h, n)

    def _decode_logits(self, h: HostDecode, n: int) -> torch.Tensor:
        if self.graphs is not None:
            g = self.graphs.graph_for(h)
            self.tables.apply(self.staging.copy(h, g.d64, g.d32))
            g.graph.replay()
            hidden = g.out
        else:
            p, changes = self.staging.tensors(h)
            self.tables.apply(changes)
            hidden = self._decode_hidden(p)
        return self.model.logits(hidden[:n])

    def _prefill(self, batch: Batch) -> tuple[torch.Tensor, Scored | None]:
        dev = self.device
        ids = [t for it in batch.items for t in tokens_between(it.seq, it.start, it.start + it.n_new)]
        if self.publish is None:
            p = plan_prefill(batch, self.plan, dev)
            input_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
            return self._prefill_logits(input_ids, p)
        p, input_ids = plan_prefill(batch, self.plan, "cpu"), torch.tensor(ids, dtype=torch.long)
        self.publish(StepMsg(ids=input_ids, prefill=p))
        return self._prefill_logits(input_ids.to(dev, non_blocking=True), prefill_to(p, dev))

    def _prefill_logits(
        self, input_ids: torch.Tensor, p: PrefillTensors
    ) -> tuple[torch.Tensor, Scored | None]:
        """The logits of the rows that sample, and the prompt rows' log-probabilities (if any)."""
        pool = self.pool

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.attn[layer].prefill(q, k, v, pool.layer(layer), p)

        if p.lp_idx is None:
            return self.model(input_ids, p.positions, attn, p.last_idx), None
        n = p.last_idx.shape[0]
        h = self.model.final_hidden(input_ids, p.positions, attn, torch.cat([p.last_idx, p.lp_idx]))
        assert p.lp_target is not None
        r = self.score_rows
        parts = [token_logprobs(self.model.logits(h[n + a : n + a + r]), p.lp_target[a : a + r], p.lp_k)
                 for a in range(0, p.lp_idx.shape[0], r)]  # fmt: skip
        scored = tuple(torch.cat(t) for t in zip(*parts, strict=True))
        return self.model.logits(h[:n]), scored  # type: ignore[return-value]

    @torch.inference_mode()
    def execute(self, step: StepMsg) -> torch.Tensor:
        """Run the step rank 0 published (ranks > 0): the forward and the gathered fp32 logits."""
        if step.decode is not None:
            return self._decode_logits(step.decode, step.n)
        assert step.ids is not None and step.prefill is not None
        dev = self.device
        return self._prefill_logits(step.ids.to(dev, non_blocking=True), prefill_to(step.prefill, dev))[0]

    @torch.inference_mode()
    def launch(self, batch: Batch, host: HostDecode | None = None) -> Launched:
        """Queue ``batch`` on the device (a decode with its host part ``host`` from
        :meth:`plan_decode`, made here when not given): the forward, the sampling of one token
        per item that ends its prompt (every decode item), the tokens written to their slots'
        ``last_tok`` and copied to pinned host memory. :func:`~.launched.tokens_of` reads them."""
        prompt_lps = None
        if batch.is_decode:
            logits = self._decode(batch, host if host is not None else self.plan_decode(batch))
        else:
            logits, prompt_lps = self._prefill(batch)
        rows = [it for it in batch.items if it.ends_prompt]
        if not rows:
            ev = None
            if prompt_lps is not None and self.device.type == "cuda":
                prompt_lps, ev = pinned(prompt_lps), torch.cuda.Event()
                ev.record()
            return Launched(batch, None, event=ev, prompt_logprobs=prompt_lps)
        params = [it.seq.params for it in rows]
        gens = [self.generator(it.seq.rid, it.seq.params) for it in rows]
        if self.penalties is None and any(p.penalized for p in params):
            self.penalties = PenaltyCounts(self.plan.max_running, logits.shape[1], self.device)
        seen = self.penalties.seen(rows) if self.penalties is not None else None
        toks = sample(logits, params, gens, seen)
        if seen is not None and self.penalties is not None:  # counted before the next step samples
            self.penalties.count(toks)
        slots = [it.seq.slot or 0 for it in rows]
        self.last_tok.index_copy_(0, to_device(slots, torch.long, self.device), toks)
        ks = [p.logprobs for p in params if p.logprobs is not None]
        lps = token_logprobs(logits, toks, max(ks)) if ks else None
        if self.device.type != "cuda":
            return Launched(batch, toks, logprobs=lps, prompt_logprobs=prompt_lps)
        out = torch.empty(toks.shape, dtype=toks.dtype, pin_memory=True)
        out.copy_(toks, non_blocking=True)
        lps, prompt_lps = pinned(lps), pinned(prompt_lps)
        ev = torch.cuda.Event()
        ev.record()
        return Launched(batch, toks, out, ev, lps, prompt_lps)

    def memory_report(self, tokens_quantized: int = 0, tokens_hp: int = 0) -> dict[str, Any]:
        return self.pool.memory_report(tokens_quantized, tokens_hp)
