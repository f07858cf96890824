"""Every command the README shows, read from the README itself and run as a user would, shortened.

A README line is run as written, in a workspace of its own (a folder with the project's
``recipes/`` and ``examples/``, so the recipes' relative paths resolve and ``runs/`` is the
workspace's), with three kinds of change, each spelled out here:

- ``tether train`` gets ``SHORT`` appended: two batches, a five-step warm start when a model is
  built on first use, a small held-out set, and ``--run-dir`` under a name the other lines can
  refer to;
- placeholders become real paths (``PLACEHOLDERS``: ``runs/demo-<time>`` is the demo run the
  first line trained; ``my.yaml`` and ``my_family.py`` are a recipe for the contextual-bandit
  family the test suite defines as a plug-in);
- the Makefile targets the README names run their recipe lines (``$(VENV)`` being this one); a
  target whose one line is a README line word for word (``make demo``) is checked on that line's
  run rather than training the same thing twice.

A README line this module cannot classify is an error, so a new command cannot go untested.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BANDIT = ROOT / "tests" / "plugins" / "bandit.py"

SHORT = ["train.num_batches=2", "--plain", "--no-report"]
"""What every ``tether train`` line gets: its schedule is two batches; no plots at the end
(``tether report`` is a line of its own)."""

SMALL_EVAL = {  # per family: a small held-out set, and a model built on first use warm-starts briefly
    "text": ["data.num_eval=16", "warmstart.max_steps=5"],
    # some episodes succeed: something to learn (16 chats a step: 64, the default, takes 3× as long)
    "agent": ["data.num_eval=16", "warmstart.max_steps=60", "warmstart.batch_size=16",
              "warmstart.eval_every=60"],
    "flow": ["data.num_eval=32", "warmstart.max_steps=5"],
}
WARM = {  # recipes whose task the family's short warm start leaves at no reward at all, or slow
    # (a recipe's own eval_every of 5 is twelve held-out evaluations in 60 steps)
    "longtail.yaml": ["warmstart.max_steps=60", "warmstart.batch_size=16", "warmstart.eval_every=60"],
    "agent-tools.yaml": ["warmstart.max_steps=60", "warmstart.batch_size=4", "warmstart.eval_every=60"],
}
RECIPE_SHORTENING = {  # a recipe's other overrides for its short run
    "flow-sd3.yaml": ["flow.init_vae_steps=20"],  # the model build's VAE steps
    # 60 warm-start steps at script_quality 0.4 answer 0 without the tools, so every group's reward
    # would be equal: the chats that all call them
    "agent-tools.yaml": ["env.script_quality=1.0"],
}

PLACEHOLDERS = {"runs/demo-<time>": "runs/demo", "runs/sync": "runs/sync", "my.yaml": "my.yaml"}


@dataclass(frozen=True)
class Command:
    """One README line: the environment whose ``tether`` it calls, its words, and its comment."""

    venv: str  # ".venv", ".venv-vllm", or "make"
    words: tuple[str, ...]
    comment: str

    @property
    def id(self) -> str:
        return " ".join(self.words)[:90]


def readme_commands(readme: Path = ROOT / "README.md") -> list[Command]:
    """Every line of the README's shell blocks that runs ``tether`` or ``make``."""
    out: list[Command] = []
    in_block = False
    for line in readme.read_text().splitlines():
        if line.startswith("```"):
            in_block = line.strip() in ("```bash", "```sh", "```shell")
            continue
        if not in_block or not line.strip():
            continue
        text, _, comment = line.partition("  #")
        text = text.split(" # ")[0].strip()
        words = shlex.split(text)
        head = words[0]
        if head in (".venv/bin/tether", ".venv-vllm/bin/tether"):
            out.append(Command(head.split("/")[0], tuple(words[1:]), comment.strip()))
        elif head == "make":
            out.append(Command("make", tuple(words[1:]), comment.strip()))
        else:
            raise AssertionError(f"README line {line!r}: not a tether or make command; tests/readme.py "
                                 "cannot run it (teach it, or put the line in a block that is not bash)")
    return out


def make_lines(target: str, makefile: Path = ROOT / "Makefile") -> list[str]:
    """The recipe lines of a Makefile target (tab-indented lines under ``target:``)."""
    lines, inside = [], False
    for line in makefile.read_text().splitlines():
        if re.match(rf"^{re.escape(target)}\s*:", line):
            inside = True
            continue
        if inside:
            if line.startswith("\t"):
                lines.append(line[1:])
            elif line.strip():
                break
    if not lines:
        raise AssertionError(f"the Makefile has no recipe for target {target!r}")
    return lines


