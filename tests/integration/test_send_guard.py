"""libzmq aborts a process whose TCP send fails with EACCES; ``zio``'s send guard turns
that error into a dead peer (shards/README.md, *A refused route does not abort the
process*).

Linux gives EACCES to a connection whose route became ``prohibit`` once
``TCP_USER_TIMEOUT`` gives up on it, and whether libzmq's send or its receive meets it
first is a race in libzmq's I/O thread: that is how a server cut off from a client by a
test's ``prohibit`` routes died now and then. The race cannot be forced with a route, so
the fault is made at the system-call boundary: a seccomp filter makes ``sendto`` on one
connection's descriptor fail with EACCES, as the kernel does after the timeout, and the
peer's close then gives the read side its end of stream, as the dead connection does.
Everything else is real: pyzmq's own libzmq, TCP on loopback, the I/O thread's write.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from clonemap.shards.common import zio
from conftest import ROOT, free_port_base

# One process: a PUSH bound on the port, a PULL connected to it, one message through;
# then every send() on the PUSH's connection fails with EACCES and a message is queued.
CHILD = r'''
import ctypes, json, platform, struct, sys, time
import psutil, zmq
from zmq.utils.monitor import parse_monitor_message

port, guarded = int(sys.argv[1]), sys.argv[2] == "guarded"
if guarded:
    from clonemap.shards.common import zio

SENDTO = {"x86_64": 44, "aarch64": 206}
SECCOMP = {"x86_64": 317, "aarch64": 277}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}


def refuse_sends(fd):
    """Every thread's sendto() on ``fd`` fails with EACCES from now on."""
    machine = platform.machine()
    program = [  # classic BPF over struct seccomp_data (nr at 0, arch at 4, args at 16)
        (0x20, 0, 0, 4), (0x15, 0, 5, AUDIT_ARCH[machine]),   # another ABI: allow
        (0x20, 0, 0, 0), (0x15, 0, 3, SENDTO[machine]),       # not sendto: allow
        (0x20, 0, 0, 16), (0x15, 0, 1, fd),                   # another fd: allow
        (0x06, 0, 0, 0x00050000 | 13),                        # SECCOMP_RET_ERRNO | EACCES
        (0x06, 0, 0, 0x7FFF0000)]                             # SECCOMP_RET_ALLOW
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in program))

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    # SECCOMP_SET_MODE_FILTER with SECCOMP_FILTER_FLAG_TSYNC: libzmq's I/O thread too
    if libc.syscall(SECCOMP[machine], 1, 1, ctypes.byref(Program(len(program),
                                                                  ctypes.addressof(code)))):
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER)")


ctx = zmq.Context()
push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
push.bind(f"tcp://127.0.0.1:{port}")
monitor = push.get_monitor_socket(zmq.EVENT_DISCONNECTED)
pull.connect(f"tcp://127.0.0.1:{port}")
push.send(b"before")
assert pull.recv() == b"before"
fd = next(c.fd for c in psutil.Process().net_connections("tcp")
          if c.laddr.port == port and c.raddr)
refuse_sends(fd)
print(json.dumps({"refusing": fd, "guard": zio.SEND_GUARD if guarded else None}),
      flush=True)
push.send(b"after")  # the I/O thread writes it at once: send() fails with EACCES
if guarded:
    deadline = time.monotonic() + 20
    while zio.refused_sends() == 0 and time.monotonic() < deadline:
        time.sleep(0.001)  # no event says that libzmq's write was tried
    refused = zio.refused_sends()
    pull.close(linger=0)  # the peer's FIN: the read side sees the end of the stream
    monitor.rcvtimeo = 20_000
    event = parse_monitor_message(monitor.recv_multipart())
    print(json.dumps({"refused_sends": refused, "event": int(event["event"]),
                      "endpoint": event["endpoint"].decode()}), flush=True)
else:
    monitor.rcvtimeo = 20_000
    monitor.recv_multipart()  # not reached: libzmq aborts the process first
    print(json.dumps({"survived": True}), flush=True)
'''


def run_child(mode: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CLONEMAP_PURE"}
    return subprocess.run([sys.executable, "-c", CHILD, str(free_port_base(1)), mode],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_without_the_guard_libzmq_aborts_on_eacces():
    """The failure the guard exists for, with this environment's libzmq. If a pyzmq
    upgrade brings a libzmq that no longer asserts, this fails: the guard may go."""
    done = run_child("bare")
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stdout, done.stderr)
    assert "Permission denied (src/tcp.cpp:" in done.stderr, done.stderr
    assert json.loads(done.stdout.splitlines()[0])["refusing"] > 2


@pytest.mark.skipif(zio.SEND_GUARD != "on", reason="the guard needs the compiled "
                    "extension (test_frame_paths checks that it is built where a "
                    "compiler is)")
def test_with_the_guard_the_connection_is_dropped_and_the_process_lives():
    done = run_child("guarded")
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert "Permission denied" not in done.stderr, done.stderr
    first, last = (json.loads(line) for line in done.stdout.splitlines())
    assert first["guard"] == "on"
    assert last["refused_sends"] >= 1, last
    assert last["event"] == 0x0200, last  # ZMQ_EVENT_DISCONNECTED: a dead peer, closed
    assert last["endpoint"].startswith("tcp://127.0.0.1:"), last


def test_the_guard_says_why_it_is_off():
    """As on a machine without a compiler: the import of ``_zframes`` fails."""
    code = ("import sys; sys.modules['clonemap.shards.common._zframes'] = None\n"
            "from clonemap.shards.common import zio\n"
            "print(zio.SEND_GUARD, zio.refused_sends())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip() == "off (the compiled extension is not built) 0"


def test_the_pure_frame_path_keeps_the_guard():
    """``CLONEMAP_PURE`` chooses pyzmq's frame calls over the extension's; the guard is
    about libzmq's own sends and stays on."""
    if zio.SEND_GUARD != "on":
        pytest.skip("the guard needs the compiled extension")
    code = "from clonemap.shards.common import zio; print(zio.FRAME_PATH, '|', zio.SEND_GUARD)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True,
                         env={**os.environ, "CLONEMAP_PURE": "1"})
    assert out.stdout.strip() == "pure (CLONEMAP_PURE is set) | on"
