import sys, torch
sys.path.insert(0, "/tmp/p11")
from sp import ShardedTensor, ShardSpec
arena = torch.zeros(8); m = torch.randn(8)
p = torch.nn.Parameter(ShardedTensor(m[0:8], ShardSpec((2, 4), 0, 8)))
p.grad = ShardedTensor(torch.ones(8), p._spec)
o = torch.optim.AdamW([p]); o.step()
target = ShardedTensor(arena[0:8], p._spec)
sd = o.state_dict(); sd["state"][0]["exp_avg"] = target
o2 = torch.optim.AdamW([p]); o2.load_state_dict(sd)
print("load_state_dict keeps arena view (alias):", o2.state[p]["exp_avg"] is target or o2.state[p]["exp_avg"]._local.data_ptr() == arena.data_ptr())
o3 = torch.optim.AdamW([("layer.w", p)]); o3.step() if False else None
print("named params optimizer param_groups keys:", sorted(o3.param_groups[0]))
print("state_dict param_names:", o3.state_dict()["param_groups"][0].get("param_names"))
