"""Prototype of the step-time swap: torch optimizers step plain views, never ShardedTensors."""
import torch, weakref
from torch.optim.optimizer import register_optimizer_step_pre_hook, register_optimizer_step_post_hook
from sp import ShardedTensor

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad)
ALIGN = 16

class FlatSlot:
    """Where a sharded param lives: its master flat tensor, its grad flat, offset, numel."""
    def __init__(self, master, offset, numel):
        self.master, self.offset, self.numel = master, offset, numel

class StepSwap:
    def __init__(self, slot_of, grad_flat_of, max_run_numel=1 << 62):
        self.max_run_numel = max_run_numel
        self.slot_of = slot_of            # id(param) -> FlatSlot
        self.grad_flat_of = grad_flat_of  # id(master) -> callable returning the current grad flat
        self.arenas = {}                  # (id(master), key) -> flat state tensor
        self.active = {}
        self.owners = {}                  # id(optimizer) -> saved params lists and run tensors
        self._h = (register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post))

    def _pre(self, opt, args, kwargs):
        if not isinstance(opt, ELEMENTWISE) or id(opt) in self.active:
            return None
        if not any(id(p) in self.slot_of for g in opt.param_groups for p in g["params"]):
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
        if closure is None:
            self._swap_in(opt)
            return None
        def closure_then_swap():
            loss = closure()
            self._swap_in(opt)
            return loss
        return (args[0],), {**{k: v for k, v in kwargs.items() if k != "closure"}, "closure": closure_then_swap}

    def _sig(self, state, p):
        st = state.get(p)
        if not st:
            return "fresh"
        step = st.get("step")
        if isinstance(step, torch.Tensor):
            step = float(step) if step.device.type == "cpu" else id(step)
        return ("init", step)

    def _runs(self, params, state):
        """Params with a grad, in flat order, merged while adjacent (padding only between)
        and in the same optimizer state (both fresh, or the same step count)."""
        items = sorted(((self.slot_of[id(p)], p) for p in params if p.grad is not None),
                       key=lambda sp_: (id(sp_[0].master), sp_[0].offset))
        runs = []
        for slot, p in items:
            last = runs[-1] if runs else None
            if (last and last["master"] is slot.master and slot.offset - last["end"] < ALIGN
                    and slot.offset + slot.numel - last["start"] <= self.max_run_numel
                    and self._sig(state, p) == last["sig"]
                    and p.grad._local.data_ptr() == last["gbase"].data_ptr() + slot.offset * last["gbase"].element_size()):
                last["end"] = slot.offset + slot.numel; last["members"].append(p)
            else:
                runs.append({"master": slot.master, "start": slot.offset, "end": slot.offset + slot.numel,
                             "members": [p], "sig": self._sig(state, p), "gbase": p.grad._local._base if p.grad._local._base is not None else p.grad._local})
        return runs

    def _swap_in(self, opt):
        state = opt.state
        saved, made = [], []
        for g in opt.param_groups:
            plain = []
            for run in self._runs(g["params"], state):
                m, a, b = run["master"], run["start"], run["end"]
                t = m.detach()[a:b]
                gb = run["gbase"]
                t.grad = gb[a:b] if gb.numel() == m.numel() else run["members"][0].grad._local  # fallback
                first = state.get(run["members"][0])
                if first:   # state exists: hand the optimizer arena views + one step tensor
                    st = {}
                    for k, v in first.items():
                        if isinstance(v, ShardedTensor):
                            st[k] = self.arenas[(id(m), k)][a:b]
                        elif isinstance(v, torch.Tensor):
                            # scalar state (step) is incremented in place: share one object
                            # only if exactly the run's members hold it, else a clone
                            objs = {id(state[p][k]) for p in run["members"]}
                            if len(objs) == 1 and self.owners.get(id(v)) == len(run["members"]):
                                st[k] = v
                            else:
                                st[k] = v.clone()
                        else:
                            st[k] = v
                    state[t] = st
                plain.append(t); made.append((t, run))
            saved.append(g["params"]); g["params"] = plain
        self.active[id(opt)] = (saved, made)

    def _post(self, opt, args, kwargs):
        entry = self.active.pop(id(opt), None)
        if entry is None:
            return
        saved, made = entry
        for g, params in zip(opt.param_groups, saved):
            g["params"] = params
        state = opt.state
        for t, run in made:
            st = state.pop(t, None)
            if not st: continue
            m, a = run["master"], run["start"]
            for p in run["members"]:
                ps = state[p]
                slot = self.slot_of[id(p)]
                lo = slot.offset - a
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == t.numel():
                        arena = self.arenas.get((id(m), k))
                        if arena is None:
                            arena = self.arenas[(id(m), k)] = torch.zeros_like(m.detach())
                        if v.data_ptr() != arena[a:].data_ptr():   # first step: fresh tensor from the optimizer
                            arena[slot.offset:slot.offset + slot.numel].copy_(v[lo:lo + slot.numel])
                        if k not in ps or not isinstance(ps[k], ShardedTensor):
                            ps[k] = ShardedTensor(arena[slot.offset:slot.offset + slot.numel], p._spec)
                    else:
                        ps[k] = v   # step: the same tensor object for every member of the run
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() == 0:
                    self.owners[id(v)] = len(run["members"])
