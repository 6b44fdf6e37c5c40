"""megatron-core on torch CPU + gloo: the few spots where megatron-core 0.16 hard-codes CUDA.

Applied only when the trainer runs on CPU (``apply_cpu_compat()``; a no-op once applied) and only
for the pinned release line (``SUPPORTED``): another megatron-core version raises, because these
spots move between releases. What is adapted, and why:

- ``torch.cuda.current_device()`` where megatron-core allocates at run time (rotary embeddings move
  ``inv_freq`` there on the first forward; the tensor-parallel all-gather/reduce-scatter buffers of
  ``tensor_parallel.mappings``/``layers``; attention buffers): those modules see a ``torch`` whose
  ``cuda.current_device()`` is ``"cpu"``; everything else is the real torch.
- ``transformer.utils.get_default_causal_mask`` builds its mask with ``device="cuda"``: replaced by
  the same upper-triangular mask on CPU (also where ``fused_softmax`` imported it by name).
- ``tensor_parallel.random.CudaRNGStatesTracker`` saves and restores CUDA generator states: replaced
  by a tracker with the same interface over CPU generator states (``add``, ``fork``, ``get_states``,
  ``set_states``), so tensor-parallel dropout and initialisation keep their per-rank streams.
- activation recompute (``tensor_parallel.checkpoint``) saves the CUDA generator state: on CPU there
  is none (``_get_cuda_rng_state``/``_set_cuda_rng_state`` do nothing; CPU and tracker states are kept).
- ``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings over pipeline stages) moves the
  last stage's copy of the embedding with ``Tensor.cuda()`` before summing it over the embedding group:
  on CPU that call is skipped (the tensor stays where it is; the sum runs over gloo).
- ``models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank`` (context parallelism: the rotary
  positions of this CP rank's chunks) builds its index with ``pin_memory`` and ``.cuda()``: replaced by the
  same selection on the embedding's device (also where ``rotary_pos_embedding`` imported it by name).
- mixture-of-experts (``moe.py``'s models; ``apply_moe_compat`` on CPU and GPU, ``apply_moe_cpu_compat`` on CPU):
  the router reads ``moe_utils.te_general_gemm`` (defined only with transformer-engine; None selects its torch
  matmul), moves its weight to ``torch.cuda.current_device()`` and the all-to-all dispatcher creates and
  synchronises a CUDA stream and converts its split sizes to numpy only from CUDA tensors.
- ``initialize_model_parallel`` sizes its groups by the default group; ``trainer_world(n)`` makes it
  see the first ``n`` ranks only (the trainer ranks; engines are the later ranks of the world).
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Iterator

import torch

SUPPORTED = "0.16."            # megatron-core release line these adaptations were written against
_RUNTIME_CUDA_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
)
_applied = False


def megatron_version() -> str:
    from megatron.core import package_info

    return str(package_info.__version__)


def check_version() -> None:
    v = megatron_version()
    if not v.startswith(SUPPORTED):
        raise RuntimeError(f"miles's CPU adaptation of megatron-core is written for {SUPPORTED}x, found {v}; "
                           "install megatron-core==0.16.1 (pip install 'miles[megatron]').")


class _CpuCuda(types.SimpleNamespace):
    """``torch.cuda`` as megatron-core's run-time allocations see it on CPU."""

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"


class _CpuTorch(types.ModuleType):
    """The real ``torch`` except ``torch.cuda.current_device()`` -> ``"cpu"``."""

    cuda = _CpuCuda()

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """[sq, sq] bool, True above the diagonal (masked), on CPU."""
    return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)


