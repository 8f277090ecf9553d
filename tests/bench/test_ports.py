"""The loopback ports tests and benchmarks give their servers: none from the kernel's ephemeral
range (where vLLM's own sockets and any outgoing connection may take it before the server binds:
"Address already in use" in CI), and never the same one twice across processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.lib import ports
from tests.telemetry.serve import free_port

REPO = Path(__file__).resolve().parents[2]


def test_the_tests_ports_lie_below_the_kernels_ephemeral_range():
    low = ports.ephemeral_low()
    handed = [free_port() for _ in range(50)]
    assert all(port < low for port in handed), handed
    assert len(set(handed)) == len(handed)


def test_processes_asking_together_never_get_the_same_port(tmp_path):
    counter = tmp_path / "counter"
    code = (
        "import sys; from pathlib import Path; from bench.lib.ports import free_ports; "
        "print(*free_ports(40, counter=Path(sys.argv[1])))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(counter)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    handed = [int(p) for proc in procs for p in proc.communicate(timeout=60)[0].split()]
    assert len(handed) == 160
    assert len(set(handed)) == 160


def test_a_port_someone_listens_on_is_skipped(tmp_path):
    import socket

    counter = tmp_path / "counter"
    first = ports.free_ports(1, counter=counter)[0]
    counter.write_text(str(first))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", first))
        busy.listen()
        again = ports.free_ports(1, counter=counter)[0]
    assert again != first


def test_the_counter_wraps_to_the_start_of_the_range(tmp_path):
    counter = tmp_path / "counter"
    counter.write_text(str(ports.ephemeral_low() - 1))
    got = ports.free_ports(2, counter=counter)
    assert got[0] in (ports.ephemeral_low() - 1, ports.LOWEST)
    assert all(ports.LOWEST <= p < ports.ephemeral_low() for p in got)
