"""Device profiles: compute rate, power and storage speed of a device, as versioned data with sources.

A :class:`DeviceProfile` is what the paging cost model and the POET planner need to know about a device
we may not be running on (POET style): how fast it computes, what it draws while computing and while
paging, how fast its storage pages tensors out and in, and how much RAM it has. Named profiles are JSON
data files in ``edgetrain/profiles/`` (schema below); every numeric field cites a source (datasheet,
paper table or measurement) in ``sources`` and says in ``provenance`` whether it is ``datasheet``,
``paper``, ``measured`` or ``estimate``. :func:`measure_host` builds the same record for the machine at
hand from short timed runs.

Schema (``schema_version`` 1)::

    {"schema_version": 1, "name": "rpi4", "display_name": "...", "processor": "...", "storage": "...",
     "compute_flops_per_s": float, "active_power_w": float, "memory_power_w": float,
     "page_in_latency_s": float, "page_in_bytes_per_s": float,
     "page_out_latency_s": float, "page_out_bytes_per_s": float, "ram_bytes": int,
     "sources": {field: citation}, "provenance": {field: "datasheet"|"paper"|"measured"|"estimate"},
     "notes": [str, ...]}
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from .errors import ProfileError
from .graph import CostChain

__all__ = ["SCHEMA_VERSION", "NUMERIC_FIELDS", "DeviceProfile", "load_profile", "list_profiles",
           "measure_host", "scale_chain"]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
NUMERIC_FIELDS = ("compute_flops_per_s", "active_power_w", "memory_power_w", "page_in_latency_s",
                  "page_in_bytes_per_s", "page_out_latency_s", "page_out_bytes_per_s", "ram_bytes")
_PROVENANCE = ("datasheet", "paper", "measured", "estimate")
_HOST_CACHE: dict[str, "DeviceProfile"] = {}


@dataclass(frozen=True)
class DeviceProfile:
    """What the planners need to know about one device.

    Attributes:
        name: short key (``load_profile(name)``).
        compute_flops_per_s: sustained floating-point operations per second of training kernels.
        active_power_w: power drawn while computing (POET: compute energy = time x this).
        memory_power_w: power drawn while paging (POET: paging energy = (latency + bytes/throughput)
            x this).
        page_in_latency_s: fixed seconds of reading one paged block back from storage.
        page_in_bytes_per_s: read throughput of the paging storage.
        page_out_latency_s: fixed seconds of writing one paged block out.
        page_out_bytes_per_s: write throughput of the paging storage.
        ram_bytes: main memory (the largest sensible memory budget).
        display_name: readable name.
        processor: processor / accelerator the compute rate refers to.
        storage: the paging medium.
        sources: per numeric field, where the number comes from.
        provenance: per numeric field, ``datasheet``, ``paper``, ``measured`` or ``estimate``.
        notes: caveats.
        schema_version: version of the data format.
    """

    name: str
    compute_flops_per_s: float
    active_power_w: float
    memory_power_w: float
    page_in_latency_s: float
    page_in_bytes_per_s: float
    page_out_latency_s: float
    page_out_bytes_per_s: float
    ram_bytes: int
    display_name: str = ""
    processor: str = ""
    storage: str = ""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    provenance: Mapping[str, str] = field(default_factory=dict, compare=False)
    notes: tuple[str, ...] = field(default=(), compare=False)
    schema_version: int = SCHEMA_VERSION

    def page_out_s(self, nbytes: float) -> float:
        """Seconds to write ``nbytes`` out (latency + bytes / throughput)."""
        return self.page_out_latency_s + nbytes / self.page_out_bytes_per_s

    def page_in_s(self, nbytes: float) -> float:
        """Seconds to read ``nbytes`` back in (latency + bytes / throughput)."""
        return self.page_in_latency_s + nbytes / self.page_in_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["sources"], d["provenance"], d["notes"] = dict(self.sources), dict(self.provenance), list(self.notes)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @staticmethod
    def from_dict(d: Mapping[str, Any], *, origin: str = "profile") -> "DeviceProfile":
        """Validate and load a profile record.

        Args:
            d: the decoded JSON object.
            origin: where it came from, for error messages.

        Returns:
            The profile.

        Raises:
            ProfileError: wrong schema version, a missing or non-positive field, or a field without a
                source or provenance.
        """
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ProfileError(f"{origin}: schema_version is {version!r}, this edgetrain reads version "
                               f"{SCHEMA_VERSION}; convert the file or upgrade edgetrain")
        missing = [k for k in ("name",) + NUMERIC_FIELDS if k not in d]
        if missing:
            raise ProfileError(f"{origin}: missing fields {missing}; every profile needs {list(NUMERIC_FIELDS)}")
        sources, prov = dict(d.get("sources", {})), dict(d.get("provenance", {}))
        for k in NUMERIC_FIELDS:
            v = d[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ProfileError(f"{origin}: {k} must be a positive number, got {v!r}")
            if not sources.get(k):
                raise ProfileError(f"{origin}: field {k} has no entry in 'sources'; cite where it comes from")
            if prov.get(k) not in _PROVENANCE:
                raise ProfileError(f"{origin}: provenance of {k} is {prov.get(k)!r}; use one of {_PROVENANCE}")
        known = {f.name for f in fields(DeviceProfile)}
        extra = sorted(set(d) - known)
        if extra:
            raise ProfileError(f"{origin}: unknown fields {extra}")
        kw = {k: v for k, v in d.items() if k not in ("sources", "provenance", "notes")}
        kw["ram_bytes"] = int(kw["ram_bytes"])
        for k in NUMERIC_FIELDS[:-1]:
            kw[k] = float(kw[k])
        return DeviceProfile(**kw, sources=sources, provenance=prov, notes=tuple(d.get("notes", ())))


def _profiles_dir() -> Any:
    return resources.files("edgetrain") / "profiles"


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def list_profiles() -> list[str]:
    """Names of the bundled device profiles (sorted), then ``"host"`` (measured on demand)."""
    names = sorted(p.name[:-5] for p in _profiles_dir().iterdir() if p.name.endswith(".json"))
    return names + ["host"]


def load_profile(name: str | os.PathLike[str]) -> DeviceProfile:
    """Load a named bundled profile, a JSON file path, or ``"host"`` (:func:`measure_host`, cached).

    Args:
        name: a name from :func:`list_profiles` (case and ``_``/``-`` do not matter) or a path to a
            JSON file in the schema of the module doc.

    Returns:
        The profile.

    Raises:
        ProfileError: unknown name, unreadable file, or invalid contents.
    """
    path = Path(name)
    if path.suffix == ".json" and path.exists():
        try:
            return DeviceProfile.from_dict(json.loads(path.read_text()), origin=str(path))
        except (OSError, json.JSONDecodeError) as e:
            raise ProfileError(f"cannot read device profile {path}: {e}") from e
    key = _normalise(str(name))
    if key == "host":
        if "host" not in _HOST_CACHE:
            _HOST_CACHE["host"] = measure_host()
        return _HOST_CACHE["host"]
    entry = _profiles_dir() / f"{key}.json"
    if not entry.is_file():
        raise ProfileError(f"unknown device profile {name!r}; known: {', '.join(list_profiles())} "
                           "(or pass the path of a JSON profile file)")
    try:
        data = json.loads(entry.read_text())
    except json.JSONDecodeError as e:
        raise ProfileError(f"bundled profile {key}.json is not valid JSON: {e}") from e
    return DeviceProfile.from_dict(data, origin=f"{key}.json")


# ---------------------------------------------------------------------------------------------------
# Measuring the host


def _time_matmul(size: int, min_time_s: float) -> tuple[float, float, int]:
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)   # warm-up (thread pool, caches)
    reps, t0 = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        reps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time_s and reps >= 3:
            return 2.0 * size**3 * reps / elapsed, elapsed, reps


def _rapl_domains() -> list[tuple[str, Path]]:
    """Readable RAPL energy counters: (domain name, energy_uj path)."""
    out = []
    for d in sorted(Path("/sys/class/powercap").glob("intel-rapl*")):
        f = d / "energy_uj"
        try:
            name = (d / "name").read_text().strip()
            int(f.read_text())
        except (OSError, ValueError):
            continue
        out.append((name, f))
    return out


def _read_uj(domains: list[tuple[str, Path]], kind: str) -> float:
    total = 0.0
    for name, f in domains:
        if name.startswith(kind):
            total += int(f.read_text())
    return total


def _storage_speeds(page_dir: str | None, nbytes: int) -> dict[str, float]:
    """Timed write+fsync and cache-dropped read of a temp file; latency from 4 KiB blocks."""
    block = 4096
    payload = os.urandom(1 << 20)
    fd, path = tempfile.mkstemp(prefix="edgetrain-probe-", dir=page_dir)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, payload[: min(len(payload), nbytes - written)])
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        lat_out = []
        for i in range(8):
            t0 = time.perf_counter()
            os.pwrite(fd, payload[:block], i * block)
            os.fsync(fd)
            lat_out.append(time.perf_counter() - t0)
        dropped = hasattr(os, "posix_fadvise")
        if dropped:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        read = 0
        while read < nbytes:
            chunk = os.pread(fd, 1 << 20, read)
            if not chunk:
                break
            read += len(chunk)
        read_s = time.perf_counter() - t0
        if dropped:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        lat_in = []
        for i in range(8):
            t0 = time.perf_counter()
            os.pread(fd, block, ((i * 37) % max(1, nbytes // block)) * block)
            lat_in.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    return {"page_out_bytes_per_s": nbytes / max(write_s, 1e-9), "page_out_latency_s": min(lat_out),
            "page_in_bytes_per_s": read / max(read_s, 1e-9), "page_in_latency_s": min(lat_in),
            "cache_dropped": float(dropped)}


def _ram_bytes() -> tuple[int, str]:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    src = "os.sysconf(SC_PHYS_PAGES) x page size"
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max" and int(limit) < total:
            return int(limit), "cgroup v2 memory.max (below physical RAM)"
    except (OSError, ValueError):
        pass
    return int(total), src


def measure_host(page_dir: str | os.PathLike[str] | None = None, *, storage_bytes: int = 16 << 20,
                 matmul_size: int = 512, min_time_s: float = 0.2) -> DeviceProfile:
    """Measure this machine into a :class:`DeviceProfile` (about a second).

    Compute rate: a timed ``size x size`` float32 matmul on the default torch thread count. Storage: a
    write + ``fsync`` of ``storage_bytes`` to a temp file in ``page_dir`` (default: the system temp
    dir), then a read after dropping it from the page cache (``posix_fadvise``); latencies are the best
    of eight 4 KiB synchronous writes/reads. Power: RAPL package (and DRAM) counters under
    ``/sys/class/powercap`` over the matmul when readable; otherwise a stated estimate. Every field's
    ``provenance`` says ``measured`` or ``estimate``.

    Args:
        page_dir: directory whose storage will hold paged tensors.
        storage_bytes: size of the timed storage transfer.
        matmul_size: matrix side of the compute probe.
        min_time_s: least seconds of timed matmuls.

    Returns:
        The measured profile, named ``host``.

    Raises:
        ProfileError: the page directory cannot be written.
    """
    rapl = _rapl_domains()
    e0 = _read_uj(rapl, "package") if rapl else 0.0
    m0 = _read_uj(rapl, "dram") if rapl else 0.0
    flops, elapsed, _ = _time_matmul(matmul_size, min_time_s)
    sources: dict[str, str] = {
        "compute_flops_per_s": f"measured: timed {matmul_size}x{matmul_size} float32 torch.mm, {elapsed:.2f} s",
    }
    prov: dict[str, str] = {"compute_flops_per_s": "measured"}
    notes: list[str] = []
    pkg_w = (_read_uj(rapl, "package") - e0) * 1e-6 / elapsed if rapl else 0.0
    if pkg_w > 0:
        active_w = pkg_w
        sources["active_power_w"] = "measured: RAPL package energy_uj over the matmul probe"
        prov["active_power_w"] = "measured"
    else:
        active_w = 15.0 * max(1, min(os.cpu_count() or 1, 8)) / 8 + 5.0
        sources["active_power_w"] = ("estimate: RAPL unreadable here; 5 W platform + 15 W for 8 busy cores, "
                                     "scaled by the core count (typical server/desktop package power)")
        prov["active_power_w"] = "estimate"
    try:
        io = _storage_speeds(None if page_dir is None else os.fspath(page_dir), storage_bytes)
    except OSError as e:
        raise ProfileError(f"cannot time storage in {page_dir or tempfile.gettempdir()}: {e}; "
                           "pass a writable page_dir") from e
    where = os.fspath(page_dir) if page_dir is not None else tempfile.gettempdir()
    for k in ("page_out_bytes_per_s", "page_out_latency_s"):
        sources[k] = f"measured: write+fsync of {storage_bytes} bytes / 4 KiB blocks in {where}"
        prov[k] = "measured"
    for k in ("page_in_bytes_per_s", "page_in_latency_s"):
        sources[k] = f"measured: read of {storage_bytes} bytes / 4 KiB blocks in {where}"
        prov[k] = "measured"
    if not io["cache_dropped"]:
        notes.append("posix_fadvise unavailable: read figures may come from the page cache")
    dram_w = (_read_uj(rapl, "dram") - m0) * 1e-6 / elapsed if rapl else 0.0
    if dram_w > 0:
        memory_w = dram_w
        sources["memory_power_w"] = "measured: RAPL dram energy_uj over the matmul probe"
        prov["memory_power_w"] = "measured"
    else:
        memory_w = 3.0
        sources["memory_power_w"] = ("estimate: no readable RAPL dram domain; 3 W, a typical SSD's active "
                                     "power (SATA 2-3 W, NVMe 3-6 W datasheets)")
        prov["memory_power_w"] = "estimate"
    ram, ram_src = _ram_bytes()
    sources["ram_bytes"], prov["ram_bytes"] = f"measured: {ram_src}", "measured"
    prof = DeviceProfile(
        name="host", compute_flops_per_s=flops, active_power_w=active_w, memory_power_w=memory_w,
        page_in_latency_s=max(io["page_in_latency_s"], 1e-9),
        page_in_bytes_per_s=io["page_in_bytes_per_s"],
        page_out_latency_s=max(io["page_out_latency_s"], 1e-9),
        page_out_bytes_per_s=io["page_out_bytes_per_s"], ram_bytes=ram,
        display_name="this machine (measured)", processor=os.uname().machine, storage=where,
        sources=sources, provenance=prov, notes=tuple(notes))
    log.info("measured host: %.3g FLOP/s, write %.3g B/s, read %.3g B/s, active %.1f W (%s)",
             flops, prof.page_out_bytes_per_s, prof.page_in_bytes_per_s, active_w, prov["active_power_w"])
    return prof


# ---------------------------------------------------------------------------------------------------
# Planning for a device we are not running on


def _rescaled_options(options: tuple[Any, ...], old_fwd: Any, new_fwd: Any) -> tuple[Any, ...]:
    """Selective options whose re-run time keeps its share of the stage's forward (at each size's line
    ends: the share is measured, the forward is the FLOP estimate)."""
    out = []
    for o in options:
        shares = [o.recompute_s.at(m) / old_fwd.at(m) if old_fwd.at(m) > 0 else 1.0 for m in (1, 2)]
        out.append(replace(o, recompute_s=type(new_fwd).fit(1, shares[0] * new_fwd.at(1), 2, shares[1] * new_fwd.at(2))))
    return tuple(out)


def scale_chain(chain: CostChain, from_profile: DeviceProfile | None, to_profile: DeviceProfile) -> CostChain:
    """The chain's costs as they would be on ``to_profile`` (bytes unchanged; times rescaled).

    With ``from_profile`` (the device the chain was measured on) every time is multiplied by
    ``from.compute_flops_per_s / to.compute_flops_per_s``. Without it, stage times come from FLOPs
    (forward ``flops / rate``, backward ``2 x flops / rate``, input-gradient part ``flops / rate``) and
    the loss and optimizer seconds, which have no FLOP count, are kept as they are. Energy follows from
    time x power in :func:`edgetrain.planners.paging_model.simulate_paged`.

    Args:
        chain: the chain.
        from_profile: the profile the chain's times were measured on, or ``None`` to use FLOPs.
        to_profile: the target device.

    Returns:
        A new chain with rescaled times and a name noting the target.

    Raises:
        ProfileError: ``from_profile`` is ``None`` and a stage has no FLOP count.
    """
    rate = to_profile.compute_flops_per_s
    if from_profile is not None:
        f = from_profile.compute_flops_per_s / rate
        stages = tuple(replace(s, fwd_s=s.fwd_s.scaled(f), bwd_s=s.bwd_s.scaled(f),
                               bwd_input_s=s.bwd_input_s.scaled(f),
                               selective=tuple(replace(o, recompute_s=o.recompute_s.scaled(f)) for o in s.selective))
                       for s in chain.stages)
        loss_s, step_s = chain.loss_s.scaled(f), chain.step_fixed_s * f
    else:
        missing = [s.name for s in chain.stages if s.flops.fixed <= 0 and s.flops.per_sample <= 0]
        if missing:
            raise ProfileError(f"stages {missing[:5]} have no FLOP count; pass from_profile (the device the "
                               "chain was measured on) to scale by compute rate instead")
        stages = tuple(replace(s, fwd_s=s.flops.scaled(1 / rate), bwd_s=s.flops.scaled(2 / rate),
                               bwd_input_s=s.flops.scaled(1 / rate),
                               selective=_rescaled_options(s.selective, s.fwd_s, s.flops.scaled(1 / rate)))
                       for s in chain.stages)
        loss_s, step_s = chain.loss_s, chain.step_fixed_s
    name = f"{chain.name}@{to_profile.name}" if chain.name else f"@{to_profile.name}"
    return CostChain(stages=stages, batch_size=chain.batch_size, input_bytes=chain.input_bytes,
                     fixed_bytes=chain.fixed_bytes, loss_s=loss_s, step_fixed_s=step_s, name=name)

