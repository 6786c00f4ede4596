"""Experiment config: every bad value names key, value and what is allowed; overrides;
the JSON round trip the ClientApp depends on; the registry's rules."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from conftest import REPO, SMOKE, smoke_config
from fedmech_flwr.contracts import plugins
from fedmech_flwr.foundation.errors import ConfigError, DataNotFoundError, brief
from fedmech_flwr.foundation.registry import Registry, loading
from fedmech_flwr.foundation.typed import to_plain
from fedmech_flwr.spec.config import apply_overrides, experiment_from_json, override, read_yaml
from fedmech_flwr.spec.experiment import load_experiment, parse_experiment

LOC = "experiments/smoke.yaml: "


def raw_smoke() -> dict:
    return yaml.safe_load(SMOKE.read_text())


def config_error(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        smoke_config(list(overrides))
    return info.value


# --- known answers: a valid file --------------------------------------------------------

def _leaves(tree, prefix=""):
    """Every scalar of a nested dict/list as (dotted path, value)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else None
    if items is None:
        return {prefix: tree}
    return {k: v for key, sub in items for k, v in _leaves(sub, f"{prefix}{key}.").items()}


def test_every_file_value_reaches_the_config_and_the_rest_are_defaults(smoke_cfg):
    """The smoke file's values are kept as written (nothing dropped, renamed or moved) and
    every key it leaves out holds its documented default."""
    written, resolved = _leaves(raw_smoke()), _leaves(to_plain(smoke_cfg))
    assert {k: resolved.get(k) for k in written} == written
    defaults = {k: v for k, v in resolved.items() if k not in written}
    assert defaults["federation.on_client_failure."] == "fail" and defaults["train.max_samples_per_round."] is None
    assert defaults["data.dataset.channels."] == 1 and defaults["diagnostics.0.per_layer."] is True
    assert smoke_cfg.diagnostics[0].due(1) and smoke_cfg.diagnostics[0].due(2)


def test_float_written_1e_minus_3_is_accepted():
    # YAML 1.1 reads a bare 1e-3 as a string; it must still become a float.
    assert yaml.safe_load("lr: 1e-3")["lr"] == "1e-3"
    assert smoke_config(["train.lr=1e-3"]).train.lr == pytest.approx(0.001)
    raw = raw_smoke()
    raw["train"]["lr"] = "1e-3"
    assert parse_experiment(raw, "x").train.lr == 0.001


# --- each bad value fails with key, value and what is allowed ---------------------------

def test_unknown_top_level_key_lists_allowed_keys():
    err = config_error("learning_rate=0.1")
    assert "unknown key(s) ['learning_rate']" in str(err)
    for key in ("data", "federation", "model", "seed", "train", "diagnostics"):
        assert key in err.message.split("allowed keys:")[1]
    assert err.where.endswith("experiments/smoke.yaml:")


def test_unknown_key_inside_plugin_params():
    err = config_error("model.chanels=[4, 8]")
    assert "unknown key(s) ['chanels']" in str(err)
    assert "allowed keys: channels" in str(err)
    assert err.where.endswith(LOC + "model")


def test_wrong_type_names_key_and_value():
    err = config_error("federation.num_rounds=x")
    assert "expected an integer, got 'x'" in str(err)
    assert err.where.endswith(LOC + "federation.num_rounds")


@pytest.mark.parametrize(
    ("override", "message", "key"),
    [
        ("train.lr=0", "lr must be > 0.0, got 0", "train.lr"),
        ("data.partition.alpha=-1", "alpha must be > 0, got -1", "data.partition.alpha"),
        ("train.momentum=1", "momentum must be < 1.0, got 1", "train.momentum"),
        ("federation.num_clients=0", "num_clients must be >= 1, got 0", "federation.num_clients"),
        ("pruning.target_sparsity=1.0", "target_sparsity must be < 1.0, got 1.0", "pruning.target_sparsity"),
        ("data.dataset.num_classes=1", "num_classes must be >= 2, got 1", "data.dataset.num_classes"),
    ],
)
def test_out_of_range(override, message, key):
    err = config_error(override)
    assert message in str(err)
    assert f"{LOC}{key}" in str(err)


