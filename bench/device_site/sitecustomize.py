"""Make this Python lack the packages the GPU machine lacks, for ``bench/gpu.sh --small``.

With this folder on ``PYTHONPATH``, every top-level module named in ``DEVICE_LACKS`` (names split
by spaces or commas: ``celery pydantic_settings ...``) fails to import with ``ModuleNotFoundError``,
as on a machine where it is not installed, and ``importlib.util.find_spec`` finds none of them. So a
rehearsal on a developer machine, where the worker's dependencies are installed, still proves that
the GPU steps never import them. Each refusal is also written to stderr (code that catches the
error and goes on would otherwise hide that it tried).
"""

import os
import sys

LACKING = frozenset(n for n in os.environ.get("DEVICE_LACKS", "").replace(",", " ").split() if n)


class _LackingFinder:
    """First on ``sys.meta_path``: answers for the lacking modules before any real finder can."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in LACKING:
            print(f"device_site: refused import of {name!r} (not on the GPU machine)", file=sys.stderr)
            raise ModuleNotFoundError(f"No module named {name!r} (DEVICE_LACKS)", name=name)
        return None


if LACKING:
    sys.meta_path.insert(0, _LackingFinder())
