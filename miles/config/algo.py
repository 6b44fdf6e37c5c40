"""Algorithm flags: advantage estimators, policy loss, KL, off-policy correction, OPD."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

ADVANTAGE_ESTIMATORS = ["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]
LOSS_TYPES = ["policy_loss", "sft_loss", "custom_loss"]
KL_TYPES = ["k1", "k2", "k3", "low_var_kl"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument_group("algorithm")
    a.add_argument("--advantage-estimator", choices=ADVANTAGE_ESTIMATORS, default="grpo", help="Advantage estimator.")
    a.add_argument("--loss-type", choices=LOSS_TYPES, default="policy_loss", help="Loss.")
    a.add_argument("--custom-loss-function-path", type=str, default=None, help="module.function for --loss-type custom_loss.")
    a.add_argument("--eps-clip", type=float, default=0.2, help="PPO clip range (low side, and high unless --eps-clip-high).")
    a.add_argument("--eps-clip-high", type=float, default=None, help="PPO clip range, high side (clip-higher).")
    a.add_argument("--eps-clip-c", type=float, default=None, help="Dual-clip PPO lower bound constant (> 1).")
    a.add_argument("--value-clip", type=float, default=0.2, help="PPO value clip.")
    a.add_argument("--kl-coef", type=float, default=0.0, help="KL penalty folded into rewards.")
    a.add_argument("--use-kl-loss", action="store_true", help="Add a KL-to-reference loss term.")
    a.add_argument("--kl-loss-coef", type=float, default=0.0, help="Weight of the KL loss.")
    a.add_argument("--kl-loss-type", choices=KL_TYPES, default="k1", help="KL estimator.")
    a.add_argument("--entropy-coef", type=float, default=0.0, help="Entropy bonus weight.")
    a.add_argument("--gamma", type=float, default=1.0, help="Discount (PPO/GAE, REINFORCE++).")
    a.add_argument("--lambd", type=float, default=1.0, help="GAE lambda.")
    a.add_argument("--normalize-advantages", action="store_true", help="Whiten advantages over the data-parallel batch.")
    a.add_argument("--disable-grpo-std-normalization", dest="grpo_std_normalization", action="store_false",
                   help="GRPO: subtract the group mean only (Dr.GRPO).")
    a.add_argument("--disable-rewards-normalization", dest="rewards_normalization", action="store_false",
                   help="Use raw rewards as returns.")
    a.add_argument("--disable-compute-advantages-and-returns", dest="compute_advantages_and_returns", action="store_false",
                   help="Do not compute advantages and returns (SFT or a custom loss that needs none).")
    a.add_argument("--calculate-per-token-loss", action="store_true", help="Average the loss over tokens, not sequences.")
    a.add_argument("--use-rollout-logprobs", action="store_true", help="Use the engine's log-probs as the old policy.")
    a.add_argument("--use-tis", action="store_true", help="Truncated importance sampling against rollout log-probs.")
    a.add_argument("--tis-clip", type=float, default=2.0, help="TIS upper clip.")
    a.add_argument("--tis-clip-low", type=float, default=0.0, help="TIS lower clip.")
    a.add_argument("--custom-tis-function-path", type=str, default=None,
                   help="module.function computing the TIS/RS weights (Miles's call), instead of the built-in --use-tis clamp.")
    a.add_argument("--use-routing-replay", action="store_true",
                   help="MoE routing replay (R2, arxiv 2507.18071): the training forwards route each token to the "
                        "experts the old log-prob forward chose (set by --use-rollout-routing-replay too, as Miles).")
    a.add_argument("--use-rollout-routing-replay", action="store_true",
                   help="Rollout routing replay (R3, arxiv 2510.11370): the engines return each token's routed "
                        "experts and every policy forward of the trainer routes to them. MoE models only.")
    a.add_argument("--use-opd", action="store_true", help="On-policy distillation from a teacher.")
    a.add_argument("--opd-type", choices=["model", "megatron", "sglang"], default=None,
                   help="Teacher: in the trainer (megatron: Miles's name; model: this project's older name), or engines (sglang).")
    a.add_argument("--opd-kl-coef", type=float, default=1.0, help="Weight of the teacher reverse KL in the advantages.")
    a.add_argument("--opd-teacher-load", type=str, default=None, help="Teacher HF dir (--opd-type model).")
    a.add_argument("--opd-teacher-urls", type=str, nargs="+", default=None,
                   help="--opd-type sglang: Miles's NAME=URL routing map (by metadata[--opd-teacher-key]; else --rm-url), "
                        "or plain teacher engine URLs (this project's older form).")
    a.add_argument("--opd-teacher-key", type=str, default="opd_teacher", help="Metadata key naming a sample's teacher.")
    a.add_argument("--opd-teacher-ckpt-step", type=int, default=None, help="Megatron teacher checkpoint step (refused).")
    a.add_argument("--opd-log-prob-top-k", type=int, default=0,
                   help="Top-k OPD: compare student and teacher on K token ids per position (0: the sampled token).")
    a.add_argument("--opd-top-k-strategy", choices=["only-student", "only-teacher", "intersection", "union", "xor"],
                   default="only-student", help="Token set of top-k OPD.")
    a.add_argument("--opd-reward-weight-mode", choices=["student_p", "teacher_p", "none"], default="student_p",
                   help="Weights of top-k OPD token rewards.")
    a.add_argument("--opd-topk-per-position", action="store_true", help="Per-position token ids for top-k OPD.")


@dataclass(kw_only=True)
class AlgoConfig:
    advantage_estimator: str
    loss_type: str
    custom_loss_function_path: str | None
    eps_clip: float
    eps_clip_high: float | None
    eps_clip_c: float | None
    value_clip: float
    kl_coef: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    entropy_coef: float
    gamma: float
    lambd: float
    normalize_advantages: bool
    grpo_std_normalization: bool
    rewards_normalization: bool
    compute_advantages_and_returns: bool
    calculate_per_token_loss: bool
    use_rollout_logprobs: bool
    use_tis: bool
    tis_clip: float
    tis_clip_low: float
    custom_tis_function_path: str | None
    use_routing_replay: bool
    use_rollout_routing_replay: bool
    use_opd: bool
    opd_type: str | None
    opd_kl_coef: float
    opd_teacher_load: str | None
    opd_teacher_urls: list[str] | None
    opd_teacher_key: str
    opd_teacher_ckpt_step: int | None
    opd_log_prob_top_k: int
    opd_top_k_strategy: str
    opd_reward_weight_mode: str
    opd_topk_per_position: bool

    @property
    def opd_teacher_in_trainer(self) -> bool:
        """``--opd-type megatron`` (Miles's name) or ``model``: the teacher is forwarded by the trainer."""
        return self.use_opd and self.opd_type in ("model", "megatron")
