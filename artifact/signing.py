"""ed25519 signatures over artifact manifests, so a car can require bundles made by its release build.

The manifest lists the sha256 of every other file, so one signature over its exact bytes covers the whole artifact. The
signature lives beside it in manifest.sig; the private key stays with whoever builds releases, the public key (one line,
`ed25519 <hex>`) goes wherever artifacts are verified, named by `--pubkey` or $MODELD_PUBKEY.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from selfdrive_glue.errors import UserError
from selfdrive_glue.files import write_atomic

SIGNATURE = "manifest.sig"
PUBKEY_ENV = "MODELD_PUBKEY"
_PUB_PREFIX = "ed25519 "


class SignatureError(UserError):
  pass


def key_id(pub_raw: bytes) -> str:
  return hashlib.sha256(pub_raw).hexdigest()[:16]


def generate_keypair(out_dir: Path, name: str = "modeld-msm") -> tuple[Path, Path]:
  """-> (private key PEM, 0600; public key line). Refuses to overwrite an existing private key."""
  from cryptography.hazmat.primitives import serialization
  from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
  out_dir.mkdir(parents=True, exist_ok=True)
  priv_path, pub_path = out_dir / f"{name}.key", out_dir / f"{name}.pub"
  if priv_path.exists():
    raise UserError(f"{priv_path} exists; refusing to replace a signing key (move it away first)")
  key = Ed25519PrivateKey.generate()
  pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
  pub = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
  write_atomic(priv_path, pem, 0o600)
  write_atomic(pub_path, (_PUB_PREFIX + pub.hex() + "\n").encode())
  return priv_path, pub_path


def load_private(path: Path):
  from cryptography.hazmat.primitives import serialization
  from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
  try:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
  except FileNotFoundError:
    raise SignatureError(f"signing key {path} not found; make one with `modeld-msm keygen -o DIR`") from None
  except (ValueError, TypeError):
    raise SignatureError(f"{path} is not an unencrypted PEM private key; make one with `modeld-msm keygen -o DIR`") from None
  if not isinstance(key, Ed25519PrivateKey):
    raise SignatureError(f"{path} is not an ed25519 key; make one with `modeld-msm keygen -o DIR`")
  return key


def load_public(path: str | os.PathLike) -> bytes:
  """The raw 32-byte public key from a `ed25519 <hex>` line."""
  try:
    text = Path(path).read_text().strip()
  except FileNotFoundError:
    raise SignatureError(f"public key {path} not found (set by --pubkey or ${PUBKEY_ENV})") from None
  try:
    if not text.startswith(_PUB_PREFIX):
      raise ValueError
    raw = bytes.fromhex(text[len(_PUB_PREFIX):])
    if len(raw) != 32:
      raise ValueError
  except ValueError:
    raise SignatureError(f"{path} is not a modeld-msm public key (one line: `ed25519 <64 hex digits>`)") from None
  return raw


def sign_manifest(manifest: bytes, key_path: Path) -> bytes:
  """-> the manifest.sig contents: key id and signature, one line each."""
  from cryptography.hazmat.primitives import serialization
  key = load_private(key_path)
  pub = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
  return f"key {key_id(pub)}\nsig {key.sign(manifest).hex()}\n".encode()


def sign_artifact(art_dir: Path, key_path: Path, manifest_name: str) -> str:
  """Write art_dir/manifest.sig for the manifest as it is now; -> the key id. An artifact this key signed before and
  that was edited since is refused: signing it again would vouch for the edit without anyone having looked."""
  manifest = (art_dir / manifest_name).read_bytes()
  check_not_edited_since(art_dir, manifest, key_path)
  return sign_bytes(art_dir, manifest, key_path)


def sign_bytes(folder: Path, data: bytes, key_path: Path, sig_name: str = SIGNATURE) -> str:
  """Write folder/sig_name, this key's signature of data; -> the key id."""
  sig = sign_manifest(data, key_path)
  write_atomic(folder / sig_name, sig)
  return sig.split()[1].decode()


def check_not_edited_since(art_dir: Path, manifest: bytes, key_path: Path) -> None:
  from cryptography.exceptions import InvalidSignature
  from cryptography.hazmat.primitives import serialization
  pub = load_private(key_path).public_key()
  try:
    fields = dict(line.split(" ", 1) for line in (art_dir / SIGNATURE).read_text().splitlines())
  except (FileNotFoundError, ValueError):
    return   # unsigned, or a signature no one can read: nothing this key vouched for
  if fields.get("key") != key_id(pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)):
    return
  try:
    pub.verify(bytes.fromhex(fields.get("sig", "")), manifest)
  except (InvalidSignature, ValueError):
    raise SignatureError(f"artifact {art_dir} was signed by this key and edited since (its manifest no longer matches that signature); "
                         "rebuild it, or restore the signed files, before signing") from None


def configured_pubkey(explicit: str | os.PathLike | None = None) -> Path | None:
  value = explicit if explicit is not None else os.environ.get(PUBKEY_ENV) or None
  return Path(value) if value else None


def check_signature(art_dir: Path, manifest: bytes, pubkey: Path, sig_name: str = SIGNATURE) -> str:
  """Refuse unless art_dir/sig_name is pubkey's signature of exactly these manifest bytes; -> the key id."""
  from cryptography.exceptions import InvalidSignature
  from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
  raw = load_public(pubkey)
  want = key_id(raw)
  try:
    fields = dict(line.split(" ", 1) for line in (art_dir / sig_name).read_text().splitlines())
  except FileNotFoundError:
    what = "artifact" if sig_name == SIGNATURE else "smoke data"
    raise SignatureError(f"{what} {art_dir} is not signed, and a public key is configured ({pubkey}); use a signed bundle "
                         f"from the release build (`modeld-msm sign`), or unset ${PUBKEY_ENV} to accept unsigned artifacts") from None
  except ValueError:
    raise SignatureError(f"{art_dir}: {sig_name} is malformed; sign the bundle again with `modeld-msm sign`") from None
  if fields.get("key") != want:
    raise SignatureError(f"artifact {art_dir} is signed by key {fields.get('key')}, not by the configured key {want} ({pubkey}); "
                         "use a bundle signed with that key")
  try:
    Ed25519PublicKey.from_public_bytes(raw).verify(bytes.fromhex(fields.get("sig", "")), manifest)
  except (InvalidSignature, ValueError):
    raise SignatureError(f"artifact {art_dir}: the signature does not match its manifest (modified after signing); "
                         "use the bundle as the release build signed it") from None
  return want
