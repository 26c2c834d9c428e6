"""Device check for design11: AdamW step, flat tensor vs per-parameter ShardedTensors (swap / no swap).

python gpu_optim_bench.py [--device cuda] [--numel 125e6] [--params 300]
Prints one row per config: median step ms over 20 steps after 3 warm-up steps.
"""
import argparse, statistics, sys, time, os
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sp import ShardedTensor, ShardSpec
import swap

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--numel", type=float, default=125e6)
ap.add_argument("--params", type=int, default=300)
ap.add_argument("--steps", type=int, default=20)
a = ap.parse_args()
dev = torch.device(a.device)
torch.manual_seed(0)
sizes = torch.randint(1, 100, (a.params,)).double()
sizes = (sizes / sizes.sum() * a.numel).long().clamp(min=1).tolist()
offs, c = [], 0
for s in sizes:
    c = (c + 15) // 16 * 16; offs.append(c); c += s
total = (c + 15) // 16 * 16
master0 = torch.randn(total, device=dev); g0 = torch.randn(total, device=dev) * 1e-3

def sync():
    if dev.type == "cuda": torch.cuda.synchronize()

def flat(**kw):
    p = torch.nn.Parameter(master0.clone()); p.grad = g0.clone()
    return torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, **kw), None

def sharded(groups=1, interleave=False, use_swap=True, **kw):
    m = master0.clone(); g = g0.clone(); ps, slots = [], {}
    for o, s in zip(offs, sizes):
        p = torch.nn.Parameter(ShardedTensor(m[o:o + s], ShardSpec((s,), 0, s)))
        p.grad = ShardedTensor(g[o:o + s], p._spec); ps.append(p); slots[id(p)] = swap.FlatSlot(m, o, s)
    if interleave:
        pg = [{"params": ps[i::groups], "lr": 1e-4 * (i + 1)} for i in range(groups)]
    else:
        n = (len(ps) + groups - 1) // groups
        pg = [{"params": ps[i * n:(i + 1) * n], "lr": 1e-4 * (i + 1)} for i in range(groups)]
    sw = swap.StepSwap(slots, None) if use_swap else None
    return torch.optim.AdamW(pg, lr=1e-4, weight_decay=0.1, **kw), sw

cfgs = {}
for mode in ("foreach", "fused"):
    kw = {mode: True}
    cfgs[f"flat 1 tensor, {mode}"] = lambda kw=kw: flat(**kw)
    cfgs[f"K ShardedTensor no swap, {mode}"] = lambda kw=kw: sharded(use_swap=False, **kw)
    cfgs[f"swap, 1 group, {mode}"] = lambda kw=kw: sharded(1, **kw)
    cfgs[f"swap, 10 contiguous groups, {mode}"] = lambda kw=kw: sharded(10, **kw)
    cfgs[f"swap, 10 interleaved groups, {mode}"] = lambda kw=kw: sharded(10, True, **kw)
print(f"device={dev} N={total/1e6:.1f}M K={a.params}")
for name, make in cfgs.items():
    opt, sw = make()
    for _ in range(3): opt.step()
    sync(); ts = []
    for _ in range(a.steps):
        t = time.perf_counter(); opt.step(); sync(); ts.append(time.perf_counter() - t)
    print(f"  {name:42s} {statistics.median(ts) * 1e3:8.2f} ms", flush=True)
    if sw: [h.remove() for h in sw._h]
    del opt, sw
    if dev.type == "cuda": torch.cuda.empty_cache()
