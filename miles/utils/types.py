"""Miles's import path for the sample types: ``from miles.utils.types import Sample`` (used by Miles's example
plugins) gives this project's ``miles.types.Sample`` (and ``RewardSpec``, ``SampleStatus``)."""

from miles.types import RewardSpec, Sample, SampleStatus

__all__ = ["RewardSpec", "Sample", "SampleStatus"]
