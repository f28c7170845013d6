"""Render the tables of ``docs/benchmarks/measurements.md`` from the recorded results.

Each table is one JSON file in ``benchmarks/results/tables/``: its ``columns`` and
``rows``, when and where they were measured (``date``, ``machine``, ``versions``) and the
raw run files they come from (``sources``). In the page a table sits between two marker
comments, ``<!-- table: eigh_3c3d_k10 -->`` and ``<!-- /table -->``; this script
replaces what is between them by the table rendered from ``eigh_3c3d_k10.json`` and a
line that says where the numbers come from::

    python -m benchmarks.render_tables           # rewrite docs/benchmarks/measurements.md
    python -m benchmarks.render_tables --check   # exit 1 if the page is out of date

The prose around the tables is written by hand; it explains, it does not log.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLES = ROOT / "benchmarks" / "results" / "tables"
PAGE = ROOT / "docs" / "benchmarks" / "measurements.md"

#: Fields every table record must have.
REQUIRED = ("date", "machine", "versions", "sources", "columns", "rows")

_BLOCK = re.compile(r"(<!-- table: (?P<id>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)",
                    re.DOTALL)


def load_tables(folder: Path = TABLES) -> dict[str, dict]:
    """The table records (``<id>.json``) of a folder by id; a ``ValueError`` if a record
    lacks a required field or a row has the wrong length."""
    tables = {}
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        if missing := [key for key in REQUIRED if key not in record]:
            raise ValueError(f"{path.name} lacks {', '.join(missing)}")
        width = len(record["columns"])
        if (bad := next((r for r in record["rows"] if len(r) != width), None)) is not None:
            raise ValueError(f"{path.name}: row {bad} has {len(bad)} cells, not {width}")
        tables[path.stem] = record
    return tables


def _machine(machine) -> str:
    if isinstance(machine, str):
        return machine
    cores = machine.get("cpu_count_usable", machine.get("cpu_count"))
    text = f"{machine.get('cpu_name', 'unknown CPU')}, {cores} cores"
    device = machine.get("device_name") if machine.get("device", "cpu") != "cpu" else None
    return text + (f", {device}" if device else ", no GPU")


def _versions(versions) -> str:
    if isinstance(versions, str):
        return versions
    return ", ".join(f"{name} {version}" for name, version in versions.items())


def render_table(table_id: str, record: dict) -> str:
    """One table in markdown with a line naming its data file, date, machine and versions."""
    lines = ["| " + " | ".join(record["columns"]) + " |",
             "|" + "---|" * len(record["columns"])]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in record["rows"]]
    sources = ", ".join(f"`{s}`" for s in record["sources"])
    sources = f"raw: {sources}" if sources else "the raw run was not kept"
    lines += ["", f"*Data: `benchmarks/results/tables/{table_id}.json` ({sources}); "
              f"recorded {record['date']}; {_machine(record['machine'])}; "
              f"{_versions(record['versions'])}.*"]
    return "\n".join(lines) + "\n"


def render(page: str, tables: dict[str, dict]) -> str:
    """The page with every marked table rendered from its record (``tables``: by id); a
    ``KeyError`` if the page marks a table that has no record."""
    def replace(match: re.Match) -> str:
        table_id = match["id"]
        if table_id not in tables:
            raise KeyError(f"docs mark table {table_id!r}, but there is no {table_id}.json")
        return match.group(1) + render_table(table_id, tables[table_id]) + match.group(4)

    return _BLOCK.sub(replace, page)


def marked_ids(page: str) -> list[str]:
    """The ids of the tables a page marks, in order."""
    return [m["id"] for m in _BLOCK.finditer(page)]


def main(argv: list[str] | None = None) -> int:
    """Rewrite the page, or with ``--check`` only compare: 1 if it is stale, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only check that the page matches the records")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    new = render(page, load_tables())
    if args.check:
        if new != page:
            print(f"{PAGE} is out of date: run python -m benchmarks.render_tables",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    print(f"rendered {len(marked_ids(new))} tables into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
