"""Fused forwards for the hot elementwise modules of the FSDP backend's transformers models (on CUDA).

transformers' decoder layers run RMSNorm, the SwiGLU product and the q/k RoPE as several elementwise kernels each
(fp32 casts, a reduction, ``rotate_half``'s concatenation), where the Megatron backend runs fused ones. ``apply``
gives the model's verified modules a forward of the SAME expression, compiled (``torch.compile``, dynamic shapes,
inductor's ``emulate_precision_casts``: every bf16 rounding eager PyTorch makes between two ops is kept, so the
result is transformers' up to the order of a reduction):

- RMSNorm: a module whose class's ``forward`` is, statement for statement, transformers' Llama/Qwen form
  ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`` (``_VERIFIED["rms_norm"]``), or the
  GPT-OSS/OLMo-2 form that multiplies the weight before the cast back (``rms_norm_weight_first``). Each is a
  compiled function of ``(x [N, D], weight, eps)``, x flattened to rows (one graph for 3-D and 4-D inputs).
  Gemma's ``x * (1 + w)`` norms (another forward) are left alone.
- SwiGLU MLP: a class whose ``forward`` is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` and whose ``act_fn``
  is SiLU: ``down_proj(silu_mul(gate_proj(x), up_proj(x)))`` with ``silu_mul`` compiled (megatron-core's
  ``bias_activation_fusion``). The projections stay the module's own (a LoRA-wrapped projection too).
- RoPE: an attention class whose ``forward`` calls its modeling module's ``apply_rotary_pos_emb``, where that
  function and its ``rotate_half`` are transformers' standard ones: inside such a module's forward the
  module-level name runs the compiled function (``rope``). The name is replaced in the modeling module (the
  forward's globals) by a dispatcher that runs the original everywhere else (another model of the process, e.g. an embedded engine's,
  computes as before).

Which modules qualify is decided per class from its source (``ast`` of the method and of the module's functions,
compared with the forms in ``_VERIFIED``, transformers 5.24's text): a class whose code differs (another
transformers release, another family's math) keeps its forward. The module is swapped to a subclass of its own
class (same name) that overrides ``forward``; parameters, buffers and names are unchanged.

Where: ``modeling.load_hf_model`` applies it to every model the FSDP backend loads on a CUDA device (policy,
reference, teacher, critic); on CPU the models are left as transformers builds them (compiling there would
cost more than it saves). ``compiled=False`` runs the same functions eagerly (the tests compare the math on CPU).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from miles.utils.logging import get_logger

logger = get_logger(__name__)

# transformers 5.24's code (qwen3 / llama / gpt_oss modeling files): a class is patched only where its code has
# these statements (ast-compared: comments, annotations, docstrings and decorators aside)
_VERIFIED = {
    "rms_norm": '''
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
''',
    "rms_norm_weight_first": '''
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)
''',
    "mlp": '''
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
''',
    "rotate_half": '''
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
''',
    "apply_rotary_pos_emb": '''
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
''',
}


# ------------------------------------------------------------------ the fused math (the same expressions)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (``_VERIFIED["rms_norm"]``): the weight multiplies the normalised x in x's dtype."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def rms_norm_weight_first(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GPT-OSS/OLMo-2's RMSNorm (``_VERIFIED["rms_norm_weight_first"]``): the weight multiplies in fp32, then the cast."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return (weight * h).to(input_dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's product ``act_fn(gate) * up`` with transformers' SiLU activation."""
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (``_VERIFIED["apply_rotary_pos_emb"]``)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (_rotate_half(q) * sin)
    k_embed = (k * cos) + (_rotate_half(k) * sin)
    return q_embed, k_embed


_FUNCTIONS: dict[str, Callable] = {"rms_norm": rms_norm, "rms_norm_weight_first": rms_norm_weight_first,
                                   "silu_mul": silu_mul, "rope": rope}
_compiled: dict[str, Callable] = {}
_failed: set[str] = set()


def fused(name: str, compiled: bool) -> Callable:
    """The function ``name`` of ``_FUNCTIONS``, compiled (once per process) or eager. A compiled function whose
    compilation fails (dynamo or inductor raising, e.g. a Triton toolchain problem on the node) warns once and runs
    eagerly from then on in this process: the same math, only unfused."""
    fn = _FUNCTIONS[name]
    if not compiled or name in _failed:
        return fn
    if name not in _compiled:
        # dynamic shapes (the token count varies per micro-batch); eager's bf16 roundings between ops are kept
        _compiled[name] = _guarded(name, torch.compile(fn, dynamic=True, fullgraph=True,
                                                       options={"emulate_precision_casts": True}), fn)
    return _compiled[name]


def _guarded(name: str, compiled_fn: Callable, fn: Callable) -> Callable:
    from torch._dynamo.exc import TorchDynamoException

    def call(*args):
        if name in _failed:
            return fn(*args)
        try:
            return compiled_fn(*args)
        except TorchDynamoException as e:
            _failed.add(name)
            logger.warning("hf_fusions: compiling %s failed (%s); it runs unfused (eager, the same math) from now on",
                           name, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return fn(*args)
    return call


# ------------------------------------------------------------------ which code qualifies
_forms: dict[str, str] = {}
_verdicts: dict[tuple[object, str], bool] = {}


def _form(fn) -> str | None:
    """A function's argument names, defaults and statements (its docstring, comments, annotations and decorators
    aside), as ``ast.dump`` text; None when its source cannot be read."""
    try:
        src = fn if isinstance(fn, str) else inspect.getsource(fn)
        node = ast.parse(textwrap.dedent(src)).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(node, ast.FunctionDef):
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
            body[0].value.value, str):
        body = body[1:]
    return repr(([a.arg for a in node.args.args], [ast.dump(d) for d in node.args.defaults],
                 [ast.dump(s) for s in body]))


