"""Semantic mutants: the bugs an FL researcher writes into an update rule, each planted in
memory and run against the fast tests that must catch it.

mutmut's operators change syntax (a ``+`` for a ``-``, a constant, an argument dropped);
they cannot write a step count taken over one epoch, a statistic read from the batch
instead of the shard, a state saved as a view of the live weights or a server state
read before its update. Each ``Mutant`` here is one such bug: a module, an exact snippet of
its source and what replaces it, the kind of bug, and the fast tests that must fail on it.

    python benchmarks/semantic_mutants.py [--only NAME ...] [--list]

First the union of the named tests runs on the unchanged source (they must pass: a
failure there would make every kill meaningless), then one pytest process per mutant,
with this module as a plug-in (``-p semantic_mutants``, the mutant's name in
``SEMANTIC_MUTANT``): as the mutant's module is imported, its snippet is replaced in the
source, which is compiled and run in its place, so the repository's files never change.
A mutant is killed when a named test fails; the process also writes a marker when it
imported the mutated module, so a mutant that no test reached reports "not applied". It
prints one line per mutant, the totals and the time, and exits 1 unless every mutant was
killed. ``tests/test_semantic_mutants.py`` checks that every snippet is still in its module,
so the catalogue cannot silently rot when the code changes.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV_NAME = "SEMANTIC_MUTANT"
"""The mutant a pytest process under this plug-in applies."""
ENV_MARKER = "SEMANTIC_MUTANT_APPLIED"
"""A file the plug-in writes once it has imported the mutated module; it then adds the
type of each failing test's exception, one a line."""
FAILED_CHECK = {"AssertionError", "Failed"}
"""A test's own check failing (an assert, ``pytest.raises`` that saw nothing raised)."""

DRIFT = "tests/test_drift_correction.py"
REPRESENTATION = "tests/test_representation_methods.py"
CLIENTS = "tests/test_clients.py"
COUNTS = "tests/test_class_counts.py"
FEDROD = "tests/test_fedrod_and_server_optimisers.py"
FEDAVG = "tests/test_fedavg.py"


@dataclass(frozen=True)
class Mutant:
    """One researcher-style bug: ``old`` (exactly once in ``module``'s source) becomes ``new``."""

    name: str
    module: str
    old: str
    new: str
    kind: str
    """wrong count, wrong normaliser, state at the wrong time, sign, detached or aliased
    tensor, batch vs shard statistics, wrong objective."""
    bug: str
    """The bug in words."""
    killed_by: tuple[str, ...]
    """pytest node ids of fast tests that must fail on it."""

    def apply(self, source: str) -> str:
        """``source`` with the snippet replaced; raises if it is not there exactly once."""
        found = source.count(self.old)
        if found != 1:
            raise ValueError(f"mutant {self.name}: expected its snippet once in {self.module}, found it {found} times; "
                             "update the mutant in benchmarks/semantic_mutants.py to the module's current code")
        return source.replace(self.old, self.new)


def _node(file: str, test: str) -> str:
    return f"{file}::{test}"


