"""The tools around a run: the CLI, the launcher, sweeps, reports, the scaffold and the reaper."""
