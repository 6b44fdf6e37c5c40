"""The run: the RL loop (sync and async), the driver's command channel, metrics sinks, progress bars.

``train.py`` / ``train_async.py`` call :func:`miles.run.entry.run_job` with :class:`miles.run.loop.RLLoop`
or :class:`miles.run.async_loop.AsyncRLLoop`. ``build.py`` wires the planes (spmd, engines, rollout,
trainer, weight sync) into a :class:`miles.run.build.Run`; ``worker.py`` is what every rank does on
the driver's commands; ``metrics.py``/``plot.py``/``progress.py`` are what a user sees.
"""
