"""Built-in verifiers behind ``--rm-type`` (one module each); ``miles.rollout.rewards`` dispatches to them."""
