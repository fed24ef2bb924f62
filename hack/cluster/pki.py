"""The cluster's PKI: one CA, the certificates signed by it, kubeconfigs that use them.

Standard library and the ``openssl`` command.
"""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

APISERVER_SANS = (
    "IP:127.0.0.1",
    "IP:10.96.0.1",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)


_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(pki: Path) -> None:
    """A fresh CA in ``pki`` and the control plane's certificates and service-account key."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        *_EC,
        "-keyout",
        str(pki / "ca.key"),
        "-out",
        str(pki / "ca.crt"),
        "-days",
        "3650",
        "-subj",
        "/CN=sandpool-cluster-ca",
    )
    certs = {
        "apiserver": (
            "/CN=kube-apiserver",
            "serverAuth",
            ",".join(APISERVER_SANS),
        ),
        "kwok": ("/CN=kwok-kubelet", "serverAuth", "IP:127.0.0.1,DNS:localhost"),
        "admin": ("/O=system:masters/CN=sandpool-admin", "clientAuth", None),
    }
    for name, (subj, usage, san) in certs.items():
        issue_cert(pki, name, subj, usage, san)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(pki / "sa.key"))
    _openssl("ec", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def issue_cert(pki: Path, name: str, subj: str, usage: str, san: str | None) -> None:
    """``<pki>/<name>.{key,crt}``: an EC key and a certificate for it signed by ``<pki>/ca``,
    for ``usage`` (serverAuth or clientAuth), with subject alternative names ``san``."""
    ext = pki / f"{name}.ext"
    ext.write_text(
        f"extendedKeyUsage={usage}\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        + (f"subjectAltName={san}\n" if san else "")
    )
    _openssl(
        "req",
        "-new",
        *_EC,
        "-keyout",
        str(pki / f"{name}.key"),
        "-out",
        str(pki / f"{name}.csr"),
        "-subj",
        subj,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        str(pki / f"{name}.csr"),
        "-CA",
        str(pki / "ca.crt"),
        "-CAkey",
        str(pki / "ca.key"),
        "-CAcreateserial",
        "-days",
        "3650",
        "-out",
        str(pki / f"{name}.crt"),
        "-extfile",
        str(ext),
    )


def write_kubeconfig(path: Path, server: str, pki: Path, user: str = "admin") -> None:
    b64 = lambda p: base64.b64encode(p.read_bytes()).decode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: sandpool
  cluster:
    server: {server}
    certificate-authority-data: {b64(pki / "ca.crt")}
users:
- name: sandpool-admin
  user:
    client-certificate-data: {b64(pki / f"{user}.crt")}
    client-key-data: {b64(pki / f"{user}.key")}
contexts:
- name: sandpool
  context:
    cluster: sandpool
    user: sandpool-admin
current-context: sandpool
""")
    path.chmod(0o600)
