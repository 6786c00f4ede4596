"""The Flower ServerApp (``[tool.flwr.app.components] serverapp``).

Run config keys (declared in pyproject.toml): ``experiment`` (YAML path, relative to the
app), ``overrides`` (JSON list of ``key=value`` strings), ``out`` (output root) and
``run-dir`` (an exact run folder), and ``resume`` (a killed run's folder to continue with
its own config; the other keys are then ignored). ``fedmech run`` fills them in.
"""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedmech_flwr.app import link_index
from fedmech_flwr.app.experiment_run import resume_config, run_experiment
from fedmech_flwr.app.run import show_logs
from fedmech_flwr.artifacts.folder import APP_DIR
from fedmech_flwr.contracts import plugins
from fedmech_flwr.spec.experiment import load_experiment

link_index.install()  # in simulation this process holds Flower's link state: before its engine starts polling
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    show_logs()
    plugins.load()
    rc = context.run_config
    if resume := str(rc.get("resume") or ""):
        run_experiment(grid, resume_config(resume), run_dir=resume, run_config=dict(rc), resume=True)
        return
    path = Path(str(rc["experiment"])).expanduser()
    if not path.is_absolute():
        path = APP_DIR / path
    overrides = json.loads(str(rc.get("overrides") or "[]"))
    cfg = load_experiment(path, overrides)
    run_experiment(
        grid,
        cfg,
        out=str(rc.get("out") or "") or None,
        run_dir=str(rc.get("run-dir") or "") or None,
        run_config=dict(rc),
    )