@dataclass
class Workspace:
    """A folder to run README lines in, with the project's recipes and examples beside ``runs/``."""

    root: Path
    bin_dir: Path = field(default_factory=lambda: Path(sys.executable).parent)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for name in ("recipes", "examples", "tests"):
            link = self.root / name
            if not link.exists():
                link.symlink_to(ROOT / name)
        (self.root / "my.yaml").write_text("\n".join([
            "model:", "  family: bandit", "  path: runs/models/bandit", "  create_if_missing: true",
            "data:", "  task: arms", "  num_train: 200", "  num_eval: 16",
            "rollout:", "  batch_size: 4", "  group_size: 8",
            "train:", "  num_batches: 20", "  lr: 0.1", "  kl_coef: 0.0", ""]))

    def tether(self, venv: str) -> str:
        exe = self.bin_dir / "tether"
        if not exe.exists():
            raise AssertionError(f"no tether console script beside {sys.executable} ({venv})")
        return str(exe)

    def argv(self, cmd: Command, run_name: str | None = None) -> list[str]:
        """The words to run for a ``tether`` line: placeholders replaced, ``train`` shortened."""
        words = [self.placeholder(w) for w in cmd.words]
        if words and words[0] == "train":
            words += SHORT + self.small_eval(words)
            if "--resume" not in words:
                words += ["--run-dir", f"runs/{run_name or self.run_name(words)}"]
            else:  # a finished two-batch run continues to a third
                words[words.index("train.num_batches=2")] = "train.num_batches=3"
        elif words[:1] == ["warmstart"]:
            words += self.small_eval(words)
        elif words[:1] == ["sweep"]:  # two values of the first key, one seed, runs of two batches
            at = words.index("--set") + 1
            key, _, values = words[at].partition("=")
            words[at] = f"{key}={','.join(values.split(',')[:2])}"
            if "--seeds" in words:
                words[words.index("--seeds") + 1] = "1"
            words += ["train.num_batches=2", *self.small_eval(words), "--out", "runs/sweep"]
        return [self.tether(cmd.venv), *words]

    def placeholder(self, word: str) -> str:
        word = word.replace("my_family.py", str(BANDIT))
        for old, new in PLACEHOLDERS.items():
            if word == old:
                return new
        return word

    def run_name(self, words: list[str]) -> str:
        """``runs/<name>`` of a train line: its recipe's stem, then its overrides, readable."""
        recipe = next((w for w in words[1:] if w.endswith(".yaml")), "run")
        name = Path(recipe).stem
        shortening = {*SHORT, *(w for ws in (*SMALL_EVAL.values(), *RECIPE_SHORTENING.values()) for w in ws)}
        rest = [w for w in words[1:] if "=" in w and w not in shortening and not w.startswith("warmstart.")]
        if rest:
            name += "-" + "-".join(re.sub(r"[^A-Za-z0-9]+", "_", w) for w in rest)
        return name[:100]

    def small_eval(self, words: list[str]) -> list[str]:
        recipe = next((w for w in words if w.endswith(".yaml")), None)
        if recipe is None:
            return []
        text = (self.root / recipe).read_text()
        family = re.search(r"^\s*family:\s*(\w+)", text, re.M)
        words = SMALL_EVAL.get(family.group(1) if family else "text", [])
        warm = WARM.get(Path(recipe).name)
        if warm:
            words = [w for w in words if not w.startswith("warmstart.")] + warm
        return words + RECIPE_SHORTENING.get(Path(recipe).name, [])

    def run(self, argv: list[str], *, shell: bool = False) -> subprocess.CompletedProcess:
        out = subprocess.run(argv, cwd=self.root, capture_output=True, text=True, timeout=self.timeout_s,
                             shell=shell, executable="/bin/bash" if shell else None)
        shown = argv if shell else shlex.join(argv)
        if out.returncode != 0:
            raise AssertionError(f"`{shown}` exited with {out.returncode}:\n{out.stdout[-2000:]}\n"
                                 f"{out.stderr[-4000:]}")
        # a process ended before its exit handlers ran leaves named semaphores to multiprocessing's
        # resource tracker, which unlinks them and warns the user of a leak
        leaks = [line for line in out.stderr.splitlines() if "resource_tracker" in line]
        assert not leaks, f"`{shown}` left resources to the resource tracker: {leaks}"
        return out

    def run_make(self, target: str) -> list[subprocess.CompletedProcess]:
        """A Makefile target's recipe lines, ``$(VENV)`` this environment, ``tether train`` shortened."""
        results = []
        for line in make_lines(target):
            line = line.replace("$(VENV)/bin/python", sys.executable)
            line = line.replace("$(VENV)/bin/", f"{self.bin_dir}/")
            if "$(" in line:
                raise AssertionError(f"make {target}: cannot run {line!r} here (an unknown make variable)")
            if re.search(r"/tether train ", line):
                words = shlex.split(line)
                words += [*SHORT, *self.small_eval(words), "--run-dir", f"runs/make-{target}"]
                line = shlex.join(words)
            results.append(self.run(line, shell=True))
        return results

    def clean_runs(self) -> None:
        shutil.rmtree(self.root / "runs", ignore_errors=True)
