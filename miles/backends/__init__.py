"""Miles's ``miles.backends`` import path, kept only for the names Miles's plugins import from it
(``miles.backends.training_utils.cp_utils``); this project's trainers live in :mod:`miles.trainer`."""
