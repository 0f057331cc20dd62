"""The decode kernel's fragment-level emulation (ffi/tools/emulate_decode.py) on the CPU: its shared-memory layout,
ldmatrix lane addresses and MMA fragments, as written in ffi/verify_attention.cu, give float64 attention."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ffi", "tools"))

import emulate_decode  # noqa: E402


def test_decode_kernel_emulation_matches_float64():
    emulate_decode.main()  # asserts relative error < 1e-2 on three problems (T = 1 x 8 heads, a tree, 3 rows)
