"""benchmarks/OSD.md is what benchmarks/osd_report.py prints from the stored results (plus its hand-kept
caveats), and a run with nothing to compare its outputs with reads "-", not "True"."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _report():
    spec = importlib.util.spec_from_file_location("osd_report", BENCH / "osd_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_osd_md_is_the_report_of_the_stored_results():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _report().main(str(BENCH / "results" / "osd"))
    assert out.getvalue() == (BENCH / "OSD.md").read_text()


def test_outputs_identical_needs_two_runs():
    """keep_all's result.json holds one run and, from before replay wrote None there, True: the online
    run compared with itself."""
    ident = _report()._identical
    assert ident({"runs": {"online": {}}, "outputs_identical": True}) == "-"
    assert ident({"runs": {"static": {}, "online": {}}, "outputs_identical": None}) == "-"
    assert ident({"runs": {"static": {}, "online": {}}, "outputs_identical": False}) == "False"
