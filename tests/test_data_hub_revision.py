"""A Hub dataset's commit is part of the cache key: after the dataset is updated, the same options name another
prepared set instead of serving the stale one (a local stand-in answers the Hub's dataset API)."""

from __future__ import annotations

import pytest
from hub_standin import REPO, HubStandIn

from cram.data import DataOptions, prepared_path
from cram.data.sources import resolve_sources


class DatasetHub(HubStandIn):
    """The stand-in plus the dataset-info route, answering each dataset's current commit from `dataset_commits`."""

    def __init__(self) -> None:
        super().__init__()
        self.dataset_commits: dict[str, str] = {}

    def routes(self) -> list:
        route = ("GET", rf"/api/datasets/{REPO}(?:/revision/(?P<revision>[^/]+))?", self.dataset_info)
        return [*super().routes(), route]

    def dataset_info(self, body: bytes, repo: str, revision: str | None = None) -> tuple:
        if repo not in self.dataset_commits:
            return self.repo_not_found(repo)
        return 200, {"id": repo, "sha": self.dataset_commits[repo], "private": False}


@pytest.fixture
def hub(monkeypatch):
    with DatasetHub() as stand_in:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", stand_in.endpoint)
        yield stand_in


def test_an_updated_hub_dataset_gets_a_new_cache_key_and_is_read_at_its_commit(hub, tmp_path):
    options = DataOptions(sources=["lab/corpus"])
    hub.dataset_commits["lab/corpus"] = "a" * 40
    before = prepared_path(options, tmp_path)
    assert prepared_path(options, tmp_path) == before  # unchanged dataset: the same cached set
    assert resolve_sources(["lab/corpus"], tmp_path)[0].hub_revision == "a" * 40
    hub.dataset_commits["lab/corpus"] = "b" * 40
    assert prepared_path(options, tmp_path) != before
    assert not [route for route in hub.unknown_routes if "/datasets/" in route]
