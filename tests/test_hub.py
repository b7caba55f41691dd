"""cram.hub against a local stand-in for the Hub's HTTP API, through the real huggingface_hub client; no network."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from hub_standin import HubStandIn, closed_port
from huggingface_hub import ModelCard, constants
from launching import run

from cram.data.tokenizer import train_wordpiece
from cram.errors import UserError, run_cli
from cram.hub import HubUnreachable, main, push_checkpoint
from cram.model_card import ModelCardFacts, add_eval_results_to_card, render_model_card, write_model_card
from cram.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cram.train.checkpoint import save_checkpoint

REPO = Path(__file__).resolve().parents[1]
TOKEN = "hf_standinSECRETtoken0123456789abcdef"
REPO_ID = "cram-org/crammed-bert-tiny"
SENTENCES = ["The cat sat on the mat.", "A dog ran far away!", "Is this the end of the line?"] * 20


@pytest.fixture(autouse=True)
def online(monkeypatch):
    """These tests talk only to 127.0.0.1, so an HF_HUB_OFFLINE=1 in the environment must not stop them."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory) -> Path:
    """A real (tiny) checkpoint as the recipe writes it, built once; tests copy it before changing anything."""
    tokenizer = train_wordpiece(SENTENCES, vocab_size=120, lowercase=True, model_max_length=32)
    config = CrammedBertConfig.from_preset("tiny", vocab_size=len(tokenizer), max_position_embeddings=32)
    directory = save_checkpoint(
        CrammedBertForMaskedLM(config), tokenizer, {"training": {"preset": "tiny"}},
        tmp_path_factory.mktemp("run") / "final",
    )
    (directory / "eval_results.json").write_text(json.dumps({"sst2": 0.81, "cola": 0.25}) + "\n")
    return directory


@pytest.fixture
def checkpoint(saved_checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(saved_checkpoint, tmp_path / "final"))


@pytest.fixture
def hub():
    with HubStandIn(token=TOKEN) as stand_in:
        yield stand_in
    assert stand_in.unknown_routes == [], "huggingface_hub called a route the stand-in does not know"


def facts(**changes) -> ModelCardFacts:
    values = dict(
        repo_id=REPO_ID, architecture="crammed BERT, 2 layers × 128, 2 heads", num_parameters=1_234_567,
        data="the embedded English corpus", budget="1000 steps", hardware="2 × CPU processes",
        tokens_seen=8_388_608, optimizer_steps=1000, final_loss=2.71828, eval_results={"sst2": 0.81, "cola": 0.25},
    )
    return ModelCardFacts(**{**values, **changes})


def folder_contents(directory: Path) -> dict[str, bytes]:
    files = sorted(path for path in directory.rglob("*") if path.is_file())
    return {path.relative_to(directory).as_posix(): path.read_bytes() for path in files}


def run_hub_cli(*arguments: str) -> int:
    """`python -m cram.hub ARGUMENTS` in this process: the exit status run_cli gives."""
    try:
        run_cli(lambda: main([*arguments]))
    except SystemExit as done:
        return int(done.code)
    return 0


def test_push_uploads_every_file_byte_identical_to_a_private_repo_with_its_card(hub, checkpoint):
    write_model_card(checkpoint, facts())
    url = push_checkpoint(checkpoint, REPO_ID, token=TOKEN, endpoint=hub.endpoint)

    uploaded = hub.files(REPO_ID)
    assert uploaded == folder_contents(checkpoint)
    assert {"config.json", "model.safetensors", "tokenizer.json", "cram_options.json", "eval_results.json",
            "crammed_bert.py", "README.md"} <= set(uploaded)
    assert hub.repos[REPO_ID].private
    assert url.startswith(f"{hub.endpoint}/{REPO_ID}/commit/")
    # The card's load snippet works where cram is not installed because the modelling file travels along.
    assert json.loads(uploaded["config.json"])["auto_map"]["AutoModelForMaskedLM"].startswith("crammed_bert.")
    card = uploaded["README.md"].decode()
    assert REPO_ID in card
    assert "8,388,608" in card and "2.7183" in card
    assert f'AutoModelForMaskedLM.from_pretrained("{REPO_ID}", trust_remote_code=True)' in card
    assert f'AutoTokenizer.from_pretrained("{REPO_ID}")' in card


def test_public_push_makes_a_public_repo(hub, checkpoint):
    push_checkpoint(checkpoint, REPO_ID, private=False, token=TOKEN, endpoint=hub.endpoint)
    assert not hub.repos[REPO_ID].private


