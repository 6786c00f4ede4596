"""Known answers of the strict YAML loader that every config, sweep and values file goes
through (``fedmech_flwr.foundation.yaml_text``)."""

from __future__ import annotations

import pytest

from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.foundation.safe_text import CONTROL
from fedmech_flwr.foundation.yaml_text import MAX_NODES, load_yaml, read_yaml_file


def test_plain_yaml_and_merges_load_as_pyyaml_loads_them():
    text = "base: &b {lr: 0.1, epochs: 2}\nrun:\n  <<: *b\n  lr: 0.01\nempty:\n"
    assert load_yaml(text, "x") == {"base": {"lr": 0.1, "epochs": 2}, "run": {"lr": 0.01, "epochs": 2}, "empty": None}
    assert load_yaml("", "x") is None


@pytest.mark.parametrize(("text", "message"), [
    ("a: 1\nb:\n  c: 1\n  d: 2\n  c: 3\n", "key 'c' appears twice, on line 3 and on line 5"),
    ("{a: 1, a: 2}", "key 'a' appears twice, on line 1 and on line 1"),
    ("1: x\n1: y\n", "key 1 appears twice, on line 1 and on line 2"),
    ("a: &a [*a]\n", f"aliases expand to more than {MAX_NODES:,} nodes"),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
     "e: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n", f"aliases expand to more than {MAX_NODES:,} nodes"),
    ("a: " + "[" * 3000 + "]" * 3000, "nested too deeply"),
    ("a: [1, 2\n", "cannot parse YAML: "),
])
def test_what_a_config_cannot_mean_is_one_error_naming_the_source(text, message):
    with pytest.raises(ConfigError) as err:
        load_yaml(text, "exp.yaml")
    assert message in str(err.value) and str(err.value).endswith("in exp.yaml") and "\n" not in str(err.value)


@pytest.mark.parametrize(("text", "message"), [
    ("a: 1\nname: x\x1b]0;t\x07\n", "character '\\x1b' (U+001B) on line 2, column 8 is not allowed in YAML text"),
    ("name: \"\x07\"", "character '\\x07' (U+0007) on line 1, column 8"),
    ("a: \x9b2J", "character '\\x9b' (U+009B) on line 1, column 4"),
])
def test_a_raw_control_character_is_one_line_that_shows_it_escaped(text, message):
    """PyYAML refuses it before parsing, with a traceback; here it is named where it is."""
    with pytest.raises(ConfigError) as err:
        load_yaml(text, "exp.yaml")
    assert message in str(err.value) and str(err.value).endswith("in exp.yaml")
    assert not CONTROL.search(str(err.value))


def test_ten_thousand_aliased_nodes_are_fine():
    text = "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n" \
           "c: [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
    assert len(load_yaml(text, "x")["c"]) == 10


def test_bytes_that_are_not_utf8_are_named_by_offset(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_bytes("name: caf\u00e9\nseed: 0\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"not UTF-8 text: byte 9 \(0xe9\) cannot be decoded; save the file as "
                                          r"UTF-8 in .*exp\.yaml$"):
        read_yaml_file(path)
