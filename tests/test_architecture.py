"""The package's shape: its layers (the import-linter contracts in pyproject.toml), module and function sizes,
and what importing a layer pulls in."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("normlab", "hydra_plugins")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# The training step reads top to bottom, one phase after another (STYLE: it may be longer).
LONG_FUNCTIONS_ALLOWED: set[str] = set()


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the project in `cwd` (its pyproject.toml and its normlab), without import-linter's cache."""
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    env = {"PYTHONPATH": str(cwd), "PATH": str(Path(sys.executable).parent), "HOME": str(cwd)}
    return subprocess.run([exe, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "broken" not in result.stdout.lower().split("contracts:")[-1].split("kept")[0]


@pytest.mark.parametrize("module, wrong", [
    ("normlab/config/__init__.py", "import normlab.train.run"),  # the schema importing the training loop
    ("normlab/nn/model.py", "import wandb"),  # the model knowing of wandb
    ("normlab/analysis/__init__.py", "import normlab.nn.model"),  # analysis reading the model
    ("normlab/launch/launcher.py", "import normlab.launch.app"),  # the launcher<->app cycle, back again
])
def test_a_wrong_import_breaks_a_contract(tmp_path, module, wrong):
    for name in (*PACKAGES, "pyproject.toml"):
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, tmp_path / name)
    with open(tmp_path / module, "a") as fh:
        fh.write(f"\n{wrong}  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout, result.stdout[-2000:]


def _modules() -> list[tuple[str, Path]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found.append((".".join(path.relative_to(ROOT).with_suffix("").parts), path))
    return found


def test_no_module_is_longer_than_the_limit():
    long = {name: n for name, path in _modules() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_longer_than_the_limit():
    long = {}
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and f"{name}.{node.name}" not in LONG_FUNCTIONS_ALLOWED:
                    long[f"{name}.{node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return set(out.split())


def test_the_training_layer_loads_neither_hydra_nor_matplotlib():
    loaded = _loaded_after("import normlab.train.run")
    assert "torch" in loaded  # the check can see a heavy import
    assert not {"hydra", "omegaconf", "matplotlib", "wandb"} & loaded


def test_the_public_api_loads_on_first_use():
    assert not {"torch", "matplotlib", "hydra"} & _loaded_after("import normlab")
    import normlab
    from normlab.analysis import load_runs
    from normlab.analysis.compare import compare
    from normlab.config import RunConfig
    from normlab.train.api import train_run

    assert (normlab.RunConfig, normlab.train_run, normlab.load_runs, normlab.compare) == (RunConfig, train_run, load_runs, compare)
    assert set(normlab.__all__) <= set(dir(normlab))
    with pytest.raises(AttributeError):
        normlab.no_such_name


def test_every_package_is_installed():
    """pyproject.toml lists the packages a (non-editable) install ships: every folder of normlab's code is one."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for package in PACKAGES for p in (ROOT / package).rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
