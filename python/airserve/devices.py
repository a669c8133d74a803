"""`python -m airserve.devices`: print what this machine can run on (`--json` for the raw dict).

The discovery itself is `airserve.srt.hardware.discover()`; this module only formats it. Nothing
under `airserve.srt` imports this module.
"""

from __future__ import annotations

import argparse
import json

from airserve.srt.hardware import discover


def format_report(info: dict) -> str:
    lines = [f"torch {info['torch']['version']}"]
    for d in info["torch"]["devices"]:
        lines.append(_line(d, d.get("detail", "")))
    ov = info["openvino"]
    if not ov["installed"]:
        lines.append(f"openvino: not installed ({ov['reason']})")
        return "\n".join(lines)
    lines.append(f"openvino {ov['version']}")
    for d in ov["devices"]:
        lines.append(_line(d, d.get("full_name", "")))
    return "\n".join(lines)


def _line(d: dict, detail: str) -> str:
    if d["available"]:
        count = f" x{d['count']}" if d.get("count", 1) > 1 else ""
        return f"  {d['name']:<8} available{count}  {detail}".rstrip()
    return f"  {d['name']:<8} unavailable  {d['reason']}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="List the devices airserve can run on here.")
    parser.add_argument("--json", action="store_true", help="print the raw dict as JSON")
    args = parser.parse_args(argv)
    info = discover()
    print(json.dumps(info, indent=2) if args.json else format_report(info))


if __name__ == "__main__":
    main()
