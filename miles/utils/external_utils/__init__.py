"""Miles's ``miles.utils.external_utils``: what Miles's Python launchers (``scripts/run_<model>.py``) call.

``command_utils`` (``execute_train``, ``convert_checkpoint``, ``hf_download_dataset``, ...), ``exec_command``
and ``model_args_utils`` keep Miles's names and signatures. Where Miles submits a Ray job, ``execute_train``
starts the same ``train.py`` command line as one SPMD job: torchrun on one node, srun inside a Slurm
allocation (``launch.py``). ``MILES_SCRIPT_DRY_RUN=1`` prints every command instead of running it. These
modules import no plane: the job is a subprocess. docs/launching.md, "Miles's Python launchers".
"""