@pytest.mark.parametrize(
    ("override", "message", "key"),
    [
        ("federation.num_rounds=99999999999999999999999",
         "num_rounds must be <= 100000, got 99999999999999999999999 (allowed: >= 1, <= 100000)",
         "federation.num_rounds"),
        ("train.lr=.inf", "lr must be a finite number > 0.0, got inf", "train.lr"),
        ("train.lr=.nan", "lr must be a finite number > 0.0, got nan", "train.lr"),
        ("data.partition.alpha=.inf", "alpha must be a finite number > 0, got inf", "data.partition.alpha"),
        ("federation.round_timeout_s=-.inf", "round_timeout_s must be a finite number > 0.0, got -inf",
         "federation.round_timeout_s"),
        ("seed=99999999999999999999999", "seed must be an integer that fits in 64 bits", "seed"),
        ("model.channels=[4, 99999999999999999999999]", "channels must be an integer that fits in 64 bits",
         "model.channels"),
        ("data.dataset.image_size=100000", "image_size must be <= 4096, got 100000 (allowed: >= 4, <= 4096)",
         "data.dataset.image_size"),
    ],
)
def test_nonsense_sizes_and_non_finite_numbers_are_refused_in_one_line(override, message, key, recwarn):
    """A size, count or rate no machine could run, and .inf/.nan anywhere, are refused at
    their key in one line, with no NumPy warning before it."""
    err = config_error(override)
    assert message in str(err) and str(err).endswith(f"{LOC}{key}") and "\n" not in str(err)
    assert not recwarn.list


def test_memory_beyond_the_machine_is_refused_before_anything_is_allocated(monkeypatch):
    """The estimate (data, model, replies and batches, on the server and every client
    process) is checked against the memory available before the model or data exist."""
    from fedmech_flwr.spec import experiment

    cfg = smoke_config()
    need, parts = experiment.memory_needed(cfg, experiment.dataset_info("synthetic", cfg.data.dataset.params),
                                           experiment.new_model(cfg, _Shape(1, 4, 12)))
    assert 400 * 144 * 4 < need < 2**30 and "the data" in parts
    monkeypatch.setattr(experiment, "memory_available_gib", lambda: (need - 1) / 2**30)
    err = config_error()
    assert err.message.startswith("this experiment needs about") and "MemAvailable" in err.message
    assert err.where.endswith(f"{LOC}data.dataset")
    monkeypatch.setattr(experiment, "memory_available_gib", lambda: need / 2**30)
    assert smoke_config().name == "smoke"
    monkeypatch.undo()
    err = config_error("data.dataset.image_size=4096", "data.dataset.num_train=1000000")
    assert "this experiment needs about" in err.message


@dataclasses.dataclass
class _Shape:
    in_channels: int
    num_classes: int
    image_size: int


def test_alpha_message_and_location_exactly():
    err = config_error("data.partition.alpha=-1")
    assert err.message.startswith("alpha must be > 0, got -1")
    assert str(err).endswith("experiments/smoke.yaml: data.partition.alpha")


def test_bad_literal_lists_choices():
    err = config_error("device=tpu")
    assert "got 'tpu'; choose one of 'auto', 'cpu', 'cuda'" in str(err)
    assert err.where.endswith(LOC + "device")
    err = config_error("federation.on_client_failure=retry")
    assert "'fail', 'continue'" in str(err) and "retry" in str(err)


def test_unknown_model_suggests_closest():
    err = config_error("model.name=simple_cnm")
    assert "unknown model 'simple_cnm'" in str(err)
    assert "did you mean 'simple_cnn'?" in str(err)
    assert "resnet10, simple_cnn" in str(err)
    assert err.where.endswith(LOC + "model.name")


