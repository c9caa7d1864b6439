"""2-process CPU DDP smoke test through torchrun (gloo): one summary, 2 processes.

`accelerate launch --cpu --num_processes 2` starts a single process in accelerate 1.15
(multi-CPU needs a saved `accelerate config`); torchrun sets the env Accelerate reads.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun not installed beside this Python")
def test_two_process_cpu_ddp(tmp_path):
    launcher = str(Path(sys.executable).parent / "torchrun")
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [launcher, "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), "-m", "attnlab.cli", "run",
           "name=ddp", f"output_dir={tmp_path}", "task.data_dir=builtin",
           "model.name=scratch:tiny", "model.max_length=16", "train.max_steps=4",
           "train.batch_size=4", "task.train_limit=32", "task.eval_limit=8"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    summaries = list(tmp_path.glob("**/summary.json"))
    assert len(summaries) == 1
    summary = json.loads(summaries[0].read_text())
    assert summary["num_processes"] == 2 and summary["steps"] == 4
    assert res.stdout.count("run directory:") == 1  # only the main process reports
