"""The algorithm interface carries the variation: component variants reduce exactly, and nothing above
`algorithms/` branches on an algorithm's name."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from algorithms import ALGORITHMS, AlgorithmConfig, build_draft
from algorithms.metrics import finalize

from conftest import anchors_for, frozen_tensors, tiny_config, tiny_draft, tiny_target

ROOT = Path(__file__).parent.parent
NAMES = "|".join(re.escape(name) for name in ALGORITHMS)
# A comparison with an algorithm name, a membership test on a tuple of names, or an isinstance on a
# draft or knobs class: each is a branch on the algorithm that belongs in the registry instead.
BRANCH = re.compile(
    rf"""(==|!=)\s*f?["']({NAMES})["']|["']({NAMES})["']\s*(==|!=)|\bin\s*[(\[{{]\s*["']({NAMES})["']"""
    r"|isinstance\([^)]*(Draft|Knobs)\b"
)


def test_no_algorithm_branches_outside_algorithms():
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for package in ("harness", "studies", "reports")
        for path in sorted((ROOT / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if BRANCH.search(line)
    ]
    assert not offenders, "branches on an algorithm name outside algorithms/:\n" + "\n".join(offenders)


def test_branch_pattern_catches_the_usual_forms():
    for line in (
        'if algorithm == "dflash2":',
        "if 'dflash' != name:",
        'x = a if name in ("dflash", "dflash2") else b',
        "isinstance(draft, DFlash2Draft)",
        "isinstance(knobs, DFlash2Knobs)",
    ):
        assert BRANCH.search(line), line
    assert not BRANCH.search('DEFAULT_ALGORITHM = "dflash2"')


def test_every_variant_is_registered_with_its_components():
    components = {name: (entry.has_conv, entry.has_selector) for name, entry in ALGORITHMS.items()}
    assert components == {
        "dflash": (False, False),
        "dflash+conv": (True, False),
        "dflash+selector": (False, True),
        "dflash2": (True, True),
        "jetspec": (False, False),
        "domino": (False, False),
        "dspark": (False, False),
    }
    assert ALGORITHMS["dflash2"].tuned_knobs == (
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "candidate_top_k",
        "selector_loss_alpha",
    )


def test_variants_share_every_shared_knob_with_the_base_but_their_defining_ones():
    base = AlgorithmConfig.preset("dflash2", selector_rank=32, conv_group_size=8, block_size=4)
    for name in ALGORITHMS:
        variant = base.with_algorithm(name)
        defining = ALGORITHMS[name].defining_shared
        assert all(getattr(variant.shared, knob) == value for knob, value in defining.items())
        for knob in dataclasses.asdict(base.shared).keys() - defining.keys():
            assert getattr(variant.shared, knob) == getattr(base.shared, knob), (name, knob)
        assert variant.with_algorithm("dflash2").shared == base.shared, f"{name} and back"
        for knob in ("selector_rank", "conv_group_size"):
            if hasattr(variant.knobs, knob):
                assert getattr(variant.knobs, knob) == getattr(base.knobs, knob)


def _variant(name: str, seed: int):
    """A tiny `name` draft with the shared knobs of the tiny DFlash2 config (a component ablation)."""
    torch.manual_seed(seed)
    return build_draft(tiny_config("dflash2").with_algorithm(name), tiny_target(), *frozen_tensors())


def _forward(draft, row, anchors):
    torch.manual_seed(0)
    draft.eval()
    with torch.no_grad():
        return draft.training_forward(row, anchors)


def test_dflash_conv_with_identity_conv_equals_dflash(row):
    dflash, with_conv = _variant("dflash", seed=1), _variant("dflash+conv", seed=2)
    missing, unexpected = with_conv.load_state_dict(dflash.state_dict(), strict=False)
    assert unexpected == [] and missing and all("conv" in name for name in missing)
    anchors = anchors_for(row)
    ours, theirs = _forward(with_conv, row, anchors), _forward(dflash, row, anchors)
    assert torch.allclose(ours.loss, theirs.loss, rtol=1e-6)
    mine, reference = finalize(ours.counts), finalize(theirs.counts)
    assert mine.keys() == reference.keys()
    for name, value in reference.items():
        assert mine[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name


def test_dflash_conv_with_a_trained_conv_differs(row):
    dflash, with_conv = _variant("dflash", seed=1), _variant("dflash+conv", seed=2)
    with_conv.load_state_dict(dflash.state_dict(), strict=False)
    with torch.no_grad():
        for name, param in with_conv.named_parameters():
            if "conv" in name:
                param.add_(torch.randn_like(param) * 0.1)
    anchors = anchors_for(row)
    assert not torch.allclose(_forward(with_conv, row, anchors).loss, _forward(dflash, row, anchors).loss)


def test_dflash_selector_at_init_equals_dflash_unary_path(row):
    dflash, with_selector = _variant("dflash", seed=1), _variant("dflash+selector", seed=2)
    missing, unexpected = with_selector.load_state_dict(dflash.state_dict(), strict=False)
    assert unexpected == [] and all(name.startswith("candidate_selector.") for name in missing)
    anchors = anchors_for(row)
    ours, theirs = (
        finalize(_forward(with_selector, row, anchors).counts),
        finalize(_forward(dflash, row, anchors).counts),
    )
    # The zero successor codebook makes the selector a no-op: its walk is the unary argmax path.
    assert ours["realized_accepted_length"] == pytest.approx(ours["unary_accepted_length"])
    for name in ("unary_loss", "unary_accepted_length", "oracle_accepted_length", "realized_accepted_length"):
        assert ours[name] == pytest.approx(theirs[name], rel=1e-6), name
    assert ours["realized_accepted_length"] == pytest.approx(theirs["realized_accepted_length"])
    # ... and proposals are DFlash's, token for token.
    features, positions = row.features[:12], row.position_ids[:12]
    anchor = int(row.input_ids[12])
    proposals = [d.propose(features, positions, anchor, 12).tokens for d in (with_selector, dflash)]
    assert torch.equal(*proposals)


def test_variants_without_a_peer_format_refuse_export(tmp_path):
    from harness.export import NoPeerFormat, export_checkpoint

    unexportable = [name for name, entry in ALGORITHMS.items() if entry.export_format is None]
    assert unexportable == ["domino"]
    for name in unexportable:
        draft = tiny_draft(name)
        with pytest.raises(NoPeerFormat, match=rf"cannot export a {re.escape(name)} draft: no peer format"):
            export_checkpoint(draft, tmp_path / name, "/models/verifier")
        assert not (tmp_path / name).exists()