def test_unknown_strategy_and_diagnostic_names():
    assert "unknown strategy 'fedavgg'; did you mean 'fedavg'?" in str(config_error("strategy.name=fedavgg"))
    err = config_error("diagnostics=[{name: weight_divergance}]")
    assert "did you mean 'weight_divergence'?" in str(err)
    assert err.where.endswith(LOC + "diagnostics[0].name")


def test_diagnostic_every_must_be_positive_int():
    err = config_error("diagnostics=[{name: weight_divergence, every: 0}]")
    assert "every must be an integer >= 1, got 0" in str(err)
    assert err.where.endswith(LOC + "diagnostics[0].every")


def test_diagnostic_rounds_run_after_exactly_those_rounds():
    spec = smoke_config(["diagnostics=[{name: weight_divergence, rounds: [2, 1]}]"]).diagnostics[0]
    assert [r for r in range(1, 6) if spec.due(r)] == [1, 2]
    assert spec.to_plain()["rounds"] == [1, 2] and "every" not in spec.to_plain()
    for bad, says in [("rounds: []", "non-empty list"), ("rounds: [0]", "non-empty list"),
                      ("rounds: [true]", "non-empty list"), ("rounds: [1, 1]", "lists a round twice"),
                      ("rounds: [1], every: 2", "either every or rounds")]:
        err = config_error(f"diagnostics=[{{name: weight_divergence, {bad}}}]")
        assert says in str(err), bad
        assert (LOC + "diagnostics[0]") in err.where


def test_diagnostic_rounds_after_the_last_round_are_refused():
    err = config_error("diagnostics=[{name: weight_divergence, rounds: [1, 9]}]")
    assert "rounds [9] come after the last round (2) and would never run" in str(err)
    assert err.where.endswith(LOC + "diagnostics[0].rounds")


@pytest.mark.parametrize("section", ["data", "model", "client", "strategy", "name"])
def test_missing_required_section(section):
    raw = raw_smoke()
    del raw[section]
    with pytest.raises(ConfigError, match=f"missing required key '{section}' in x.yaml: {section}$"):
        parse_experiment(raw, "x.yaml")


def test_missing_component_name_lists_choices():
    raw = raw_smoke()
    raw["data"]["partition"] = {"alpha": 0.5}
    with pytest.raises(ConfigError, match="'name' key \\(one of: class_map, classes_per_client, dirichlet, iid\\)"):
        parse_experiment(raw, "x.yaml")


def test_clients_per_round_above_num_clients():
    err = config_error("federation.clients_per_round=4")
    assert "clients_per_round (4) must be <= num_clients (3)" in str(err)
    assert err.where.endswith(LOC + "federation.clients_per_round")
    assert smoke_config(["federation.clients_per_round=3"]).federation.clients_per_round == 3


def test_min_replies_above_sampled():
    err = config_error("federation.clients_per_round=2", "federation.min_replies=3")
    assert "min_replies (3) must be <= the clients sampled per round (2)" in str(err)


def test_relative_output_root_rejected():
    err = config_error("output_root=runs")
    assert "output_root must be absolute or start with '~', got 'runs'" in str(err)
    assert err.where.endswith(LOC + "output_root")
    assert smoke_config(["output_root=/tmp/runs"]).output_root == "/tmp/runs"
    assert smoke_config(["output_root=~/runs"]).output_root == "~/runs"


@pytest.mark.parametrize("name", ["../escaped", "/tmp/abs", "runs/a", ".hidden", "..", "", "a b", "x" * 201, 12,
                                  "-A1", "-x", "--help"])
def test_run_name_that_is_not_a_slug_is_rejected(name):
    """A leading '-' too: the name is an option to a command it is passed to, and a
    formula in a spreadsheet's cell."""
    err = config_error(override("name", name))
    assert str(err).startswith(
        f"name must be letters, digits, '.', '_' or '-' (starting with a letter, a digit or '_', at most 200 "
        f"characters), got {brief(name)}: it names the run folder inside the output root"
    )
    assert err.where.endswith(LOC + "name")