MUTANTS: tuple[Mutant, ...] = (
    # --- SCAFFOLD --------------------------------------------------------------------------
    Mutant("scaffold-k-over-one-epoch", "fedmech_flwr.builtin.clients.scaffold",
           "scale = 1.0 / (self.steps * self.train.lr)",
           "scale = 1.0 / (self.steps // self.train.epochs * self.train.lr)",
           "wrong count", "K in c_i+ counts one epoch's steps, not the round's (issue 55)",
           (_node(DRIFT, "test_scaffold_client_at_two_epochs_divides_by_every_local_step"),)),
    Mutant("scaffold-correction-sign", "fedmech_flwr.builtin.clients.scaffold",
           "torch.tensor(c[name] - c_i[name], device=p.device)",
           "torch.tensor(c_i[name] - c[name], device=p.device)",
           "sign", "the gradient correction is c_i - c instead of c - c_i",
           (_node(DRIFT, "test_scaffold_client_takes_corrected_steps_and_updates_its_control_variate"),)),
    Mutant("scaffold-anchor-aliased", "fedmech_flwr.builtin.clients.scaffold",
           "self.anchor = {name: p.detach().clone() for name, p in params.items()}",
           "self.anchor = {name: p.detach() for name, p in params.items()}",
           "detached or aliased tensor", "x is a view of the live weights, so x - y is 0",
           (_node(DRIFT, "test_scaffold_client_takes_corrected_steps_and_updates_its_control_variate"),)),
    Mutant("scaffold-state-not-updated", "fedmech_flwr.builtin.clients.scaffold",
           "self.state = {name: v.astype(np.float32) for name, v in new.items()}",
           "self.state = {name: c_i[name].astype(np.float32) for name in new}",
           "state at the wrong time", "the client keeps its old c_i after uploading the new one's delta",
           (_node(DRIFT, "test_scaffold_client_takes_corrected_steps_and_updates_its_control_variate"),)),
    Mutant("scaffold-server-c-over-sampled", "fedmech_flwr.builtin.strategies.scaffold",
           "for d in deltas) / self.num_clients)",
           "for d in deltas) / len(deltas))",
           "wrong normaliser", "c moves by the mean of the sampled deltas, not by |S|/N of it",
           (_node(DRIFT, "test_scaffold_server_steps_the_model_and_updates_c"),)),
    # --- FedNova ---------------------------------------------------------------------------
    Mutant("fednova-a-norm-over-one-epoch", "fedmech_flwr.builtin.clients.fednova",
           "metrics[A_NORM] = a_norm(self.steps, self.train.momentum)",
           "metrics[A_NORM] = a_norm(self.steps // self.train.epochs, self.train.momentum)",
           "wrong count", "||a_i||_1 over one epoch's steps, not the round's (issue 55)",
           (_node(DRIFT, "test_fednova_a_norm_counts_every_local_step_of_the_round"),)),
    Mutant("fednova-steps-over-one-epoch", "fedmech_flwr.builtin.clients.fednova",
           "metrics[STEPS] = self.steps", "metrics[STEPS] = self.steps // self.train.epochs",
           "wrong count", "tau_i reported as one epoch's steps",
           (_node(DRIFT, "test_fednova_a_norm_counts_every_local_step_of_the_round"),)),
    Mutant("fednova-a-norm-without-momentum", "fedmech_flwr.builtin.clients.fednova",
           "metrics[A_NORM] = a_norm(self.steps, self.train.momentum)",
           "metrics[A_NORM] = float(self.steps)",
           "wrong normaliser", "||a_i||_1 taken as tau_i whatever the momentum",
           (_node(DRIFT, "test_fednova_client_reports_its_steps_and_a_norm"),)),
    Mutant("fednova-tau-eff-unweighted", "fedmech_flwr.builtin.strategies.fednova",
           "tau_eff = sum(p_i * a for p_i, a in zip(p, norms))",
           "tau_eff = sum(norms) / len(norms)",
           "wrong normaliser", "tau_eff is the plain mean of ||a_i||_1, not weighted by p_i",
           (_node(DRIFT, "test_fednova_normalises_the_updates_by_the_clients_steps"),)),
    Mutant("a-norm-geometric-shortcut", "fedmech_flwr.learning.training",
           "return (steps - momentum * (1 - momentum**steps) / (1 - momentum)) / (1 - momentum)",
           "return steps / (1 - momentum)",
           "wrong normaliser", "||a||_1 as tau / (1 - rho), momentum's long-run gain from the first step",
           (_node(DRIFT, "test_fednova_a_norm_of_momentum_sgd"),)),
    Mutant("optimiser-made-every-epoch", "fedmech_flwr.learning.training",
           "    for _ in range(cfg.epochs):\n        order = ",
           "    for _ in range(cfg.epochs):\n"
           "        optimizer = make_optimizer(model.parameters(), cfg)\n        order = ",
           "state at the wrong time", "a fresh optimiser (momentum at 0) every local epoch instead of every round",
           (_node(DRIFT, "test_fednova_a_norm_counts_every_local_step_of_the_round"),)),
    Mutant("batch-order-drawn-once", "fedmech_flwr.learning.training",
           "    for _ in range(cfg.epochs):\n        order = torch.randperm(n, generator=generator).to(x.device)\n",
           "    order = torch.randperm(n, generator=generator).to(x.device)\n    for _ in range(cfg.epochs):\n",
           "state at the wrong time", "every local epoch visits the samples in the first epoch's order",
           ("tests/test_benchmarks.py::test_scaffold_and_fednova_agree_with_niid_benchs_rules_written_independently"
            "[scaffold-train.momentum=0-2]",)),
    # --- FedDyn ----------------------------------------------------------------------------
    Mutant("feddyn-h-sign", "fedmech_flwr.builtin.clients.feddyn",
           "(self.h[name] - self.alpha * (p.detach() - self.anchor[name]))",
           "(self.h[name] + self.alpha * (p.detach() - self.anchor[name]))",
           "sign", "h_k <- h_k + alpha (theta_k - theta^{t-1})",
           (_node(DRIFT, "test_feddyn_client_minimises_the_dynamic_objective_and_updates_h"),)),
    Mutant("feddyn-anchor-aliased", "fedmech_flwr.builtin.clients.feddyn",
           "self.anchor = {name: p.detach().clone() for name, p in params.items()}",
           "self.anchor = {name: p.detach() for name, p in params.items()}",
           "detached or aliased tensor", "theta^{t-1} is a view of the live weights",
           (_node(DRIFT, "test_feddyn_client_minimises_the_dynamic_objective_and_updates_h"),)),
    Mutant("feddyn-server-h-over-participants", "fedmech_flwr.builtin.strategies.feddyn",
           "h_new = h - self.alpha * moved / self.num_clients",
           "h_new = h - self.alpha * moved / len(models)",
           "wrong normaliser", "h moves by the participants' mean, not by 1/m of the sum",
           (_node(DRIFT, "test_feddyn_server_updates_h_and_corrects_the_mean"),)),
    Mutant("feddyn-server-reads-stale-h", "fedmech_flwr.builtin.strategies.feddyn",
           "out[name] = (theta + moved / len(models) - h_new / self.alpha)",
           "out[name] = (theta + moved / len(models) - h / self.alpha)",
           "state at the wrong time", "theta^t corrected by h^{t-1} instead of h^t",
           (_node(DRIFT, "test_feddyn_server_updates_h_and_corrects_the_mean"),)),
    # --- FedProx ---------------------------------------------------------------------------
    Mutant("proximal-anchor-aliased", "fedmech_flwr.builtin.clients.proximal",
           "self.anchor = [p.detach().clone() for p in self.model.parameters()]",
           "self.anchor = [p.detach() for p in self.model.parameters()]",
           "detached or aliased tensor", "w_global is a view of the live weights: no proximal pull",
           (_node(DRIFT, "test_proximal_client_at_two_epochs_stays_anchored_at_the_global_model"),)),
    Mutant("proximal-mu-not-halved", "fedmech_flwr.builtin.clients.proximal",
           "0.5 * self.mu * proximal", "self.mu * proximal",
           "wrong normaliser", "mu ||w - w_global||^2 instead of (mu / 2) ||w - w_global||^2",
           (_node(CLIENTS, "test_proximal_loss_is_cross_entropy_plus_half_mu_squared_distance"),)),
    # --- MOON ------------------------------------------------------------------------------
    Mutant("moon-contrasts-the-live-model", "fedmech_flwr.builtin.clients.moon",
           "z_glob = self.global_model.forward_features(x)",
           "z_glob = self.model.forward_features(x)",
           "detached or aliased tensor", "z_glob from the model being trained, not the frozen global copy",
           (_node(REPRESENTATION, "test_moon_contrasts_with_the_frozen_global_model_after_the_live_one_moved"),)),
    Mutant("moon-pull-and-push-swapped", "fedmech_flwr.builtin.clients.moon",
           "model_contrastive_loss(z, z_glob, z_prev, self.params.temperature)",
           "model_contrastive_loss(z, z_prev, z_glob, self.params.temperature)",
           "sign", "pulled towards the previous local model and pushed from the global one",
           (_node(REPRESENTATION, "test_moon_contrasts_with_the_global_and_the_previous_model"),)),
    Mutant("moon-state-aliases-the-weights", "fedmech_flwr.builtin.clients.moon",
           "self.state = {k: np.array(w, copy=True) for k, w in zip(self.model.state_dict(), weights)}",
           "self.state = dict(zip(self.model.state_dict(), weights))",
           "detached or aliased tensor", "the previous model kept as views of the live weights",
           (_node(REPRESENTATION, "test_moon_first_round_is_cross_entropy_and_keeps_its_weights_as_state"),)),
    Mutant("moon-previous-is-the-global-model", "fedmech_flwr.builtin.clients.moon",
           "            load_model_arrays(self.previous, self.state)\n", "",
           "state at the wrong time", "the previous local model never loaded from the state (it is the global one)",
           (_node(REPRESENTATION, "test_moon_contrasts_with_the_global_and_the_previous_model"),)),
    # --- FedRS, FedLC, FedRoD, FedETF: class counts ----------------------------------------
    Mutant("fedrs-held-classes-from-the-batch", "fedmech_flwr.builtin.clients.fedrs",
           "restricted = restricted_logits(features, head.weight, head.bias, self.scale)",
           "restricted = restricted_logits(features, head.weight, head.bias, torch.where(torch.bincount("
           "y, minlength=self.data.num_classes) > 0, 1.0, self.params.alpha))",
           "batch vs shard statistics", "the held classes read from the batch, not the shard (issue 55)",
           (_node(COUNTS, "test_the_loss_reads_the_shards_class_counts_not_the_batchs"),)),
    Mutant("fedrs-scales-the-held-classes", "fedmech_flwr.builtin.clients.fedrs",
           "torch.where(held, 1.0, params.alpha)", "torch.where(held, params.alpha, 1.0)",
           "sign", "alpha damps the classes the client holds instead of the absent ones",
           (_node(REPRESENTATION, "test_fedrs_client_restricts_the_classes_it_does_not_hold"),)),
    Mutant("fedlc-counts-from-the-batch", "fedmech_flwr.builtin.clients.fedlc",
           "return super().loss(logits - self.shift.to(logits.device), y)",
           "return super().loss(logits - self.params.tau * torch.bincount(y, minlength=self.data.num_classes)"
           ".double().clamp_min(self.params.min_count).pow(-0.25).float(), y)",
           "batch vs shard statistics", "n_c counted in the batch, not the shard",
           (_node(COUNTS, "test_the_loss_reads_the_shards_class_counts_not_the_batchs"),)),
    Mutant("fedlc-shift-sign", "fedmech_flwr.builtin.clients.fedlc",
           "logits - self.shift.to(logits.device)", "logits + self.shift.to(logits.device)",
           "sign", "rare classes' logits raised instead of lowered",
           (_node(CLIENTS, "test_fedlc_loss_is_cross_entropy_of_count_shifted_logits"),)),
    Mutant("fedrod-balanced-softmax-from-the-batch", "fedmech_flwr.builtin.clients.fedrod",
           "return F.cross_entropy(logits + self.log_counts.to(logits.device), y)",
           "return F.cross_entropy(logits + torch.bincount(y, minlength=self.data.num_classes).double()"
           ".clamp_min(self.params.min_count).log().float(), y)",
           "batch vs shard statistics", "L_BSM's log n_c counted in the batch, not the shard",
           (_node(COUNTS, "test_the_loss_reads_the_shards_class_counts_not_the_batchs"),)),
    Mutant("fedrod-personal-head-on-its-own-logits", "fedmech_flwr.builtin.clients.fedrod",
           "personalised = logits.detach() + self.personal(features.detach())",
           "personalised = self.personal(features.detach())",
           "wrong objective", "the P-head trained alone, not as a residual on the generic logits",
           (_node(FEDROD, "test_the_personal_head_learns_a_residual_on_the_generic_logits"),)),
    Mutant("etf-log-counts-from-the-batch", "fedmech_flwr.builtin.clients.etf",
           "return self.loss(logits + self.shift.to(logits.device), y)",
           "return self.loss(logits + torch.bincount(y, minlength=self.data.num_classes).clamp_min(1).double()"
           ".log().float(), y)",
           "batch vs shard statistics", "the balanced loss's log n_c counted in the batch, not the shard",
           (_node(COUNTS, "test_the_loss_reads_the_shards_class_counts_not_the_batchs"),)),
    # --- FedETF, FedBABU: the fixed head ---------------------------------------------------
    Mutant("etf-head-trained", "fedmech_flwr.builtin.clients.etf",
           "self.model.get_classifier().requires_grad_(False)", "self.model.get_classifier().requires_grad_(True)",
           "detached or aliased tensor", "the ETF head left trainable on the client",
           (_node(REPRESENTATION, "test_fedetf_sends_and_keeps_the_etf_head"),)),
    Mutant("fedetf-aggregate-keeps-the-clients-heads", "fedmech_flwr.builtin.strategies.fedetf",
           "        return to_record({**from_record(arrays), **self.initial_head}), metrics",
           "        return arrays, metrics",
           "state at the wrong time", "the ETF put back when sending only, so the aggregate holds the mean head",
           (_node(REPRESENTATION, "test_fedetf_sends_and_keeps_the_etf_head"),)),
    Mutant("fedetf-round-0-under-the-random-head", "fedmech_flwr.app.run",
           "            initial = inputs.strategy.initial_model(initial)\n",
           "            pass\n",
           "state at the wrong time", "the ETF head put in place when round 1 is sent: round 0 has a random head",
           (_node(REPRESENTATION, "test_smoke_run_records_the_method_and_the_misalignment_diagnostic[etf]"),)),
    Mutant("fedbabu-head-trained", "fedmech_flwr.builtin.clients.fedbabu",
           "p.requires_grad_(False)", "p.requires_grad_(True)",
           "detached or aliased tensor", "the head left trainable on the client",
           (_node(CLIENTS, "test_fedbabu_client_trains_the_body_only"),)),
    # --- FedDecorr -------------------------------------------------------------------------
    Mutant("feddecorr-term-detached", "fedmech_flwr.builtin.clients.feddecorr",
           "decorr = decorrelation_loss(features)", "decorr = decorrelation_loss(features.detach())",
           "detached or aliased tensor", "L_decorr computed on detached features: recorded, never trained on",
           (_node(REPRESENTATION, "test_feddecorr_term_reaches_the_body"),)),
    # --- FedAvg and the server optimisers --------------------------------------------------
    Mutant("fedavg-weights-over-the-client-count", "fedmech_flwr.learning.arrays",
           "acc += arrays[name].astype(np.float64) * (w / total)",
           "acc += arrays[name].astype(np.float64) * (w / len(models))",
           "wrong normaliser", "each client's weight divided by the number of clients, not by the total",
           (_node(FEDAVG, "test_examples_weighting_equals_hand_computed_mean"),)),
    Mutant("fedavg-weighting-swapped", "fedmech_flwr.contracts.strategy",
           'if self.weighting == "uniform":', 'if self.weighting == "examples":',
           "wrong count", "weighted by examples when asked for uniform, and the reverse",
           (_node(FEDAVG, "test_uniform_weighting_equals_plain_mean"),)),
    Mutant("fedavgm-momentum-kept-on-pruned-weights", "fedmech_flwr.builtin.strategies.fedopt",
           "self.momentum_vector[i] = np.where(held[name], 0.0, self.momentum_vector[i])",
           "self.momentum_vector[i] = self.momentum_vector[i]",
           "state at the wrong time", "server momentum carried on a coordinate every client pruned",
           (_node(FEDROD, "test_a_server_optimiser_over_pruned_clients_keeps_fedavgs_zeros"),)),
)


