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
    a.add_argument("--disable-grpo-std-normalization", action="store_true", help="GRPO: subtract the group mean only (Dr.GRPO).")
    a.add_argument("--disable-rewards-normalization", action="store_true", help="Use raw rewards as returns.")
    a.add_argument("--calculate-per-token-loss", action="store_true", help="Average the loss over tokens, not sequences.")
    a.add_argument("--use-rollout-logprobs", action="store_true", help="Use the engine's log-probs as the old policy.")
    a.add_argument("--use-tis", action="store_true", help="Truncated importance sampling against rollout log-probs.")
    a.add_argument("--tis-clip", type=float, default=2.0, help="TIS upper clip.")
    a.add_argument("--tis-clip-low", type=float, default=0.0, help="TIS lower clip.")
    a.add_argument("--use-opd", action="store_true", help="On-policy distillation from a teacher.")
    a.add_argument("--opd-type", choices=["model", "sglang"], default="model", help="Teacher: a model in the trainer, or engines.")
    a.add_argument("--opd-kl-coef", type=float, default=1.0, help="Weight of the teacher reverse KL in the advantages.")
    a.add_argument("--opd-teacher-load", type=str, default=None, help="Teacher HF dir (--opd-type model).")
    a.add_argument("--opd-teacher-urls", type=str, nargs="+", default=None, help="Teacher engine URLs (--opd-type sglang).")


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
    disable_grpo_std_normalization: bool
    disable_rewards_normalization: bool
    calculate_per_token_loss: bool
    use_rollout_logprobs: bool
    use_tis: bool
    tis_clip: float
    tis_clip_low: float
    use_opd: bool
    opd_type: str
    opd_kl_coef: float
    opd_teacher_load: str | None
    opd_teacher_urls: list[str] | None
