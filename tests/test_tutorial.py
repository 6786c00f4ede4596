"""docs/tutorials/first_strategy.md runs as written: its fenced blocks, in order, in a fresh folder.

The convention (the doc states it at its end):

- a ```bash block is commands, run with ``bash -euo pipefail``; exports and the working
  folder carry from one block to the next, as in one terminal. ``fedmech`` and ``python``
  are the ones of the interpreter running the tests (its bin folder first on PATH);
- a ```python or ```yaml block whose first line is ``# file: PATH`` is a file, PATH relative
  to the folder: a new one (it must not exist yet), ``# file: PATH (replace)`` a new text
  for a file an earlier step wrote, ``# file: PATH (append)`` added to the end of one (both
  must exist, so a misnamed file fails);
- ``<!-- test: dry-run -->`` on the line before a bash block: its ``fedmech`` commands run
  with ``--dry-run`` (the full-size sweep: every cell validated, none run; skipped when
  Fashion-MNIST is not on this machine);
- ``<!-- test: output -->`` on the line before a ```text block: its text must appear in the
  output of the bash block before it (what the reader is told to expect);
  ``<!-- test: in PATH -->``: in the file PATH (relative to the folder) as the steps so
  far left it. Both compare line by line, exactly but for what a rerun changes (durations,
  a run folder's time stamp, a path's start written ``.../``; see ``conftest.shows``); a
  line ``...`` stands for lines left out. A tutorial shows no output it does not check.

The fast tests check the convention and the runner; the integration test runs the page at
its smoke size (one ``fedmech run`` and the sweep's ``smoke`` preset: 4 two-round cells,
each its own ``flwr run``): 320 s measured on 2 busy cores, most of it Flower's and Ray's
start per run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, fenced_blocks, shows
from fedmech_flwr.datasets.data import DEBIAN_FASHION_MNIST

DOC = REPO / "docs" / "tutorials" / "first_strategy.md"
FILE = re.compile(r"^# file: (\S+)(?: \((replace|append)\))?$")
MARKER = re.compile(r"^<!-- test: (.*?) -->$")
MARKERS = {"dry-run": "bash", "output": "text", "in": "text"}
"""Marker (its first word) -> the language of the block it may precede."""
SHOWN = {"text"}
"""Fence languages that are output, checked by their marker."""


class TutorialError(AssertionError):
    """A block that is malformed, or failed."""


@dataclass
class Block:
    language: str
    text: str
    line: int
    """The line of its opening fence (1-based)."""
    marker: str | None = None

    @property
    def where(self) -> str:
        return f"the {self.language or 'unlabelled'} block at line {self.line}"

    def target(self) -> tuple[str, str]:
        """(path, mode) of a file block: mode is new, replace or append."""
        first = self.text.split("\n", 1)[0]
        match = FILE.match(first)
        if not match:
            raise TutorialError(f"{self.where} must start with '# file: PATH' (or 'PATH (replace)', 'PATH (append)'), "
                                f"got {first!r}")
        path = match.group(1)
        if Path(path).is_absolute() or ".." in Path(path).parts:
            raise TutorialError(f"{self.where}: {path} must be relative to the tutorial's folder")
        return path, match.group(2) or "new"


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, with the marker comment just before each."""
    try:
        found = fenced_blocks(text)
    except ValueError as err:
        raise TutorialError(str(err)) from None
    return [Block(language, body, line, m.group(1) if (m := MARKER.match(previous)) else None)
            for language, body, line, previous in found]


