"""LoRA (``--lora-rank R``): trainable low-rank adapters on frozen linears, our own implementation.

    spec = LoraSpec.from_config(cfg.train)                  # None when --lora-rank is 0
    lora = attach(model, spec, tp_rank=r, tp_size=tp, tp_group=g, seed=seed)   # base frozen, hooks on
    optimizer = build_adamw(lora, ...)                      # the adapters are the only trained parameters
    with merged(lora): export(model)                        # W + (alpha / r) * B @ A, restored after

A target linear ``y = W x`` becomes ``y = W x + (alpha / r) * B (A dropout(x))`` with ``A`` [r, in] and
``B`` [out, r]; ``B`` starts at zero (the model is the base model at step 0) and ``A`` Kaiming-uniform, drawn
from a generator seeded by the trainer seed and the module's name (the same on every rank). The adapters
live in their own module (``LoraAdapters``), not in the model: the model's parameters, names, converter,
export and checkpoint code are unchanged, and a forward hook on each target adds its delta.

Megatron tensor parallelism follows the base weight's split:

- column-parallel (``linear_qkv``, ``linear_fc1``; W [out/tp, in]): ``A`` replicated, ``B`` split on rows
  like W; ``A x`` passes megatron-core's copy-to-TP region, so its gradient is summed over TP (every rank
  then holds the same ``A`` gradient).
- row-parallel (``linear_proj``, ``linear_fc2``; W [out, in/tp], input split): ``A`` split on columns like
  W, ``B`` replicated; ``A x`` is a TP-partial sum, reduced over TP before ``B``.

- replicated (multi-latent attention's down projections ``linear_q_down_proj`` / ``linear_kv_down_proj``, whole on
  every TP rank): ``A`` and ``B`` whole.

So ``B @ A`` has W's local shape on every rank and ``merged`` adds it to the local shard: the export
gathers and converts merged weights exactly as it does base weights (HF names; the engines need no LoRA).

Under sequence parallelism (``--sequence-parallel``, each TP rank holding a slice of the sequence where megatron-core
does, the module's own ``sequence_parallel``): a column-parallel target's input is this rank's slice, so ``A x`` is
gathered from the sequence-parallel region (backward: reduce-scattered); a row-parallel target's ``A x`` is
reduce-scattered to this rank's slice before ``B``; a replicated target sees this rank's slice only. The factors
every TP rank holds whole (column's ``A``, row's ``B``, replicated's both) then have a gradient from this rank's part
of the sequence: ``finish_grads`` sums them over TP first, as megatron-core sums its sequence-parallel norms.

Target names (``--target-modules``, Miles's): ``all-linear`` or a comma list of HF names (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``; multi-latent attention's ``q_a_proj``,
``kv_a_proj_with_mqa``, ``q_b_proj``, ``kv_b_proj``) or Megatron names (``linear_qkv``, ``linear_proj``,
``linear_fc1``, ``linear_fc2``, ``linear_q_proj``, ``linear_q_down_proj``, ``linear_kv_down_proj``,
``linear_q_up_proj``, ``linear_kv_up_proj``; ``miles.config.lora``). Megatron fuses q/k/v and gate/up, so,
as in Miles's standard ``--lora-type lora``, any of q/k/v selects the fused ``linear_qkv`` (one ``A``, a
``B`` whose rows are q, k and v) and gate/up select ``linear_fc1``; a name selects the modules of that leaf name the
model has (as Megatron-Bridge's LoRA, which Miles uses), the ones that select nothing are logged.

MoE experts (Miles's semantics, radixark/miles@v0.1.0:miles/backends/megatron_utils/lora_utils.py and its
``--experts-shared-outer-loras`` help in radixark/miles@v0.1.0:miles/utils/arguments.py; Megatron-Bridge's ``LoRA`` matches a target by
the module's leaf name): the expert names are the dense ones, so ``gate_proj`` / ``up_proj`` / ``linear_fc1``
select the dense MLPs' ``linear_fc1``, the shared experts' and every routed expert's (``mlp.experts.
local_experts.E.linear_fc1``, HF ``mlp.experts.E.{gate,up}_proj``), and ``down_proj`` / ``linear_fc2`` the
``linear_fc2`` of each. Two layouts of the routed experts' adapters:

- per-expert (the default): each expert ``E`` has its own ``A_E`` and ``B_E`` on ``linear_fc1`` and on
  ``linear_fc2``; ``delta W_E = (alpha / r) B_E @ A_E``.
- ``--experts-shared-outer-loras`` (SGLang's ``experts_shared_outer_loras=True`` serving contract, Miles's
  "gate_up lora_A and down lora_B shared across experts, expert_dim=1"): the *outer* factors, those on the
  hidden-size side, are one tensor per layer shared by all its experts: ``linear_fc1``'s ``A`` [r, hidden]
  (``delta W1_E = (alpha / r) B1_E @ A1``) and ``linear_fc2``'s ``B`` [hidden, r] (``delta W2_E = (alpha / r)
  B2 @ A2_E``); the inner ones (``B1_E`` [2 ffn, r], ``A2_E`` [r, ffn]) stay per expert.

Expert parallelism: EP rank ``p`` holds the adapters of its local experts (seeded by the *global* expert's
name, so EP 1 and EP 2 draw the same ``A``); their gradients are reduced as the experts' weights are (summed over
the expert-data-parallel group, divided by the DP size: ``moe.reduce_expert_grads``). A shared outer factor is
replicated on every EP rank and each rank's copy sees only its own experts' tokens, so its gradient is first summed
over the EP group (Miles's ``_lora_grad_sum_group = "ep"``) and then reduced as an expert's. The merged export
gathers the merged experts over EP as the base export does, so the engines still receive plain merged weights.

Pipeline parallelism (``--pipeline-model-parallel-size``): each stage attaches adapters to the layers it holds,
named, selected and seeded by the layer's model-wide index (``pipeline.global_name``: ``decoder.layers.<global
i>``), so every PP size draws the same adapters. The gradients are reduced per stage (over the stage's TP / EP / DP
groups, as above); the gradient norm and the trainable count are summed over the pipeline group. ``merged`` merges
this stage's targets, and the pipeline export (``export._iter_pipeline``) broadcasts each stage's merged weights
under their global names, so the engines receive the whole merged model. ``full_pairs`` (and the PEFT adapter)
gathers the stages' adapters over the pipeline group; ``--save`` writes each rank's adapters (its stage's), and a
checkpoint resumes at the same pipeline size only.

Context parallelism (``--context-parallel-size``): a target linear maps each token on its own, so the hooks need
nothing; each CP rank's adapter gradients are its sequence chunks', summed over DP x CP as the base weights' are
(``finish_grads``; a routed expert's over the expert-DP group, which spans the CP ranks).

Modules: ``lora_adapters`` (``LoraSpec``, ``attach``, hooks, ``merged``, ``check_megatron``), ``lora_state`` (gradient
reductions, the norm clip, the trainable count, checkpoints), ``lora_peft`` (``full_pairs``, the PEFT names and
adapter files); this module names them all for their importers (``from miles.trainer import lora``).
"""

