"""docs/pytorch.md's table of Transformer Engine names says what fp8kit.pytorch has: every name marked present is
there, and none marked 'not yet' or 'out of scope' is (a name that lands must move to 'present')."""

import pathlib
import re

import fp8kit.pytorch as te

DOC = pathlib.Path(__file__).parents[1] / "docs" / "pytorch.md"
BEING_BUILT: set = set()  # names marked present whose branch has not merged yet


def table():
    section = DOC.read_text().split("\n## Transformer Engine names\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            rows.append((re.findall(r"`([A-Za-z_0-9]+)`", cells[0]), cells[1]))
    return rows


def test_table_matches_fp8kit():
    rows = table()
    assert len(rows) > 30
    wrong = []
    for names, status in rows:
        present = status.startswith("present")
        assert present or status.startswith(("not yet", "out of scope")), status
        for name in names:
            if present and not hasattr(te, name) and name not in BEING_BUILT:
                wrong.append(f"{name}: marked present, missing from fp8kit.pytorch")
            if not present and hasattr(te, name):
                wrong.append(f"{name}: fp8kit.pytorch has it, the table says '{status[:20]}...'")
    assert not wrong, wrong


def test_every_present_name_is_exported():
    present = {n for names, status in table() if status.startswith("present") for n in names}
    assert present - BEING_BUILT <= set(te.__all__)
