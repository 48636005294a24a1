"""What a smol machine boots for a Smolfile ``image``: a registry image, or a local one.

smol boots an OCI image reference (pulled from inside the machine), an unpacked
rootfs directory, or a ``docker save`` archive. A name that ``smolbench image
build`` built into the local cache (``debian:bookworm``) boots from that rootfs
directory, so one Smolfile works on both backends without a registry.
"""

from __future__ import annotations

import os
import re
import tarfile
from pathlib import Path

from .. import signing
from .._pkgtrust import open_root, untrusted
from ..errors import SmolbenchError
from ..images import PATH_IMAGE, has_python, is_path_image, is_valid_image_name, open_image
from ..packages import GuestPython, rootfs_python, version_python

DEFAULT_IMAGE = "python:3.12-slim"
BOOT_TIMEOUT_ENV = "SMOLBENCH_SMOL_BOOT_TIMEOUT"
DEFAULT_BOOT_TIMEOUT = 120.0  # the SDK's own default
_PYTHON_TAG = re.compile(r"(?:.*/)?python:(3\.\d+)(?:\.\d+)?(?:-(?!alpine)[a-z0-9.-]+)?")


def boot_timeout() -> float:
    """Seconds a new (non-branchable) machine may take to boot: ``$SMOLBENCH_SMOL_BOOT_TIMEOUT``."""
    raw = os.environ.get(BOOT_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_BOOT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise SmolbenchError(f"{BOOT_TIMEOUT_ENV}={raw!r} is not a number of seconds > 0: fix or unset it")
    return value


def smol_image(image: str | None) -> str:
    """The ``MachineConfig.image`` for a Smolfile image (one-line errors for bad local ones)."""
    if not image:
        return DEFAULT_IMAGE
    if is_path_image(image):
        return _local(Path(image).expanduser())
    if is_valid_image_name(image):
        held = open_image(image)  # built by `smolbench image build`: checked, no link followed
        if held is not None:
            try:
                if has_python(held.path):
                    # smol takes a path: the checked folder's own (a folder no other user can write
                    # in, nor in any above it, so none can swap it after this)
                    return os.readlink(held.path)
            finally:
                held.close()
    return image


def is_local(image: str) -> bool:
    """True when smol would boot ``image`` from this host's files (host-backed layers)."""
    return image.startswith("/")


def _local(path: Path) -> str:
    """A rootfs folder or ``docker save`` archive given by path, trusted as the image cache is: smol
    reads it by path, so it and the folders above it must be such that no other user can change or
    swap it after this check (_pkgtrust.open_root; the archive itself the user's own or root's). A link on
    the way is resolved first, and what it names is checked and used (its own folder and lstat say
    nothing of another user's file it points at)."""
    path = Path(os.path.realpath(path))
    if path.is_dir():
        if not has_python(path):
            raise SmolbenchError(
                f"rootfs directory {str(path)!r} has no usr/bin/python3: install python3 in it, "
                f"or use an image with python3 like {DEFAULT_IMAGE!r}"
            )
        os.close(open_root(path, what=PATH_IMAGE))
        signing.check_image(path)  # the real path smol reads (a link may name another folder by now)
        return str(path)
    if path.is_file():
        os.close(open_root(path.parent, what=f"folder of the image {path.name}"))
        why = untrusted(os.lstat(path))
        if why is not None:
            raise SmolbenchError(f"refusing the image {path}: {why}, so another user could alter it; "
                                 f"chmod go-w {path}, or use a file of your own")
        if not tarfile.is_tarfile(path):
            raise SmolbenchError(
                f"image {str(path)!r} is neither a rootfs directory nor a `docker save` archive: "
                "point image at one of those"
            )
        return str(path)
    raise SmolbenchError(
        f"image path {str(path)!r} does not exist: point image at a rootfs directory or a "
        f"`docker save` archive, or use a registry image like {DEFAULT_IMAGE!r}"
    )


def image_python(image: str) -> GuestPython:
    """The Python an image boots with, known before it boots (what its packages are installed for):
    read from a rootfs directory's files, or a ``python:3.N`` image's tag."""
    if is_local(image) and Path(image).is_dir():
        return rootfs_python(image)
    match = _PYTHON_TAG.fullmatch(image)
    if match:
        return version_python(match.group(1), (2, 28))  # the official python images are Debian's: glibc >= 2.28
    raise SmolbenchError(f"can't tell which Python image {image!r} has before it boots, so the Smolfile's "
                         "packages can't be installed for it: use a python:3.N image, a rootfs directory, or "
                         "an image `smolbench image build` made")
