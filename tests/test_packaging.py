"""Packaging: callbacks/ and kernels/ ship inside uma_lightning, from an editable install and a wheel."""

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
from suite import REPO

PACKAGE_DIRS = {
    "uma_lightning": "uma_lightning",
    "uma_lightning.callbacks": "callbacks",
    "uma_lightning.kernels": "kernels",
}


def declared_packages() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def test_every_source_package_is_declared():
    expected = set()
    for package, folder in PACKAGE_DIRS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder).parts
            expected.add(".".join((package, *relative)))
    missing = expected - set(declared_packages())
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


@pytest.mark.slow  # a new interpreter
def test_callbacks_and_kernels_are_not_top_level_modules():
    # A top-level `kernels` may be installed: the distribution transformers (the hf extra) depends on.
    code = (
        "import importlib.util, uma_lightning.callbacks, uma_lightning.kernels;"
        "assert importlib.util.find_spec('callbacks') is None;"
        "kernels = importlib.util.find_spec('kernels');"
        "print(uma_lightning.callbacks.__file__);"
        "print(kernels.origin if kernels else '')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True).stdout
    callbacks, kernels = out.splitlines()
    assert Path(callbacks).parent == REPO / "callbacks"
    assert not kernels or Path(kernels).parent != REPO / "kernels"


@pytest.mark.slow  # a new interpreter
def test_models_import_neither_lightning_nor_distributed_and_the_cli_not_mlflow():
    # What importing loads, transitively, not what the source says. `import torch` itself loads the
    # process-group basics of torch.distributed; DTensor, FSDP and tensor parallelism come with plans.
    # Policy, which reads sharded checkpoints, needs torch's checkpoint reader but not Lightning.
    # The CLI and the callbacks import MLflow (0.8 s) only when a run logs to it.
    code = (
        "import sys, json; loaded = lambda prefixes: sorted(m for m in sys.modules if m.startswith(prefixes));"
        "import uma_lightning.models; models = loaded(('torch.distributed.tensor', 'torch.distributed.fsdp', 'uma_lightning.parallel', 'lightning', 'mlflow'));"
        "import uma_lightning.policy; policy = loaded(('lightning', 'pytorch_lightning', 'mlflow', 'uma_lightning.parallel'));"
        "import uma_lightning.cli, uma_lightning.callbacks; print(json.dumps([models, policy, loaded(('mlflow',))]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    models, policy, cli = json.loads(out)
    assert models == [], f"import uma_lightning.models loads {models}"
    assert policy == [], f"import uma_lightning.policy loads {policy}"
    assert cli == [], f"import uma_lightning.cli loads {cli}"


@pytest.mark.slow
def test_built_wheel_ships_and_imports_callbacks_kernels_and_configs(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("uma_lightning-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "uma_lightning/callbacks/throughput.py" in names
    assert "uma_lightning/kernels/attention.py" in names
    shipped_configs = {
        f"uma_lightning/configs/{path.relative_to(REPO / 'configs')}"
        for path in (REPO / "configs").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert shipped_configs - set(names) == set()  # every fragment and launch template, each folder of configs/
    assert not any(n.startswith(("callbacks/", "kernels/", "configs/")) for n in names)
    # Import from the unpacked wheel alone, with the repository out of the way.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import uma_lightning.callbacks as c, uma_lightning.kernels as k, uma_lightning.models as m;"
        "print(c.__file__); print(k.__file__); print(m.load_size('small').dim)"
    )
    # -S skips site-packages' .pth files, so the editable install's path finder is not active;
    # the dependencies (torch, lightning...) are still importable from site-packages itself.
    search_path = [str(site)] + [p for p in sys.path if p.endswith("site-packages")]
    out = subprocess.run(
        [sys.executable, "-S", "-c", f"import sys; sys.path[:0] = {search_path!r}; {code}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    callbacks_file, kernels_file, small_dim = out.stdout.split()
    assert Path(callbacks_file).is_relative_to(site) and Path(kernels_file).is_relative_to(site)
    assert small_dim == "768"


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^(pip install -e \"\.\[dev[^\n]*pytest[^\n]*)$", readme, flags=re.M)
    assert len(commands) == 1, "the README shows exactly one test command"
    assert commands[0] in (REPO / ".ci" / "run").read_text().splitlines()
