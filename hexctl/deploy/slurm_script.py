"""The batch script of a Slurm job (`slurm.py` builds the job it renders).

The script, top to bottom: `#SBATCH` lines (one block per component, `#SBATCH hetjob`
between them); the site's setup lines; host names of every component; the run's config
with those hosts (`slurm_runtime config`); v0 (`deploy.prepare`, kept on a requeue);
Redis; the inference servers (waits until healthy); trainer and controller; then a watch
loop that restarts a dead inference server (up to `run.max_restarts`) and ends the job
when the trainer finishes or a service fails. SIGUSR1 (`--signal=B:USR1@N`, before the
time limit) and SIGTERM stop the services in order (controller first: it gives back its
admissions), write the report, and after SIGUSR1 requeue the job.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from hexctl.deploy.common import PREDICTION, Deployment
from hexctl.deploy.slurm_site import KindPlacement, Placement, SiteConfig, megabytes
from hexctl.job.layout import CONFIG_PLACEHOLDER

SCRIPT = "job.sbatch"
RUNTIME_CONFIG = "runtime/config.yaml"  # config + secrets, written by the job (0600)
q = shlex.quote


@dataclass
class Component:
    """One heterogeneous-job component: `nodes` nodes, each with the same request."""

    name: str
    place: Placement
    nodes: int = 1
    gpus_per_node: int = 0
    services: list[str] = field(default_factory=list)

    @property
    def share(self) -> tuple[int, str]:
        """(--cpus-per-task, --mem) per node: its GPUs' share of a GPU kind's node."""
        if isinstance(self.place, KindPlacement):
            return self.place.share(self.gpus_per_node)
        return self.place.cpus, self.place.mem

    @property
    def gres(self) -> str | None:
        place = self.place
        if not isinstance(place, KindPlacement) or not place.gpus or not self.gpus_per_node:
            return None
        kind = f"{place.gres_type}:" if place.gres_type else ""
        return f"gpu:{kind}{self.gpus_per_node}"


@dataclass
class Step:
    """One service as a job step: which component, which of its nodes, what it gets."""

    name: str
    role: str
    component: int
    command: list[str]
    nodes: list[int]  # node indices within the component
    gpus: int = 0  # per node; 0 on CPU-only nodes
    cpus: int = 1
    mem: str | None = None
    devices: list[int] = field(default_factory=list)  # planned GPU ids
    # a trainer across GPU kinds: one step per kind, this one's first torchrun node rank
    rank_offset: int = 0


@dataclass
class SlurmJob:
    d: Deployment
    site: SiteConfig
    components: list[Component]
    steps: list[Step]
    server_slots: list[tuple[int, int]]  # inference server i -> (component, node index)

    @property
    def run_dir(self) -> Path:
        return self.d.cfg.run.run_dir()

    @property
    def trainers(self) -> list[Step]:
        """The trainer's steps: one, or one per GPU kind of a trainer across kinds (the
        first, `trainer`, holds node rank 0 and the rendezvous)."""
        return [s for s in self.steps if s.role == "trainer"]


# ---------------------------------------------------------------- #SBATCH lines


def sbatch_header(job: SlurmJob, out_dir: Path) -> list[str]:
    site = job.site
    run_id = job.d.cfg.run.run_id or "areal-hex"
    lines = [
        f"#SBATCH --job-name={site.job_name or run_id}",
        f"#SBATCH --output={out_dir}/slurm-%j.out",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=B:USR1@{site.signal_s}",
        "#SBATCH --requeue" if site.requeue else "#SBATCH --no-requeue",
    ]
    blocks = [_component_block(c, site) for c in job.components]
    if not site.hetjob:
        return lines + _single_allocation(job)
    for i, (comp, block) in enumerate(zip(job.components, blocks, strict=True)):
        if i:
            lines.append("#SBATCH hetjob")
        lines.append(f"# component {i}: {comp.name} ({', '.join(comp.services)})")
        lines += block
    return lines


def _component_block(comp: Component, site: SiteConfig) -> list[str]:
    p = comp.place
    cpus, mem = comp.share
    opts = [f"--nodes={comp.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}"]
    opts.append(f"--mem={mem}")
    if comp.gres:
        opts.append(f"--gres={comp.gres}")
    return [f"#SBATCH {o}" for o in [*_common(p, site), *opts, *p.extra]]


def _common(p: Placement, site: SiteConfig) -> list[str]:
    opts = [f"--time={site.time}"]
    if p.partition:
        opts.append(f"--partition={p.partition}")
    if p.constraint:
        opts.append(f"--constraint={p.constraint}")
    if site.account:
        opts.append(f"--account={site.account}")
    if site.qos:
        opts.append(f"--qos={site.qos}")
    return opts


def _single_allocation(job: SlurmJob) -> list[str]:
    """`hetjob: false`: one allocation as many nodes as the largest component, the
    largest per-node CPUs and memory, and every component's GPUs on the nodes it uses."""
    comps = job.components
    nodes = max(c.nodes for c in comps)
    cpus = max(c.share[0] for c in comps)
    mem = max((c.share[1] for c in comps), key=megabytes)
    lines = [f"# one allocation for {', '.join(c.name for c in comps)} (site hetjob: false)"]
    opts = [*_common(comps[0].place, job.site), f"--nodes={nodes}", "--ntasks-per-node=1"]
    opts += [f"--cpus-per-task={cpus}", f"--mem={mem}"]
    gpus = sum(c.gpus_per_node for c in comps if c.gres)
    gres_types = {c.place.gres_type for c in comps if c.gres}
    if gpus:
        kind = f"{gres_types.pop()}:" if len(gres_types) == 1 and None not in gres_types else ""
        opts.append(f"--gres=gpu:{kind}{gpus}")
    for c in comps:
        opts += [e for e in c.place.extra if e not in opts]
    return lines + [f"#SBATCH {o}" for o in opts]


