"""The Simulation Engine on a private local Flower: ``launch`` runs one experiment on a
``flower-superlink --simulation`` and a private Ray head (or an existing Ray cluster when
``simulation.ray_address`` is set), started side by side; a sweep keeps one ``Simulation``
warm for many runs (``WarmSimulations``), each still its own Flower run with its own run id."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from fedmech_flwr.artifacts.folder import APP_DIR
from fedmech_flwr.spec.config import SimulationConfig
from fedmech_flwr.tools.local_flower import LaunchResult, LocalFlower, opened, run_folder_of

log = logging.getLogger(__name__)


class Simulation:
    """A local simulation SuperLink that runs one ``flwr run`` after another, each a Flower
    run of its own (run id, logs), and the Ray its runs join: an existing cluster when
    ``ray_address`` names one, else a private Ray head with ``num_cpus`` CPUs (default:
    all) started beside the SuperLink. A lone ``fedmech run`` uses it once (Ray starts
    while the SuperLink does, and a run leaves Ray faster than it stops a Ray of its
    own); a sweep's worker keeps it warm for its cells. ``stack`` stops it."""

    def __init__(self, stack: ExitStack, ray_address: str | None = None, num_cpus: int | None = None) -> None:
        home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedmech-flwr-")))
        self.flower = opened(stack, LocalFlower(home, None, ray_address=ray_address))
        self.ray_address = ray_address
        if ray_address:
            log.info("simulation uses the existing Ray cluster at %s", ray_address)
        else:
            self.flower.start_ray_head(num_cpus)
        self.flower.start_superlink("--insecure", "--simulation", "--isolation", "subprocess")

    def alive(self) -> bool:
        return self.flower.alive()

    def run(self, run_config: dict[str, str], num_supernodes: int, sim: SimulationConfig, *,
            stream: TextIO | None = None, app: Path = APP_DIR, verbose: bool = False) -> LaunchResult:
        """``flwr run`` an app with ``run_config`` (see ``launch``; ``sim`` gives the clients'
        resources); its logs go to its run folder."""
        federation = (f"num-supernodes={num_supernodes} client-resources-num-cpus={sim.cpus_per_client} "
                      f"client-resources-num-gpus={sim.gpus_per_client}")
        since = self.flower.log_sizes()
        try:
            result = self.flower.run(run_config, federation, stream, app, verbose)
        finally:
            logs_error = self.flower.keep_logs(run_folder_of(run_config), since)
        return replace(result, logs_error=logs_error)


class WarmSimulations:
    """One warm ``Simulation`` per worker thread of a sweep: a cell runs on its thread's
    (one on the cell's Ray address, started on first use), so a thread pays the
    SuperLink's and Ray's start once, not once per cell. A simulation that a process of
    it left, or that a failed run may have left in a bad state (``discard``), is replaced
    by a fresh one. ``close`` stops them all."""

    def __init__(self, num_cpus: int | None = None) -> None:
        self.num_cpus = num_cpus
        self.local = threading.local()
        self.stacks: list[ExitStack] = []
        self.lock = threading.Lock()

    def get(self, ray_address: str | None) -> Simulation:
        current = getattr(self.local, "simulation", None)
        if current is not None and current.alive() and current.ray_address == ray_address:
            return current
        self.discard()
        stack = ExitStack()
        with self.lock:
            self.stacks.append(stack)
        self.local.stack = stack
        self.local.simulation = Simulation(stack, ray_address, self.num_cpus)
        return self.local.simulation

    def discard(self) -> None:
        """Stop this thread's simulation; its next cell starts a fresh one."""
        if getattr(self.local, "simulation", None) is not None:
            self.local.simulation = None
            self.local.stack.close()  # and again, as a no-op, in ``close``

    def close(self) -> None:
        with self.lock:
            stacks, self.stacks = self.stacks, []
        for stack in stacks:
            stack.close()


def private_ray_cpus(clients_cpus: int, share: int | None = None) -> int:
    """The CPUs a private Ray gets: its ``share`` of this machine (default: all of it), but
    no more than ``clients_cpus``, what every client of the federation at once would take
    (clients x ``simulation.cpus_per_client``). Flower starts one client actor for every
    ``cpus_per_client`` CPUs of the cluster, needed or not, and each is a process that
    imports torch (seconds of CPU, a few hundred MiB): without the cap a 3-client run on
    32 cores would start 32."""
    return min(share or os.cpu_count() or 1, clients_cpus)


def launch(run_config: dict[str, str], num_supernodes: int, sim: SimulationConfig, *,
           stream: TextIO | None = None, app: Path = APP_DIR, verbose: bool = False) -> LaunchResult:
    """``flwr run`` an app (this one by default; a user's own Flower app, say) with
    ``run_config`` on a fresh local ``Simulation``.

    The clients' resources go to Flower's Ray backend through ``--federation-config``;
    ``sim.ray_address`` runs them on an existing Ray cluster instead of a private Ray. What
    the console shows goes to ``stream`` (default: stdout; ``verbose``: Flower's whole
    log); the logs of Flower, Ray and the run end up in the run folder's ``logs/``.
    """
    with ExitStack() as stack:
        simulation = Simulation(stack, sim.ray_address, private_ray_cpus(num_supernodes * sim.cpus_per_client))
        return simulation.run(run_config, num_supernodes, sim, stream=stream, app=app, verbose=verbose)
