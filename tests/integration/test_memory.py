"""``clonemap.shards.common.memory.return_large_frees``: freed large blocks leave the process.

Each case runs in a fresh interpreter (the allocator's state is per process): free one
900 KB block (glibc would now raise its mmap threshold past 900 KB), allocate 100 more,
keep the newest (so the heap's top cannot be trimmed) and free the rest. With the fixed
threshold the RSS falls back by the 99 freed blocks; glibc's default keeps them.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")

SCRIPT = r"""
import json, sys, psutil
from clonemap.shards.common.memory import return_large_frees
applied = return_large_frees() if sys.argv[1] == "on" else False
me = psutil.Process()
first = bytearray(900 * 1024); del first
base = me.memory_info().rss
blocks = [bytearray(b"x" * (900 * 1024)) for _ in range(100)]
full = me.memory_info().rss
keep = blocks[-1]
del blocks[:-1]
print(json.dumps({"applied": applied, "grown": full - base, "kept": me.memory_info().rss - base}))
"""


def measure(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], check=True, capture_output=True,
                         text=True, timeout=60)
    return json.loads(out.stdout)


def test_freed_large_blocks_go_back_to_the_os():
    on = measure("on")
    assert on["applied"] is True
    assert on["grown"] >= 80 * 900 * 1024  # the blocks were really resident
    assert on["kept"] <= 4 * 900 * 1024, on  # one block kept, the 99 freed are gone


def test_without_it_the_allocator_keeps_them():
    """The measurement above can fail: glibc's default keeps the freed blocks."""
    off = measure("off")
    assert off["kept"] >= 50 * 900 * 1024, off
