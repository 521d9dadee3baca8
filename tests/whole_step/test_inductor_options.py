"""``inductor_options``: every setting is a real Inductor config entry, and each switch
controls only its own settings. What they do to the generated code is pinned in
``compile_tests/test_inductor_code.py``."""

from __future__ import annotations

import pytest
import torch._inductor.config as inductor_config

from fsdp_traceable import inductor_options
from fsdp_traceable.whole_step.inductor_options import OVERLAP_PASSES, SINK_WAITS_ONLY
from fsdp_traceable.whole_step.region_schedule import CompiledAutogradOverlap


def test_every_option_is_an_inductor_config_entry() -> None:
    options = inductor_options()
    with inductor_config.patch(**options):  # raises on an unknown name
        assert all(getattr(inductor_config, name) == value for name, value in options.items())
    assert options["reorder_for_compute_comm_overlap_passes"] == list(OVERLAP_PASSES)


def test_switches_select_their_own_settings() -> None:
    assert inductor_options(overlap=False, group_copy_kernels=False, exact_casts=False) == {}
    assert inductor_options(overlap=False, exact_casts=False) == {"reorder_for_peak_memory": False}
    assert inductor_options(overlap=False, group_copy_kernels=False) == {
        "emulate_precision_casts": True,
    }
    assert inductor_options(group_copy_kernels=False, exact_casts=False) == {
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": list(OVERLAP_PASSES),
        "post_grad_custom_post_pass": CompiledAutogradOverlap(),
    }
    assert inductor_options(raise_collectives=False, group_copy_kernels=False,
                            exact_casts=False) == {
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": list(SINK_WAITS_ONLY),
    }


@pytest.mark.parametrize("name", ["overlap", "group_copy_kernels", "exact_casts",
                                  "raise_collectives"])
def test_rejects_a_non_bool_switch(name: str) -> None:
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        inductor_options(**{name: "yes"})
