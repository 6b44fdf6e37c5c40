"""Miles's import path for the sample type: ``from miles.utils.types import Sample`` (used by Miles's example
plugins) gives this project's ``miles.types.Sample``."""

from miles.types import Sample, SampleStatus

__all__ = ["Sample", "SampleStatus"]
