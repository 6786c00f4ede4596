"""The tools around a run: the CLI, the launcher, sweeps, reports, ``fedmech new`` (``new_plugin``) and the reaper."""
