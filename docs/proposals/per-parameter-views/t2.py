import sys, torch, copy
sys.path.insert(0, "/tmp/p11")
from sp import ShardedTensor, ShardSpec
import swap
torch.manual_seed(0)
K = 12
INTER = len(sys.argv) < 2
sizes = torch.randint(5, 40, (K,)).tolist()
offs=[]; c=0
for s_ in sizes: c=(c+15)//16*16; offs.append(c); c+=s_
total=(c+15)//16*16
def build(with_swap):
    master = torch.randn(total, generator=torch.Generator().manual_seed(1))
    gflat = torch.zeros(total)
    ps=[]; slots={}
    for o,s_ in zip(offs,sizes):
        p=torch.nn.Parameter(ShardedTensor(master[o:o+s_], ShardSpec((s_,),0,s_))); ps.append(p)
        slots[id(p)] = swap.FlatSlot(master, o, s_)
    sw = swap.StepSwap(slots, None) if with_swap else None
    return master, gflat, ps, sw
def run(with_swap, foreach, use_closure, opt_name="AdamW"):
    master, gflat, ps, sw = build(with_swap)
    groups=[{"params": ps[0::2] if INTER else ps[:6], "lr": 0.01, "weight_decay": 0.1}, {"params": ps[1::2] if INTER else ps[6:], "lr": 0.02, "weight_decay": 0.0}]
    cls = getattr(torch.optim, opt_name)
    kw = dict(foreach=foreach) 
    if opt_name == "SGD": kw["momentum"]=0.9
    opt = cls(groups, **kw)
    gen = torch.Generator().manual_seed(2)
    for step in range(6):
        def closure():
            opt.zero_grad(set_to_none=True)
            gflat.copy_(torch.randn(total, generator=gen))
            for i,(p,o,s_) in enumerate(zip(ps,offs,sizes)):
                if (i + step) % 4 == 0: continue   # LayerDrop: no grad this step
                p.grad = ShardedTensor(gflat[o:o+s_], p._spec)
            return torch.tensor(0.)
        if use_closure: opt.step(closure)
        else: closure(); opt.step()
    if sw: [h.remove() for h in sw._h]
    return master, opt, ps
for opt_name in ["AdamW", "SGD", "Adam"]:
  for foreach in [False, True]:
    for closure in [False, True]:
        ref, ropt, rps = run(False, foreach, closure, opt_name)
        got, gopt, gps = run(True, foreach, closure, opt_name)
        steps_ok = all(float(ropt.state[a].get("step", 0)) == float(gopt.state[b].get("step", 0)) for a,b in zip(rps,gps))
        print(opt_name, "foreach", foreach, "closure", closure, "max|diff|", max(float((ref[o:o+s_]-got[o:o+s_]).abs().max()) for o,s_ in zip(offs,sizes)), "steps equal", steps_ok,
              "state types", {k: type(v).__name__ for k,v in gopt.state[gps[0]].items()}, "leftover run keys", len(gopt.state) - sum(1 for p in gps if p in gopt.state))
sd = gopt.state_dict(); print("state_dict ok", len(sd["state"]), [len(g["params"]) for g in sd["param_groups"]])