# ---------------------------------------------------------------- steps


def _argv(cmd: list[str]) -> str:
    """A layout command as shell words: the site's interpreter, the runtime config."""
    if cmd and cmd[0] == "areal-hex":
        cmd = ["{python}", "-m", "hexctl.cli", *cmd[1:]]
    elif cmd and cmd[0] == "python3":
        cmd = ["{python}", *cmd[1:]]
    words = {CONFIG_PLACEHOLDER: '"$CONFIG"', "{python}": '"$PY"'}
    return " ".join(words.get(a, q(a)) for a in cmd)


def _hosts(job: SlurmJob, k: int, nodes: list[int]) -> str:
    return f"$(pick C{k} {' '.join(str(n) for n in nodes)})"


def srun_options(job: SlurmJob, step: Step) -> str:
    opts = []
    if job.site.hetjob:
        opts.append(f"--het-group={step.component}")
    n = len(step.nodes)
    opts += [f'--nodelist="{_hosts(job, step.component, step.nodes)}"']
    opts += [f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1"]
    if step.gpus and job.site.hetjob:
        # its own GPUs and its share of the node; concurrent steps get disjoint GPUs
        gres = job.components[step.component].gres or ""
        kind = gres.rsplit(":", 1)[0]
        opts += ["--exact", f"--gres={kind}:{step.gpus}", f"--cpus-per-task={step.cpus}"]
        opts.append(f"--mem={step.mem}")
    else:
        opts.append("--overlap")  # CPU-light, or sharing the one allocation
    if step.role == "trainer":
        opts.append("--kill-on-bad-exit=1")
    return " ".join(opts)


def step_env(job: SlurmJob, step: Step) -> str:
    env = ["PYTHONUNBUFFERED=1", f"OMP_NUM_THREADS={step.cpus}"]
    if step.gpus and not job.site.hetjob and step.devices:
        env.append(f"CUDA_VISIBLE_DEVICES={','.join(str(d) for d in step.devices)}")
    if step.role == "trainer":
        first = job.trainers[0]
        env += [
            f'PET_MASTER_ADDR="${{C{first.component}[{first.nodes[0]}]}}"',
            f"PET_MASTER_PORT={job.site.master_port}",
            f"PET_NNODES={sum(len(t.nodes) for t in job.trainers)}",
        ]
        if step.rank_offset:  # `areal-hex train` adds it to the node rank
            env.append(f"AREAL_HEX_NODE_RANK_OFFSET={step.rank_offset}")
    return "env " + " ".join(env)


def step_line(job: SlurmJob, step: Step) -> str:
    cmd = _argv(step.command)
    if step.role == "trainer":
        # torchrun's node rank is the node's index in the step
        cmd = f"bash -c 'PET_NODE_RANK=$SLURM_NODEID exec \"$@\"' trainer {cmd}"
    return f"launch {q(step.name)} {srun_options(job, step)} {step_env(job, step)} {cmd}"


# ---------------------------------------------------------------- the script


def task_host_args(job: SlurmJob) -> list[str]:
    """`NAME="$H0","$H1"` for each workflow task that listens on a port: the node of each
    instance's step, where the controller reaches it."""
    where = {s.name: (s.component, s.nodes[0]) for s in job.steps if s.role == "worker"}
    hosts: dict[str, list[str]] = {}
    for svc in job.d.layout.by_role("worker"):
        if svc.task is not None and svc.port is not None and svc.name in where:
            k, r = where[svc.name]
            hosts.setdefault(svc.task, []).append(f'"${{C{k}[{r}]}}"')
    return [f"{q(name)}={','.join(h)}" for name, h in hosts.items()]


def batch_script(job: SlurmJob, out_dir: Path) -> str:
    cfg, site = job.d.cfg, job.site
    servers = [s for s in job.steps if s.role == "inference"]
    hosts = [f'"${{C{k}[{r}]}}"' for k, r in job.server_slots]
    runtime = f'"$PY" -m hexctl.runtime.slurm config "$OUT" --servers {" ".join(hosts)}'
    if site.redis.mode == "internal":
        runtime += ' --redis-host "${C0[0]}"'
    runtime += "".join(f" --task {arg}" for arg in task_host_args(job))
    if site.redis.password_file:
        runtime += f" --redis-password-file {q(site.redis.password_file)}"
    prediction = job.d.prepare_command(str(out_dir / PREDICTION))
    prep = Step("prepare", "prepare", 0, prediction, [0])
    prepare = f"srun --job-name=prepare {srun_options(job, prep)} {_argv(prep.command)}"
    nodelist = [
        f'mapfile -t C{k} < <(scontrol show hostnames "$SLURM_JOB_NODELIST'
        + (f'_HET_GROUP_{k}")' if site.hetjob else '")')
        for k in range(len(job.components))
    ]
    starts = [f"    {q(s.name)}) {step_line(job, s)} ;;" for s in job.steps]
    server_names = " ".join(q(s.name) for s in servers)
    values = {
        "header": "\n".join(sbatch_header(job, out_dir)),
        "setup": "\n".join(site.setup) or "# (no site setup lines)",
        "out": q(str(out_dir)),
        "run_dir": q(str(job.run_dir)),
        "python": q(site.python),
        "run_id": cfg.run.run_id or "",
        "max_restarts": str(cfg.run.max_restarts),
        "start_timeout": str(site.start_timeout_s),
        "stop_grace": str(int(cfg.rollout.stop_grace_s) + 15),
        "requeue": "1" if site.requeue else "0",
        "nodelists": "\n".join(nodelist),
        "runtime": runtime,
        "prepare": prepare,
        "starts": "\n".join(starts),
        "servers": server_names,
        "trainers": " ".join(q(s.name) for s in job.trainers),
        "workers": " ".join(q(s.name) for s in job.steps if s.role == "worker"),
        "redis": REDIS_START if any(s.role == "redis" for s in job.steps) else "",
        "comment": f"{cfg.run.run_id} of plan {job.d.plan.cluster} ({job.d.plan.model})",
    }
    return TEMPLATE.format(**values)


REDIS_START = """\
start redis
"$PY" -m hexctl.runtime.slurm wait redis "$CONFIG" --timeout "$START_TIMEOUT" \\
  --pids "${PIDS[redis]}" || fail redis
"""

TEMPLATE = """\
#!/bin/bash
# areal-hex: run {comment} as a Slurm job.
# Rendered by `areal-hex deploy --target slurm` (docs/slurm.md); submit with
#   sbatch {out}/job.sbatch
{header}

set -uo pipefail
{setup}

OUT={out}
RUN_DIR={run_dir}
PY={python}
CONFIG="$OUT/runtime/config.yaml"
LOGS="$RUN_DIR/logs"
MAX_RESTARTS={max_restarts}
START_TIMEOUT={start_timeout}
STOP_GRACE={stop_grace}
REQUEUE={requeue}
SERVERS=({servers})
TRAINERS=({trainers})  # the trainer's steps: one per GPU kind it spans
WORKERS=({workers})  # the workflow's tasks beyond generate and train
mkdir -p "$LOGS"
echo "areal-hex: job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}) runs {run_id} in $RUN_DIR"

# Host names of each component (its nodes in order).
{nodelists}

declare -A PIDS=() RESTARTS=() DONE=()
STOP=""
trap 'STOP=timeout; echo "areal-hex: SIGUSR1 (time limit near): stopping"' USR1
trap 'STOP=cancel; echo "areal-hex: SIGTERM: stopping"' TERM INT

pick() {{  # pick ARRAY I [J ...]: those host names, comma-separated
  local -n hosts_=$1
  shift
  local out=() i
  for i in "$@"; do out+=("${{hosts_[$i]}}"); done
  (IFS=,; echo "${{out[*]}}")
}}

launch() {{  # launch NAME SRUN-OPTIONS... COMMAND...: one service as a background step
  local name=$1
  shift
  echo "=== start $name (job $SLURM_JOB_ID): $*" >>"$LOGS/$name.log"
  srun --job-name="$name" "$@" >>"$LOGS/$name.log" 2>&1 &
  PIDS[$name]=$!
}}

start() {{
  case "$1" in
{starts}
  esac
}}

alive() {{ [ -n "${{PIDS[$1]:-}}" ] && kill -0 "${{PIDS[$1]}}" 2>/dev/null; }}

step_id() {{  # step_id NAME: the running step of that name (squeue), if any
  squeue --steps --jobs="$SLURM_JOB_ID" --noheader --format="%i %j" 2>/dev/null \
    | awk -v name="$1" '$2 == name {{print $1}}' | tail -n 1
}}

stop_step() {{  # stop_step NAME SECONDS: SIGTERM to its tasks, then end its srun
  local name=$1 pid=${{PIDS[$1]:-}} step i
  [ -n "$pid" ] || return 0
  if kill -0 "$pid" 2>/dev/null; then
    # the signal goes to the service itself (a SIGTERM to srun would kill the step)
    step=$(step_id "$name")
    if [ -n "$step" ]; then scancel --signal=TERM "$step"; else kill -TERM "$pid"; fi
    for ((i = 0; i < $2; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" 2>/dev/null
    for ((i = 0; i < 40; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  fi
  wait "$pid" 2>/dev/null
  return 0
}}

finish() {{  # finish OUTCOME: stop in order, write the report, exit (or requeue)
  local outcome=$1
  stop_step controller "$STOP_GRACE"
  if [ "$outcome" = stopped ] && ! alive trainer && wait "${{PIDS[trainer]}}"; then
    outcome=finished  # the trainer took its last step while the others stopped
  fi
  for s in "${{TRAINERS[@]}}"; do stop_step "$s" 60; done
  "$PY" -m hexctl.cli report "$CONFIG" --outcome "$outcome" >>"$LOGS/report.log" 2>&1 \\
    && tail -n 1 "$LOGS/report.log"
  for s in "${{SERVERS[@]}}" "${{WORKERS[@]}}"; do stop_step "$s" 15; done
  stop_step redis 30
  echo "areal-hex: $outcome; logs in $LOGS"
  if [ "$outcome" = stopped ] && [ "$STOP" = timeout ] && [ "$REQUEUE" = 1 ]; then
    echo "areal-hex: requeueing job $SLURM_JOB_ID (the run resumes from its newest checkpoint)"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  [ "$outcome" = failed ] && exit 1
  exit 0
}}

fail() {{  # fail NAME: say which service failed and where its log is
  echo "areal-hex: $1 failed; last lines of $LOGS/$1.log:"
  tail -n 30 "$LOGS/$1.log"
  finish failed
}}

# The run's config with this job's hosts, then v0 (kept when the run resumes).
{runtime} || exit 1
{prepare} \\
  >>"$LOGS/prepare.log" 2>&1 || fail prepare

{redis}for s in "${{WORKERS[@]}}"; do start "$s"; done
pids=()
for s in "${{SERVERS[@]}}"; do start "$s"; pids+=("${{PIDS[$s]}}"); done
"$PY" -m hexctl.runtime.slurm wait servers "$CONFIG" --timeout "$START_TIMEOUT" \\
  --pids "${{pids[@]}}" || fail "${{SERVERS[0]}}"
for s in "${{TRAINERS[@]}}"; do start "$s"; done
start controller

while [ -z "$STOP" ]; do
  for name in "${{!PIDS[@]}}"; do
    [ -n "${{DONE[$name]:-}}" ] && continue
    alive "$name" && continue
    wait "${{PIDS[$name]}}"
    rc=$?
    DONE[$name]=1
    case "$name" in
      trainer) [ "$rc" = 0 ] && finish finished || fail trainer ;;
      trainer-*) [ "$rc" = 0 ] || fail "$name" ;;  # rank 0's step says when it is done
      controller) [ "$rc" = 0 ] || fail controller ;;  # 0: it produced the run's groups
      redis) fail redis ;;
      *)
        n=${{RESTARTS[$name]:-0}}
        [ "$n" -lt "$MAX_RESTARTS" ] || fail "$name"
        RESTARTS[$name]=$((n + 1))
        unset "DONE[$name]"
        echo "areal-hex: $name exited ($rc); restart $((n + 1)) of $MAX_RESTARTS"
        start "$name"
        ;;
    esac
  done
  sleep 5 &
  wait $!
done
finish stopped
"""
