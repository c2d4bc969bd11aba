"""torch's C++ warnings stay off the launcher's console: recognised, counted, one line per kind,
the full text in the log; a --master that is neither this node's nor reachable is said first."""

from __future__ import annotations

import socket
import threading

from longboat.launch import ports
from longboat.launch.torch_noise import KnownWarnings, _FilteredText, first_line
from tests.launch._launcher import run_launcher

PING = """\
[W1207 05:32:21.526450949 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to host 10.0.0.1:29500 - retrying (try=0, timeout=15000ms, delay=687ms): Ping failed, invalid value returned from server. Expected: 5789, Got: 117901063
Exception raised from ping at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/TCPStore.cpp:427 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7fb962379b8d in libc10.so)
<omitting python frames>
frame #32: _start + 0x21 (0x565286021081 in python3.11)
"""  # noqa: E501
HOSTNAME = "[W1207 05:40:01.000000001 TCPStoreLibUvBackend.cpp:1013] [c10d] The hostname of the client socket cannot be retrieved. err=-3"  # noqa: E501
PEER = """\
torch.distributed.DistNetworkError: failed to recv, got 0 bytes
Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:682 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f in libc10.so)
[W1207 05:40:02.000000002 socket.cpp:460] [c10d] recvBytes failed: Connection reset by peer
"""  # noqa: E501


def _feed(known: KnownWarnings, text: str, source: str = "launcher") -> list[str]:
    return [line for line in text.splitlines() if not known.swallow(line, source)]


def test_each_kind_is_one_line_and_counted():
    said: list[str] = []
    known = KnownWarnings(said.append, lambda source: "log/launcherlog.1")
    kept = _feed(known, "longboat launch: waiting\n" + PING + "\n" + PING + HOSTNAME + "\n" + PEER)
    assert kept == ["longboat launch: waiting", "torch.distributed.DistNetworkError: failed to recv, got 0 bytes"]  # noqa: E501
    assert dict(known.counts) == {"ping failed": 2, "hostname": 1, "peer ended": 1}
    assert len(said) == 3 and all("log/launcherlog.1" in line for line in said)
    assert "--master" in said[0] and "harmless" in said[1] and "finishes first" in said[2]
    assert known.summary() == (
        "longboat launch: kept 4 torch C++ warnings off the console "
        "(2 ping failed, 1 hostname, 1 peer ended)"
    )


def test_ranks_lines_on_the_console_are_filtered_per_rank():
    said: list[str] = []
    known = KnownWarnings(said.append, lambda source: "log/workerlog.N")
    out: list[str] = []

    class Sink:
        def write(self, text: str) -> None:
            out.append(text)

    stream = _FilteredText(Sink(), known, "ranks")  # type: ignore[arg-type]
    for line in ["[rank 0] step 1\n", *(f"[rank 0] {line}\n" for line in PING.splitlines())]:
        stream.write(line)
    stream.write("[rank 0] step 2\n")
    assert "".join(out) == "[rank 0] step 1\n[rank 0] step 2\n"
    assert known.counts["ping failed"] == 1 and len(said) == 1
    assert first_line(RuntimeError(PEER)) == PEER.splitlines()[0]


def test_a_master_neither_here_nor_reachable_is_one_line(monkeypatch):
    assert ports.master_note("127.0.0.1", 29500, "127.0.0.1") is None  # this node's own

    def silent(*args: object, **kwargs: object) -> socket.socket:
        raise TimeoutError

    monkeypatch.setattr(ports.socket, "create_connection", silent)
    note = ports.master_note("10.0.0.1", 29500, "192.0.2.2")
    assert note is not None and "\n" not in note
    assert "--master 10.0.0.1:29500 is not an address of this node (192.0.2.2)" in note
    assert "no answer within 2 s" in note


def test_a_wrong_master_prints_longboats_lines_not_torchs_frames(tmp_path):
    """A node whose --master answers, but not as a torch store: TCPStore's "Ping failed"
    warnings (30 lines of C++ frames each) go to log/launcherlog.1, the console says it once."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    stop = threading.Event()

    def answer_wrongly() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    while conn.recv(64):
                        conn.sendall(b"\x07" * 8)
                except OSError:
                    pass

    thread = threading.Thread(target=answer_wrongly, daemon=True)
    thread.start()
    (tmp_path / "t.py").write_text("print('never runs')\n")
    try:
        done = run_launcher(
            tmp_path, "--nnodes", "2", "--node-rank", "1", "--master", f"127.0.0.1:{port}",
            "--timeout", "3", "t.py", timeout=60,
        )  # fmt: skip
    finally:
        stop.set()
        thread.join()
        server.close()
    console = done.stdout + done.stderr
    assert done.returncode == 1, console
    assert "frame #" not in console and "TCPStore.cpp" not in console, console
    assert console.count("torch warned (ping failed)") == 1, console
    assert "torch C++ warning" in console.splitlines()[-1], console
    assert "could not connect to the rendezvous" in console
    assert "Ping failed" in (tmp_path / "log" / "launcherlog.1").read_text()