# --- the plug-in ----------------------------------------------------------------------------

class _MutatedSource(importlib.machinery.SourceFileLoader):
    """Loads a module from its source with a mutant applied (never from a cached .pyc)."""

    mutant: Mutant

    def get_code(self, fullname: str):
        source = self.get_data(self.path).decode()
        code = compile(self.mutant.apply(source), self.path, "exec", dont_inherit=True)
        if marker := os.environ.get(ENV_MARKER):
            Path(marker).write_text("")
        return code


class MutantFinder(importlib.abc.MetaPathFinder):
    """Finds ``mutant.module`` as the path finder does, with ``_MutatedSource`` as its loader."""

    def __init__(self, mutant: Mutant) -> None:
        self.mutant = mutant

    def find_spec(self, fullname, path, target=None):
        if fullname != self.mutant.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            raise ImportError(f"mutant {self.mutant.name}: {fullname} is not a source module on its package's path")
        spec.loader = _MutatedSource(fullname, spec.origin)
        spec.loader.mutant = self.mutant
        return spec


def by_name(name: str) -> Mutant:
    found = [m for m in MUTANTS if m.name == name]
    if not found:
        raise KeyError(f"no semantic mutant named {name!r}; the catalogue holds {[m.name for m in MUTANTS]}")
    return found[0]


