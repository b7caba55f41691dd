"""The start-up version check: floors read from cram's installed metadata, the DeepSpeed-only accelerate floor, the
once-only note about versions older than the newest tested, and torch's private CPU probes."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
import torch

import cram.versions
from cram.devices import cpu_has_bf16_units
from cram.errors import UserError
from cram.train.precision import resolve_precision
from cram.versions import NEWEST_TESTED, check_installed_versions, warn_about_untested_versions

REPO = Path(__file__).resolve().parents[1]


def installed_versions(**versions: str):
    """importlib.metadata.version's signature over a fixed set of installed packages."""
    def version(package: str) -> str:
        if package not in versions:
            raise importlib.metadata.PackageNotFoundError(package)
        return versions[package]
    return version


@pytest.fixture
def installed_cram(tmp_path, monkeypatch) -> None:
    """An installed `cram` whose metadata carries this pyproject.toml's requirements, found first on sys.path, as pip
    writes it (Requires-Dist lines with the extra as a marker)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = [f"Requires-Dist: {requirement}" for requirement in project["dependencies"]]
    for extra, requirements in project["optional-dependencies"].items():
        lines += [f'Requires-Dist: {requirement}; extra == "{extra}"' for requirement in requirements]
    dist_info = tmp_path / "cram-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: cram\nVersion: 0.1.0\n" + "\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setattr(cram.versions, "_warned_untested", set())


def test_the_installed_metadata_is_what_the_check_reads(installed_cram):
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [line for line in importlib.metadata.requires("cram") if "extra" not in line] == declared
    current = installed_versions(torch="2.13.0", transformers="5.23.0", accelerate="1.15.0", datasets="5.2.0")
    check_installed_versions(uses_deepspeed=False, installed=current)
    old_torch = installed_versions(torch="2.5.1", transformers="5.23.0", accelerate="1.15.0", datasets="5.2.0")
    with pytest.raises(UserError, match=r"^torch 2\.5\.1 is installed but cram needs torch>=2\.6; run pip install "):
        check_installed_versions(uses_deepspeed=False, installed=old_torch)


def test_accelerate_before_1_9_and_deepspeed_before_0_16_are_refused_only_with_deepspeed_and_say_why(installed_cram):
    versions = dict(torch="2.13.0", transformers="5.23.0", accelerate="1.8.1", datasets="5.2.0", deepspeed="0.19.8")
    check_installed_versions(uses_deepspeed=False, installed=installed_versions(**versions))
    with pytest.raises(UserError) as refused:
        check_installed_versions(uses_deepspeed=True, installed=installed_versions(**versions))
    assert str(refused.value).startswith("accelerate 1.8.1 is installed but cram[deepspeed] needs accelerate>=1.9: "
                                         "before accelerate 1.9 it enters DeepSpeed's `no_sync`")
    old_deepspeed = {**versions, "accelerate": "1.9.0", "deepspeed": "0.15.4"}
    with pytest.raises(UserError, match=r"^deepspeed 0\.15\.4 is installed but cram\[deepspeed\] needs "
                                        r"deepspeed>=0\.16\.0: before DeepSpeed 0\.16\.0 its checkpoints do not load"):
        check_installed_versions(uses_deepspeed=True, installed=installed_versions(**old_deepspeed))
    check_installed_versions(uses_deepspeed=True, installed=installed_versions(**{**versions, "accelerate": "1.9.0"}))


def test_a_deepspeed_launch_without_deepspeed_names_the_extra(installed_cram):
    versions = installed_versions(torch="2.13.0", transformers="5.23.0", accelerate="1.15.0", datasets="5.2.0")
    check_installed_versions(uses_deepspeed=False, installed=versions)
    with pytest.raises(UserError, match=r'not installed: pip install "cram\[deepspeed\]"'):
        check_installed_versions(uses_deepspeed=True, installed=versions)


def test_the_launch_configs_deepspeed_flag_decides_which_floors_apply(installed_cram, monkeypatch):
    versions = installed_versions(torch="2.13.0", transformers="5.23.0", accelerate="1.7.0", datasets="5.2.0")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(UserError, match="cram\\[deepspeed\\]"):
        check_installed_versions(installed=versions)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    check_installed_versions(installed=versions)


def test_versions_older_than_the_newest_tested_get_one_note_once(monkeypatch, capsys):
    monkeypatch.setattr(cram.versions, "_warned_untested", set())
    monkeypatch.delenv("RANK", raising=False)
    gpu_image = installed_versions(**{**NEWEST_TESTED, "torch": "2.11.0+cu130", "transformers": "5.17.0"})
    warn_about_untested_versions(gpu_image)
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 2 and notes[0].startswith("note: torch 2.11.0+cu130 is older than 2.13, the newest")
    assert notes[1].startswith(f"note: transformers 5.17.0 is older than {NEWEST_TESTED['transformers']}")
    warn_about_untested_versions(gpu_image)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(cram.versions, "_warned_untested", set())
    monkeypatch.setenv("RANK", "1")  # the other ranks of a launch stay quiet
    warn_about_untested_versions(gpu_image)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    warn_about_untested_versions(installed_versions(**NEWEST_TESTED))
    assert capsys.readouterr().err == ""


def test_a_torch_without_the_private_cpu_probes_still_resolves_a_precision(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    assert cpu_has_bf16_units() is False
    assert resolve_precision("auto", "cpu") == "no"
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert cpu_has_bf16_units() is True