def check(block: Block) -> None:
    """A block is run, written or shown, and says which."""
    kind = block.marker.split(" ", 1)[0] if block.marker else None
    if kind is not None and MARKERS.get(kind) != block.language:
        raise TutorialError(f"{block.where}: unknown marker {block.marker!r} before a {block.language} block (known: "
                            + ", ".join(f"{m} before a {lang} block" for m, lang in MARKERS.items()) + ")")
    if block.language in SHOWN and kind not in ("output", "in"):
        raise TutorialError(f"{block.where} is an example output that nothing checks: put <!-- test: output --> "
                            "(the bash block before it printed it) or <!-- test: in PATH --> (a file holds it) "
                            "on the line before it")
    if block.language in ("python", "yaml"):
        block.target()
    elif block.language != "bash" and block.language not in SHOWN:
        raise TutorialError(f"{block.where}: a block is bash (run), python or yaml with '# file:' (written) or "
                            f"{'/'.join(sorted(SHOWN))} (output, checked), got {block.language or 'no language'!r}")


def write(block: Block, folder: Path) -> None:
    path, mode = block.target()
    target = folder / path
    body = block.text.split("\n", 1)[1]
    if mode == "new":
        if target.exists():
            raise TutorialError(f"{block.where} writes a new {path}, which exists already")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body)
    elif not target.is_file():
        raise TutorialError(f"{block.where} changes {path} ({mode}), which no earlier step wrote")
    elif mode == "replace":
        target.write_text(body)
    else:
        target.write_text(target.read_text().rstrip("\n") + "\n\n" + body)


