"""Miles's ``miles.backends.training_utils`` import path (see :mod:`miles.backends`)."""
