"""Every name Miles v0.1.0's ``examples/`` plugins and its documented plugin contracts (docs/) import from ``miles``
resolves in this package. The table is data (module -> names), gathered from Miles's sources with
``git grep -n "from miles" v0.1.0 -- examples docs``; no Miles code is here.

Not in the table, by design: ``miles.utils.external_utils.*`` (``command_utils``, ``exec_command``,
``model_args_utils``): what Miles's launcher scripts (``run*.py``) use to start Ray jobs; runs here start with
``python -m miles.train`` under torchrun / mpirun / sbatch instead.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest

MILES_EXAMPLE_IMPORTS: dict[str, tuple[str, ...]] = {
    "miles.backends.training_utils.cp_utils": ("all_gather_with_cp", "slice_log_prob_with_cp"),
    "miles.rollout.base_types": ("GenerateFnInput", "GenerateFnOutput", "RolloutFnConstructorInput",
                                 "RolloutFnEvalInput", "RolloutFnEvalOutput", "RolloutFnInput", "RolloutFnOutput",
                                 "RolloutFnTrainInput", "RolloutFnTrainOutput"),
    "miles.rollout.checkpoint_eval": ("CheckpointEvalFn", "retarget_args"),
    "miles.rollout.data_source": ("DataSource", "RolloutDataSourceWithBuffer"),
    "miles.rollout.filter_hub.base_types": ("MetricGatherer", "call_dynamic_filter"),
    "miles.rollout.generate_utils.prefill_logprobs": ("recompute_samples_rollout_logprobs_via_prefill",),
    "miles.rollout.inference_rollout.inference_rollout_common": ("GenerateState", "InferenceRolloutFn"),
    "miles.rollout.inference_rollout.inference_rollout_eval": ("run_eval_datasets",),
    "miles.rollout.rm_hub": ("async_rm", "batched_async_rm", "grade_answer_verl"),
    "miles.rollout.rm_hub.math_dapo_utils": ("compute_score",),
    "miles.rollout.rm_hub.math_utils": ("extract_answer", "grade_answer_verl"),
    "miles.rollout.sglang_rollout": ("GenerateState", "generate", "generate_rollout"),
    "miles.utils": ("dumper_utils",),
    "miles.utils.dumper_utils": ("configure_sglang",),
    "miles.utils.async_utils": ("run",),
    "miles.utils.eval_config": ("DATASET_RUNTIME_SPECS", "_apply_dataset_field_overrides"),
    "miles.utils.file_arg_utils": ("PSEUDO_FILE_PREFIX", "resolve_file_arg"),
    "miles.utils.http_utils": ("get", "post", "wait_http_ok"),
    "miles.utils.lora": ("LORA_ADAPTER_NAME", "is_lora_enabled"),
    "miles.utils.misc": ("get_free_port", "load_function"),
    "miles.utils.processing_utils": ("encode_image_for_rollout_engine", "load_tokenizer"),
    "miles.utils.types": ("Sample",),
    # Miles's fast tests of these modules import these too
    "miles.utils.mask_utils": ("MultiTurnLossMaskGenerator",),
}


@pytest.mark.parametrize("module", sorted(MILES_EXAMPLE_IMPORTS))
def test_miles_example_import_resolves(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [name for name in MILES_EXAMPLE_IMPORTS[module]
               if not hasattr(mod, name) and importlib.util.find_spec(f"{module}.{name}") is None]
    assert not missing, f"{module} lacks {missing}"


def test_sample_has_the_methods_and_fields_miles_plugins_use() -> None:
    from miles.utils.types import RewardSpec, Sample

    s = Sample(reward_spec=RewardSpec(rm_type="math"))
    assert callable(s.strip_last_output_tokens) and s.reward_spec.rm_type == "math"
    assert Sample.Status.ABORTED.value == "aborted"
