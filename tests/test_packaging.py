"""weir installs one top-level import name, ``weir``: the repository's folders (engine/, kernels/,
worker/, jobs/, migrations/) become ``weir.engine`` and so on, and modules of the user's own with
those names change nothing."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import zipfile

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setuptools_table() -> dict:
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _package_folders() -> dict[str, str]:
    """Every folder with an ``__init__.py`` under a mapped folder, by its installed dotted name."""
    found = {}
    for name, folder in _setuptools_table()["package-dir"].items():
        root = os.path.join(REPO_ROOT, folder)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, root)
                found[name if rel == "." else name + "." + rel.replace(os.sep, ".")] = dirpath
    return found


def test_every_package_folder_is_declared():
    table = _setuptools_table()
    assert set(table["packages"]) == set(_package_folders())
    assert all(name == "weir" or name.startswith("weir.") for name in table["package-dir"])


def test_wheel_installs_only_weir(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), REPO_ROOT],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("weir-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"weir", next(t for t in tops if t.endswith(".dist-info"))}
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["weir"]
    # every source file of every mapped folder is in the wheel, migrations' revisions included
    expected = set()
    for name, folder in _setuptools_table()["package-dir"].items():
        root = os.path.join(REPO_ROOT, folder)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if f.endswith((".py", ".mako", ".toml")):
                    rel = os.path.relpath(os.path.join(dirpath, f), root)
                    expected.add("/".join([*name.split("."), *rel.split(os.sep)]))
    assert expected - set(names) == set()
    assert "weir/migrations/versions/20261130_0001_initial.py" in names
    assert "weir/jobs/catalog/specs/flipkart.toml" in names  # the shipped job specs


def test_installed_distribution_exposes_only_weir():
    # the installed one (a source checkout also holds a weir.egg-info, found first from its root)
    dist = next(d for d in importlib.metadata.distributions(name="weir") if d.read_text("WHEEL") is not None)
    files = [str(f) for f in dist.files or []]
    finders = [f for f in files if f.startswith("__editable__") and f.endswith("_finder.py")]
    if finders:  # editable install (pip install -e): setuptools' finder maps names to folders
        namespace: dict = {}
        with open(dist.locate_file(finders[0])) as f:
            exec(compile(f.read(), finders[0], "exec"), namespace)
        assert namespace["MAPPING"]
        assert all(name == "weir" or name.startswith("weir.") for name in namespace["MAPPING"])
        assert not namespace["NAMESPACES"]
    else:
        tops = {f.split("/", 1)[0] for f in files if not f.startswith(("weir-", "../"))}
        assert tops <= {"weir"}


SHADOWS = ("engine", "worker", "jobs", "kernels", "migrations", "bench")


@pytest.fixture
def shadowed_cwd(tmp_path):
    """A working directory with the user's own ``engine.py``, ``worker.py``, ... that fail on import."""
    for name in SHADOWS:
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return tmp_path, env


