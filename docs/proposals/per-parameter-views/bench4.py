import sys, time, statistics, torch
sys.path.insert(0, "/tmp/p11")
exec(open("bench3.py").read().split("cfgs = {")[0].split("torch.set_num_threads(1)")[1].replace("N = int(float(sys.argv[1])); K = int(sys.argv[2]); ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 3; STEPS = 4", "N=int(float(sys.argv[1])); K=int(sys.argv[2]); ROUNDS=3; STEPS=20"))
import swap
from sp import ShardedTensor, ShardSpec
torch.set_num_threads(1)
def plain(foreach):
    m = master0.clone(); g = g0.clone(); ps=[]
    for o, s in zip(offs, sizes):
        p = torch.nn.Parameter(m[o:o+s]); p.grad = g[o:o+s]; ps.append(p)
    return torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=foreach), None
cfgs = {
 "flat 1 tensor, single": lambda: flat(),
 "K plain, single-tensor": lambda: plain(False),
 "K plain, foreach": lambda: plain(True),
 "K ShardedTensor no swap, single-tensor": lambda: sharded(use_swap=False, foreach=False),
 "K ShardedTensor no swap, foreach": lambda: sharded(use_swap=False, foreach=True),
 "swap, runs<=1 param, single-tensor": lambda: sharded(1, cap=0, foreach=False),
 "swap, runs<=1 param, foreach": lambda: sharded(1, cap=0, foreach=True),
 "swap, uncapped (1 run), single-tensor": lambda: sharded(1, foreach=False),
 "swap, 10 interleaved groups, foreach": lambda: sharded(10, True, foreach=True),
}
res = {k: [] for k in cfgs}
for r in range(ROUNDS):
    for k, f in cfgs.items():
        o, sw = f(); o.step()
        ts=[]
        for _ in range(STEPS):
            t=time.perf_counter(); o.step(); ts.append(time.perf_counter()-t)
        res[k].append(statistics.median(ts))
        if sw: [h.remove() for h in sw._h]
print(f"overhead: N={total} elements K={K}")
for k, v in res.items(): print(f"  {k:42s} {min(v)*1e3:7.2f} ms")
