"""Miles's class-based rollout package; see :mod:`miles.rollout.inference_rollout.inference_rollout_common`."""
