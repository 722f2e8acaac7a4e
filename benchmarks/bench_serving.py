"""OpenAI-API load generator (engine.md §7.2): streamed completions or chat against any
OpenAI-compatible server, with TTFT, TPOT, inter-token latency, end-to-end time, throughput and
errors; results through ``_harness.save``.

    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --num-requests 64 --concurrency 8
    python benchmarks/bench_serving.py --start-demo --num-requests 8 --output-len 16   # CPU smoke

Token counts come from the server's ``usage`` chunk when it sends one (asked for with
``stream_options.include_usage``), else the prompt's length in words or ids and one output token per
streamed chunk with text. ITL is the gap between chunks with text (a chunk may carry several tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np
from _harness import save

_TEXT = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work number night "
         "point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member "
         "law car city community name president team minute idea kid body information back parent face "
         "others level office door health person art war history party result change morning reason "
         "research girl guy moment air teacher force education")  # fmt: skip
WORDS = _TEXT.split()
PCTS = (50, 90, 99)


@dataclass
class RequestSpec:
    """One request to send: its prompt (text or token ids) and lengths."""

    prompt: str | list[int]
    input_len: int
    output_len: int


@dataclass
class RequestResult:
    """What one request measured; times in seconds from its own start."""

    ok: bool
    input_len: int
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    e2e: float = 0.0
    start: float = 0.0  # since the run began
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def lengths(mean: int, range_ratio: float, n: int, rng: random.Random) -> list[int]:
    """``n`` lengths uniform in ``[mean*(1-r), mean*(1+r)]``, at least 1."""
    lo, hi = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_requests(n: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                  prompt_type: str = "words", vocab_size: int = 2000) -> list[RequestSpec]:  # fmt: skip
    """Random prompts: ``words`` (random English words, ~1 token each) or ``token-ids`` (random ids in
    ``[10, vocab_size)``, completions only)."""
    rng = random.Random(seed)
    ins, outs = lengths(input_len, range_ratio, n, rng), lengths(output_len, range_ratio, n, rng)
    specs = []
    for i, o in zip(ins, outs, strict=True):
        if prompt_type == "token-ids":
            prompt: str | list[int] = [rng.randrange(10, vocab_size) for _ in range(i)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(i))
        specs.append(RequestSpec(prompt, i, o))
    return specs


def arrival_times(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times (s from start): Poisson arrivals at ``request_rate`` per second, all 0 if infinite."""
    if request_rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


def base_url(url: str) -> str:
    """``http://host:port`` or ``.../v1`` -> ``.../v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def send_one(client: httpx.AsyncClient, url: str, model: str, spec: RequestSpec, chat: bool,
                   extra: dict[str, Any], t0: float) -> RequestResult:  # fmt: skip
    """Send one streaming request and time its chunks; any failure is an error result."""
    body: dict[str, Any] = {"model": model, "max_tokens": spec.output_len, "stream": True, "temperature": 0.0,
                            "stream_options": {"include_usage": True}, **extra}  # fmt: skip
    if chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    res = RequestResult(ok=False, input_len=spec.input_len)
    start = time.perf_counter()
    res.start = start - t0
    chunks, usage, last = 0, None, start
    try:
        path = "/chat/completions" if chat else "/completions"
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = f"stream error: {str(msg['error'])[:200]}"
                    return res
                usage = msg.get("usage") or usage
                choices = msg.get("choices") or []
                c = choices[0] if choices else {}
                text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                if not text:
                    continue
                now = time.perf_counter()
                if res.ttft is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last, chunks = now, chunks + 1
        res.e2e = time.perf_counter() - start
        res.output_tokens = int(usage["completion_tokens"]) if usage else chunks
        if usage and usage.get("prompt_tokens"):
            res.input_len = int(usage["prompt_tokens"])  # the server's count beats the word count
        res.ok = True
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(url: str, model: str, specs: list[RequestSpec], *, concurrency: int | None = None,
                   request_rate: float = float("inf"), seed: int = 0, chat: bool = False,
                   api_key: str | None = None, extra: dict[str, Any] | None = None,
                   on_done: Callable[[RequestResult], None] | None = None,
                   transport: httpx.AsyncBaseTransport | None = None,
                   timeout_s: float = 600.0) -> tuple[list[RequestResult], float]:  # fmt: skip
    """Send ``specs`` (Poisson arrivals at ``request_rate``, at most ``concurrency`` in flight);
    returns the results in spec order and the wall time of the run."""
    url = base_url(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency or len(specs) or 1, max_keepalive_connections=None)
    sem = asyncio.Semaphore(concurrency or max(1, len(specs)))
    times = arrival_times(len(specs), request_rate, seed)
    async with httpx.AsyncClient(
        headers=headers, timeout=timeout_s, limits=limits, transport=transport
    ) as client:
        t0 = time.perf_counter()

        async def one(spec: RequestSpec, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            async with sem:
                res = await send_one(client, url, model, spec, chat, extra or {}, t0)
            if on_done is not None:
                on_done(res)
            return res

        results = await asyncio.gather(*(one(s, t) for s, t in zip(specs, times, strict=True)))
        return list(results), time.perf_counter() - t0


def _stats(values: list[float]) -> dict[str, float]:
    """Mean and percentiles in milliseconds (NaN when empty)."""
    if not values:
        return {"mean_ms": float("nan"), **{f"p{p}_ms": float("nan") for p in PCTS}}
    a = np.asarray(values) * 1e3
    return {"mean_ms": float(a.mean()), **{f"p{p}_ms": float(np.percentile(a, p)) for p in PCTS}}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Counts, throughputs and latency statistics of a run (successful requests only)."""
    ok = [r for r in results if r.ok]
    n_in, n_out = sum(r.input_len for r in ok), sum(r.output_tokens for r in ok)
    d = max(duration, 1e-9)
    return {
        "completed": len(ok), "errors": len(results) - len(ok), "duration_s": duration,
        "input_tokens": n_in, "output_tokens": n_out, "request_throughput": len(ok) / d,
        "input_throughput": n_in / d, "output_throughput": n_out / d, "total_token_throughput": (n_in + n_out) / d,
        "ttft": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot": _stats([t for t in (r.tpot for r in ok) if t is not None]),
        "itl": _stats([g for r in ok for g in r.itl]),
        "e2e": _stats([r.e2e for r in ok]),
        "error_samples": sorted({r.error for r in results if not r.ok})[:5],
    }  # fmt: skip


