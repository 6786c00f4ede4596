"""The Deployment Engine on localhost: a ``flower-superlink`` and N ``flower-supernode``
processes (each told its partition, or its own data, through ``--node-config``),
optionally with TLS and SuperNode authentication (``scripts/make_certs.sh``)."""

from __future__ import annotations

import logging
import subprocess
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

from fedmech_flwr.artifacts.folder import APP_DIR
from fedmech_flwr.datasets.data import npz_arrays
from fedmech_flwr.tools.local_flower import (
    CONNECTION, LaunchResult, LocalFlower, free_port, opened, run_folder_of, toml_quoted,
)

log = logging.getLogger(__name__)

MAKE_CERTS = APP_DIR / "scripts" / "make_certs.sh"


@dataclass(frozen=True)
class Credentials:
    """The files ``scripts/make_certs.sh DIR N`` writes: a CA, the SuperLink's certificate
    and key, and one SSH-format ECDSA key pair per SuperNode (``node_I``, ``node_I.pub``)."""

    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def server(self) -> tuple[Path, Path]:
        return self.folder / "server.crt", self.folder / "server.key"

    def node_key(self, i: int) -> Path:
        return self.folder / f"node_{i}"

    def check(self, num_nodes: int, auth: bool) -> None:
        """Fail with what is missing and how to make it."""
        needed = [self.ca, *self.server] + [p for i in range(num_nodes if auth else 0)
                                            for p in (self.node_key(i), self.node_key(i).with_suffix(".pub"))]
        missing = [str(p) for p in needed if not p.is_file()]
        if missing:
            raise FileNotFoundError(
                f"credentials for {num_nodes} SuperNode(s) expected in {self.folder}, missing: "
                f"{', '.join(missing)}; create them with: {MAKE_CERTS} {self.folder} {num_nodes}"
            )


def make_credentials(folder: Path, num_nodes: int) -> Credentials:
    """Fresh TLS certificates and SuperNode keys from ``scripts/make_certs.sh``."""
    done = subprocess.run(["bash", str(MAKE_CERTS), str(folder), str(num_nodes)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{MAKE_CERTS} failed (needs openssl and ssh-keygen): {done.stderr.strip()}")
    return Credentials(folder)


def node_data_entries(folder: Path) -> list[Path]:
    """The per-node data in ``folder`` (``--node-data``): its files and folders, sorted,
    hidden ones left out; each is one node's ``data-path``. Each file's array headers are
    checked against its size here (``npz_arrays``), before anything starts: a damaged file
    is a BadFileError naming it, not a node refusing mid-run."""
    if not folder.is_dir():
        raise FileNotFoundError(f"--node-data {folder} is not a folder; give a folder holding one .npz file or "
                                "image folder per node (scripts/write_node_data.py writes one)")
    entries = sorted(p.resolve() for p in folder.iterdir() if not p.name.startswith("."))
    if not entries:
        raise FileNotFoundError(f"--node-data {folder} is empty; put one .npz file or image folder per node in it")
    for entry in entries:
        if entry.is_file():
            npz_arrays(entry)
    return entries


def node_configs(num_nodes: int, node_data: list[Path]) -> list[str]:
    """``--node-config`` of each SuperNode: shard nodes first (``partition-id=i
    num-partitions=num_nodes``), then one node per ``node_data`` entry (``data-path``, and
    ``node-name``: the entry's name without suffix)."""
    if len(node_data) > num_nodes:
        raise ValueError(f"--node-data holds {len(node_data)} entries but federation.num_clients is {num_nodes}; "
                         f"set federation.num_clients to at least {len(node_data)}")
    shards = [f"partition-id={i} num-partitions={num_nodes}" for i in range(num_nodes - len(node_data))]
    return shards + [f"data-path={toml_quoted(str(p))} node-name={toml_quoted(p.stem)}" for p in node_data]


def deploy_local(
    run_config: dict[str, str],
    num_nodes: int,
    *,
    tls: bool = False,
    auth: bool = False,
    certs: Path | None = None,
    port: int | None = None,
    node_data: list[Path] | None = None,
    verbose: bool = False,
) -> LaunchResult:
    """``flwr run`` this app on a local Deployment Engine: one SuperLink, ``num_nodes``
    SuperNodes (``node_configs``): shard nodes, and one node with its own data per
    ``node_data`` entry.

    ``auth`` (SuperNode authentication; Flower requires TLS for it) registers each node's
    public key with the SuperLink before the node starts. ``certs`` (implies ``tls``) is a
    folder made by ``scripts/make_certs.sh`` (default: fresh credentials for this run). The SuperLink and
    SuperNode logs end up in ``<run folder>/logs`` (or, without a run folder, their tail
    in the log).
    """
    tls = tls or auth or certs is not None
    with tempfile.TemporaryDirectory(prefix="fedmech-deploy-") as tmp, ExitStack() as stack:
        home = Path(tmp)
        creds = None
        if tls:
            creds = Credentials(certs) if certs else make_credentials(home / "certs", num_nodes if auth else 0)
            creds.check(num_nodes, auth)
        flower = LocalFlower(home, port, creds.ca if creds else None)
        kept: list[str | None] = []  # once all is stopped (callbacks run LIFO)
        stack.callback(lambda: kept.append(flower.keep_logs(run_folder_of(run_config), {})))
        opened(stack, flower)
        if creds:
            cert, key = creds.server
            security = ["--ssl-ca-certfile", str(creds.ca), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
        else:
            security = ["--insecure"]
        flower.start_superlink(*security, *(["--enable-supernode-auth"] if auth else []))
        nodes = []
        for i, node_config in enumerate(node_configs(num_nodes, node_data or [])):
            node_flags = ["--root-certificates", str(creds.ca)] if creds else ["--insecure"]
            if auth:
                flower.flwr("supernode", "register", str(creds.node_key(i).with_suffix(".pub")), CONNECTION)
                node_flags += ["--auth-supernode-private-key", str(creds.node_key(i))]
            nodes.append(flower.start(f"supernode_{i}", [
                "flower-supernode", *node_flags, "--superlink", f"127.0.0.1:{flower.port}",
                "--port", str(free_port()), "--node-config", node_config,
            ]))
        flower.wait_for_nodes(nodes)
        security_name = "TLS, SuperNode auth" if auth else "TLS" if tls else "insecure"
        own = f"; {len(node_data)} with their own data" if node_data else ""
        log.info("%d SuperNodes online at SuperLink 127.0.0.1:%d (%s%s)", num_nodes, flower.port, security_name, own)
        result = flower.run(run_config, verbose=verbose)
    return replace(result, logs_error=kept[0])