def test_a_revision_lands_on_its_own_branch_and_main_is_untouched(hub, checkpoint):
    push_checkpoint(checkpoint, REPO_ID, token=TOKEN, endpoint=hub.endpoint)
    (checkpoint / "eval_results.json").write_text(json.dumps({"sst2": 0.9}) + "\n")
    push_checkpoint(checkpoint, REPO_ID, revision="budget-24h", token=TOKEN, endpoint=hub.endpoint)
    # Pushing to an existing branch again is fine too (exist_ok on repo and branch).
    push_checkpoint(checkpoint, REPO_ID, revision="budget-24h", token=TOKEN, endpoint=hub.endpoint)

    assert hub.files(REPO_ID, "budget-24h") == folder_contents(checkpoint)
    assert json.loads(hub.files(REPO_ID, "main")["eval_results.json"]) == {"sst2": 0.81, "cola": 0.25}


def test_the_token_goes_only_in_the_authorization_header_and_is_never_written_or_printed(
    hub, checkpoint, tmp_path, monkeypatch, capfd
):
    write_model_card(checkpoint, facts())
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)  # what HF_ENDPOINT sets when huggingface_hub loads
    assert run_hub_cli(str(checkpoint), REPO_ID, "--public", "--revision", "v1") == 0

    output = capfd.readouterr()
    assert f"to {hub.endpoint}/{REPO_ID}/commit/" in output.out
    assert hub.files(REPO_ID, "v1") == folder_contents(checkpoint)
    assert not hub.repos[REPO_ID].private
    assert TOKEN not in output.out + output.err
    assert all(request.headers.get("authorization") == f"Bearer {TOKEN}" for request in hub.requests)
    for request in hub.requests:
        assert TOKEN.encode() not in request.body
        assert TOKEN not in request.path
        assert all(TOKEN not in value for name, value in request.headers.items() if name != "authorization")
    for path in tmp_path.rglob("*"):
        assert not path.is_file() or TOKEN.encode() not in path.read_bytes(), path


@pytest.mark.launch
def test_an_unreachable_hub_exits_with_one_line_saying_how_to_push_later(checkpoint, tmp_path):
    before = folder_contents(checkpoint)
    environment = {
        **os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "HF_TOKEN": TOKEN,
        "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "0",
    }
    completed = run([sys.executable, "-m", "cram.hub", str(checkpoint), REPO_ID, "--revision", "v1"], cwd=REPO,
                    env=environment)

    assert completed.returncode != 0
    assert completed.stdout == ""
    lines = completed.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: could not reach the Hugging Face Hub at"), completed.stderr
    assert f"the checkpoint is saved at {checkpoint}" in lines[0]
    assert f"push it later with `python -m cram.hub {checkpoint} {REPO_ID} --revision v1`" in lines[0]
    assert TOKEN not in completed.stderr
    assert folder_contents(checkpoint) == before


@pytest.mark.parametrize("repo_id", ["crammed-bert", "org/name/extra", "org/", "/name", "org/na me", "org/a..b"])
def test_a_bad_repo_id_is_one_sentence_a_nonzero_exit_and_no_request(hub, checkpoint, repo_id, capfd):
    with pytest.raises(UserError, match="ORG/NAME"):
        push_checkpoint(checkpoint, repo_id, token=TOKEN, endpoint=hub.endpoint)
    assert run_hub_cli(str(checkpoint), repo_id) != 0

    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the Hub repository") and "e.g. my-org/" in lines[0]
    assert hub.requests == []


