"""``--optimizer-cpu-offload`` (Megatron's meaning): the AdamW state and update of a fraction of the parameters on
CPU, the results copied back to the device parameters.

    opt = CpuOffloadAdamW(param_groups, fraction=1.0, lr=1e-6, betas=(0.9, 0.98), eps=1e-8, device=dev)
    opt.step()        # grads D2H (fp32), torch AdamW on the CPU masters, parameters H2D; the rest on the device

The first ``fraction`` of the parameters (``--optimizer-offload-fraction``, default 1.0; counted in elements, in
parameter order, as Megatron-LM's hybrid optimizer splits them) get an fp32 CPU master copy, and torch's AdamW
(foreach) steps those on CPU; the others keep a device AdamW. ``param_groups`` hold the device parameters (the LR
schedule writes their ``lr``; it is copied to both optimizers each step) and ``state`` maps each device parameter to
its AdamW state (CPU tensors for the offloaded ones), so checkpoints save and load it as for a plain AdamW. On a
CPU device the update is the plain AdamW's, bit for bit. ``--overlap-cpu-optimizer-d2h-h2d`` is accepted as a hint:
the copies are issued non-blocking from pinned buffers on CUDA and are not overlapped with the CPU update. The
parameters are copied to their CPU masters each step (a checkpoint load or a weight change is seen). Offload and
onload (colocated runs) move only the device part of the state. ``load_state_dict`` takes ``state_dict``'s
output (a LoRA checkpoint's optimizer: ``miles.trainer.lora.save_files``).
"""

from __future__ import annotations

import torch


class CpuOffloadAdamW(torch.optim.Optimizer):
    def __init__(self, param_groups: list[dict], *, fraction: float, lr: float, betas: tuple[float, float],
                 eps: float, device: torch.device):
        super().__init__(param_groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        params = [p for g in self.param_groups for p in g["params"]]
        budget = fraction * sum(p.numel() for p in params)
        pin = device.type == "cuda"
        self._cpu: dict[int, torch.Tensor] = {}
        seen = 0
        for p in params:
            if seen + p.numel() > budget + 0.5 and p.numel() > 0:
                break
            seen += p.numel()
            self._cpu[id(p)] = torch.empty(p.shape, dtype=torch.float32, pin_memory=pin)
        kw = {"fused": True} if device.type == "cuda" else {"foreach": True}
        cpu_groups = self._groups(True)
        self._on_cpu = torch.optim.AdamW(cpu_groups, lr=lr, betas=betas, eps=eps, foreach=True) if cpu_groups else None
        dev_groups = self._groups(False)
        self._on_dev = torch.optim.AdamW(dev_groups, lr=lr, betas=betas, eps=eps, **kw) if dev_groups else None
        self._non_blocking = pin

    @property
    def offloaded(self) -> int:
        """Parameters whose AdamW state and update are on CPU."""
        return len(self._cpu)

    def _groups(self, cpu: bool) -> list[dict]:
        out = []
        for g in self.param_groups:
            ps = [self._cpu[id(p)] if cpu else p for p in g["params"] if (id(p) in self._cpu) == cpu]
            if ps:
                out.append({**{k: v for k, v in g.items() if k != "params"}, "params": ps, "_src": g})
        return out

    @property
    def state(self):  # noqa: D102  (torch's attribute; a view keyed by the device parameters)
        view = {}
        for g in self.param_groups:
            for p in g["params"]:
                inner = (self._on_cpu if id(p) in self._cpu else self._on_dev).state
                key = self._cpu.get(id(p), p)
                if key in inner:
                    view[p] = inner[key]
        return view

    def device_part(self):
        """An object whose ``state`` is the device AdamW's (what offload/onload moves); the CPU state stays."""
        from types import SimpleNamespace

        return SimpleNamespace(state=self._on_dev.state if self._on_dev is not None else {})

    @state.setter
    def state(self, value) -> None:         # torch.optim.Optimizer.__init__ assigns it
        self.__dict__["_unused_state"] = value

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``Optimizer.state_dict()`` layout (parameters by index in group order, as ``state_dict`` gives it
        from the ``state`` view): each parameter's AdamW state into the CPU or device optimizer that steps it (its
        tensors on that one's side), the groups' hyper-parameters into ``param_groups``. (torch's own
        ``load_state_dict`` would replace ``param_groups`` by new dicts, which the inner optimizers do not follow.)"""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(len(g["params"]) != len(s["params"])
                                                        for g, s in zip(self.param_groups, groups)):
            raise ValueError("the optimizer state was saved for other parameter groups than this optimizer's")
        saved = state_dict["state"]
        for g, sg in zip(self.param_groups, groups):
            g.update({k: v for k, v in sg.items() if k != "params"})
            for p, index in zip(g["params"], sg["params"]):
                st = saved.get(index)
                if st is None:
                    continue
                on_cpu = id(p) in self._cpu
                key = self._cpu[id(p)] if on_cpu else p
                inner = (self._on_cpu if on_cpu else self._on_dev).state
                inner[key] = {k: (v.detach().to(key.device).clone() if isinstance(v, torch.Tensor) and k != "step"
                                  else (v.detach().clone() if isinstance(v, torch.Tensor) else v))
                              for k, v in st.items()}

    @torch.no_grad()
    def step(self, closure=None):
        for opt in (self._on_cpu, self._on_dev):
            for g in opt.param_groups if opt is not None else ():
                g.update({k: v for k, v in g["_src"].items() if k != "params"})
        pairs = [(p, self._cpu[id(p)]) for g in self.param_groups for p in g["params"] if id(p) in self._cpu]
        for p, master in pairs:                   # D2H: the parameters (a checkpoint load may have changed them)
            master.copy_(p.detach(), non_blocking=self._non_blocking)       # and their fp32 gradients
            master.grad = None if p.grad is None else p.grad.detach().to("cpu", torch.float32,
                                                                           non_blocking=self._non_blocking)
        if self._non_blocking:
            torch.cuda.current_stream().synchronize()
        if self._on_cpu is not None:
            self._on_cpu.step()
        if self._on_dev is not None:
            self._on_dev.step()
        for p, master in pairs:                   # H2D: the updated parameters
            if master.grad is not None:
                p.copy_(master, non_blocking=self._non_blocking)
            master.grad = None
        return None


def build_offloaded_adamw(module: torch.nn.Module, *, fraction: float, lr: float, weight_decay: float,
                          betas: tuple[float, float], eps: float, device: torch.device) -> CpuOffloadAdamW:
    """``optim.build_adamw``'s parameter groups (decay on matrices), offloaded (``--optimizer-cpu-offload``)."""
    decay = [p for p in module.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.requires_grad and p.ndim < 2]
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
              if g["params"]]
    return CpuOffloadAdamW(groups, fraction=fraction, lr=lr, betas=betas, eps=eps, device=device)
