"""A box node's speed under its quota (`node_speed`): the box job's kind of work, timed
inside the node's cgroup, which a sample of the head node does not see."""

from __future__ import annotations

import subprocess
import sys

from hexctl.box.emulate import NodeState

# the box job's own work in miniature: a 2-layer transformer block's forward (attention
# and MLP, hidden 64, 8 sequences of 40 tokens) in torch on one thread. It imports torch
# and warms up outside the node (torch's import under a fifth of a core took minutes),
# then joins the node's cgroup and is timed there
_WORK = (
    "import os,sys,time,torch\n"
    "torch.set_num_threads(1)\n"
    "g=torch.Generator().manual_seed(0)\n"
    "x=torch.randn(8,40,64,generator=g)\n"
    "w=[torch.randn(64,64,generator=g)/8 for _ in range(4)]\n"
    "u,d=torch.randn(64,128,generator=g)/8,torch.randn(128,64,generator=g)/11\n"
    "def step(h):\n"
    "    for _ in range(2):\n"
    "        a=torch.softmax((h@w[0])@(h@w[1]).transpose(1,2)/8,-1)@(h@w[2])\n"
    "        h=h+a@w[3]\n"
    "        h=h+torch.nn.functional.silu(h@u)@d\n"
    "    return h\n"
    "step(x)\n"
    "if len(sys.argv)>2:\n"
    "    open(os.path.join(sys.argv[2],'cgroup.procs'),'w').write(str(os.getpid()))\n"
    "    time.sleep(0.05)\n"
    "w0,n=time.monotonic(),0\n"
    "while time.monotonic()-w0<float(sys.argv[1]):\n"
    "    step(x);n+=1\n"
    "print(n/(time.monotonic()-w0))\n"
)


def node_speed(nodes: list[NodeState], seconds: float = 1.5) -> dict[str, float | None]:
    """Each node's speed now: forward steps per wall second of a fixed torch block of the
    box job's sizes (`_WORK`) timed inside the node's cgroup, the nodes at once. It moves
    with the node's quota as the machine honours it and with how fast the machine runs
    such work under it, which a sample outside every quota does not see (`bench host`),
    nor did a pure Python loop under it. None for a node whose sample failed (a speed
    sample is a reading beside a run, not a reason to stop it)."""
    procs = {
        n.name: subprocess.Popen(
            [sys.executable, "-c", _WORK, str(seconds), n.cgroup],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in nodes
    }
    speeds: dict[str, float | None] = {}
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=60 + seconds)
            speeds[name] = round(float(out.split()[0]), 2) if proc.returncode == 0 else None
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            proc.kill()
            proc.communicate()
            speeds[name] = None
    return speeds
