"""A cluster in a box: several "nodes" on loopback, with stand-ins for ssh, pdsh, srun and mpirun.

Multi-node launches are tested without containers, sshd or a network beyond ``lo``: the
hostfile names ``127.0.0.1``, ``127.0.0.2``, ``127.0.0.3``... (all of 127/8 routes to the
loopback interface), and :func:`install_stand_ins` writes executables named ``ssh``, ``pdsh``,
``srun`` and ``mpirun`` into a directory the test puts first on ``PATH``. The launcher's real
runner code then runs unchanged: it builds its real command lines and starts them.

What each stand-in does, as its real counterpart would on a cluster:

* ``ssh [options] HOST COMMAND``: runs ``COMMAND`` with ``bash -c`` under ``env -i`` (only
  ``HOME`` and a system ``PATH``, as a fresh remote login has), in the node's own home
  directory ``ROOT/<host>`` (the node-local working directory), so a variable the launcher
  forgot to export is missing on the "node" exactly as it would be remotely. ``bash`` replaces
  the stand-in (exec), so the launcher's parent-death signal reaches the remote side.
* ``pdsh -w H1,H2 [-S] [-f N] COMMAND``: the same, once per host, ``%n`` replaced by the
  host's index and ``%h`` by its name; with ``-S`` it exits with the largest exit code.
* ``srun -n N [--nodes K] [--nodelist ...] [-K|--kill-on-bad-exit[=1]] [--export=ALL,K=V]
  PROGRAM``: ``N`` tasks spread evenly over the nodes (``--nodelist``, else the allocation
  ``SLURM_JOB_NODELIST``), with ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
  ``SLURM_STEP_ID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_TASKS_PER_NODE`` and
  ``SLURM_STEP_NODELIST``; the environment is this one for ``--export=ALL`` (srun's meaning),
  else only the listed variables. Each node's tasks run under a node daemon of their own (as
  ``slurmstepd``); a daemon that dies ends the step (a node failure), and so does a task that
  exits non-zero with ``--kill-on-bad-exit`` (else, as with Slurm's default ``KillOnBadExit=0``,
  the others run on). The step is stopped as Slurm does: SIGCONT and SIGTERM, SIGKILL after
  ``KillWait`` (30 s).
* ``mpirun -n N -hostfile F [--mca K V] [-x K=V] PROGRAM`` (Open MPI): ``N`` ranks placed by
  the hostfile's slots, with ``OMPI_COMM_WORLD_*``, under ``env -i`` plus the ``-x`` variables,
  each node's under a node daemon (as ``orted``). As Open MPI does by default, a rank that
  exits non-zero or a lost daemon aborts the job: SIGCONT and SIGTERM to every rank, SIGKILL
  after 2 s.

Every remote process gets ``CLUSTER_BOX_NODE`` (its host) and ``CLUSTER_BOX_NODE_DIR`` (that
node's local directory, ``ROOT/<host>``), so a test can tell the nodes apart; no real
launcher sets them and the launcher must not need them.

Example:
    >>> import tempfile, pathlib
    >>> box = pathlib.Path(tempfile.mkdtemp())
    >>> bin_dir = install_stand_ins(box)
    >>> sorted(p.name for p in bin_dir.iterdir())
    ['mpirun', 'pdsh', 'srun', 'ssh']
    >>> write_hostfile(box / "hostfile", 2).read_text()
    '127.0.0.1 slots=1\\n127.0.0.2 slots=1\\n'
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["SYSTEM_PATH", "install_stand_ins", "node_dir", "write_hostfile"]

#: The ``PATH`` a fresh remote shell gets (the stand-ins' ``env -i`` keeps only this and ``HOME``).
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"

# The stand-ins are small standalone scripts (run by this interpreter, importing nothing from
# shardwise), so they behave the same whatever the caller's environment holds.
_COMMON = r'''
import os, signal, subprocess, sys
ROOT = {root!r}
SYSTEM_PATH = {system_path!r}

def node_dir(host):
    home = os.path.join(ROOT, host)
    os.makedirs(home, exist_ok=True)
    return home

def node_env(host, extra=None):
    home = node_dir(host)
    env = {{"HOME": home, "PATH": SYSTEM_PATH, "CLUSTER_BOX_NODE": host, "CLUSTER_BOX_NODE_DIR": home}}
    env.update(extra or {{}})
    return home, env

def die_with_parent():
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

def run_all(children):
    """Wait for every child; SIGTERM to this stand-in reaches them all."""
    def stop(signum, frame):
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return [child.wait() for child in children]

def signal_groups(pids, signals):
    for pid in pids:
        for sig in signals:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass

def node_daemon(tasks, grace):
    """Fork this node's daemon (slurmstepd, orted): it starts the node's tasks, each in a process
    group of its own, and exits with the largest exit code (128 + signal for a killed task). A
    SIGTERM to it stops its tasks as Slurm and Open MPI do: SIGCONT (a stopped task runs again)
    and SIGTERM, SIGKILL after ``grace`` seconds. A task gets SIGTERM if its daemon dies
    (``kill -9`` of the daemon is a lost node). Returns the daemon's pid.

    Waiting is ``os.wait`` (not ``Popen.wait``, whose lock a signal handler that polls would
    wait on forever)."""
    pid = os.fork()
    if pid:
        return pid
    die_with_parent()
    pids, stopping = [], []
    def on_term(signum, frame):
        if not stopping:
            stopping.append(signum)
            signal_groups(pids, (signal.SIGCONT, signal.SIGTERM))
            signal.alarm(max(1, int(grace)))
    signal.signal(signal.SIGALRM, lambda signum, frame: signal_groups(pids, (signal.SIGKILL,)))
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    # the Popen objects stay referenced: a collected one would be reaped behind os.wait's back
    children = [subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=die_with_parent)
                for argv, env in tasks]
    pids.extend(child.pid for child in children)
    if stopping:  # told to stop while the tasks were starting: stop them now
        signal_groups(pids, (signal.SIGCONT, signal.SIGTERM))
    codes = {{}}
    while len(codes) < len(pids):
        done, status = os.wait()
        if done in pids:
            codes[done] = os.waitstatus_to_exitcode(status)
    os._exit(max(128 - c if c < 0 else c for c in codes.values()))

def run_nodes(daemons, kill_on_bad_exit):
    """Wait for the node daemons; a daemon killed by a signal (a lost node), or with
    ``kill_on_bad_exit`` one that ended non-zero, stops the others. Returns the first failed
    daemon's exit code (128 + signal when killed), else 0."""
    codes, failed = {{}}, []
    def on_term(signum, frame):
        for pid in daemons:
            if pid not in codes:
                os.kill(pid, signal.SIGTERM)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while len(codes) < len(daemons):
        pid, status = os.wait()
        if pid not in daemons:
            continue
        code = codes[pid] = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed.append(128 - code if code < 0 else code)
            if code < 0 or kill_on_bad_exit:
                on_term(signal.SIGTERM, None)
    return failed[0] if failed else 0

def hostfile_slots(path):
    slots = []
    for line in open(path, encoding="utf-8"):
        line = line.split("#")[0].strip()
        if line:
            host, *rest = line.split()
            count = int(next((r.split("=")[1] for r in rest if r.startswith("slots=")), "1"))
            slots.append((host, count))
    return slots
'''

_SSH = r'''
args = sys.argv[1:]
with_value = {"-p", "-o", "-i", "-l", "-F", "-E", "-b", "-c", "-J", "-L", "-R", "-D", "-W", "-w", "-m", "-O", "-Q", "-S"}
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag in with_value and args:
        args.pop(0)
host, command = args[0], " ".join(args[1:])
home, env = node_env(host)
os.chdir(home)
die_with_parent()
os.execve("/bin/bash", ["bash", "-c", command], env)
'''

_PDSH = r'''
args = sys.argv[1:]
hosts, strict = [], False
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag == "-w":
        hosts = args.pop(0).split(",")
    elif flag in ("-f", "-R", "-l", "-t", "-u"):
        args.pop(0)
    elif flag == "-S":
        strict = True
command = " ".join(args)
children = []
for index, host in enumerate(hosts):
    home, env = node_env(host)
    line = command.replace("%n", str(index)).replace("%h", host)
    children.append(subprocess.Popen(["/bin/bash", "-c", line], env=env, cwd=home, preexec_fn=die_with_parent))
codes = run_all(children)
sys.exit(max(codes) if strict else 0)
'''

_SRUN = r'''
args = sys.argv[1:]
ntasks, nodes, nodelist, export, kill_on_bad_exit = 1, None, None, "ALL", False
while args and args[0].startswith("-"):
    flag = args.pop(0)
    name, _, value = flag.partition("=")
    if name in ("-n", "--ntasks", "-N", "--nodes", "-w", "--nodelist", "--gpus-per-node") and not value:
        value = args.pop(0)
    if name in ("-n", "--ntasks"):
        ntasks = int(value)
    elif name in ("-N", "--nodes"):
        nodes = int(value)
    elif name in ("-w", "--nodelist"):
        nodelist = value.split(",")
    elif name == "--export":
        export = value
    elif name in ("-K", "--kill-on-bad-exit"):
        kill_on_bad_exit = value in ("", "1")
allocation = [h for h in os.environ.get("SLURM_JOB_NODELIST", "").split(",") if h]  # the job's nodes
hosts = nodelist or (allocation or ["127.0.0.1"])[: nodes or len(allocation) or 1]
per_node = ntasks // len(hosts)
if export.split(",")[0] == "ALL":
    base = dict(os.environ)
    pairs = export.split(",")[1:]
else:
    base = {"PATH": SYSTEM_PATH}
    pairs = export.split(",") if export != "NONE" else []
for pair in pairs:
    key, _, value = pair.partition("=")
    base[key] = value if _ else os.environ.get(key, "")
by_node = [[] for _ in hosts]
for rank in range(ntasks):
    node = rank // per_node
    env = dict(base)
    env.update({
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(node),
        "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_NTASKS": str(ntasks),
        "SLURM_STEP_TASKS_PER_NODE": "%d(x%d)" % (per_node, len(hosts)), "SLURM_STEP_NODELIST": ",".join(hosts),
        "SLURM_JOB_NODELIST": ",".join(hosts), "CLUSTER_BOX_NODE": hosts[node],
        "CLUSTER_BOX_NODE_DIR": node_dir(hosts[node]),
    })
    by_node[node].append((args, env))
daemons = [node_daemon(tasks, grace=30.0) for tasks in by_node]
sys.exit(run_nodes(daemons, kill_on_bad_exit=kill_on_bad_exit))
'''

_MPIRUN = r'''
args = sys.argv[1:]
ntasks, hostfile, exports = 1, None, {}
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag in ("-n", "-np"):
        ntasks = int(args.pop(0))
    elif flag in ("-hostfile", "--hostfile"):
        hostfile = args.pop(0)
    elif flag == "--mca":
        args.pop(0); args.pop(0)
    elif flag == "-x":
        key, _, value = args.pop(0).partition("=")
        exports[key] = value if _ else os.environ.get(key, "")
placement = []
for host, count in (hostfile_slots(hostfile) if hostfile else [("127.0.0.1", ntasks)]):
    placement += [(host, local, count) for local in range(count)]
by_node = {}
for rank in range(ntasks):
    host, local, count = placement[rank]
    home, env = node_env(host, exports)
    env.update({
        "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(ntasks),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local), "OMPI_COMM_WORLD_LOCAL_SIZE": str(count),
    })
    by_node.setdefault(host, []).append((args, env))
daemons = [node_daemon(tasks, grace=2.0) for tasks in by_node.values()]
sys.exit(run_nodes(daemons, kill_on_bad_exit=True))
'''

_STAND_INS = {"ssh": _SSH, "pdsh": _PDSH, "srun": _SRUN, "mpirun": _MPIRUN}


def node_dir(root: Path, host: str) -> Path:
    """The node-local home and working directory of ``host`` in the box rooted at ``root``."""
    return Path(root) / host


def install_stand_ins(root: Path) -> Path:
    """Write the ``ssh``/``pdsh``/``srun``/``mpirun`` stand-ins under ``root/bin``; return that
    directory (put it first on ``PATH``). Node directories are created under ``root``."""
    bin_dir = Path(root) / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    common = _COMMON.format(root=str(Path(root).resolve()), system_path=SYSTEM_PATH)
    for name, body in _STAND_INS.items():
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{common}\n{body}", encoding="utf-8")
        path.chmod(0o755)
    return bin_dir


def write_hostfile(path: Path, nodes: int, slots: int = 1) -> Path:
    """A hostfile of ``nodes`` loopback "hosts" ``127.0.0.1``... with ``slots`` each."""
    path = Path(path)
    path.write_text("".join(f"127.0.0.{i + 1} slots={slots}\n" for i in range(nodes)), encoding="utf-8")
    return path
