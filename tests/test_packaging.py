"""zeropp installs as a library: its core dependencies are what it imports, its version is one
everywhere, a subcommand names the extra it needs, and the built wheel, installed into a fresh
virtual environment with nothing else from the repository, runs the README's plain loop."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

import zeropp
from zeropp.tools import extras

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_one_version_everywhere() -> None:
    """pyproject's version, ``zeropp.__version__`` and the CHANGELOG's newest heading agree."""
    newest = re.search(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE).group(1)
    assert PYPROJECT["project"]["version"] == zeropp.__version__ == newest


def test_the_core_is_what_the_library_imports() -> None:
    """No plotting or progress bars in a training job's environment: torch, numpy, safetensors."""
    names = [re.split(r"[<>=;\[ ]", requirement)[0] for requirement in PYPROJECT["project"]["dependencies"]]
    assert names == ["torch", "numpy", "safetensors"]
    assert {"matplotlib>=3.7", "tqdm>=4.60"} == set(PYPROJECT["project"]["optional-dependencies"]["tools"])
    library = [path for path in (ROOT / "src" / "zeropp").rglob("*.py") if "tools" not in path.parts]
    imports = re.compile(r"^\s*(?:import|from) (matplotlib|tqdm)\b", re.MULTILINE)
    assert [str(path) for path in library if imports.search(path.read_text())] == []


def test_extras_take_ranges_and_the_constraints_pin_them() -> None:
    """Every extra's requirement of a third-party package is a range (``==`` lives in
    constraints.txt, which pins each of them)."""
    pinned = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                  if line and not line.startswith("#"))
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items():
        for requirement in requirements:
            assert "==" not in requirement, (extra, requirement)
            name = re.split(r"[<>=;\[ ]", requirement)[0]
            if name not in ("zeropp", "llama-cpp-python"):
                assert name in pinned, (extra, name)


def test_a_subcommand_names_the_extra_it_needs(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as stopped:
        extras.require("zeropp demo", "tools", "matplotlib", "tqdm")
    assert str(stopped.value) == "zeropp demo needs matplotlib, which the 'tools' extra installs: pip install " \
                                 "'zeropp[tools]'"
    extras.require("zeropp demo", "tools", "tqdm")  # present: nothing happens


PREAMBLE = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.blocks, self.head = nn.Embedding(16, 32), nn.ModuleList(Block() for _ in range(2)), None

    def forward(self, x, y):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        logits = h @ self.embed.weight.t()
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


torch.manual_seed(0)
model = TinyLM()
loader = [(torch.randint(0, 16, (2, 8)), torch.randint(0, 16, (2, 8))) for _ in range(3)]
'''


def readme_plain_loop() -> str:
    """The README's plain-loop example, for 2 ranks on one node (hpZ over its 2 ranks)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"\*\*A plain FSDP2 loop\.\*\*.*?```python\n(.*?)```", text, re.DOTALL).group(1)
    assert "hpz_partition_size=8" in block
    return PREAMBLE + block.replace("hpz_partition_size=8", "hpz_partition_size=2") + \
        '\nprint("README loop done", loss.item())\n'


@pytest.mark.slow
def test_the_wheel_installs_alone_and_runs_the_readme_loop(tmp_path: pathlib.Path) -> None:
    """``pip wheel`` the project, install the wheel into a fresh virtual environment whose only
    other package is torch, and run the README's plain loop under torchrun on 2 gloo ranks from
    outside the repository. torch (with what it requires) is this environment's, put on the new
    one's path: pip finds it installed, and unpacking its 800 MB again would take most of the
    test's time; the rest of zeropp's dependencies come from the package index."""
    quiet = ["--quiet", "--disable-pip-version-check"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", *quiet, "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True)
    wheel, = (tmp_path / "dist").glob("zeropp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "zeropp/py.typed" in names and "zeropp/codes/native_codec.c" in names
    assert not any(name.startswith("tests/") for name in names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (pathlib.Path(site) / "torch-of-the-test.pth").write_text(str(_link_distributions("torch", tmp_path / "torch")))
    subprocess.run([str(python), "-m", "ensurepip", "--default-pip"], check=True, capture_output=True)
    subprocess.run([str(python), "-m", "pip", "install", *quiet, str(wheel)], check=True)
    installed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], check=True,
                               capture_output=True, text=True).stdout
    assert re.search(rf"^torch=={re.escape(_torch_version())}\b", installed, re.MULTILINE), installed
    assert "matplotlib" not in installed and "tqdm" not in installed
    script = tmp_path / "run" / "train.py"
    script.parent.mkdir()
    script.write_text(readme_plain_loop())
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    run = subprocess.run([str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], cwd=script.parent, capture_output=True, text=True, timeout=600,
                         env={**env, "OMP_NUM_THREADS": "1", "ZEROPP_RANKS_PER_NODE": "2"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("README loop done") == 2
    assert (script.parent / "final" / "model.safetensors").exists()
    imported = subprocess.run([str(python), "-c", "import zeropp; print(zeropp.__file__)"], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout
    assert str(venv) in imported and str(ROOT) not in imported


def _link_distributions(name: str, folder: pathlib.Path) -> pathlib.Path:
    """``folder`` with a link to each top-level file and package of the installed distribution
    ``name`` and of every distribution it requires (without extras), as a path entry."""
    from importlib import metadata

    from packaging.requirements import Requirement

    folder.mkdir()
    pending, seen = [name], set()
    while pending:
        distribution = metadata.distribution(pending.pop())
        key = distribution.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        tops = {pathlib.PurePath(file).parts[0] for file in distribution.files or () if ".." not in str(file)}
        for top in tops - {"__pycache__"}:
            if not (folder / top).exists():
                (folder / top).symlink_to(distribution.locate_file(top))
        for text in distribution.requires or ():
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return folder


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]
