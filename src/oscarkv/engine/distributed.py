"""Tensor parallelism on one host (engine.md §5.9): worker processes, the process group, the
per-step message from rank 0, and failures.

Rank 0 is the engine's own process: it owns the scheduler and planner, plans each step on the
host and sends the plan (a pickled :class:`~oscarkv.engine.tp_step.StepMsg`) to every
worker over its own pipe; then all ranks run the same forward on their own pools (identical page
ids) and the collectives inside it (gloo on CPU, NCCL on CUDA) keep them in lock step. A pipe,
not a collective, carries the steps so that an idle worker waits for work without a timeout and
sees rank 0 go away (``EOFError``). The rendezvous is a TCP store on ``127.0.0.1`` at a port the
OS picks. Rank 0 notices a dead worker before a step (its exit code), on the pipe (a broken
pipe) or in a collective (gloo's connection error; a collective that stays stuck ends after
``timeout_s``), then kills the other workers and raises :class:`TensorParallelError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import pickle
import signal
import time
import traceback
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..kernels.devices import resolve_device
from .models.loader import check_model_split

if TYPE_CHECKING:
    from .model_runner import ModelRunner

__all__ = [
    "TIMEOUT_S",
    "TPComm",
    "TensorParallelError",
    "Workers",
    "launch",
    "rank_config",
    "start_workers",
]

#: the longest a collective (or the start-up rendezvous) may wait for another rank
TIMEOUT_S = 300.0
#: how long rank 0, its collective broken, waits for the failed worker to report and exit
SETTLE_S = 10.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine is stopped."""


@dataclasses.dataclass
class TPComm:
    """One rank's collectives over its process group (satisfies ``models.parallel.Comm``)."""

    rank: int
    world: int
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(out, x, group=self.group)
        return out

    def min_int(self, n: int, device: torch.device) -> int:
        """The smallest ``n`` over the ranks (so every rank plans the same pools)."""
        t = torch.tensor([n], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def rank_config(cfg: EngineConfig, rank: int) -> EngineConfig:
    """``cfg`` for ``rank``: on CUDA, device ``cuda:(base + rank)``; elsewhere unchanged."""
    dev = torch.device(resolve_device(cfg.device))
    if dev.type != "cuda":
        return cfg
    return dataclasses.replace(cfg, device=f"cuda:{(dev.index or 0) + rank}")


def _init_group(cfg: EngineConfig, rank: int, world: int, store: dist.Store) -> TPComm:
    dev = torch.device(resolve_device(cfg.device))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S)
    )
    return TPComm(rank, world, dist.group.WORLD)


def _worker_main(cfg: EngineConfig, rank: int, port: int, conn: Connection, threads: int) -> None:
    """A worker's life: join the group, load its shard, then run the steps rank 0 sends."""
    from .model_runner import ModelRunner

    world = cfg.tensor_parallel
    try:
        torch.set_num_threads(threads)
        cfg = rank_config(cfg, rank)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        store.add("joined", 1)
        comm = _init_group(cfg, rank, world, store)
        runner = ModelRunner(cfg, comm=comm)
        conn.send(("ready", None))
        while True:
            step = pickle.loads(conn.recv_bytes())  # EOFError: rank 0 is gone
            if step is None:
                break
            runner.execute(step)
    except EOFError:
        pass
    except BaseException as e:  # reported to rank 0, then the process ends
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"exit code {code}, killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


def _stop(procs: list[Any], conns: list[Connection], grace: float) -> None:
    """Ask the workers to stop, wait ``grace`` seconds, kill what is left."""
    for c in conns:
        with contextlib.suppress(OSError):
            c.send_bytes(pickle.dumps(None))
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(end - time.monotonic(), 0))
        if p.is_alive():
            p.kill()
            p.join(5)
    for c in conns:
        c.close()


def _release(procs: list[Any], conns: list[Connection], grace: float = 0.0) -> None:
    """Stop the workers and leave the process group (also the finalizer of a lost engine)."""
    _stop(procs, conns, grace)
    if dist.is_initialized():
        dist.destroy_process_group()


def _readable(c: Connection) -> bool:
    """Whether ``c`` holds a message or has been closed by the worker."""
    try:
        return c.poll(0)
    except (EOFError, OSError):
        return True


