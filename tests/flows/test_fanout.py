"""flows.fanout on a local Ray instance: every server of the instance listens on the loopback interface only."""

import ipaddress
import os

import psutil
from ray_children import Rendezvous, ray_listeners


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1: an IPv6 socket bound to 127.0.0.1
    return (mapped or address).is_loopback


def test_a_local_instance_listens_on_loopback_only(prefect_harness, tmp_path):
    """Ray 2.60 turned ``_node_ip_address="127.0.0.1"`` into the host's outward address, and its GCS, raylet,
    workers and agents listened on ``::``, ``0.0.0.0`` or that address. Two children, both up at once
    (a rendezvous), list the listening sockets of every process of the session: the GCS, the raylet, the
    agents, both workers, and the driver's own gRPC server."""
    from flows.fanout import run_children_on_ray
    from tasks.fanout import RAY_SINGLE_MACHINE_ENV

    me = psutil.Process()
    before = [p.pid for p in me.children(recursive=True)]
    driver_listening = [
        [c.laddr.ip, c.laddr.port]
        for c in psutil.net_connections(kind="tcp")
        if c.pid == me.pid and c.status == psutil.CONN_LISTEN
    ]
    params = {"driver": me.pid, "before": before, "driver_listening": driver_listening}
    env_before = os.environ.get(RAY_SINGLE_MACHINE_ENV)
    names = ["a", "b"]
    results = run_children_on_ray(
        {name: params for name in names}, Rendezvous(ray_listeners, tmp_path / "rendezvous", names), gpus_per_child=0
    )
    assert os.environ.get(RAY_SINGLE_MACHINE_ENV) == env_before  # restored: a later ray.init(address=...) is unaffected
    workers = Rendezvous.started(tmp_path / "rendezvous")
    assert sorted(workers) == names and me.pid not in workers.values()
    for listeners in results:
        commands = " ".join(entry["command"] for entry in listeners)
        for server in ("gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent"):  # the listing sees the session
            assert server in commands, (server, listeners)
        assert set(workers.values()) <= {entry["pid"] for entry in listeners}, listeners
        assert me.pid in {entry["pid"] for entry in listeners}, listeners  # the driver's core-worker server
        outside = [
            f"{entry['ip']}:{entry['port']} {entry['command'].split()[0]}"
            for entry in listeners
            if not is_loopback(entry["ip"])
        ]
        assert not outside, "listening beyond the loopback interface:\n" + "\n".join(outside)
