import sys, copy, io, torch, time
sys.path.insert(0, "/tmp/p11")
from sp import ShardedTensor, ShardSpec
torch.manual_seed(0)
shapes = [(8, 6), (6,), (5, 8)]
full = [torch.randn(s) for s in shapes]
# world 2, rank 0 local pieces: take first half of each flattened param, laid out in a flat master
def pieces(rank, W=2):
    out=[]
    for f in full:
        n=f.numel(); a=rank*n//W; b=(rank+1)*n//W; out.append((a,b))
    return out
master = torch.zeros(sum(b-a for a,b in pieces(0)))
gflat = torch.zeros_like(master)
params=[]; off=0
for f,(a,b) in zip(full,pieces(0)):
    master[off:off+b-a] = f.reshape(-1)[a:b]
    p = torch.nn.Parameter(ShardedTensor(master[off:off+b-a], ShardSpec(f.shape,a,b)))
    params.append((p, off, b-a)); off+=b-a
ps=[p for p,_,_ in params]
print("shape/dim/numel/ndim", [ (tuple(p.shape), p.dim(), p.numel(), p.ndim) for p in ps], isinstance(ps[0], torch.nn.Parameter), type(ps[0]).__name__)
m = torch.nn.Module(); m.register_parameter("w", ps[0]); print("registered ok", [n for n,_ in m.named_parameters()])
# grads as views of the flat grad
for p,o,n in params:
    gflat[o:o+n] = torch.randn(n)
    p.grad = ShardedTensor(gflat[o:o+n], p._spec)
print("grad set ok", type(ps[0].grad).__name__, ps[0].grad.shape)
def ref_step(opt_cls, **kw):
    ref=[torch.nn.Parameter(p._local.detach().clone()) for p in ps]
    for r,p in zip(ref,ps): r.grad=p.grad._local.clone()
    o=opt_cls(ref, **kw); o.step(); o.step()
    return ref
for opt_cls, kw in [(torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1, foreach=False)),
                    (torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1, foreach=True)),
                    (torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1, fused=True)),
                    (torch.optim.Adam, dict(lr=0.1, foreach=True)),
                    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=False)),
                    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True)),
                    (torch.optim.AdamW, dict(lr=0.1)),]:
    before = master.clone()
    ref = ref_step(opt_cls, **kw)
    try:
        o = opt_cls(ps, **kw); o.step(); o.step()
        ok = all(torch.allclose(r, p._local) for r,p in zip(ref, ps))
        st = o.state[ps[0]]
        print(opt_cls.__name__, kw, "OK" if ok else "MISMATCH", "master changed in place:", not torch.equal(before, master),
              {k: type(v).__name__ for k,v in st.items()})
        sd = o.state_dict(); o2 = opt_cls(ps, **kw); o2.load_state_dict(copy.deepcopy(sd))
        print("   state_dict/load ok", {k: type(v).__name__ for k,v in o2.state[ps[0]].items()})
    except Exception as e:
        print(opt_cls.__name__, kw, "FAIL", type(e).__name__, str(e)[:200])
    master.copy_(before)
# zero_grad set_to_none
o = torch.optim.AdamW(ps, lr=0.1); o.zero_grad(); print("zero_grad none:", [p.grad is None for p in ps])
o.step(); print("step with None grads ok, master unchanged:", torch.equal(master, before))
# deepcopy / torch.save
c = copy.deepcopy(m); print("deepcopy:", type(c.w).__name__, isinstance(c.w, torch.nn.Parameter), c.w.shape, c.w._local.data_ptr()!=ps[0]._local.data_ptr())
buf = io.BytesIO(); torch.save(m.state_dict(), buf); print("torch.save bytes", buf.tell(), "(master bytes", master.numel()*4, ")")
buf.seek(0); l = torch.load(buf, weights_only=False); print("load:", type(l["w"]).__name__, l["w"].shape)
# clip_grad_norm_ and norms
for p,o_,n in params: p.grad = ShardedTensor(gflat[o_:o_+n], p._spec)
try:
    print("clip_grad_norm_", torch.nn.utils.clip_grad_norm_(ps, 1.0))
except Exception as e: print("clip_grad_norm_ FAIL", type(e).__name__, str(e)[:150])
try: print("norm", ps[0].grad.norm(2))
except Exception as e: print("p.grad.norm FAIL", type(e).__name__, str(e)[:150])
print(".data type", type(ps[0].data).__name__, "p.data.copy_ works:", ps[0].data.copy_(ps[0].data) is not None)
print("requires_grad", ps[0].requires_grad, "is_leaf", ps[0].is_leaf, "dtype", ps[0].dtype, ps[0].device)