def test_own_modules_in_the_working_directory_change_nothing(shadowed_cwd):
    cwd, env = shadowed_cwd
    code = (
        "import sys\n"
        "from weir import SamplingParams\n"
        "from weir.jobs import GenerateRequest, ClassifyRequest\n"
        "assert 'torch' not in sys.modules, 'from weir import SamplingParams pulled torch'\n"
        "from weir.jobs import Client\n"
        "from weir import LLM\n"
        "import weir.worker.app, weir.worker.tasks, weir.kernels, weir.migrations, weir.engine.llm_engine\n"
        f"assert not set(sys.modules) & {set(SHADOWS)!r}, set(sys.modules) & {set(SHADOWS)!r}\n"
        "print(LLM.__module__, Client.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["weir.engine.llm", "weir.jobs.client"]

    cli = subprocess.run([sys.executable, "-m", "weir", "--help"], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    celery = subprocess.run([sys.executable, "-m", "celery", "-A", "weir.worker.app", "report"], cwd=cwd,
                            env=env, capture_output=True, text=True, timeout=120)
    assert celery.returncode == 0, celery.stderr
    assert "weir.run_job" in celery.stdout or "celery:" in celery.stdout


def test_the_repository_root_on_sys_path_does_not_shadow_an_installed_kernels_distribution():
    # python -m pytest and python -c from a checkout put its root on sys.path, where kernels/ is
    # found as `kernels` before the distribution of that name transformers (5.25 on) imports
    code = (
        "import importlib.metadata, sys\n"
        "import transformers.activations\n"
        "import weir.kernels\n"
        "try:\n"
        "    importlib.metadata.distribution('kernels')\n"
        "except importlib.metadata.PackageNotFoundError:\n"
        "    installed = False\n"
        "else:\n"
        "    installed = True\n"
        "try:\n"
        "    import kernels\n"
        "except ImportError as e:\n"
        "    print('refused', installed, e)\n"
        "else:\n"
        "    print('distribution' if kernels.__file__ != weir.kernels.__file__ else 'folder', installed)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] in (["distribution", "True"], ["refused", "False"]), out.stdout


APPLICATIONS = ("weir.jobs.openai_batch", "weir.jobs.catalog")
"""Packages that meet the core only through its seams (the entry-point groups of
:mod:`weir.jobs.applications`); the core imports none of them."""


def _imported_names(path: str, package: str) -> set[str]:
    """Every module name ``path`` imports (absolute, relative ones resolved against ``package``),
    at any depth of the file (function-level imports count)."""
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def core_imports_of_applications() -> list[str]:
    """``file: imported name`` for every core module that imports an application."""
    found = []
    for package, folder in _package_folders().items():
        if package.startswith(APPLICATIONS):
            continue
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for imported in sorted(_imported_names(path, package)):
                if any(imported == app or imported.startswith(app + ".") for app in APPLICATIONS):
                    found.append(f"{os.path.relpath(path, REPO_ROOT)}: {imported}")
    return found


def test_the_core_imports_no_application():
    assert core_imports_of_applications() == []


def test_the_application_check_sees_an_import_of_one(tmp_path, monkeypatch):
    # the check itself can fail: a core module that imports the application is named
    folder = tmp_path / "jobs"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "client.py").write_text("def f():\n    from weir.jobs import openai_batch\n")
    monkeypatch.setattr(sys.modules[__name__], "_package_folders", lambda: {"weir.jobs": str(folder)})
    assert core_imports_of_applications() == [f"{os.path.relpath(folder / 'client.py', REPO_ROOT)}: weir.jobs.openai_batch"]


def _module_files() -> dict[str, str]:
    """Every installed module's file, by its dotted name."""
    files = {}
    for package, folder in _package_folders().items():
        for name in os.listdir(folder):
            if name.endswith(".py"):
                files[package if name == "__init__.py" else f"{package}.{name[:-3]}"] = os.path.join(folder, name)
    return files


def import_cycles(files: dict[str, str]) -> list[list[str]]:
    """The cycles of the graph of module-level imports between ``files`` (dotted name -> path;
    imports inside functions are taken when called, so they close no cycle at import time):
    each strongly connected component of more than one module, sorted."""
    import ast

    graph = {}
    for module, path in files.items():
        package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        with open(path, encoding="utf-8") as f:
            body = ast.parse(f.read(), path).body
        nodes = [n for node in body for n in ([node] + (node.body if isinstance(node, ast.If) else []))]
        names = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                    + ([node.module] if node.module else []))
                names.add(base)
                names.update(f"{base}.{alias.name}" for alias in node.names)
        graph[module] = sorted(n for n in names if n in files and n != module)
    order, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return sorted(cycles)


def test_the_module_level_import_graph_has_no_cycle(tmp_path):
    assert import_cycles(_module_files()) == []
    # the check can fail: two modules importing each other at module level are a cycle
    (tmp_path / "a.py").write_text("from weir.x import b\n")
    (tmp_path / "b.py").write_text("import weir.x.a\n")
    assert import_cycles({"weir.x.a": str(tmp_path / "a.py"), "weir.x.b": str(tmp_path / "b.py")}) == [
        ["weir.x.a", "weir.x.b"]]
