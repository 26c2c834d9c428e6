import sys, copy, torch, io
sys.path.insert(0, "/tmp/p11")
from sp import ShardedTensor, ShardSpec
from torch import nn
torch.manual_seed(0)
lin = nn.Linear(4, 3)
full_w, full_b = lin.weight.detach().clone(), lin.bias.detach().clone()
master = torch.cat([full_w.reshape(-1)[:6], full_b[:2]])   # "rank 0" owns w[0:6], b[0:2]
sw = nn.Parameter(ShardedTensor(master[0:6], ShardSpec((3, 4), 0, 6)))
sb = nn.Parameter(ShardedTensor(master[6:8], ShardSpec((3,), 0, 2)))
del lin._parameters["weight"], lin._parameters["bias"]
lin._parameters["weight"] = sw; lin._parameters["bias"] = sb
print("outside forward: named_parameters", [(n, type(p).__name__, tuple(p.shape)) for n, p in lin.named_parameters()],
      "lin.weight is sharded:", lin.weight is sw, "dtype", lin.weight.dtype, "dim>=2:", lin.weight.dim() >= 2)
try: lin(torch.randn(2, 4))
except NotImplementedError as e: print("forward outside a unit -> NotImplementedError:", str(e)[:90])
# forward: shadow with full views in __dict__
lin.__dict__["weight"] = full_w.requires_grad_(); lin.__dict__["bias"] = full_b
y = lin(torch.randn(2, 4)); print("forward with __dict__ shadow OK", tuple(y.shape),
      "| named_parameters during forward still sharded:", all(isinstance(p, ShardedTensor) for p in lin.parameters()),
      "| state_dict during forward sharded:", type(lin.state_dict()["weight"]).__name__)
del lin.__dict__["weight"], lin.__dict__["bias"]
print("after forward lin.weight is sharded again:", lin.weight is sw)
# nn.Module.__setattr__ of a non-parameter on a registered name is refused by torch
try: lin.weight = torch.zeros(3, 4)
except TypeError as e: print("setattr plain tensor refused:", str(e)[:70])
# deepcopy -> shard-sized copies; AveragedModel EMA
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, get_ema_avg_fn
m = nn.Sequential(lin)
for kw in [dict(multi_avg_fn=get_ema_multi_avg_fn(0.9)), dict(avg_fn=get_ema_avg_fn(0.9))]:
    avg = AveragedModel(m, use_buffers=True, **kw)
    print("AveragedModel copy:", type(avg.module[0].weight).__name__, avg.module[0].weight._local.data_ptr() != sw._local.data_ptr())
    avg.update_parameters(m)
    with torch.no_grad(): master.add_(1.0)
    avg.update_parameters(m)
    exp = (master[0:6] - 1.0) * 0.9 + master[0:6] * 0.1
    print("  EMA update exact:", torch.allclose(avg.module[0].weight._local, exp), list(kw))
    # Lightning's _swap_models / _copy_average_to_current
    for a, c in zip(avg.module.parameters(), m.parameters()):
        tmp = a.data.clone(); a.data.copy_(c.data); c.data.copy_(tmp)
    print("  swap through .data ok; master version", master._version)
buf = io.BytesIO(); torch.save(avg.state_dict(), buf); print("AveragedModel state_dict keys", list(avg.state_dict()), "saved bytes", buf.tell())
