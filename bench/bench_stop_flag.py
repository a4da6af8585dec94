"""Cost of the ranks' agreement on a stop request: one all-reduce (MAX) of one int32 per step.

    python bench/bench_stop_flag.py [--iters 2000] [--world-size 2]

Times ``World.any_rank(False)`` (what the trainer calls every ``train.interrupt.check_every_steps``
steps) on forked gloo processes over loopback, one thread each, and prints the median and the
90th percentile per call in microseconds, on the slowest rank. On CUDA with NCCL the call also
waits for the device (``.item()``); measure it there with the same script on GPUs. Compare the
figure with the step time of docs/distributed.md (tiny U-Net, 2 ranks: 64 ms/step). Prints
figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world_size: int, port: int, iters: int, out: "mp.Queue") -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from latentforge.distributed.env import close_world, init_world

    world = init_world("cpu")
    for _ in range(50):  # warm-up: connections, allocator
        world.any_rank(False)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        world.any_rank(False)
        times.append(time.perf_counter() - t)
    close_world()
    out.put((rank, times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--world-size", type=int, default=2)
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, a.world_size, port, a.iters, out)) for r in range(a.world_size)]
    for proc in procs:
        proc.start()
    results = dict(out.get() for _ in procs)
    for proc in procs:
        proc.join()
    per_rank = {r: (statistics.median(t) * 1e6, statistics.quantiles(t, n=10)[-1] * 1e6) for r, t in results.items()}
    median = max(m for m, _ in per_rank.values())
    p90 = max(q for _, q in per_rank.values())
    print(f"any_rank (all-reduce MAX of one int32, gloo, {a.world_size} ranks, {a.iters} calls, "
          f"load average {os.getloadavg()[0]:.1f}): median {median:.0f} us, p90 {p90:.0f} us per call")


if __name__ == "__main__":
    main()