def test_a_missing_folder_or_one_without_config_is_refused(hub, checkpoint, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        push_checkpoint(tmp_path / "nowhere", REPO_ID, token=TOKEN, endpoint=hub.endpoint)
    (checkpoint / "config.json").unlink()
    with pytest.raises(UserError, match="holds no config.json"):
        push_checkpoint(checkpoint, REPO_ID, token=TOKEN, endpoint=hub.endpoint)
    assert hub.requests == []


def test_refused_credentials_name_the_login_fix_and_not_the_token(hub, checkpoint):
    wrong_token = "hf_wrongTOKENabcdefghijklmnop"
    with pytest.raises(UserError) as refused:
        push_checkpoint(checkpoint, REPO_ID, token=wrong_token, endpoint=hub.endpoint)
    message = str(refused.value)
    assert "HTTP 401" in message and "`hf auth login`" in message and "HF_TOKEN" in message
    assert f"the checkpoint is saved at {checkpoint}" in message
    assert wrong_token not in message and "\n" not in message
    assert REPO_ID not in hub.repos


def test_another_refusal_carries_the_hubs_reason(hub, checkpoint):
    hub.commit_refusal = (400, "model.safetensors is over the file size limit")
    with pytest.raises(UserError, match="HTTP 400: model.safetensors is over the file size limit") as refused:
        push_checkpoint(checkpoint, REPO_ID, token=TOKEN, endpoint=hub.endpoint)
    assert not isinstance(refused.value, HubUnreachable) and "\n" not in str(refused.value)
    assert hub.files(REPO_ID) == {}


def test_offline_mode_sends_nothing_and_says_so(hub, checkpoint, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubUnreachable, match="HF_HUB_OFFLINE is set.*unset HF_HUB_OFFLINE and push it later"):
        push_checkpoint(checkpoint, REPO_ID, token=TOKEN, endpoint=hub.endpoint)
    assert hub.requests == []


def test_the_card_has_hub_metadata_and_an_evaluation_table_only_with_results():
    card = render_model_card(facts())
    _, front_matter, body = card.split("---\n", 2)
    metadata = yaml.safe_load(front_matter)
    assert metadata["library_name"] == "transformers" and metadata["license"] == "apache-2.0"
    assert metadata["pipeline_tag"] == "fill-mask" and "cram" in metadata["tags"]
    for line in ("- Architecture: crammed BERT, 2 layers × 128, 2 heads", "- Parameters: 1,234,567 (1.2 M)",
                 "- Data: the embedded English corpus", "- Budget: 1000 steps", "- Hardware: 2 × CPU processes",
                 "- Optimizer steps: 1,000", "| sst2 | 0.81 |", "| cola | 0.25 |"):
        assert line in body
    assert "## Evaluation" not in render_model_card(facts(eval_results=None))


def test_writing_the_card_replaces_it_whole_and_leaves_no_temporary_file(checkpoint):
    before = set(folder_contents(checkpoint))
    (checkpoint / "README.md").write_text("an old card\n")
    with pytest.raises(TypeError):
        write_model_card(checkpoint, facts(num_parameters=None))  # fails half-way through rendering
    assert (checkpoint / "README.md").read_text() == "an old card\n"
    assert set(folder_contents(checkpoint)) == before | {"README.md"}

    path = write_model_card(checkpoint, facts())
    assert path == checkpoint / "README.md"
    assert path.read_text(encoding="utf-8") == render_model_card(facts())
    assert set(folder_contents(checkpoint)) == before | {"README.md"}


def test_the_cards_glue_results_read_back_as_model_index_by_huggingface_hubs_parser(tmp_path):
    results = {"mnli_matched": 0.80, "cola": 0.25, "stsb": 0.85, "glue_average": 0.7}
    card = ModelCard(render_model_card(facts(eval_results=results)))
    parsed = {(entry.dataset_config, entry.dataset_split, entry.metric_type): entry.metric_value
              for entry in card.data.eval_results}
    assert parsed == {
        ("mnli", "validation_matched", "accuracy"): 0.80, ("cola", "validation", "matthews_correlation"): 0.25,
        ("stsb", "validation", "pearsonr"): 0.85, (None, "validation", "average"): 0.7,
    }
    assert {entry.dataset_type for entry in card.data.eval_results} == {"nyu-mll/glue"}
    assert card.data.to_dict()["model-index"][0]["name"] == REPO_ID.split("/")[-1]
    assert ModelCard(render_model_card(facts(eval_results=None))).data.eval_results is None


def test_glue_results_added_to_a_written_card_replace_earlier_ones_and_keep_the_rest(checkpoint):
    write_model_card(checkpoint, facts(eval_results={"sst2": 0.5}))
    add_eval_results_to_card(checkpoint, {"sst2": 0.81, "rte": 0.6})
    card = ModelCard.load(checkpoint / "README.md")
    assert {(entry.dataset_config, entry.metric_value) for entry in card.data.eval_results} == {
        ("sst2", 0.81), ("rte", 0.6)}
    assert card.data.license == "apache-2.0" and "- Optimizer steps: 1,000" in card.text
    assert not list(checkpoint.glob(".README.md.*"))
    (checkpoint / "README.md").unlink()
    assert add_eval_results_to_card(checkpoint, {"sst2": 0.81}) is None

