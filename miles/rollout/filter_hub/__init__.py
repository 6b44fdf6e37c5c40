"""Miles's dynamic-sampling filter hub (``--dynamic-sampling-filter-path miles.rollout.filter_hub.dynamic_sampling_filters.X``)."""
