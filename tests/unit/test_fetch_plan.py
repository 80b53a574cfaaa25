"""Which weight files a pod fetches of an `hf://` model (`chariot.worker.model.fetch`), as pure functions.

A stage fetches the shards holding the tensors it loads — by the loader's own rule
(`chariot.contracts.parallelism.stage_weight_names`: its layers, the embeddings on the first stage, the
final norm and LM head on the last, the embeddings again where the LM head is tied to them) and the
worker's own split (`split_layers`) — a router none, a single-file model its one file. The index here
is a small fake: 4 layers over 3 shards, layer 1 straddling the first two.
"""

from __future__ import annotations

from typing import Any

import pytest

from chariot.cli.main import parser
from chariot.contracts.errors import ChariotError, ModelLoadError
from chariot.contracts.parallelism import split_layers, stage_weight_names
from chariot.operator import render
from chariot.operator.render import Owner
from chariot.operator.spec import parse_spec
from chariot.worker.cli import fetch_part
from chariot.worker.model.fetch import SINGLE_FILE, StagePart, stage_weight_files, weight_files

LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
         "post_attention_layernorm.weight")
S1, S2, S3 = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))


def fake_index(tied: bool = False) -> dict[str, str]:
    """embeddings + layer 0 + half of layer 1 in S1, the rest of layer 1 + layer 2 in S2, layer 3 + the
    final norm (+ LM head, untied) in S3."""
    wm = {"model.embed_tokens.weight": S1}
    for i, shard in ((0, S1), (2, S2), (3, S3)):
        wm |= {f"model.layers.{i}.{n}": shard for n in LAYER}
    wm |= {f"model.layers.1.{n}": (S1 if k < 4 else S2) for k, n in enumerate(LAYER)}
    wm["model.norm.weight"] = S3
    if not tied:
        wm["lm_head.weight"] = S3
    return wm


CONFIG = {"num_hidden_layers": 4, "tie_word_embeddings": False}


@pytest.mark.parametrize(("stages", "stage", "shards"), [
    (1, 0, [S1, S2, S3]),
    (2, 0, [S1, S2]),   # embeddings, layers 0-1 (layer 1 straddles S1 and S2)
    (2, 1, [S2, S3]),   # layers 2-3, norm, LM head
    (4, 0, [S1]),
    (4, 1, [S1, S2]),
    (4, 2, [S2]),
    (4, 3, [S3]),
])
def test_a_stage_fetches_exactly_the_shards_of_its_tensors(stages: int, stage: int, shards: list[str]) -> None:
    assert stage_weight_files(fake_index(), 4, False, StagePart(stage, stages)) == shards
    assert weight_files(CONFIG, {"weight_map": fake_index()}, [], StagePart(stage, stages)) == shards


@pytest.mark.parametrize(("stages", "stage", "shards"), [(2, 1, [S1, S2, S3]), (4, 3, [S1, S3]), (4, 0, [S1])])
def test_a_tied_lm_head_makes_the_last_stage_fetch_the_embeddings(stages: int, stage: int,
                                                                   shards: list[str]) -> None:
    assert stage_weight_files(fake_index(tied=True), 4, True, StagePart(stage, stages)) == shards


def test_the_split_and_the_tensors_are_the_workers() -> None:
    """The fetch asks the same functions the worker's loader does, with an explicit split too."""
    wm = fake_index()
    for stage, (start, end) in enumerate(split_layers(4, 2, [3, 1])):
        names = stage_weight_names(start, end, 4, False,
                                   lambda i: [n for n in wm if n.startswith(f"model.layers.{i}.")])
        expected = sorted({wm[n] for n in names})
        assert stage_weight_files(wm, 4, False, StagePart(stage, 2, (3, 1))) == expected
    assert stage_weight_files(wm, 4, False, StagePart(0, 2, (3, 1))) == [S1, S2]
    assert stage_weight_files(wm, 4, False, StagePart(1, 2, (3, 1))) == [S3]


def test_a_router_fetches_no_weights_and_a_single_file_model_its_one_file() -> None:
    assert weight_files(CONFIG, {"weight_map": fake_index()}, [S1, S2, S3], StagePart(0, 2), weights=False) == []
    assert weight_files(CONFIG, None, [SINGLE_FILE, "config.json"], StagePart(1, 2)) == [SINGLE_FILE]
    assert weight_files(CONFIG, None, [SINGLE_FILE], None) == [SINGLE_FILE]
    assert weight_files(CONFIG, {"weight_map": fake_index()}, [], None) == [S1, S2, S3]  # no stage: every shard


@pytest.mark.parametrize(("config", "index", "listing", "part", "message"), [
    (CONFIG, None, ["config.json"], None, "no safetensors weights"),
    (CONFIG, {"weight_map": {}}, [], StagePart(0, 2), "weight_map"),
    ({"num_hidden_layers": "4"}, {"weight_map": fake_index()}, [], StagePart(0, 2), "num_hidden_layers"),
    (CONFIG, {"weight_map": {k: v for k, v in fake_index().items() if k != "lm_head.weight"}}, [], StagePart(1, 2),
     "missing tensor 'lm_head.weight'"),
    (CONFIG, {"weight_map": {k: v for k, v in fake_index().items() if ".layers.2." not in k}}, [], StagePart(1, 2),
     "no tensors of layer 2"),
    ({"num_hidden_layers": 4}, {"weight_map": fake_index()}, [], StagePart(0, 5), "pipeline_stages"),
])
def test_what_cannot_be_fetched_is_a_clear_error(config: dict[str, Any], index: dict[str, Any] | None,
                                                 listing: list[str], part: StagePart | None, message: str) -> None:
    with pytest.raises(ChariotError, match=message):
        weight_files(config, index, listing, part)


def test_a_stage_outside_the_pipeline_is_refused() -> None:
    with pytest.raises(ModelLoadError, match=r"stage 2 of 2"):
        StagePart(2, 2)


OWNER = Owner(name="llama", namespace="prod", uid="u")


def test_the_rendered_init_commands_select_each_stages_shards_and_none_for_the_router() -> None:
    """The operator's init containers, parsed by the real `chariot` CLI, name exactly these selections."""
    spec = parse_spec({"model": {"uri": "hf://org/m"}, "parallelism": {"pipeline": 2}}, OWNER.name)
    commands = [render.stage_pod(OWNER, spec, "img", 0, s)["spec"]["initContainers"][0]["command"] for s in (0, 1)]
    commands.append(render.router_pod_spec(OWNER, spec, "img")["initContainers"][0]["command"])
    selected = []
    for command in commands:
        assert command[:2] == ["chariot", "fetch-model"]
        args = parser().parse_args(command[1:])
        selected.append(weight_files(CONFIG, {"weight_map": fake_index()}, [], fetch_part(args), args.weights))
    assert selected == [[S1, S2], [S2, S3], []]


@pytest.mark.parametrize(("flags", "message"), [(["--stage", "1"], "go together"),
                                                (["--stage", "2", "--stages", "2"], r"\[0, 2\)"),
                                                (["--layer-split", "1,1"], "only applies"),
                                                (["--stage", "0", "--stages", "2", "--no-weights"], "no --stage")])
def test_contradictory_fetch_flags_are_refused(flags: list[str], message: str) -> None:
    args = parser().parse_args(["fetch-model", "hf://org/m", "/tmp/m", *flags])
    with pytest.raises(ChariotError, match=message):
        fetch_part(args)
