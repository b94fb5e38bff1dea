"""`areal-hex box up|down BOX.yaml`: a heterogeneous cluster emulated on one Linux machine.

What `up` makes, every name starting with `ahx-<box>-` (interfaces, namespaces) or
under `areal-hex-box/<box>` (cgroups), so that anything a killed launcher left behind is
found by name:

    root namespace                                   node namespace ahx-<box>-<node>
    spine bridge  ahx-<box>-x   (host address .254)
      └─ ahx-<box>-cR ══ ahx-<box>-uR  uplink of rack R, tbf both ends
            rack bridge ahx-<box>-bR
              └─ ahx-<box>-nI ═════════ eth0 (node address), tbf both ends: the NIC

A tbf on an interface shapes what leaves it, so each end of a pair shapes one direction:
`nI` what reaches node I, its `eth0` what node I sends. Each node also gets a CPU cgroup
whose quota is its kind's `cpu` (with an accounting group where cgroup v1 mounts
`cpuacct` apart: `hexctl/box/cgroups.py`); `node_argv` starts a command inside them.

`up` first removes whatever an earlier box of the same name left (a SIGKILLed `up` or a
run that never said `down`), then builds, then checks that the CPU quota takes effect.
If anything fails on the way, it removes what it made before raising. `down` removes by
name, with or without the state file `up` writes under /run/areal-hex-box/<box>/.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from areal_hex.errors import UsageError
from hexctl.box.cgroups import BoxError, kill_pids, leftover_cgroups, make_acct, remove_cgroups
from hexctl.box.cgroups import cgroup_layout as _cgroup_layout
from hexctl.box.cgroups import make_cgroup as _make_cgroup
from hexctl.box.cgroups import remove_if_empty as _remove_if_empty
from hexctl.box.cgroups import weigh as _weigh
from hexctl.box.checks import check_fits
from hexctl.box.spec import Box, BoxNode

STATE_ROOT = Path("/run/areal-hex-box")
NODE_IFACE = "eth0"  # the node's side of its NIC pair, inside its namespace


@dataclass
class NodeState:
    name: str
    kind: str
    rack: str
    netns: str
    address: str
    iface: str
    cgroup: str  # the directory whose cgroup.procs a process joins
    cpu: float  # the quota, in cores
    max_running_requests: int  # the kind's engine batch limit (its KV-cache budget)
    acct: str = ""  # the node's cpuacct group where v1 mounts it apart; "": `cgroup` counts


@dataclass
class BoxState:
    name: str
    host_address: str
    prefix_len: int
    nodes: dict[str, NodeState]
    cpu_check: dict[str, float]  # node -> CPU seconds per wall second of a busy loop

    def node(self, name: str) -> NodeState:
        if name not in self.nodes:
            raise UsageError(
                f"box {self.name!r} has no node {name!r} (nodes: {', '.join(self.nodes)})"
            )
        return self.nodes[name]


# ---------------------------------------------------------------- names
def prefix(box_name: str) -> str:
    return f"ahx-{box_name}-"


def netns_name(box_name: str, node: str) -> str:
    return f"{prefix(box_name)}{node}"


def _link(box_name: str, tag: str) -> str:
    name = f"{prefix(box_name)}{tag}"
    assert len(name) <= 15, name  # IFNAMSIZ - 1; the spec keeps box names to 6 characters
    return name


def state_dir(box_name: str) -> Path:
    return STATE_ROOT / box_name


# ---------------------------------------------------------------- host checks
def check_host() -> None:
    """What a box needs of this machine; each missing piece is named (exit 2)."""
    if os.geteuid() != 0:
        raise UsageError(
            "areal-hex box needs root (network namespaces, tc, cgroups); run it as root"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise UsageError(
                f"areal-hex box needs the `{tool}` command (iproute2); it is not on PATH"
            )
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise UsageError(f"network namespaces are not available here: {probe.stderr.strip()}")
    _cgroup_layout()


# ---------------------------------------------------------------- commands
def _sh(*argv: str, netns: str | None = None) -> str:
    cmd = ["ip", "netns", "exec", netns, *argv] if netns else list(argv)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise BoxError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _tbf(dev: str, mbit: float, netns: str | None = None) -> None:
    """Shape what leaves `dev` to `mbit`: a token bucket as deep as 10 ms of the rate (at
    least 16 KB: a burst below one segment would stall it), packets waiting up to 100 ms."""
    burst = max(16 * 1024, int(mbit * 1e6 / 8 * 0.01))
    _sh(
        "tc",
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{mbit}mbit",
        "burst",
        str(burst),
        "latency",
        "100ms",
        netns=netns,
    )


# ---------------------------------------------------------------- up
def up(box: Box, cpu_check_s: float = 0.5) -> BoxState:
    check_fits(box)  # ConfigError naming the quota, before anything is built
    check_host()
    down(box.name)  # whatever an earlier box of this name left
    sdir = state_dir(box.name)
    sdir.mkdir(parents=True, exist_ok=True)
    try:
        state = _build(box)
        state.cpu_check = {n: _cpu_check(ns, cpu_check_s) for n, ns in state.nodes.items()}
        for name, ratio in state.cpu_check.items():
            quota = state.nodes[name].cpu
            # a quota in effect never lets the loop run faster than it (allow scheduler
            # slack); a slower loop only means other work on the machine
            if ratio > quota * 1.25 + 0.05:
                raise BoxError(
                    f"node {name}: the CPU quota of {quota} cores did not take effect "
                    f"(a busy loop got {ratio:.2f} CPU-seconds per second)"
                )
        (sdir / "state.json").write_text(json.dumps(asdict(state), indent=2))
        return state
    except BaseException:
        down(box.name)
        raise


def _build(box: Box) -> BoxState:
    name, plen = box.name, box.network.prefixlen
    spine = _link(name, "x")
    _sh("ip", "link", "add", spine, "type", "bridge")
    _sh("ip", "addr", "add", f"{box.host_address}/{plen}", "dev", spine)
    _sh("ip", "link", "set", spine, "up")
    for r, rack in enumerate(box.spec.racks):
        bridge, rack_end, spine_end = (
            _link(name, f"b{r}"),
            _link(name, f"u{r}"),
            _link(name, f"c{r}"),
        )
        _sh("ip", "link", "add", bridge, "type", "bridge")
        _sh("ip", "link", "set", bridge, "up")
        _sh("ip", "link", "add", rack_end, "type", "veth", "peer", "name", spine_end)
        _sh("ip", "link", "set", rack_end, "master", bridge, "up")
        _sh("ip", "link", "set", spine_end, "master", spine, "up")
        _tbf(rack_end, rack.uplink_mbit)  # spine -> rack
        _tbf(spine_end, rack.uplink_mbit)  # rack -> spine
    _, cg_root = _cgroup_layout()
    nodes = {n.name: _node(box, n, cg_root / name) for n in box.nodes}
    _weigh(cg_root, cg_root / name, len(nodes))
    return BoxState(name, box.host_address, plen, nodes, {})


def _node(box: Box, node: BoxNode, cg_dir: Path) -> NodeState:
    name, kind = box.name, box.spec.kinds[node.kind]
    ns, host_end = netns_name(name, node.name), _link(name, f"n{node.index}")
    rack = box.spec.racks[node.rack]
    _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", NODE_IFACE, "netns", ns)
    _sh("ip", "link", "set", host_end, "master", _link(name, f"b{node.rack}"), "up")
    addr = box.address(node)
    _sh("ip", "addr", "add", f"{addr}/{box.network.prefixlen}", "dev", NODE_IFACE, netns=ns)
    _sh("ip", "link", "set", NODE_IFACE, "up", netns=ns)
    _sh("ip", "link", "set", "lo", "up", netns=ns)
    _tbf(host_end, kind.nic_mbit)  # into the node
    _tbf(NODE_IFACE, kind.nic_mbit, netns=ns)  # out of the node
    cgroup = _make_cgroup(cg_dir / node.name, kind.cpu)
    return NodeState(
        node.name,
        node.kind,
        rack.name,
        ns,
        addr,
        NODE_IFACE,
        str(cgroup),
        kind.cpu,
        kind.max_running_requests,
        make_acct(name, node.name),
    )


# ---------------------------------------------------------------- inside a node
def node_argv(node: NodeState, argv: list[str]) -> list[str]:
    """`argv` run inside the node: the shell joins the node's cgroup and its accounting
    group, if any (its children inherit both), then `ip netns exec` replaces it in the
    node's namespace."""
    script = (
        'echo $$ > "$1/cgroup.procs" && { [ -z "$3" ] || echo $$ > "$3/cgroup.procs"; } '
        '&& ns="$2" && shift 3 && exec ip netns exec "$ns" "$@"'
    )
    return ["sh", "-c", script, "sh", node.cgroup, node.netns, node.acct, *argv]


