"""scripts/pip_install.py, `make setup`'s installer: uv, given the settings pip would use here (pip.conf files and PIP_*
variables), which uv does not read itself. A package that lies only in a local folder pip is told to look in is found,
with every index turned off, whichever way pip was told."""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import zipfile
from pathlib import Path

import launching
import pytest

sys.path.insert(0, str(launching.REPO / "scripts"))
from pip_install import FALLBACK  # noqa: E402

pytestmark = pytest.mark.launch

NAME, VERSION = "cram_standin_wheel", "1.0"


def wheel(folder: Path) -> Path:
    """A pure-Python wheel as the wheel format (PEP 427) lays it out: a module, and METADATA, WHEEL and a RECORD of
    every file's hash in its .dist-info."""
    info = f"{NAME}-{VERSION}.dist-info"
    files = {f"{NAME}.py": b"VALUE = 1\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()}"
                     f",{len(data)}\n" for name, data in files.items()) + f"{info}/RECORD,,\n"
    path = folder / f"{NAME}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in {**files, f"{info}/RECORD": record.encode()}.items():
            archive.writestr(name, data)
    return path


def install(env: dict[str, str]) -> launching.subprocess.CompletedProcess:
    return launching.run([sys.executable, "scripts/pip_install.py", "--dry-run", f"{NAME}=={VERSION}"],
                         cwd=launching.REPO, env=env, timeout=120)


@pytest.mark.parametrize("told_by", ["pip.conf", "PIP_ variables"])
def test_uv_installs_from_where_pip_was_told_to_look(tmp_path, told_by):
    links = tmp_path / "links"
    links.mkdir()
    wheel(links)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PIP_", "UV_"))}
    env["UV_CACHE_DIR"] = str(tmp_path / "uv-cache")
    if told_by == "pip.conf":
        conf = tmp_path / "pip.conf"
        conf.write_text(f"[global]\nno-index = true\nfind-links = {links}\n")
        env["PIP_CONFIG_FILE"] = str(conf)
    else:
        env |= {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links)}
    completed = install(env)
    assert completed.returncode == 0 and FALLBACK not in completed.stderr, completed.stderr


def test_without_pips_settings_uv_finds_no_such_package(tmp_path):
    """The premise: the package is nowhere uv looks by itself, so the test above passes only through pip's settings."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PIP_", "UV_"))}
    env |= {"UV_CACHE_DIR": str(tmp_path / "uv-cache"), "PIP_CONFIG_FILE": os.devnull, "UV_OFFLINE": "1"}
    completed = install(env)
    assert completed.returncode != 0 and NAME.replace("_", "-") in completed.stderr.replace("_", "-"), \
        completed.stderr
