"""Mutation testing of the guard modules with cosmic-ray (https://cosmic-ray.readthedocs.io).

The guards behind README "Guarantees": claims, leases and the fenced result write
(``jobs/claims.py``, ``jobs/results.py``), the sweeper (``jobs/sweeper.py`` and its read in
``jobs/outbox.py``), group
commit (``worker/group_commit.py``) and the delivery settings (``worker/app.py``). Each target
names the functions mutated (all of a module when None) and the tests that cover them; cosmic-ray
mutates one operator at a time **in the files on disk**, runs the tests (``pytest -x``), and
records whether they failed (killed) or passed (survived).

Outside CI (an hour or more on 2 cores). Run it in a clone of its own, never in a checkout you
work in, with the clone installed in a virtual environment of its own (an editable install of the
clone into the Python you work with would point ``weir`` at the mutated files)::

    git clone -q . /tmp/weir-mutation && cd /tmp/weir-mutation
    python -m venv --system-site-packages .venv && .venv/bin/pip install -e ".[mutation]"
    .venv/bin/python -m tests.mutation [--target app|claims|sweeper_read|group_commit|sweeper] [--timeout-s 60]

Two targets may run at once, each in its own clone and environment (two cores: about 35 s a
mutant each). ``--timeout-s`` bounds a mutant's test run (one that hangs counts as killed): keep
it near twice the tests' normal time, or a hanging mutant costs the default 600 s.

Writes ``<dir>/<target>.toml`` and ``<dir>/<target>.sqlite`` (the session; ``cr-report``,
``cr-html`` and ``cosmic-ray dump`` read it) and prints each target's counts and its surviving
mutants. cosmic-ray does not mutate string literals, so SQL text (the fencing-token clause of the
result write, ``SKIP LOCKED`` spelled in SQL) is outside its reach; those guards are broken by
hand (README "Guarantees" names the test that fails for each).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXCLUDED_OPERATORS = (
    # Selective mutation (Offutt, Lee, Rothermel, Untch and Zapf, "An experimental determination
    # of sufficient mutant operators", TOSEM 1996): a relational operator is replaced by its
    # negation and by its boundary neighbours only, an arithmetic or bitwise operator by its
    # inverse only. cosmic-ray's full sets (every operator by every other) make about three
    # times as many mutants, nearly all killed whenever these are.
    r"core/ReplaceComparisonOperator_(?!(Eq_NotEq|NotEq_Eq|Lt_GtE|Lt_LtE|LtE_Gt|LtE_Lt|Gt_LtE|Gt_GtE|GtE_Lt"
    r"|GtE_Gt|Is_IsNot|IsNot_Is|In_NotIn|NotIn_In)$)",
    r"core/ReplaceBinaryOperator_(?!(Add_Sub|Sub_Add|Mul_Div|Div_Mul|FloorDiv_Mul|Mod_FloorDiv|Pow_Mul"
    r"|BitOr_BitAnd|BitAnd_BitOr|BitXor_BitOr|LShift_RShift|RShift_LShift)$)",
)


@dataclass(frozen=True)
class Target:
    name: str
    path: str
    functions: Optional[tuple[str, ...]]  # top-level functions or classes; None: the whole module
    tests: tuple[str, ...]  # pytest arguments, fastest and most likely to fail first


TARGETS = (
    Target("app", "worker/app.py",
           ("transport_options", "delivery_conf", "make_app", "worker_concurrency", "interactive_concurrency",
            "pool_threads", "DeadLetterConsumer"),
           ("tests/worker/test_app.py", "tests/worker/test_make_worker.py")),
    Target("claims", "jobs/claims.py", ("claim_jobs", "_claim_sql", "renew_leases", "release_jobs"),
           ("tests/jobs/test_store.py", "tests/worker/test_attempt.py")),
    Target("results", "jobs/results.py", ("record_results",),
           ("tests/jobs/test_store.py", "tests/worker/test_attempt.py")),
    Target("sweeper_read", "jobs/outbox.py", ("take_jobs_to_publish", "mark_published"),
           ("tests/jobs/test_sweeper.py", "tests/jobs/test_store.py")),
    Target("group_commit", "worker/group_commit.py", None,
           ("tests/worker/test_attempt.py", "tests/worker/test_runtime.py")),
    Target("sweeper", "jobs/sweeper.py", None,
           ("tests/jobs/test_sweeper.py", "tests/jobs/test_client.py", "-k", "lost or sweep")),
)


def tool(name: str) -> str:
    """A cosmic-ray command: beside this Python (its environment's ``bin``), else on ``PATH`` (an
    environment with the system's site-packages finds cosmic-ray installed there, scripts and all).

    Raises:
        FileNotFoundError: neither has it (``pip install -e ".[mutation]"``).
    """
    local = os.path.join(os.path.dirname(sys.executable), name)
    found = local if os.path.exists(local) else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found; pip install -e \".[mutation]\"")
    return found


def line_ranges(path: str, functions: Optional[Sequence[str]]) -> list[str]:
    """``"first-last"`` line ranges of the named top-level definitions of ``path`` (the whole
    file when ``functions`` is None).

    Raises:
        ValueError: a named definition is not in the file.
    """
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    if functions is None:
        return [f"1-{max(getattr(node, 'end_lineno', 1) for node in ast.walk(tree))}"]
    found = {node.name: node for node in tree.body
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    missing = sorted(set(functions) - set(found))
    if missing:
        raise ValueError(f"{path}: no top-level definition named {', '.join(missing)}")
    return [f"{found[name].lineno}-{found[name].end_lineno}" for name in functions]


def config_text(target: Target, timeout_s: float) -> str:
    test_command = " ".join(shlex.quote(a) for a in (
        sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *target.tests))
    lines = {target.path: line_ranges(os.path.join(REPO_ROOT, target.path), target.functions)}
    return "\n".join([
        "[cosmic-ray]",
        f"module-path = {json.dumps(target.path)}",
        f"timeout = {timeout_s}",
        "excluded-modules = []",
        f"test-command = {json.dumps(test_command)}",
        "",
        "[cosmic-ray.distributor]",
        'name = "local"',
        "",
        "[cosmic-ray.filters.line-filter]",
        f"lines = {{ {json.dumps(target.path)} = {json.dumps(lines[target.path])} }}",
        "",
        "[cosmic-ray.filters.operators-filter]",
        f"exclude-operators = {json.dumps(list(EXCLUDED_OPERATORS))}",
        "",
    ])


def run(command: Sequence[str]) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=REPO_ROOT, check=True)


def survivors(session: str) -> list[dict]:
    """The mutants whose tests passed, from ``cosmic-ray dump``."""
    dump = subprocess.run([tool("cosmic-ray"), "dump", session],
                          cwd=REPO_ROOT, check=True, capture_output=True, text=True).stdout
    found = []
    for line in dump.splitlines():
        item, result = json.loads(line)
        if result and result.get("worker_outcome") == "normal" and result.get("test_outcome") == "survived":
            for mutation in item["mutations"]:
                found.append(dict(mutation, diff=result.get("diff", "")))
    return found


def recheck(target: Target, session: str, timeout_s: float) -> None:
    """Apply each survivor of ``session`` to the files on disk again, run the target's tests as
    they are now (a run past ``timeout_s`` counts as killed, as in ``exec``), restore the file,
    and print whether the survivor is now killed."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *target.tests]
    for mutant in survivors(session):
        try:
            run([tool("cosmic-ray"), "apply", mutant["module_path"],
                 mutant["operator_name"], str(mutant["occurrence"])])
            try:
                passed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, timeout=timeout_s).returncode == 0
            except subprocess.TimeoutExpired:
                passed = False
        finally:
            subprocess.run(["git", "checkout", "--", target.path], cwd=REPO_ROOT, check=True)
        print(f"{'SURVIVED' if passed else 'KILLED now'} {target.path}:{mutant['start_pos'][0]} "
              f"{mutant['operator_name']} #{mutant['occurrence']}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=[t.name for t in TARGETS],
                        help="a target to mutate (repeatable; default: all)")
    parser.add_argument("--dir", default="mutation-out", help="where configs and sessions go (relative to the repo)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="a mutant's test run past this counts as killed")
    parser.add_argument("--recheck", action="store_true",
                        help="run the current tests against each earlier session's survivors only (after new tests)")
    args = parser.parse_args(argv)

    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout
    if status.strip():
        parser.error(f"the checkout has uncommitted changes; cosmic-ray edits files in place:\n{status}")
    out = os.path.join(REPO_ROOT, args.dir)
    os.makedirs(out, exist_ok=True)
    for target in TARGETS:
        if args.target and target.name not in args.target:
            continue
        config = os.path.join(out, f"{target.name}.toml")
        session = os.path.join(out, f"{target.name}.sqlite")
        if args.recheck:
            if os.path.exists(session):
                recheck(target, session, args.timeout_s)
            continue
        with open(config, "w", encoding="utf-8") as f:
            f.write(config_text(target, args.timeout_s))
        try:
            if not os.path.exists(session):
                run([tool("cosmic-ray"), "init", config, session])
                run([tool("cr-filter-lines"), "--config", config, session])
                run([tool("cr-filter-operators"), session, config])
            run([tool("cosmic-ray"), "exec", config, session])  # resumes a session
        finally:  # a mutant left on disk by an interrupted run
            subprocess.run(["git", "checkout", "--", target.path], cwd=REPO_ROOT, check=True)
        run([tool("cr-report"), "--show-pending", session])
        for mutant in survivors(session):
            print(f"SURVIVED {target.path}:{mutant['start_pos'][0]} {mutant['operator_name']}"
                  f" #{mutant['occurrence']}\n{mutant['diff']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
