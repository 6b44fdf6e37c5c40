"""Rollout plane: sample generation on the engine fleet (``miles.fleet``): prompt data, the rollout manager,
generate functions, rewards, filters, on-policy distillation and the plugin contracts, under Miles's module
names where Miles's plugins import them (``sglang_rollout``, ``base_types``, ``rm_hub``, ``filter_hub``,
``generate_hub``, ``inference_rollout``, ...). Submodules are imported explicitly; nothing heavy is imported here."""
