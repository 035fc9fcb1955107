"""The certificate and key that sign results' Content Credentials, as a Prefect Secret block.

The operator saves a ``Secret`` block whose value is the JSON object
``{"cert_chain_pem": "<leaf then intermediates, PEM>", "private_key_pem": "<PKCS#8 PEM>"}``
(an ES256 key: C2PA wants a leaf with the digitalSignature key usage and the
emailProtection or documentSigning extended key usage, issued by a CA). The flows receive
its document name as ``signing_block`` (default ``DEFAULT_SIGNING_BLOCK``).

The local stack makes a development chain (``dev_chain``: a self-signed root and a leaf
issued by it, under ``<home>/c2pa/``) at first start and saves it as that block: such a
result validates, but no C2PA reader trusts its root. Production: a certificate from a CA
on the C2PA trust list.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from prefect.blocks.system import Secret

from blocks.cache import load_block
from tasks.errors import MarkingFailed
from tasks.provenance import Credentials, dev_root_path

SIGNING_SECRET_NAME = "faceflow-c2pa-signing"
ORGANISATION = "FaceFlow development"


def load_credentials(block_name: str) -> Credentials:
    """The credentials in the Secret block ``block_name`` (``"secret/<name>"``), through
    the block cache; ``MarkingFailed`` when it is missing or not of the expected shape."""
    try:
        block = load_block(block_name)
        value = block.get() if isinstance(block, Secret) else None
        data = json.loads(value) if isinstance(value, str) else value
        if not isinstance(data, dict):
            raise TypeError(f"a {type(data).__name__}, not a JSON object")
        return Credentials(str(data["cert_chain_pem"]), str(data["private_key_pem"]))
    except (ValueError, KeyError, TypeError) as exc:
        detail = f"signing block {block_name!r}: {type(exc).__name__}"
        raise MarkingFailed("The signing certificate is not available.", detail=detail) from exc


@dataclass(frozen=True)
class DevChain:
    """A development signing chain: the credentials and the root's certificate (PEM)."""

    credentials: Credentials
    root_pem: str
    created: bool
    """Whether this call made it (else it was read from disk)."""


def dev_chain(home: Path) -> DevChain:
    """The local stack's development chain under ``<home>/c2pa/`` (made on first use: an
    ES256 root CA valid 10 years, a leaf valid 1 year with digitalSignature and
    emailProtection; the key file is readable by its owner only)."""
    root_path = dev_root_path(home)
    folder = root_path.parent
    chain_path, key_path = folder / "chain.pem", folder / "signer.key"
    if chain_path.is_file() and key_path.is_file() and root_path.is_file():
        credentials = Credentials(chain_path.read_text(), key_path.read_text())
        return DevChain(credentials, root_path.read_text(), created=False)
    credentials, root_pem = make_chain(ORGANISATION)
    folder.mkdir(parents=True, exist_ok=True)
    key_path.touch(mode=0o600)
    key_path.write_text(credentials.private_key_pem)
    chain_path.write_text(credentials.cert_chain_pem)
    root_path.write_text(root_pem)
    return DevChain(credentials, root_pem, created=True)


def make_chain(organisation: str, *, days: int = 365) -> tuple[Credentials, str]:
    """A fresh root CA and a C2PA signing leaf issued by it: the leaf's credentials and
    the root's certificate (PEM)."""
    now = datetime.datetime.now(datetime.UTC)
    start = now - datetime.timedelta(minutes=5)
    root_key = ec.generate_private_key(ec.SECP256R1())
    root_name = _name(f"{organisation} root CA", organisation)
    root = (
        certificate_builder(
            root_name, root_name, root_key.public_key(), start, now + datetime.timedelta(days=3650)
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(root_key.public_key()), False)
        .sign(root_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        certificate_builder(
            _name(f"{organisation} signer", organisation),
            root_name,
            key.public_key(),
            start,
            now + datetime.timedelta(days=days),
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.EMAIL_PROTECTION]), False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(root_key.public_key()), False
        )
        .sign(root_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    root_pem = root.public_bytes(pem).decode()
    return Credentials(leaf.public_bytes(pem).decode() + root_pem, key_pem), root_pem


def certificate_builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    start: datetime.datetime,
    end: datetime.datetime,
) -> x509.CertificateBuilder:
    """A certificate of ``public_key`` for ``subject``, issued by ``issuer``, valid from
    ``start`` to ``end``, with a random serial number: add its extensions, then sign it."""
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
    )


def save_credentials(credentials: Credentials, name: str = SIGNING_SECRET_NAME) -> str:
    """Save (overwrite) ``credentials`` as the Secret block ``name``; its document name."""
    value = {
        "cert_chain_pem": credentials.cert_chain_pem,
        "private_key_pem": credentials.private_key_pem,
    }
    Secret(value=value).save(name, overwrite=True)
    return f"secret/{name}"


def _name(common_name: str, organisation: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, organisation),
        ]
    )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )
