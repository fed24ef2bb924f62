"""The seccomp filter every sandbox's commands run under, on every backend.

A local sandbox gets it from bubblewrap (``--seccomp``: every process of the sandbox, its
agent included). In a Kubernetes pod the agent installs it on itself (its ``seccomp`` op,
sent by the host before any command), after ``PR_SET_NO_NEW_PRIVS``, so that every process it
starts inherits it; the pod's own profile (``RuntimeDefault``) stays in force under it, as
seccomp filters stack. No node-side file is needed, so it holds on any cluster.

It denies two things, and nothing else (every other system call is allowed):

* **The kernel keyrings** (``add_key``, ``request_key``, ``keyctl``: ``ENOSYS``, as on a
  kernel built without keys). Keys are not namespaced: a key is found by its global serial
  number and checked against the caller's host uid, so a key one sandbox stores is readable
  from a concurrent sandbox and outlives an in-place reset, which no file comparison sees.
  With the calls gone the sandbox has no keyring it can reach, so there is nothing for a reset
  to revoke and nothing for a sibling to read. containerd's ``RuntimeDefault`` profile denies
  the same three (they are absent from its allow list).
* **Changing another process's resource limits** (``prlimit64`` with a new limit for a pid
  other than 0, the caller: ``EPERM``). The sandbox's agent runs as the same uid as the
  policy's commands, and the kernel lets a process set the limits of any process of its uid:
  an ``RLIMIT_CPU`` on the agent kills it with SIGKILL, an ``RLIMIT_NOFILE`` of 3 makes it fail
  every request. Either would turn the policy's failure into an agent death that looks like
  infrastructure. ``setrlimit``, ``ulimit`` and ``prlimit`` on the caller itself, and every
  read of limits, are unaffected. containerd's ``RuntimeDefault`` allows ``prlimit64``.

Why hand-assembled classic BPF rather than libseccomp: the program is a few dozen
instructions, bubblewrap takes it as bytes on a file descriptor and the agent as a
``sock_fprog`` for ``prctl``, and neither the host nor an image needs a binding
of libseccomp (none is packaged for Debian's Python or installs from source reliably). The
program checks the architecture first: a call made through the 32-bit compat ABI (``int
0x80`` on x86-64) is matched against that ABI's numbers, x32 calls are refused, and an
architecture this module does not know kills the process rather than slip past the filter.
"""

from __future__ import annotations

import errno
import os
import platform
import struct
from dataclasses import dataclass

from sandpool.core import errors

__all__ = ["program", "program_fd"]

# Classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000
_ERRNO = 0x00050000
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
_NR, _ARCH = 0, 4


def _arg_lo(i: int) -> int:  # offset of the low 32 bits of args[i] (little-endian hosts)
    return 16 + 8 * i


@dataclass(frozen=True)
class _Abi:
    audit_arch: int
    keyring: tuple[int, ...]  # add_key, request_key, keyctl
    prlimit64: int
    x32_bit: int = 0  # set on x86-64: call numbers with it are the x32 ABI's


# Numbers from the kernel's syscall tables (arch/x86/entry/syscalls, include/uapi/asm-generic).
_X86_64 = _Abi(0xC000003E, (248, 249, 250), 302, x32_bit=0x40000000)
_I386 = _Abi(0x40000003, (286, 287, 288), 340)
_AARCH64 = _Abi(0xC00000B7, (217, 218, 219), 261)
_ARM = _Abi(0x40000028, (309, 310, 311), 369)
_ABIS = {"x86_64": (_X86_64, _I386), "aarch64": (_AARCH64, _ARM)}


class _Asm:
    """Classic BPF with forward jumps to labels, resolved when the program is packed."""

    def __init__(self) -> None:
        self.ops: list[tuple[int, object, object, int]] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.ops)

    def load(self, offset: int) -> None:
        self.ops.append((_LD_W_ABS, 0, 0, offset))

    def jump_if(self, op: int, k: int, true: str | int = 0, false: str | int = 0) -> None:
        self.ops.append((op, true, false, k))

    def ret(self, k: int) -> None:
        self.ops.append((_RET_K, 0, 0, k))

    def pack(self) -> bytes:
        out = []
        for at, (code, jt, jf, k) in enumerate(self.ops):
            # A label is an absolute index; a jump offset counts from the next instruction.
            t = self.labels[jt] - at - 1 if isinstance(jt, str) else jt
            f = self.labels[jf] - at - 1 if isinstance(jf, str) else jf
            assert isinstance(t, int) and isinstance(f, int) and 0 <= t < 256 and 0 <= f < 256
            out.append(struct.pack("=HBBI", code, t, f, k))
        return b"".join(out)


def _abi_block(asm: _Asm, abi: _Abi, tag: str) -> None:
    asm.label(tag)
    asm.load(_NR)
    if abi.x32_bit:
        asm.jump_if(_JGE_K, abi.x32_bit, "enosys")
    for nr in abi.keyring:
        asm.jump_if(_JEQ_K, nr, "enosys")
    asm.jump_if(_JEQ_K, abi.prlimit64, "prlimit")
    asm.ret(_ALLOW)


def program(machine: str | None = None) -> bytes:
    """The filter as a classic BPF program (``struct sock_filter`` array, host byte order).

    Args:
        machine: ``platform.machine()`` of the machine the sandbox runs on (default: this
            one's).

    Raises:
        BackendUnavailable: The architecture has no table here (x86-64 and aarch64 do).
    """
    machine = machine or platform.machine()
    if machine not in _ABIS:
        raise errors.BackendUnavailable(
            f"no seccomp filter for architecture {machine!r}; sandboxes run on x86_64 and "
            "aarch64 machines")
    native, compat = _ABIS[machine]
    asm = _Asm()
    asm.load(_ARCH)
    asm.jump_if(_JEQ_K, native.audit_arch, "native")
    asm.jump_if(_JEQ_K, compat.audit_arch, "compat")
    asm.ret(_KILL_PROCESS)
    _abi_block(asm, native, "native")
    _abi_block(asm, compat, "compat")
    # prlimit64(pid, resource, new_limit, old_limit): only reads, or the caller's own limits.
    asm.label("prlimit")
    asm.load(_arg_lo(2))
    asm.jump_if(_JEQ_K, 0, 0, "sets")
    asm.load(_arg_lo(2) + 4)
    asm.jump_if(_JEQ_K, 0, "allow")
    asm.label("sets")
    asm.load(_arg_lo(0))  # pid_t is 32 bits: the kernel ignores the upper half
    asm.jump_if(_JEQ_K, 0, "allow")
    asm.ret(_ERRNO | errno.EPERM)
    asm.label("allow")
    asm.ret(_ALLOW)
    asm.label("enosys")
    asm.ret(_ERRNO | errno.ENOSYS)
    return asm.pack()


def program_fd() -> int:
    """A file descriptor holding :func:`program`, for bubblewrap's ``--seccomp FD``.

    The read end of a pipe whose write end is closed: bubblewrap reads it to end of file.
    The caller passes it to the child and closes its own copy afterwards.
    """
    data = program()
    r, w = os.pipe()
    try:
        os.write(w, data)  # a few hundred bytes: always fits in the pipe's buffer
    finally:
        os.close(w)
    return r