def matches(fn, kind: str) -> bool:
    """Whether ``fn``'s code is transformers' verified form ``kind`` (``_VERIFIED``); cached per function."""
    key = (fn, kind)
    if key not in _verdicts:
        if kind not in _forms:
            _forms[kind] = _form(_VERIFIED[kind])
        _verdicts[key] = _form(fn) == _forms[kind]
    return _verdicts[key]


def _calls(fn, name: str) -> bool:
    """Whether ``fn``'s code calls the module-level ``name``; cached per function."""
    key = (fn, "calls " + name)
    if key not in _verdicts:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            tree = None
        _verdicts[key] = tree is not None and any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name for n in ast.walk(tree))
    return _verdicts[key]


def _rms_kind(module: nn.Module) -> str | None:
    cls = type(module)
    if "forward" in vars(module) or not isinstance(getattr(module, "weight", None), nn.Parameter):
        return None
    if module.weight.dim() != 1 or not isinstance(getattr(module, "variance_epsilon", None), (int, float)):
        return None
    for kind in ("rms_norm", "rms_norm_weight_first"):
        if matches(cls.forward, kind):
            return kind
    return None


def _is_swiglu(module: nn.Module) -> bool:
    from transformers.activations import SiLUActivation

    if "forward" in vars(module) or type(getattr(module, "act_fn", None)) not in (SiLUActivation, nn.SiLU):
        return False
    return all(isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")) and \
        matches(type(module).forward, "mlp")


def _rope_globals(module: nn.Module) -> dict | None:
    """The globals in which this attention module's forward looks up ``apply_rotary_pos_emb`` (its modeling
    module's), when it calls that name and the function there is the verified one (with the verified
    ``rotate_half`` beside it); else None."""
    cls = type(module)
    if "forward" in vars(module) or not _calls(cls.forward, "apply_rotary_pos_emb"):
        return None
    names = getattr(inspect.unwrap(cls.forward), "__globals__", None)
    current = (names or {}).get("apply_rotary_pos_emb")
    original = getattr(current, "_miles_original", current)
    if not inspect.isfunction(original) or not matches(original, "apply_rotary_pos_emb"):
        return None
    if not matches(original.__globals__.get("rotate_half"), "rotate_half"):
        return None
    return names


# ------------------------------------------------------------------ the patched forwards
def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _rms_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    out = fused(self._miles_fused, self._miles_compiled)(_rows(hidden_states), self.weight, self.variance_epsilon)
    return out.view(*hidden_states.shape[:-1], out.shape[-1])


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    act = fused("silu_mul", self._miles_compiled)(_rows(gate), _rows(up))
    return self.down_proj(act.view(*gate.shape[:-1], act.shape[-1]))


_scope = threading.local()          # the RoPE functions of the patched attention forwards running on this thread


def _scoped(base: Callable) -> Callable:
    def forward(self, *args, **kwargs):
        stack = getattr(_scope, "stack", None)
        if stack is None:
            stack = _scope.stack = []
        stack.append(fused("rope", self._miles_compiled))
        try:
            return base(self, *args, **kwargs)
        finally:
            stack.pop()
    return forward


def _dispatcher(original: Callable) -> Callable:
    """The modeling module's ``apply_rotary_pos_emb``: the fused function inside a patched attention forward, the
    original everywhere else."""
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        stack = getattr(_scope, "stack", None)
        if stack:
            return stack[-1](q, k, cos, sin, unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._miles_original = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


_classes: dict[tuple[type, str, bool], type] = {}


def _swap(module: nn.Module, kind: str, forward: Callable, compiled: bool) -> None:
    cls = type(module)
    key = (cls, kind, compiled)
    if key not in _classes:
        _classes[key] = type(cls.__name__, (cls,), {
            "forward": forward, "_miles_fused": kind, "_miles_compiled": compiled,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__name__} with a fused forward ({kind}, miles.trainer.hf_fusions)."})
    module.__class__ = _classes[key]


def apply(model: nn.Module, *, compiled: bool = True) -> dict[str, list[str]]:
    """Give ``model``'s verified RMSNorm, SwiGLU MLP and RoPE-calling attention modules fused forwards (module
    docstring); returns {"rms_norm" | "mlp" | "rope": sorted names of the classes patched}. Idempotent."""
    patched: dict[str, set[str]] = {"rms_norm": set(), "mlp": set(), "rope": set()}
    for module in model.modules():
        if getattr(type(module), "_miles_fused", None) is not None:
            continue
        name = type(module).__name__
        kind = _rms_kind(module)
        if kind is not None:
            _swap(module, kind, _rms_forward, compiled)
            patched["rms_norm"].add(name)
        elif _is_swiglu(module):
            _swap(module, "mlp", _mlp_forward, compiled)
            patched["mlp"].add(name)
        else:
            names = _rope_globals(module)
            if names is None:
                continue
            if not hasattr(names["apply_rotary_pos_emb"], "_miles_original"):
                names["apply_rotary_pos_emb"] = _dispatcher(names["apply_rotary_pos_emb"])
            _swap(module, "rope", _scoped(type(module).forward), compiled)
            patched["rope"].add(name)
    return {k: sorted(v) for k, v in patched.items()}
