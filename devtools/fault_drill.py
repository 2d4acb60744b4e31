"""The fault drill: every row of the fault table, tried for real, as a table.

    python devtools/fault_drill.py            # CPU only; ~2 minutes on 2 cores (the multi-node test included)
    python devtools/fault_drill.py -k sigint  # more pytest arguments select or change the run

It runs tests/test_faults.py (the ``faults`` marker) with the multi-node test switched on
(FMR_TEST_MULTINODE=1), reads what each test recorded (its row of the table, what is expected, what was
observed) from pytest's junit XML, and prints one markdown row per fault: row, expected, observed,
pass/fail (a test's temporary folder is shown as $TMP). It exits with pytest's exit code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(pytest_args: list[str]) -> tuple[int, list[dict]]:
    with tempfile.TemporaryDirectory(prefix="fault-drill-") as tmp:
        xml = Path(tmp) / "drill.xml"
        env = {**os.environ, "FMR_TEST_MULTINODE": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        command = [sys.executable, "-m", "pytest", "-q", "-m", "faults", "tests/test_faults.py",
                   "-p", "no:cacheprovider", "-o", "junit_family=xunit1", f"--junitxml={xml}",
                   *pytest_args]  # fmt: skip
        code = subprocess.call(command, cwd=REPO, env=env)
        if not xml.exists():
            return code, []
        rows = []
        for case in ET.parse(xml).getroot().iter("testcase"):
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
            if "row" not in props:
                continue  # a unit test behind the rows, not a row of the table
            if case.find("failure") is not None or case.find("error") is not None:
                outcome = "FAIL"
            elif case.find("skipped") is not None:
                outcome = "skipped"
            else:
                outcome = "pass"
            rows.append({**props, "result": outcome, "test": case.get("name")})
        return code, rows


# A test's own temporary folder, e.g. /tmp/fmr-tests-abc/faults-usr1-xyz or /tmp/pytest-of-me/pytest-7/test_x0
TEST_FOLDER = re.compile(r"(?:/[^\s/]+)*/(?:fmr-tests-[^\s/]+|pytest-of-[^\s/]+/pytest-\d+)/[^\s/]+")


def table(rows: list[dict]) -> str:
    def cell(text: str | None) -> str:
        text = TEST_FOLDER.sub("$TMP", text or "—")  # the test's temporary folder, for legibility
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| row | expected | observed | result |", "|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {cell(r['row'])} | {cell(r.get('expected'))} | {cell(r.get('observed'))} | {r['result']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    code, rows = run(list(sys.argv[1:] if argv is None else argv))
    print()
    print(table(rows))
    passed = sum(r["result"] == "pass" for r in rows)
    print(f"\n{passed} of {len(rows)} rows pass (pytest exit code {code})")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
