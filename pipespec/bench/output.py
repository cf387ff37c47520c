"""Printing a bench result and saving it as JSON."""
from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path


def report(lines: list[str], results: dict, output_json: str | None) -> None:
    print("\n".join(lines), flush=True)
    if output_json:
        record = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), **results}
        Path(output_json).write_text(json.dumps(record, indent=1) + "\n")
