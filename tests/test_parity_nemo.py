"""Side by side with NeMo AutoModel 0.7.0's own modules: same weights, same row, same anchors."""

import pytest
import torch

from algorithms.metrics import finalize

from conftest import anchors_for, packed_row, tiny_draft

pytest.importorskip(
    "nemo_automodel.components.speculative.dflash.jetspec_core",
    reason="nemo-automodel==0.7.0 is not installed (.ci/run installs it with --no-deps)",
)

from benchmarks.nemo_peers import fixed_nemo_anchors, frozen_modules, nemo_backbone, nemo_row_inputs

pytestmark = pytest.mark.peer

BLOCK = 4


def one_document_row():
    """One unpacked document (NeMo's unpacked path), with anchors that leave room for a whole block."""
    row = packed_row(doc_lengths=(40,), pad=0)
    anchors = anchors_for(row, block_size=BLOCK, max_anchors=8)
    assert int(anchors.positions.max()) <= row.length - BLOCK and bool(anchors.valid.all())
    return row, anchors


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in module.named_parameters() if p.grad is not None}


def test_jetspec_matches_nemo():
    """JetSpec: causal in-block attention, forward KL at T = 1 over every predicted slot alike."""
    from nemo_automodel.components.speculative.dflash.jetspec_core import JetSpecTrainerModule

    ours = tiny_draft("jetspec", block_size=BLOCK)
    assert ours.config.causal_blocks and ours.shared.position_weighting == "uniform"
    row, anchors = one_document_row()
    head, embed = frozen_modules(ours)
    theirs = JetSpecTrainerModule(
        nemo_backbone(ours), head, embed, ours.config.mask_token_id, BLOCK, attention_backend="sdpa", num_anchors=8
    )
    output = ours.training_forward(row, anchors)
    output.loss.backward()
    with fixed_nemo_anchors(anchors):
        their = theirs(**nemo_row_inputs(row, head))
    their.loss.backward()

    assert float(output.loss.detach()) == pytest.approx(float(their.loss.detach()), rel=1e-4)
    their_grads = grads(theirs.draft_model)
    for name, grad in grads(ours).items():
        assert torch.allclose(grad, their_grads[name], rtol=1e-4, atol=1e-6), name
    # NeMo's tau proxy is greedy agreement with the target's argmax: our unary accepted length
    assert finalize(output.counts)["unary_accepted_length"] == pytest.approx(float(their.accept_len), rel=1e-5)


def test_jetspec_is_dflash_with_its_defining_knobs_and_exports_as_causal():
    """The same draft class and weights as DFlash; only attention, loss and weighting differ, and the export
    carries `dflash_config.causal`, which vLLM and Z Lab read."""
    from harness.export import checkpoint_config
    from harness.presets import preset_run

    jetspec, dflash = tiny_draft("jetspec"), tiny_draft("dflash")
    assert type(jetspec) is type(dflash)
    assert jetspec.state_dict().keys() == dflash.state_dict().keys()
    small = preset_run("small", "jetspec", "smollm2-135m").algorithm.shared
    assert (small.block_attention, small.position_weighting, small.loss) == ("causal", "uniform", "kl_div")
    assert checkpoint_config(jetspec, "target")["dflash_config"]["causal"] is True
    assert "causal" not in checkpoint_config(dflash, "target")["dflash_config"]