_BUSY = (
    "import time,sys\n"
    "w0,c0=time.monotonic(),time.process_time()\n"
    "while time.monotonic()-w0<float(sys.argv[1]): pass\n"
    "print((time.process_time()-c0)/(time.monotonic()-w0))\n"
)


def _cpu_check(node: NodeState, seconds: float) -> float:
    """CPU seconds per wall second a busy loop gets in the node's cgroup."""
    out = subprocess.run(
        node_argv(node, [sys.executable, "-c", _BUSY, str(seconds)]),
        capture_output=True,
        text=True,
        timeout=30 + seconds,
    )
    if out.returncode != 0:
        raise BoxError(f"node {node.name}: the CPU check failed: {out.stderr.strip()}")
    return round(float(out.stdout.strip()), 3)


def load_state(box_name: str) -> BoxState:
    path = state_dir(box_name) / "state.json"
    if not path.is_file():
        raise UsageError(f"box {box_name!r} is not up (no {path}); run `areal-hex box up BOX.yaml`")
    try:
        raw = json.loads(path.read_text())
        raw["nodes"] = {k: NodeState(**v) for k, v in raw["nodes"].items()}
        return BoxState(**raw)
    except (ValueError, TypeError, KeyError) as exc:
        raise UsageError(
            f"{path} is not a box state this version reads ({exc}); bring the box up again"
        ) from None