@pytest.mark.parametrize("name", ["smoke", "paper-v2-fmnist_cnn_a0.05_s0", "run_1.v2", "_x", "x-", "x" * 200])
def test_run_name_slug_is_accepted(name):
    assert smoke_config([override("name", name)]).name == name


@pytest.mark.parametrize(("item", "key", "shown"), [
    ('name="a\\e]0;x\\a"', "name", "'a\\x1b]0;x\\x07'"),
    ('output_root="~/runs\\nforged"', "output_root", "'~/runs\\nforged'"),
    ('data.dataset.name="syn\\u202ethetic"', "data.dataset.name", "'syn\\u202ethetic'"),
    ('plugins=["my_lab\\tx"]', "plugins[0]", "'my_lab\\tx'"),
    ('diagnostics=[{name: misalignment, "ev\\x9bry": 1}]', "diagnostics[0].ev\\x9bry", "'ev\\x9bry'"),
])
def test_a_control_character_anywhere_in_the_config_is_refused_naming_the_key(item, key, shown):
    """Written as a YAML escape (a raw one never gets past the YAML reader): it would reach
    folder names, the console and the report as an instruction, not as text."""
    err = config_error(item)
    assert str(err).startswith(f"got {shown}, which holds the control character ")
    assert err.where.endswith(LOC + key) and "\n" not in str(err)


EXPERIMENT_FILES = sorted(p for p in [*REPO.glob("experiments/*.yaml"), *REPO.glob("experiments/paper/*.yaml")]
                          if "name" in read_yaml(p))


@pytest.mark.parametrize("path", EXPERIMENT_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_experiment_and_sweep_cell_validates(path):
    """Names included: a sweep names each cell ``<name>-<labels>_s<seed>``. Validation
    reads each dataset's labels: a machine without the dataset skips, saying which."""
    from fedmech_flwr.tools.sweep import load_sweep

    plugins.load()
    try:
        if "base" in read_yaml(path):
            load_sweep(path)
        else:
            load_experiment(path)
    except ConfigError as err:
        if isinstance(err.__cause__, DataNotFoundError):
            pytest.skip(str(err).splitlines()[0])
        raise


@pytest.mark.parametrize("address", ["auto", "127.0.0.1:6379", "head-node.cluster:10001"])
def test_ray_address_accepts_auto_and_host_port(address):
    assert smoke_config([f"simulation.ray_address={address}"]).simulation.ray_address == address
    assert smoke_config().simulation.ray_address is None


def test_ray_address_rejects_other_forms():
    err = config_error("simulation.ray_address=ray://head:10001")
    assert "ray_address must be 'auto', HOST:PORT" in str(err) and "got 'ray://head:10001'" in str(err)
    assert err.where.endswith(LOC + "simulation.ray_address")


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="experiment file not found"):
        read_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse YAML"):
        load_experiment(bad)


# --- overrides --------------------------------------------------------------------------

def test_apply_overrides_nested_and_yaml_parsed():
    raw = {"a": {"b": 1}, "keep": "me"}
    out = apply_overrides(raw, ["a.b=2", "a.c.d=[1, 2]", "flag=yes", "text=x=y", "none=null"])
    assert out == {"a": {"b": 2, "c": {"d": [1, 2]}}, "keep": "me", "flag": True, "text": "x=y", "none": None}
    assert raw == {"a": {"b": 1}, "keep": "me"}  # the input is not modified


def test_override_without_equals_errors():
    with pytest.raises(ConfigError, match="expected key=value, got 'federation.num_rounds' in --set"):
        apply_overrides({}, ["federation.num_rounds"])


def test_override_through_a_scalar_errors():
    with pytest.raises(ConfigError, match="cannot set 'seed.x': 'seed' is not a mapping"):
        apply_overrides({"seed": 0}, ["seed.x=1"])


