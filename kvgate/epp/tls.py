"""TLS on the picker's gRPC port: the operator's certificate, or one made at start.

The Inference Extension's reference picker serves TLS by default with a self-signed
certificate, and the gateways' charts reach it over TLS without verifying it; kvgate does
the same. A certificate made here is valid for a year from start, for `localhost`, the
loopback addresses and the host the picker listens on.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvgate.config import EppTlsConfig

VALID_FOR = datetime.timedelta(days=365)


@dataclass(frozen=True, slots=True)
class Certificate:
    cert_pem: bytes
    key_pem: bytes

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])


def certificate(config: EppTlsConfig, host: str) -> Certificate:
    """The operator's certificate and key, else a self-signed one for `host`."""
    if config.cert_file is not None and config.key_file is not None:
        return Certificate(Path(config.cert_file).read_bytes(), Path(config.key_file).read_bytes())
    return self_signed(host)


def self_signed(host: str) -> Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost"),
                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                     x509.IPAddress(ipaddress.ip_address("::1"))]  # fmt: skip
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
        if host:
            names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvgate endpoint picker")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALID_FOR)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Certificate(
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                          serialization.NoEncryption()),
    )