def run_bash(block: Block, folder: Path, env: dict[str, str], timeout: float) -> str:
    """Run the block in bash in the working folder and with the exports the previous block
    left (kept in folder/.tutorial-state); return its output."""
    state = folder / ".tutorial-state"
    state.mkdir(exist_ok=True)
    env_file, cwd_file = state / "env.sh", state / "cwd"
    prelude = [f"cd {shlex.quote(cwd_file.read_text().strip() if cwd_file.exists() else str(folder))}"]
    if env_file.exists():
        prelude.append(f"source {shlex.quote(str(env_file))}")
    if block.marker == "dry-run":
        prelude.append('fedmech() { command fedmech "$@" --dry-run; }')
    script = "\n".join([*prelude, "set -euo pipefail", block.text,
                        f"export -p > {shlex.quote(str(env_file))}", f"pwd > {shlex.quote(str(cwd_file))}"])
    proc = subprocess.Popen(["bash", "--noprofile", "--norc", "-c", script], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # a sweep or run stops every process it started
        output, _ = proc.communicate()
        raise TutorialError(f"{block.where} ran over {timeout:.0f} s:\n{block.text}--- output (end) ---\n"
                            f"{output[-4000:]}") from None
    if proc.returncode != 0:
        raise TutorialError(f"{block.where} exited {proc.returncode}:\n{block.text}"
                            f"--- output (end) ---\n{output[-4000:]}")
    return output


def terminal() -> dict[str, str]:
    """The environment of a terminal where this project's venv is active."""
    return {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def run_page(text: str, folder: Path, env: dict[str, str] | None = None, timeout: float = 900,
             skip: set[str] = frozenset(), log=print) -> dict[int, str]:
    """Every block of ``text`` in order in ``folder``; blocks whose marker is in ``skip``
    are left out. Returns each run bash block's output by line."""
    env = env or terminal()
    found = blocks(text)
    for block in found:
        check(block)
    outputs, last = {}, None
    for block in found:
        if block.marker == "output":
            if last is None:
                raise TutorialError(f"{block.where} is the output of a bash block, but none ran before it")
            if not shows(block.text, outputs[last]):
                raise TutorialError(f"{block.where} is not in the output of the block at line {last}:\n"
                                    f"{block.text}--- output ---\n{outputs[last][-4000:]}")
            continue
        if block.marker and block.marker.startswith("in "):
            path = folder / block.marker[3:]
            text = path.read_text() if path.is_file() else "(no such file)"
            if not shows(block.text, text):
                near = text.find(block.text.split("\n", 1)[0][:20])  # where the file has its first line, if anywhere
                raise TutorialError(f"{block.where} is not in {block.marker[3:]}:\n{block.text}--- file ---\n"
                                    f"{text[max(near, 0):][:4000]}")
            continue
        if block.language in SHOWN:
            continue
        if block.marker in skip:
            log(f"line {block.line}: skipped ({block.marker})")
            continue
        start = time.monotonic()
        if block.language == "bash":
            outputs[block.line] = run_bash(block, folder, env, timeout)
            last = block.line
        else:
            write(block, folder)
        log(f"line {block.line}: {block.language} {time.monotonic() - start:.1f} s")
    return outputs


# --- the convention and the runner --------------------------------------------------------


def test_every_block_of_the_page_is_run_written_or_shown():
    found = blocks(DOC.read_text())
    for block in found:
        check(block)
    kinds = [b.language for b in found]
    assert kinds.count("bash") >= 5 and "python" in kinds and "yaml" in kinds
    dry = [b for b in found if b.marker == "dry-run"]
    commands = [line for b in dry for line in b.text.splitlines() if line.strip() and not line.startswith("#")]
    assert commands and all(c.startswith("fedmech sweep ") for c in commands), "dry-run: fedmech sweep commands only"


def test_exports_and_the_working_folder_carry_between_blocks(tmp_path):
    page = ("```bash\nexport GREETING=hello\nmkdir -p lab && cd lab\n```\n\n"
            "```yaml\n# file: lab/x.yaml\na: 1\n```\n\n"
            "```bash\ntest \"$GREETING\" = hello && test \"$(basename \"$PWD\")\" = lab && cat x.yaml\n```\n"
            "<!-- test: output -->\n```text\na: 1\n```\n")
    run_page(page, tmp_path, log=lambda _: None)


def test_every_example_output_of_the_tutorials_is_checked():
    """first_strategy.md's by this file's runner, first-run.md's by tests/test_flwr_run.py."""
    for page in sorted((REPO / "docs" / "tutorials").glob("*.md")):
        shown = [b for b in blocks(page.read_text()) if b.language in SHOWN]
        assert shown, page
        for block in shown:
            check(block)


@pytest.mark.parametrize(("printed", "expected"), [
    ("round 1/2 | accuracy 57.0% | 8.0s | ETA 1m12s\n", True),  # durations may differ
    ("round 1/2 | accuracy 58.0% | 1.2s | ETA 1s\n", False),  # a measured number may not
    ("before\nround 1/2 | accuracy 57.0% | 1.2s | ETA 1s\nafter\n", True),
    ("round 1/2 | accuracy 57.0% | 1.2s | ETA 1s | new column\n", False),  # whole lines
    ("xround 1/2 | accuracy 57.0% | 1.2s | ETA 1s\n", False),
])
def test_an_example_output_matches_exactly_but_for_durations(printed, expected):
    assert shows("round 1/2 | accuracy 57.0% | 1.2s | ETA 1s\n", printed) is expected


def test_an_example_output_may_leave_lines_out_and_shorten_paths():
    shown = "start in .../runs/smoke-20261205-101500\n...\nend\n"
    assert shows(shown, "start in /tmp/x/runs/smoke-20261207-200651\nround 1\nround 2\nend\n")
    assert shows(shown, "start in /tmp/x/runs/smoke-20261207-200651\nend")
    assert not shows(shown, "end\nstart in /tmp/x/runs/smoke-20261207-200651\n")  # in order
    assert not shows(shown, "start in /tmp/x/logs/smoke-20261207-200651\nend\n")


def test_an_example_output_in_a_file_is_checked_against_the_file(tmp_path):
    page = "```bash\nprintf 'a 1.0s\\nb\\n' > out.txt\n```\n<!-- test: in out.txt -->\n```text\na 2.5s\nb\n```\n"
    run_page(page, tmp_path, log=lambda _: None)
    (tmp_path / "again").mkdir()
    with pytest.raises(TutorialError, match="the text block at line 5 is not in out.txt"):
        run_page(page.replace("b\n```\n", "c\n```\n"), tmp_path / "again", log=lambda _: None)


@pytest.mark.parametrize(("page", "message"), [
    ("```bash\ntrue\nfalse\necho never\n```\n", "the bash block at line 1 exited 1"),
    ("```bash\nfedmech nwe strategy x\n```\n", "the bash block at line 1 exited 2"),
    ("```python\n# file: lab/x.py (replace)\nx = 1\n```\n", "changes lab/x.py (replace), which no earlier step wrote"),
    ("```python\n# file: x.py (append)\nx = 1\n```\n", "changes x.py (append), which no earlier step wrote"),
    ("```yaml\n# file: x.yaml\na: 1\n```\n```yaml\n# file: x.yaml\na: 2\n```\n", "writes a new x.yaml, which exists"),
    ("```python\nprint('where does this go?')\n```\n", "must start with '# file: PATH'"),
    ("```sh\nls\n```\n", "got 'sh'"),
    ("<!-- test: skip -->\n```bash\nls\n```\n", "unknown marker 'skip'"),
    ("<!-- test: output -->\n```bash\nls\n```\n", "unknown marker 'output' before a bash block"),
    ("```bash\necho hello\n```\n<!-- test: output -->\n```text\nhullo\n```\n",
     "the text block at line 5 is not in the output of the block at line 1"),
    ("```bash\nls\n", "the block at line 1 is never closed"),
    ("```bash\necho hello\n```\n```text\nhello\n```\n", "the text block at line 4 is an example output that nothing"),
    ("```bash\ntrue\n```\n<!-- test: in nowhere.txt -->\n```text\nhello\n```\n", "is not in nowhere.txt"),
])
def test_a_wrong_block_fails_naming_its_line(tmp_path, page, message):
    with pytest.raises(TutorialError, match=re.escape(message)):
        run_page(page, tmp_path, log=lambda _: None)


def test_a_block_that_runs_too_long_is_stopped_with_what_it_started(tmp_path):
    page = "```bash\nsleep 60 &\necho $! > child\nwait\n```\n"
    with pytest.raises(TutorialError, match="the bash block at line 1 ran over 2 s"):
        run_page(page, tmp_path, timeout=2, log=lambda _: None)
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and running(child):
        time.sleep(0.05)
    assert not running(child)


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- the page, at smoke size --------------------------------------------------------------


@pytest.mark.integration
def test_the_tutorial_runs_as_written(tmp_path):
    """``fedmech new``, the edited strategy and its test, a diagnostic of one's own whose
    declared metric the run's page shows, one run, the smoke sweep against FedAvg with the
    IID control, the report and the misalignment table."""
    start = time.monotonic()
    skip = set() if DEBIAN_FASHION_MNIST.is_dir() else {"dry-run"}
    outputs = run_page(DOC.read_text(), tmp_path, skip=skip)
    print(f"the tutorial ran in {time.monotonic() - start:.0f} s")
    text = "\n".join(outputs.values())
    assert "2 passed" in text  # the written test, and the one the page adds
    label = re.search(r'Metric\("([^"]+)"', (tmp_path / "my_lab" / "global_norm.py").read_text()).group(1)
    [run] = (tmp_path / "my_runs").glob("trimmed_mean-*")
    for page in ("report.md", "index.html"):  # the page the run wrote, as the tutorial says
        assert label in (run / "report" / page).read_text(), f"{label!r} is not in {run}/report/{page}"
    assert "## global_norm\n" in (run / "report" / "report.md").read_text()
    assert re.search(rf"round 2/2 \|.* {re.escape(label)} [0-9.]+ \|", text)  # the run's round line (headline)
    assert "4 of 4 cell(s) run now completed" in text
    summary = json.loads((tmp_path / "my_runs" / "compare-smoke" / "report" / "summary.json").read_text())
    assert [(g["group"], g["completed"]) for g in summary["groups"]] == [
        ("iid_fedavg", 1), ("iid_trimmed_mean", 1), ("a0.05_fedavg", 1), ("a0.05_trimmed_mean", 1)]
    assert all("misalignment.gaps.probe" in g["stats"] for g in summary["groups"])
    assert "gap beyond IID" in text  # the misalignment table found each skewed run's IID control
