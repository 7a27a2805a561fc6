"""How fast can copy engines move an all_gather between H200s? Ways of moving every rank's
shard (S bytes) to every peer over torch's symmetric memory, timed against NCCL's all_gather:

- pull_1: copy the input into this rank's symmetric buffer, barrier, then pull each peer's
  buffer into the output, one copy per peer, all on the current stream;
- pull_n: the same with each peer's pull on its own stream;
- pull_chunks: pull_1 in 4 chunks per peer, chunk-major (what the pipelined overlap does);
- push_1: write the input into every peer's buffer slot [rank], barrier, copy the buffer out;
- push_n: push_1 with each peer's push on its own stream.

torchrun --nproc-per-node 4 benchmarks/transfer_probe.py --out benchmarks/results
"""

import argparse

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import timing

SIZES_MB = (16, 64, 256)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    rank, world, device = timing.start_job()
    cpu = dist.new_group(backend="gloo")
    group_name = dist.group.WORLD.group_name
    streams = [torch.cuda.Stream(device) for _ in range(world)]
    peers = [(rank + i) % world for i in range(1, world)]
    rows = []
    for mb in SIZES_MB:
        n = (mb << 20) // 2
        x = torch.randn(n, device=device, dtype=torch.bfloat16)
        out = torch.empty(world, n, device=device, dtype=torch.bfloat16)
        buf = symm_mem.empty(world * n, device=device, dtype=torch.bfloat16)
        handle = symm_mem.rendezvous(buf, group_name)
        bufs = [handle.get_buffer(p, (world * n,), torch.bfloat16) for p in range(world)]
        main_stream = torch.cuda.current_stream()

        def fork():
            for s in streams:
                s.wait_stream(main_stream)

        def join():
            for s in streams:
                main_stream.wait_stream(s)

        def pull(split: bool, chunks: int = 1):
            bufs[rank][:n].copy_(x)
            handle.barrier(channel=0)
            if split:
                fork()
            step = -(-n // chunks)
            for k in range(chunks):
                for i, p in enumerate(peers):
                    with torch.cuda.stream(streams[i] if split else main_stream):
                        out[p, k * step:(k + 1) * step].copy_(bufs[p][k * step:(k + 1) * step])
            out[rank].copy_(x)
            if split:
                join()
            handle.barrier(channel=1)

        def push(split: bool):
            handle.barrier(channel=0)
            if split:
                fork()
            for i, p in enumerate(peers):
                with torch.cuda.stream(streams[i] if split else main_stream):
                    bufs[p][rank * n:(rank + 1) * n].copy_(x)
            if split:
                join()
            handle.barrier(channel=1)
            out.view(-1).copy_(bufs[rank])
            out[rank].copy_(x)

        ways = {"nccl": lambda: dist.all_gather_into_tensor(out, x),
                "pull_1": lambda: pull(False), "pull_n": lambda: pull(True),
                "pull_chunks": lambda: pull(False, 4),
                "push_1": lambda: push(False), "push_n": lambda: push(True)}
        row = {"bytes_per_rank": mb << 20, "world_size": world}
        for name, fn in ways.items():
            fn()
            reference = torch.empty_like(out)
            dist.all_gather_into_tensor(reference, x)
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            assert torch.equal(out, reference), name
            us = timing.time_loop_us(fn, args.iters, cpu)
            row[f"{name}_us"] = round(us, 1)
            row[f"{name}_busbw_gbs"] = round((world - 1) * (mb << 20) / us / 1e3, 1)
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
    if rank == 0:
        timing.write_result(args.out, "transfer_probe", world, f"median of 5 loops of {args.iters} calls", rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
