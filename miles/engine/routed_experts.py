"""The experts each token was routed to, as SGLang returns them (``return_routed_experts``, R3).

SGLang (``--enable-return-routed-experts``) keeps one int32 row ``[num_hidden_layers, num_experts_per_tok]`` per
token that ran through the model (prompt and generated tokens but the last, which no forward saw), every layer's
top-k expert ids (a dense layer's row stays 0), and answers ``meta_info["routed_experts"]`` = base64 of the C-order
int32 array ``[prompt + completion - 1 - routed_experts_start_len, layers, top-k]``. Miles decodes it with
``np.frombuffer(b64decode(s), np.int32).reshape(len(tokens) - 1, num_layers, top_k)``.

``RoutedExpertsRecorder`` hooks the HF MoE routers of a model whose router returns the indices it chose
(transformers' ``Qwen3MoeTopKRouter`` and its Qwen3-Next / Qwen3.5-MoE copies, and the grouped sigmoid
``Glm4MoeLiteTopkRouter`` / ``DeepseekV3TopkRouter``: ``(logits, weights, indices)``; Nemotron-H's
``NemotronHTopkRouter`` at ``layers.L.mixer.gate``, the same; Gemma 4's ``Gemma4TextRouter`` at ``layers.L.router``:
``(probabilities, weights, indices)``; GLM-4.5's ``Glm4MoeTopkRouter``, gpt-oss's ``GptOssTopKRouter`` at
``layers.L.mlp.router``, DeepSeek-V3.2's / GLM-5's DeepSeek-V3 router and DeepSeek-V4's top-k and hash routers, all
``(logits, weights, indices)``; ``RECORDED_MODEL_TYPES``) and collects, for each forward it is armed for, every MoE
layer's ``[tokens, top-k]`` indices. Other MoE families are not recorded: a request for them is refused in one line.
The hooks exist only while armed (``begin`` to ``end``): a forward nobody records runs the routers hook-free.
"""

from __future__ import annotations

import base64
import re

import numpy as np
import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp\.gate|mixer\.gate|mlp\.router|router)$")
# Gemma 4: layers.L.router; Nemotron-H: layers.L.mixer.gate; gpt-oss: layers.L.mlp.router
# routers that return (scores, weights, top-k indices), with the names the engine's refusal gives them
RECORDED_MODEL_TYPES = {"qwen3_moe": "Qwen3-MoE", "glm4_moe_lite": "GLM-4.7-Flash", "deepseek_v3": "DeepSeek-V3",
                        "kimi_k2": "Kimi-K2", "joyai_llm_flash": "JoyAI-LLM-Flash",   # DeepSeek-V3's router
                        "gemma4_text": "Gemma 4 MoE",                                 # (hf_aliases); Gemma4TextRouter
                        "qwen3_next": "Qwen3-Next", "qwen3_5_moe": "Qwen3.5-MoE",     # Qwen3-MoE's router
                        "qwen3_5_moe_text": "Qwen3.5-MoE",                            # (the published layout's text)
                        "nemotron_h": "Nemotron-H (Nemotron-3)",                      # NemotronHTopkRouter
                        "glm4_moe": "GLM-4.5",                                        # Glm4MoeTopkRouter
                        "gpt_oss": "gpt-oss",                                         # GptOssTopKRouter
                        "deepseek_v32": "DeepSeek-V3.2", "glm_moe_dsa": "GLM-5",      # DeepSeek-V3's router
                        "deepseek_v4": "DeepSeek-V4"}                                 # its top-k and hash routers


def moe_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(layer index, router module)`` of every MoE layer of a HF decoder (``model.layers.L.mlp.gate``; Gemma 4's
    ``...layers.L.router``; Nemotron-H's ``...layers.L.mixer.gate``)."""
    found = []
    for name, mod in model.named_modules():
        m = _LAYER.search(name)
        if m is not None:
            found.append((int(m.group(1)), mod))
    return sorted(found, key=lambda x: x[0])


def topk_of(config) -> int:
    return int(getattr(config, "num_experts_per_tok", 0) or getattr(config, "moe_router_topk", 0)
               or getattr(config, "top_k_experts", 0) or 0)


def encode(rows: np.ndarray | torch.Tensor) -> str:
    """SGLang's wire format: base64 of the int32 C-order bytes."""
    a = rows.cpu().numpy() if isinstance(rows, torch.Tensor) else rows
    return base64.b64encode(np.ascontiguousarray(a, dtype=np.int32).tobytes()).decode("ascii")


def decode(s: str, num_layers: int, top_k: int) -> np.ndarray:
    """``[tokens, num_layers, top_k]`` int32 from ``meta_info["routed_experts"]`` (the token count from its length)."""
    x = np.frombuffer(base64.b64decode(s.encode("ascii")), dtype=np.int32)
    per = num_layers * top_k
    if per <= 0 or x.size % per:
        raise ValueError(f"routed_experts holds {x.size} ids, not a multiple of {num_layers} layers x top-k {top_k}")
    return x.reshape(-1, num_layers, top_k)


class RoutedExpertsRecorder:
    """Forward hooks on a model's MoE routers; ``with rec.capture() as out`` gives ``[tokens, layers, top-k]``."""

    def __init__(self, model: torch.nn.Module, config):
        self.model_type = str(getattr(config, "model_type", ""))
        self.routers = moe_routers(model) if self.model_type in RECORDED_MODEL_TYPES else []
        self.num_layers = int(config.num_hidden_layers)
        self.top_k = topk_of(config)
        self._cur: dict[int, torch.Tensor] | None = None
        self._handles: list = []

    @property
    def enabled(self) -> bool:
        return bool(self.routers) and self.top_k > 0

    def _hook(self, layer: int):
        def hook(_mod, _inp, out):
            if self._cur is None:
                return
            self._cur[layer] = out[2].reshape(-1, self.top_k).to(torch.int32)   # (logits, weights, indices)
        return hook

    def begin(self) -> None:
        """Arm for the next forward: hook every router (the hooks go again at ``end``)."""
        self._cur = {} if self.enabled else None
        if self._cur is not None and not self._handles:
            self._handles = [mod.register_forward_hook(self._hook(layer)) for layer, mod in self.routers]

    def end(self, num_tokens: int) -> torch.Tensor | None:
        """The armed forward's ``[num_tokens, layers, top-k]`` (CPU int32; zeros for dense layers), then disarm."""
        cur, self._cur = self._cur, None
        for h in self._handles:
            h.remove()
        self._handles = []
        if cur is None:
            return None
        rows = torch.zeros(num_tokens, self.num_layers, self.top_k, dtype=torch.int32)
        for layer, idx in cur.items():
            rows[:, layer] = idx[-num_tokens:].cpu()
        return rows
