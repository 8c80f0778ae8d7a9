"""Side by side with NeMo AutoModel 0.7.0's own modules: same weights, same row, same anchors."""

import pytest
import torch

from algorithms.blocks import Anchors
from algorithms.metrics import finalize

from conftest import fitted, packed_row, tiny_draft

pytest.importorskip(
    "nemo_automodel.components.speculative.dflash.jetspec_core",
    reason="nemo-automodel==0.7.0 is not installed (.ci/run installs it with --no-deps)",
)

from benchmarks.common.nemo_peers import (
    fixed_nemo_anchors,
    frozen_modules,
    greedy_dataset_row,
    nemo_backbone,
    nemo_row_inputs,
)

pytestmark = pytest.mark.peer

BLOCK = 4


def one_document_row():
    """One unpacked document (NeMo's unpacked path), with anchors that leave room for a whole block and the
    token after it (where NeMo's shifted labels reach)."""
    row = packed_row(doc_lengths=(40,), pad=0)
    positions = torch.tensor([3, 6, 7, 14, 20, 22, 27, 35])  # overlapping blocks too; 35 + 4 < 40
    return row, Anchors(positions, torch.ones_like(positions, dtype=torch.bool))


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in module.named_parameters() if p.grad is not None}


def test_jetspec_matches_nemo():
    """JetSpec: causal in-block attention, forward KL at T = 1 over every predicted slot alike."""
    from nemo_automodel.components.speculative.dflash.jetspec_core import JetSpecTrainerModule

    ours = tiny_draft("jetspec", block_size=BLOCK)
    assert ours.config.causal_blocks and ours.shared.position_weighting == "uniform"
    row, anchors = one_document_row()
    head, embed = frozen_modules(ours)
    fitted(ours, row, anchors)
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
    accepted = finalize(output.counts)["unary_accepted_length"]
    assert accepted > 1.2 and accepted == pytest.approx(float(their.accept_len), rel=1e-5)


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


@pytest.mark.parametrize(("shifted", "pure_prefix"), [(True, 1), (False, 0)])
def test_domino_matches_nemo(shifted, pure_prefix):
    """Domino: base and corrected (final) losses mixed by lambda, the GRU teacher-forced on the dataset's
    tokens; NeMo's `shift_label` is our `sample_from_anchor`, its `pure_draft_prefix_len` our pure prefix.
    Their accepted length is teacher-forced; on a block it equals our walk's, since both stop at the first miss."""
    from nemo_automodel.components.speculative.dflash.domino_core import DominoTrainerModule

    ours = tiny_draft(
        "domino",
        block_size=BLOCK,
        sample_from_anchor=shifted,
        position_weighting="uniform",
        domino_pure_prefix=pure_prefix,
    )
    head, embed = frozen_modules(ours)
    row, anchors = one_document_row()
    row = greedy_dataset_row(row, head)
    ours.set_training_progress(step=3, total_steps=10)  # lambda = 1 - 3 / 5
    assert ours.base_weight == pytest.approx(0.4)
    fitted(ours, row, anchors)  # the delta moves off zero
    domino = dict(projector_type="domino", emb_dim=8, gru_hidden_dim=16, pure_draft_prefix_len=pure_prefix)
    theirs = DominoTrainerModule(
        nemo_backbone(ours, **domino, shift_label=shifted),
        head,
        embed,
        ours.config.mask_token_id,
        BLOCK,
        attention_backend="sdpa",
        num_anchors=8,
        loss_decay_gamma=None,
        shift_label=shifted,
    )
    output = ours.training_forward(row, anchors)
    output.loss.backward()
    with fixed_nemo_anchors(anchors):
        their = theirs(**nemo_row_inputs(row), lambda_base=0.4)
    their.loss.backward()

    mine = finalize(output.counts)
    assert mine["loss"] == pytest.approx(float(their.loss.detach()), rel=1e-4)
    assert mine["final_loss"] == pytest.approx(float(their.final_loss), rel=1e-4)
    assert mine["unary_loss"] == pytest.approx(float(their.base_loss), rel=1e-4)
    their_grads = grads(theirs.draft_model)
    for name, grad in grads(ours).items():
        assert torch.allclose(grad, their_grads[name], rtol=1e-3, atol=1e-6), name
    assert mine["realized_accepted_length"] > 1.2 and mine["unary_accepted_length"] > 1.2
    assert mine["realized_accepted_length"] == pytest.approx(float(their.accept_len), rel=1e-5)
    assert mine["unary_accepted_length"] == pytest.approx(float(their.base_accept_len), rel=1e-5)


def test_dspark_matches_nemo():
    """DSpark: NeMo's own draft and three-term loss (0.1 CE + 0.9 L1 + 1.0 BCE) against ours, blocks predicted
    from the anchor on. NeMo's L1 distance is twice our total variation (our weight 1.8). Without decay both
    weight every supervised slot alike; with decay NeMo divides by the weights' sum, we by the slots' count
    (a constant factor, named in the README)."""
    from benchmarks.common.nemo_peers import nemo_dspark, nemo_dspark_loss

    ours = tiny_draft("dspark", block_size=BLOCK, sample_from_anchor=True, position_weighting="uniform")
    assert ours.shared.loss_weights == {"ce": 0.1, "tv": 1.8}
    head, _ = frozen_modules(ours)
    row, anchors = one_document_row()
    row = greedy_dataset_row(row, head)  # NeMo's CE is against the dataset's token, ours the target's
    fitted(ours, row, anchors)  # the Markov bias and the confidence head move off their start
    assert float(ours.markov_head.markov_w2.weight.abs().max()) > 1e-3
    theirs = nemo_dspark(ours, num_anchors=len(anchors.positions))
    output = ours.training_forward(row, anchors)
    output.loss.backward()
    loss, terms = nemo_dspark_loss(theirs, row, anchors, ours.knobs.confidence_loss_weight)
    loss.backward()

    mine = finalize(output.counts)
    assert mine["loss"] == pytest.approx(float(loss.detach()), rel=1e-4)
    assert mine["final_loss"] == pytest.approx(float(0.1 * terms["ce_loss"] + 0.9 * terms["l1_loss"]), rel=1e-4)
    assert mine["confidence_loss"] == pytest.approx(float(terms["confidence_loss"]), rel=1e-4)
    abs_error = terms["confidence_abs_error_num"] / terms["confidence_diag_den"]
    assert mine["confidence_abs_error"] == pytest.approx(float(abs_error), rel=1e-4)
    their_grads = grads(theirs)
    for name, grad in grads(ours).items():
        assert torch.allclose(grad, their_grads[name], rtol=1e-3, atol=1e-6), name
    assert mine["realized_accepted_length"] > 1.2
