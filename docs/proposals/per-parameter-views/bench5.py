import sys, time, statistics, torch
sys.path.insert(0, "/tmp/p11")
from sp import ShardedTensor, ShardSpec
import swap
exec(open("bench3.py").read().split("cfgs = {")[0].split("torch.set_num_threads(1)")[1].replace("N = int(float(sys.argv[1])); K = int(sys.argv[2]); ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 3; STEPS = 4", "N=int(float(sys.argv[1])); K=int(sys.argv[2])"))
torch.set_num_threads(1)
from sp import ShardedTensor, ShardSpec
import swap
for groups, inter in [(1, False), (10, True)]:
    o, sw = sharded(groups, inter, foreach=False)
    o.step(); o.step()
    ts = []
    for _ in range(50):
        t = time.perf_counter(); sw._swap_in(o); t1 = time.perf_counter()
        # restore without stepping
        sw._post(o, (), {}); ts.append((t1 - t, time.perf_counter() - t1))
    print(f"K={K} groups={groups} interleaved={inter}: swap-in {statistics.median([a for a,_ in ts])*1e3:.2f} ms, swap-out {statistics.median([b for _,b in ts])*1e3:.2f} ms (uncached Python prototype)")
    [h.remove() for h in sw._h]
