"""`pip install ARGS` for `make setup`, through uv where uv installs, several times faster than pip from empty caches
(docs/benchmarks.md: The test suite). uv does not read pip's configuration, so the settings pip would use here (`pip
config list`: pip.conf files and PIP_* variables) are passed on to it: indexes, find-links, constraints, trusted
hosts, certificate, timeout, proxy. Where uv cannot be installed (a mirror without it), pip itself installs, as
before.

Usage: python scripts/pip_install.py [--compile-bytecode] [pip install arguments]
(run by the virtual environment's python; stdlib only). Without --compile-bytecode, nothing is compiled: each module
is compiled where it is first imported, and its bytecode kept only where PYTHONDONTWRITEBYTECODE is unset.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

# Sections of `pip config list` that apply to `pip install`, weakest first: PIP_* variables (":env:") override files.
SECTIONS = ("global", "install", ":env:")
# pip option -> uv pip option, one flag per value.
FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
# pip option -> the environment variable uv reads for it.
VARIABLES = {"cert": "SSL_CERT_FILE", "timeout": "UV_HTTP_TIMEOUT", "default-timeout": "UV_HTTP_TIMEOUT",
             "proxy": "HTTPS_PROXY"}
COMPILE = "--compile-bytecode"
FALLBACK = "uv could not be installed here, so pip installs (slower)"


def pip_settings(python: str) -> dict[str, str]:
    """pip's effective install settings for `python`, e.g. {"find-links": "/opt/wheels"}."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
    settings: dict[str, dict[str, str]] = {section: {} for section in SECTIONS}
    for line in listed.stdout.splitlines():
        name, _, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if section in settings:
            settings[section][key] = value.strip().strip("'\"")
    return {key: value for section in SECTIONS for key, value in settings[section].items()}


def uv_arguments(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The `uv pip install` flags and environment that carry pip's `settings`."""
    flags, environment = [], {}
    for key, value in settings.items():
        if key in FLAGS:
            flags += [part for entry in value.split() for part in (FLAGS[key], entry)]
        elif key in VARIABLES and value:
            environment[VARIABLES[key]] = value
        elif key == "no-index" and value.lower() in ("1", "true", "yes", "on"):
            flags.append("--no-index")
    if any(key in settings for key in ("extra-index-url", "find-links")):
        flags += ["--index-strategy", "unsafe-best-match"]  # pip takes the best version across all of them
    return flags, environment


def find_uv() -> Path | None:
    """The uv of this environment (its scripts folder), installed there by pip when missing; None where pip cannot
    install it."""
    uv = Path(sysconfig.get_path("scripts")) / "uv"
    if not uv.exists():
        installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "uv"], capture_output=True,
                                   text=True)
        if installed.returncode != 0 or not uv.exists():
            print(f"{FALLBACK}: {installed.stderr.strip()[-300:]}", file=sys.stderr)
            return None
    return uv


def main(arguments: list[str]) -> int:
    """`arguments` are pip's, and `--compile-bytecode` (uv's word; pip compiles unless told `--no-compile`)."""
    compile_bytecode = COMPILE in arguments
    arguments = [argument for argument in arguments if argument != COMPILE]
    uv = find_uv()
    if uv is None:
        bytecode = [] if compile_bytecode else ["--no-compile"]
        return subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *bytecode, *arguments]).returncode
    flags, environment = uv_arguments(pip_settings(sys.executable))
    # The target is the environment's folder (sys.executable may be a stand-in).
    command = [str(uv), "pip", "install", "--quiet", *([COMPILE] if compile_bytecode else []), "--python",
               sys.prefix, *flags, *arguments]
    return subprocess.run(command, env={**os.environ, **environment}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
