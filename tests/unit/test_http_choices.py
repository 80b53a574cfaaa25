"""How the HTTP front splits an OpenAI `n` > 1 request into one request per choice (`choice_inputs`),
without a server: ids `{id}-{i}`, seeds `seed + i`, and a 400 naming the field when either would
leave its range. (The fan-out itself runs against real workers in tests/integration/test_router_choices.py.)
"""

from __future__ import annotations

import pytest

from chariot.contracts.errors import InvalidRequestError
from chariot.contracts.proto_codec import MAX_REQUEST_ID_CHARS
from chariot.contracts.sampling_params import SamplingParams
from chariot.router.dataplane import GenerateInput
from chariot.router.http_front import MAX_SEED, choice_inputs


def test_each_choice_gets_a_suffixed_id_and_seed_plus_index() -> None:
    req = GenerateInput("hi", SamplingParams(max_tokens=4, seed=7), "rid", "acme", "tiny")
    subs = choice_inputs(req, 3)
    assert [s.request_id for s in subs] == ["rid-0", "rid-1", "rid-2"]
    assert [s.params.seed for s in subs] == [7, 8, 9]
    assert all(s.params.max_tokens == 4 and (s.prompt, s.tenant, s.model) == ("hi", "acme", "tiny") for s in subs)


def test_without_a_seed_the_choices_sample_independently() -> None:
    req = GenerateInput([1, 2], SamplingParams(temperature=0.7), "rid")
    assert {s.params for s in choice_inputs(req, 2)} == {req.params}


def test_an_id_too_long_for_its_suffix_names_request_id() -> None:
    fits = GenerateInput("hi", SamplingParams(), "r" * (MAX_REQUEST_ID_CHARS - 3))
    assert choice_inputs(fits, 100)[-1].request_id.endswith("-99")
    with pytest.raises(InvalidRequestError) as err:
        choice_inputs(fits, 101)  # "-100" no longer fits
    assert err.value.field == "request_id" and str(MAX_REQUEST_ID_CHARS - 4) in err.value.message


def test_a_seed_that_would_overflow_names_seed() -> None:
    assert choice_inputs(GenerateInput("hi", SamplingParams(seed=MAX_SEED - 1), "r"), 2)[1].params.seed == MAX_SEED
    with pytest.raises(InvalidRequestError) as err:
        choice_inputs(GenerateInput("hi", SamplingParams(seed=MAX_SEED - 1), "r"), 3)
    assert err.value.field == "seed" and "n=3" in err.value.message
