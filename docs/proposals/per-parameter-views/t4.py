import sys, os, torch, torch.distributed as dist, torch.multiprocessing as mp, math
sys.path.insert(0, "/tmp/p11")
def main(rank, W, path):
    from sp import ShardedTensor, ShardSpec
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=W)
    torch.manual_seed(0)
    fulls = [torch.randn(7, 5), torch.randn(3), torch.randn(2)]  # the last: rank 1 owns nothing
    m = torch.nn.Module(); full_grads = [torch.randn_like(f) for f in fulls]
    for i, (f, g) in enumerate(zip(fulls, full_grads)):
        n = f.numel(); a, b = (rank * n) // W, ((rank + 1) * n) // W
        if i == 2: a, b = (0, 2) if rank == 0 else (2, 2)
        p = torch.nn.Parameter(ShardedTensor(f.reshape(-1)[a:b].clone(), ShardSpec(f.shape, a, b)))
        p.grad = ShardedTensor(g.reshape(-1)[a:b].clone(), p._spec)
        m.register_parameter(f"p{i}", p)
    from lightning.pytorch.utilities import grad_norm
    for nt in (2, 1, "inf"):
        got = grad_norm(m, nt)
        exp = {f"p{i}": float(g.norm(float(nt))) for i, g in enumerate(full_grads)}
        ok = all(abs(float(got[f"grad_{float(nt)}_norm/p{i}"]) - exp[f"p{i}"]) < 1e-5 for i in range(3))
        tot = float(torch.stack([g.norm(float(nt)) for g in full_grads]).norm(float(nt)))
        if rank == 0: print(f"grad_norm({nt}) per-param global: {ok}; total {float(got[f'grad_{float(nt)}_norm_total']):.5f} vs {tot:.5f}")
    for foreach in (False, True):
        for p, g in zip(m.parameters(), full_grads): pass
        tn = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, foreach=foreach)
        exp = float(torch.cat([g.reshape(-1) for g in full_grads]).norm())
        if rank == 0: print(f"torch clip_grad_norm_(foreach={foreach}) total {float(tn):.5f} vs full {exp:.5f}")
        # restore grads
        for i, (p, g) in enumerate(zip(m.parameters(), full_grads)):
            p.grad._local.copy_(g.reshape(-1)[p._spec.start:p._spec.end])
    dist.destroy_process_group()
if __name__ == "__main__":
    path = "/tmp/p11/store"; 
    if os.path.exists(path): os.remove(path)
    mp.spawn(main, args=(2, path), nprocs=2)
