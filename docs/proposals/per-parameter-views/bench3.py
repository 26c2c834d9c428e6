import sys, time, statistics, torch
sys.path.insert(0, "/tmp/p11")
from sp import ShardedTensor, ShardSpec
import swap
torch.set_num_threads(1)
N = int(float(sys.argv[1])); K = int(sys.argv[2]); ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 3; STEPS = 4
torch.manual_seed(0)
sizes = torch.randint(1, 100, (K,)).double(); sizes = (sizes / sizes.sum() * N).long().clamp(min=1).tolist()
offs = []; c = 0
for s in sizes:
    c = (c + 15) // 16 * 16; offs.append(c); c += s
total = (c + 15) // 16 * 16
master0 = torch.randn(total); g0 = torch.randn(total) * 1e-3
def flat(fused=None):
    p = torch.nn.Parameter(master0.clone()); p.grad = g0.clone()
    return torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, fused=fused), None
def sharded(groups=1, interleave=False, use_swap=True, cap=1 << 62, fused=None, foreach=None):
    m = master0.clone(); g = g0.clone(); ps = []; slots = {}
    for o, s in zip(offs, sizes):
        p = torch.nn.Parameter(ShardedTensor(m[o:o+s], ShardSpec((s,), 0, s)))
        p.grad = ShardedTensor(g[o:o+s], p._spec); ps.append(p); slots[id(p)] = swap.FlatSlot(m, o, s)
    if interleave: pg = [{"params": ps[i::groups], "lr": 1e-4 * (i+1)} for i in range(groups)]
    else:
        n = (len(ps) + groups - 1) // groups
        pg = [{"params": ps[i*n:(i+1)*n], "lr": 1e-4 * (i+1)} for i in range(groups)]
    sw = swap.StepSwap(slots, None, max_run_numel=cap) if use_swap else None
    return torch.optim.AdamW(pg, lr=1e-4, weight_decay=0.1, fused=fused, foreach=foreach), sw
cfgs = {
  "flat 1 tensor (today)": lambda: flat(),
  "per-param ShardedTensor, no swap": lambda: sharded(use_swap=False),
  "swap, 1 group, runs uncapped": lambda: sharded(1),
  "swap, 1 group, runs <= 1M": lambda: sharded(1, cap=1 << 20),
  "swap, 1 group, runs <= 1 param": lambda: sharded(1, cap=0),
  "swap, 10 contiguous groups, runs <= 1M": lambda: sharded(10, cap=1 << 20),
  "swap, 10 interleaved groups, runs <= 1M": lambda: sharded(10, True, cap=1 << 20),
  "flat 1 tensor, fused": lambda: flat(True),
  "swap, 10 interleaved groups, fused": lambda: sharded(10, True, fused=True),
}
only = sys.argv[4].split(",") if len(sys.argv) > 4 else None
res = {k: [] for k in cfgs}
for r in range(ROUNDS):
    for k, f in cfgs.items():
        if only and not any(o in k for o in only): continue
        o, sw = f(); o.step()
        ts = []
        for _ in range(STEPS):
            t = time.perf_counter(); o.step(); ts.append(time.perf_counter() - t)
        res[k].append(statistics.median(ts))
        if sw: [h.remove() for h in sw._h]
        del o, sw
base = min(res["flat 1 tensor (today)"])
print(f"N={total/1e6:.1f}M K={K} 1 thread; min over {ROUNDS} rounds of median of {STEPS} steps")
for k, v in res.items():
    if v: print(f"  {k:42s} {min(v)*1e3:8.2f} ms  {min(v)/base:5.2f}x   rounds: {[round(x*1e3,1) for x in v]}")