def test_override_into_an_empty_yaml_section(tmp_path):
    # ``federation:`` with nothing under it is YAML null, which the config reads as {}.
    text = SMOKE.read_text().replace("federation: {num_clients: 3, num_rounds: 2}", "federation:")
    assert "federation:\n" in text
    path = tmp_path / "x.yaml"
    path.write_text(text)
    assert load_experiment(path).federation.num_rounds == 5  # the default
    assert load_experiment(path, ["federation.num_rounds=2"]).federation.num_rounds == 2


def test_overrides_reach_the_config():
    cfg = smoke_config(["federation.num_rounds=7", "data.partition={name: iid}", "train.optimizer=sgd"])
    assert cfg.federation.num_rounds == 7
    assert cfg.data.partition.name == "iid"
    assert cfg.train.optimizer == "sgd"


# --- round trip: the config the ServerApp sends to clients ------------------------------

def test_json_round_trip_equals_original(smoke_cfg):
    again = parse_experiment(json.loads(smoke_cfg.to_json()), "x")
    assert again.to_plain() == smoke_cfg.to_plain()
    assert again == smoke_cfg
    assert experiment_from_json(smoke_cfg.to_json()) == smoke_cfg


def test_json_round_trip_with_int_keyed_mapping():
    # class_map's {client: [classes]} has int keys, which JSON turns into strings; the
    # ClientApp rebuilds the config from that JSON, so it must parse back identically.
    cfg = smoke_config(["data.partition={name: class_map, classes: {0: [0], 1: [1], 2: [2, 3]}}"])
    assert cfg.data.partition.params.classes == {0: [0], 1: [1], 2: [2, 3]}
    again = experiment_from_json(cfg.to_json())
    assert again.data.partition.params.classes == {0: [0], 1: [1], 2: [2, 3]}
    assert again.to_plain() == cfg.to_plain()


def test_yaml_round_trip_of_resolved_config(smoke_cfg):
    text = yaml.safe_dump(smoke_cfg.to_plain(), sort_keys=False)
    assert parse_experiment(yaml.safe_load(text), "config.yaml") == smoke_cfg


# --- registry ---------------------------------------------------------------------------

def test_duplicate_registration_raises_naming_both_origins():
    reg = Registry("widget")
    reg.register("a")(lambda: 1)
    assert reg.get("a").origin == f"{__name__} (built-in)"  # the module registering, outside any plug-in loading
    with loading("entry point 'w' of widgets 1.0"), pytest.raises(ConfigError) as info:
        reg.register("a")(lambda: 2)
    assert str(info.value) == (f"widget 'a' is already registered by {__name__} (built-in); {__name__} (entry point "
                               "'w' of widgets 1.0) registers it again: rename one of them")
    assert reg.get("a").factory() == 1
    with loading("x.yaml: plugins[0]"):
        reg.register("b")(lambda: 3)
    assert reg.get("b").origin == f"{__name__} (x.yaml: plugins[0])"


def test_registry_get_unknown_lists_names():
    reg = Registry("widget")
    for name in ("gamma", "alpha", "beta"):
        reg.register(name)(lambda: None)
    assert reg.names() == ["alpha", "beta", "gamma"]
    with pytest.raises(ConfigError) as info:
        reg.get("zzz", "f.yaml: widget")
    assert "unknown widget 'zzz'" in str(info.value)
    assert "registered: alpha, beta, gamma" in str(info.value)
    assert "did you mean" not in str(info.value)
    assert info.value.where == "f.yaml: widget"
    with pytest.raises(ConfigError, match="did you mean 'alpha'"):
        reg.get("alpah")


def test_registry_entry_default_config_has_no_params():
    reg = Registry("widget")
    reg.register("x")(lambda: None)
    from fedmech_flwr.foundation.typed import parse_dataclass

    assert dataclasses.fields(parse_dataclass(reg.get("x").config_cls, {}, "w")) == ()
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['p'\]; allowed keys: \(none\)"):
        parse_dataclass(reg.get("x").config_cls, {"p": 1}, "w")
