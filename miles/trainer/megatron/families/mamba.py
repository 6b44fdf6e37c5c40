"""Mamba-2 in torch for the hybrid families (``nemotron_h.py``): the chunked SSD scan and a mixer module with
megatron-core's ``MambaMixer`` parameters, for where megatron-core's mixer cannot be built.

    y, last = ssd_scan(x, dt, A, B, C, chunk_size=128, D=D)     # [b, l, h, p]; last state [b, h, p, n]
    mixer = TorchMambaMixer(config, submodules, d_model=h, ...)  # a MambaLayer's mixer (the local spec's)

megatron-core 0.16's ``MambaMixer`` raises ImportError without ``mamba_ssm`` (its Triton kernels) and allocates
its parameters on ``torch.cuda.current_device()``; ``mamba_ssm`` and ``causal_conv1d`` are CUDA-only. So the
local spec's Mamba layer holds ``TorchMambaMixer``: megatron-core's ``ColumnParallelLinear`` ``in_proj`` and
``RowParallelLinear`` ``out_proj``, and the same parameters as ``MambaMixer`` under the same names and per-rank
layouts (``in_proj`` rows ``[z_r; x_r; B_r; C_r; dt_r]``, ``conv1d`` ``[x_r; B_r; C_r]``, ``dt_bias`` / ``A_log`` /
``D`` per head, the gated norm's ``norm.weight``), so a megatron checkpoint of either reads into the other. Its
scan is ``ssd_scan`` (below) on CPU, and ``mamba_ssm``'s ``mamba_chunk_scan_combined`` where that imports on a
GPU (``tests/gpu/test_mamba_scan_gpu.py`` checks the two agree).

The scan, per head (state S [p, n], a_t = dt_t A <= 0):
    S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T,        y_t = S_t C_t + D x_t
computed by chunks of ``chunk_size`` tokens (SSD, Dao & Gu 2024): inside a chunk as a masked "attention"
(C_i . B_j) exp(sum_{j<m<=i} a_m) dt_j x_j; each chunk's end state from its own tokens; the states entering the
chunks from one [chunks+1, chunks+1] matrix of decays between chunk ends (no Python loop over tokens or chunks);
then each token reads its chunk's entering state. fp32 throughout, the output cast back to ``x``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
             chunk_size: int, D: torch.Tensor | None = None, initial_state: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's selective scan by chunks. x [b, l, h, p]; dt [b, l, h] (already softplus'ed and clamped);
    A [h] (negative); B, C [b, l, g, n] (h a multiple of g: heads h*g//h.. share group h // (h/g)); D [h];
    initial_state [b, h, p, n]. Returns (y [b, l, h, p] in x's dtype, the final state [b, h, p, n] in fp32)."""
    b, length, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if h % g:
        raise ValueError(f"ssd_scan: {h} heads are not a multiple of {g} groups")
    q = int(chunk_size)
    pad = (-length) % q
    xf, dtf = x.float(), dt.float()
    Bf = B.float().repeat_interleave(h // g, dim=2)                          # [b, l, h, n]
    Cf = C.float().repeat_interleave(h // g, dim=2)
    if pad:     # zero dt at the end: no decay, no input, so the final state is the last real token's
        xf, Bf, Cf = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xf, Bf, Cf))
        dtf = F.pad(dtf, (0, 0, 0, pad))
    c = (length + pad) // q
    xs = (xf * dtf[..., None]).view(b, c, q, h, p)                          # dt_j x_j
    Bc, Cc = Bf.view(b, c, q, h, n), Cf.view(b, c, q, h, n)
    acs = (dtf * A.float()).view(b, c, q, h).permute(0, 3, 1, 2).cumsum(-1)    # [b, h, c, q]: sum_{m<=i} a_m
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp((acs[..., :, None] - acs[..., None, :]).masked_fill(~causal, float("-inf")))  # [b,h,c,i,j]
    scores = torch.einsum("bcihn,bcjhn->bhcij", Cc, Bc) * decay
    y = torch.einsum("bhcij,bcjhp->bcihp", scores, xs)                      # inside each chunk
    to_end = torch.exp(acs[..., -1:] - acs)                                 # [b, h, c, q]
    states = torch.einsum("bcjhn,bhcj,bcjhp->bchpn", Bc, to_end, xs)        # each chunk's own end state
    first = initial_state.float()[:, None] if initial_state is not None else states.new_zeros(b, 1, h, p, n)
    states = torch.cat([first, states], dim=1)                              # [b, c+1, h, p, n]: ends at t = 0..c
    ends = F.pad(acs[..., -1], (1, 0)).cumsum(-1)                           # [b, h, c+1]: decay up to each end
    between = torch.ones(c + 1, c + 1, dtype=torch.bool, device=x.device).tril()
    carry = torch.exp((ends[..., :, None] - ends[..., None, :]).masked_fill(~between, float("-inf")))
    entering = torch.einsum("bhts,bshpn->bthpn", carry, states)              # state after chunk t-1 (t = 0..c)
    y = y + torch.einsum("bcihn,bchpn,bhci->bcihp", Cc, entering[:, :c], torch.exp(acs))
    y = y.reshape(b, c * q, h, p)[:, :length]
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return y.to(x.dtype), entering[:, c]


