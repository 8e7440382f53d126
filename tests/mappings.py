"""This process's memory mappings, as /proc/self/smaps lists them (Linux)."""

from __future__ import annotations

from pathlib import Path


def mappings():
    """This process's mappings (/proc/self/smaps): (start, end, path or "", {field: its words})."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            if mapping is not None:
                yield mapping
            start, end = (int(v, 16) for v in fields[0].split("-"))
            mapping = (start, end, fields[5] if len(fields) >= 6 else "", {})
        elif fields and mapping is not None:
            mapping[3][fields[0].rstrip(":")] = fields[1:]
    if mapping is not None:
        yield mapping


def vm_flags_at(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address`."""
    for start, end, _, fields in mappings():
        if start <= address < end:
            return fields["VmFlags"]
    raise AssertionError(f"no mapping holds {address:#x}")
