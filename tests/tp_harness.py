"""Runs a function on several ranks of a gloo process group on this machine (spawned processes, one thread each),
as torchrun would: `spawn(fn, *args)` -> each rank's return value."""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specdec.parallel import close_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, fn, args, queue) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        value = fn(rank, world, *args)
        dist.barrier()  # no rank tears the group down while another still uses it
        queue.put((rank, True, value))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        close_group(ok=False)  # the barrier is above: a result is queued only once every rank got there


def spawn(fn, *args, world: int = 2, timeout: float = 900) -> list:
    """`fn(rank, world, *args)` on `world` ranks (a module-level function: the spawned processes import it); -> the
    return values by rank. A rank that raises fails the call with its traceback."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = [ctx.Process(target=_rank, args=(r, world, port, fn, args, queue), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
    finally:
        if env is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = env
    out, failed, waiting, start = [None] * world, [], set(range(world)), time.monotonic()
    try:
        while waiting:
            try:
                rank, ok, value = queue.get(timeout=1)
            except queue_mod.Empty:
                dead = [r for r in waiting if procs[r].exitcode is not None]
                if dead or time.monotonic() - start > timeout:  # a rank died without reporting, or hangs
                    failed += [f"rank {r}: exited with code {procs[r].exitcode} without a result" for r in dead]
                    failed += [] if dead else [f"ranks {sorted(waiting)}: no result after {timeout} s"]
                    break
                continue
            waiting.discard(rank)
            if ok:
                out[rank] = value
            else:
                failed.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failed:
        raise RuntimeError("\n".join(failed))
    return out
