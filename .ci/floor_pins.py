"""Print `name==floor` for every direct dependency of cram (and of the extras named) in pyproject.toml.

    python3 .ci/floor_pins.py deepspeed glue dev

A package floored twice (accelerate: by the base install and by the deepspeed extra) gets its higher floor.
Standard library only: it runs before any environment exists.
"""

import re
import sys
import tomllib
from pathlib import Path

FLOOR = re.compile(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)$")


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def floor_pins(pyproject: Path, extras: list[str]) -> dict[str, str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    pins: dict[str, str] = {}
    for requirement in requirements:
        requirement = requirement.split(";")[0].strip()
        if requirement.startswith(project["name"] + "["):
            continue  # an extra naming other extras (`all`)
        match = FLOOR.match(requirement)
        if match is None:
            sys.exit(f"{requirement!r} in {pyproject} has no floor: give it one (name>=version).")
        name, floor = match.group(1).lower().replace("_", "-"), match.group(2)
        if name not in pins or version_key(floor) > version_key(pins[name]):
            pins[name] = floor
    return pins


if __name__ == "__main__":
    for name, floor in floor_pins(Path(__file__).resolve().parent.parent / "pyproject.toml", sys.argv[1:]).items():
        print(f"{name}=={floor}")