def ssd_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
                  D: torch.Tensor | None = None, initial_state: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (tests only: the definition ``ssd_scan`` is checked against)."""
    b, length, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    Bf = B.double().repeat_interleave(h // g, dim=2)
    Cf = C.double().repeat_interleave(h // g, dim=2)
    state = initial_state.double() if initial_state is not None else x.new_zeros(b, h, p, n, dtype=torch.float64)
    ys = []
    for t in range(length):
        da = torch.exp(dt[:, t].double() * A.double())                       # [b, h]
        state = state * da[..., None, None] + (dt[:, t].double()[..., None] * x[:, t].double())[..., None] * \
            Bf[:, t][:, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", state, Cf[:, t])
        if D is not None:
            y = y + D.double()[:, None] * x[:, t].double()
        ys.append(y)
    return torch.stack(ys, dim=1), state


def gpu_chunk_scan():
    """``mamba_ssm``'s ``mamba_chunk_scan_combined`` when it imports, else None."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError:
        return None
    return mamba_chunk_scan_combined


class GatedRMSNorm(torch.nn.Module):
    """Mamba-2's norm after the scan (``norm_before_gate`` false): RMS over groups of ``group_size`` channels of
    ``y * silu(z)``, times ``weight``; in fp32, cast back. megatron-core's ``ExtendedRMSNorm`` (mamba_ssm's) and
    transformers' ``NemotronHRMSNormGated`` compute the same."""

    def __init__(self, size: int, group_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(z.float())
        grouped = h.view(*h.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * grouped.view_as(h)).to(y.dtype)


def _mixer_class():
    from megatron.core.transformer.module import MegatronModule

    class TorchMambaMixer(MegatronModule):
        """megatron-core's ``MambaMixer`` (training forward, no inference cache) in torch: same constructor
        arguments (from the ``MambaLayer``), parameters, per-rank layouts and (out, bias) return."""

        def __init__(self, config, submodules, d_model: int, variant=None, layer_number: int | None = None,
                     pg_collection=None, pp_layer_offset: int = 0, **_unused):
            super().__init__(config)
            from megatron.core.transformer.spec_utils import build_module

            v = variant          # the family's Mamba fields (nemotron_h.NemotronHShape)
            tp = pg_collection.tp.size()
            self.heads, self.headdim, self.ngroups, self.d_state = v.num_heads, v.head_dim, v.n_groups, v.state_size
            if self.heads % tp or self.ngroups % tp:
                raise ValueError(f"Mamba: {self.heads} heads and {self.ngroups} groups must both divide by TP {tp}")
            self.h_local, self.g_local = self.heads // tp, self.ngroups // tp
            self.d_inner = self.heads * self.headdim
            self.d_local = self.d_inner // tp
            self.chunk_size, self.dt_limit = v.chunk_size, (v.dt_min, v.dt_max)
            self.layer_number = layer_number
            dtype = config.params_dtype
            self.in_proj = build_module(submodules.in_proj, d_model, 2 * self.d_inner + 2 * self.ngroups * self.d_state
                                        + self.heads, config=config, init_method=config.init_method,
                                        gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
                                        tp_comm_buffer_name="fc1", tp_group=pg_collection.tp)
            conv_dim = self.d_local + 2 * self.g_local * self.d_state
            self.conv1d = torch.nn.Conv1d(conv_dim, conv_dim, kernel_size=v.conv_kernel, groups=conv_dim,
                                          padding=v.conv_kernel - 1, bias=v.conv_bias, dtype=dtype)
            self.dt_bias = torch.nn.Parameter(torch.zeros(self.h_local, dtype=dtype))
            self.A_log = torch.nn.Parameter(torch.zeros(self.h_local, dtype=torch.float32))
            self.D = torch.nn.Parameter(torch.ones(self.h_local, dtype=torch.float32))
            for prm in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D):
                if prm is not None:
                    prm.tensor_model_parallel, prm.partition_dim, prm.partition_stride = True, 0, 1
            self.norm = GatedRMSNorm(self.d_local, self.d_local // self.g_local, v.norm_eps, dtype)
            self.norm.weight.tensor_model_parallel = True
            self.out_proj = build_module(submodules.out_proj, self.d_inner, d_model, config=config,
                                         init_method=config.output_layer_init_method, bias=False,
                                         input_is_parallel=True, skip_bias_add=True, is_expert=False,
                                         tp_comm_buffer_name="fc2", tp_group=pg_collection.tp)

        def forward(self, hidden_states: torch.Tensor, inference_context=None, *, inference_params=None,
                    packed_seq_params=None):
            """hidden_states [l, b, d] (a sequence-parallel part under SP) -> (out [l, b, d], None)."""
            if inference_context is not None or inference_params is not None or packed_seq_params is not None:
                raise NotImplementedError("TorchMambaMixer runs whole training rows (no inference cache, no packing)")
            zxbcdt, _ = self.in_proj(hidden_states)                          # [l, b, local]
            zxbcdt = zxbcdt.transpose(0, 1)                                  # [b, l, local]
            gn = self.g_local * self.d_state
            z, xbc, dt = zxbcdt.split([self.d_local, self.d_local + 2 * gn, self.h_local], dim=-1)
            length = xbc.shape[1]
            xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :length].transpose(1, 2))
            x, B, C = xbc.split([self.d_local, gn, gn], dim=-1)
            b = x.shape[0]
            A = -torch.exp(self.A_log.float())
            x4 = x.reshape(b, length, self.h_local, self.headdim)
            B4 = B.reshape(b, length, self.g_local, self.d_state)
            C4 = C.reshape(b, length, self.g_local, self.d_state)
            kernel = gpu_chunk_scan() if x.is_cuda else None
            if kernel is not None:      # mamba_ssm's Triton scan: bias, softplus and clamp inside, as megatron-core calls it
                y = kernel(x4, dt, A, B4, C4, self.chunk_size, D=self.D, dt_bias=self.dt_bias.float(),
                           dt_softplus=True, dt_limit=self.dt_limit)
            else:
                dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
                y, _ = ssd_scan(x4, dt, A, B4, C4, chunk_size=self.chunk_size, D=self.D)
            y = self.norm(y.reshape(b, length, self.d_local), z)
            out, bias = self.out_proj(y.transpose(0, 1).contiguous())
            return out, bias

        def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: dict | None = None) -> dict:
            """megatron-core's ``MambaMixer`` checkpoint layout: per-head parameters, ``conv1d`` and the norm split
            over TP on dim 0, and ``in_proj`` / ``conv1d`` stored as their sections (``.z .x .B .C .dt``), each split
            over TP on its own, so a checkpoint reads back at another TP size."""
            from megatron.core import parallel_state
            from megatron.core.transformer.utils import (
                ensure_metadata_has_dp_cp_group,
                make_sharded_tensors_for_checkpoint,
                sharded_state_dict_default,
            )

            metadata = ensure_metadata_has_dp_cp_group(metadata)
            tp_group = parallel_state.get_tensor_model_parallel_group()
            own = {n: p for n, p in self.named_parameters(recurse=False)} | {
                f"conv1d.{n}": p for n, p in self.conv1d.named_parameters()} | {"norm.weight": self.norm.weight}
            out = make_sharded_tensors_for_checkpoint(own, prefix, {n: 0 for n in own}, sharded_offsets,
                                                      tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"])
            for name in ("in_proj", "out_proj"):
                out.update(sharded_state_dict_default(getattr(self, name), f"{prefix}{name}.", sharded_offsets,
                                                      metadata, tp_group=tp_group))
            gn = self.g_local * self.d_state
            out[f"{prefix}in_proj.weight"] = _split_factory(out[f"{prefix}in_proj.weight"], [
                self.d_local, self.d_local, gn, gn, self.h_local], ["z", "x", "B", "C", "dt"])
            for name in ("conv1d.weight", "conv1d.bias"):
                if f"{prefix}{name}" in out:
                    out[f"{prefix}{name}"] = _split_factory(out[f"{prefix}{name}"], [self.d_local, gn, gn],
                                                            ["x", "B", "C"])
            return out

    return TorchMambaMixer


def _split_factory(sharded, sections: list[int], names: list[str]):
    """A ``ShardedTensorFactory`` saving a TP-split tensor as its row sections, each its own sharded tensor
    (``<key>.<name>``), joined back on load (megatron-core's ``mamba_mixer._split_tensor_factory``, which cannot
    be imported without triton)."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    bare = sharded.without_data()

    @torch.no_grad()
    def build(key, t, replica_id, flattened_range):
        whole = replace(bare, key=key, data=t, dtype=t.dtype, replica_id=replica_id, flattened_range=flattened_range)
        parts, start = [], 0
        for size, name in zip(sections, names):
            for piece in whole.narrow(0, start, size):
                piece.key = f"{piece.key}.{name}"
                parts.append(piece)
            start += size
        return parts

    @torch.no_grad()
    def merge(parts):
        return torch.cat(parts)

    return ShardedTensorFactory(sharded.key, sharded.data, build, merge, sharded.replica_id)


_MIXER = None


def torch_mamba_mixer() -> type:
    """The ``TorchMambaMixer`` class (defined on first use: megatron-core is imported lazily)."""
    global _MIXER
    if _MIXER is None:
        _MIXER = _mixer_class()
    return _MIXER
