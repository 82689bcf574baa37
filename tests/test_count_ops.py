"""scripts/tools/count_ops.py counts one mixer layer's ops on the CUDA paths: the Triton launches are there,
an unpadded prefill masks nothing and synchronises nothing, and the fused output norm and gate runs
as one launch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_count_ops_hla_and_sse(tmp_path):
    pytest.importorskip("triton")
    cmd = [sys.executable, "-m", "scripts.tools.count_ops", "--family", "hla", "--family", "sse",
           "--no-triton", "--top", "60"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env["TRITON_INTERPRET"] = "1"
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {" ".join(line.split()[:3]): line for line in res.stdout.splitlines() if "ops" in line}
    # HLA: 4 chunked-kernel launches (two calls of walk and output; the walk does the decays' cumsum, the second
    # call's of 2 log alpha) + the feature maps with the log decays + the norm-gate (reading the gate in place),
    # no torch.where; SSE: 3 (one call of walk, intra-chunk, output over the shared and partition rows) + the
    # grouping by partition (1: its counts come from the router's launch) + the chunk table + the rows' packing
    # with the feature maps computed inside it + their sum per token with the norm-gate (without gradients) +
    # the router (softmax and top-K in one kernel), none of the padding masks' torch.where
    hla = rows["hla model forward"]
    assert "log_sigmoid" not in hla and " mul " not in hla and "clone" not in hla and "_to_copy" not in hla, hla
    for fam, launches, where in (("hla", 6, None), ("sse", 8, None)):
        line = rows[f"{fam} model forward"]
        assert f"<triton> x{launches}" in line, line
        assert "topk" not in line and "softmax" not in line and "scatter" not in line, line
        assert "syncs  0" in line and "rsqrt" not in line, line
        assert (where in line) if where else ("where" not in line), line
        assert f"{fam} model backward" in " ".join(rows), rows