class Workers:
    """Rank 0's handle on ranks ``1..world-1``: their processes and pipes."""

    def __init__(self, procs: list[Any], conns: list[Connection]):
        self.procs, self.conns = procs, conns
        self.error: TensorParallelError | None = None
        self.closed = False
        self._finalizer = weakref.finalize(self, _release, procs, conns)

    def send(self, step: Any) -> None:
        """Hand one step's message to every worker."""
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        for c in self.conns:
            c.send_bytes(data)

    def check(self) -> None:
        """Raise :class:`TensorParallelError` if the engine failed or a worker has exited."""
        if self.error is not None:
            raise self.error
        if any(p.exitcode is not None for p in self.procs):
            raise self.fail(None)

    def wait_ready(self, timeout: float = TIMEOUT_S) -> None:
        """Wait for every worker's ``ready`` (each loaded its shard and planned its pools)."""
        end = time.monotonic() + timeout
        for c in self.conns:
            while not c.poll(0.05):
                self.check()
                if time.monotonic() > end:
                    raise self.fail(TimeoutError(f"no worker ready within {timeout:.0f} s"))
            try:
                kind, _ = c.recv()
            except (EOFError, OSError):
                raise self.fail(None) from None
            if kind != "ready":
                raise self.fail(None)

    def fail(self, cause: BaseException | None) -> BaseException:
        """Stop every worker; the error to raise: which worker died and why, or ``cause`` itself
        when all workers were alive (rank 0's own failure)."""
        if self.error is not None:
            return self.error
        self._settle(cause)
        dead = [(r + 1, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]
        reports = []
        for r, c in enumerate(self.conns, 1):
            try:
                while c.poll(0):
                    kind, text = c.recv()
                    if kind == "error":
                        reports.append((r, text))
            except (EOFError, OSError):
                pass
        self.shutdown(grace=0.0)
        if not dead and not reports:  # rank 0's own failure: raise it, and refuse later steps
            what = "an error" if cause is None else f"{type(cause).__name__}: {cause}"
            self.error = TensorParallelError(f"the tensor-parallel engine stopped after {what} on rank 0")
            return cause if cause is not None else self.error
        world = len(self.procs) + 1
        parts = [f"rank {r} of {world} exited ({_exit_text(code)})" for r, code in dead]
        for r, text in reports:
            last = text.strip().splitlines()
            parts.append(f"rank {r} raised {last[0] if last else 'an error'}")
        err = TensorParallelError(
            "tensor-parallel worker failed: " + "; ".join(parts) + ". The engine is stopped: create a new one"
        )
        if not reports and any(code == 1 for _, code in dead):
            err.add_note(
                "its error is in the output above; a script that starts a tensor-parallel engine "
                'must do so under `if __name__ == "__main__":` (spawned workers import it)'
            )
        if reports:
            err.add_note("\n".join(f"--- rank {r} ---\n{text}" for r, text in reports))
        self.error = err
        return err

    def _settle(self, cause: BaseException | None) -> None:
        """Let a failing worker finish reporting and exiting before :meth:`fail` reads what
        happened: until one worker has exited and every worker that wrote to its pipe has too.
        A collective error on rank 0 (``RuntimeError``) means a peer went away, so wait up to
        ``SETTLE_S``; for other failures of rank 0's own, 2 s."""
        end = time.monotonic() + (SETTLE_S if cause is None or isinstance(cause, RuntimeError) else 2.0)
        while (left := end - time.monotonic()) > 0:
            exited = [p.exitcode is not None for p in self.procs]
            wrote = [_readable(c) for c in self.conns]
            if any(exited) and all(e or not w for e, w in zip(exited, wrote, strict=True)):
                return
            wait([p.sentinel for p in self.procs], timeout=min(left, 0.05))

    def shutdown(self, grace: float = 10.0) -> None:
        """Stop the workers (kill after ``grace`` seconds) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        _release(self.procs, self.conns, grace)


def start_workers(cfg: EngineConfig) -> tuple[Workers, TPComm]:
    """Spawn ranks ``1..N-1`` for ``cfg.tensor_parallel = N`` and join the group as rank 0.

    Raises :class:`TensorParallelError` when a worker dies before the group forms, and
    ``RuntimeError`` when this process already holds a process group.
    """
    world = cfg.tensor_parallel
    if dist.is_initialized():
        raise TensorParallelError(
            "this process already holds a torch.distributed process group (another tensor-parallel "
            "engine?): call shutdown() on it first"
        )
    dev = torch.device(resolve_device(cfg.device))
    if dev.type == "cuda" and (dev.index or 0) + world > torch.cuda.device_count():
        raise TensorParallelError(
            f"tensor_parallel={world} needs {world} GPUs from {dev}; {torch.cuda.device_count()} visible"
        )
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=TIMEOUT_S))  # fmt: skip
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(1, world):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_worker_main, args=(cfg, rank, store.port, theirs, torch.get_num_threads()),
                        name=f"oscarkv-tp{rank}", daemon=True)  # fmt: skip
        p.start()
        theirs.close()  # so that a dead worker's pipe reads EOF here
        procs.append(p)
        conns.append(mine)
    workers = Workers(procs, conns)
    try:
        end = time.monotonic() + TIMEOUT_S
        while store.add("joined", 0) < world - 1:
            workers.check()
            if time.monotonic() > end:
                raise TimeoutError(f"the workers did not join within {TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        comm = _init_group(rank_config(cfg, 0), 0, world, store)
    except BaseException as e:
        raise workers.fail(e) from e
    return workers, comm


def _check_split(cfg: EngineConfig) -> None:
    """Refuse a model whose sizes ``cfg.tensor_parallel`` cannot split, before spawning anything."""
    check_model_split(cfg.model, cfg.tensor_parallel)


def launch(cfg: EngineConfig) -> tuple[ModelRunner, Workers]:
    """Rank 0's runner and the running workers of a ``cfg.tensor_parallel > 1`` engine; a
    failure on any rank stops them all and raises."""
    from .model_runner import ModelRunner

    _check_split(cfg)
    workers, comm = start_workers(cfg)
    try:
        runner = ModelRunner(rank_config(cfg, 0), comm=comm, publish=workers.send)
        workers.wait_ready()
    except BaseException as e:
        err = workers.fail(e)
        if err is e:
            raise
        raise err from e
    return runner, workers
