"""The GRPO ablations' names: the choices of ``grpo.ablation`` (flows/params.py) and the table that builds each
one's children (flows/ablations.py) name the same ablations, in the same order."""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import ValidationError

from flows.ablations import ABLATIONS
from flows.params import AblationName, GRPOParams


def test_every_ablation_a_run_may_choose_is_built_and_every_built_one_may_be_chosen():
    assert list(get_args(AblationName)) == list(ABLATIONS)


def test_the_ablation_setting_refuses_a_name_with_no_table_entry():
    with pytest.raises(ValidationError, match="ablation"):
        GRPOParams(ablation="grpo_no_such_ablation")
