"""A pytest JUnit XML file as a verdict: a test run on the GPU counts only if its tests ran there.

Usage::

    python -m bench.junit_check RESULTS.xml [--min-passed N] [--allow-skip TEXT ...] [--gpu-skip-policy]

Prints the passed/failed/skipped count of each test file and every skip's reason, then exits 1 when
a test failed or errored, when fewer than ``--min-passed`` passed, or when a test was skipped for a
reason that contains none of the ``--allow-skip`` texts nor, with ``--gpu-skip-policy``, any reason of
``tests.skip_policy.ALLOWED_GPU_SKIPS`` (a kernel test that skips on the GPU
machine, for want of Triton or CUDA, would otherwise leave a green run that tested nothing).
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def outcomes(path: str) -> list[tuple[str, str, str]]:
    """``(test id, outcome, message)`` of every test case: outcome is passed, failed, error or
    skipped; the message is the skip's or failure's text ("" when passed)."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "failed" if tag == "failure" else tag
                message = node.get("message") or (node.text or "")
                break
        rows.append((test_id, outcome, message))
    return rows


def problems(rows: list[tuple[str, str, str]], min_passed: int, allowed_skips: list[str]) -> list[str]:
    """Why the run does not count, one sentence each; empty when it counts."""
    found = [f"{outcome}: {test_id}" for test_id, outcome, _ in rows if outcome in ("failed", "error")]
    found += [f"skipped ({message.strip()[:160]}): {test_id}" for test_id, outcome, message in rows
              if outcome == "skipped" and not any(text in message for text in allowed_skips)]
    num_passed = sum(outcome == "passed" for _, outcome, _ in rows)
    if num_passed < min_passed:
        found.append(f"{num_passed} tests passed, fewer than {min_passed}")
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.junit_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("xml")
    ap.add_argument("--min-passed", type=int, default=1)
    ap.add_argument("--allow-skip", action="append", default=[], help="text of a skip reason that is expected")
    ap.add_argument("--gpu-skip-policy", action="store_true",
                    help="also allow the reasons of tests.skip_policy.ALLOWED_GPU_SKIPS")
    args = ap.parse_args(argv)
    if args.gpu_skip_policy:
        from tests.skip_policy import ALLOWED_GPU_SKIPS

        args.allow_skip += list(ALLOWED_GPU_SKIPS)
    rows = outcomes(args.xml)
    per_file = collections.defaultdict(collections.Counter)
    for test_id, outcome, _ in rows:
        per_file[test_id.split("::")[0]][outcome] += 1
    for name, counts in sorted(per_file.items()):
        print(f"{name}: " + ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped") if counts[k]))
    found = problems(rows, args.min_passed, args.allow_skip)
    for line in found:
        print("junit_check:", line)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
