"""python -m stalwart.dashboards [DIR]: write the dashboards' JSON (default dashboards/grafana/)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stalwart.dashboards.definitions import ALL

HERE = Path(__file__).resolve().parent


def render() -> dict[str, str]:
    """file name -> JSON text, exactly as committed."""
    return {
        f"{name}.json": json.dumps(make(), indent=2, sort_keys=True) + "\n"
        for name, make in ALL.items()
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m stalwart.dashboards",
        description="Write the dashboards' JSON (users export them with `stalwart dashboards`).",
    )
    ap.add_argument("dir", nargs="?", type=Path, default=HERE / "grafana", help="the folder")
    out = ap.parse_args(argv).dir
    out.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (out / name).write_text(text)
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
