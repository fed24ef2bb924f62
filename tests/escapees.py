"""Commands for a policy that hides a process from the agent behind its zombie leader.

A process whose main thread exits while another thread runs (``SYS_exit`` on the leader, not
``exit_group``) shows as a zombie in ``/proc/<pid>/stat``, with an empty ``cmdline`` and
``environ``, yet its threads run on. :data:`HIDE` starts such a server (out of the command's
session and group) on an abstract unix socket; :data:`ASK` prints what it answers, or
``nobody: Connection refused`` once it is gone.
"""

#: Forks a server that leaves its session, then exits its main thread only (x86_64 and arm64
#: ``SYS_exit``); the parent returns once the leader shows as a zombie.
HIDE = r"""python3 - <<'PY'
import ctypes, os, platform, socket, sys, threading, time
pid = os.fork()
if pid:
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    print("hidden")
    sys.exit(0)
os.setsid()
null = os.open("/dev/null", os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
srv = socket.socket(socket.AF_UNIX)
srv.bind("\0sandpool-handoff")
srv.listen(4)
def serve():
    while True:
        conn, _ = srv.accept()
        conn.sendall(b"the fix")
        conn.close()
threading.Thread(target=serve).start()
ctypes.CDLL(None).syscall(93 if platform.machine() == "aarch64" else 60, 0)
PY"""
ASK = r"""python3 -c '
import socket
s = socket.socket(socket.AF_UNIX)
try:
    s.connect("\0sandpool-handoff")
    print(s.recv(64).decode())
except OSError as exc:
    print("nobody:", exc.strerror)
'"""
