"""The edgetrain ClientApp on Flower's own engines: the Ray simulation engine and the deployment engine
(a SuperLink and two SuperNodes on 127.0.0.1). Both start processes and take tens of seconds on a shared
2-core machine, so they are opt-in: ``pytest -m flower_engines`` (they are also ``slow``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytestmark = [pytest.mark.slow, pytest.mark.flower_engines]

OFFLINE = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "RAY_USAGE_STATS_ENABLED": "0"}


def test_ray_simulation_two_clients_one_round():
    from edgetrain.fl.simulation import SimulationConfig, run

    cfg = SimulationConfig(clients=2, rounds=1, tiers=(("rpi4", "24MiB"), ("jetson-tx2", "96MiB")))
    report = run(cfg)
    clients = report.rounds[0]["clients"]
    assert sorted(c["partition-id"] for c in clients) == [0, 1]
    assert all(c["within-budget"] == 1 and 0 < c["peak-bytes"] <= c["budget-bytes"] for c in clients)
    assert report.accuracy[1] > report.accuracy[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


APP = '''
from edgetrain.fl.apps import mnist_client_app, mnist_server_app
from edgetrain.fl.settings import ClientSettings

client = mnist_client_app(ClientSettings(batch_size=64))
server = mnist_server_app(num_rounds=1, min_nodes=2)
'''

PYPROJECT = '''
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "edgetrain-fl-test"
version = "0.1.0"
description = "edgetrain ClientApp on the deployment engine"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "edgetrain"

[tool.flwr.app.components]
serverapp = "edgetrain_fl_app:server"
clientapp = "edgetrain_fl_app:client"

[tool.flwr.app.config]
num-server-rounds = 1
report-path = "{report}"
'''


def test_deployment_engine_superlink_and_two_supernodes_run_one_round(tmp_path: Path):
    bin_dir = Path(sys.executable).parent
    app = tmp_path / "app"
    app.mkdir()
    report = tmp_path / "report.json"
    (app / "edgetrain_fl_app.py").write_text(APP)
    (app / "pyproject.toml").write_text(PYPROJECT.format(report=report))
    link_port = _free_port()
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "edgetrain-test"\n\n[superlink.edgetrain-test]\n'
                                      f'address = "127.0.0.1:{link_port}"\ninsecure = true\n')
    env = {**os.environ, **OFFLINE, "FLWR_HOME": str(home), "EDGETRAIN_NO_CACHE": "1",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}  # the SuperLink starts flower-superexec
    logs = {}
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> None:
        logs[name] = open(tmp_path / f"{name}.log", "w")
        procs.append(subprocess.Popen([str(bin_dir / args[0]), *args[1:]], stdout=logs[name], stderr=subprocess.STDOUT,
                                      env=env, cwd=tmp_path, start_new_session=True))

    try:
        start("superlink", "flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(link_port))
        for i, budget in enumerate(("24MiB", "96MiB")):
            start(f"supernode{i}", "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                  "--host", "127.0.0.1", "--port", str(_free_port()),
                  "--node-config", f"partition-id={i} num-partitions=2 memory-budget='{budget}'")
        deadline = time.monotonic() + 180
        while True:  # submit once the SuperLink answers
            out = subprocess.run([str(bin_dir / "flwr"), "run", str(app)], capture_output=True, text=True, env=env,
                                 cwd=tmp_path, timeout=120)
            if out.returncode == 0:
                break
            assert time.monotonic() < deadline, out.stdout[-2000:] + out.stderr[-2000:]
            time.sleep(2)
        while not report.exists():
            assert all(p.poll() is None for p in procs), _tails(tmp_path)
            assert time.monotonic() < deadline, "no report in time\n" + _tails(tmp_path)
            time.sleep(1)
        time.sleep(0.5)  # written by one write(); let it land
        rounds = json.loads(report.read_text())
        clients = rounds["rounds"][0]["clients"]
        assert sorted(c["partition-id"] for c in clients) == [0, 1], _tails(tmp_path)
        assert sorted(c["budget-bytes"] for c in clients) == [24 << 20, 96 << 20]
        assert all(c["within-budget"] == 1 for c in clients), clients
        assert rounds["accuracy"]["1"] > rounds["accuracy"]["0"]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=15)
        for f in logs.values():
            f.close()


def _tails(tmp_path: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(tmp_path.glob("*.log")))
