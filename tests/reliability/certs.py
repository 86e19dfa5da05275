"""Throw-away PKI for TLS tests, generated per run with `cryptography` (never committed)."""

from __future__ import annotations

import datetime
import pathlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_NOW = datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class Pem:
    cert: bytes
    key: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_ca(common_name: str) -> tuple[Pem, ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_NOW - datetime.timedelta(days=1))
        .not_valid_after(_NOW + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)), key, cert


def issue(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    *,
    server: bool,
    expired: bool = False,
    san: str = "localhost",
) -> Pem:
    key = ec.generate_private_key(ec.SECP256R1())
    start = _NOW - datetime.timedelta(days=10 if expired else 1)
    end = _NOW - datetime.timedelta(days=5) if expired else _NOW + datetime.timedelta(days=2)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


@dataclass(frozen=True)
class Pki:
    folder: pathlib.Path
    ca: Pem
    server: Pem
    client: Pem
    foreign_client: Pem  # signed by another CA
    expired_client: Pem
    foreign_ca: Pem

    def path(self, name: str) -> str:
        return str(self.folder / name)


def make_pki(folder: pathlib.Path) -> Pki:
    ca, ca_key, ca_cert = make_ca("ferrum-test-ca")
    other, other_key, other_cert = make_ca("someone-else-ca")
    pki = Pki(
        folder=folder,
        ca=ca,
        server=issue(ca_key, ca_cert, "executor", server=True),
        client=issue(ca_key, ca_cert, "scheduler", server=False),
        foreign_client=issue(other_key, other_cert, "intruder", server=False),
        expired_client=issue(ca_key, ca_cert, "old-scheduler", server=False, expired=True),
        foreign_ca=other,
    )
    for name, data in {
        "ca.pem": ca.cert,
        "server.pem": pki.server.cert,
        "server.key": pki.server.key,
    }.items():
        (folder / name).write_bytes(data)
    return pki