from __future__ import annotations

from miles.config.lora import FAMILY_TARGETS, MEGATRON_KIND, path_matches, resolve, resolve_targets
from miles.trainer.lora_adapters import (
    LoraAdapters,
    LoraPair,
    LoraSpec,
    _expert_pair,
    _init_a,
    attach,
    bridge_names,
    check_megatron,
    merged,
    selects_routed_experts,
)
from miles.trainer.lora_peft import (
    expert_peft_tensors,
    full_pairs,
    peft_config,
    peft_named,
    peft_tensors,
    write_peft_adapter,
)
from miles.trainer.lora_state import (
    _spec_dict,
    clip_grad_norm,
    finish_grads,
    load_files,
    load_state,
    save_files,
    state,
    trainable_count,
)

__all__ = [
    "FAMILY_TARGETS", "MEGATRON_KIND", "LoraAdapters", "LoraPair", "LoraSpec", "_expert_pair", "_init_a", "_spec_dict",
    "attach", "bridge_names", "check_megatron", "clip_grad_norm", "expert_peft_tensors", "finish_grads", "full_pairs",
    "load_files", "load_state", "merged", "path_matches", "peft_config", "peft_named", "peft_tensors", "resolve",
    "resolve_targets", "save_files", "selects_routed_experts", "state", "trainable_count", "write_peft_adapter",
]