def markdown(summary: dict[str, Any], label: str) -> str:
    s = summary
    lines = [f"Serving benchmark, {label}", "",
             f"{s['completed']} completed, {s['errors']} errors in {s['duration_s']:.2f} s: "
             f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
             f"{s['total_token_throughput']:.1f} total tok/s", "",
             "| metric | mean ms | p50 ms | p90 ms | p99 ms |", "|---|---|---|---|---|"]  # fmt: skip
    for k in ("ttft", "tpot", "itl", "e2e"):
        v = s[k]
        lines.append(
            f"| {k.upper()} | "
            + " | ".join(f"{v[c]:.2f}" for c in ("mean_ms", "p50_ms", "p90_ms", "p99_ms"))
            + " |"
        )
    return "\n".join(lines)


def headline(summary: dict[str, Any], shape: str) -> list[tuple[str, str, float]]:
    out = [(shape, m, summary[m]) for m in ("request_throughput", "output_throughput", "errors")]
    return out + [(shape, f"{k}_p50_ms", summary[k]["p50_ms"]) for k in ("ttft", "tpot", "itl", "e2e")]


def start_demo() -> Any:
    """The bundled demo model served in-process (BF16 pages, CPU) on a free port."""
    try:
        from oscarkv.server.launch import start_server
    except ImportError as e:
        raise SystemExit(f"--start-demo needs oscarkv.server.launch.start_server: {e}") from e
    from oscarkv.config import EngineConfig
    from oscarkv.config.server import ServerConfig
    from oscarkv.demo import demo_model_path

    return start_server(EngineConfig(model=str(demo_model_path()), kv_dtype="bf16", device="cpu"),
                        ServerConfig(port=0))  # fmt: skip


async def first_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=30) as c:
        r = await c.get(base_url(url) + "/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)")
    ap.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default: all)")
    ap.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per s (inf: all at t=0)"
    )
    ap.add_argument("--input-len", type=int, default=128, help="mean prompt length (words or token ids)")
    ap.add_argument("--output-len", type=int, default=64, help="mean max_tokens")
    ap.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in mean*(1 +- r)")
    ap.add_argument("--prompt-type", choices=("words", "token-ids"), default="words")
    ap.add_argument("--vocab-size", type=int, default=2000, help="token ids drawn below this")
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (fixed output lengths)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-demo", action="store_true", help="serve the bundled demo model in-process")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--name", default="bench_serving", help="results file name")
    args = ap.parse_args(argv)
    if args.endpoint == "chat" and args.prompt_type == "token-ids":
        ap.error("--prompt-type token-ids needs --endpoint completions")
    server = start_demo() if args.start_demo else None
    url = server.url if server is not None else args.url
    try:
        model = args.model or asyncio.run(first_model(url, args.api_key))
        specs = make_requests(args.num_requests, args.input_len, args.output_len, args.range_ratio,
                              args.seed, args.prompt_type, args.vocab_size)  # fmt: skip
        extra = {"ignore_eos": True} if args.ignore_eos else {}
        from rich.progress import Progress

        with Progress(disable=args.no_progress) as bar:
            task = bar.add_task("requests", total=len(specs))
            results, duration = asyncio.run(run_load(
                url, model, specs, concurrency=args.concurrency, request_rate=args.request_rate,
                seed=args.seed, chat=args.endpoint == "chat", api_key=args.api_key, extra=extra,
                on_done=lambda _r: bar.advance(task)))  # fmt: skip
    finally:
        if server is not None:
            server.stop()
    summary = summarize(results, duration)
    shape = f"{args.num_requests}x{args.input_len}x{args.output_len}@" + (
        f"c{args.concurrency}" if args.concurrency else "") + (f"r{args.request_rate:g}")  # fmt: skip
    label = f"{model} at {'demo' if server is not None else url}, {shape}"
    md = markdown(summary, label)
    print(md)
    payload = {"args": vars(args), "model": model, "summary": summary,
               "requests": [{k: v for k, v in asdict(r).items() if k != "itl"} for r in results]}  # fmt: skip
    save(args.name, payload, md, history=headline(summary, shape))
    return summary


if __name__ == "__main__":
    main()