# ---------------------------------------------------------------- down
def down(box_name: str) -> list[str]:
    """Remove everything of box `box_name`, found by name; what was removed."""
    removed: list[str] = []
    for ns in leftover_netns(box_name):
        kill_pids(_netns_pids(ns))
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        removed.append(f"netns {ns}")
    removed += remove_cgroups(box_name)
    for link in leftover_links(box_name):  # a veth's peer goes with it; qdiscs with both
        subprocess.run(["ip", "link", "del", link], capture_output=True)
        removed.append(f"link {link}")
    shutil.rmtree(state_dir(box_name), ignore_errors=True)
    _remove_if_empty(STATE_ROOT)
    return removed


def leftover_netns(box_name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix(box_name))]


def leftover_links(box_name: str) -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith(prefix(box_name))]


def leftovers(box_name: str) -> list[str]:
    """Everything of the box still on the machine (empty after `down`)."""
    return (
        [f"netns {n}" for n in leftover_netns(box_name)]
        + [f"link {n}" for n in leftover_links(box_name)]
        + [f"cgroup {c}" for c in leftover_cgroups(box_name)]
        + ([f"state {state_dir(box_name)}"] if state_dir(box_name).exists() else [])
    )


def _netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if p.isdigit()]


# ---------------------------------------------------------------- link check
_RECEIVE = (
    "import socket,sys,time\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
    "s.bind((sys.argv[1],int(sys.argv[2]))); s.listen(1); print('ready',flush=True)\n"
    "c,_=s.accept(); n=0; t0=None\n"
    "while True:\n"
    "    b=c.recv(1<<20)\n"
    "    if t0 is None: t0=time.monotonic()\n"
    "    if not b: break\n"
    "    n+=len(b)\n"
    "print(n,time.monotonic()-t0,flush=True)\n"
)
_SEND = (
    "import socket,sys\n"
    "c=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=60)\n"
    "buf=bytes(1<<20)\n"
    "for _ in range(int(sys.argv[3])): c.sendall(buf)\n"
    "c.close()\n"
)


def transfer_s(src: NodeState, dst: NodeState, mbytes: int, port: int = 39111) -> float:
    """Seconds `mbytes` MiB take from node `src` to node `dst` over TCP, timed by the
    receiver from the first byte to the last: the shaped path's rate, as a test sees it."""
    recv = subprocess.Popen(
        node_argv(dst, [sys.executable, "-c", _RECEIVE, dst.address, str(port)]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert recv.stdout is not None
        if recv.stdout.readline().strip() != "ready":
            raise BoxError(
                f"receiver in {dst.name} did not start: {recv.stderr.read() if recv.stderr else ''}"
            )
        send = subprocess.run(
            node_argv(src, [sys.executable, "-c", _SEND, dst.address, str(port), str(mbytes)]),
            capture_output=True,
            text=True,
            timeout=600,
        )
        if send.returncode != 0:
            raise BoxError(f"sender in {src.name} failed: {send.stderr.strip()}")
        out, _ = recv.communicate(timeout=60)
        got, seconds = out.split()
        if int(got) != mbytes << 20:
            raise BoxError(f"{dst.name} received {got} bytes of {mbytes << 20}")
        return float(seconds)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