def pytest_load_initial_conftests(early_config, parser, args) -> None:
    """Under ``-p semantic_mutants`` with ``SEMANTIC_MUTANT`` set: that mutant's module is
    imported mutated (installed before pytest loads the conftest, which imports the core)."""
    if name := os.environ.get(ENV_NAME):
        mutant = by_name(name)
        if mutant.module in sys.modules:
            raise RuntimeError(f"mutant {name}: {mutant.module} was imported before the plug-in could mutate it")
        sys.meta_path.insert(0, MutantFinder(mutant))


def pytest_exception_interact(node, call, report) -> None:
    """Records the failing test's exception type after the marker."""
    marker = os.environ.get(ENV_MARKER)
    if marker and os.environ.get(ENV_NAME) and Path(marker).exists():
        with open(marker, "a") as out:
            out.write(call.excinfo.typename + "\n")


# --- the runner -----------------------------------------------------------------------------

def run_pytest(tests: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-p", "semantic_mutants", *tests], cwd=REPO, env=env, capture_output=True, text=True)


def verdict(mutant: Mutant, base: dict[str, str]) -> str:
    """killed (a named test failed an assertion), survived (they all passed), errored (a
    test raised something else: the mutant broke the code, not the rule, so it proves
    nothing) or not applied (no test imported the module: the tests cannot reach it)."""
    with tempfile.TemporaryDirectory() as tmp:
        marker = Path(tmp) / "applied"
        done = run_pytest(list(mutant.killed_by), {**base, ENV_NAME: mutant.name, ENV_MARKER: str(marker)})
        if not marker.exists():
            return "not applied"
        raised = set(marker.read_text().split())
    if done.returncode == 0:
        return "survived"
    return "killed" if raised and raised <= FAILED_CHECK else "errored"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="print the catalogue and stop")
    args = parser.parse_args(argv)
    mutants = [by_name(n) for n in args.only] if args.only else list(MUTANTS)
    if args.list:
        for m in mutants:
            print(f"{m.name:44} {m.kind:28} {m.bug}")
        return 0
    base = {k: v for k, v in os.environ.items() if k not in (ENV_NAME, ENV_MARKER, "PYTEST_ADDOPTS")}
    base["PYTHONPATH"] = os.pathsep.join([str(REPO / "benchmarks"), *filter(None, [base.get("PYTHONPATH")])])
    start = time.perf_counter()
    tests = sorted({t for m in mutants for t in m.killed_by})
    baseline = run_pytest(tests, base)
    if baseline.returncode != 0:
        print(f"the {len(tests)} named tests fail on the unchanged source; fix them first:\n{baseline.stdout[-3000:]}")
        return 1
    print(f"baseline: the {len(tests)} named tests pass on the unchanged source")
    results = {}
    for mutant in mutants:
        results[mutant.name] = verdict(mutant, base)
        print(f"{results[mutant.name]:12} {mutant.name:44} {mutant.kind}", flush=True)
    killed = sum(v == "killed" for v in results.values())
    print(f"{killed} of {len(mutants)} semantic mutants killed in {time.perf_counter() - start:.0f} s")
    return 0 if killed == len(mutants) else 1


if __name__ == "__main__":
    sys.exit(main())
