import sys, time, statistics, torch
torch.set_num_threads(1)
N = int(float(sys.argv[1])); K = int(sys.argv[2]); ROUNDS = 3; STEPS = 4
torch.manual_seed(0)
sizes = torch.randint(1, 100, (K,)).double(); sizes = (sizes / sizes.sum() * N).long().clamp(min=1).tolist()
offs = []; c = 0
for s in sizes:
    c = (c + 15) // 16 * 16; offs.append(c); c += s
total = c
master0 = torch.randn(total); g0 = torch.randn(total) * 1e-3
def runs_capped(cap):
    out = []
    for o, s in zip(offs, sizes):
        if out and o - out[-1][1] < 16 and (o + s - out[-1][0]) <= cap: out[-1][1] = o + s
        else: out.append([o, o + s])
    return out
def make(spans, fused=None, foreach=False):
    m = master0.clone(); g = g0.clone(); ps = []
    for a, b in spans:
        p = torch.nn.Parameter(m[a:b]); p.grad = g[a:b]; ps.append(p)
    o = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=foreach, fused=fused)
    return o
cfgs = {
  "flat (today)": lambda: make([[0, total]]),
  "per-param plain views (K)": lambda: make([[o, o+s] for o, s in zip(offs, sizes)]),
  "runs capped 1M": lambda: make(runs_capped(1 << 20)),
  "runs capped 4M": lambda: make(runs_capped(1 << 22)),
  "flat (today), fused": lambda: make([[0, total]], fused=True),
  "per-param plain views, fused": lambda: make([[o, o+s] for o, s in zip(offs, sizes)], fused=True),
}
res = {k: [] for k in cfgs}
for r in range(ROUNDS):
    for k, f in cfgs.items():
        o = f(); o.step()
        ts = []
        for _ in range(STEPS):
            t = time.perf_counter(); o.step(); ts.append(time.perf_counter() - t)
        res[k].append(statistics.median(ts)); del o
base = min(res["flat (today)"])
print(f"N={total/1e6:.1f}M K={K} 1 thread; min over {ROUNDS} rounds of median of {STEPS} steps")
for k, v in res.items(): print(f"  {k:32s} {min(v)*1e3:7.1f} ms  {min(v)/base:5.2f}x   rounds: {[round(x*1e3) for x in v]}")
