"""Context parallelism in two processes: each rank computes its shard of one packed batch, forward and backward,
and checks it against the single-process call on the whole batch.

    python examples/context_parallel.py                        # gloo on CPU; NCCL when 2+ GPUs
    torchrun --nproc_per_node=2 examples/context_parallel.py
"""
import os, socket, torch, torch.distributed as dist, torch.multiprocessing as mp, torch.nn.functional as F
import gdnkit, gdnkit.distributed

def run(rank, world):
    nccl = torch.cuda.device_count() >= world                   # one GPU per rank, else CPU processes
    dev = torch.device(f"cuda:{rank}" if nccl else "cpu")
    if nccl:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if nccl else "gloo", rank=rank, world_size=world)
    torch.manual_seed(0)                                        # every rank builds the same global batch
    T, H, HV, K, V = 600, 2, 4, 32, 32
    q, k = torch.randn(1, T, H, K, device=dev), F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1)
    v, g = torch.randn(1, T, HV, V, device=dev), F.logsigmoid(torch.randn(1, T, HV, device=dev))
    beta, w = torch.rand(1, T, HV, device=dev), torch.randn(1, T, HV, V, device=dev)
    cu = torch.tensor([0, 150, T], device=dev)                  # global offsets: sequence 1 spans every rank
    h0 = torch.randn(2, HV, K, V, device=dev, requires_grad=True)
    lo, hi = T * rank // world, T * (rank + 1) // world         # this rank's tokens (any split works)
    shard = [t[:, lo:hi].clone().requires_grad_() for t in (q, k, v, g, beta)]
    o, ht = gdnkit.distributed.chunk_gated_delta_rule(*shard, initial_state=h0, output_final_state=True,
                                                      cu_seqlens=cu)
    ((o * w[:, lo:hi]).sum() + ht.sum() / world).backward()     # this rank's loss; the ranks' losses add up
    dist.all_reduce(h0.grad)                                    # h0 is on every rank: sum its parts
    whole = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0.detach())]
    o1, ht1 = gdnkit.chunk_gated_delta_rule(*whole[:5], initial_state=whole[5], output_final_state=True,
                                            cu_seqlens=cu)
    ((o1 * w).sum() + ht1.sum()).backward()                     # the single-process call on the whole batch
    pairs = [(o, o1[:, lo:hi]), (ht, ht1), (h0.grad, whole[5].grad)]
    pairs += [(s.grad, t.grad[:, lo:hi]) for s, t in zip(shard, whole)]
    with torch.no_grad():
        err = max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)
    print(f"rank {rank} of {world} ({dist.get_backend()}): max error against one process {err:.1e}")
    dist.destroy_process_group()
    assert err < (1e-2 if nccl else 1e-4), err                  # 1e-2: TF32 matmuls on GPUs

if __name__ == "__main__":
    if "RANK" in os.environ:                                    # started by torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    else:
        with socket.socket() as s:                              # a free port for the processes to meet on
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        mp.spawn(run, args=(2,), nprocs=2)
