"""compute-sanitizer initcheck's reports, attributed: which kernel (or host API call) read which of the workload's
outputs (tests/sanitizer_workload.py prints `RANGE name 0xSTART 0xEND` for each).

initcheck reports a read of device memory that nothing it saw has written. It sees the threads' stores and the
copy engines', and some TMA tensor stores (cp.async.bulk.tensor) but not all: the probe cases `tma-store-probe*`
check which (tests/test_sanitizer.py). Where it misses a kernel's TMA stores, every later read of those bytes is
reported although they were written; tests/test_sanitizer.py uses this module to tell those reads from real ones.

Run as `python tests/sanitizer_reports.py LOG [LOG ...]` for a table per log: count, reader, range read.
"""
from __future__ import annotations

import bisect
import collections
import re
import sys
import dataclasses
from dataclasses import dataclass
from typing import Iterable

_DEVICE = re.compile(r"Uninitialized __global__ memory read of size (\d+) bytes")
_AT = re.compile(r"^=+\s+at (.+?)\s*$")
_ADDRESS = re.compile(r"^=+\s+Address (0x[0-9a-f]+)")
_HOST = re.compile(r"Host API memory access error at .* of size (\d+) bytes")
_HOST_AT = re.compile(r"Uninitialized access at (0x[0-9a-f]+) on access by (.+?)\s*$")
_RANGE = re.compile(r"^RANGE (\S+) (0x[0-9a-f]+) (0x[0-9a-f]+)(?: (\d+))?\s*$")
_HEADER = re.compile(r"^=+ (\S.*?)\s*$")   # a report's first line (its details are indented further)
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
# the device-side record buffer filled: later reports of that launch are dropped unprinted, and each of these
# notices counts as one error in the summary
_OVERFLOW = re.compile(r"Error buffer overflow has been detected")


@dataclass(frozen=True)
class Report:
    reader: str     # the kernel's name, or "host: <API call>"
    address: int
    size: int


@dataclass
class Log:
    reports: list[Report]
    ranges: list[tuple[int, int, str, int]]   # (start, end, name, bytes a token or 0), sorted by start
    errors: int | None                        # the tool's ERROR SUMMARY count
    headers: collections.Counter = dataclasses.field(default_factory=collections.Counter)   # every report's kind
    overflows: int = 0                        # buffer-overflow notices (some reports were dropped unprinted)

    def _find(self, address: int):
        i = bisect.bisect_right(self.ranges, (address, float("inf"), "", 0)) - 1
        if i >= 0 and self.ranges[i][0] <= address < self.ranges[i][1]:
            return self.ranges[i]
        return None

    def range_of(self, address: int) -> str | None:
        """The name of the printed range holding address, or None."""
        found = self._find(address)
        return found[2] if found else None

    def token_of(self, address: int) -> int | None:
        """The token (row of the range's tensor) address lies in, where its range gave the bytes a token."""
        found = self._find(address)
        return (address - found[0]) // found[3] if found and found[3] else None

    def attributed(self) -> collections.Counter:
        """Counter of (reader, range name or "unnamed memory")."""
        return collections.Counter((r.reader, self.range_of(r.address) or "unnamed memory") for r in self.reports)


def _kernel_name(at: str) -> str:
    """The kernel in an `at` line's text: `name+0xOFFSET [in FILE:LINE]` or `0xOFFSET in NAME`."""
    if m := re.match(r"0x[0-9a-f]+ in (.+)", at):
        return m.group(1)
    return re.split(r"\+0x[0-9a-f]+", at)[0]


def parse(lines: Iterable[str]) -> Log:
    """The reports, ranges and error count in a sanitizer run's output (stdout and stderr together)."""
    reports, ranges, errors, headers, overflows = [], [], None, collections.Counter(), 0
    pending = None   # ("device", size, reader) until its Address line
    for line in lines:
        if (h := _HEADER.match(line)) and not h.group(1).startswith(("COMPUTE-SANITIZER", "ERROR SUMMARY")):
            headers[re.sub(r"0x[0-9a-f]+|\d+", "N", h.group(1))] += 1
        if _OVERFLOW.search(line):
            overflows += 1
        if m := _RANGE.match(line):
            ranges.append((int(m.group(2), 16), int(m.group(3), 16), m.group(1), int(m.group(4) or 0)))
        elif m := _DEVICE.search(line):
            pending = ["device", int(m.group(1)), None]
        elif pending and pending[0] == "device" and pending[2] is None and (m := _AT.match(line)):
            pending[2] = _kernel_name(m.group(1))
        elif pending and pending[0] == "device" and (m := _ADDRESS.match(line)):
            reports.append(Report(pending[2] or "unknown kernel", int(m.group(1), 16), pending[1]))
            pending = None
        elif m := _HOST.search(line):
            pending = ["host", int(m.group(1)), None]
        elif pending and pending[0] == "host" and (m := _HOST_AT.search(line)):
            reports.append(Report(f"host: {m.group(2)}", int(m.group(1), 16), pending[1]))
            pending = None
        elif m := _SUMMARY.search(line):
            errors = int(m.group(1))
    ranges.sort()
    return Log(reports, ranges, errors, headers, overflows)


def table(log: Log) -> str:
    """Count, reader and range of the reports (with the tokens read, where the range gives them), then every kind
    of report the log holds."""
    tokens, sizes = collections.defaultdict(set), collections.defaultdict(set)
    for r in log.reports:
        key = r.reader, log.range_of(r.address) or "unnamed memory"
        sizes[key].add(r.size)
        if (t := log.token_of(r.address)) is not None:
            tokens[key].add(t)
    rows = []
    for (reader, where), n in log.attributed().most_common():
        read = sorted(tokens.get((reader, where), ()))
        rows.append(f"{n:>8}  {reader[:100]}  ->  {where}, bytes {sorted(sizes[reader, where])}"
                    + (f", tokens {read[:16]}" if read else ""))
    kinds = [f"{n:>8}  kind: {h[:120]}" for h, n in log.headers.most_common(8)]
    dropped = f", {log.overflows} buffer overflows (reports dropped)" if log.overflows else ""
    return "\n".join([f"errors {log.errors}, reports parsed {len(log.reports)}{dropped}", *rows, *kinds])


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path, errors="replace") as f:
            print(f"== {path}\n{table(parse(f))}")