class CpuRNGStatesTracker:
    """megatron-core's RNG tracker interface over CPU generator states."""

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        g = torch.Generator()
        g.manual_seed(seed)
        self.states_[name] = g.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Chunks ``i`` and ``2 cp - 1 - i`` (of ``2 cp``) of the positions along ``seq_dim``, for CP rank ``i``."""
    cp, rank = cp_group.size(), cp_group.rank()
    shape = pos_emb.shape
    chunks = pos_emb.reshape(*shape[:seq_dim], 2 * cp, shape[seq_dim] // (2 * cp), *shape[seq_dim + 1:])
    mine = chunks.index_select(seq_dim, torch.tensor([rank, 2 * cp - 1 - rank], device=pos_emb.device))
    return mine.reshape(*shape[:seq_dim], -1, *shape[seq_dim + 1:])


def _no_cuda_rng_state(*args, **kwargs) -> None:
    return None


def _set_no_cuda_rng_state(*args, **kwargs) -> None:
    return None


def apply_cpu_compat() -> None:
    """Adapt megatron-core for torch CPU (see module docstring); idempotent."""
    global _applied
    if _applied:
        return
    check_version()
    from miles.trainer.megatron import lean_import

    lean_import.run_fused_eagerly()
    cpu_torch = _CpuTorch("torch")
    for name in _RUNTIME_CUDA_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(mod, "torch", None) is torch:
            mod.torch = cpu_torch
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as tutils

    tutils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)
    # activation recompute (tensor_parallel.checkpoint) saves and restores the CPU, CUDA and tracker RNG
    # states; on CPU there is no CUDA state (the CPU one and the tracker's are still restored)
    mrandom._get_cuda_rng_state = _no_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_no_cuda_rng_state
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _cpu_setup_embeddings(
        LanguageModule.setup_embeddings_and_output_layer)
    # context parallelism: the rotary positions of this CP rank's chunks (megatron-core pins an index tensor
    # and moves it to CUDA)
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    rope_utils.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank
    _applied = True


def _cpu_setup_embeddings(setup):
    """``setup_embeddings_and_output_layer`` with ``Tensor.cuda()`` the identity while it runs (CPU only)."""

    def run(self) -> None:
        real = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *args, **kwargs: t
        try:
            setup(self)
        finally:
            torch.Tensor.cuda = real

    return run


@contextlib.contextmanager
def trainer_world(num_ranks: int) -> Iterator[None]:
    """Inside: ``torch.distributed.get_world_size()`` is ``num_ranks`` (megatron-core's group layout
    then covers global ranks 0..num_ranks-1, the trainer ranks). Every trainer rank must enter it
    and create the same groups in the same order; ranks outside never create groups after that."""
    import torch.distributed as dist

    real = dist.get_world_size

    def world_size(group=None) -> int:
        return num_ranks if group is None else real(group)

    dist.get_world_size = world_size
    try:
        yield
    finally:
        dist.get_world_size = real


# ------------------------------------------------------------------------------------------- MoE (moe.py's models)
class _CpuStream:
    """A CUDA stream as megatron-core's MoE code uses one, on CPU (work is synchronous there)."""

    def wait_stream(self, other) -> None:
        return None

    def record_event(self):
        return self

    def synchronize(self) -> None:
        return None


_CPU_STREAM = _CpuStream()
_MOE_CPU_MODULES = ("megatron.core.transformer.moe.router", "megatron.core.transformer.moe.experts",
                    "megatron.core.transformer.moe.token_dispatcher", "megatron.core.transformer.moe.moe_utils",
                    "megatron.core.transformer.moe.shared_experts")
_moe_cpu_applied = False


def apply_moe_compat() -> None:
    """megatron-core 0.16's router reads ``moe_utils.te_general_gemm``, which is only defined when
    transformer-engine imports (a NameError otherwise, on CPU and GPU alike): None there selects its
    torch matmul path. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply_moe_cpu_compat() -> None:
    """megatron-core 0.16's MoE modules on torch CPU (after ``apply_cpu_compat``): the router moves its
    weight to ``torch.cuda.current_device()`` on each forward and the all-to-all dispatcher creates and
    synchronises a CUDA stream; in those modules ``torch.cuda.current_device()`` is ``"cpu"`` and the stream
    calls are no-ops. Idempotent."""
    global _moe_cpu_applied
    if _moe_cpu_applied:
        return
    check_version()
    apply_moe_compat()

    class _MoeCpuCuda(_CpuCuda):
        @staticmethod
        def Stream(*args, **kwargs):  # noqa: N802 (torch.cuda's name)
            return _CPU_STREAM

        @staticmethod
        def current_stream(*args, **kwargs):
            return _CPU_STREAM

        @staticmethod
        def stream(s):
            return contextlib.nullcontext()

    class _MoeCpuTorch(_CpuTorch):
        cuda = _MoeCpuCuda()

    cpu_torch = _MoeCpuTorch("torch")
    for name in _MOE_CPU_MODULES:
        mod = importlib.import_module(name)
        if isinstance(getattr(mod, "torch", None), type(torch)):
            mod.torch = cpu_torch
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _cpu_splits
    _moe_cpu_applied = True


def _cpu_splits(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` on CPU: the all-to-all split sizes become numpy arrays there
    (megatron-core converts only CUDA tensors, and gloo's ``all_to_all_single`` wants int sequences)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor
