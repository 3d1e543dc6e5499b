"""Resource planning for the launcher: which device slots on which hosts, and who gets which rank.

Everything here is pure: the runners (local, ssh/pdsh, slurm, mpi) read the hostfile and the
command line, call these functions, and only then start processes. The rules follow
DeepSpeed's launcher (spec section 9.2):

* The pool is ``{host: [0 .. slots-1]}`` in hostfile order.
* ``--include`` / ``--exclude`` take ``NODE_SPEC[@NODE_SPEC...]`` with
  ``NODE_SPEC = host[:slot[,slot...]]``; a bare host means all of its slots.
* The result always follows hostfile order, slots are sorted and de-duplicated, and hosts
  left without slots are dropped.
* ``num_nodes`` keeps the first N hosts; ``num_gpus`` uses slots ``0 .. N-1`` on every host;
  neither may be combined with include/exclude.

Where DeepSpeed silently does something surprising we raise instead, and say so below:
``num_nodes`` larger than the hostfile, ``num_gpus`` larger than a host's slots, and a
filter that leaves nothing to run on are errors. Ranks are assigned contiguously in
hostfile order, and ``LOCAL_RANK`` is the index on the node (DeepSpeed computes
``RANK % LOCAL_SIZE``, which is wrong when hosts have different slot counts).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "NodePlan",
    "assign_ranks",
    "child_env",
    "decode_world_info",
    "encode_world_info",
    "filter_resources",
    "include_from_visible_devices",
    "parse_env_file",
    "parse_node_spec",
    "select_resources",
]

_NODE_SPEC_FORM = "host[:slot[,slot...]][@host[:slot[,slot...]]...], for example 'worker-0:0,2@worker-1'"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_node_spec(spec: str, option: str = "--include") -> dict[str, list[int] | None]:
    """Parse an include/exclude string into ``{host: slots}``; ``None`` means every slot.

    A host named twice is merged: the slot lists are joined, and a bare mention of the
    host (all slots) wins over any list.

    Args:
        spec: the ``NODE_SPEC[@NODE_SPEC...]`` string.
        option: the command-line option it came from, used in error messages.

    Raises:
        ValueError: for an empty part, an empty host name, or a slot that is not a
            non-negative integer.

    Example:
        >>> parse_node_spec("worker-0:0,2@worker-1")
        {'worker-0': [0, 2], 'worker-1': None}
    """
    parsed: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        part = part.strip()
        if not part:
            raise ValueError(f"{option} {spec!r} has an empty node spec; expected {_NODE_SPEC_FORM}.")
        host, sep, slot_text = part.partition(":")
        host = host.strip()
        if not host:
            raise ValueError(
                f"{option} {spec!r}: node spec {part!r} has no host name; expected {_NODE_SPEC_FORM}."
            )
        slots: list[int] | None = None
        if sep:
            slots = []
            for token in slot_text.split(","):
                token = token.strip()
                if not token.isdigit():
                    raise ValueError(
                        f"{option} {spec!r}: slot {token!r} on host {host!r} is not a non-negative integer; "
                        f"expected {_NODE_SPEC_FORM}."
                    )
                slots.append(int(token))
        if host in parsed:
            previous = parsed[host]
            parsed[host] = None if previous is None or slots is None else previous + slots
        else:
            parsed[host] = slots
    return parsed


def _normalise_pool(pool: Mapping[str, int] | Mapping[str, list[int]]) -> dict[str, list[int]]:
    """Turn ``{host: slots}`` or ``{host: [slot ids]}`` into sorted, de-duplicated slot lists."""
    result: dict[str, list[int]] = {}
    for host, value in pool.items():
        if isinstance(value, bool) or not isinstance(value, int | list | tuple):
            raise ValueError(
                f"Resource pool entry for host {host!r} must be a slot count or a list of slot ids, got {value!r}."
            )
        if isinstance(value, int):
            if value < 0:
                raise ValueError(f"Resource pool entry for host {host!r} has a negative slot count {value}.")
            result[host] = list(range(value))
        else:
            if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in value):
                raise ValueError(
                    f"Resource pool entry for host {host!r} must list non-negative slot ids, got {value!r}."
                )
            result[host] = sorted(set(value))
    return result


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (value != -1 and value < 1):
        raise ValueError(f"{name} must be a positive integer, or -1 for 'use everything', got {value!r}.")


def _check_known(pool: dict[str, list[int]], host: str, slots: list[int] | None) -> None:
    if host not in pool:
        known = ", ".join(pool) or "(none)"
        raise ValueError(f"Hostname '{host}' not found in hostfile. Known hosts: {known}.")
    for slot in slots or []:
        if slot not in pool[host]:
            raise ValueError(f"No slot '{slot}' specified on host '{host}'. Its slots are {pool[host]}.")


def filter_resources(
    pool: Mapping[str, int] | Mapping[str, list[int]], include: str = "", exclude: str = ""
) -> dict[str, list[int]]:
    """The include/exclude step alone: ``{host: slots}`` in pool order, hosts left with no slot dropped
    (so the result may be empty; :func:`select_resources` refuses that).

    Raises:
        ValueError: both filters given, a malformed spec, an unknown host or slot.

    Example:
        >>> filter_resources({"w0": [0, 1, 2, 3]}, exclude="w0:1,2")
        {'w0': [0, 3]}
    """
    resources = _normalise_pool(pool)
    if include and exclude:
        raise ValueError("--include and --exclude are mutually exclusive; give only one of them.")
    if include:
        wanted = parse_node_spec(include, "--include")
        for host, slots in wanted.items():
            _check_known(resources, host, slots)
        # Iterate the pool, not the spec, so the output follows hostfile order.
        resources = {
            host: (slots if wanted[host] is None else sorted(set(wanted[host] or [])))
            for host, slots in resources.items()
            if host in wanted
        }
    elif exclude:
        unwanted = parse_node_spec(exclude, "--exclude")
        for host, slots in unwanted.items():
            _check_known(resources, host, slots)
        resources = {
            host: ([] if unwanted[host] is None else [s for s in slots if s not in (unwanted[host] or [])])
            if host in unwanted
            else slots
            for host, slots in resources.items()
        }

    return {host: slots for host, slots in resources.items() if slots}


def select_resources(
    pool: Mapping[str, int] | Mapping[str, list[int]],
    include: str = "",
    exclude: str = "",
    num_nodes: int = -1,
    num_gpus: int = -1,
) -> dict[str, list[int]]:
    """Apply the launcher's include/exclude/num_nodes/num_gpus filters to a resource pool.

    Args:
        pool: ``{host: slot count}`` (as parsed from a hostfile) or ``{host: [slot ids]}``,
            in hostfile order.
        include: ``NODE_SPEC[@NODE_SPEC...]`` of the slots to use; mutually exclusive
            with ``exclude``.
        exclude: ``NODE_SPEC[@NODE_SPEC...]`` of the slots to leave out; a bare host
            drops that host entirely.
        num_nodes: keep the first N hosts (-1: all).
        num_gpus: use slots ``0 .. N-1`` on every host (-1: all).

    Returns:
        ``{host: sorted slot ids}`` in hostfile order, without empty hosts.

    Raises:
        ValueError: for combined include and exclude, num_nodes/num_gpus together with
            include/exclude, an unknown host or slot, counts beyond what the pool has,
            or an empty result.

    Example:
        >>> pool = {"worker-0": 4, "worker-1": 4}
        >>> select_resources(pool, include="worker-1@worker-0:2,0")
        {'worker-0': [0, 2], 'worker-1': [0, 1, 2, 3]}
        >>> select_resources(pool, num_gpus=2)
        {'worker-0': [0, 1], 'worker-1': [0, 1]}
    """
    resources = _normalise_pool(pool)
    if not any(resources.values()):
        raise ValueError("Unable to proceed, no GPU resources available: the resource pool has no slots.")
    _check_count("num_nodes", num_nodes)
    _check_count("num_gpus", num_gpus)
    if include and exclude:
        raise ValueError("--include and --exclude are mutually exclusive; give only one of them.")
    if (include or exclude) and (num_nodes != -1 or num_gpus != -1):
        raise ValueError(
            "Cannot specify num_nodes/gpus with include/exclude: either pick hosts and slots with "
            "--include/--exclude, or counts with --num_nodes/--num_gpus."
        )

    resources = filter_resources(resources, include, exclude)
    if not resources:
        filters = f"--include {include!r}" if include else f"--exclude {exclude!r}"
        raise ValueError(f"No resources left to run on after applying {filters}.")

    if num_nodes != -1:
        if num_nodes > len(resources):
            raise ValueError(
                f"num_nodes={num_nodes} but only {len(resources)} host(s) have slots: {list(resources)}. "
                "Add hosts to the hostfile or lower --num_nodes."
            )
        resources = dict(list(resources.items())[:num_nodes])
    if num_gpus != -1:
        for host, slots in resources.items():
            missing = [s for s in range(num_gpus) if s not in slots]
            if missing:
                raise ValueError(
                    f"num_gpus={num_gpus} needs slots 0..{num_gpus - 1} on every host, but host '{host}' has "
                    f"{slots}. Lower --num_gpus or fix the hostfile's slots for that host."
                )
        resources = {host: list(range(num_gpus)) for host in resources}
    return resources


def include_from_visible_devices(visible_devices: str, host: str = "localhost") -> str:
    """Turn a ``CUDA_VISIBLE_DEVICES`` value into the equivalent ``--include`` string.

    Example:
        >>> include_from_visible_devices("0,1")
        'localhost:0,1'
    """
    return f"{host}:{visible_devices.strip()}"


def encode_world_info(resources: Mapping[str, list[int]]) -> str:
    """Encode ``{host: [slots]}`` as URL-safe base64 of its JSON, as passed to every node.

    Example:
        >>> encode_world_info({"localhost": [0, 1]})
        'eyJsb2NhbGhvc3QiOiBbMCwgMV19'
    """
    return base64.urlsafe_b64encode(json.dumps(dict(resources)).encode("utf-8")).decode("ascii")


def decode_world_info(encoded: str) -> dict[str, list[int]]:
    """Invert :func:`encode_world_info`, checking the structure.

    Raises:
        ValueError: the text is not base64 of a JSON object mapping host names to lists
            of non-negative integer slots.

    Example:
        >>> decode_world_info("eyJsb2NhbGhvc3QiOiBbMCwgMV19")
        {'localhost': [0, 1]}
    """
    try:
        data = json.loads(base64.urlsafe_b64decode(encoded.encode("ascii")).decode("utf-8"))
    except (binascii.Error, UnicodeError, ValueError) as exc:
        raise ValueError(
            f"World info {encoded!r} is not URL-safe base64 of JSON ({exc}); it should come from encode_world_info()."
        ) from exc
    if not isinstance(data, dict) or not all(
        isinstance(host, str)
        and isinstance(slots, list)
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in slots)
        for host, slots in data.items()
    ):
        raise ValueError(f"World info decodes to {data!r}, expected a JSON object {{host: [slot, ...]}}.")
    return data


@dataclass(frozen=True)
class NodePlan:
    """What one node runs: its slots and the global ranks of the processes it starts.

    Attributes:
        node_rank: the node's index in hostfile order (``CROSS_RANK``).
        host: the host name.
        local_slots: device ids used on this node, one process each.
        global_ranks: the global rank of each local process, aligned with ``local_slots``.
        num_nodes: number of nodes in the run (``CROSS_SIZE``).
        world_size: total number of processes in the run.
    """

    node_rank: int
    host: str
    local_slots: tuple[int, ...]
    global_ranks: tuple[int, ...]
    num_nodes: int
    world_size: int

    @property
    def local_size(self) -> int:
        """Number of processes on this node."""
        return len(self.local_slots)

    @property
    def visible_devices(self) -> str:
        """The ``CUDA_VISIBLE_DEVICES`` value for this node, e.g. ``"0,1"``."""
        return ",".join(str(s) for s in self.local_slots)


def assign_ranks(resources: Mapping[str, list[int]]) -> list[NodePlan]:
    """Assign global ranks contiguously in hostfile order, one process per slot.

    Example:
        >>> plans = assign_ranks({"a": [0, 1], "b": [0, 1]})
        >>> [(p.host, p.global_ranks) for p in plans]
        [('a', (0, 1)), ('b', (2, 3))]
    """
    hosts = [(host, tuple(slots)) for host, slots in resources.items() if slots]
    if not hosts:
        raise ValueError("Cannot assign ranks: no host has any slot.")
    world_size = sum(len(slots) for _, slots in hosts)
    plans: list[NodePlan] = []
    next_rank = 0
    for node_rank, (host, slots) in enumerate(hosts):
        ranks = tuple(range(next_rank, next_rank + len(slots)))
        next_rank += len(slots)
        plans.append(NodePlan(node_rank, host, slots, ranks, len(hosts), world_size))
    return plans


def child_env(
    node_plan: NodePlan, local_index: int, master_addr: str, master_port: int | str
) -> dict[str, str]:
    """The rendezvous environment for the ``local_index``-th process of a node.

    Args:
        node_plan: the node's plan from :func:`assign_ranks`.
        local_index: the process's index on the node, ``0 .. local_size-1``.
        master_addr: address of the rank-0 host.
        master_port: TCP port of the rendezvous, 1..65535.

    Returns:
        ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE``, ``CROSS_RANK``,
        ``CROSS_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` as strings.

    Example:
        >>> plan = assign_ranks({"a": [0, 1], "b": [0, 1]})[1]
        >>> child_env(plan, 1, "10.0.0.1", 29500)["RANK"]
        '3'
    """
    if (
        isinstance(local_index, bool)
        or not isinstance(local_index, int)
        or not 0 <= local_index < node_plan.local_size
    ):
        raise ValueError(
            f"local_index must be in [0, {node_plan.local_size}) for host '{node_plan.host}', got {local_index!r}."
        )
    port_text = str(master_port).strip()
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"master_port must be an integer in 1..65535, got {master_port!r}.")
    if not master_addr:
        raise ValueError("master_addr must be a non-empty host name or IP address.")
    return {
        "RANK": str(node_plan.global_ranks[local_index]),
        "LOCAL_RANK": str(local_index),
        "WORLD_SIZE": str(node_plan.world_size),
        "LOCAL_SIZE": str(node_plan.local_size),
        "CROSS_RANK": str(node_plan.node_rank),
        "CROSS_SIZE": str(node_plan.num_nodes),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(int(port_text)),
    }


def parse_env_file(text: str, source: str = "<env file>") -> dict[str, str]:
    """Parse a ``.deepspeed_env`` / ``.shardwise_env`` file of ``KEY=VALUE`` lines.

    Each line is split on the first ``=`` (values may contain ``=``); blank lines and
    lines starting with ``#`` are skipped; a later line overrides an earlier one.

    Raises:
        ValueError: a line has no ``=`` or its key is not a valid variable name; the
            message names the source and line number.

    Example:
        >>> parse_env_file("# network\\nNCCL_IB_DISABLE=1\\nOPTS=a=b\\n")
        {'NCCL_IB_DISABLE': '1', 'OPTS': 'a=b'}
    """
    env: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _ENV_NAME.match(key):
            raise ValueError(
                f"Bad line in environment file {source}:{lineno}: {raw!r}. Expected KEY=VALUE with KEY a "
                "variable name (letters, digits, '_'; no 'export' prefix)."
            )
        env[key] = value
    return env
