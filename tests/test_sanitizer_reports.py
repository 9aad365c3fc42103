"""tests/sanitizer_reports.py reads initcheck's output as compute-sanitizer prints it (CPU)."""
from __future__ import annotations

from sanitizer_reports import parse, table   # tests/ is on sys.path

LOG = """\
========= COMPUTE-SANITIZER
RANGE o 0x7f0000001000 0x7f0000002000 1024
RANGE grad:q 0x7f0000004000 0x7f0000004100
========= Uninitialized __global__ memory read of size 16 bytes
=========     at recurrent_kernel+0x1a40 in /tmp/recurrence.py:120
=========     by thread (3,0,0) in block (7,0,0)
=========     Address 0x7f0000001ff0
=========
========= Uninitialized __global__ memory read of size 4 bytes
=========     at 0x2c0 in void at::native::elementwise_kernel<128, 4>(int, T3)
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x7f0000003000
=========
========= Host API memory access error at host access to 0x7f0000004000 of size 256 bytes
=========     Uninitialized access at 0x7f0000004010 on access by cudaMemcpy source
=========
RANGE by-tma 0x7f0000009000 0x7f0000009080
========= ERROR SUMMARY: 3 errors
"""


def test_reports_are_attributed_to_the_printed_ranges():
    log = parse(LOG.splitlines())
    assert log.errors == 3 and len(log.reports) == 3
    assert log.attributed() == {("recurrent_kernel", "o"): 1,
                                ("void at::native::elementwise_kernel<128, 4>(int, T3)", "unnamed memory"): 1,
                                ("host: cudaMemcpy source", "grad:q"): 1}
    assert [r.size for r in log.reports] == [16, 4, 256]
    assert log.range_of(0x7F0000001000) == "o" and log.range_of(0x7F0000002000) is None   # end excluded
    assert log.range_of(0x7F0000009000) == "by-tma"   # a range printed after the reports still counts
    assert log.token_of(0x7F0000001FF0) == 3 and log.token_of(0x7F0000004010) is None   # grad:q gave no row size
    assert "unnamed memory" in table(log) and "bytes [16], tokens [3]" in table(log)
    assert log.headers["Uninitialized __global__ memory read of size N bytes"] == 2


def test_a_clean_run_has_no_reports():
    log = parse(["========= COMPUTE-SANITIZER", "RANGE o 0x10 0x20", "========= ERROR SUMMARY: 0 errors"])
    assert log.errors == 0 and log.reports == [] and not log.attributed()


def test_buffer_overflow_notices_are_counted_apart_from_the_reports():
    """A launch that fills initcheck's record buffer gets its reports dropped after a notice; the summary counts
    each notice as an error (initcheck's H100 runs: 257 errors for 256 reports and one notice)."""
    lines = LOG.replace("========= ERROR SUMMARY: 3 errors\n", "").splitlines() + [
        "========= Warning: Error buffer overflow has been detected. Some records have been dropped",
        "========= 40 errors were skipped (error buffer overflow).",
        "========= ERROR SUMMARY: 4 errors"]
    log = parse(lines)
    assert len(log.reports) == 3 and log.overflows == 1 and log.errors == len(log.reports) + log.overflows
    assert "1 buffer overflows (reports dropped)" in table(log)
    assert parse(LOG.splitlines()).overflows == 0
