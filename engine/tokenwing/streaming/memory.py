"""What memory this process may use: free RAM and the process's memory limit (cgroup v1 or v2)."""

from __future__ import annotations

import os
from dataclasses import dataclass

_UNLIMITED = 1 << 60
HEADROOM = 512 << 20  # left free for other programs (spec section 4: 0.5 GB in Run My AI's presets)


@dataclass(frozen=True)
class MemoryInfo:
    total: int  # physical RAM
    available: int  # MemAvailable: free plus reclaimable cache
    limit: int  # the cgroup limit (or total when there is none)
    used_in_group: int  # what the cgroup already charges (0 without a limit)

    @property
    def usable(self) -> int:
        """Bytes this process can still take: free RAM, and room under its memory limit."""
        return max(0, min(self.available, self.limit - self.used_in_group))


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _meminfo(root: str) -> tuple[int, int]:
    values: dict[str, int] = {}
    with open(os.path.join(root, "proc/meminfo")) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                values[key] = int(parts[0]) * 1024
    total = values.get("MemTotal", 0)
    return total, values.get("MemAvailable", values.get("MemFree", 0))


def _cgroup_paths(root: str) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and v1 memory path, from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            for line in f:
                hid, controllers, path = line.rstrip("\n").split(":", 2)
                if hid == "0" and controllers == "":
                    v2 = path
                elif "memory" in controllers.split(","):
                    v1 = path
    except OSError:
        pass
    return v2, v1


def memory_info(root: str = "/") -> MemoryInfo:
    """Reads /proc and the cgroup file system under `root` (tests point it at a fake tree)."""
    total, available = _meminfo(root)
    limit, used = _UNLIMITED, 0
    v2, v1 = _cgroup_paths(root)
    cg = os.path.join(root, "sys/fs/cgroup")
    candidates: list[tuple[str, str, str]] = []
    if v1 is not None:
        base = os.path.join(cg, "memory", v1.lstrip("/"))
        candidates.append((base, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    if v2 is not None:
        base = os.path.join(cg, v2.lstrip("/"))
        candidates.append((base, "memory.max", "memory.current"))
    for base, limit_file, usage_file in candidates:
        # A limit set on any ancestor applies too: walk up to the root of the hierarchy.
        d = base
        while True:
            lim = _read_int(os.path.join(d, limit_file))
            if lim is not None and lim < limit:
                limit = lim
                used = _read_int(os.path.join(d, usage_file)) or 0
            parent = os.path.dirname(d)
            if parent == d or not parent.startswith(cg):
                break
            d = parent
    limit = min(limit, total) if total else limit
    return MemoryInfo(total, available, limit, used if limit < total else 0)


def expert_budget(info: MemoryInfo, headroom: int, reserved: int) -> int:
    """RAM for the expert cache: what the process can still take, minus the engine's own non-expert memory
    still to come (KV cache, compute buffers). The headroom for other programs comes off the machine's free
    RAM, not off a memory limit: under a cgroup cap the other programs are outside the group. Never negative;
    the slot planner raises a too-small budget to its minimum itself."""
    room = min(info.available - headroom, info.limit - info.used_in_group)
    return max(0, room - reserved)
